"""The engine process's side of engine_process (the caller's side: engine_process.py): the messages that cross the
pipes, and the step loop that runs LLMEngine in a child process of its own, as vLLM's EngineCore does.

The loop takes every message waiting (requests, aborts, fault injections) without blocking between steps, and
blocks on its pipe when the engine is idle. After each step it sends ONE StepOutput: every stream's new token ids,
the finished requests' outputs, the requests that failed alone, and at most every STATS_INTERVAL_S (and when it goes
idle) the engine's stats. An exception in a step sends EngineFailed and ends the process; the parent's end of the
pipe closing (its death or shutdown) ends it too."""
from __future__ import annotations

import gc
import logging
import os
import signal
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

from flame_llm.config import Config
from flame_llm.outputs import RequestOutput
from flame_llm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
STATS_INTERVAL_S = 0.1  # the engine's stats ride on a step's message at most this often (and when it goes idle)


# ---- caller -> engine process ----------------------------------------------------------------------------------
@dataclass(slots=True)
class AddRequest:
    """A request the caller's process checked (ids, length, sampling, KV-pool fit)."""
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: bool  # its new tokens go out after every step


@dataclass(slots=True)
class AbortRequest:
    request_id: str


@dataclass(slots=True)
class BreakEngine:
    """Fault injection (engine/faults.py break_engine)."""
    shard_name: str


@dataclass(slots=True)
class SlowEngine:
    """Fault injection (engine/faults.py slow_engine)."""
    pause_s: float


@dataclass(slots=True)
class Shutdown:
    pass


# ---- engine process -> caller ----------------------------------------------------------------------------------
@dataclass(slots=True)
class Ready:
    """The engine is loaded: what the caller's request checks need, once."""
    pid: int
    num_blocks: int  # the KV pool (LLMEngine.check_fits)
    stats: dict


@dataclass(slots=True)
class StartFailed:
    error: str  # "<type>: <message>" of what LLMEngine raised


@dataclass(slots=True)
class StepOutput:
    tokens: dict[str, list[int]] = field(default_factory=dict)  # stream request id -> its new token ids, in order
    # the finished requests' outputs, prompt_token_ids left empty (the caller has them; an 8K prompt need not
    # cross back)
    finished: list[RequestOutput] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)  # request id -> why it failed alone (RequestFailed)
    stats: dict | None = None  # LLMEngine.stats(), at most every STATS_INTERVAL_S and when the loop goes idle

    def __bool__(self) -> bool:
        return bool(self.tokens or self.finished or self.failed or self.stats is not None)


@dataclass(slots=True)
class EngineFailed:
    error: str  # repr of the exception that stopped the step loop


class ParentGone(Exception):
    """The caller's end of a pipe closed: its process died or shut the engine down."""


@dataclass(slots=True)
class _Stream:
    seq: object  # Sequence
    num_streamed: int = 0


class EngineCore:
    """The step loop of the engine process over one LLMEngine."""

    def __init__(self, engine, send: Connection) -> None:
        self.engine, self.conn = engine, send
        self.live: dict[str, object] = {}  # request id -> its Sequence, every request in the engine
        self.streams: dict[str, _Stream] = {}
        self.out = StepOutput()
        self.stats_at = time.monotonic()
        self.stepped = False  # a step ran since the stats were last sent

    def serve(self, recv: Connection) -> None:
        engine = self.engine
        while True:
            if engine.is_finished() and not _poll(recv):
                self.flush(stats=self.stepped)  # idle: the stats of the last steps, then block
                _poll(recv, None)
            while _poll(recv):
                msg = _recv(recv)
                if isinstance(msg, Shutdown):
                    return
                self.handle(msg)
            try:
                self.flush()
                if not engine.is_finished():
                    engine.step(self.commit)
                    self.stepped = True
            except ParentGone:
                raise
            except BaseException as e:  # the step failed: the caller fails every waiting request
                logger.exception("engine step failed")
                self.send(EngineFailed(repr(e)))
                return

    def handle(self, msg: AddRequest | AbortRequest | BreakEngine | SlowEngine) -> None:
        from flame_llm.engine.faults import break_engine, slow_engine

        if isinstance(msg, AddRequest):
            rid = msg.request_id
            try:
                seq = self.engine._add_checked(msg.prompt_token_ids, msg.params, rid)
            except Exception as e:  # checked in the caller's process; should it still fail, it fails alone
                logger.exception("request %s could not be added", rid)
                self.out.failed[rid] = f"it could not be added ({type(e).__name__}: {e})"
                return
            self.live[rid] = seq
            if msg.stream:
                self.streams[rid] = _Stream(seq)
        elif isinstance(msg, AbortRequest):
            seq = self.engine.abort(msg.request_id)
            if seq is not None:
                self.deliver(seq)
        elif isinstance(msg, BreakEngine):
            break_engine(self.engine, msg.shard_name)
        elif isinstance(msg, SlowEngine):
            slow_engine(self.engine, msg.pause_s)
        else:
            raise AssertionError(f"unknown message {type(msg).__name__}")

    def commit(self, finished: list) -> None:
        """A step's tokens are committed (LLMEngine.step's on_commit): send them, and the finished requests."""
        for st in self.streams.values():
            self.push(st)
        for seq in finished:
            self.deliver(seq)
        self.flush()

    def push(self, st: _Stream) -> None:
        new = st.seq.completion_token_ids[st.num_streamed:]
        if new:
            st.num_streamed += len(new)
            self.out.tokens.setdefault(st.seq.request_id, []).extend(new)

    def deliver(self, seq) -> None:
        rid = seq.request_id
        if self.live.pop(rid, None) is None:
            return
        st = self.streams.pop(rid, None)
        if st is not None:
            self.push(st)
        try:
            out = self.engine.make_output(seq)
        except Exception as e:  # the request is done: fail it alone
            logger.exception("request %s: output failed", rid)
            self.out.failed[rid] = f"its output could not be made ({type(e).__name__}: {e})"
            return
        if out.finish_reason == "error":
            self.out.failed[rid] = out.error or "unknown error"
            return
        out.prompt_token_ids = []
        self.out.finished.append(out)

    def flush(self, stats: bool = False) -> None:
        out = self.out
        now = time.monotonic()
        if stats or now - self.stats_at >= STATS_INTERVAL_S:
            out.stats, self.stats_at, self.stepped = self.engine.stats(), now, False
        if out:
            self.out = StepOutput()
            self.send(out)

    def send(self, msg: StepOutput | EngineFailed) -> None:
        try:
            self.conn.send(msg)
        except OSError as e:
            raise ParentGone from e


def _poll(conn: Connection, timeout: float | None = 0.0) -> bool:
    try:
        return conn.poll(timeout)
    except OSError as e:
        raise ParentGone from e


def _recv(conn: Connection):
    try:
        return conn.recv()
    except (EOFError, OSError) as e:
        raise ParentGone from e


def run_engine_process(config: Config, recv: Connection, send: Connection, torch_threads: int,
                       log_level: int) -> None:
    """The engine process's main (multiprocessing spawn target): load LLMEngine, freeze the startup heap as
    EngineHost does, say Ready, run the step loop until Shutdown or the caller's pipe closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the caller's process decides when the engine stops
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s[engine %(process)d]: %(message)s")
    import torch

    if torch_threads:
        torch.set_num_threads(torch_threads)
    from flame_llm.engine.llm_engine import LLMEngine

    try:
        engine = LLMEngine(config)
    except BaseException as e:
        logger.exception("the engine failed to start")
        send.send(StartFailed(f"{type(e).__name__}: {e}"))
        return
    gc.collect()
    gc.freeze()  # everything allocated so far lives as long as the process
    send.send(Ready(os.getpid(), engine.block_manager.num_blocks, engine.stats()))
    try:
        EngineCore(engine, send).serve(recv)
    except ParentGone:
        logger.info("engine process %d: the caller's pipe closed; exiting", os.getpid())
