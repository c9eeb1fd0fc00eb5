"""The front door's bounds on what one request may cost it (issue 37): a text prompt longer than could fit in
max_model_len refused before it is tokenized, tokenizing off the event loop, the body limit, and who a request
is (its key, compared in constant time; keys from a file or the environment; /health without a key). serve-http
over the embedded default (with its tokenizer), served for real on 127.0.0.1 (bounded in count and time)."""
import json
import resource
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest

from flame_llm import AsyncEngine
from flame_llm.serving import http_auth
from flame_llm.serving.http_app import HttpConfig
from flame_llm.serving.http_server import EngineBackend
from flame_llm.serving.openai_prompts import longest_token_chars, max_text_chars
from tests.test_http_server import _serve

KEYS = ("alpha-key-0123", "beta-key-4567")


@pytest.fixture(scope="module")
def door(tmp_path_factory):
    from flame_llm.models.tiny import ensure_tiny_default

    model = ensure_tiny_default(str(tmp_path_factory.mktemp("default") / "tiny-llama"))
    engine = AsyncEngine.from_args(model, block_size=16, max_model_len=512, max_num_batched_tokens=512,
                                   cpu_kvcache_gib=0.01)
    backend = EngineBackend(engine, "cpu-0")
    url, close = _serve(backend, HttpConfig(port=0))
    key_file = tmp_path_factory.mktemp("keys") / "keys"
    key_file.write_text(f"# the door's keys\n{KEYS[0]}\n\n{KEYS[1]}\n")
    keyed, close_keyed = _serve(backend, HttpConfig(port=0, api_key_file=str(key_file)))
    yield url, keyed, backend, model
    close()
    close_keyed()
    engine.shutdown()


def _call(url: str, body=None, headers=None, timeout: float = 60) -> tuple[int, dict, float]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    t0 = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read()), time.perf_counter() - t0
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), time.perf_counter() - t0


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def test_the_text_bound_refuses_only_what_cannot_fit(door):
    """max_text_chars is max_model_len x the longest token: a text one character longer is more than max_model_len
    tokens whatever it holds (so the refusal is never wrong), and a text at the bound of one repeated token fits."""
    *_, backend, _ = door
    tok = backend.tokenizer
    longest = max(tok.get_vocab(), key=len)
    assert longest_token_chars(tok) == len(longest) and max_text_chars(512, tok) == 512 * len(longest)
    for text in ("a" * (512 * len(longest) + 1), "hello world " * 600, "\u00e9\u4e2d" * 3500):
        if len(text) > max_text_chars(512, tok):
            assert len(tok.encode(text, add_special_tokens=False)) > 512


def test_a_long_text_prompt_is_refused_before_tokenizing_and_others_go_on(door):
    """A 1.5 MB text (the issue's 15 MB at a tenth; tokenizing it took this door ~5 s of its event loop): a 400
    naming the field and the limit, fast, without the door's memory growing; a request sent alongside is served
    as fast as alone."""
    url, _, backend, _ = door
    small = {"prompt": [5, 6, 7], "max_tokens": 2}
    _, _, alone_s = _call(f"{url}/v1/completions", small)
    text = "lorem ipsum dolor sit amet " * 58_000  # ~1.5 MB
    rss0 = _rss_mb()
    got = {}
    thread = threading.Thread(target=lambda: got.update(big=_call(f"{url}/v1/completions", {"prompt": text})))
    thread.start()
    time.sleep(0.02)
    status, _, beside_s = _call(f"{url}/v1/completions", small)
    thread.join(timeout=60)
    big_status, out, big_s = got["big"]
    assert big_status == 400 and out["error"]["param"] == "prompt"
    assert out["error"]["code"] == "context_length_exceeded"
    assert f"at most {max_text_chars(512, backend.tokenizer)}" in out["error"]["message"]
    assert big_s < 1.0, big_s  # tokenizing it took ~5 s here
    assert status == 200 and beside_s < alone_s + 1.0, (alone_s, beside_s)
    assert _rss_mb() - rss0 < 40, "the refused text moved the door's memory"
    status, out, _ = _call(f"{url}/v1/chat/completions", {"messages": [{"role": "user", "content": text}]})
    assert status == 400 and out["error"]["param"] == "messages"
    status, out, _ = _call(f"{url}/v1/completions", {"prompt": ["hi", text]})
    assert status == 400 and out["error"]["param"] == "prompt"


class SlowTokenizer:
    """A fake (named so): the real tokenizer, whose encode takes 1.5 s, as a long text's does on a slow host."""

    def __init__(self, tok) -> None:
        self.tok = tok

    def __getattr__(self, name):
        return getattr(self.tok, name)

    def encode(self, text, **kwargs):
        time.sleep(1.5)
        return self.tok.encode(text, **kwargs)


def test_text_is_tokenized_off_the_event_loop(door):
    """While one request's text is being tokenized, a token-id request is answered (before: it waited)."""
    _, _, backend, _ = door
    slow = EngineBackend(backend.engine, "cpu-0")
    slow.tokenizer = SlowTokenizer(backend.tokenizer)
    url, close = _serve(slow, HttpConfig(port=0))
    try:
        got = {}
        thread = threading.Thread(target=lambda: got.update(t=_call(f"{url}/v1/completions",
                                                                     {"prompt": "hello", "max_tokens": 2})))
        thread.start()
        time.sleep(0.2)
        status, _, took_s = _call(f"{url}/v1/completions", {"prompt": [5, 6], "max_tokens": 2})
        thread.join(timeout=30)
        assert status == 200 and took_s < 1.0, took_s
        assert got["t"][0] == 200
    finally:
        close()


def test_a_body_past_the_default_limit_is_refused_unread(door):
    """The default body limit is 8 MiB (was 16): a 9 MB Content-Length is a 413 at once, its body never sent."""
    url, *_ = door
    assert HttpConfig().max_body_bytes == 8 << 20
    host, port = url[len("http://"):].split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        t0 = time.monotonic()
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 9000000\r\n\r\n")
        assert s.recv(4096).startswith(b"HTTP/1.1 413")
    assert time.monotonic() - t0 < 2.0


def test_keys_from_a_file_each_accepted_and_health_without_one(door):
    url, keyed, _, model = door
    body = {"prompt": [1, 2, 3], "max_tokens": 2}
    for key in KEYS:
        assert _call(f"{keyed}/v1/completions", body, {"Authorization": f"Bearer {key}"})[0] == 200
    for wrong in ("", "Bearer ", f"Bearer {KEYS[0][:-1]}", f"Bearer {KEYS[0]}x", KEYS[0], "Bearer \u00e9"):
        assert _call(f"{keyed}/v1/completions", body, {"Authorization": wrong} if wrong else {})[0] == 401
    status, h, _ = _call(f"{keyed}/health")
    assert status == 200 and h == {"status": "ok"}  # no model path, limits or device without a key
    status, h, _ = _call(f"{keyed}/health", headers={"Authorization": f"Bearer {KEYS[1]}"})
    assert status == 200 and h["model"] == model and h["max_model_len"] == 512
    assert _call(f"{url}/health")[1]["model"] == model  # a door with no key hides nothing it would serve


def test_keys_are_compared_in_constant_time(monkeypatch):
    seen = []
    real = http_auth.hmac.compare_digest
    monkeypatch.setattr(http_auth.hmac, "compare_digest", lambda a, b: seen.append((a, b)) or real(a, b))
    keys = http_auth.Keys("k1", None)
    assert keys.match("Bearer k1") == keys.ids[0] and keys.match("Bearer k2") is None
    assert len(seen) == 2


def test_key_sources_and_their_errors(tmp_path, monkeypatch):
    monkeypatch.setenv(http_auth.API_KEY_ENV, "from-env")
    assert http_auth.key_from_env(None, None) == "from-env"
    assert http_auth.key_from_env("flag", None) == "flag"
    assert http_auth.key_from_env(None, "some-file") is None  # a key file given: the environment is not read
    with pytest.raises(ValueError, match="api_key_file.*cannot read"):
        http_auth.Keys(None, str(tmp_path / "missing"))
    (tmp_path / "empty").write_text("# nothing\n\n")
    with pytest.raises(ValueError, match="api_key_file.*holds no key"):
        http_auth.Keys(None, str(tmp_path / "empty"))


def test_a_keyless_door_beyond_loopback_is_warned_about():
    none, one = False, True
    assert http_auth.exposure_warning("127.0.0.1", none) is None
    assert http_auth.exposure_warning("::1", none) is None and http_auth.exposure_warning("localhost", none) is None
    assert "no API key" in http_auth.exposure_warning("0.0.0.0", none)
    assert "no API key" in http_auth.exposure_warning("10.1.2.3", none)
    assert http_auth.exposure_warning("0.0.0.0", one) is None


def test_callers_by_key_then_user_then_address():
    assert http_auth.caller_of("key:ab", "alice", "1.2.3.4") == "key:ab"
    alice = http_auth.caller_of(None, "alice", "1.2.3.4")
    assert alice.startswith("user:") and "alice" not in alice and alice != http_auth.caller_of(None, "bob", "x")
    assert http_auth.caller_of(None, "", "1.2.3.4") == "addr:1.2.3.4"



def _drop_test(url: str, body: dict, settled) -> bytes:
    """A stream request from a client that never reads (a 4 kB receive buffer): waits for settled() (bounded),
    then reads what the server sent until it closes."""
    host, port = url[len("http://"):].split(":")
    raw = json.dumps({**body, "stream": True}).encode()
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    try:
        s.settimeout(10)
        s.connect((host, int(port)))
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(raw) + raw)
        settled()
        got = b""
        while len(got) < 256 << 20 and (part := s.recv(1 << 20)):
            got += part
        return got
    finally:
        s.close()


def _serve_small_sndbuf(backend, cfg: HttpConfig):
    """The door's app on a listening socket whose send buffer is 4 kB (accepted sockets inherit it on Linux)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    sock.bind(("127.0.0.1", 0))
    return _serve(backend, cfg, sock)


def test_a_client_that_never_reads_is_dropped_and_its_requests_aborted(door):
    """A streamed response whose client stops reading: dropped once stream_buffer_events events wait for it; its
    requests leave the engine. Before, every event was buffered (the issue: +52 MB for one n=256 request) and the
    requests ran to their end."""
    _, _, backend, _ = door
    engine = backend.engine
    # the door's socket with a 4 kB send buffer: Linux lets an accepted socket's buffer grow to tcp_wmem's 4 MB, room
    # for this whole answer (16 x 480 events, ~1.1 MB), so a writer there never waits on a client that does not read
    url, close = _serve_small_sndbuf(backend, HttpConfig(port=0, stream_buffer_events=32))

    def settled():
        deadline = time.monotonic() + 30
        while engine.stats()["num_in_flight"] == 0:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        deadline = time.monotonic() + 30
        while engine.stats()["num_in_flight"]:
            assert time.monotonic() < deadline, "the engine still serves a client that does not read"
            time.sleep(0.05)
    try:
        got = _drop_test(url, {"prompt": [[31, 32, k] for k in range(16)], "max_tokens": 480, "ignore_eos": True},
                         settled)
    finally:
        close()
    tokens = got.count(b'"token_ids":[') - got.count(b'"token_ids":[]')
    assert b"data: [DONE]" not in got and tokens < 16 * 480, tokens


class FloodBackend:
    """A fake backend (named so): streams 64-token chunks as fast as the loop runs, to fill a socket that the
    tiny model on this CPU would take minutes to; records when its stream is closed (the request's abort)."""

    def __init__(self, backend) -> None:
        self.limits, self.tokenizer, self.model_names = backend.limits, None, backend.model_names
        self.chunks, self.closed = 0, False

    async def stream(self, prompt, sp, user: str = ""):
        import asyncio

        from flame_llm.serving.pending import StreamChunk

        try:
            for _ in range(1 << 20):
                self.chunks += 1
                yield StreamChunk(list(range(64)))
                await asyncio.sleep(0)
        finally:
            self.closed = True


def test_a_write_that_does_not_drain_drops_the_client(door):
    """stream_drain_timeout_s: a write waiting that long for a client that does not read drops it, and its stream
    is closed (on a real backend: its request aborted)."""
    _, _, backend, _ = door
    flood = FloodBackend(backend)
    url, close = _serve(flood, HttpConfig(port=0, stream_buffer_events=1 << 30, stream_drain_timeout_s=0.5))

    def settled():
        deadline = time.monotonic() + 60
        while not flood.closed:
            assert time.monotonic() < deadline, f"still streaming to a client that does not read ({flood.chunks})"
            time.sleep(0.05)
    try:
        got = _drop_test(url, {"prompt": [5, 6], "max_tokens": 100}, settled)
    finally:
        close()
    assert b"data: [DONE]" not in got and flood.chunks < 1 << 20


def test_start_warns_of_a_keyless_door_beyond_loopback(door, caplog):
    """The warning at the call site: start() on 0.0.0.0 with no key logs it (the port is taken, so nothing listens
    beyond loopback here), and not with a key."""
    import asyncio

    from aiohttp import web

    from flame_llm.serving.http_app import start

    port = int(door[0].rsplit(":", 1)[1])
    for key, warned in ((None, True), ("k", False)):
        caplog.clear()
        with caplog.at_level("WARNING"), pytest.raises(RuntimeError, match="cannot listen"):
            asyncio.run(start(web.Application(), HttpConfig(host="0.0.0.0", port=port, api_key=key)))
        assert any("beyond loopback, with no API key" in r.message for r in caplog.records) == warned
