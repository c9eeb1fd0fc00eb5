"""Does writing the FP8 projection inputs from the producing kernels (fp8_fused_quant) make one Llama-3.1-8B
decoder layer's norm -> quantize -> GEMM chains faster, and at which step sizes? (issue 40)

    python -m bench.engine.fp8_fusion_probe --out $OUT/fp8fusion.json      (about 1-3 minutes on an H200)

Per token count M (decode rows 1-64 to prefill chunks of 8,192) it times, in interleaved rounds (A-B-C-C-B-A, so
clocks and heat fall on every variant alike), one layer's two chains with their producers:
  attention input: residual-add + RMSNorm -> qkv_proj (6144 x 4096)
  MLP:             residual-add + RMSNorm -> gate_up_proj (28672 x 4096) -> SiLU-mul -> down_proj (4096 x 14336)
as four variants:
- `unfused`: kernels/fused.py's bf16 producers, then fp8_linear (kernels/fp8_quant.py's launch + _scaled_mm), the
  engine with fp8_fused_quant false;
- `fused`: kernels/fp8_fused.py's producers writing e4m3 + scales, then _scaled_mm: fp8_fused_quant true;
- `unfused_prod` / `fused_prod`: the producers (and quantization) alone, no GEMMs: what the fusion itself saves;
- `bf16`: the same chain in bf16 (F.linear), for scale;
- `fused_prod_2pass`: fused_prod with SiLU-mul's two-pass form (amax, then the row again from L2) instead of
  holding the 14,336-wide row in registers (kernels/fp8_fused.SILU_ONE_PASS_MAX), to pick between them;
- `w8a16` (M <= 64): bf16 producers, then kernels/fp8_gemv.py on the e4m3 weights (fp8_small_m_gemv >= M).
Each timing is `--calls` back-to-back chains over rotating inputs and weights (`--sets`, so little stays in L2)
captured in one CUDA graph and replayed between two events, as the engine's steps run. Reported per M: ms per
layer (median of rounds), fused ÷ unfused speed-up, the 32-layer sum, and the relative difference of the fused
chain's output from the unfused one (0 when the producers write the same values). On CPU it exits with a message.
"""
from __future__ import annotations

import argparse
import json
import logging
import statistics

import torch
import torch.nn.functional as F

from bench.engine.fp8_gemm_probe import timed  # ms per call: calls captured in one CUDA graph, replayed

log = logging.getLogger("bench.engine.fp8_fusion_probe")
HIDDEN, QKV, INTER = 4096, 6144, 14336  # Llama-3.1-8B
TOKENS = "1,2,4,8,16,32,64,128,256,512,1024,2048,4096,8192"
VARIANTS = ("unfused", "fused", "unfused_prod", "fused_prod", "fused_prod_2pass", "bf16", "w8a16")


def make_chains(m: int, sets: int) -> dict:
    """The variants' callables (i: which rotating set) for M tokens."""
    from flame_llm.kernels.fp8 import fp8_linear, fp8_small_m, per_token_quant, quantize_weight
    from flame_llm.kernels.fp8_fused import SILU_ONE_PASS_MAX, add_rmsnorm_quant, silu_mul_quant
    from flame_llm.kernels.fused import add_rmsnorm, silu_mul

    def bf16(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16)

    w16 = [{"qkv": bf16(QKV, HIDDEN) * 0.02, "gate_up": bf16(2 * INTER, HIDDEN) * 0.02,
            "down": bf16(HIDDEN, INTER) * 0.02} for _ in range(sets)]
    w8 = [{k: quantize_weight(v) for k, v in w.items()} for w in w16]
    # (x, residual, norm weight, o_proj's output: the post-attention norm's input)
    xs = [(bf16(m, HIDDEN), bf16(m, HIDDEN), bf16(HIDDEN).abs() + 0.5, bf16(m, HIDDEN)) for _ in range(sets)]
    gus = [bf16(m, 2 * INTER) for _ in range(sets)]  # gate_up outputs, for the producers-only variants
    eps = 1e-5

    def chain(i: int, fused: bool) -> torch.Tensor:
        x, r, nw, o = xs[i % sets]
        w = w8[i % sets]
        a, res = (add_rmsnorm_quant if fused else add_rmsnorm)(x, nw, eps, r)
        fp8_linear(a, *w["qkv"], None)
        h, _ = (add_rmsnorm_quant if fused else add_rmsnorm)(o, nw, eps, res)
        gu = fp8_linear(h, *w["gate_up"], None)
        return fp8_linear((silu_mul_quant if fused else silu_mul)(gu), *w["down"], None)

    def producers(i: int, fused: bool, one_pass_max: int = SILU_ONE_PASS_MAX) -> None:
        x, r, nw, o = xs[i % sets]
        if fused:
            add_rmsnorm_quant(x, nw, eps, r)
            add_rmsnorm_quant(o, nw, eps, r)
            silu_mul_quant(gus[i % sets], one_pass_max=one_pass_max)
        else:
            per_token_quant(add_rmsnorm(x, nw, eps, r)[0])
            per_token_quant(add_rmsnorm(o, nw, eps, r)[0])
            per_token_quant(silu_mul(gus[i % sets]))

    def chain16(i: int) -> torch.Tensor:
        x, r, nw, o = xs[i % sets]
        w = w16[i % sets]
        a, res = add_rmsnorm(x, nw, eps, r)
        F.linear(a, w["qkv"])
        h, _ = add_rmsnorm(o, nw, eps, res)
        return F.linear(silu_mul(F.linear(h, w["gate_up"])), w["down"])

    def chain_w8a16(i: int) -> torch.Tensor:
        x, r, nw, o = xs[i % sets]
        w = w8[i % sets]
        a, res = add_rmsnorm(x, nw, eps, r)
        fp8_small_m(a, *w["qkv"], None)
        h, _ = add_rmsnorm(o, nw, eps, res)
        return fp8_small_m(silu_mul(fp8_small_m(h, *w["gate_up"], None)), *w["down"], None)

    fns = {"unfused": lambda i: chain(i, False), "fused": lambda i: chain(i, True),
           "unfused_prod": lambda i: producers(i, False), "fused_prod": lambda i: producers(i, True),
           "fused_prod_2pass": lambda i: producers(i, True, 0), "bf16": chain16}
    if m <= 64:
        fns["w8a16"] = chain_w8a16
    return fns


def probe(m: int, calls: int, rounds: int, sets: int) -> dict:
    fns = make_chains(m, sets)
    ref, got = fns["unfused"](0).float(), fns["fused"](0).float()
    diff = ((got - ref).norm() / ref.norm().clamp(min=1e-30)).item()
    order = [v for v in VARIANTS if v in fns]
    times: dict[str, list[float]] = {v: [] for v in order}
    for r in range(rounds):
        for v in order if r % 2 == 0 else order[::-1]:
            times[v].append(timed(fns[v], calls))
    row = {"m": m, "rel_diff_fused_vs_unfused": diff}
    row.update({v: {"ms": statistics.median(t), "all_ms": t} for v, t in times.items()})
    row["speedup_chain"] = row["unfused"]["ms"] / row["fused"]["ms"]
    row["speedup_producers"] = row["unfused_prod"]["ms"] / row["fused_prod"]["ms"]
    row["silu_2pass_vs_1pass"] = row["fused_prod"]["ms"] / row["fused_prod_2pass"]["ms"]
    row["fp8_vs_bf16_fused"] = row["bf16"]["ms"] / row["fused"]["ms"]
    row["fp8_vs_bf16_unfused"] = row["bf16"]["ms"] / row["unfused"]["ms"]
    if "w8a16" in row:
        row["w8a16_vs_fused"] = row["fused"]["ms"] / row["w8a16"]["ms"]
    del fns
    torch.cuda.empty_cache()
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", default=TOKENS)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--sets", type=int, default=2, help="rotating input/weight sets (keeps weights out of L2)")
    ap.add_argument("--layers", type=int, default=32)
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not torch.cuda.is_available():
        raise SystemExit("bench.engine.fp8_fusion_probe needs a CUDA GPU with FP8 tensor cores (Hopper); none here")
    from flame_llm.kernels.fp8 import fp8_unavailable_reason
    why = fp8_unavailable_reason(torch.device("cuda"))
    if why:
        raise SystemExit(f"bench.engine.fp8_fusion_probe: {why}")
    rows = []
    log.info("%6s %10s %10s %8s %10s %10s %8s %9s %9s %9s", "M", "unfused", "fused", "x chain", "unf prod",
             "fus prod", "x prod", "bf16", "w8a16", "diff")
    for m in [int(t) for t in a.tokens.split(",")]:
        row = probe(m, a.calls, a.rounds, a.sets)
        rows.append(row)
        log.info("%6d %10.4f %10.4f %8.3f %10.4f %10.4f %8.3f %9.4f %9s %9.2e", m, row["unfused"]["ms"],
                 row["fused"]["ms"], row["speedup_chain"], row["unfused_prod"]["ms"], row["fused_prod"]["ms"],
                 row["speedup_producers"], row["bf16"]["ms"],
                 f"{row['w8a16']['ms']:.4f}" if "w8a16" in row else "-", row["rel_diff_fused_vs_unfused"])
    steps = [{"m": r["m"], **{f"{v}_ms": a.layers * r[v]["ms"] for v in ("unfused", "fused", "bf16")},
              "saved_ms": a.layers * (r["unfused"]["ms"] - r["fused"]["ms"])} for r in rows]
    log.info("\nper %d-layer step (these chains only; ms): %s", a.layers,
             ", ".join(f"M={s['m']}: {s['unfused_ms']:.3f} -> {s['fused_ms']:.3f}" for s in steps))
    meta = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "calls": a.calls,
            "rounds": a.rounds, "sets": a.sets, "layers": a.layers}
    with open(a.out, "w") as f:
        json.dump({"meta": meta, "rows": rows, "steps": steps}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
