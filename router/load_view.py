"""A router replica's shared view of the shards' load (issue 42, router.load_view), for RouterPolicy.

With N router replicas each replica charges only the work it placed itself, so an unseen prefix goes to the shard
that is least loaded *as that replica knows it*, and the replicas pile new prefixes on the same shards. A LoadView
adds the others' work to a replica's counts:

- 'engines': each shard reports its real load with its cache events (KvEventBatch.load: the prefill work of the
  prompt tokens it has not computed yet, the tokens it has still to decode and its requests, waiting and running).
  A shard's view is its last report (with row_cost per request past row_free: a new prefill delays every running
  row) plus the work this replica placed there since, less the placements older than grace_s at the report (those
  the report already counts); completions change nothing (the next report does). A shard that has not reported
  (engines that publish no load) counts as in 'own': this replica's outstanding work.
- 'peers': the replicas exchange their outstanding work per shard every so often (set_peers); a shard's view is
  this replica's own outstanding work plus the others' as last heard (stale by up to the exchange period).

Either way an unseen prefix goes to the least of the view (LeastLoaded; loads within one `bucket` of work tie), ties
broken by the replica's home shards first (replica r of N: shard s with s % N == r), then the least recently placed,
then its own random order of the shards (seeded), so replicas that place at about the same moment on the same view
mostly pick different shards; with choices k > 1 it goes to a random one of the
k least. RouterPolicy keeps its own outstanding counts (and its load guard on them); 'own' has no LoadView at all:
the same placement as before the view existed."""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable, Sequence

from flame_llm.protocol.kv_events import ShardLoad
from router.config import LOAD_VIEWS
from router.least import LeastLoaded

AWAY = 1e12  # a tie order term that puts the shards of other replicas' homes after this one's
MAX_SINCE = 4096  # placements remembered per shard between two of its load reports


class LoadView:
    def __init__(
        self,
        mode: str,
        own: list[float],
        decode_cost: float,
        grace_s: float,
        clock: Callable[[], float],
        choices: int = 1,
        bucket: float = 0.0,
        seed: int | None = None,
        home: tuple[int, int] | None = None,
        row_cost: float = 0.0,
        row_free: int = 0,
    ) -> None:
        assert mode in LOAD_VIEWS[1:] and choices >= 1
        n = len(own)
        self.mode, self.own, self.decode_cost, self.grace_s, self.clock = mode, own, decode_cost, grace_s, clock
        self.load = list(own)  # the view: what RouterPolicy balances on
        self.total = sum(self.load)
        self.peer = [0.0] * n  # peers: the other replicas' outstanding work, as last heard
        self.reported = [0.0] * n  # engines: each shard's last report (prefill work + decode_cost x decode tokens)
        self.stamp: list[tuple[int, int] | None] = [None] * n  # engines: the (epoch, seq) of that report
        # engines: (when, work) placed since the shard's last report, the last MAX_SINCE
        self.since: list[deque[tuple[float, float]]] = [deque(maxlen=MAX_SINCE) for _ in range(n)]
        self.choices, self.rng = choices, random.Random(seed)
        # ties break by when this replica last placed work on the shard (least recently first: new prefixes spread over
        # the near-idle shards instead of refilling the one that just finished), then its own random order (a jitter)
        # unit of work), so replicas that place at the same moment on the same view mostly pick different shards
        self.last, self.jitter = [0.0] * n, [r / n * 1e-6 for r in self.rng.sample(range(n), n)]
        self.tie = [0.0] * n
        self.row_cost, self.row_free = row_cost, row_free  # engines: work per request a shard holds past row_free
        self.bucket = bucket  # loads within one bucket of work tie (0: exact loads)
        # home (replica r of N): among ties, shards s with s % N == r come first (the others' home shards after)
        self.away = [0 if home is None or s % home[1] == home[0] else 1 for s in range(n)]
        self.key = [self._key(x, s) for s, x in enumerate(self.load)]
        self.tie = [self._tie(s) for s in range(n)]
        self.heap = LeastLoaded(self.key, self.tie)
        self.counters = {"reports": 0, "stale_reports": 0, "peer_updates": 0}

    def _key(self, load: float, s: int) -> float:
        return float(int(load / self.bucket)) if self.bucket > 0 else load

    def _tie(self, s: int) -> float:
        return AWAY * self.away[s] + self.last[s] + self.jitter[s]

    def _set(self, s: int, value: float) -> None:
        self.total += value - self.load[s]
        self.load[s] = value
        key, tie = self._key(value, s), self._tie(s)
        if key != self.key[s] or tie != self.tie[s]:
            self.key[s], self.tie[s] = key, tie
            self.heap.changed(s)

    def charged(self, s: int, work: float) -> None:
        """This replica placed `work` on shard s (already in its own outstanding counts)."""
        self.last[s] = self.clock()
        if self.mode == "engines":
            if self.stamp[s] is None:  # no report from this shard yet: its own counts, as 'own' has them
                self._set(s, self.own[s])
                return
            self.since[s].append((self.clock(), work))
        self._set(s, self.load[s] + work)

    def completed(self, s: int) -> None:
        """This replica's outstanding work on s fell (a completion, a dropped shard)."""
        if self.mode == "peers":
            self._set(s, self.own[s] + self.peer[s])
        elif self.stamp[s] is None:
            self._set(s, self.own[s])

    def report(self, s: int, stamp: tuple[int, int], load: ShardLoad) -> bool:
        """engines: shard s's load as of (epoch, seq); an older report than the last applied is ignored (False)."""
        if self.stamp[s] is not None and stamp <= self.stamp[s]:
            self.counters["stale_reports"] += 1
            return False
        self.stamp[s] = stamp
        rows = max(0, load.rows - self.row_free)
        self.reported[s] = load.prefill_work + self.decode_cost * load.decode_tokens + self.row_cost * rows
        since, horizon = self.since[s], self.clock() - self.grace_s
        while since and since[0][0] < horizon:
            since.popleft()
        self._set(s, self.reported[s] + sum(w for _, w in since))
        self.counters["reports"] += 1
        return True

    def set_peers(self, peer_load: Sequence[float]) -> None:
        """peers: the other replicas' outstanding work per shard, summed."""
        assert len(peer_load) == len(self.peer)
        self.peer = list(peer_load)
        for s in range(len(self.peer)):
            self._set(s, self.own[s] + self.peer[s])
        self.counters["peer_updates"] += 1

    def drop_shard(self, s: int) -> None:
        """A restarted shard: cold, its requests gone."""
        self.peer[s] = self.reported[s] = 0.0
        self.since[s].clear()
        self.stamp[s] = None
        self._set(s, self.own[s])

    def least(self) -> int:
        """The least-loaded shard of the view, or with choices k > 1 a random one of the k least."""
        if self.choices == 1:
            return self.heap.least()
        return self.rng.choice(self.heap.smallest(self.choices))
