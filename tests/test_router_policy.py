import numpy as np
import pytest

from flame_llm.prefix import hash_block, revision_seed
from flame_llm.protocol.routing_key import (
    ATTN_CROSSOVER_TOKENS,
    DECODE_TOKEN_COST,
    Completion,
    RouteItem,
    estimate_prefill_work,
    prefix_chain,
)
from router.policy import RouterConfig, RouterPolicy

rng = np.random.default_rng(0)


def _tokens(n: int) -> list[int]:
    return rng.integers(0, 50_000, n).tolist()


# ---- prefix identity ----

def test_chain_is_the_engine_block_chain_seeded_with_the_revision():
    toks = _tokens(600)
    chain = prefix_chain(toks, "rev")
    e = [hash_block(toks[:128], revision_seed("rev"))]  # the engine's 128-token blocks, chained from the seed
    for i in range(1, 4):
        e.append(hash_block(toks[128 * i:128 * (i + 1)], e[-1]))
    assert chain == [e[1], e[3]]  # a 256-token routing block's key: its last engine block's; no partial block
    assert prefix_chain(toks, "rev", block=128) == e
    assert prefix_chain(toks, "rev", block=256, hash_block=256) == [hash_block(toks[:256], revision_seed("rev")),
                                                                    hash_block(toks[256:512], hash_block(
                                                                        toks[:256], revision_seed("rev")))]


def test_shared_prefix_shares_the_chain_prefix():
    doc = _tokens(512)
    a, b = prefix_chain(doc + _tokens(700), "r"), prefix_chain(doc + _tokens(700), "r")
    assert a[:2] == b[:2] and a[2] != b[2] and len(a) == len(b) == 4
    assert prefix_chain(np.array(doc + [1] * 300, np.uint32), "r")[:2] == a[:2]  # arrays hash like lists


def test_revision_salts_the_chain():
    toks = _tokens(1024)
    a, b = prefix_chain(toks, "rev-1"), prefix_chain(toks, "rev-2")
    assert not set(a) & set(b)


def test_only_the_first_1024_tokens_count():
    doc = _tokens(1024)
    a, b = prefix_chain(doc + _tokens(7000), "r"), prefix_chain(doc + _tokens(100), "r")
    assert a == b and len(a) == 4
    assert len(prefix_chain(_tokens(8192), "r", block=128, max_tokens=2048)) == 16


def test_short_prompt_gets_one_key_over_all_its_tokens():
    toks = _tokens(100)
    assert prefix_chain(toks, "r") == [hash_block(toks, revision_seed("r"))]
    assert prefix_chain(toks, "r") != prefix_chain(toks[:99], "r")
    assert prefix_chain(toks + _tokens(200), "r")[0] != prefix_chain(toks, "r")[0]  # documented


@pytest.mark.parametrize("kw, match", [
    ({"token_ids": []}, "at least 1 token"),
    ({"block": 0}, "block must be >= 1"),
    ({"block": 512, "max_tokens": 256}, "max_tokens >= block"),
    ({"block": 200}, "multiple of hash_block"),
    ({"block": 256, "hash_block": 0}, "multiple of hash_block"),
])
def test_chain_rejects_bad_arguments(kw, match):
    args = {"token_ids": [1, 2], "model_revision": "r", **kw}
    with pytest.raises(ValueError, match=match):
        prefix_chain(**args)


def test_work_estimates():
    assert estimate_prefill_work(0) == 0.0
    assert estimate_prefill_work(1000) == pytest.approx(1000 + 1000**2 / 2 / ATTN_CROSSOVER_TOKENS)
    # quadratic: an 8K prompt costs more than 8x a 1K prompt; a cached prefix removes its share
    assert estimate_prefill_work(8192) > 8 * estimate_prefill_work(1024)
    assert estimate_prefill_work(8192, 8192) == 0.0
    # the uncached second half attends over more keys than the first half did
    assert estimate_prefill_work(8192) / 2 < estimate_prefill_work(8192, 4096) < estimate_prefill_work(8192)
    assert DECODE_TOKEN_COST * 16 > estimate_prefill_work(16)  # a decoded token costs more than a prefilled one
    for n, c in [(-1, 0), (10, 11), (10, -1)]:
        with pytest.raises(ValueError, match=f"num_tokens={n}, cached_tokens={c}"):
            estimate_prefill_work(n, c)


# ---- policies ----

def _chain(*blocks):
    return list(blocks)


@pytest.mark.parametrize("kw, match", [
    ({"num_shards": 0}, "num_shards must be an integer >= 1; got 0"),
    ({"num_shards": 2.0}, "num_shards"),
    ({"policy": "random"}, "router field 'policy' must be one of 'cumulative', 'load_guarded', 'round_robin', "
                           "'events'; got 'random'"),
    ({"spill_factor": 0.9}, "router field 'spill_factor' must be a number >= 1.0; got 0.9"),
    ({"max_entries": 0}, "router field 'max_entries' must be an integer >= 1; got 0"),
    ({"decode_cost": -1}, "router field 'decode_cost' must be a number >= 0"),
    ({"spill_moves_prefix": 1}, "router field 'spill_moves_prefix' must be"),
])
def test_policy_rejects_bad_config(kw, match):
    num_shards = kw.pop("num_shards", 2)
    with pytest.raises(ValueError, match=match):
        RouterPolicy(num_shards, RouterConfig(**kw))


@pytest.mark.parametrize("items, match", [
    ([([1], 1.0)], "item 0 must be \\(chain, est_prefill_work, est_decode_tokens\\)"),
    ([([1], 1.0, 0), ([], 1.0, 0)], "item 1: chain must hold at least 1 hash; got 0"),
    ([([1], -1.0, 0)], "item 0: est_prefill_work and est_decode_tokens must be >= 0; got -1.0, 0"),
    ([([1], float("nan"), 0)], "must be >= 0"),
    ([([1], 1.0, -2)], "must be >= 0; got 1.0, -2"),
])
def test_route_batch_rejects_bad_items_without_changing_state(items, match):
    p = RouterPolicy(2)
    with pytest.raises(ValueError, match=match):
        p.route_batch(items)
    assert p.stats() == RouterPolicy(2).stats()


def test_cumulative_keeps_a_prefix_on_its_shard_across_and_within_batches():
    p = RouterPolicy(4)
    burst = [(_chain(1, 2, 3, 4), 100.0, 16)] * 8  # one new document asked 8 times in one batch
    first = p.route_batch(burst)
    assert len(set(first)) == 1
    assert p.counters["new"] == 1 and p.counters["hit"] == 7
    other = p.route_batch([(_chain(9, 10, 11, 12), 100.0, 16)])[0]
    assert other != first[0]  # the unseen prefix went to a shard with less cumulative work
    # shares the first two blocks with the burst: longest known match wins
    assert p.route_batch([(_chain(1, 2, 7, 8), 100.0, 16)] * 3) == [first[0]] * 3
    assert p.stats()["entries"] == 4 + 4 + 2


def test_cumulative_balances_unseen_prefixes_by_estimated_work():
    p = RouterPolicy(2)
    works = [8.0] + [1.0] * 8
    shards = p.route_batch([(_chain(i), w, 0) for i, w in enumerate(works)])
    assert shards == [0] + [1] * 8
    st = p.stats()["shards"]
    assert st[0]["cumulative_work"] == st[1]["cumulative_work"] == 8.0
    # the seed's policy balances what was ever routed, not what is outstanding
    p.complete_many([(s, w, 0, 10, 0) for s, w in zip(shards, works, strict=True)])
    p.route_batch([(_chain(100), 50.0, 0)])
    assert p.route_batch([(_chain(101), 1.0, 0), (_chain(100), 1.0, 0)]) == [1, 0]


def test_cumulative_never_spills_a_hot_prefix():
    p = RouterPolicy(2)
    assert set(p.route_batch([(_chain(5, 6), 1000.0, 100)] * 50)) == {0}
    assert p.counters["spill"] == 0


def test_load_guarded_spills_a_hot_prefix_and_returns_when_load_drops():
    p = RouterPolicy(2, RouterConfig("load_guarded", spill_factor=1.25))
    shards = p.route_batch([(_chain(5, 6), 100.0, 0)] * 20)
    owner = shards[0]
    assert p.counters["spill"] > 0 and shards.count(owner) > shards.count(1 - owner)
    st = p.stats()["shards"]
    # the owner stays within the guard: never above 1.25x the mean by more than one request
    assert st[owner]["outstanding_work"] <= 1.25 * (st[0]["outstanding_work"] + st[1]["outstanding_work"]) / 2 + 100
    p.complete_many([(s, 100.0, 0, 4096, 2048) for s in shards])
    assert p.route_batch([(_chain(5, 6), 100.0, 0)]) == [owner]  # the spill did not move the prefix
    assert p.stats()["shards"][owner]["cached_tokens"] == 2048 * shards.count(owner)


@pytest.mark.parametrize("moves", [False, True])
def test_spill_moves_prefix_flag(moves):
    """router.spill_moves_prefix: off (the default), a spill leaves the prefix with its owner, as before; on, the
    prefix follows the request to the shard it spilled to."""
    p = RouterPolicy(2, RouterConfig("load_guarded", spill_moves_prefix=moves))
    assert RouterConfig().spill_moves_prefix is False
    assert p.route_batch([(_chain(1, 2), 1000.0, 0)]) == [0]
    assert p.route_batch([(_chain(1, 2), 100.0, 0)]) == [1] and p.counters["spill"] == 1
    p.complete(0, 1000.0, 0, 1000, 0)
    p.complete(1, 100.0, 0, 1000, 0)
    assert p.route_batch([(_chain(1, 2), 10.0, 0)]) == [1 if moves else 0]


def test_load_guarded_longest_match_beats_a_shorter_one():
    p = RouterPolicy(2, RouterConfig("load_guarded"))
    assert p.route_batch([(_chain(1, 2), 1000.0, 0)]) == [0]
    assert p.route_batch([(_chain(1, 3), 100.0, 0)]) == [1]  # owner 0 overloaded by more than 100: spill
    assert p.counters["spill"] == 1
    assert p.route_batch([(_chain(1, 3), 100.0, 0)]) == [1]  # longest match (3) is on shard 1
    p.complete(0, 1000.0, 0, 1000, 0)
    assert p.route_batch([(_chain(1, 4), 10.0, 0)]) == [0]  # only block 1 known: its owner, 0


def test_load_guarded_keeps_the_start_of_a_burst_on_a_new_prefix_together():
    """Two shards, questions on one new document: moving the second question would recompute the
    whole document elsewhere, which costs more than the imbalance it would fix. (Hits are charged
    full work, so a longer burst does spill: the documented limit.)"""
    p = RouterPolicy(2, RouterConfig("load_guarded"))
    doc_work = estimate_prefill_work(8256)
    assert len(set(p.route_batch([(_chain(7, 8), doc_work, 16)] * 2))) == 1
    assert p.counters["spill"] == 0
    assert p.route_batch([(_chain(7, 8), doc_work, 16)] * 2).count(1) >= 1 and p.counters["spill"] >= 1


def test_load_guarded_counts_decode_work():
    for policy, expect in [("load_guarded", 1), ("cumulative", 0)]:
        p = RouterPolicy(2, RouterConfig(policy, decode_cost=10.0))
        assert p.route_batch([(_chain(1), 1.0, 1000), (_chain(2), 100.0, 0)]) == [0, 1]
        assert p.route_batch([(_chain(3), 1.0, 0)]) == [expect], policy


def test_complete_lowers_outstanding_and_records_cache_hits():
    p = RouterPolicy(2, RouterConfig("load_guarded", decode_cost=2.0))
    p.route_batch([(_chain(1), 10.0, 5)])
    assert p.stats()["shards"][0]["outstanding_work"] == 20.0
    p.complete(0, 10.0, 5, prompt_tokens=1000, cached_tokens=750)
    s = p.stats()["shards"][0]
    assert s["outstanding_work"] == 0.0 and s["completed"] == 1
    assert (s["prompt_tokens"], s["cached_tokens"], s["cached_fraction"]) == (1000, 750, 0.75)
    assert s["actual_prefill_work"] == estimate_prefill_work(1000, 750)
    p.complete(0, 10.0, 5, 10, 0)  # a late completion never drives outstanding below zero
    assert p.stats()["shards"][0]["outstanding_work"] == 0.0


@pytest.mark.parametrize("args, match", [
    ((2, 1.0, 0, 10, 0), "shard must be an integer in \\[0, 2\\); got 2"),
    ((-1, 1.0, 0, 10, 0), "shard must be"),
    ((0, -1.0, 0, 10, 0), "completion needs"),
    ((0, 1.0, 0, 10, 11), "0 <= cached_tokens <= prompt_tokens; got 1.0, 0, 11, 10"),
])
def test_complete_rejects_bad_values(args, match):
    with pytest.raises(ValueError, match=match):
        RouterPolicy(2).complete(*args)


def test_drop_shard_forgets_its_prefixes_and_load():
    p = RouterPolicy(2)
    a, b = p.route_batch([(_chain(1, 2), 10.0, 0), (_chain(3, 4), 10.0, 0)])
    assert (a, b) == (0, 1)
    p.drop_shard(0)
    st = p.stats()
    assert st["entries"] == 2 and st["counters"]["dropped"] == 2 and st["shards"][0]["outstanding_work"] == 0
    assert p.route_batch([(_chain(3, 4), 1.0, 0)]) == [1]  # other shard's prefixes kept
    new_before = p.counters["new"]
    assert p.route_batch([(_chain(1, 2), 1.0, 0)]) == [0]  # routed as unseen, to the idle shard
    assert p.counters["new"] == new_before + 1
    with pytest.raises(ValueError, match="shard must be an integer in \\[0, 2\\); got 5"):
        p.drop_shard(5)


def test_lru_map_is_bounded_and_refreshed_on_use():
    p = RouterPolicy(3, RouterConfig(max_entries=8))
    p.route_batch([(_chain(1, 2, 3, 4), 1.0, 0), (_chain(5, 6, 7, 8), 1.0, 0)])
    p.route_batch([(_chain(1, 2, 3, 4), 1.0, 0)])  # refresh prefix A
    p.route_batch([(_chain(9, 10, 11, 12), 1.0, 0)])  # evicts B, the least recently used
    st = p.stats()
    assert st["entries"] == 8 and st["counters"]["evicted"] == 4
    hits = p.counters["hit"]
    p.route_batch([(_chain(1, 2, 3, 4), 1.0, 0)])
    assert p.counters["hit"] == hits + 1
    p.route_batch([(_chain(5, 6, 7, 8), 1.0, 0)])
    assert p.counters["new"] == 4  # A, B, C, and B again
    assert p.stats()["entries"] <= 8


def test_a_move_takes_only_the_avoided_shards_blocks():
    """A prompt whose longest known block is on an avoided shard moves that shard's blocks; a shorter prefix a
    healthy shard owns (and has cached) stays with it."""
    r = RouterPolicy(3)
    assert r.route_batch([(_chain(1), 10.0, 0), (_chain(5), 10.0, 0)]) == [0, 1]
    assert r.route_batch([(_chain(1, 2), 1.0, 0)]) == [0]  # 0 owns blocks 1 and 2
    r._owner[2] = 1  # block 2 on shard 1 (as a spill leaves it), block 1 still on shard 0
    assert r.route_batch([(_chain(1, 2, 3), 1.0, 0)], avoid=[1]) == [2]  # longest known is on 1: moves
    assert r.route_batch([(_chain(1), 1.0, 0)]) == [0]  # the healthy owner of the shorter prefix keeps it
    assert r.route_batch([(_chain(1, 2), 1.0, 0)]) == [2]


def test_avoided_shards_get_nothing_and_their_prefixes_move():
    p = RouterPolicy(3)
    assert p.route_batch([(_chain(1, 2), 10.0, 0), (_chain(3), 10.0, 0), (_chain(4), 10.0, 0)]) == [0, 1, 2]
    # shard 0 drains: its prefix moves to the least-loaded other shard (a tie: the lower index), and stays
    assert p.route_batch([(_chain(1, 2, 5), 1.0, 0)], avoid=[0]) == [1]
    assert p.counters["moved"] == 1
    assert p.route_batch([(_chain(1, 2), 1.0, 0)]) == [1]
    assert set(p.route_batch([(_chain(100 + i), 0.0, 0) for i in range(6)], avoid=[0, 2])) == {1}
    rr = RouterPolicy(3, RouterConfig("round_robin"))
    assert rr.route_batch([(_chain(1), 1.0, 0)] * 4, avoid=[1]) == [0, 2, 0, 2]
    before = p.stats()
    with pytest.raises(ValueError, match="avoid must leave at least one shard; got \\[0, 1, 2\\] of 3"):
        p.route_batch([(_chain(1), 1.0, 0)], avoid=[0, 1, 2])
    with pytest.raises(ValueError, match="shard must be an integer in \\[0, 3\\); got 7"):
        p.route_batch([(_chain(1), 1.0, 0)], avoid=[7])
    assert p.stats() == before


def test_round_robin_alternates_ignoring_prefixes():
    p = RouterPolicy(3, RouterConfig("round_robin"))
    assert p.route_batch([(_chain(1), 1.0, 0)] * 4) == [0, 1, 2, 0]
    assert p.route_batch([(_chain(1), 1.0, 0)] * 2) == [1, 2]
    st = p.stats()
    assert st["counters"]["round_robin"] == 6 and st["counters"]["hit"] == 0 and st["entries"] == 0


def test_stats_shape():
    st = RouterPolicy(2, RouterConfig("load_guarded", spill_factor=1.5)).stats()
    assert st["policy"] == "load_guarded" and st["spill_factor"] == 1.5 and len(st["shards"]) == 2
    assert set(st["counters"]) == {"hit", "new", "spill", "moved", "round_robin", "evicted", "dropped",
                                   "placed", "held", "recent"}


def test_a_placement_told_after_the_fact_counts_as_a_routed_request():
    """A client that placed a request itself (place_batch) leaves the policy as route_batch would have: the
    prefix registered to that shard, its work outstanding until completed, its cumulative work charged."""
    routed, placed = RouterPolicy(2), RouterPolicy(2)
    first = RouteItem([1, 2], 100.0, 4)
    again = RouteItem([1, 2, 3], 100.0, 4)
    (s,) = routed.route_batch([first])
    placed.route_batch([first])
    assert routed.route_batch([again]) == [s]
    placed.place_batch([again], [s])
    a, b = routed.stats()["shards"], placed.stats()["shards"]
    for key in ("outstanding_work", "cumulative_work", "routed"):
        assert [x[key] for x in a] == [x[key] for x in b]
    assert placed.counters["placed"] == 1 and placed._owner[3] == s  # the chain's new block is registered
    # an unseen prefix placed by the client (a one-shard client) is registered too: the router answers it next
    placed.place_batch([RouteItem([9], 10.0, 1)], [1])
    assert placed.route_batch([RouteItem([9, 10], 10.0, 1)]) == [1]
    placed.complete_many([Completion(s, 100.0, 4, 200, 100)])
    left = a[s]["outstanding_work"] - (100.0 + 4 * placed.decode_cost)
    assert placed.stats()["shards"][s]["outstanding_work"] == left


def test_place_batch_checks_its_input_and_changes_nothing_on_a_bad_item():
    p = RouterPolicy(2)
    with pytest.raises(ValueError, match="one shard per item"):
        p.place_batch([RouteItem([1], 1.0, 1)], [])
    with pytest.raises(ValueError, match="shard must be an integer in"):
        p.place_batch([RouteItem([1], 1.0, 1)], [2])
    with pytest.raises(ValueError, match="item 1: chain must hold"):
        p.place_batch([RouteItem([1], 1.0, 1), RouteItem([], 1.0, 1)], [0, 0])
    assert p.stats()["entries"] == 0 and p.counters["placed"] == 0
