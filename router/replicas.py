"""Router scale-out, pure (issue 42): N router replicas share the prefix space by consistent hashing on a
prompt's first chain key (the engine's block hash of its first routing block, flame_llm.protocol.routing_key), and a
client caches routes with a TTL. The ring's points are that same hash function (flame_llm.prefix.hash_block) over
(replica, point), VNODES per replica.

Each replica is a RouterPolicy ('events') fed the cache events of every shard, so any replica can route any
prefix from the engines' holdings; the ring only decides which replica's own recent placements and load counts
a prefix uses. A dead replica's points leave the ring: its share moves to the next replicas clockwise, which
already hold every shard's holdings, so nothing but its recent placements (a TTL's worth) is lost. A revived
replica starts empty and resyncs from every shard's snapshot before it takes its share back.

RouteCache: a client's answers (deepest chain key -> shard, when), so a stream on a document routed within
ttl_s goes to its shard without a router call; the owner replica is told after (RouterPolicy.place_batch)."""

from __future__ import annotations

import bisect
from collections import OrderedDict
from collections.abc import Collection, Sequence

from flame_llm.prefix import hash_block, revision_seed

ROUTER_NAME = "flame-router"


def replica_name(base: str, replica: int) -> str:
    """Replica 0 keeps the one router's name (replicas=1 is the service as before); replica r > 0 is base-r."""
    return base if replica == 0 else f"{base}-{replica}"

VNODES = 256  # ring points per replica: with 2-4 replicas the shares stay within a few percent of even
_RING_SEED = revision_seed("flame-router-ring")


class ReplicaRing:
    """Consistent hashing of chain keys onto replicas 0..num_replicas-1, `vnodes` points each."""

    def __init__(self, num_replicas: int, vnodes: int = VNODES) -> None:
        if not isinstance(num_replicas, int) or num_replicas < 1:
            raise ValueError(f"num_replicas must be an integer >= 1; got {num_replicas!r}")
        if vnodes < 1:
            raise ValueError(f"vnodes must be >= 1; got {vnodes!r}")
        self.num_replicas = num_replicas
        points = sorted((hash_block((r, v), _RING_SEED), r) for r in range(num_replicas) for v in range(vnodes))
        self._keys = [k for k, _ in points]
        self._owners = [r for _, r in points]
        self.alive = set(range(num_replicas))

    def owner(self, key: int) -> int:
        """The live replica whose share holds `key` (the first point clockwise from it owned by a live one)."""
        if not self.alive:
            raise ValueError("no router replica is alive")
        i, n = bisect.bisect_left(self._keys, key), len(self._keys)
        for j in range(n):
            r = self._owners[(i + j) % n]
            if r in self.alive:
                return r
        raise AssertionError("a live replica owns points")

    def owner_of(self, chain: Sequence[int]) -> int:
        """The live replica that routes a prompt: the owner of its first routing block's key (chain[0])."""
        assert chain, "a prompt has at least one chain key"
        return self.owner(chain[0])

    def kill(self, replica: int) -> None:
        self.alive.discard(replica)

    def revive(self, replica: int) -> None:
        if not 0 <= replica < self.num_replicas:
            raise ValueError(f"replica must be in [0, {self.num_replicas}); got {replica!r}")
        self.alive.add(replica)

    def shares(self, keys: Sequence[int]) -> dict[int, int]:
        """How many of `keys` each live replica owns (to check a share moved)."""
        out: dict[int, int] = {}
        for k in keys:
            r = self.owner(k)
            out[r] = out.get(r, 0) + 1
        return out


class RouteCache:
    """A client's recent routes: chain key -> (shard, when), bounded LRU, each valid for ttl_s."""

    def __init__(self, ttl_s: float, max_entries: int = 100_000) -> None:
        if not ttl_s >= 0:
            raise ValueError(f"ttl_s must be >= 0; got {ttl_s!r}")
        self.ttl_s, self.max_entries = float(ttl_s), max_entries
        self._routes: OrderedDict[int, tuple[int, float]] = OrderedDict()
        self.hits = self.misses = 0

    def lookup(self, chain: Sequence[int], now: float, avoid: Collection[int] = ()) -> int | None:
        """The shard of the chain's deepest key routed within ttl_s (not in avoid), or None: ask a router."""
        horizon = now - self.ttl_s
        for h in reversed(chain):
            got = self._routes.get(h)
            if got is not None and got[1] >= horizon and got[0] not in avoid:
                self.hits += 1
                return got[0]
        self.misses += 1
        return None

    def learn(self, chain: Sequence[int], shard: int, now: float) -> None:
        """A router's answer: the whole chain is on `shard` from now."""
        routes = self._routes
        for h in chain:
            routes[h] = (shard, now)
            routes.move_to_end(h)
        while len(routes) > self.max_entries:
            routes.popitem(last=False)

    def drop_shard(self, shard: int) -> None:
        self._routes = OrderedDict((h, v) for h, v in self._routes.items() if v[0] != shard)
