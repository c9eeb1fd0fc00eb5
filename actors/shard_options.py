"""What every engine actor runs with besides its model: the service YAML's `shard` section."""
from __future__ import annotations

from dataclasses import dataclass

from actors.stream_guard import StreamLimits
from flame_llm.protocol.types import DEFAULT_MAX_PAYLOAD_BYTES, DEFAULT_ZSTD_LEVEL
from flame_llm.protocol.wire import MAX_LEVEL, MIN_LEVEL
from flame_llm.validate import check_bool, check_int, check_number


@dataclass(slots=True)
class ShardOptions:
    """What every engine actor runs with besides its model (the service YAML's `shard` section)."""
    torch_threads: int = 1  # intra-op threads of a CPU shard
    # admission bounds; the token bound is above a shard's half of the seed reuse trace (1.06M tokens)
    max_inflight_tokens: int = 1 << 22  # prompt + max output tokens of the requests admitted
    max_inflight_requests: int = 1024  # requests admitted
    max_queued_requests: int = 4096  # requests waiting for admission (per caller when fair); past it: overloaded
    max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES  # decoded size budget of one request batch
    zstd_level: int = DEFAULT_ZSTD_LEVEL  # results here, requests at the client
    result_window_ms: float = 2.0  # results finishing this close to a payload's first travel with it (a batch)
    # the stream port's bounds (actors/stream_guard.py)
    stream_hello_timeout_s: float = 5.0  # a connection presents its token within this, or is closed
    stream_max_pending: int = 256  # connections not yet past their hello (a new one past it closes the oldest)
    stream_max_connections: int = 1024  # connections past their hello (one per client per shard); more are closed
    stream_idle_timeout_s: float = 120.0  # a connection with no stream and no frame (clients ping at a third of it)
    stream_frame_timeout_s: float = 30.0  # a frame begun must complete within this (+ its length at 1 MiB/s)
    stream_accept_share: float = 0.25  # under a connection flood, accepting's share of the loop's time; 1.0: unpaced
    stream_defer_accept: bool = True  # Linux: a connection reaches the loop once its hello arrives (TCP_DEFER_ACCEPT)
    stream_refuse_reset: bool = False  # a connection refused before its hello is reset (RST), not closed (FIN)
    # the stream port's output (actors/stream_out.py)
    stream_coalesce: bool = True  # a connection's frames of one loop turn leave as one write; false: a write a frame
    stream_max_unsent_bytes: int = 1 << 20  # a connection's unsent bytes past this make its streams wait
    stream_drain_timeout_s: float = 30.0  # a peer that does not read within this, over the bound, is cut off

    def __post_init__(self) -> None:
        for name, low, high in (("torch_threads", 1, 1 << 10), ("max_inflight_tokens", 1, 1 << 40),
                                ("max_inflight_requests", 1, 1 << 30), ("max_queued_requests", 0, 1 << 30),
                                ("max_payload_bytes", 1024, 1 << 30), ("zstd_level", MIN_LEVEL, MAX_LEVEL)):
            check_int(name, getattr(self, name), low, high, where="shard field")  # zstd: the codec's own range
        check_number("result_window_ms", self.result_window_ms, 0, 1000, where="shard field")
        check_bool("stream_coalesce", self.stream_coalesce, where="shard field")
        check_bool("stream_defer_accept", self.stream_defer_accept, where="shard field")
        check_bool("stream_refuse_reset", self.stream_refuse_reset, where="shard field")
        check_number("stream_accept_share", self.stream_accept_share, 0, 1, low_open=True, where="shard field")
        # at least asyncio's default write high-water mark (64 KiB): over the bound, a transport is always paused
        check_int("stream_max_unsent_bytes", self.stream_max_unsent_bytes, 1 << 16, 1 << 34, where="shard field")
        for name in ("stream_hello_timeout_s", "stream_idle_timeout_s", "stream_frame_timeout_s",
                     "stream_drain_timeout_s"):
            check_number(name, getattr(self, name), 0, 86400, low_open=True, where="shard field")
        check_int("stream_max_pending", self.stream_max_pending, 1, 1 << 20, where="shard field")
        check_int("stream_max_connections", self.stream_max_connections, 1, 1 << 20, where="shard field")

    def stream_limits(self) -> StreamLimits:
        return StreamLimits(self.stream_hello_timeout_s, self.stream_max_pending, self.stream_max_connections,
                            self.stream_idle_timeout_s, self.stream_frame_timeout_s, self.stream_coalesce,
                            self.stream_max_unsent_bytes, self.stream_drain_timeout_s, self.stream_accept_share,
                            self.stream_defer_accept, self.stream_refuse_reset)
