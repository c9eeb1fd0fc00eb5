"""The router's settings (the service YAML's `router` section): RouterConfig, each field checked, naming the field.
The policies are router/policy.py's, the load views router/load_view.py's."""

from __future__ import annotations

from dataclasses import dataclass

from flame_llm.protocol.routing_key import DECODE_TOKEN_COST
from flame_llm.validate import check_bool, check_choice, check_int, check_number

LOAD_VIEWS = ("own", "engines", "peers")
POLICIES = ("cumulative", "load_guarded", "round_robin", "events")
MAX_REPLICAS = 64


@dataclass(slots=True, frozen=True)
class RouterConfig:
    """The router's settings (the service YAML's `router` section); each checked, naming the field."""

    policy: str = "cumulative"  # cumulative | load_guarded | round_robin | events (module doc)
    spill_factor: float = 1.25  # load_guarded: spill when the owner's outstanding work exceeds this x the mean
    max_entries: int = 100_000  # prefix chain hashes remembered (LRU)
    decode_cost: float = DECODE_TOKEN_COST  # one decoded token in prefill-token units
    placement_ttl_s: float = 1.0  # events: how long the router's own placement of a prefix counts
    event_poll_ms: float = 20.0  # events: the router actor pulls the shards' cache events this often
    spill_moves_prefix: bool = False  # load_guarded: a spilled request's prefix moves to the shard it spilled to
    replicas: int = 1  # router actors; N > 1 splits prefixes among them by their first block (router/replicas.py)
    load_view: str = "own"  # own | engines | peers: whose load a replica balances on (router/load_view.py)
    load_choices: int = 1  # engines/peers: an unseen prefix goes to a random one of this many least-loaded shards
    load_grace_s: float = 0.005  # engines: own placements this recent count on top of a shard's load report
    load_row_cost: float = 1000.0  # engines: work a shard's report counts per request it holds (waiting or running)
    load_row_free: int = 4  # engines: the requests a shard holds that load_row_cost does not count
    load_bucket: float = 0.0  # engines/peers: loads within one bucket of work tie (broken by a replica's own order)

    def __post_init__(self) -> None:
        check_choice("policy", self.policy, POLICIES, where="router field")
        check_number("spill_factor", self.spill_factor, 1.0, where="router field")
        check_int("max_entries", self.max_entries, 1, where="router field")
        check_number("decode_cost", self.decode_cost, 0, where="router field")
        check_number("placement_ttl_s", self.placement_ttl_s, 0, where="router field")
        check_number("event_poll_ms", self.event_poll_ms, 1, where="router field")
        check_bool("spill_moves_prefix", self.spill_moves_prefix, where="router field")
        check_int("replicas", self.replicas, 1, MAX_REPLICAS, where="router field")
        check_choice("load_view", self.load_view, LOAD_VIEWS, where="router field")
        check_int("load_choices", self.load_choices, 1, 64, where="router field")
        check_number("load_grace_s", self.load_grace_s, 0, where="router field")
        check_number("load_bucket", self.load_bucket, 0, where="router field")
        check_number("load_row_cost", self.load_row_cost, 0, where="router field")
        check_int("load_row_free", self.load_row_free, 0, 1 << 20, where="router field")
        if self.load_view == "engines" and self.policy != "events":
            raise ValueError(
                f"router field 'load_view' 'engines' reads the shards' load with their cache events: it "
                f"needs policy 'events'; got policy {self.policy!r}"
            )
        if self.load_choices > 1 and self.load_view == "own":
            raise ValueError(
                f"router field 'load_choices' > 1 needs load_view 'engines' or 'peers'; got "
                f"load_choices={self.load_choices} with load_view 'own'"
            )
