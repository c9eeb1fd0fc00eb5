"""The Python client's configuration (the service YAML's `client` section), apart from the service's other
sections so that the client imports no engine module."""
from __future__ import annotations

from dataclasses import dataclass

from flame_llm.protocol.types import MAX_BATCH_REQUESTS
from flame_llm.validate import check_int, check_number

DEFAULT_NAMESPACE = "flame"  # the Ray namespace of a service, unless configured
# switches retired with the older paths they kept (issue 38): (section, field) -> the behaviour that is now the only one
RETIRED = {
    ("client", "flush_formed"): "a call's formed batches are always sent at once",
    ("client", "flow_control"): "a shard always gets at most its admission capacity unanswered",
    ("client", "results_as_finished"): "results always come back as they finish",
    ("client", "local_routing"): "a stream with a prefix placed before always goes without a router call",
    ("client", "stream_transport"): "streams always go over the socket to the shard",
    ("client", "reroute_on_loss"): "a dying shard's requests always go to the other shards at once",
    ("client", "stream_resume"): "a stream whose shard died always goes on from its last token",
    ("shard", "fair_admission"): "callers are always admitted in turn",
}


def check_retired(section: str, fields) -> None:
    """ValueError naming the first retired field among `fields` of `section`, and what replaced it."""
    for f in fields:
        why = RETIRED.get((section, f))
        if why is not None:
            raise ValueError(f"{section} field {f!r} is retired (issue 38): {why}; remove it from the config")


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
