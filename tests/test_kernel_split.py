"""bench.engine.kernel_split's CPU parts: the A-B-B-A order, FLOP counting, the roofline and the tables."""
import os

import numpy as np
import pytest
import torch

from bench.burst.traces import TraceConfig, make_trace
from bench.engine import kernel_split
from bench.engine.split_report import (
    ModelShape,
    abba,
    computed_starts,
    render_groups,
    render_kernels,
    render_orders,
    render_roofline,
    roofline,
    trace_flops,
)

LLAMA = "configs/models/llama-3.1-8b"


def test_abba_order():
    assert abba(["vllm", "engine"]) == ["vllm", "engine", "engine", "vllm"]
    assert abba(["engine"]) == ["engine"]
    assert abba(["a", "b", "c"]) == ["a", "b", "c", "c", "b", "a"]


def test_linear_flops_match_the_models_weights():
    from flame_llm.config import load_hf_config
    from flame_llm.layers.layers import Linear
    from flame_llm.models.llama import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(load_hf_config(LLAMA))
    params = sum(m.weight.numel() for m in model.modules() if isinstance(m, Linear))
    assert ModelShape.from_config(LLAMA).linear_flops_per_token == 2 * params


def test_attention_flops_count_every_causal_pair():
    s = ModelShape(layers=2, hidden=8, intermediate=16, heads=4, kv_heads=2, head_dim=2, vocab=10)
    pairs = sum(p + 1 for p in range(5, 12))  # positions 5..11 see p + 1 keys each
    assert s.attention_flops(5, 12) == 4 * 2 * 4 * 2 * pairs
    assert s.attention_flops(0, 0) == 0


def test_ideal_cache_computes_each_document_once():
    cfg = TraceConfig(name="reuse", num_docs=3, questions=2, doc_tokens=64, question_tokens=8, vocab_size=1000)
    reqs = make_trace(cfg).requests
    starts = computed_starts([r.token_ids for r in reqs], block=16)
    seen = set()
    for r, s in zip(reqs, starts):
        assert s == (64 if r.doc in seen else 0)
        seen.add(r.doc)
    # a prompt equal to an earlier one still computes its last token (it samples)
    p = np.arange(32)
    assert computed_starts([p, p.copy()], block=16) == [0, 31]


def test_no_reuse_trace_is_the_issues_8_5_pflop():
    cfg = TraceConfig(name="no-reuse", vocab_size=128256)
    f = trace_flops(ModelShape.from_config(LLAMA), [r.token_ids for r in make_trace(cfg).requests], 16)
    assert f["computed_tokens"] == 64 * (8192 + 64 + 15)
    assert 8.4e15 < f["flops"] < 8.6e15
    assert 1.1e15 < f["attention_flops"] < 1.2e15
    r = roofline(f, wall_s=14.35, requests=64, peak_tflops=790.0)
    assert r["roofline_s"] == pytest.approx(f["flops"] / 790e12)
    assert 0.74 < r["fraction"] < 0.76  # the issue's "about 75% of the roofline"


def _run(system, run, gemm, kernels):
    row = {"req_per_s": 4.0 + run, "wall_plain_s": 14.0, "wall_profiled_s": 14.0, "kernel_s": 13.0,
           "idle_s": 1.0, "gemm_s": gemm, "attention_s": 2.0, "other_s": 1.0, "kernels": kernels,
           "flops": {"flops": 8.5e15, "computed_tokens": 100}, "roofline": roofline(
               {"flops": 8.5e15}, 14.0, 64, 790.0)}
    return {"system": system, "label": system, "run": run, "traces": {"no-reuse": row}}


def test_reports_show_both_orders_and_kernels_side_by_side():
    nvjet = "nvjet_sm90_tst_192x192"
    results = [_run("vllm", 0, 10.0, [[nvjet, 5.0, 2048, "gemm"]]),
               _run("engine", 1, 11.0, [[nvjet, 6.0, 2048, "gemm"], ["_silu_mul_kernel", 0.35, 2560, "other"]]),
               _run("engine", 2, 10.0, [[nvjet, 5.0, 2048, "gemm"], ["_silu_mul_kernel", 0.35, 2560, "other"]]),
               _run("vllm", 3, 11.0, [[nvjet, 6.0, 2048, "gemm"]])]
    groups = render_groups(results)
    assert "vllm #1" in groups and "vllm #4" in groups and "roofline fraction" in groups
    orders = render_orders(results, "vllm", "engine")
    gemm = next(line for line in orders.splitlines() if line.startswith("| gemm_s"))
    # vllm first: 11 / 10; engine first: 10 / 11; both: 10.5 / 10.5
    assert gemm.split("|")[3:6] == [" 1.100 ", " 0.909 ", " 1.000 "]
    kern = render_kernels(results)
    row = next(line for line in kern.splitlines() if nvjet in line)
    assert row.count("2048 | 5.5000") == 2  # mean of each system's two runs
    silu = next(line for line in kern.splitlines() if "_silu_mul_kernel" in line)
    assert "- | -" in silu  # vLLM has no such kernel
    assert "8.500" in render_roofline(results)


def test_vllm_process_gets_its_own_pythonpath(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/ours:/tmp/fa4/site")
    env = kernel_split.system_env("vllm", "/tmp/vsite/site")
    from bench import REPO

    assert env["PYTHONPATH"].split(os.pathsep) == [REPO, "/tmp/vsite/site"]  # the repository root: bench imports
    assert kernel_split.system_env("engine", "/tmp/vsite/site")["PYTHONPATH"] == "/ours:/tmp/fa4/site"


def test_unknown_system_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="unknown system"):
        kernel_split.main(["--systems", "engine,sglang", "--out", str(tmp_path / "x.json")])


def test_kernel_groups_name_our_attention_kernels_and_vllms():
    """Every attention kernel the engine can launch counts as attention, including the shared-prefix decode kernel
    (its first A/B counted it as 'other'); cuBLAS GEMMs as gemm; norms and activations as other."""
    for name in ("paged_attention_kernel", "shared_decode_kernel", "combine_splits_kernel",
                 "void flash::FlashAttnFwdSm90<...>", "kernel_cutlass_flash_attn_fwd"):
        assert kernel_split.group(name) == "attention", name
    assert kernel_split.group("nvjet_sm90_tst_256x128_64x4_2x1_v_bz_coopA_TNT") == "gemm"
    for name in ("_silu_mul_kernel", "_add_rmsnorm_kernel", "store_kv_kernel", "Memset (Device)"):
        assert kernel_split.group(name) == "other", name
