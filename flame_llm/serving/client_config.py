"""The Python client's configuration (the service YAML's `client` section), apart from the service's other
sections so that the client imports no engine module."""
from __future__ import annotations

from dataclasses import dataclass

from flame_llm.protocol.types import MAX_BATCH_REQUESTS
from flame_llm.validate import check_int, check_number

DEFAULT_NAMESPACE = "flame"  # the Ray namespace of a service, unless configured


@dataclass(slots=True)
class ClientConfig:
    """The Python client's batching and retries (the `client` section)."""
    max_batch_prompts: int = 128  # a shard's batch leaves at this many prompts,
    batch_window_ms: float = 10.0  # this long after its first one, or at the payload budget
    max_retries: int = 20  # resubmissions of one request (overloaded, draining or dead shard)
    restart_timeout_s: float = 300.0  # how long to wait for a dead shard to come back
    overload_deadline_s: float = 300.0  # a request is retried on overloaded shards this long before it fails

    def __post_init__(self) -> None:
        w = "client field"
        check_int("max_batch_prompts", self.max_batch_prompts, 1, MAX_BATCH_REQUESTS, where=w)
        check_number("batch_window_ms", self.batch_window_ms, 0, 10_000, where=w)
        check_int("max_retries", self.max_retries, 0, where=w)
        check_number("restart_timeout_s", self.restart_timeout_s, 0, low_open=True, where=w)
        check_number("overload_deadline_s", self.overload_deadline_s, 0, where=w)
