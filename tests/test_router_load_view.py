"""Issue 42: router replicas balance on a shared view of load (router/load_view.py): the shards' reported load
('engines') or the other replicas' outstanding work ('peers'); 'own' (the default) places exactly as before."""

import hashlib
import random

import pytest

from flame_llm.engine.sequence import Sequence
from flame_llm.protocol.kv_events import KvEventBatch, ShardLoad, shard_load
from flame_llm.protocol.routing_key import Completion, RouteItem, estimate_prefill_work
from flame_llm.sampling_params import SamplingParams
from router.least import LeastLoaded
from router.policy import RouterConfig, RouterPolicy


class Clock:
    t = 0.0

    def __call__(self):
        return self.t


def item(key, work=2000.0, dec=16):
    return RouteItem([key], work, dec)


def replicas(view, n=2, shards=8, **kw):
    clock = Clock()
    cfg = RouterConfig(policy="events", load_view=view, **kw)
    return clock, [RouterPolicy(shards, cfg, clock=clock, seed=r) for r in range(n)]


def test_own_view_replicas_herd_on_the_same_shard():
    # the problem (session 18): each replica knows only its own placements, so both put a new prefix on shard 0
    _, (a, b) = replicas("own")
    assert a.route_batch([item(1)]) == b.route_batch([item(2)]) == [0]


def test_a_replica_sees_the_other_replicas_placement_in_the_shards_load_report():
    clock, (a, b) = replicas("engines")
    for s in range(8):  # every shard idle, reported
        assert a.apply_load(s, (1, 1), ShardLoad(0.0, 0)) and b.apply_load(s, (1, 1), ShardLoad(0.0, 0))
    (sa,) = a.route_batch([item(1)])
    clock.t = 1.0
    # the engine got a's request and reports it (through the event feed); b applies it and places elsewhere
    b.apply_events([KvEventBatch(sa, 1, 2, [], [], False, load=ShardLoad(2000.0, 16))])
    assert b.view.load[sa] == 2000.0 + 10.0 * 16
    for key in range(2, 9):  # seven more new prefixes: the seven other shards, never sa
        assert b.route_batch([item(key)]) != [sa]
    assert sorted(b.view.load).count(0.0) == 0
    # a report older than the last applied is ignored
    assert not b.apply_load(sa, (1, 1), ShardLoad(0.0, 0)) and b.view.counters["stale_reports"] == 1


def test_a_report_keeps_only_the_placements_made_within_the_grace():
    clock, (a,) = replicas("engines", n=1, load_grace_s=0.005)
    a.apply_load(3, (1, 1), ShardLoad(0.0, 0))
    a.place_batch([item(10, 500.0, 0)], [3])
    clock.t = 1.0
    a.place_batch([item(11, 700.0, 0)], [3])
    assert a.view.load[3] == 1200.0
    # the report counts the placement 1 s old, not yet the one made just now
    a.apply_load(3, (1, 2), ShardLoad(100.0, 1))
    assert a.view.load[3] == 100.0 + 10.0 + 700.0


def test_row_cost_counts_the_requests_a_shard_reports_past_the_free_ones():
    _, (a,) = replicas("engines", n=1, load_row_cost=2500.0, load_row_free=2)
    a.apply_load(1, (1, 1), ShardLoad(0.0, 40, 5))  # five rows decoding: three past the two free
    a.apply_load(2, (1, 1), ShardLoad(0.0, 8, 1))
    assert a.view.load[1] == 10.0 * 40 + 2500.0 * 3 and a.view.load[2] == 80.0


def test_a_shard_that_never_reports_counts_as_the_replicas_own_work():
    _, (a,) = replicas("engines", n=1)
    (s,) = a.route_batch([item(1)])
    assert a.view.load[s] == a._outstanding[s] > 0
    a.complete(s, 2000.0, 16, 2048, 0)
    assert a.view.load[s] == 0.0


def test_peers_view_adds_the_other_replicas_outstanding_work():
    _, (a, b) = replicas("peers")
    (sa,) = a.route_batch([item(1)])
    b.set_peer_load(a.outstanding())
    assert b.route_batch([item(2)]) != [sa]
    assert b.view.load[sa] == a.outstanding()[sa]
    with pytest.raises(ValueError, match="one value per shard"):
        b.set_peer_load([0.0])
    with pytest.raises(ValueError, match="needs load_view 'peers'"):
        replicas("engines")[1][0].set_peer_load([0.0] * 8)
    with pytest.raises(ValueError, match="needs load_view 'engines'"):
        b.apply_load(0, (1, 1), ShardLoad(0.0, 0))


def test_loads_within_a_bucket_tie_and_replicas_break_ties_differently():
    _, reps = replicas("engines", n=4, shards=64, load_bucket=512.0)
    for r in reps:
        for s in range(64):
            r.apply_load(s, (1, 1), ShardLoad(float(s), 0))  # 0..63: all in the first bucket
    firsts = {r.route_batch([item(1)])[0] for r in reps}
    assert len(firsts) > 1  # not all four on shard 0, as exact least-loaded would do


def test_replicas_prefer_their_home_shards_among_tied_loads():
    clock = Clock()
    cfg = RouterConfig(policy="events", load_view="engines", load_bucket=512.0)
    reps = [RouterPolicy(8, cfg, clock=clock, seed=r, home=(r, 2)) for r in range(2)]
    for r, p in enumerate(reps):
        for s in range(8):
            p.apply_load(s, (1, 1), ShardLoad(0.0, 0))
        got = []
        for key in range(4):
            clock.t += 0.01
            got += p.route_batch([item(100 * r + key, 100.0, 0)])
        assert sorted(got) == [s for s in range(8) if s % 2 == r]  # its four home shards, least recently used first
    # a busier home shard (another bucket) loses to an idle shard of the other replica's home
    reps[0].apply_load(0, (1, 2), ShardLoad(5000.0, 0))
    for s in (2, 4, 6):
        reps[0].apply_load(s, (1, 2), ShardLoad(5000.0, 0))
    assert reps[0].route_batch([item(999)])[0] % 2 == 1


def test_with_a_view_a_hit_spills_only_when_its_owner_is_over_in_the_view_too():
    def setup(view):
        _, (p,) = replicas(view, n=1, shards=4)
        p.apply_events([KvEventBatch(0, 1, 1, [7], [], True)])  # shard 0 holds prefix 7
        for _ in range(3):  # this router's own counts: shard 0 well over the mean
            p.place_batch([item(50, 3000.0, 0)], [0])
        return p

    assert setup("own").route_batch([item(7, 1000.0)]) != [0]  # own counts alone: spills
    p = setup("engines")
    for s in range(4):  # the engines say shard 0 is as idle as the others (its work done)
        p.apply_load(s, (1, 2), ShardLoad(0.0, 0))
    assert p.route_batch([item(7, 1000.0)]) == [0]  # stays with its holder: no recompute


def test_one_of_n_replicas_spills_on_the_view_alone():
    cfg = RouterConfig(policy="events", load_view="engines")
    got = {}
    for home in (None, (0, 2)):
        p = RouterPolicy(4, cfg, home=home)
        p.apply_events([KvEventBatch(0, 1, 1, [7], [], True)])  # shard 0 holds prefix 7
        for s in range(4):  # the other replicas' work: shard 0 is far over, in the engines' reports only
            p.apply_load(s, (1, 2), ShardLoad(9000.0 if s == 0 else 0.0, 0))
        got[home] = p.route_batch([item(7, 1000.0)])[0]
    assert got[None] == 0  # one router: its own counts (nothing placed) say the owner is not over
    assert got[(0, 2)] != 0  # a replica: the view alone decides


def test_choices_pick_among_the_least_loaded():
    _, (a,) = replicas("engines", n=1, shards=16, load_choices=3)
    for s in range(16):
        a.apply_load(s, (1, 1), ShardLoad(0.0 if s in (4, 9, 13) else 5000.0, 0))
    assert a.route_batch([item(1)])[0] in (4, 9, 13)


def test_least_loaded_smallest():
    load, cum = [5.0, 1.0, 3.0, 1.0], [0.0, 2.0, 0.0, 1.0]
    heap = LeastLoaded(load, cum)
    load[0] = 0.5
    heap.changed(0)
    assert heap.smallest(3) == [0, 3, 1] and heap.least() == 0 and heap.smallest(9) == [0, 3, 1, 2]


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        (dict(load_view="shared"), "load_view"),
        (dict(load_view="engines", load_choices=0), "load_choices"),
        (dict(load_choices=2), "load_choices' > 1 needs load_view"),
        (dict(load_view="engines", load_grace_s=-1.0), "load_grace_s"),
        (dict(load_view="engines", load_bucket=-1.0), "load_bucket"),
        (dict(load_view="engines", load_row_cost=-1.0), "load_row_cost"),
        (dict(load_view="engines", load_row_free=-1), "load_row_free"),
        (dict(load_view="engines", policy="load_guarded"), "'engines' reads the shards' load .* needs policy 'events'"),
    ],
)
def test_bad_load_view_config_names_the_field(kw, match):
    with pytest.raises(ValueError, match=match):
        RouterConfig(**{"policy": "events", **kw})


def test_shard_load_of_a_schedulers_sequences():
    a = Sequence(list(range(300)), SamplingParams(max_tokens=20), 128)
    b = Sequence(list(range(100)), SamplingParams(max_tokens=8), 128)
    a.num_computed_tokens = 128
    load = shard_load([a, b])
    assert load.decode_tokens == 28 and load.rows == 2
    assert load.prefill_work == pytest.approx(estimate_prefill_work(300, 128) + estimate_prefill_work(100))


# Digests of the shards chosen on one seeded workload by the base commit's router (2008eb1, before load_view)
BASE_DIGESTS = {
    "cumulative": "e733ab4bb7825150",
    "load_guarded": "e27b774fcbf1d070",
    "round_robin": "f987f9c9a13536de",
    "events": "967ec6f63def11ce",
}


def trace(policy: str) -> str:
    rng, clock = random.Random(7), Clock()
    p = RouterPolicy(16, RouterConfig(policy=policy), clock=clock)
    docs = [[rng.getrandbits(63) for _ in range(rng.randint(1, 6))] for _ in range(40)]
    live, out, seq = [], [], [0] * 16
    for step in range(300):
        clock.t += 0.01
        items = []
        for _ in range(rng.randint(1, 5)):
            d = docs[int(rng.paretovariate(1.2)) % len(docs)]
            items.append(RouteItem(d[: rng.randint(1, len(d))], float(rng.randint(100, 3000)), rng.randint(1, 64)))
        shards = p.route_batch(items, [rng.randrange(16)] if step % 37 == 5 else [])
        out += shards
        live += list(zip(items, shards))
        if policy == "events" and step % 3 == 0:
            s = rng.randrange(16)
            seq[s] += 1
            stored = [it.chain[-1] for it, sh in live[-20:] if sh == s]
            p.apply_events([KvEventBatch(s, 1, seq[s], stored, [], seq[s] == 1)])
        while len(live) > 30:
            (_, w, dec), s = live.pop(0)
            p.complete_many([Completion(s, w, dec, int(w), int(w) // 3)])
        if step % 97 == 50:
            p.drop_shard(rng.randrange(16))
    assert p.view is None  # the default load_view 'own' builds no view
    return hashlib.sha256(repr(out).encode()).hexdigest()[:16]


@pytest.mark.parametrize("policy", sorted(BASE_DIGESTS))
def test_load_view_off_places_exactly_as_before(policy):
    assert RouterConfig().load_view == "own"
    assert trace(policy) == BASE_DIGESTS[policy]
