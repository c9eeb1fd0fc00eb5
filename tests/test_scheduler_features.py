"""Scheduler features (chunked prefill, LRU free list, cache-aware order): every flag off replays the
original two-phase schedule exactly; every flag on keeps outputs and KV contents correct."""
import random

import pytest
from helpers import (
    BS,
    MAX_TOKENS,
    FakeRunner,
    expected_outputs,
    make_prompts,
    make_scheduler,
    make_workload,
    replay,
    trace_digest,
)

from flame_llm import LLM
from flame_llm.config import SCHEDULER_FEATURES_OFF
from flame_llm.engine.block_manager import BlockManager
from flame_llm.engine.outputs import SchedulerOutput, SpeculativeOutput
from flame_llm.engine.scheduler import Scheduler
from flame_llm.engine.sequence import Sequence, SequenceStatus
from flame_llm.sampling_params import SamplingParams


class OriginalScheduler(Scheduler):
    """The pre-feature two-phase policy, frozen verbatim from commit 1c08e51 (the reference); schedule() only
    wraps its tuple in today's SchedulerOutput and counts the step launched, as Scheduler.schedule does."""

    def schedule(self) -> SchedulerOutput:
        seqs, num_tokens = self.frozen_schedule()
        out = SchedulerOutput(seqs, num_tokens, [s.num_computed_tokens for s in seqs], sum(num_tokens), 0.0, False)
        if seqs:
            self._launched(out)
        return out

    def frozen_schedule(self) -> tuple[list[Sequence], list[int]]:
        bm = self.block_manager
        scheduled: list[Sequence] = []
        num_tokens: list[int] = []
        num_batched = 0
        while self.waiting and len(scheduled) < self.max_num_seqs:
            seq = self.waiting[0]
            cached = bm.can_allocate(seq)
            if cached < 0 or num_batched + seq.num_tokens - cached > self.max_num_batched_tokens:
                break
            bm.allocate(seq)
            n = seq.num_tokens - seq.num_computed_tokens
            bm.append_slots(seq, n)
            num_batched += n
            seq.status = SequenceStatus.RUNNING
            self.waiting.popleft()
            self.running.append(seq)
            scheduled.append(seq)
            num_tokens.append(n)
        if scheduled:
            return scheduled, num_tokens
        while self.running and len(scheduled) < self.max_num_seqs:
            seq = self.running.popleft()
            while not bm.can_append(seq, 1):
                if self.running:
                    self.preempt(self.running.pop())
                else:
                    self.preempt(seq)
                    break
            else:
                bm.append_slots(seq, 1)
                scheduled.append(seq)
        self.running.extendleft(reversed(scheduled))
        return scheduled, [1] * len(scheduled)


# (workload seed, requests, KV blocks, prefix caching, aborts at step) -> the original code's trace digest,
# recorded with the scheduler and block manager of commit 1c08e51, and the counts that make it meaningful
RECORDED = [
    ((0, 40, 24, True, {5: "r3", 40: "r27"}), "9f17e7f09334ea33ae7d359876261fedf45bdf909748b5cc6dce1a6b8a09a77e",
     dict(steps=101, num_preemptions=3, prefix_hit_tokens=272, evictions=77)),
    ((1, 50, 40, False, {}), "f6dcaad92a86dfdb0fc8c31899008e067f6244c6cfe276f0bd4f261c751aa6fc",
     dict(steps=126, num_preemptions=10, prefix_hit_tokens=0, evictions=0)),
    ((2, 60, 14, True, {}), "3e87af26e2839fc2f9ce55275431c8ca6baf1d4fcc63bd5ab9efc9e4630c77a6",
     dict(steps=225, num_preemptions=19, prefix_hit_tokens=801, evictions=117)),
]


@pytest.mark.parametrize("case,digest,counts", RECORDED, ids=["preempt-abort", "nocache", "tight-pool"])
def test_flags_off_replays_the_recorded_original_schedule(tiny_llama, case, digest, counts):
    seed, n, num_blocks, caching, aborts = case
    sched = make_scheduler(tiny_llama, num_blocks, enable_prefix_caching=caching)
    trace, outputs = replay(sched, make_workload(seed, n), aborts)
    st = sched.stats()
    assert dict(steps=len(trace), **{k: st[k] for k in counts if k != "steps"}) == counts
    assert trace_digest(trace, outputs) == digest


@pytest.mark.parametrize("seed,num_blocks", [(0, 24), (2, 14), (4, 10), (5, 64)])
def test_flags_off_matches_frozen_original_step_by_step(tiny_llama, seed, num_blocks):
    work = make_workload(seed, 60)
    new_trace, new_out = replay(make_scheduler(tiny_llama, num_blocks), work, {7: "r1"})
    old_trace, old_out = replay(make_scheduler(tiny_llama, num_blocks, OriginalScheduler), work, {7: "r1"})
    for step, (a, b) in enumerate(zip(new_trace, old_trace)):
        assert a == b, f"step {step} differs"
    assert len(new_trace) == len(old_trace) and new_out == old_out


FLAG_SETS = [dict(enable_chunked_prefill=c, enable_lru=lru, enable_cache_aware_schedule=lpm, enable_prefix_dedup=dd,
                  enable_same_step_prefix_sharing=sh)
             for c in (False, True) for lru in (False, True) for lpm in (False, True) for dd in (False, True)
             for sh in (False, True)]


@pytest.mark.parametrize("flags", FLAG_SETS, ids=lambda f: "-".join(k[7:11] for k, v in f.items() if v) or "off")
@pytest.mark.parametrize("seed,num_blocks,budget", [(0, 24, 128), (3, 10, 40)])
def test_every_flag_combination_keeps_outputs_and_kv_correct(tiny_llama, flags, seed, num_blocks, budget):
    work = make_workload(seed, 60)
    sched = make_scheduler(tiny_llama, num_blocks, cache_aware_window=8, cache_aware_max_skips=3,
                           max_num_batched_tokens=budget if flags["enable_chunked_prefill"] else 128, **flags)
    trace, outputs = replay(sched, work)  # the fake runner checks every KV read of every step
    assert [outputs[f"r{i}"][0] for i in range(len(work))] == expected_outputs(work, 128)
    st = sched.stats()
    assert st["num_prefill_tokens"] + st["num_decode_tokens"] == sum(n for step in trace for _, n in step)
    assert st["num_prefill_steps"] + st["num_decode_steps"] == sum(1 for step in trace if step)
    if num_blocks == 10:
        assert st["num_preemptions"] > 0
    if flags["enable_chunked_prefill"]:
        assert st["num_mixed_steps"] > 0
        assert max(sum(n for _, n in step) for step in trace) <= budget
    else:
        assert st["num_mixed_steps"] == 0


def seq_of(tokens, max_tokens: int = 8, rid: str | None = None) -> Sequence:
    return Sequence(list(tokens), SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True), BS, rid)


def step(sched: Scheduler, runner: FakeRunner) -> list[tuple[str, int]]:
    scheduled = sched.schedule()
    if scheduled.seqs:
        sched.update_from_output(runner.run(scheduled))
    return [(s.request_id, n) for s, n in zip(scheduled.seqs, scheduled.num_scheduled_tokens)]


def test_chunked_prefill_serves_decodes_first_then_chunks_the_budget(tiny_llama):
    sched = make_scheduler(tiny_llama, 64, enable_chunked_prefill=True, max_num_batched_tokens=32)
    runner = FakeRunner(BS)
    for i in range(3):
        sched.add(seq_of(range(10 + i, 15 + i), max_tokens=6, rid=f"d{i}"))
    assert step(sched, runner) == [("d0", 5), ("d1", 5), ("d2", 5)]
    long = seq_of(range(100, 170), max_tokens=2, rid="long")
    sched.add(long)
    assert step(sched, runner) == [("d0", 1), ("d1", 1), ("d2", 1), ("long", 29)]
    assert long.num_computed_tokens == 29 and len(long.block_table) == 2  # blocks for this chunk only
    assert long.num_completion_tokens == 0  # a chunk short of the end samples nothing
    assert step(sched, runner) == [("d0", 1), ("d1", 1), ("d2", 1), ("long", 29)]
    assert step(sched, runner) == [("d0", 1), ("d1", 1), ("d2", 1), ("long", 12)]  # final chunk
    assert long.num_completion_tokens == 1 and long.first_token_time is not None
    assert step(sched, runner) == [("d0", 1), ("d1", 1), ("d2", 1), ("long", 1)]
    assert long.is_finished
    assert step(sched, runner) == [("d0", 1), ("d1", 1), ("d2", 1)]
    assert sched.is_finished()
    st = sched.stats()
    assert (st["num_prefill_steps"], st["num_mixed_steps"], st["num_decode_steps"]) == (4, 3, 2)
    assert (st["num_prefill_tokens"], st["num_decode_tokens"]) == (15 + 70, 3 * 5 + 1)


def test_chunked_prefill_still_computes_the_last_token_of_a_fully_cached_prompt(tiny_llama):
    sched = make_scheduler(tiny_llama, 64, enable_chunked_prefill=True, max_num_batched_tokens=32)
    runner = FakeRunner(BS)
    first = seq_of(range(50, 82), max_tokens=1, rid="a")  # exactly two blocks
    sched.add(first)
    assert step(sched, runner) == [("a", 32)]
    again = seq_of(range(50, 82), max_tokens=1, rid="b")
    sched.add(again)
    assert step(sched, runner) == [("b", 16)]  # the block holding the last token is recomputed
    assert again.num_cached_tokens == 16 and again.completion_token_ids == first.completion_token_ids


def test_chunked_prefill_preempts_the_newest_partial_prefill_and_keeps_its_written_blocks(tiny_llama):
    sched = make_scheduler(tiny_llama, 6, enable_chunked_prefill=True, max_num_batched_tokens=32)
    runner = FakeRunner(BS)
    dec = seq_of(range(10, 25), max_tokens=60, rid="dec")
    sched.add(dec)
    step(sched, runner)
    long = seq_of(range(200, 280), max_tokens=2, rid="long")  # 80 tokens: 5 blocks, never fits beside dec
    sched.add(long)
    trace = [step(sched, runner) for _ in range(200) if not sched.is_finished()]
    assert long.num_preemptions > 0 and sched.counts.num_preemptions == long.num_preemptions
    assert dec.num_preemptions == 0  # the decode is older: it is never the victim
    assert all(s[0] == ("dec", 1) for s in trace if s and s[0][0] == "dec")  # decode-first in every step
    assert long.num_cached_tokens > 0  # re-admitted on top of the chunks it had published
    assert long.completion_token_ids == expected_outputs([(0, list(range(200, 280)), long.sampling_params)], 128)[0]
    assert dec.completion_token_ids == expected_outputs([(0, list(range(10, 25)), dec.sampling_params)], 128)[0]


def test_chunked_prefill_admits_nothing_in_a_step_that_preempted(tiny_llama):
    sched = make_scheduler(tiny_llama, 4, enable_chunked_prefill=True, max_num_batched_tokens=32,
                           enable_prefix_caching=False)
    runner = FakeRunner(BS)
    t, v = seq_of(range(10, 26), max_tokens=8, rid="t"), seq_of(range(40, 80), max_tokens=2, rid="v")
    sched.add(t)
    sched.add(v)
    assert step(sched, runner) == [("t", 16), ("v", 16)]
    assert step(sched, runner) == [("t", 1), ("v", 16)]  # KV allows 16 of v's remaining 24
    assert sched.block_manager.num_free_blocks == 0
    # v needs a block and is the newest: it preempts itself, freeing two blocks; re-admitting it at
    # once would only churn, so the step runs t alone
    assert step(sched, runner) == [("t", 1)]
    assert v.num_preemptions == 1 and sched.block_manager.num_free_blocks == 2
    assert step(sched, runner) == [("t", 1), ("v", 31)]


def prefill_and_free(bm: BlockManager, *seqs: Sequence) -> list[list[int]]:
    """Compute each whole sequence, then release them in order; return their block tables."""
    tables = []
    for seq in seqs:
        assert bm.can_allocate(seq) >= 0
        bm.allocate(seq)
        bm.append_slots(seq, seq.num_tokens - seq.num_computed_tokens)
        seq.num_computed_tokens = seq.num_tokens
        bm.publish(seq)
        tables.append(list(seq.block_table))
    for seq in seqs:
        bm.deallocate(seq)
    return tables


@pytest.mark.parametrize("lru,evictions,a_hit", [(False, 1, 16), (True, 0, 32)])
def test_lru_reuses_uncached_free_blocks_before_cached_ones(lru, evictions, a_hit):
    bm = BlockManager(6, BS, enable_lru=lru)
    a, b = seq_of(range(40)), seq_of(range(100, 140))  # 2 cached blocks + 1 partial each
    prefill_and_free(bm, a, b)
    c = seq_of(range(300, 320))  # 2 blocks: FIFO takes a's partial then a's cached second block
    prefill_and_free(bm, c)
    assert bm.num_evictions == evictions
    assert bm.can_allocate(seq_of(list(range(40)) + [9])) == a_hit


def test_lru_evicts_least_recently_released_request_tail_first():
    bm = BlockManager(6, BS, enable_lru=True)
    (a0, a1, a2), (b0, b1, b2) = prefill_and_free(bm, seq_of(range(40)), seq_of(range(100, 140)))
    assert list(bm.free_block_ids) == [b2, a2, a1, a0, b1, b0]  # uncached partials first, tails before heads
    prefill_and_free(bm, seq_of(list(range(40)) + [1, 2]))  # revives a0, a1 in O(1): a is now the most recent
    assert list(bm.free_block_ids)[-2:] == [a1, a0]
    taken = seq_of(range(500, 564))  # 4 blocks: the two uncached ones, then b's tail, then b's head
    bm.allocate(taken)
    bm.append_slots(taken, 64)
    assert taken.block_table[2:] == [b1, b0] and bm.num_evictions == 2
    assert bm.num_cached_prefix_tokens(seq_of(list(range(100, 140)) + [5])) == 0
    assert bm.num_cached_prefix_tokens(seq_of(list(range(40)) + [5])) == 32


def test_reset_prefix_cache_needs_every_block_free_and_forgets_hits():
    bm = BlockManager(4, BS, enable_lru=True)
    prefill_and_free(bm, seq_of(range(40)))
    held = seq_of(range(200, 210))
    bm.allocate(held)
    bm.append_slots(held, 10)
    with pytest.raises(AssertionError, match="every block free"):
        bm.reset_prefix_cache()
    bm.deallocate(held)
    assert bm.stats()["prefix_hit_tokens"] == 0 and bm.stats()["prefix_query_tokens"] == 50
    bm.reset_prefix_cache()
    bm.reset_stats()
    assert list(bm.free_block_ids) == [0, 1, 2, 3] and bm.can_allocate(seq_of(range(40))) == 0
    assert bm.stats()["prefix_query_tokens"] == 0 and bm.num_evictions == 0


def first_admissions(trace) -> list[str]:
    seen: dict[str, None] = {}
    for row in trace:
        for rid, _ in row:
            seen.setdefault(rid, None)
    return list(seen)


@pytest.mark.parametrize("max_skips,order", [(16, ["y", "y2", "w", "z", "x"]), (2, ["y", "y2", "x", "z", "w"])])
def test_cache_aware_serves_longest_cached_prefix_in_window_with_aging(tiny_llama, max_skips, order):
    sched = make_scheduler(tiny_llama, 64, max_num_seqs=1, enable_cache_aware_schedule=True, cache_aware_window=4,
                           cache_aware_max_skips=max_skips)
    runner = FakeRunner(BS)
    prefix = list(range(100, 148))  # three blocks
    sched.add(seq_of(prefix + [1, 2], max_tokens=1, rid="warm"))
    step(sched, runner)
    assert sched.is_finished()
    sched.add(seq_of(range(300, 320), max_tokens=1, rid="x"))  # nothing cached
    sched.add(seq_of(prefix[:16] + list(range(400, 410)), max_tokens=1, rid="z"))  # 16 cached
    sched.add(seq_of(prefix + [5], max_tokens=1, rid="y"))  # 48 cached
    sched.add(seq_of(prefix + [7, 7], max_tokens=1, rid="y2"))  # 48 cached, behind y
    sched.add(seq_of(prefix + [9], max_tokens=1, rid="w"))  # 48 cached, outside the window of 4 at first
    trace = [step(sched, runner) for _ in range(5)]
    assert first_admissions(trace) == order
    assert sched.is_finished()


def passed_over(trace, arrival: list[str]) -> dict[str, int]:
    """For each request, how many requests that arrived after it were admitted before it."""
    rank = {rid: i for i, rid in enumerate(arrival)}
    admitted = first_admissions(trace)
    return {rid: sum(1 for later in admitted[:k] if rank[later] > rank[rid]) for k, rid in enumerate(admitted)}


@pytest.mark.parametrize("chunked", [False, True])
def test_cache_aware_aging_bounds_how_often_a_request_is_passed_over(tiny_llama, chunked):
    work = [(0, p, sp) for _, p, sp in make_workload(7, 80)]  # all at once: arrival order = index
    arrival = [f"r{i}" for i in range(len(work))]
    worst = {}
    for max_skips in (2, 1000):
        sched = make_scheduler(tiny_llama, 24, max_num_seqs=4, enable_cache_aware_schedule=True,
                               cache_aware_window=16, cache_aware_max_skips=max_skips, enable_chunked_prefill=chunked)
        trace, outputs = replay(sched, work)
        assert [outputs[r][0] for r in arrival] == expected_outputs(work, 128)
        worst[max_skips] = max(passed_over(trace, arrival).values())
    assert 0 < worst[2] <= 2  # reordered, but never more than max_skips times past a request
    assert worst[1000] > 2  # without aging the same workload passes some request more often


# each case names every feature it turns on; the others are off (SCHEDULER_FEATURES_OFF: the engine's defaults
# turn chunked prefill, LRU and cache-aware admission on, and tests/test_engine.py checks those defaults)
FEATURE_CASES = {
    "off": ("llama", dict(max_num_batched_tokens=256)),
    "chunked": ("llama", dict(enable_chunked_prefill=True, max_num_batched_tokens=32, max_num_seqs=8)),
    "chunked-qwen3": ("qwen3", dict(enable_chunked_prefill=True, max_num_batched_tokens=40, max_num_seqs=8)),
    "chunked-preempt": ("llama", dict(enable_chunked_prefill=True, max_num_batched_tokens=32, max_num_seqs=8,
                                      num_kvcache_blocks=10)),
    "lru-preempt": ("qwen3", dict(enable_lru=True, num_kvcache_blocks=10, max_num_batched_tokens=256)),
    "cache-aware": ("llama", dict(enable_cache_aware_schedule=True, cache_aware_window=3, cache_aware_max_skips=2)),
    "all-preempt": ("qwen3", dict(enable_chunked_prefill=True, enable_lru=True, enable_cache_aware_schedule=True,
                                  max_num_batched_tokens=24, max_num_seqs=8, num_kvcache_blocks=10)),
    "prefix-dedup": ("llama", dict(enable_prefix_dedup=True)),
    "dedup-chunked": ("qwen3", dict(enable_prefix_dedup=True, enable_chunked_prefill=True,
                                    max_num_batched_tokens=48, max_num_seqs=8)),
}


@pytest.mark.parametrize("name", list(FEATURE_CASES))
def test_greedy_matches_transformers_with_features_on(name, reference, tiny_llama, tiny_qwen3):  # noqa: F811
    arch, case = FEATURE_CASES[name]
    llm = LLM(tiny_llama if arch == "llama" else tiny_qwen3, block_size=16, max_model_len=256,
              **{**SCHEDULER_FEATURES_OFF, **case})
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    prompts = make_prompts()
    for _ in range(2):  # the second pass starts from prefix-cache hits
        outs = llm.generate(prompts, sp, use_tqdm=False)
        assert [o.output_token_ids for o in outs] == reference[arch]
    stats = llm.engine.stats()
    assert stats["prefix_hit_tokens"] > 0
    if "num_kvcache_blocks" in case:
        assert stats["num_preemptions"] > 0
    if case.get("enable_chunked_prefill"):
        assert stats["num_mixed_steps"] > 0
    else:
        assert stats["num_mixed_steps"] == 0
    if case.get("enable_lru"):
        assert stats["evictions"] > 0


def shared_prefix_burst() -> list[tuple[int, list[int], SamplingParams]]:
    """Five requests on one new 64-token prefix (4 blocks) and one unrelated request behind them, all
    arriving together."""
    rng = random.Random(7)
    prefix = [rng.randrange(3, 500) for _ in range(64)]
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    work = [(0, prefix + [rng.randrange(3, 500) for _ in range(5)], sp) for _ in range(5)]
    return work + [(0, [rng.randrange(3, 500) for _ in range(40)], sp)]


@pytest.mark.parametrize("chunked", [False, True])
def test_prefix_dedup_waits_for_an_inflight_prefix_instead_of_recomputing_it(tiny_llama, chunked):
    work = shared_prefix_burst()
    kw = dict(max_num_batched_tokens=100 if chunked else 512, enable_chunked_prefill=chunked, max_num_seqs=8)
    runs = {}
    for dedup in (False, True):
        sched = make_scheduler(tiny_llama, 64, enable_prefix_dedup=dedup, **kw)
        trace, outputs = replay(sched, work)
        assert [outputs[f"r{i}"][0] for i in range(len(work))] == expected_outputs(work, 128)
        runs[dedup] = trace, outputs, sched.stats()
    (_, off_out, off), (on_trace, on_out, on) = runs[False], runs[True]
    assert off["num_deferred_admissions"] == 0 and on["num_deferred_admissions"] >= 4
    # with the flag each follower finds the 64 prefix tokens cached; without it some compute them again
    assert all(on_out[f"r{i}"][2] == 64 for i in range(1, 5))
    assert sum(off_out[f"r{i}"][2] for i in range(1, 5)) < 4 * 64
    assert on["num_prefill_tokens"] == 69 + 4 * 5 + 40 < off["num_prefill_tokens"]
    # the unrelated request behind the followers is not held up by them
    assert "r5" in [rid for rid, _ in on_trace[0]]
    if not chunked:
        assert on_trace[0] == [("r0", 69), ("r5", 40)] and on_trace[1] == [(f"r{i}", 5) for i in range(1, 5)]


def test_prefix_dedup_defers_only_while_the_prefix_is_being_written(tiny_llama):
    """A follower whose next block the lead is writing this step waits one step, then hits the whole
    prefix; a request that shares only published blocks is admitted at once."""
    rng = random.Random(3)
    prefix = [rng.randrange(3, 500) for _ in range(96)]
    sched = make_scheduler(tiny_llama, 64, enable_prefix_dedup=True, enable_chunked_prefill=True,
                           max_num_batched_tokens=64, max_num_seqs=8)
    runner = FakeRunner(BS)
    lead = seq_of(prefix + [5], rid="lead")
    sched.add(lead)
    assert step(sched, runner) == [("lead", 64)]  # blocks 0-3 written and published
    follower = seq_of(prefix + [6, 7], rid="follower")
    early = seq_of(prefix[:32] + [9] * 20, rid="early")  # shares blocks 0-1, diverges in block 2
    sched.add(follower)
    sched.add(early)
    # lead writes blocks 4-5 this step: the follower (64 cached, block 4 next) waits, early goes ahead
    assert step(sched, runner) == [("lead", 33), ("early", 20)]
    assert sched.counts.num_deferred_admissions == 1 and [s.request_id for s in sched.waiting] == ["follower"]
    assert ("follower", 2) in step(sched, runner)
    while not sched.is_finished():
        step(sched, runner)
    assert follower.num_cached_tokens == 96 and early.num_cached_tokens == 32
    assert sched.counts.num_deferred_admissions == 1


@pytest.mark.parametrize("chunked", [False, True])
def test_same_step_sharing_lets_a_request_hit_the_prefix_computed_beside_it(tiny_llama, chunked):
    """Two requests on one new 64-token prefix arrive together: with sharing the second hits the blocks the
    first computes in the same step (one prefill of the prefix); without it, both compute them."""
    rng = random.Random(5)
    prefix = [rng.randrange(3, 500) for _ in range(64)]
    work = [(0, prefix + [7, 8, 9], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)),
            (0, prefix + [10, 11], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))]
    runs = {}
    for share in (False, True):
        sched = make_scheduler(tiny_llama, 64, enable_chunked_prefill=chunked, enable_same_step_prefix_sharing=share,
                               max_num_batched_tokens=256)
        trace, outputs = replay(sched, work)  # the fake runner checks every KV read of the step
        assert [outputs[f"r{i}"][0] for i in range(2)] == expected_outputs(work, 128)
        assert trace[0] == [("r0", 67), ("r1", 66 - (64 if share else 0))]  # both in the first step
        runs[share] = outputs["r1"][2], sched.stats()["num_prefill_tokens"]
    assert runs[False] == (0, 67 + 66) and runs[True] == (64, 67 + 2)


def test_same_step_sharing_is_off_with_speculative_decoding(tiny_llama):
    sched = make_scheduler(tiny_llama, 64, enable_same_step_prefix_sharing=True, speculative_model=tiny_llama,
                           num_speculative_tokens=2)
    assert not sched.same_step_sharing


def test_speculative_lookahead_takes_free_blocks_for_all_or_none_and_commits_verified_positions(tiny_llama):
    sched = make_scheduler(tiny_llama, 6, speculative_model=tiny_llama, num_speculative_tokens=2)
    runner = FakeRunner(BS)
    a = seq_of(range(10, 25), max_tokens=20, rid="a")
    b = Sequence(list(range(40, 55)), SamplingParams(max_tokens=20, ignore_eos=True, stop_token_ids=(999,)), BS, "b")
    sched.add(a)
    sched.add(b)
    first = sched.schedule()  # 15-token prompts plus their first token: one block each, 4 free
    assert [a.num_computed_tokens, b.num_computed_tokens] == [0, 0]  # a speculative step is committed, not launched
    tokens = runner.run(first).sampled_token_ids  # a plain step, committed whole as SpecDecoder commits it
    sched.update_from_output(SpeculativeOutput(first, [[t] for t in tokens], first.num_scheduled_tokens, [15, 15]))
    scheduled = sched.schedule()
    assert scheduled.num_scheduled_tokens == [1, 1] and sched.block_manager.num_free_blocks == 4
    assert not sched.reserve_lookahead(scheduled, 40)  # 3 more blocks each: nobody gets any
    assert sched.block_manager.num_free_blocks == 4 and len(a.block_table) == len(b.block_table) == 1
    assert sched.reserve_lookahead(scheduled, 17)  # 2 more blocks each
    assert sched.block_manager.num_free_blocks == 0 and len(a.block_table) == len(b.block_table) == 3
    # a: 3 positions verified, 3 tokens; the draft's KV covers 16 positions. b: stops at its second token
    finished = sched.update_from_output(SpeculativeOutput(scheduled, [[7, 8, 9], [5, 999, 6]], [3, 3], [16, 18]))
    assert finished == [b] and b.finish_reason == "stop" and b.completion_token_ids[-2:] == [5, 999]
    assert a.num_tokens == 19 and a.num_computed_tokens == 18 and a.num_published_blocks == 1
    st = sched.stats()
    assert st["num_decode_steps"] == 1 and st["decode_time_s"] > 0
