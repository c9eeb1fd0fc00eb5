"""Fused GEMM epilogues and fresh-prefill attention against today's path, on one GPU, in one call.

    python bench/fusion_probe.py --out $OUT/fusion.json      (about 3-5 minutes on an H200, compiles included)

Llama-3.1-8B shapes (hidden 4096, intermediate 14336, 32 / 8 heads of 128), bf16, random inputs, tokens
64..8192. For each op: today's path (cuBLAS F.linear + our separate Triton kernel) and each candidate
(Config.gemm_epilogues' implementations): relative error against an fp32 reference of the same
composition, the first call's seconds (JIT), and the median of CUDA-event timings over rotating inputs.

  gate_up+silu : F.linear(x, W_gate_up) -> silu_mul   vs  swiglu=triton | swiglu=quack
  o+res+norm   : F.linear(o, W_o) -> add_rmsnorm(.., residual)  vs  residual=cublas|triton|quack -> rmsnorm
  down+res+norm: the same with K = 14336
  attention    : FA4 paged (page 128) vs dense varlen on 8 x 8K and 1 x 8K fresh, 8 x (64 over 8K cached) (dense on the
                 gathered K/V: what paging costs) and the no-reuse trace's chunk (8128 fresh + 64 over 8K):
                 paged in one call vs the fresh part dense + the tail paged; TFLOP/s of exact causal FLOPs.
The table at the end: ms per shape, speedup over today's path (> 1 = faster), max relative error."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from flame_llm.kernels import gemm_epilogue as ge  # noqa: E402
from flame_llm.kernels.fused import add_rmsnorm, silu_mul  # noqa: E402

HID, INTER, HQ, HKV, D, PAGE = 4096, 14336, 32, 8, 128, 128
TOKENS = (64, 512, 2048, 8192)
ROTATE = 4  # input sets cycled through, so no set stays in L2 between calls
T0 = time.time()


def log(msg: str) -> None:
    print(f"[{time.time() - T0:6.1f}s] {msg}", flush=True)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    if not torch.isfinite(a).all():
        return float("inf")
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def median_ms(fn, inputs: list, iters: int = 30) -> float:
    """Median of per-call CUDA-event times, cycling through `inputs` (each a tuple of args)."""
    for args in inputs:
        fn(*args)
    torch.cuda.synchronize()
    times = []
    for i in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        args = inputs[i % len(inputs)]
        s.record()
        fn(*args)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e))
    return sorted(times)[len(times) // 2]


def first_call_s(fn, args) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn(*args)
    torch.cuda.synchronize()
    return time.perf_counter() - t


def run_case(name: str, t: int, make_inputs, today, candidates: dict, reference, compare) -> list[dict]:
    """One op at t tokens: today's path and each candidate (first-call time, error, median ms)."""
    inputs = [make_inputs(seed) for seed in range(ROTATE)]
    ref = reference(*inputs[0])
    rows = []
    base_ms = None
    for impl, fn in [("today", today), *candidates.items()]:
        row = {"op": name, "tokens": t, "impl": impl}
        try:
            row["first_call_s"] = first_call_s(fn, inputs[0])
            row["rel_err"] = compare(fn(*inputs[0]), ref)
            row["ms"] = median_ms(fn, inputs)
            if impl == "today":
                base_ms = row["ms"]
            row["speedup"] = base_ms / row["ms"] if base_ms else None
        except Exception as e:  # a candidate that does not run here: report it and go on
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        rows.append(row)
        log(json.dumps(row))
    return rows


def gemm_cases(impls: list[str]) -> list[dict]:
    dev, dt = "cuda", torch.bfloat16
    torch.manual_seed(0)
    w_gu = torch.randn(2 * INTER, HID, device=dev, dtype=dt) * HID ** -0.5
    w_o = torch.randn(HID, HQ * D, device=dev, dtype=dt) * (HQ * D) ** -0.5
    w_d = torch.randn(HID, INTER, device=dev, dtype=dt) * INTER ** -0.5
    norm_w = torch.rand(HID, device=dev, dtype=dt) + 0.5
    rows = []
    for t in TOKENS:
        def x_in(seed, k=HID, t=t):
            g = torch.Generator(device=dev).manual_seed(seed)
            return (torch.randn(t, k, device=dev, dtype=dt, generator=g),)

        def swiglu_ref(x):
            gate, up = (x.float() @ w_gu.float().T).chunk(2, -1)
            return F.silu(gate) * up

        cands = {f"swiglu={i}": (lambda x, i=i: ge.swiglu_linear(x, w_gu, i)) for i in impls if i != "cublas"}
        rows += run_case("gate_up+silu", t, x_in, lambda x: silu_mul(F.linear(x, w_gu)), cands, swiglu_ref, rel)

        for name, w, k in (("o+res+norm", w_o, HQ * D), ("down+res+norm", w_d, INTER)):
            def res_in(seed, k=k, t=t):
                g = torch.Generator(device=dev).manual_seed(seed)
                return (torch.randn(t, k, device=dev, dtype=dt, generator=g),
                        torch.randn(t, HID, device=dev, dtype=dt, generator=g))

            def res_ref(x, r, w=w):
                s = x.float() @ w.float().T + r.float()
                return s, s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-5) * norm_w.float()

            def today(x, r, w=w):
                normed, stream = add_rmsnorm(F.linear(x, w), norm_w, 1e-5, r)
                return stream, normed

            def fused(x, r, w=w, impl="cublas"):
                stream = ge.residual_linear(x, w, r, impl)
                return stream, add_rmsnorm(stream, norm_w, 1e-5)

            cands = {f"residual={i}": (lambda x, r, i=i: fused(x, r, impl=i)) for i in impls}
            rows += run_case(name, t, res_in, today, cands, res_ref,
                             lambda got, ref: max(rel(got[0], ref[0]), rel(got[1], ref[1])))
    # the GEMM alone: how far the Triton kernel is from cuBLAS before any epilogue
    for t in TOKENS:
        def x_in(seed, t=t):
            g = torch.Generator(device=dev).manual_seed(seed)
            return (torch.randn(t, HID, device=dev, dtype=dt, generator=g),)
        rows += run_case("gemm gate_up (no epilogue)", t, x_in, lambda x: F.linear(x, w_gu),
                         {"triton": lambda x: ge.triton_gemm(x, w_gu)}, lambda x: x.float() @ w_gu.float().T, rel)
    return rows


def attention_cases() -> list[dict]:
    from flame_llm.kernels.fa4_backend import fa4_unavailable_reason

    reason = fa4_unavailable_reason(torch.device("cuda"), torch.bfloat16, D)
    if reason:
        return [{"op": "attention", "error": reason}]
    from flame_llm.kernels.fa4_backend import fa4_dense_prefill, fa4_paged_attention
    from flame_llm.kernels.metadata import AttentionMetadata

    dev, dt, scale = "cuda", torch.bfloat16, D ** -0.5
    rows = []

    def step(ctx: list[int], new: list[int], seed: int = 0):
        """A paged cache holding each sequence's ctx + new keys, q for the new tokens, the contiguous k/v."""
        g = torch.Generator(device=dev).manual_seed(seed)
        pages = [-(-(c + n) // PAGE) for c, n in zip(ctx, new)]
        kc = torch.randn(sum(pages) + 1, PAGE, HKV, D, device=dev, dtype=dt, generator=g)
        vc = torch.randn_like(kc)
        perm = torch.randperm(sum(pages), device=dev, generator=g).to(torch.int32)
        table = torch.zeros(len(ctx), max(pages), dtype=torch.int32, device=dev)
        off = 0
        for i, p in enumerate(pages):
            table[i, :p] = perm[off:off + p]
            off += p
        lens = [c + n for c, n in zip(ctx, new)]
        k = torch.cat([kc[table[i, :pages[i]].long()].reshape(-1, HKV, D)[:lens[i]] for i in range(len(ctx))])
        v = torch.cat([vc[table[i, :pages[i]].long()].reshape(-1, HKV, D)[:lens[i]] for i in range(len(ctx))])
        q = torch.randn(sum(new), HQ, D, device=dev, dtype=dt, generator=g)
        cu_q = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32, device=dev)
        cu_k = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=dev)
        meta = AttentionMetadata(cu_q, torch.tensor(lens, dtype=torch.int32, device=dev), table,
                                 torch.empty(0, dtype=torch.int64, device=dev), max(new), max(lens),
                                 fresh_only=ctx == [0] * len(ctx), cu_seqlens_k=cu_k)
        flops = sum(4 * HQ * D * ((c + n) * (c + n + 1) // 2 - c * (c + 1) // 2) for c, n in zip(ctx, new))
        return q, kc, vc, k, v, meta, flops

    def dense_kv(q, k, v, meta):  # FA4 varlen on contiguous K/V (bottom-right causal, as paged)
        from flame_llm.kernels.fa4_backend import _varlen_fn
        out = _varlen_fn()(q, k, v, cu_seqlens_q=meta.cu_seqlens_q, cu_seqlens_k=meta.cu_seqlens_k,
                           max_seqlen_q=meta.max_seqlen_q, max_seqlen_k=meta.max_seqlen_k, softmax_scale=scale,
                           causal=True)
        return out[0] if isinstance(out, tuple) else out

    def timed(op: str, impl: str, fn, ref, flops: int) -> dict:
        row = {"op": op, "impl": impl}
        try:
            row["first_call_s"] = first_call_s(fn, ())
            row["rel_err_vs_paged"] = rel(fn(), ref)
            row["ms"] = median_ms(fn, [()], iters=10)
            row["tflops"] = flops / row["ms"] / 1e9
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        log(json.dumps(row))
        return row

    def case(name: str, ctx: list[int], new: list[int]) -> list[dict]:
        q, kc, vc, k, v, meta, flops = step(ctx, new)
        paged = fa4_paged_attention(q, kc, vc, meta, scale)
        out = [timed(f"attention {name}", "paged", lambda: fa4_paged_attention(q, kc, vc, meta, scale), paged,
                     flops)]
        if meta.fresh_only:
            out.append(timed(f"attention {name}", "dense (fresh k/v)",
                             lambda: fa4_dense_prefill(q, k, v, meta, scale), paged, flops))
        else:
            out.append(timed(f"attention {name}", "dense (gathered k/v)", lambda: dense_kv(q, k, v, meta), paged,
                             flops))
        return out

    rows += case("8x8K fresh", [0] * 8, [8192] * 8)
    # one 8K prompt alone (a no-reuse step holds about one): the causal triangle of a single sequence
    rows += case("1x8K fresh", [0], [8192])
    rows += case("8x(64 over 8K)", [8192] * 8, [64] * 8)
    # the engine's order in a chunked step: the running sequence's tail first, then the admitted prompt
    q2, kc2, vc2, _, _, meta2, flops2 = step([8192, 0], [64, 8128], seed=1)
    ref2 = fa4_paged_attention(q2, kc2, vc2, meta2, scale)
    rows.append(timed("attention chunk 64 over 8K + 8128 fresh (engine order)", "paged (one call)",
                      lambda: fa4_paged_attention(q2, kc2, vc2, meta2, scale), ref2, flops2))
    # the no-reuse trace's chunked step: 8128 fresh tokens of one prompt + the 64-token tail of another
    q, kc, vc, k, v, meta, flops = step([0, 8192], [8128, 64])
    whole = fa4_paged_attention(q, kc, vc, meta, scale)
    i32 = dict(dtype=torch.int32, device=dev)
    none = torch.empty(0, dtype=torch.int64, device=dev)
    fq, fk, fv = q[:8128], k[:8128], v[:8128]  # the fresh prompt's rows come first in q and k/v
    fmeta = AttentionMetadata(torch.tensor([0, 8128], **i32), torch.tensor([8128], **i32), meta.block_tables[:1],
                              none, 8128, 8128, fresh_only=True)
    tail_meta = AttentionMetadata(torch.tensor([0, 64], **i32), meta.seq_lens[1:], meta.block_tables[1:], none,
                                  64, 8256)

    def split():
        out = torch.empty_like(q)
        fa4_dense_prefill(fq, fk, fv, fmeta, scale, out=out[:8128])
        fa4_paged_attention(q[8128:], kc, vc, tail_meta, scale, out=out[8128:])
        return out

    op = "attention chunk 8128 fresh + 64 over 8K"
    rows.append(timed(op, "paged (one call)", lambda: fa4_paged_attention(q, kc, vc, meta, scale), whole, flops))
    rows.append(timed(op, "fresh dense + tail paged", split, whole, flops))
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| op | tokens | impl | ms | speedup | TFLOP/s | rel err | first call s |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['op']} | {r.get('tokens', '')} | {r.get('impl', '')} | error: {r['error'][:90]} |||||")
            continue
        err = r.get("rel_err", r.get("rel_err_vs_paged"))
        sp = f"{r['speedup']:.3f}" if r.get("speedup") else ""
        tf = f"{r['tflops']:.0f}" if "tflops" in r else ""
        lines.append(f"| {r['op']} | {r.get('tokens', '')} | {r['impl']} | {r['ms']:.3f} | {sp} | {tf} | "
                     f"{err:.1e} | {r['first_call_s']:.2f} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--impls", default="cublas,triton,quack", help="epilogue implementations to try")
    p.add_argument("--parts", default="gemm,attention")
    a = p.parse_args()
    assert torch.cuda.is_available(), "the probe needs a GPU"
    impls = [i for i in a.impls.split(",") if i]
    if "quack" in impls and isinstance(ge.quack_module(), Exception):
        log(f"quack does not import: {ge.quack_module()!r}")
        impls.remove("quack")
    rows = []
    parts = a.parts.split(",")
    if "gemm" in parts:
        rows += gemm_cases(impls)
    if "attention" in parts:
        rows += attention_cases()
    info = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}
    with open(a.out, "w") as f:
        json.dump(info, f, indent=1)
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
