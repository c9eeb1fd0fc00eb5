"""Issue 21's engine part: typed step outputs, a request checked once per process, the CPU KV pool sized
from the limits, and the stall counters of stats()."""
import asyncio
import gc

import pytest
import torch

from flame_llm import LLM, AsyncEngine, SamplingParams
from flame_llm.engine.llm_engine import LLMEngine
from flame_llm.engine.outputs import ModelRunnerOutput, SchedulerOutput
from flame_llm.engine.stalls import GcPauses, triton_kernel_variants
from flame_llm.limits import max_kv_blocks_in_use
from flame_llm.outputs import RequestMetrics, RequestOutput


def test_a_step_passes_typed_outputs_and_a_request_its_typed_metrics(tiny_llama):
    llm = LLM(tiny_llama, block_size=16, device="cpu")
    eng, sched = llm.engine, llm.engine.scheduler
    seq = eng.add_request([5, 6, 7], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), "a")
    scheduled = sched.schedule()
    assert isinstance(scheduled, SchedulerOutput) and scheduled.seqs == [seq]
    assert scheduled.num_scheduled_tokens == [3] == [scheduled.total_num_scheduled_tokens] and scheduled.has_prefill
    out = eng.model_runner.run(scheduled)
    assert isinstance(out, ModelRunnerOutput) and out.scheduled is scheduled and out.failed == {}
    assert scheduled.num_computed_tokens == [0] and seq.num_computed_tokens == 3  # counted launched by schedule()
    assert sched.update_from_output(out) == [] and seq.completion_token_ids == out.sampled_token_ids
    while not eng.is_finished():
        eng.step()
    res = eng.make_output(seq)
    assert isinstance(res, RequestOutput) and isinstance(res.metrics, RequestMetrics) and res.error is None
    m = res.metrics
    assert m.arrival_time < m.first_token_time <= m.finish_time and m.ttft == m.first_token_time - m.arrival_time
    assert m.tpot is not None and m.tpot >= 0 and m.num_preemptions == 0
    assert (res.num_prompt_tokens, res.num_cached_tokens, len(res.output_token_ids), res.finish_reason) == \
        (3, 0, 2, "length")


@pytest.fixture
def counted(monkeypatch):
    """Counts of the engine's request checks and of SamplingParams.validate made after this point."""
    counts = {"to_token_ids": 0, "check_request": 0, "validate": 0}
    for cls, name in ((LLMEngine, "to_token_ids"), (LLMEngine, "check_request"), (SamplingParams, "validate")):
        real = getattr(cls, name)

        def spy(self, *args, _real=real, _name=name):
            counts[_name] += 1
            return _real(self, *args)

        monkeypatch.setattr(cls, name, spy)
    return counts


def test_async_engine_checks_a_request_once(tiny_llama, counted):
    sp = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)  # validated once when built
    counted["validate"] = 0
    eng = AsyncEngine.from_args(tiny_llama, block_size=16, device="cpu")
    try:
        out = asyncio.run(eng.generate([5, 6, 7], sp))
    finally:
        eng.shutdown()
    assert len(out.output_token_ids) == 2
    assert counted == {"to_token_ids": 1, "check_request": 1, "validate": 1}


def test_a_request_checked_at_its_process_boundary_is_not_checked_again(tiny_llama, counted):
    """The engine actor and serve-http check a prompt and its sampling at their boundary (the wire decoder, the
    HTTP parser) and pass checked=True: the engine then checks only what no boundary knows, the KV-pool fit."""
    import numpy as np

    sp = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    counted["validate"] = 0
    eng = AsyncEngine.from_args(tiny_llama, block_size=16, device="cpu", num_kvcache_blocks=4)
    try:
        out = asyncio.run(eng.generate(np.array([5, 6, 7], dtype=np.uint32), sp, checked=True))
        assert out.output_token_ids and counted == {"to_token_ids": 0, "check_request": 0, "validate": 0}
        with pytest.raises(ValueError, match="KV blocks"):  # 3 + 100 tokens need 7 blocks of 16; the pool has 4
            asyncio.run(eng.generate([5, 6, 7], SamplingParams(max_tokens=100), checked=True))
    finally:
        eng.shutdown()


def test_llm_generate_and_add_request_check_each_request_once(tiny_llama, counted):
    llm = LLM(tiny_llama, block_size=16, device="cpu")
    sp = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    counted["validate"] = 0
    llm.generate([[5, 6], [7, 8, 9]], sp, use_tqdm=False)
    assert counted == {"to_token_ids": 2, "check_request": 2, "validate": 2}
    llm.engine.add_request([5, 6], sp)
    assert counted == {"to_token_ids": 3, "check_request": 3, "validate": 3}


def test_cpu_kv_pool_is_no_larger_than_the_limits_can_use(tiny_llama):
    """An idle CPU engine held cpu_kvcache_gib (1 GiB by default) whatever its limits: 2 sequences of 256
    tokens use 32 blocks of 16, and that is what it allocates now."""
    llm = LLM(tiny_llama, block_size=16, max_num_seqs=2, max_model_len=256, device="cpu")
    runner = llm.engine.model_runner
    assert max_kv_blocks_in_use(2, 256, 16) == 32
    assert runner.num_blocks == 32 == llm.engine.block_manager.num_blocks == runner.kv_cache.shape[2]
    assert runner.kv_cache.numel() * runner.kv_cache.element_size() == 32 * runner.block_bytes()
    # the budget still caps it, and an explicit num_kvcache_blocks is taken as given
    small = LLM(tiny_llama, block_size=16, max_num_seqs=64, max_model_len=256, device="cpu",
                cpu_kvcache_gib=20 * runner.block_bytes() / (1 << 30)).engine.model_runner
    assert small.num_blocks == 20
    assert LLM(tiny_llama, block_size=16, max_num_seqs=1, max_model_len=256, device="cpu",
               num_kvcache_blocks=100).engine.model_runner.num_blocks == 100


def test_gc_pauses_over_the_threshold_are_counted():
    heap = [[i] for i in range(1_500_000)]  # a full collection walks every one of these lists
    slow, never = GcPauses(0.010).install(), GcPauses(3600.0).install()
    try:
        gc.collect()
    finally:
        slow.uninstall()
        never.uninstall()
    assert len(heap) == 1_500_000
    assert slow.num_over == 1 and slow.max_s > 0.010
    assert never.num_over == 0 and never.max_s > 0.010  # measured, not counted


def test_stall_counters_are_in_the_engine_stats(tiny_llama, monkeypatch):
    import flame_llm.engine.llm_engine as llm_engine

    eng = LLM(tiny_llama, block_size=16, device="cpu").engine
    before = eng.stats()
    heap = [[i] for i in range(1_500_000)]
    gc.collect()
    after = eng.stats()
    del heap
    assert after["gc_pauses_over_10ms"] >= before["gc_pauses_over_10ms"] + 1
    assert after["gc_pause_max_s"] > 0.010
    # jit_compiles is 0 on CPU whatever the code does (Triton runs in its interpreter, which keeps no compiled
    # variants; the torch backend has no JIT), so what is checked here is its arithmetic: the Triton variants
    # compiled since the engine started, plus the attention backend's own (FA4's), counted from startup
    assert before["jit_compiles"] == 0
    variants = {"n": 5}  # compiled by startup (graph capture, warmup)
    monkeypatch.setattr(llm_engine, "triton_kernel_variants", lambda: variants["n"])
    eng = LLM(tiny_llama, block_size=16, device="cpu").engine
    assert eng.stats()["jit_compiles"] == 0
    variants["n"] = 7
    monkeypatch.setattr(eng.model_runner, "attention_jit_compiles", lambda: 1)
    st = eng.stats()
    assert st["jit_compiles"] == 3 and st["attention_jit_compiles"] == 1
    # the GPU half (a kernel compiled after startup is counted) is test_triton_variants_are_counted_as_they_compile


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiling a Triton kernel needs CUDA")
def test_triton_variants_are_counted_as_they_compile():
    import triton
    import triton.language as tl

    global _fill  # a module attribute, where triton_kernel_variants looks for kernels

    @triton.jit
    def _fill(out_ptr, value: tl.constexpr):
        tl.store(out_ptr + tl.arange(0, 16), tl.full((16,), value, tl.float32))

    out = torch.empty(16, device="cuda")
    assert triton_kernel_variants(__name__) == 0
    _fill[(1,)](out, value=1.0)
    _fill[(1,)](out, value=1.0)  # the same variant: cached
    assert triton_kernel_variants(__name__) == 1
    _fill[(1,)](out, value=2.0)  # a new constexpr: a new variant
    assert triton_kernel_variants(__name__) == 2 and out.tolist() == [2.0] * 16
