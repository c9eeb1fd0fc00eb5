"""Engine-level GPU measurements for issue 3, one H200, Llama-3.1-8B shapes with dummy weights.

In one process: the card's ceilings (bf16 matmul, device copy), long prefill, decode at batch 64 x 8K
context and at batch 1, eager vs CUDA-graph decode step time per batch size, and (if bench.burst.traces
exists) the two seed traces as one offline burst each. Writes JSON to --out; prints a table last.

    python -m bench.engine.gpu_engine --out $OUT/engine.json [--parts ceilings,prefill,decode,graphs,traces]
"""
from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import time

import torch

from bench import MODELS
from bench.burst.traces import SEED_LIMITS as TRACE_SEED_LIMITS
from flame_llm import LLM, SamplingParams

MODEL = os.path.join(MODELS, "llama-3.1-8b")
SEED_LIMITS = dict(TRACE_SEED_LIMITS, enable_prefix_caching=True)


def ceilings() -> dict:
    from triton.testing import do_bench

    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = do_bench(lambda: a @ b, warmup=100, rep=500, return_mode="median")
    x = torch.randn(1 << 30, device="cuda", dtype=torch.bfloat16)  # 2 GiB
    y = torch.empty_like(x)
    ms_copy = do_bench(lambda: y.copy_(x), warmup=50, rep=300, return_mode="median")
    return {"matmul_tflops": 2 * n**3 / ms / 1e9, "copy_bytes_per_s": 2 * x.numel() * 2 / ms_copy * 1e3}


def flops_per_token(hf, ctx_mean: float) -> float:
    """2 x (non-embedding matmul params) + causal attention (QK^T and PV) at the mean context length."""
    h, L = hf.hidden_size, hf.num_hidden_layers
    hd = getattr(hf, "head_dim", h // hf.num_attention_heads)
    q, kv = hf.num_attention_heads * hd, hf.num_key_value_heads * hd
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * hf.intermediate_size
    # the LM head runs on sampled rows only, so it is left out of the per-token count
    return 2 * L * per_layer + 4 * L * q * ctx_mean


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n, length), generator=g).tolist()


def timed_generate(llm: LLM, ps, sp) -> tuple[float, list]:
    torch.cuda.synchronize()
    t = time.perf_counter()
    outs = llm.generate(ps, sp, use_tqdm=False)
    torch.cuda.synchronize()
    return time.perf_counter() - t, outs


def decode_step_ms(llm: LLM, batch: int, ctx: int, steps: int, seed: int, pipelined: bool = False) -> float:
    """Pure decode steps with all `batch` sequences decoding at about `ctx` tokens of context: every
    prompt is prefilled first, nobody finishes while steps are timed, then all abort.

    Default: the median of steps each timed alone (synchronized before and after, so host and device time
    add up). pipelined: the mean over `steps` back-to-back steps, as a burst runs them (with asynchronous
    scheduling the host prepares a step while the device runs the previous one)."""
    eng = llm.engine
    sp = SamplingParams(temperature=0, max_tokens=100_000, ignore_eos=True)
    seqs = [eng.add_request(p, sp) for p in prompts(batch, ctx, eng.vocab_size, seed)]
    while any(s.num_completion_tokens == 0 for s in seqs):
        eng.step()
    times = []
    torch.cuda.synchronize()
    t_all = time.perf_counter()
    for _ in range(steps):
        if not pipelined:
            torch.cuda.synchronize()
        t = time.perf_counter()
        _, n = eng.step()
        if not pipelined:
            torch.cuda.synchronize()
        assert n == batch, "a timed step must be pure decode of the whole batch"
        times.append(time.perf_counter() - t)
    torch.cuda.synchronize()
    t_all = time.perf_counter() - t_all
    for s in seqs:
        eng.abort(s.request_id)
    times.sort()
    return 1e3 * (t_all / steps if pipelined else times[len(times) // 2])


def free() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--parts", default="ceilings,prefill,decode,graphs,traces")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--max-batched", type=int, default=8192)
    ap.add_argument("--chunked", type=int, default=1, help="enable_chunked_prefill (needed when max-batched < 32768)")
    ap.add_argument("--engine-json", default="{}", help="more engine fields (JSON object), e.g. a flag's A/B: "
                    "'{\"prune_last_layer\": false}'")
    ap.add_argument("--traces", default="no-reuse,reuse", help="the seed traces the traces part runs")
    args = ap.parse_args()
    SEED_LIMITS.update(max_num_batched_tokens=args.max_batched, enable_chunked_prefill=bool(args.chunked),
                       **json.loads(args.engine_json))
    logging.basicConfig(level=logging.INFO)
    parts = set(args.parts.split(","))
    res: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "backend": args.backend,
                 "limits": dict(SEED_LIMITS)}

    def save():
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)

    if "ceilings" in parts:
        res["ceilings"] = ceilings()
        save()
    peak = res.get("ceilings", {}).get("matmul_tflops", 790.0)
    llm = LLM(MODEL, load_format="dummy", attention_backend=args.backend, **SEED_LIMITS)
    hf = llm.engine.config.model_config.hf_config
    res["num_kv_blocks"] = llm.engine.block_manager.num_blocks
    res["attention_backend"] = llm.engine.model_runner.backend
    if "prefill" in parts:
        sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        timed_generate(llm, prompts(8, 8192, hf.vocab_size, 100), sp)  # warm up
        wall, _ = timed_generate(llm, prompts(64, 8192, hf.vocab_size, 1), sp)
        tok_s = 64 * 8192 / wall
        tflops = tok_s * flops_per_token(hf, 4096) / 1e12
        res["prefill_64x8192"] = {"wall_s": wall, "tok_per_s": tok_s, "tflops": tflops, "frac_of_peak": tflops / peak}
        save()
    if "decode" in parts:
        res["decode_b64_8k_ms"] = decode_step_ms(llm, 64, 8192, 48, 2)
        res["decode_b64_8k_ms_pipelined"] = decode_step_ms(llm, 64, 8192, 48, 5, pipelined=True)
        sp = SamplingParams(temperature=0, max_tokens=256, ignore_eos=True)
        timed_generate(llm, prompts(1, 128, hf.vocab_size, 3), SamplingParams(temperature=0, max_tokens=16))
        wall, outs = timed_generate(llm, prompts(1, 128, hf.vocab_size, 4), sp)
        ttft = outs[0].metrics.ttft
        res["decode_b1"] = {"tok_per_s": 255 / (wall - ttft), "wall_s": wall}
        save()
    if "traces" in parts:
        from bench.burst.traces import TraceConfig, make_trace, warmup_traces

        res["traces"] = {}
        sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
        for name in args.traces.split(","):
            trace_cfg = TraceConfig(name=name, vocab_size=hf.vocab_size, seed=0)
            for warm in warmup_traces(trace_cfg, rounds=2):  # the protocol's two shifted rounds, unseen prefixes
                timed_generate(llm, [r.token_ids.tolist() for r in warm.requests], sp)
            trace = make_trace(trace_cfg)
            wall, outs = timed_generate(llm, [r.token_ids.tolist() for r in trace.requests], sp)
            assert all(len(o.output_token_ids) == 16 for o in outs)
            cached = sum(o.num_cached_tokens for o in outs) / sum(o.num_prompt_tokens for o in outs)
            res["traces"][name] = {"requests": len(outs), "wall_s": wall, "req_per_s": len(outs) / wall,
                                   "cached_frac": cached, "trace": trace.describe()}
            save()
    graphs_on = llm.engine.model_runner.use_graphs
    if "graphs" in parts:
        res["decode_step_ms"] = {("graphs" if graphs_on else "eager"): {
            b: decode_step_ms(llm, b, 2048, 24, 10 + b) for b in (1, 8, 32, 64)}}
        del llm
        free()
        llm = LLM(MODEL, load_format="dummy", attention_backend=args.backend, enforce_eager=True, **SEED_LIMITS)
        res["decode_step_ms"]["eager"] = {b: decode_step_ms(llm, b, 2048, 24, 10 + b) for b in (1, 8, 32, 64)}
        save()
    save()
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
