"""AsyncEngine: the LLMEngine step loop on its own thread, awaited from any asyncio loop.

Everything a step hands to callers (stream tokens, ends, results, failures) is gathered per asyncio loop and handed
over with one call_soon_threadsafe per loop when the step's tokens are committed: each such call writes the loop's
self-pipe and wakes it, so one per stream per token cost the engine thread a syscall per token
(bench.service.stream_cpu, issue 39). The calls run on each loop in the order they were made.

A failure that can be pinned on one request (its sampling fails on its own in a step, its output cannot be
made, it cannot be added) fails that request alone with RequestFailed; the engine serves on. Any other
exception in the loop fails every waiting request and stops the loop (`failed`, `error`)."""
from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time
from collections.abc import AsyncIterator
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import numpy as np

from flame_llm.config import Config
from flame_llm.engine.coalesce import coalesced
from flame_llm.engine.faults import break_engine, slow_engine
from flame_llm.engine.llm_engine import LLMEngine
from flame_llm.engine.sequence import Sequence
from flame_llm.outputs import RequestOutput
from flame_llm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class RequestFailed(ValueError):
    """One request failed inside the engine on its own (e.g. its sampling parameters could not be applied in
    a step); the engine and the requests beside it were not affected."""

    def __init__(self, request_id: str, message: str) -> None:
        super().__init__(f"request {request_id!r} failed in the engine: {message}")
        self.request_id = request_id


@dataclass(slots=True)
class _Pending:
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    prompt: list[int]
    params: SamplingParams
    stream: asyncio.Queue | None = None
    seq: Sequence | None = None
    num_streamed: int = 0
    extra: dict = field(default_factory=dict)


class AsyncEngine:
    def __init__(self, config: Config) -> None:
        self.engine = LLMEngine(config)
        self.config = config
        self._cond = threading.Condition()
        self._adds: list[tuple[str, _Pending]] = []
        self._aborts: list[str] = []
        self._pending: dict[str, _Pending] = {}
        self._streams: dict[str, _Pending] = {}
        self._stopped = False
        self._error: BaseException | None = None
        self._next_id = 0
        # bounded hand-off (handoff_wait_ms): the loops handed work since the last wait, and the waits' counts
        self._handoff_s = config.scheduler_config.handoff_wait_ms / 1000
        self._handed: set[asyncio.AbstractEventLoop] = set()
        # the hand-offs gathered since the last flush, per loop, in order (one wake-up per loop: _flush)
        self._batch: dict[asyncio.AbstractEventLoop, list[tuple]] = {}
        self._handoff = {"handoff_waits": 0, "handoff_timeouts": 0, "handoff_wait_s": 0.0, "handoff_wait_max_s": 0.0}
        self._seqs: tuple[Sequence, ...] | None = None  # sequences(): published by the engine thread once asked
        if config.scheduler_config.gil_switch_interval_ms:
            sys.setswitchinterval(config.scheduler_config.gil_switch_interval_ms / 1000)
        self._thread = threading.Thread(target=self._loop, name="flame-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_args(cls, model: str, **kwargs) -> AsyncEngine:
        return cls(Config.from_kwargs(model, **kwargs))

    def _submit(self, prompt: str | Seq[int], params: SamplingParams, request_id: str | None,
                stream: bool, checked: bool = False) -> tuple[str, _Pending]:
        if self._error is not None:
            raise RuntimeError(f"engine loop failed: {self._error!r}")
        if self._stopped:
            raise RuntimeError("engine is shut down")
        if checked:  # this process's boundary checked ids, length and sampling: only the engine's own limit is left
            ids = prompt.tolist() if isinstance(prompt, np.ndarray) else list(prompt)
            self.engine.check_fits(len(ids), params)
        else:  # the one check of this request in this process
            ids = self.engine.to_token_ids(prompt)
            self.engine.check_request(ids, params)
        loop = asyncio.get_running_loop()
        pending = _Pending(loop, loop.create_future(), ids, params, asyncio.Queue() if stream else None)
        with self._cond:
            if request_id is None:
                request_id = f"req-{self._next_id}"
                self._next_id += 1
            if request_id in self._pending or any(r == request_id for r, _ in self._adds):
                raise ValueError(f"request_id {request_id!r} is already in flight")
            self._adds.append((request_id, pending))
            self._cond.notify()
        return request_id, pending

    async def generate(self, prompt_token_ids: str | Seq[int], sampling_params: SamplingParams,
                       request_id: str | None = None, checked: bool = False) -> RequestOutput:
        """The request's RequestOutput once it finishes. `checked`: the caller's boundary has checked the prompt
        (in-vocabulary ids within max_prompt_tokens) and the sampling params; only the KV-pool fit is checked here."""
        rid, pending = self._submit(prompt_token_ids, sampling_params, request_id, stream=False, checked=checked)
        try:
            return await asyncio.shield(pending.future)
        except asyncio.CancelledError:
            self.abort(rid)
            raise

    async def stream(self, prompt_token_ids: str | Seq[int], sampling_params: SamplingParams,
                     request_id: str | None = None) -> AsyncIterator[int]:
        """Yields output token ids as they are produced; the final RequestOutput is not yielded."""
        async for chunk in self.stream_chunks(prompt_token_ids, sampling_params, request_id):
            if isinstance(chunk, list):
                for tok in chunk:
                    yield tok

    async def stream_chunks(self, prompt_token_ids: str | Seq[int], sampling_params: SamplingParams,
                            request_id: str | None = None, checked: bool = False
                            ) -> AsyncIterator[list[int] | RequestOutput]:
        """The request's new token ids as lists (every id waiting is taken at once, so a slow reader gets fewer,
        larger chunks), then its RequestOutput (finish reason, cached tokens). A failure of the request or of
        the engine loop is raised after the tokens it had. Closing the iterator early (or cancelling the task
        reading it) aborts the request."""
        rid, pending = self._submit(prompt_token_ids, sampling_params, request_id, stream=True, checked=checked)
        try:
            async for chunk in coalesced(pending.stream):  # each step's new tokens arrive as one list
                yield chunk
            yield await pending.future
        finally:
            if not pending.future.done():
                self.abort(rid)

    @property
    def error(self) -> BaseException | None:
        """The exception that stopped the step loop, or None while it runs."""
        return self._error

    @property
    def failed(self) -> bool:
        return self._error is not None

    def abort(self, request_id: str) -> None:
        with self._cond:
            self._aborts.append(request_id)
            self._cond.notify()

    # ---- what callers reached through `.engine` (the engine process's facade has the same names) ------------
    @property
    def tokenizer(self):  # -> transformers.PreTrainedTokenizerBase (loaded lazily)
        return self.engine.tokenizer

    def check_request(self, prompt_token_ids: list[int], sp: SamplingParams) -> None:
        """LLMEngine.check_request: ValueError naming the field and the limit."""
        self.engine.check_request(prompt_token_ids, sp)

    @property
    def block_manager(self):  # -> BlockManager, whose cache events KvEventLog reads
        return self.engine.block_manager

    def sequences(self) -> tuple[Sequence, ...]:
        """The scheduler's waiting and running sequences (their load: KvEventLog), as the engine thread published them
        after its last step or its last requests added, never a step's half-moved state. The thread publishes only
        once this was first called (before that a step does nothing more); that first call reads the scheduler from
        here, which may miss a sequence a step is moving."""
        seqs = self._seqs
        if seqs is None:
            seqs = self._seqs = self.engine.scheduler.sequences()
        return seqs

    def break_engine(self, shard_name: str) -> None:
        """Fault injection (engine/faults.py): the next step raises."""
        break_engine(self.engine, shard_name)

    def slow_engine(self, pause_s: float) -> None:
        """Fault injection (engine/faults.py): pause pause_s after each step (0: no more)."""
        slow_engine(self.engine, pause_s)

    def stats(self) -> dict:
        with self._cond:
            queued = len(self._adds)
        return {**self.engine.stats(), "num_queued": queued, "num_in_flight": len(self._pending), **self._handoff}

    def shutdown(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()
        self._thread.join(timeout=60)
        self._fail_all(RuntimeError("engine shut down"))

    # ---- engine thread --------------------------------------------------------------------------
    def _loop(self) -> None:
        engine = self.engine
        while True:
            with self._cond:
                while not self._stopped and not self._adds and not self._aborts and engine.is_finished():
                    self._cond.wait()
                if self._stopped:
                    return
                adds, self._adds = self._adds, []
                aborts, self._aborts = self._aborts, []
            try:
                for rid, p in adds:
                    try:
                        p.seq = engine._add_checked(p.prompt, p.params, rid)
                    except Exception as e:  # checked in _submit; should it still fail, it fails alone
                        self._fail_one(p, e)
                        continue
                    self._pending[rid] = p
                    if p.stream is not None:
                        self._streams[rid] = p
                for rid in aborts:
                    seq = engine.abort(rid)
                    if seq is not None:
                        self._deliver(seq)
                self._flush()
                publish = self._seqs is not None  # someone reads sequences(): keep them current
                if publish and (adds or aborts):
                    self._seqs = engine.scheduler.sequences()
                if not engine.is_finished():
                    engine.step(self._commit)
                    if publish:
                        self._seqs = engine.scheduler.sequences()
                if self._handed:
                    self._wait_handoff()
            except BaseException as e:  # the step failed: every waiting caller gets the error
                logger.exception("engine step failed")
                self._error = e
                self._fail_all(e)
                return

    def _commit(self, finished: list[Sequence]) -> None:
        """A step's tokens are committed: hand new tokens to streams and results to callers (LLMEngine.step may
        call this before it enqueues a long step)."""
        for p in list(self._streams.values()):
            self._push_tokens(p)
        for seq in finished:
            self._deliver(seq)
        self._flush()

    def _push_tokens(self, p: _Pending) -> None:
        seq = p.seq
        new = seq.completion_token_ids[p.num_streamed:]
        if new:
            p.num_streamed += len(new)
            self._hand(p.loop, p.stream.put_nowait, new)  # a fresh list: the slice copies

    def _deliver(self, seq: Sequence) -> None:
        p = self._pending.pop(seq.request_id, None)
        if p is None:
            return
        if self._streams.pop(seq.request_id, None) is not None:
            self._push_tokens(p)
        try:
            out = self.engine.make_output(seq)
        except Exception as e:  # e.g. the tokenizer cannot decode its tokens: the request is done, fail it alone
            logger.exception("request %s: output failed", seq.request_id)
            self._fail_one(p, RequestFailed(seq.request_id, f"its output could not be made ({type(e).__name__}: "
                                                            f"{e})"))
            return
        if out.finish_reason == "error":
            self._fail_one(p, RequestFailed(seq.request_id, out.error or "unknown error"))
            return
        if p.stream is not None:
            self._hand(p.loop, p.stream.put_nowait, None)
        self._hand(p.loop, _resolve, p.future, out)

    def _hand(self, loop: asyncio.AbstractEventLoop, fn, *args) -> None:
        """Gather a call for `loop`; _flush hands each loop its calls at once."""
        self._batch.setdefault(loop, []).append((fn, args))

    def _flush(self) -> None:
        batch, self._batch = self._batch, {}
        for loop, calls in batch.items():
            if _call(loop, _run_all, calls) and self._handoff_s:
                self._handed.add(loop)

    def _wait_handoff(self) -> None:
        """Let the GIL go until every loop handed work this step has run it and the task it woke (a release
        queued behind them), at most handoff_wait_ms; a late release finds a lock nobody waits on."""
        loops, self._handed = self._handed, set()
        locks = []
        for loop in loops:
            lock = threading.Lock()
            lock.acquire()
            if _call(loop, loop.call_soon, lock.release):
                locks.append(lock)
        t0 = time.perf_counter()
        deadline = t0 + self._handoff_s
        timed_out = not all(lock.acquire(timeout=max(0.0, deadline - time.perf_counter())) for lock in locks)
        waited = time.perf_counter() - t0
        h = self._handoff
        h["handoff_waits"] += 1
        h["handoff_timeouts"] += timed_out
        h["handoff_wait_s"] += waited
        h["handoff_wait_max_s"] = max(h["handoff_wait_max_s"], waited)

    def _fail_one(self, p: _Pending, exc: BaseException) -> None:
        if p.stream is not None:
            self._hand(p.loop, p.stream.put_nowait, None)
        self._hand(p.loop, _fail, p.future, exc)

    def _fail_all(self, exc: BaseException) -> None:
        pending = list(self._pending.values()) + [p for _, p in self._adds]
        self._pending.clear()
        self._adds.clear()
        for p in pending:
            self._fail_one(p, exc)
        self._flush()


def _call(loop: asyncio.AbstractEventLoop, fn, *args) -> bool:
    """Hand a result to the caller's loop; a caller whose loop has closed no longer listens (False)."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:
        return False
    return True


def _run_all(calls: list[tuple]) -> None:
    """A step's hand-offs to one loop, run on it in order; one that raises is logged and the rest still run."""
    for fn, args in calls:
        try:
            fn(*args)
        except Exception:
            logger.exception("a hand-off from the engine failed")


def _resolve(fut: asyncio.Future, value) -> None:
    if not fut.done():
        fut.set_result(value)


def _fail(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc if isinstance(exc, Exception) else RuntimeError(repr(exc)))
