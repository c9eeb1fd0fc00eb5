"""Asynchronous scheduling: step N+1 is scheduled and launched before step N's tokens are read.

Schedule level (fake runner that checks every KV read): for workloads that stop only by length the
schedule is the synchronous one step for step, under every feature flag and under preemption; with
stop tokens every output is still right and every block comes back. Engine level: token identity
with transformers and with the synchronous engine (greedy and seeded sampling), and the step inputs
that carry a pending token."""
import asyncio
import dataclasses

import numpy as np
import pytest
import torch
from helpers import (
    BS,
    MAX_TOKENS,
    expected_outputs,
    make_prompts,
    make_scheduler,
    make_workload,
    replay,
)

from flame_llm import LLM, SamplingParams
from flame_llm.config import Config
from flame_llm.engine.async_engine import AsyncEngine
from flame_llm.engine.scheduler import Scheduler
from flame_llm.engine.sequence import Sequence
from flame_llm.engine.step_inputs import build_step_inputs


def replay_async(sched: Scheduler, workload, aborts: dict[int, str] | None = None):
    return replay(sched, workload, aborts, asynchronous=True)


def length_only(workload):
    return [(a, p, dataclasses.replace(sp, ignore_eos=True)) for a, p, sp in workload]


FLAG_SETS = [dict(enable_chunked_prefill=c, enable_lru=lru, enable_cache_aware_schedule=lpm, enable_prefix_dedup=dd,
                  enable_same_step_prefix_sharing=sh)
             for c in (False, True) for lru in (False, True) for lpm in (False, True) for dd in (False, True)
             for sh in (False, True)]
FLAG_IDS = ["-".join(k[7:11] for k, v in f.items() if v) or "off" for f in FLAG_SETS]


@pytest.mark.parametrize("flags", FLAG_SETS, ids=FLAG_IDS)
@pytest.mark.parametrize("seed,num_blocks,budget", [(0, 24, 128), (3, 10, 40), (2, 14, 64)])
def test_async_replays_the_synchronous_schedule_when_requests_stop_by_length(tiny_llama, flags, seed,
                                                                              num_blocks, budget):
    work = length_only(make_workload(seed, 60))
    kw = dict(cache_aware_window=8, cache_aware_max_skips=3,
              max_num_batched_tokens=budget if flags["enable_chunked_prefill"] else 128, **flags)
    sync_trace, sync_out = replay(make_scheduler(tiny_llama, num_blocks, **kw), work, {9: "r4"})
    sched = make_scheduler(tiny_llama, num_blocks, **kw)
    async_trace, async_out = replay_async(sched, work, {9: "r4"})
    for step, (a, b) in enumerate(zip(async_trace, sync_trace)):
        assert a == b, f"step {step} differs"
    assert async_trace[len(sync_trace):] in ([], [[]])  # at most the final step that only reads tokens
    assert async_out == sync_out
    if num_blocks == 10:
        assert sched.stats()["num_preemptions"] > 0


@pytest.mark.parametrize("flags", FLAG_SETS[::3], ids=FLAG_IDS[::3])
@pytest.mark.parametrize("seed,num_blocks", [(0, 24), (3, 10), (5, 64)])
def test_async_with_stop_tokens_keeps_outputs_kv_and_blocks_right(tiny_llama, flags, seed, num_blocks):
    work = make_workload(seed, 60)  # 30% of requests stop at EOS, which the scheduler cannot foresee
    sched = make_scheduler(tiny_llama, num_blocks, cache_aware_window=8, cache_aware_max_skips=3, **flags)
    trace, outputs = replay_async(sched, work, {4: "r2", 30: "r41"})
    expected = expected_outputs(work, 128)
    for i in range(len(work)):
        if f"r{i}" not in ("r2", "r41"):
            assert outputs[f"r{i}"][0] == expected[i], f"r{i}"
    assert any(reason == "stop" for _, reason, _ in outputs.values())


def test_a_stop_token_costs_one_dropped_step_and_nothing_else(tiny_llama):
    """EOS is known only when step N's tokens are read, after step N+1 fed the sequence once more."""
    sched = make_scheduler(tiny_llama, 64)
    runner_eos = [(0, [7, 8, 9], SamplingParams(temperature=0.0, max_tokens=50))]
    expected = expected_outputs(runner_eos, 128)[0]
    trace, outputs = replay_async(sched, runner_eos)
    assert outputs["r0"][0] == expected and outputs["r0"][1] == "stop"
    assert len([s for s in trace if s]) == len(expected) + 1  # one decode step whose token was dropped


def test_step_inputs_carry_the_pending_token_row(tiny_llama):
    a = Sequence(list(range(10, 30)), SamplingParams(max_tokens=5), BS)  # 20 tokens, 2 blocks
    b = Sequence(list(range(40, 45)), SamplingParams(max_tokens=5), BS)
    a.block_table, b.block_table = [7, 3], [5]
    a.num_computed_tokens = 20  # decoding: position 20 is the token the running step samples
    x = build_step_inputs([b, a], [5, 1], BS)
    assert x.input_ids.tolist() == [40, 41, 42, 43, 44, 0]
    assert x.positions.tolist() == [0, 1, 2, 3, 4, 20]
    assert x.slot_mapping.tolist() == [5 * BS + i for i in range(5)] + [3 * BS + 4]
    assert x.pending_rows.tolist() == [5] and x.pending_seqs == [1]
    assert x.sample_idx == [0, 1] and x.logits_rows.tolist() == [4, 5]
    assert x.cu_seqlens_q.tolist() == [0, 5, 6] and x.seq_lens.tolist() == [5, 21]
    assert x.block_tables.tolist() == [[5, 0], [7, 3]] and not x.is_decode and not x.fresh_only
    chunk = build_step_inputs([a], [8], BS, starts=[4])  # a chunk short of the end samples nothing
    assert chunk.sample_idx == [] and chunk.input_ids.tolist() == list(range(14, 22))
    with pytest.raises(AssertionError):  # a position without a block is a scheduler bug, never a silent slot 0
        build_step_inputs([a], [14], BS, starts=[20])


@pytest.mark.parametrize("case", [dict(), dict(enable_chunked_prefill=True, max_num_batched_tokens=32, max_num_seqs=8),
                                  dict(num_kvcache_blocks=10, max_num_batched_tokens=256, max_model_len=256)],
                         ids=["two-phase", "chunked", "preempt"])
def test_async_engine_matches_transformers(case, reference, tiny_llama, tiny_qwen3):
    for arch, path in (("llama", tiny_llama), ("qwen3", tiny_qwen3)):
        llm = LLM(path, block_size=16, async_scheduling=True, **case)
        assert llm.engine.async_scheduling and llm.engine.stats()["async_scheduling"]
        sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        outs = llm.generate(make_prompts(), sp, use_tqdm=False)
        assert [o.output_token_ids for o in outs] == reference[arch]
        assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_async_engine_equals_sync_engine_with_sampling_and_stops(tiny_llama):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 500, int(rng.integers(1, 90))).tolist() for _ in range(24)]
    params = [SamplingParams(temperature=0.0 if i % 3 == 0 else 0.9, top_k=-1 if i % 2 else 40, seed=i,
                             max_tokens=int(rng.integers(1, 30)), ignore_eos=i % 4 == 0,
                             stop_token_ids=(int(rng.integers(3, 500)),)) for i in range(24)]
    runs = []
    for mode in (False, True):
        llm = LLM(tiny_llama, block_size=16, num_kvcache_blocks=30, max_model_len=160, max_num_seqs=8,
                  enable_chunked_prefill=True, max_num_batched_tokens=48, async_scheduling=mode,
                  eos_token_ids=(2, 5, 9))
        runs.append([(o.output_token_ids, o.finish_reason) for o in llm.generate(prompts, params, use_tqdm=False)])
    assert runs[0] == runs[1]
    assert {r for _, r in runs[0]} == {"stop", "length"}


def test_async_engine_streams_and_aborts_in_flight(tiny_llama):
    eng = AsyncEngine.from_args(tiny_llama, block_size=16, async_scheduling=True, num_kvcache_blocks=64)

    async def main():
        got = [t async for t in eng.stream([5, 6, 7], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))]
        ref = await eng.generate([5, 6, 7], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
        long = asyncio.ensure_future(eng.generate([9] * 20, SamplingParams(temperature=0, max_tokens=100_000 // 1000,
                                                                           ignore_eos=True), request_id="long"))
        await asyncio.sleep(0.05)
        eng.abort("long")
        out = await long
        return got, ref, out

    try:
        got, ref, aborted = asyncio.run(main())
        assert got == ref.output_token_ids and len(got) == 12
        assert aborted.finish_reason in ("abort", "length")
        deadline = 50
        while eng.engine.block_manager.num_free_blocks != eng.engine.block_manager.num_blocks and deadline:
            asyncio.run(asyncio.sleep(0.02))
            deadline -= 1
        assert eng.engine.block_manager.num_free_blocks == eng.engine.block_manager.num_blocks
    finally:
        eng.shutdown()


def test_async_scheduling_is_refused_with_speculative_decoding(tiny_llama):
    with pytest.raises(ValueError, match="async_scheduling"):
        Config.from_kwargs(tiny_llama, async_scheduling=True, speculative_model=tiny_llama, num_speculative_tokens=2)


def test_cpu_default_is_synchronous(tiny_llama):
    llm = LLM(tiny_llama, block_size=16, num_kvcache_blocks=32)
    assert llm.engine.async_scheduling is (llm.engine.model_runner.device.type == "cuda")
    assert not torch.cuda.is_available() or llm.engine.async_scheduling
