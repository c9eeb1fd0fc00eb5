"""Issue 39: the front door's server-sent events (flame_llm/serving/http_stream.py) leave in one write per batch of
ready events, with no asyncio.wait_for per event; the events themselves are unchanged (each choice's tokens in
order, its finish, [DONE]). Served for real on 127.0.0.1 over a fake backend whose choices get a token each step,
all in one loop turn, as one engine step's tokens reach them. The bounded queue and the drain deadline are
tests/test_http_limits.py's (still run)."""
import asyncio
import json
import sys
import urllib.request

from aiohttp import web

from flame_llm.protocol.types import Result
from flame_llm.serving import http_stream
from flame_llm.serving.http_app import HttpConfig
from tests.test_http_limits import door  # noqa: F401 - the module's real engine backend (its limits)
from tests.test_http_server import _serve

STEPS = 20


class StepBackend:
    """A fake backend (named so): each choice's stream yields one token a step, every choice in the same loop turn
    (a shared event set once a step), then its Result."""

    def __init__(self, backend) -> None:
        self.limits, self.tokenizer, self.model_names = backend.limits, None, backend.model_names
        self.tick: asyncio.Event | None = None
        self.driver: asyncio.Task | None = None

    async def _drive(self) -> None:
        for _ in range(STEPS * 50):
            await asyncio.sleep(0.003)
            self.tick.set()
            self.tick.clear()

    async def stream(self, prompt, sp, user: str = ""):
        from flame_llm.serving.pending import StreamChunk

        if self.driver is None:
            self.tick = asyncio.Event()
            self.driver = asyncio.ensure_future(self._drive())
        for i in range(sp.max_tokens):
            await self.tick.wait()
            yield StreamChunk([i])
        yield StreamChunk([], Result(None, output_token_ids=list(range(sp.max_tokens)), finish_reason="length",
                                     prompt_tokens=len(prompt)))


def test_ready_events_leave_in_one_write_without_a_wait_for_each(door, monkeypatch):  # noqa: F811
    writes, wait_fors = [], []
    orig_write, orig_wait_for = web.StreamResponse.write, asyncio.wait_for

    async def write(self, data):
        writes.append(len(data))
        return await orig_write(self, data)

    def wait_for(*a, **kw):
        if sys._getframe(1).f_globals.get("__name__") == http_stream.__name__:
            wait_fors.append(1)
        return orig_wait_for(*a, **kw)

    monkeypatch.setattr(web.StreamResponse, "write", write)
    monkeypatch.setattr(asyncio, "wait_for", wait_for)
    url, close = _serve(StepBackend(door[2]), HttpConfig(port=0))
    try:
        body = {"model": door[2].model_names[0], "prompt": [5, 6, 7], "max_tokens": STEPS, "n": 4, "stream": True,
                "stream_options": {"include_usage": True}}
        req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            raw = r.read()
    finally:
        close()
    lines = [ln[len(b"data: "):] for ln in raw.split(b"\n\n") if ln]
    assert lines[-1] == b"[DONE]"
    events = [json.loads(x) for x in lines[:-1]]
    tokens: dict[int, list[int]] = {k: [] for k in range(4)}
    finish = {}
    for e in events[:-1]:
        (c,) = e["choices"]
        tokens[c["index"]] += c["token_ids"]
        if c["finish_reason"]:
            finish[c["index"]] = c["finish_reason"]
    assert tokens == {k: list(range(STEPS)) for k in range(4)} and finish == dict.fromkeys(range(4), "length")
    assert events[-1]["usage"]["completion_tokens"] == 4 * STEPS
    n_events = len(lines)  # 4 x STEPS token events, 4 finishes, the usage, [DONE]
    assert n_events == 4 * STEPS + 6
    assert not wait_fors  # before: one asyncio.wait_for (a task) per event
    # before: a write per event (86); now about a write per step
    assert len(writes) <= STEPS + 6, (len(writes), n_events)
    assert sum(writes) == len(raw)
