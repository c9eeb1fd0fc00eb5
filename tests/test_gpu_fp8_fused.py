"""fp8_fused_quant on a GPU with FP8 tensor cores (skipped with a reason elsewhere): at Llama-3.1-8B's shapes the
fused producers (kernels/fp8_fused.py) write the unfused chain's e4m3 values and scales (kernels/fused.py, then
kernels/fp8_quant.py), the projections after them give the same outputs, the chain captures into a CUDA graph,
and an engine on Qwen3-0.6B shapes (dummy weights, decode graphs) gives the same logits and greedy tokens with
the flag on as off. The CPU file is tests/test_fp8_fused.py."""
import os

import pytest
import torch

from flame_llm import LLM, SamplingParams
from flame_llm.kernels.fp8 import Fp8Activation, fp8_linear, fp8_unavailable_reason, per_token_quant, quantize_weight

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or fp8_unavailable_reason(torch.device("cuda")) is not None,
    reason="needs a CUDA GPU with FP8 tensor cores (compute capability >= 9.0)")]
MODELS = os.path.join(os.path.dirname(__file__), "..", "configs", "models")
HIDDEN, INTER = 4096, 14336  # Llama-3.1-8B
TOKENS = [1, 7, 64, 256, 8192]


def assert_same(a: Fp8Activation, q: torch.Tensor, s: torch.Tensor) -> None:
    """Scales equal; values equal (both kernels divide the same float32 by the same scale): a one-step difference
    is allowed in at most 1e-4 of them, in case the two compiled divisions ever differ, and reported."""
    assert torch.equal(a.scales, s)
    diff = (a.values.float() - q.float()).abs()
    frac = (diff > 0).float().mean().item()
    assert frac <= 1e-4 and (diff <= q.float().abs() * 2.0 ** -3 + 2.0 ** -9).all(), frac


def _bf16(*shape, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=g)


@pytest.mark.parametrize("m", TOKENS)
@pytest.mark.parametrize("with_res", [False, True])
def test_add_rmsnorm_quant_equals_unfused_at_8b(m, with_res):
    from flame_llm.kernels.fp8_fused import add_rmsnorm_quant
    from flame_llm.kernels.fused import add_rmsnorm
    x, w = _bf16(m, HIDDEN, seed=m) * 4, _bf16(HIDDEN, seed=1).abs() + 0.5
    res = _bf16(m, HIDDEN, seed=m + 1) if with_res else None
    if with_res:
        got, got_res = add_rmsnorm_quant(x, w, 1e-5, res)
        out, ref_res = add_rmsnorm(x, w, 1e-5, res)
        assert torch.equal(got_res, ref_res)
    else:
        got, out = add_rmsnorm_quant(x, w, 1e-5), add_rmsnorm(x, w, 1e-5)
    assert_same(got, *per_token_quant(out))


@pytest.mark.parametrize("m", TOKENS)
def test_silu_mul_quant_equals_unfused_at_8b(m):
    from flame_llm.kernels.fp8_fused import silu_mul_quant
    from flame_llm.kernels.fused import silu_mul
    x = _bf16(m, 2 * INTER, seed=m) * 3
    assert_same(silu_mul_quant(x), *per_token_quant(silu_mul(x)))


@pytest.mark.parametrize("m", [1, 64, 8192])
def test_projections_after_fused_producers_equal_unfused(m):
    """qkv_proj after the norm and down_proj after SiLU-mul: the layer outputs, fused against unfused."""
    from flame_llm.kernels.fp8_fused import add_rmsnorm_quant, silu_mul_quant
    from flame_llm.kernels.fused import add_rmsnorm, silu_mul
    for n, k, make in ((6144, HIDDEN, "norm"), (HIDDEN, INTER, "silu")):
        wq, ws = quantize_weight(_bf16(n, k, seed=n) * 0.05)
        if make == "norm":
            x, w = _bf16(m, k, seed=3), _bf16(k, seed=4).abs() + 0.5
            fused, plain = add_rmsnorm_quant(x, w, 1e-5), add_rmsnorm(x, w, 1e-5)
        else:
            x = _bf16(m, 2 * k, seed=5)
            fused, plain = silu_mul_quant(x), silu_mul(x)
        y, ref = fp8_linear(fused, wq, ws, None), fp8_linear(plain, wq, ws, None)
        assert y.shape == (m, n) and y.dtype == torch.bfloat16
        assert ((y.float() - ref.float()).norm() / ref.float().norm()).item() < 1e-3, make


def test_fused_chain_captures_into_a_cuda_graph():
    from flame_llm.kernels.fp8_fused import add_rmsnorm_quant, silu_mul_quant
    wq, ws = quantize_weight(_bf16(2 * INTER, HIDDEN, seed=7) * 0.05)
    dq, ds = quantize_weight(_bf16(HIDDEN, INTER, seed=8) * 0.05)
    x, r, w = _bf16(64, HIDDEN, seed=9), _bf16(64, HIDDEN, seed=10), _bf16(HIDDEN, seed=11).abs() + 0.5

    def chain():
        a, res = add_rmsnorm_quant(x, w, 1e-5, r)
        return fp8_linear(silu_mul_quant(fp8_linear(a, wq, ws, None)), dq, ds, None), res

    chain()  # compile before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y, res = chain()
    x.copy_(_bf16(64, HIDDEN, seed=12))
    graph.replay()
    torch.cuda.synchronize()
    y2, res2 = chain()
    assert torch.equal(y, y2) and torch.equal(res, res2)


def _step_logits(llm: LLM, prompts: list[list[int]]) -> torch.Tensor:
    from flame_llm.engine.sequence import Sequence
    runner, seqs, nxt = llm.engine.model_runner, [], 0
    for p in prompts:
        s = Sequence(p, SamplingParams(temperature=0, max_tokens=1), runner.block_size)
        s.block_table = list(range(nxt, nxt + (len(p) + runner.block_size - 1) // runner.block_size))
        nxt += len(s.block_table)
        seqs.append(s)
    x = runner.prepare(seqs, [s.num_tokens for s in seqs], [0] * len(seqs))
    with torch.inference_mode():
        return runner.compute_logits(runner.forward(runner.upload(x)))


def test_engine_flag_on_equals_off_logits_and_tokens():
    """Dummy weights (same seed): teacher-forced prefill logits and greedy decode (CUDA graphs) with the flag on
    and off. The producers write the same e4m3 values, so logits agree to float rounding and tokens are equal."""
    kw = dict(load_format="dummy", quantization="fp8", max_model_len=512, max_num_seqs=8,
              max_num_batched_tokens=2048, num_kvcache_blocks=64, async_scheduling=False)
    prompts = [list(range(10 + i, 90 + 17 * i)) for i in range(4)]
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    logits, tokens = {}, {}
    for flag in (True, False):
        llm = LLM(os.path.join(MODELS, "qwen3-0.6b"), fp8_fused_quant=flag, **kw)
        layer = llm.engine.model_runner.model.model.layers[0]
        assert layer.input_layernorm.fp8_out is flag and layer.mlp.act_fn.fused and llm.engine.model_runner.use_graphs
        logits[flag] = _step_logits(llm, prompts)
        tokens[flag] = [o.output_token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
        del llm
        torch.cuda.empty_cache()
    rel = ((logits[True] - logits[False]).norm() / logits[False].norm()).item()
    cos = torch.nn.functional.cosine_similarity(logits[True], logits[False], dim=-1).min().item()
    assert rel < 1e-3 and cos > 0.9999, (rel, cos)
    assert tokens[True] == tokens[False]


def test_engine_small_m_gemv_runs_in_graphs_close_to_w8a8():
    """fp8_small_m_gemv 16: decode steps of <= 16 rows (graph buckets included) run W8A16; a teacher-forced step of
    <= 16 rows moves the logits less from bf16's than W8A8 does (no activation rounding), and decoding runs."""
    kw = dict(load_format="dummy", max_model_len=512, max_num_seqs=8, max_num_batched_tokens=2048,
              num_kvcache_blocks=64, async_scheduling=False)
    model = os.path.join(MODELS, "qwen3-0.6b")
    prompts = [list(range(10, 16)), list(range(40, 48))]  # 14 rows
    base = _step_logits(LLM(model, **kw), prompts).float()
    err = {}
    for small_m in (0, 16):
        llm = LLM(model, quantization="fp8", fp8_small_m_gemv=small_m, **kw)
        assert llm.engine.model_runner.use_graphs
        got = _step_logits(llm, prompts)
        err[small_m] = ((got - base).norm() / base.norm()).item()
        outs = llm.generate([list(range(10 + i, 70 + i)) for i in range(4)],
                            SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
        assert all(len(o.output_token_ids) == 16 for o in outs)
        del llm
        torch.cuda.empty_cache()
    assert err[16] < err[0], err
