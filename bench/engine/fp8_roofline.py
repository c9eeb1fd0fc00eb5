"""The FP8 roofline of the seed traces on Llama-3.1-8B (issue 40): the decoder's linear-layer FLOPs per request
at the H200's dense FP8 peak (1,979 TFLOP/s), so req/s no engine can beat with these GEMMs, and a measured req/s
as a fraction of it. Attention, norms and lm_head (bf16, sampled rows only) are left out: a ceiling, not a model.

    python -m bench.engine.fp8_roofline [--measured no-reuse=5.897 ...] [--out FILE]

Tokens through the projections per request: the prompt (prefill) plus output_tokens - 1 decode rows (the first
output comes from the prefill step). no-reuse: every prompt is new; reuse: a document is prefilled once and its
questions reuse it (prefix cache), so per request doc_tokens / questions + question_tokens + output_tokens - 1."""
from __future__ import annotations

import argparse
import json
import logging

from bench.burst.traces import TraceConfig

log = logging.getLogger("bench.engine.fp8_roofline")
FP8_DENSE_TFLOPS = 1979.0  # H200 / H100 SXM dense FP8 tensor-core peak
# Llama-3.1-8B: hidden 4096, 32 layers, 32 query / 8 KV heads of 128, intermediate 14,336
HIDDEN, LAYERS, Q, KV, INTER = 4096, 32, 4096, 1024, 14336


def linear_params_per_layer(hidden: int = HIDDEN, q: int = Q, kv: int = KV, inter: int = INTER) -> int:
    """qkv, o, gate_up and down weights of one decoder layer."""
    return hidden * (q + 2 * kv) + q * hidden + hidden * 2 * inter + inter * hidden


def tokens_per_request(name: str, cfg: TraceConfig | None = None) -> float:
    if name not in ("no-reuse", "reuse"):
        raise ValueError(f"trace {name!r}: the roofline knows 'no-reuse' and 'reuse'")
    cfg = cfg or TraceConfig(name=name)
    prompt = cfg.doc_tokens + cfg.question_tokens
    decode = cfg.output_tokens - 1
    if name == "no-reuse":
        return prompt + decode
    return cfg.doc_tokens / cfg.questions + cfg.question_tokens + decode


def roofline(name: str, tflops: float = FP8_DENSE_TFLOPS, layers: int = LAYERS) -> dict:
    flop_per_token = 2.0 * layers * linear_params_per_layer()
    tokens = tokens_per_request(name)
    flop = flop_per_token * tokens
    return {"trace": name, "tokens_per_request": tokens, "gflop_per_token": flop_per_token / 1e9,
            "tflop_per_request": flop / 1e12, "peak_tflops": tflops, "roofline_req_per_s": tflops * 1e12 / flop}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--measured", nargs="*", default=["no-reuse=5.897"], help="TRACE=req/s pairs to place")
    ap.add_argument("--tflops", type=float, default=FP8_DENSE_TFLOPS)
    ap.add_argument("--out", default="")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    measured = {}
    for item in a.measured:
        name, _, value = item.partition("=")
        try:
            measured[name] = float(value)
        except ValueError:
            raise SystemExit(f"--measured {item!r}: expected TRACE=req/s, e.g. no-reuse=5.897") from None
    rows = []
    for name in ("no-reuse", "reuse"):
        r = roofline(name, a.tflops)
        if name in measured:
            r["measured_req_per_s"] = measured[name]
            r["fraction"] = measured[name] / r["roofline_req_per_s"]
        rows.append(r)
        log.info("%-8s %8.1f tokens/req  %6.2f GFLOP/token  %7.1f TFLOP/req  roofline %6.2f req/s at %.0f TFLOP/s%s",
                 name, r["tokens_per_request"], r["gflop_per_token"], r["tflop_per_request"],
                 r["roofline_req_per_s"], a.tflops,
                 f"  measured {r['measured_req_per_s']:.3f} = {r['fraction']:.3f}" if "fraction" in r else "")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
