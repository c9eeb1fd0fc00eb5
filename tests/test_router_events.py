"""Issue 42: the router's per-shard holdings from cache events, and the events policy (holdings first, its own
recent placements second, load always)."""
import pytest

from flame_llm.protocol.kv_events import KvEventBatch
from flame_llm.protocol.routing_key import RouteItem
from router.holdings import Holdings
from router.policy import RouterConfig, RouterPolicy


def batch(shard, seq, stored=(), removed=(), reset=False, epoch=1):
    return KvEventBatch(shard, epoch, seq, list(stored), list(removed), reset)


def test_holdings_apply_in_order_and_a_gap_asks_for_a_snapshot():
    h = Holdings(3)
    assert not h.apply(batch(0, 1, [10, 11]))  # no cursor yet: a snapshot first
    assert h.apply(batch(0, 4, [10, 11], reset=True))
    assert h.apply(batch(0, 5, [12], [10]))
    assert h.apply(batch(0, 5, [10])) and h.counters["stale"] == 1 and not h.holders(10)  # already applied
    assert h.holders(11) == {0} and h.holders(12) == {0} and not h.holders(10)
    assert not h.apply(batch(0, 7, [13]))  # seq 6 is missing
    assert not h.apply(batch(0, 6, [13], epoch=2))  # a restarted engine
    assert not h.holders(13) and h.counters["gaps"] == 3
    assert h.apply(batch(1, 1, [11], reset=True))
    assert h.holders(11) == {0, 1}
    h.drop_shard(0)
    assert h.holders(11) == {1} and not h.holders(12) and not h.apply(batch(0, 6, [1]))
    with pytest.raises(ValueError, match="batch.shard"):
        h.apply(batch(3, 1, reset=True))


def item(chain, work=1000.0):
    return RouteItem(list(chain), work, 16)


class Clock:
    t = 0.0

    def __call__(self):
        return self.t


def test_events_policy_follows_what_the_engines_hold():
    clock = Clock()
    p = RouterPolicy(4, RouterConfig(policy="events", placement_ttl_s=1.0), clock=clock)
    assert p.apply_events([batch(2, 1, [1, 2], reset=True), batch(3, 1, [1], reset=True)]) == []
    assert p.route_batch([item([1, 2, 3])]) == [2]  # deepest held key: 2 on shard 2
    (s,) = p.route_batch([item([1, 9])])  # key 1 held by 2 and 3: the less loaded (3)
    assert s == 3
    # shard 2 evicts 2 and 1: the next question on [1, 2] goes to the other holder of 1, not to the old owner
    assert p.apply_events([batch(2, 2, removed=[1, 2])]) == []
    clock.t = 2.0  # past the TTL of the router's own placement of [1, 2, 3] on shard 2
    assert p.route_batch([item([1, 2, 3])]) == [3]
    # gap: reported, not applied
    assert p.apply_events([batch(3, 5, removed=[1])]) == [3] and p.holdings.holders(1) == {3}


def test_events_policy_uses_recent_placements_within_the_ttl():
    clock = Clock()
    p = RouterPolicy(3, RouterConfig(policy="events", placement_ttl_s=1.0), clock=clock)
    (s,) = p.route_batch([item([5, 6])])  # nobody holds it: least loaded, placed
    clock.t = 0.5
    assert p.route_batch([item([5, 6, 7])]) == [s] and p.counters["recent"] == 1  # not published yet
    p.complete(s, 1000.0, 16, 512, 0)
    p.complete(s, 1000.0, 16, 512, 0)
    clock.t = 2.0  # stale: the placement no longer counts, and no shard published it: a new prefix
    assert p.route_batch([item([5, 6])]) != [s] and p.counters["new"] == 2
    # a held key wins over a placement at the same depth
    p.apply_events([batch(2, 1, [8], reset=True)])
    p.route_batch([item([8])], avoid=[2])  # placed on 0 or 1
    assert p.route_batch([item([8])]) == [2]


def test_events_policy_keeps_the_load_guard_and_avoids():
    p = RouterPolicy(2, RouterConfig(policy="events", spill_factor=1.25))
    p.apply_events([batch(0, 1, [1], reset=True)])
    shards = p.route_batch([item([1], work=1.0)] * 8 + [item([1], work=1.0)])
    assert shards.count(0) < 9 and p.counters["spill"] >= 1  # the holder is overloaded: spills
    assert p.route_batch([item([1])], avoid=[0]) == [1]


def test_apply_events_needs_the_events_policy():
    with pytest.raises(ValueError, match="needs policy 'events'"):
        RouterPolicy(2).apply_events([batch(0, 1, reset=True)])
    with pytest.raises(ValueError, match="placement_ttl_s"):
        RouterConfig(placement_ttl_s=-1.0)


def test_least_loaded_heap_answers_as_the_scan_does():
    import random

    from router.least import LeastLoaded
    rnd = random.Random(0)
    load, cum = [0.0] * 7, [0.0] * 7
    ll = LeastLoaded(load, cum)
    for _ in range(2000):
        s = rnd.randrange(7)
        if rnd.random() < 0.6:
            w = float(rnd.choice([1, 2, 5]))
            load[s] += w
            cum[s] += w
        else:
            load[s] = max(0.0, load[s] - float(rnd.choice([1, 2, 5])))
        ll.changed(s)
        assert ll.least() == min(range(7), key=lambda i: (load[i], cum[i]))
    assert len(ll.heap) <= 4 * 7 + 1


def test_service_config_refuses_events_routing_without_engine_events():
    from flame_llm.serving.service_config import ServiceConfig
    with pytest.raises(ValueError, match="set the engine field 'enable_kv_events' to true"):
        ServiceConfig.from_kwargs(policy="events")
    assert ServiceConfig.from_kwargs(policy="events", enable_kv_events=True).router.policy == "events"


def test_event_poll_interval_is_checked():
    with pytest.raises(ValueError, match="router field 'event_poll_ms' must be a number >= 1"):
        RouterConfig(event_poll_ms=0.5)
