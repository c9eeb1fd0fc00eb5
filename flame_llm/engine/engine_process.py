"""ProcessEngine: AsyncEngine's surface over an engine in a child process of its own (SchedulerConfig.engine_process),
and `make_async_engine`, the one place that picks between the two.

In one process the engine thread shares the GIL with the callers' asyncio loop: each torch call on the host path lets
it go and takes it back, and while the loop writes a step's tokens to ~20 streams the engine thread waits (up to the
5 ms switch interval) with the GPU idle (issue 39). Here the step loop (engine_core.py) runs in a process started with
`spawn` (it inherits CUDA_VISIBLE_DEVICES, so the GPU this process was pinned to); this process keeps the request
checks (the same functions, over the KV pool size the child reports once), a pipe each way, and one reader thread
that blocks on its pipe without the GIL and hands each step's calls to each caller loop with one
call_soon_threadsafe per loop. The finished outputs' text is decoded here (as vLLM detokenizes in its front process).
The child ends with this process (a daemon, and its pipe's EOF) or on shutdown; should it die, every waiting request
fails with an error naming it and `failed` turns True."""
from __future__ import annotations

import asyncio
import fcntl
import logging
import multiprocessing as mp
import sys
import threading
from dataclasses import dataclass

import numpy as np

from flame_llm.config import Config
from flame_llm.engine.async_engine import AsyncEngine, RequestFailed, _call, _fail, _resolve, _run_all
from flame_llm.engine.engine_core import (
    AbortRequest,
    AddRequest,
    BreakEngine,
    EngineFailed,
    Ready,
    Shutdown,
    SlowEngine,
    StartFailed,
    StepOutput,
    run_engine_process,
)
from flame_llm.engine.llm_engine import LLMEngine
from flame_llm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
PIPE_BYTES = 1 << 20  # each pipe's buffer (Linux F_SETPIPE_SZ, best effort): a burst of 8K-token prompts fits
_HANDOFF_KEYS = {"handoff_waits": 0, "handoff_timeouts": 0, "handoff_wait_s": 0.0, "handoff_wait_max_s": 0.0}


def make_async_engine(config: Config) -> AsyncEngine | ProcessEngine:
    """The serving engine the config asks for: the step loop on a thread (AsyncEngine) or in a process of its own."""
    return ProcessEngine(config) if config.scheduler_config.engine_process else AsyncEngine(config)


@dataclass(slots=True)
class _KvPool:
    num_blocks: int


class RequestChecks:
    """LLMEngine's request checks without its model (the same functions, so the same errors), over the engine
    process's KV pool size; the tokenizer is loaded here when asked for."""
    tokenizer = LLMEngine.tokenizer
    to_token_ids = LLMEngine.to_token_ids
    check_request = LLMEngine.check_request
    check_fits = LLMEngine.check_fits

    def __init__(self, config: Config, num_blocks: int) -> None:
        self.config = config
        self.vocab_size = config.model_config.hf_config.vocab_size
        self._tokenizer = None
        self.block_manager = _KvPool(num_blocks)


@dataclass(slots=True)
class _Pending:
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    prompt: list[int]
    stream: asyncio.Queue | None = None


class ProcessEngine:
    # the callers' side is AsyncEngine's own (over this class's _submit and abort)
    generate = AsyncEngine.generate
    stream = AsyncEngine.stream
    stream_chunks = AsyncEngine.stream_chunks

    def __init__(self, config: Config, start_timeout_s: float = 3600.0) -> None:
        import torch

        self.config = config
        ctx = mp.get_context("spawn")
        child_recv, self._send_conn = ctx.Pipe(duplex=False)
        self._recv_conn, child_send = ctx.Pipe(duplex=False)
        for conn in (self._send_conn, child_send):
            _grow_pipe(conn)
        self._proc = ctx.Process(target=run_engine_process, name="flame-engine-core", daemon=True,
                                 args=(config, child_recv, child_send, torch.get_num_threads(),
                                       logging.getLogger().getEffectiveLevel()))
        self._proc.start()
        child_recv.close()  # the child's ends: its death closes them, and this process reads EOF
        child_send.close()
        ready = self._wait_ready(start_timeout_s)
        self.pid = ready.pid
        self._checks = RequestChecks(config, ready.num_blocks)
        self._stats = ready.stats
        self._lock = threading.Lock()  # _pending, _error, _stopped
        self._send_lock = threading.Lock()
        self._pending: dict[str, _Pending] = {}
        self._error: BaseException | None = None
        self._stopped = False
        self._next_id = 0
        if config.scheduler_config.gil_switch_interval_ms:
            sys.setswitchinterval(config.scheduler_config.gil_switch_interval_ms / 1000)
        self._reader = threading.Thread(target=self._read, name="flame-engine-reader", daemon=True)
        self._reader.start()
        logger.info("engine process %d: ready, %d KV blocks", self.pid, ready.num_blocks)

    def _wait_ready(self, timeout_s: float) -> Ready:
        try:
            if not self._recv_conn.poll(timeout_s):
                raise RuntimeError(f"engine process did not start within {timeout_s:.0f} s")
            msg = self._recv_conn.recv()
        except (EOFError, OSError, RuntimeError) as e:
            self._proc.kill()
            self._proc.join(10)
            raise RuntimeError(f"engine process exited while starting (exit code {self._proc.exitcode})") from e
        if isinstance(msg, StartFailed):
            self._proc.join(10)
            raise RuntimeError(f"engine process failed to start: {msg.error}")
        assert isinstance(msg, Ready), type(msg)
        return msg

    # ---- AsyncEngine's surface -------------------------------------------------------------------------------------
    def _submit(self, prompt, params: SamplingParams, request_id: str | None, stream: bool,
                checked: bool = False) -> tuple[str, _Pending]:
        if self._error is not None:
            raise RuntimeError(f"engine loop failed: {self._error!r}")
        if self._stopped:
            raise RuntimeError("engine is shut down")
        if checked:  # as AsyncEngine._submit: only the engine's own limit is left
            ids = prompt.tolist() if isinstance(prompt, np.ndarray) else list(prompt)
            self._checks.check_fits(len(ids), params)
        else:
            ids = self._checks.to_token_ids(prompt)
            self._checks.check_request(ids, params)
        loop = asyncio.get_running_loop()
        pending = _Pending(loop, loop.create_future(), ids, asyncio.Queue() if stream else None)
        with self._lock:
            if self._error is not None or self._stopped:
                raise RuntimeError(f"engine loop failed: {self._error!r}" if self._error else "engine is shut down")
            if request_id is None:
                request_id = f"req-{self._next_id}"
                self._next_id += 1
            if request_id in self._pending:
                raise ValueError(f"request_id {request_id!r} is already in flight")
            self._pending[request_id] = pending  # should the child die now, the reader fails it
        # not under _lock: a send blocked on a full pipe must not stop the reader draining the other one
        self._send(AddRequest(request_id, ids, params, stream))
        return request_id, pending

    @property
    def error(self) -> BaseException | None:
        """The exception that stopped the engine process's loop (or the process), or None while it runs."""
        return self._error

    @property
    def failed(self) -> bool:
        return self._error is not None

    def abort(self, request_id: str) -> None:
        self._send(AbortRequest(request_id))

    @property
    def tokenizer(self):  # -> transformers.PreTrainedTokenizerBase (loaded lazily, in this process)
        return self._checks.tokenizer

    def check_request(self, prompt_token_ids: list[int], sp: SamplingParams) -> None:
        """LLMEngine.check_request over the engine process's KV pool: ValueError naming the field and the limit."""
        self._checks.check_request(prompt_token_ids, sp)

    @property
    def block_manager(self):
        raise ValueError("the block manager lives in the engine process (engine_process): no cache events here; "
                         "set enable_kv_events with engine_process off")

    def sequences(self) -> tuple:
        raise ValueError("the scheduler lives in the engine process (engine_process): no load for cache events here; "
                         "set enable_kv_events with engine_process off")

    def break_engine(self, shard_name: str) -> None:
        """Fault injection (engine/faults.py), run in the engine process: its next step raises."""
        self._send(BreakEngine(shard_name))

    def slow_engine(self, pause_s: float) -> None:
        """Fault injection (engine/faults.py), run in the engine process: it pauses pause_s after each step."""
        self._send(SlowEngine(pause_s))

    def stats(self) -> dict:
        """The engine's stats as the engine process last sent them (at most STATS_INTERVAL_S old while it steps),
        with this process's counters; AsyncEngine's keys."""
        return {**self._stats, "num_queued": 0, "num_in_flight": len(self._pending), **_HANDOFF_KEYS}

    def shutdown(self) -> None:
        with self._lock:
            self._stopped = True
        self._send(Shutdown())
        self._proc.join(timeout=60)
        if self._proc.is_alive():
            logger.warning("engine process %d did not stop; killing it", self.pid)
            self._proc.kill()
            self._proc.join(timeout=10)
        self._reader.join(timeout=10)
        self._fail_all(RuntimeError("engine shut down"))
        self._send_conn.close()

    # ---- the pipes ------------------------------------------------------------------------------------------------
    def _send(self, msg: object) -> None:
        """A message to the engine process; a closed pipe is the reader's to report (it sees the EOF)."""
        with self._send_lock:
            try:
                self._send_conn.send(msg)
            except OSError:
                pass

    def _read(self) -> None:
        """The reader thread: each message from the engine process, handed to the caller loops, until EOF."""
        while True:
            try:
                msg = self._recv_conn.recv()  # blocks without the GIL
            except (EOFError, OSError):
                break
            if isinstance(msg, StepOutput):
                self._deliver(msg)
            elif isinstance(msg, EngineFailed):
                self._fail_all(RuntimeError(f"engine process {self.pid} failed: {msg.error}"), set_error=True)
        self._proc.join(timeout=10)
        if not self._stopped:
            code = self._proc.exitcode
            how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
            logger.error("engine process %d died (%s)", self.pid, how)
            self._fail_all(RuntimeError(f"engine process {self.pid} died ({how})"), set_error=True)

    def _deliver(self, msg: StepOutput) -> None:
        batch: dict[asyncio.AbstractEventLoop, list[tuple]] = {}
        with self._lock:
            if msg.stats is not None:
                self._stats = msg.stats
            for rid, tokens in msg.tokens.items():
                p = self._pending.get(rid)
                if p is not None and p.stream is not None:
                    _hand(batch, p.loop, p.stream.put_nowait, tokens)
            for out in msg.finished:
                p = self._pending.pop(out.request_id, None)
                if p is None:
                    continue
                out.prompt_token_ids = p.prompt
                tok = self._checks._tokenizer
                if tok is not None:  # as LLMEngine.make_output does once its tokenizer is loaded
                    try:
                        out.text = tok.decode(out.output_token_ids, skip_special_tokens=True)
                    except Exception as e:
                        logger.exception("request %s: output failed", out.request_id)
                        _fail_one(batch, p, RequestFailed(out.request_id, "its output could not be made "
                                                                          f"({type(e).__name__}: {e})"))
                        continue
                if p.stream is not None:
                    _hand(batch, p.loop, p.stream.put_nowait, None)
                _hand(batch, p.loop, _resolve, p.future, out)
            for rid, why in msg.failed.items():
                p = self._pending.pop(rid, None)
                if p is not None:
                    _fail_one(batch, p, RequestFailed(rid, why))
        _flush(batch)

    def _fail_all(self, exc: BaseException, set_error: bool = False) -> None:
        batch: dict[asyncio.AbstractEventLoop, list[tuple]] = {}
        with self._lock:
            if set_error and self._error is None:
                self._error = exc
            pending, self._pending = list(self._pending.values()), {}
            for p in pending:
                _fail_one(batch, p, exc)
        _flush(batch)


def _hand(batch: dict, loop: asyncio.AbstractEventLoop, fn, *args) -> None:
    batch.setdefault(loop, []).append((fn, args))


def _fail_one(batch: dict, p: _Pending, exc: BaseException) -> None:
    if p.stream is not None:
        _hand(batch, p.loop, p.stream.put_nowait, None)
    _hand(batch, p.loop, _fail, p.future, exc)


def _flush(batch: dict) -> None:
    """One call_soon_threadsafe per loop (AsyncEngine._flush)."""
    for loop, calls in batch.items():
        _call(loop, _run_all, calls)


def _grow_pipe(conn) -> None:
    try:
        fcntl.fcntl(conn.fileno(), 1031, PIPE_BYTES)  # F_SETPIPE_SZ
    except OSError:
        pass
