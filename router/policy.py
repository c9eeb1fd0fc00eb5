"""Pure routing policy: which shard serves each request of a formed batch. No Ray here.

Requests arrive as RouteItems (prefix chain, estimated prefill work, estimated decode tokens) and come back
as Completions, both from `flame_llm.protocol.routing_key`. The policy sees only what it is given at routing
time and the completions fed back; it never looks at labels or future requests.

Policies:
- cumulative (the seed's): the longest known block-chain match goes to its shard; an unseen prefix
  goes to the shard with the least cumulative estimated prefill work, which keeps it.
- load_guarded: the longest known match goes to its shard unless that shard's outstanding estimated
  work (prefill + decode, not yet completed) exceeds spill_factor x the mean outstanding and its gap
  to the least-loaded shard exceeds spill_factor x the request's own prefill work (what a spill
  would recompute);
  then it spills to the least-loaded shard. An unseen prefix goes to the least-loaded shard.
- round_robin: plain alternation, ignoring prefixes (the baseline of the affinity A/B).
- events: from what the engines hold (issue 42): the deepest chain key some shard's prefix cache holds
  (`apply_events`: the shards' KvEventBatches, router/holdings.py) goes to its least-loaded holder; failing
  that, the deepest key this router placed within placement_ttl_s (its prefill may not be published yet);
  failing that, the least-loaded shard. A placement deeper than the holdings wins over them. The load guard
  of load_guarded applies to the choice.

Load view (load_view, router/load_view.py): 'own' (the default) balances on this router's own outstanding counts, as
before; with N replicas 'engines' adds the load the shards report with their cache events, 'peers' the outstanding
work the other replicas last told, and load_choices k > 1 picks at random among the k least-loaded.

A client may place a request itself (place_batch: a stream whose prefix it learned from earlier answers, or any
request of a one-shard service) and tell the router after the fact, without waiting: the placement is
registered and counted exactly as a routed request's, so outstanding work and cumulative work stay right.

A caller may name shards to avoid (draining, or lost): a prefix they own moves to the least-loaded shard
of the others, and unseen prefixes go only to the others.

Assignments are registered while routing, so a burst sharing a new prefix stays together even inside
one batch. A spilled request does not move its prefix (unless spill_moves_prefix): the owner keeps the matched
blocks, the spill shard gets only blocks nobody had. The chain -> shard map is an LRU bounded by max_entries.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Sequence

from flame_llm.protocol.kv_events import KvEventBatch, ShardLoad
from flame_llm.protocol.routing_key import Completion, RouteItem, estimate_prefill_work
from router.config import MAX_REPLICAS, POLICIES, RouterConfig  # noqa: F401 - imported from here too
from router.holdings import Holdings
from router.least import LeastLoaded
from router.load_view import LoadView


class RouterPolicy:

    def __init__(self, num_shards: int, config: RouterConfig | None = None,
                 clock: Callable[[], float] = time.monotonic, seed: int | None = None,
                 home: tuple[int, int] | None = None) -> None:
        if not isinstance(num_shards, int) or num_shards < 1:
            raise ValueError(f"num_shards must be an integer >= 1; got {num_shards!r}")
        config = config or RouterConfig()
        self.num_shards = num_shards
        self.config = config
        self.policy = config.policy
        self.spill_factor = float(config.spill_factor)
        self.max_entries = config.max_entries
        self.decode_cost = float(config.decode_cost)
        self._owner: OrderedDict[int, int] = OrderedDict()  # chain hash -> shard, LRU order
        self._outstanding = [0.0] * num_shards  # estimated work routed, not yet completed
        self._total_outstanding = 0.0
        self._cumulative = [0.0] * num_shards  # estimated prefill work ever routed
        self._routed = [0] * num_shards
        self._completed = [0] * num_shards
        self._prompt_tokens = [0] * num_shards
        self._cached_tokens = [0] * num_shards
        self._actual_work = [0.0] * num_shards  # prefill work from the cached counts results report
        self._next_rr = 0
        self._by_load = LeastLoaded(self._outstanding, self._cumulative)  # the scans of _least in O(log n)
        self._by_cum = LeastLoaded(self._cumulative, self._cumulative)
        # events: the shards' cache holdings, and this router's placements (chain hash -> (shard, when)), LRU order
        self.holdings = Holdings(num_shards) if config.policy == "events" else None
        self._recent: OrderedDict[int, tuple[int, float]] = OrderedDict()
        self.clock, self.placement_ttl_s = clock, float(config.placement_ttl_s)
        # what placement balances on: own outstanding counts, or a LoadView that adds the other replicas' work
        self.view = None if config.load_view == "own" else LoadView(
            config.load_view, self._outstanding, self.decode_cost, float(config.load_grace_s), clock,
            config.load_choices, config.load_bucket, seed, home, float(config.load_row_cost),
            config.load_row_free)
        self._load = self._outstanding if self.view is None else self.view.load
        self._replicas = 1 if home is None else home[1]  # routers sharing the shards (this one is home[0])
        self.counters = {"hit": 0, "new": 0, "spill": 0, "moved": 0, "round_robin": 0, "evicted": 0, "dropped": 0,
                         "placed": 0, "held": 0, "recent": 0}

    def route_batch(self, items: Sequence[RouteItem], avoid: Collection[int] = ()) -> list[int]:
        """Shard per request of one formed batch, in order, never one in `avoid`. Validates the whole batch
        first, so a bad item leaves the policy unchanged."""
        avoid = set(avoid)
        for s in avoid:
            self._check_shard(s)
        allowed = [s for s in range(self.num_shards) if s not in avoid]
        if not allowed:
            raise ValueError(f"avoid must leave at least one shard; got {sorted(avoid)} of {self.num_shards}")
        self._check_items(items)
        cum, counters = self._cumulative, self.counters
        n = self.num_shards
        shards = []
        for chain, work, dec in items:
            if self.policy == "round_robin":
                s = self._next_rr
                while s in avoid:
                    s = (s + 1) % n
                self._next_rr = (s + 1) % n
                counters["round_robin"] += 1
            else:
                known = self._longest_match(chain) if self.holdings is None else self._events_match(chain, avoid)
                moved = known in avoid
                move_from = avoid if moved else ()
                if known is None or moved:
                    s = self._least(cum if self.policy == "cumulative" else self._load, allowed)
                    counters["moved" if moved else "new"] += 1
                elif self.policy in ("load_guarded", "events") and self._should_spill(known, work):
                    s = self._least(self._load, allowed)
                    counters["spill"] += 1
                    move_from = (known,) if self.config.spill_moves_prefix else ()
                else:
                    s = known
                    counters["hit"] += 1
                self._register(chain, s, move_from)
            self._charge(s, work, dec)
            shards.append(s)
        return shards

    def place_batch(self, items: Sequence[RouteItem], shards: Sequence[int]) -> None:
        """Requests a client placed itself (items[i] on shards[i]): registered and charged as routed ones are (a
        prefix a healthy shard owns stays with it; the rest of the chain goes to the shard given)."""
        if len(items) != len(shards):
            raise ValueError(f"place_batch needs one shard per item; got {len(shards)} for {len(items)}")
        for s in shards:
            self._check_shard(s)
        self._check_items(items)
        for (chain, work, dec), s in zip(items, shards, strict=True):
            if self.policy != "round_robin":
                self._register(chain, s, ())
            self._charge(s, work, dec)
            self.counters["placed"] += 1

    @staticmethod
    def _check_items(items: Sequence[RouteItem]) -> None:
        for i, item in enumerate(items):
            if len(item) != 3:
                raise ValueError(f"item {i} must be (chain, est_prefill_work, est_decode_tokens); got {item!r:.80}")
            chain, work, dec = item
            if len(chain) == 0:
                raise ValueError(f"item {i}: chain must hold at least 1 hash; got 0")
            if not work >= 0 or not dec >= 0:
                raise ValueError(f"item {i}: est_prefill_work and est_decode_tokens must be >= 0; "
                                 f"got {work!r}, {dec!r}")

    def _register(self, chain: Sequence[int], s: int, moved_from: Collection[int]) -> None:
        """Refresh what is known, register the rest to s (and the blocks of the shards in moved_from; a healthy
        shard keeps what it has cached). events: record the placement of the whole chain on s, with its time."""
        if self.holdings is not None:
            recent, now = self._recent, self.clock()
            for h in chain:
                recent[h] = (s, now)
                recent.move_to_end(h)
            while len(recent) > self.max_entries:
                recent.popitem(last=False)
            return
        owner = self._owner
        for h in chain:
            if h not in owner:
                owner[h] = s
            else:
                if owner[h] in moved_from:
                    owner[h] = s
                owner.move_to_end(h)
        while len(owner) > self.max_entries:
            owner.popitem(last=False)
            self.counters["evicted"] += 1

    def _charge(self, s: int, work: float, dec: int) -> None:
        load = work + self.decode_cost * dec
        self._outstanding[s] += load
        self._total_outstanding += load
        self._cumulative[s] += work
        self._by_load.changed(s)
        self._by_cum.changed(s)
        if self.view is not None:
            self.view.charged(s, load)
        self._routed[s] += 1

    def _should_spill(self, owner: int, work: float) -> bool:
        """The owner is over spill_factor x the mean outstanding work, and its gap to the least-loaded
        shard exceeds spill_factor x the prefill work the request would redo there (that shard has
        none of the prefix). The second condition keeps the first requests of a burst on a new prefix
        together. Known limit: a hit is charged its full estimated work (the router does not know how
        much of the prompt the owner has cached beyond the first 1,024 tokens), so a long burst on one
        prefix still spills after a couple of requests; `cumulative` never spills. With a load view: one router
        needs both its own counts and the view over; one of N replicas (its counts a share) the view alone."""
        view = self.view
        if view is not None and self._replicas > 1:
            # N replicas: its own counts are a share of each shard's work; the view alone says who is over
            load = view.load
            if load[owner] <= self.spill_factor * view.total / self.num_shards:
                return False
            return load[owner] - load[view.heap.least()] > self.spill_factor * work
        out = self._outstanding
        if out[owner] <= self.spill_factor * self._total_outstanding / self.num_shards:
            return False
        if out[owner] - out[self._by_load.least()] <= self.spill_factor * work:
            return False
        # one router with a view: the owner must be over in the view too (the shards' real load)
        return view is None or view.load[owner] - view.load[view.heap.least()] > self.spill_factor * work

    def _longest_match(self, chain: Sequence[int]) -> int | None:
        owner = self._owner
        for h in reversed(chain):
            s = owner.get(h)
            if s is not None:
                return s
        return None

    def _events_match(self, chain: Sequence[int], avoid: Collection[int]) -> int | None:
        """events: the least-loaded shard holding the chain's deepest held key, unless this router placed a
        deeper key within placement_ttl_s (then that placement's shard); None when neither knows the chain."""
        out, recent, holders = self._load, self._recent, self.holdings.holders
        horizon = self.clock() - self.placement_ttl_s
        for h in reversed(chain):
            held = [s for s in holders(h) if s not in avoid] if avoid else holders(h)
            if held:
                self.counters["held"] += 1
                return min(held, key=out.__getitem__)
            placed = recent.get(h)
            if placed is not None and placed[1] >= horizon and placed[0] not in avoid:
                self.counters["recent"] += 1
                return placed[0]
        return None

    def apply_events(self, batches: Sequence[KvEventBatch]) -> list[int]:
        """events: apply the shards' cache event batches in order; the shards whose batch did not follow the one
        applied before (a gap, or a restarted engine): ask each for a snapshot and apply that."""
        if self.holdings is None:
            raise ValueError(f"apply_events needs policy 'events'; this router's is {self.policy!r}")
        gaps = sorted({b.shard for b in batches if not self.holdings.apply(b)})
        if self.view is not None and self.view.mode == "engines":
            for b in batches:
                if b.load is not None:  # a load report stands alone (its stamp orders it), gap or not
                    self.apply_load(b.shard, (b.epoch, b.seq), b.load)
        return gaps

    def apply_load(self, shard: int, stamp: tuple[int, int], load: ShardLoad) -> bool:
        """load_view 'engines': shard's load as of stamp (epoch, seq); False for one older than the last applied."""
        self._check_shard(shard)
        if self.view is None or self.view.mode != "engines":
            raise ValueError(f"apply_load needs load_view 'engines'; this router's is {self.config.load_view!r}")
        return self.view.report(shard, stamp, load)

    def outstanding(self) -> list[float]:
        """This router's own outstanding work per shard (what load_view 'peers' exchanges)."""
        return list(self._outstanding)

    def set_peer_load(self, peer_load: Sequence[float]) -> None:
        """load_view 'peers': the other replicas' outstanding work per shard, summed."""
        if self.view is None or self.view.mode != "peers":
            raise ValueError(f"set_peer_load needs load_view 'peers'; this router's is {self.config.load_view!r}")
        if len(peer_load) != self.num_shards:
            raise ValueError(f"peer_load needs one value per shard ({self.num_shards}); got {len(peer_load)}")
        self.view.set_peers(peer_load)

    def _least(self, load: list[float], allowed: Sequence[int]) -> int:
        # ties go to the shard with less cumulative work, then the lower index
        if len(allowed) == self.num_shards:
            if self.view is not None and load is self._load:
                return self.view.least()
            return (self._by_load if load is self._outstanding else self._by_cum).least()
        cum = self._cumulative
        return min(allowed, key=lambda i: (load[i], cum[i]))

    def complete(self, shard: int, est_work: float, est_decode_tokens: int, prompt_tokens: int,
                 cached_tokens: int) -> None:
        """One finished request: its routing-time estimates leave the shard's outstanding work and
        its actual prompt/cached token counts are recorded."""
        self._check_shard(shard)
        if not est_work >= 0 or not est_decode_tokens >= 0 or not 0 <= cached_tokens <= prompt_tokens:
            raise ValueError("completion needs est_work >= 0, est_decode_tokens >= 0 and 0 <= cached_tokens "
                             f"<= prompt_tokens; got {est_work!r}, {est_decode_tokens!r}, {cached_tokens!r}, "
                             f"{prompt_tokens!r}")
        # a completion may arrive after drop_shard reset the shard; never go below zero
        done = min(self._outstanding[shard], est_work + self.decode_cost * est_decode_tokens)
        self._outstanding[shard] -= done
        self._by_load.changed(shard)
        if self.view is not None:
            self.view.completed(shard)
        self._total_outstanding = max(0.0, self._total_outstanding - done)
        self._completed[shard] += 1
        self._prompt_tokens[shard] += prompt_tokens
        self._cached_tokens[shard] += cached_tokens
        self._actual_work[shard] += estimate_prefill_work(prompt_tokens, cached_tokens)

    def complete_many(self, completions: Sequence[Completion]) -> None:
        """complete() for each Completion (shard, est_prefill_work, est_decode_tokens, prompt_tokens,
        cached_tokens)."""
        for c in completions:
            self.complete(*c)

    def drop_shard(self, shard: int) -> None:
        """Forget a restarted shard's prefixes (its engine is cold) and its outstanding work (its
        in-flight requests are gone; the client resubmits them)."""
        self._check_shard(shard)
        if self.holdings is not None:
            self.holdings.drop_shard(shard)
            self._recent = OrderedDict((h, v) for h, v in self._recent.items() if v[0] != shard)
        before = len(self._owner)
        self._owner = OrderedDict((h, s) for h, s in self._owner.items() if s != shard)
        self.counters["dropped"] += before - len(self._owner)
        self._total_outstanding = max(0.0, self._total_outstanding - self._outstanding[shard])
        self._outstanding[shard] = 0.0
        self._by_load.changed(shard)
        if self.view is not None:
            self.view.drop_shard(shard)

    def _check_shard(self, shard: int) -> None:
        if not isinstance(shard, int) or not 0 <= shard < self.num_shards:
            raise ValueError(f"shard must be an integer in [0, {self.num_shards}); got {shard!r}")

    def stats(self) -> dict:
        shards = []
        for s in range(self.num_shards):
            prompt = self._prompt_tokens[s]
            shards.append({
                "shard": s, "outstanding_work": self._outstanding[s], "cumulative_work": self._cumulative[s],
                "actual_prefill_work": self._actual_work[s], "routed": self._routed[s],
                "completed": self._completed[s], "prompt_tokens": prompt, "cached_tokens": self._cached_tokens[s],
                "cached_fraction": self._cached_tokens[s] / prompt if prompt else 0.0,
            })
        return {"policy": self.policy, "num_shards": self.num_shards, "spill_factor": self.spill_factor,
                "entries": len(self._owner) + len(self._recent), "max_entries": self.max_entries,
                "counters": dict(self.counters),
                "shards": shards, **({"holdings": self.holdings.stats()} if self.holdings is not None else {}),
                **({"view": {"mode": self.view.mode, "load": list(self.view.load), **self.view.counters}}
                   if self.view is not None else {})}
