"""Issue 42: the block manager's cache events, their log (batches, gaps, snapshots) and one hash for engine and
router."""
import time

import numpy as np
import pytest

from flame_llm import LLM, SamplingParams
from flame_llm.engine.block_manager import BlockManager
from flame_llm.engine.sequence import Sequence
from flame_llm.prefix import revision_seed
from flame_llm.protocol.kv_events import KvEventBatch, KvEventLog, ShardLoad, shard_load
from flame_llm.protocol.routing_key import estimate_prefill_work, prefix_chain

BS = 16
rng = np.random.default_rng(42)


def seq_of(tokens):
    return Sequence(list(tokens), SamplingParams(max_tokens=4), BS)


def prefill(bm: BlockManager, seq: Sequence) -> None:
    assert bm.can_allocate(seq) >= 0
    bm.allocate(seq)
    bm.append_slots(seq, seq.num_tokens - seq.num_computed_tokens)
    seq.num_computed_tokens = seq.num_tokens
    bm.publish(seq)


def test_published_hashes_are_the_routing_keys():
    toks = rng.integers(0, 1000, 70).tolist()
    bm = BlockManager(8, BS, enable_kv_events=True, hash_seed=revision_seed("rev"))
    prefill(bm, seq_of(toks))
    stored = [h for h, kept in bm.kv_events]
    assert stored == prefix_chain(toks, "rev", block=BS, max_tokens=64, hash_block=BS)  # 4 full blocks
    assert prefix_chain(toks, "rev", block=2 * BS, max_tokens=64, hash_block=BS) == stored[1::2]


def test_events_record_stores_evictions_and_clears_in_order():
    bm = BlockManager(4, BS, enable_kv_events=True)
    a, b = seq_of(range(48)), seq_of(range(100, 148))
    prefill(bm, a)
    bm.deallocate(a)
    prefill(bm, b)  # 3 blocks: takes the free one, then evicts 2 of a's
    ops = list(bm.kv_events)
    a_hashes = [h for h, _ in ops[:3]]
    assert [kept for _, kept in ops[:3]] == [True] * 3
    assert sum(1 for _, kept in ops if not kept) == bm.num_evictions == 2
    assert sum(1 for _, kept in ops if kept) == 6
    assert {h for h, kept in ops if not kept} <= set(a_hashes)
    bm.deallocate(b)
    bm.reset_prefix_cache()
    assert bm.kv_events[-1] is None


def test_a_hash_published_twice_is_one_store():
    bm = BlockManager(8, BS, enable_kv_events=True)
    a, b = seq_of(range(32)), seq_of(range(32))
    bm.allocate(a)
    bm.allocate(b)  # both compute the same blocks (neither was published)
    for s in (a, b):
        bm.append_slots(s, 32)
        s.num_computed_tokens = 32
        bm.publish(s)
    assert len(bm.kv_events) == 2  # block 0 and block 1 once each; b's copies shadow a's without an event


def test_flag_off_records_nothing_and_caches_alike():
    toks = [rng.integers(0, 1000, n).tolist() for n in (40, 40, 70)]
    toks[1][:32] = toks[0][:32]
    runs = []
    for events in (False, True):
        bm = BlockManager(6, BS, enable_kv_events=events)
        for t in toks + toks:
            s = seq_of(t)
            prefill(bm, s)
            bm.deallocate(s)
        runs.append((bm.num_hit_tokens, bm.num_evictions, sorted(bm.hash_to_block_id.items()), bm.kv_events))
    assert runs[0][:3] == runs[1][:3] and runs[0][3] is None and runs[1][3]


def test_log_cuts_net_batches_and_serves_cursors():
    bm = BlockManager(4, BS, enable_kv_events=True)
    log = KvEventLog(7, bm, keep=2)
    a = seq_of(range(48))
    prefill(bm, a)
    (b1,) = log.read(0, 0)  # a reader of no epoch yet gets a snapshot
    assert b1.reset and b1.seq == 1 and b1.shard == 7 and len(b1.stored) == 3
    assert log.read(log.epoch, 1) == []
    bm.deallocate(a)
    b = seq_of(range(100, 148))
    prefill(bm, b)
    bm.deallocate(b)
    b2 = log.cut()
    assert b2.seq == 2 and not b2.reset and len(b2.stored) == 3 and len(b2.removed) == 2
    assert not set(b2.stored) & set(b2.removed)
    assert log.read(log.epoch, 1) == [b2]
    assert log.cut() is None  # nothing changed
    for base in (200, 300):
        prefill(bm, seq_of(range(base, base + 16)))
        log.cut()
    assert [b.seq for b in log.read(log.epoch, 2)] == [3, 4]
    (snap,) = log.read(log.epoch, 1)  # batch 2 is no longer kept (keep=2): a snapshot
    assert snap.reset and snap.seq == 4 and set(snap.stored) == set(bm.hash_to_block_id)
    (snap,) = log.read(log.epoch + 1, 4)  # another epoch (a restarted engine's reader)
    assert snap.reset


def test_store_then_evict_in_one_batch_nets_out():
    bm = BlockManager(2, BS, enable_kv_events=True)
    log = KvEventLog(0, bm)
    for base in (0, 100, 200):
        s = seq_of(range(base, base + 32))
        prefill(bm, s)
        bm.deallocate(s)
    b = log.cut()
    assert set(b.stored) == set(bm.hash_to_block_id) and len(b.stored) == 2
    assert not set(b.removed) & set(bm.hash_to_block_id)


def test_log_needs_events_on():
    with pytest.raises(ValueError, match="enable_kv_events"):
        KvEventLog(0, BlockManager(4, BS))
    with pytest.raises(ValueError, match="keep must be >= 1"):
        KvEventLog(0, BlockManager(4, BS, enable_kv_events=True), keep=0)


def test_engine_with_events_hashes_like_the_router_and_generates_alike(tiny_llama):
    doc = rng.integers(0, 200, 64).tolist()
    prompts = [doc + [i, i + 1] for i in range(3)]
    sp = SamplingParams(temperature=0, max_tokens=4)
    outs = []
    for events in (False, True):
        llm = LLM(tiny_llama, block_size=16, enable_kv_events=events, max_num_seqs=1)
        outs.append([(o.output_token_ids, o.num_cached_tokens) for o in llm.generate(prompts, sp, use_tqdm=False)])
        bm = llm.engine.block_manager
        rev = llm.engine.config.model_config.model_revision
    assert outs[0] == outs[1] and outs[1][1][1] == 64
    chain = prefix_chain(doc, rev, block=32, max_tokens=64, hash_block=16)
    assert all(h in bm.hash_to_block_id for h in chain) and bm.kv_events
    assert isinstance(KvEventLog(0, bm).snapshot(), KvEventBatch)


def test_an_undrained_record_is_bounded_and_becomes_a_snapshot(monkeypatch):
    import flame_llm.engine.block_manager as bm_mod
    monkeypatch.setattr(bm_mod, "KV_EVENTS_MAX", 5)
    bm = BlockManager(16, BS, enable_kv_events=True)
    log = KvEventLog(0, bm)
    for base in range(0, 400, 100):
        s = seq_of(range(base, base + 48))
        prefill(bm, s)
        bm.deallocate(s)
    assert len(bm.kv_events) <= 6
    b = log.cut()
    assert b.reset and set(b.stored) == set(bm.hash_to_block_id) and len(b.stored) == 12


# ---- the shard's load with its events (router.load_view 'engines') ---------------------------------------------------
def _log_ops(log: KvEventLog, bm: BlockManager) -> list:
    """One fixed run of cache changes and reads; what each read returned (epochs left out)."""
    out = []
    a = seq_of(range(48))
    prefill(bm, a)
    out.append(log.read(0, 0))
    out.append(log.read(log.epoch, 1))  # nothing changed
    bm.deallocate(a)
    prefill(bm, seq_of(range(100, 148)))
    out.append(log.read(log.epoch, 1))
    out.append(log.read(log.epoch, 2))
    return [[(b.seq, b.stored, b.removed, b.reset, b.load) for b in r] for r in out]


def test_a_log_with_a_load_source_reads_as_before_without_load():
    """The flag off (load_view 'own', 'peers'): a log given the scheduler's sequences but read without with_load
    answers exactly as one without a source (no extra batches, no load)."""
    seqs = [seq_of(range(40))]
    runs = []
    for source in (None, lambda: seqs):
        bm = BlockManager(8, BS, enable_kv_events=True)
        runs.append(_log_ops(KvEventLog(3, bm, sequences=source), bm))
    assert runs[0] == runs[1]
    assert runs[0][1] == [] and runs[0][3] == [] and all(b[4] is None for r in runs[0] for b in r)


def test_read_with_load_cuts_a_batch_and_carries_the_load_on_the_last_only():
    bm = BlockManager(8, BS, enable_kv_events=True)
    waiting = seq_of(range(200, 240))  # 40 prompt tokens, none computed, 4 to decode
    running = Sequence(list(range(300, 332)), SamplingParams(max_tokens=10), BS)
    running.num_computed_tokens = 32
    running.append_token(7, 0.0)  # 1 of 10 decoded
    seqs = [waiting, running]
    log = KvEventLog(0, bm, sequences=lambda: seqs)
    (snap,) = log.read(0, 0, with_load=True)
    assert snap.reset and snap.seq == 1 and snap.load == ShardLoad(estimate_prefill_work(40), 4 + 9, 2)
    (b2,) = log.read(log.epoch, 1, with_load=True)  # nothing changed: an empty batch, so the load has a new stamp
    assert (b2.seq, b2.stored, b2.removed, b2.reset) == (2, [], [], False) and b2.load == snap.load
    prefill(bm, seq_of(range(48)))
    seqs.pop(0)
    b3, b4 = log.read(log.epoch, 2)[0], log.read(log.epoch, 2, with_load=True)
    assert b3.load is None and len(b3.stored) == 3  # a reader without load: the batch as kept
    assert [b.seq for b in b4] == [3, 4] and b4[0].load is None and b4[1].load == ShardLoad(0.0, 9, 1)
    assert all(b.load is None for b in log.batches)  # the kept batches carry none: each reader gets its own
    assert log.read(log.epoch, 4) == []  # and a read without load cuts nothing


def test_with_load_needs_a_load_source():
    bm = BlockManager(4, BS, enable_kv_events=True)
    with pytest.raises(ValueError, match="no load source"):
        KvEventLog(0, bm).read(0, 0, with_load=True)


def test_shard_load_counts_uncomputed_prompt_decode_left_and_rows():
    part = Sequence(list(range(300)), SamplingParams(max_tokens=20), 128)
    part.num_computed_tokens = 256  # a chunked prefill part way, or a prefix-cache hit
    done = Sequence(list(range(64)), SamplingParams(max_tokens=5), 128)
    done.num_computed_tokens = 64
    for t in range(3):
        done.append_token(t, 0.0)
    load = shard_load([part, done])
    assert load == ShardLoad(estimate_prefill_work(300, 256), 20 + 2, 2)
    assert shard_load([]) == ShardLoad(0.0, 0, 0)


def test_scheduler_sequences_are_waiting_then_running_not_retired(tiny_llama):
    from helpers import make_scheduler
    sched = make_scheduler(tiny_llama, max_num_seqs=2)
    seqs = [Sequence(list(range(i, i + 20)), SamplingParams(max_tokens=3, ignore_eos=True), BS) for i in range(3)]
    for s in seqs:
        sched.add(s)
    assert sched.sequences() == tuple(seqs)
    sched.schedule()  # admits two (max_num_seqs), the third waits
    assert sched.sequences() == (seqs[2], seqs[0], seqs[1])
    assert shard_load(sched.sequences()).rows == 3


def test_async_engine_publishes_its_sequences_only_once_asked(tiny_llama):
    import asyncio

    from flame_llm.engine.async_engine import AsyncEngine
    eng = AsyncEngine.from_args(tiny_llama, block_size=16, max_num_seqs=4, enable_kv_events=True)
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    try:
        asyncio.run(eng.generate(list(range(3, 40)), sp))
        assert eng._seqs is None  # never asked: the engine thread published nothing
        assert eng.sequences() == ()  # idle: read from the scheduler, and from now on published

        async def two() -> None:
            tasks = [asyncio.ensure_future(eng.generate(list(range(k, k + 30)), sp)) for k in (50, 90)]
            while not eng.sequences():
                await asyncio.sleep(0.001)
            load = shard_load(eng.sequences())
            assert 1 <= load.rows <= 2 and load.decode_tokens > 0
            await asyncio.gather(*tasks)
        asyncio.run(two())
        # published after the last step (results are handed out within the step, so a moment after them): nothing left
        deadline = time.monotonic() + 10
        while eng.sequences() and time.monotonic() < deadline:
            time.sleep(0.001)
        assert eng.sequences() == ()
    finally:
        eng.shutdown()
