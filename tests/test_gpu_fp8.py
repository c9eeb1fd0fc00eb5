"""quantization "fp8" on a GPU with FP8 tensor cores (skipped with a reason elsewhere): the Triton per-token
quantization equals the torch reference, torch._scaled_mm's row-wise product at Llama-3.1-8B's projection shapes
stays within FP8's error of bf16's, the pair captures into a CUDA graph, and an engine on Qwen3-0.6B shapes (dummy
weights) runs its decode graphs in FP8 with logits equal to its eager steps'; kv_cache_dtype fp8: the Triton
store equals torch's bit for bit and the engine runs it in graphs."""
import os

import pytest
import torch
import torch.nn.functional as F
from helpers import CASES_ATTENTION, make_case

from flame_llm import LLM, SamplingParams
from flame_llm.kernels.fp8 import (
    FP8_DTYPE,
    fp8_linear,
    fp8_unavailable_reason,
    per_token_quant,
    per_token_quant_ref,
    quantize_weight,
)
from flame_llm.kernels.torch_attention import paged_attention, store_kvcache

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or fp8_unavailable_reason(torch.device("cuda")) is not None,
    reason="needs a CUDA GPU with FP8 tensor cores (compute capability >= 9.0)")]
MODELS = os.path.join(os.path.dirname(__file__), "..", "configs", "models")
# Llama-3.1-8B's projections (N, K): qkv, o, gate_up, down
SHAPES_8B = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]


@pytest.mark.parametrize("m,k", [(1, 4096), (7, 4096), (256, 14336), (8192, 4096)])
def test_triton_quant_matches_the_reference(m, k):
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16) * torch.rand(m, 1, device="cuda") * 10
    q, s = per_token_quant(x)  # CUDA: the Triton kernel
    rq, rs = per_token_quant_ref(x)
    assert q.dtype == FP8_DTYPE and s.shape == (m, 1) and s.dtype == torch.float32
    assert torch.allclose(s, rs, rtol=1e-6, atol=0)
    # a division may round differently from torch's by an ulp: at most one e4m3 step apart, rarely
    diff = (q.float() - rq.float()).abs()
    assert (diff <= rq.float().abs() * 2.0 ** -3 + 2.0 ** -9).all()
    assert (diff > 0).float().mean().item() < 1e-3


@pytest.mark.parametrize("n,k", SHAPES_8B)
@pytest.mark.parametrize("m", [1, 64, 8192])
def test_scaled_mm_close_to_bf16_at_8b_shapes(m, n, k):
    """Dummy-like weights (uniform +-0.05) and activations of one RMSNorm'd scale: relative error of the FP8
    product against bf16's. Two e4m3 roundings of ~1/32 RMS each: ~3-5%; 8% is the bound."""
    g = torch.Generator(device="cuda").manual_seed(m + n + k)
    w = torch.empty(n, k, device="cuda", dtype=torch.bfloat16).uniform_(-0.05, 0.05, generator=g)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
    wq, ws = quantize_weight(w)
    y = fp8_linear(x, wq, ws, None)
    ref = F.linear(x.float(), w.float())
    rel = ((y.float() - ref).norm() / ref.norm()).item()
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    assert rel < 0.08, rel
    # the reference path on the same operands: the GEMM itself adds only float rounding
    xq, xs = per_token_quant_ref(x)
    exact = (xq.float() * xs) @ (wq.float() * ws[:, None]).t()
    assert ((y.float() - exact).norm() / exact.norm()).item() < 5e-3


def test_quant_and_scaled_mm_capture_into_a_cuda_graph():
    n, k = 4096, 4096
    w = torch.empty(n, k, device="cuda", dtype=torch.bfloat16).uniform_(-0.05, 0.05)
    wq, ws = quantize_weight(w)
    x = torch.randn(64, k, device="cuda", dtype=torch.bfloat16)
    fp8_linear(x, wq, ws, None)  # warm (Triton compile, cuBLASLt plan) before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = fp8_linear(x, wq, ws, None)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, fp8_linear(x, wq, ws, None))


# (quantization, kv_cache_dtype): the bf16 control, W8A8, W8A8 with e4m3 K/V
@pytest.mark.parametrize("quantization,kv", [(None, "auto"), ("fp8", "auto"), ("fp8", "fp8")])
def test_engine_decode_graphs_equal_eager_steps(quantization, kv, monkeypatch):
    """A replayed decode step's logits equal an eager step's when both split the keys alike. A decode graph is
    captured at max_seqlen_k = max_model_len, so its split-KV count can exceed what an eager step picks from the
    step's real lengths; a row whose keys then span two partials sums them in another order, and the dummy model
    amplifies that rounding to ~10% of the row's logits in 28 layers (seen on the H200 in bf16 as in fp8: rows
    within one key tile equal bit for bit, the one spanning two off by 0.098). So the eager step takes the graph's
    split count."""
    from flame_llm.kernels import triton_attention as ta
    llm = LLM(os.path.join(MODELS, "qwen3-0.6b"), load_format="dummy", quantization=quantization,
              kv_cache_dtype=kv, max_model_len=512, max_num_seqs=8, max_num_batched_tokens=2048,
              num_kvcache_blocks=64, async_scheduling=False)
    eng, runner = llm.engine, llm.engine.model_runner
    assert runner.use_graphs
    want = FP8_DTYPE if quantization else torch.bfloat16
    assert runner.model.model.layers[0].mlp.gate_up_proj.weight.dtype == want
    assert runner.kv_cache.dtype == (FP8_DTYPE if kv == "fp8" else torch.bfloat16)
    outs = llm.generate([[1, 2, 3, 4] * 20] * 3, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                        use_tqdm=False)  # first: the manual step below is scheduled, never committed
    assert all(len(o.output_token_ids) == 16 for o in outs)
    for i in range(4):  # contexts 51..69 and 200+: rows within one 64-key tile and rows over several
        n = 50 + 6 * i if i < 3 else 230
        eng.add_request(list(range(10 + i, 10 + i + n)), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    while eng.scheduler.waiting:
        eng.step()
    scheduled = eng.scheduler.schedule()
    x = runner.prepare(scheduled.seqs, scheduled.num_scheduled_tokens, scheduled.num_computed_tokens)
    bucket = next(b for b in runner.graphs.buckets if b >= len(scheduled.seqs))
    num_kv_heads = runner.kv_cache.shape[-2]
    splits = ta.decode_num_splits(bucket * num_kv_heads, runner.graphs.max_model_len, ta._sm_count(runner.device))
    assert splits > 1  # the case this test is about: the graph splits keys an eager step would not
    with torch.inference_mode():
        graph_logits = runner.graphs.replay(x, runner.staging, None).clone()
        monkeypatch.setattr(ta, "pick_num_splits", lambda *a: splits)
        monkeypatch.setattr(ta, "decode_num_splits", lambda *a: splits)
        eager = runner.model.compute_logits(runner.forward(runner.upload(x)))
    # the graph's bucket may give cuBLASLt another M, so another kernel: close, not bitwise
    rows = ((graph_logits - eager).norm(dim=-1) / eager.norm(dim=-1)).tolist()
    assert ((graph_logits - eager).norm() / eager.norm()).item() < 1e-2, rows


# ---- kv_cache_dtype fp8 ----------------------------------------------------------------------------------------
def test_triton_store_to_e4m3_equals_torch_and_attention_reads_it():
    """On the GPU the Triton store's fp32 -> e4m3 cast (cvt.rn.satfinite) equals torch's bit for bit, any values."""
    from flame_llm.kernels import triton_attention as ta  # here: a CPU run's later files set TRITON_INTERPRET first
    case = CASES_ATTENTION["prefix_chunks_gqa1_d128_bs32"]
    (q, k, v, k_cache, v_cache), meta = make_case(**case, dtype=torch.bfloat16)
    k, v = k * 120, v * 3  # randn keys up to ~500: the largest saturate at 448
    k_cache, v_cache = k_cache.to(FP8_DTYPE), v_cache.to(FP8_DTYPE)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    store_kvcache(k, v, k_ref, v_ref, meta.slot_mapping)
    scale = case["head_dim"] ** -0.5
    out = ta.triton_attention_forward(q, k, v, k_cache, v_cache, meta, scale)
    assert torch.equal(k_cache.view(torch.uint8), k_ref.view(torch.uint8))
    assert torch.equal(v_cache.view(torch.uint8), v_ref.view(torch.uint8))
    n = int(meta.cu_seqlens_q[-1])
    ref = paged_attention(q[:n].float(), k_ref.float(), v_ref.float(), meta.cu_seqlens_q, meta.seq_lens,
                          meta.block_tables, scale)
    assert ((out[:n].float() - ref).norm() / ref.norm()).item() < 2e-2  # bf16 q and P @ V


def test_engine_fp8_kv_triton_graphs_and_half_the_block_bytes():
    model = os.path.join(MODELS, "qwen3-0.6b")
    kw = dict(load_format="dummy", max_model_len=512, max_num_seqs=8, max_num_batched_tokens=2048,
              num_kvcache_blocks=64, async_scheduling=False)
    llm = LLM(model, quantization="fp8", kv_cache_dtype="fp8", **kw)
    runner = llm.engine.model_runner
    assert runner.backend == "triton" and runner.kv_cache.dtype == FP8_DTYPE and runner.use_graphs
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = [list(range(10 + i, 200 + 13 * i)) for i in range(4)]
    graphs = [o.output_token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    assert all(len(t) == 16 for t in graphs)  # graphs against eager steps: test_engine_decode_graphs_equal_eager_steps
    bf16 = LLM(model, **kw).engine.model_runner
    assert 2 * runner.block_bytes() == bf16.block_bytes()
