"""The Python client's configuration (the service YAML's `client` section), apart from the service's other
sections so that the client imports no engine module."""
from __future__ import annotations

from dataclasses import dataclass

from flame_llm.protocol.types import MAX_BATCH_REQUESTS
from flame_llm.validate import check, check_bool, check_int, check_number

DEFAULT_NAMESPACE = "flame"  # the Ray namespace of a service, unless configured
STREAM_TRANSPORTS = ("ray", "socket")  # ClientConfig.stream_transport's values


@dataclass(slots=True)
class ClientConfig:
    """The Python client's batching and retries (the `client` section)."""
    max_batch_prompts: int = 128  # a shard's batch leaves at this many prompts,
    batch_window_ms: float = 10.0  # this long after its first one, or at the payload budget
    max_retries: int = 20  # resubmissions of one request (overloaded, draining or dead shard)
    restart_timeout_s: float = 300.0  # how long to wait for a dead shard to come back
    flush_formed: bool = True  # send a generate() call's batches at once (false: the three rules above only)
    flow_control: bool = True  # at most a shard's admission capacity unanswered there (false: rejections retried)
    results_as_finished: bool = True  # each result as it finishes on its shard (false: a batch's results at once)
    overload_deadline_s: float = 300.0  # a request is retried on overloaded shards this long before it fails
    local_routing: bool = True  # a stream with a prefix the router placed before goes without a router call
    stream_transport: str = "socket"  # streams' requests and tokens: "socket" (TCP to the shard) or "ray" (Ray calls)
    # requests a dying shard had in flight go to the other shards at once (its restart, ~20 s for an 8B engine on
    # an H200, is watched meanwhile); false: they wait for the restart, as new requests do on a one-shard service
    reroute_on_loss: bool = True
    stream_resume: bool = True  # a stream whose shard died after its first token goes on from its last token

    def __post_init__(self) -> None:
        w = "client field"
        check_int("max_batch_prompts", self.max_batch_prompts, 1, MAX_BATCH_REQUESTS, where=w)
        check_number("batch_window_ms", self.batch_window_ms, 0, 10_000, where=w)
        check_int("max_retries", self.max_retries, 0, where=w)
        check_number("restart_timeout_s", self.restart_timeout_s, 0, low_open=True, where=w)
        check_bool("flush_formed", self.flush_formed, where=w)
        check_bool("flow_control", self.flow_control, where=w)
        check_bool("results_as_finished", self.results_as_finished, where=w)
        check_number("overload_deadline_s", self.overload_deadline_s, 0, where=w)
        check_bool("reroute_on_loss", self.reroute_on_loss, where=w)
        check_bool("local_routing", self.local_routing, where=w)
        check(self.stream_transport in STREAM_TRANSPORTS, "stream_transport", " or ".join(map(repr, STREAM_TRANSPORTS)),
              self.stream_transport, where=w)
        check_bool("stream_resume", self.stream_resume, where=w)
