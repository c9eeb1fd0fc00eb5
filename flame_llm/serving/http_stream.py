"""Serving one checked OpenAI request over a backend: as one response (`collect`) or as server-sent events
(`stream_events`, each choice's text as its tokens are sampled). A request with stop strings is streamed from
its shard even when the response is not, so that the engine stops (aborts) the moment a stop string matches.
A streamed response is bounded: at most http.stream_buffer_events events wait for its writer, and a write that
cannot go out within http.stream_drain_timeout_s (a client that does not read) drops the client; either way its
requests are aborted on the engines."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time

from aiohttp import web

from flame_llm.protocol.types import Result
from flame_llm.serving import openai_api as api
from flame_llm.serving.detok import TextStream
from flame_llm.serving.metrics import ANSWERED

log = logging.getLogger(__name__)
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


async def run_choice(backend, prompt, sp, stop: list[str], on_text=None, user: str = "") -> tuple[Result, str]:
    """One choice through backend.stream: (its Result, its text). on_text(text, token_ids) is called for every
    chunk. When a stop string matches, the stream is closed (the request is aborted on its engine) and the
    result says finish_reason "stop"."""
    tok = backend.tokenizer
    ts = TextStream(tok, stop) if tok is not None else None
    ids: list[int] = []
    result = None
    agen = backend.stream(prompt, sp, user)
    try:
        async for c in agen:
            ids.extend(c.token_ids)
            text = ts.feed(c.token_ids) if ts is not None else ""
            if c.result is not None:
                result = dataclasses.replace(c.result, output_token_ids=ids)  # what was streamed
                text += ts.finish() if ts is not None and not ts.stopped else ""
            if on_text is not None and (text or c.token_ids):
                on_text(text, c.token_ids)
            if ts is not None and ts.stopped:
                break
    finally:
        await agen.aclose()
    if result is None:  # stopped by a stop string before the engine finished: it was aborted there
        result = Result(None, output_token_ids=ids, finish_reason="stop", prompt_tokens=len(prompt))
    elif ts is not None and ts.stopped:
        result.finish_reason = "stop"
    return result, (ts.text if ts is not None else "")


async def collect(req: api.ApiRequest, backend, t0: float, observe) -> tuple[list[dict], list[str]]:
    """Every choice's result (as the response's JSON reads it: Result.to_dict()) and text, for a response in one
    piece."""
    if req.stop:
        pairs = await asyncio.gather(*(run_choice(backend, p, sp, req.stop, user=req.user)
                                       for p, sp in zip(req.prompts, req.sampling, strict=True)))
        results, texts = [r for r, _ in pairs], [t for _, t in pairs]
    else:
        results = await backend.generate(req.prompts, req.sampling, req.user)
        tok = backend.tokenizer
        texts = [tok.decode(r.output_token_ids, skip_special_tokens=True) if tok is not None and not r.error
                 else "" for r in results]
    observe("e2e_s", time.perf_counter() - t0)
    return [r.to_dict() for r in results], texts


class SlowClient(Exception):
    """The client does not read its stream fast enough: it is dropped and its requests aborted."""


def _event(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


async def stream_events(request: web.Request, req: api.ApiRequest, backend, t0: float, observe,
                        max_events: int = 4096, drain_s: float = 30.0) -> web.StreamResponse:
    """Server-sent events: each choice's chunks as its tokens arrive, its last chunk with its finish reason, a
    usage chunk when asked for, then [DONE]. A failed choice ends the stream with an error event. The client
    going away (a failed write, or its handler cancelled) cancels every choice: their requests are aborted; so does
    a client that falls behind by max_events events, or whose write does not drain within drain_s seconds.

    The events waiting when the writer comes round (several choices', or a choice's chunks that arrived while the
    last write drained) leave in one write; one drain deadline (a reschedulable timeout, no task per write) covers
    each write."""
    model = backend.model_names[0]
    resp = web.StreamResponse(headers=SSE_HEADERS)
    await resp.prepare(request)
    events: asyncio.Queue = asyncio.Queue()  # at most max_events, plus one last item per choice
    loop = asyncio.get_running_loop()

    async def one(index: int, prompt, sp) -> None:
        def on_text(text: str, token_ids: list[int]) -> None:
            if events.qsize() >= max_events:  # leaves run_choice: its stream is closed, the request aborted
                raise SlowClient(f"{max_events} events wait for the client (stream_buffer_events)")
            events.put_nowait(("text", index, text, token_ids))

        try:
            result, _ = await run_choice(backend, prompt, sp, req.stop, on_text, req.user)
        except SlowClient as e:
            events.put_nowait(("slow", index, e, None))
            return
        except Exception as e:  # noqa: BLE001 - reported to the client as the stream's error
            events.put_nowait(("error", index, api.ApiError(500, f"{type(e).__name__}: {e}", None, "server_error")))
            return
        events.put_nowait(("done", index, result, None))

    tasks: list[asyncio.Task] = []
    results: list[Result | None] = [None] * len(req.prompts)
    first, failed = True, False
    out: list[bytes] = []  # the events of this write
    prompt_tokens, streamed = sum(map(len, req.prompts)), 0  # continuous usage: the tokens so far

    def text_event(index: int, text: str, token_ids: list[int]) -> bytes:
        c = api.chunk(req, model, index, text, token_ids, None)
        if req.continuous_usage:
            c["usage"] = {"prompt_tokens": prompt_tokens, "completion_tokens": streamed,
                          "total_tokens": prompt_tokens + streamed}
        return _event(c)

    def event(kind: str, index: int, a, b) -> None:
        """One queued item into `out`; a SlowClient raises, a failed choice ends the stream (`failed`)."""
        nonlocal first, failed, streamed
        if kind == "slow":
            raise a
        if kind == "text":
            if first and b:
                observe("ttft_s", time.perf_counter() - t0)
                first = False
            streamed += len(b)
            out.append(text_event(index, a, b))
            return
        error = a if kind == "error" else (api.result_error(a.to_dict()) if a.error is not None else None)
        if error is not None:
            out.append(_event(error.body()))
            failed = True
            return
        results[index] = a
        out.append(_event(api.chunk(req, model, index, "", [], a.finish_reason)))

    try:
        async with asyncio.timeout(None) as deadline:

            async def write() -> None:
                data = out[0] if len(out) == 1 else b"".join(out)
                out.clear()
                deadline.reschedule(loop.time() + drain_s)
                await resp.write(data)
                deadline.reschedule(None)

            if req.kind == "chat":
                out.extend(_event(api.chunk(req, model, k, "", [], None, first=True)) for k in range(len(req.prompts)))
                await write()
            tasks = [asyncio.create_task(one(k, p, sp)) for k, (p, sp) in enumerate(zip(req.prompts, req.sampling))]
            while not failed and any(r is None for r in results):
                event(*await events.get())
                while not failed and not events.empty():  # what else is ready goes with it
                    event(*events.get_nowait())
                if not failed and all(r is not None for r in results):
                    break  # the last events go with the usage chunk and [DONE]
                await write()
            if not failed and req.include_usage:
                out.append(_event(api.usage_chunk(req, model, [r.to_dict() for r in results])))
            out.append(b"data: [DONE]\n\n")
            await write()
            request[ANSWERED] = resp.status  # answered in full: a client that goes away now (before EOF) had it all
        await resp.write_eof()
    except (SlowClient, TimeoutError) as e:  # dropped: nothing more is written; its requests are aborted below
        if isinstance(e, TimeoutError):
            if not deadline.expired():
                raise
            e = SlowClient(f"a write did not drain within stream_drain_timeout_s ({drain_s:g}s)")
        log.info("%s %s: client %s dropped: %s", request.method, request.path, request.remote, e)
        if request.transport is not None:
            request.transport.abort()
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        observe("e2e_s", time.perf_counter() - t0)
    return resp
