"""FP8 numerics (issue 40) of our engine on one model, against the same model unquantized, same dummy weights:
1. per projection of every layer, the relative error of our FP8 linear (W8A8, per-channel weights, per-token
   activations) against the model dtype's on the inputs that layer really sees in a prefill of the prompts;
2. greedy decoding of the same prompts by both engines: first tokens equal, matched prefix length, sequences equal;
3. teacher-forced: every prompt position's logits, cosine similarity and argmax agreement.
2 and 3 for "fp8" (quantization fp8) and, with --kv, "fp8kv" (and kv_cache_dtype fp8: our Triton attention reads
the prompt's e4m3 K/V in the teacher-forced step; the greedy runs' decodes read them).
Dummy weights say nothing of accuracy: these say how far FP8 moves this model's numbers (what the GPU path of
kernels/fp8_quant.py computes). On a GPU (Llama-3.1-8B shapes, the default):
    python -m bench.engine.fp8_check --out fp8_check.json
On CPU (the tiny model): python -m bench.engine.fp8_check --model tiny --load-format auto --prompts 4 --prompt-len 32
--max-tokens 8. Both engines keep the default attention backend (on the H200: FA4 for bf16 prefill, our Triton
kernel with kv fp8); --engine-json '{"attention_backend": "triton"}' holds attention the same for all."""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections import defaultdict

import torch

from bench import MODELS
from flame_llm import LLM, SamplingParams
from flame_llm.config import CacheConfig, engine_fields_from_json
from flame_llm.engine.sequence import Sequence
from flame_llm.kernels.fp8 import fp8_linear, quantize_weight
from flame_llm.layers.layers import Linear
from flame_llm.models.tiny import resolve_model

MODEL_8B = os.path.join(MODELS, "llama-3.1-8b")


def make_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (length,), generator=g).tolist() for _ in range(n)]


def step_logits(llm: LLM, prompts: list[list[int]], hook=None) -> torch.Tensor:
    """Every row's logits of one eager prefill step of `prompts` (fresh blocks from 0; run it after generating:
    it overwrites the cache's blocks without the block manager knowing)."""
    runner, seqs, nxt = llm.engine.model_runner, [], 0
    bs = runner.block_size
    for p in prompts:
        s = Sequence(p, SamplingParams(temperature=0, max_tokens=1), bs)
        s.block_table = list(range(nxt, nxt + (len(p) + bs - 1) // bs))
        nxt += len(s.block_table)
        seqs.append(s)
    assert nxt <= runner.num_blocks, "more prompt blocks than the pool holds"
    x = runner.prepare(seqs, [s.num_tokens for s in seqs], [0] * len(seqs))
    handles = []
    if hook is not None:
        handles = [m.register_forward_hook(hook) for m in runner.model.modules() if isinstance(m, Linear)]
    try:
        with torch.inference_mode():
            return runner.compute_logits(runner.forward(runner.upload(x))).float()
    finally:
        for h in handles:
            h.remove()


def layer_errors(llm: LLM, prompts: list[list[int]]) -> dict[str, list[float]]:
    """Per projection name (qkv_proj, o_proj, gate_up_proj, down_proj), per layer: ||fp8 - ref|| / ||ref||, where
    ref is the unquantized engine's projection output on its own input."""
    names = {m: n for n, m in llm.engine.model_runner.model.named_modules() if isinstance(m, Linear)}
    errs: dict[str, list[float]] = defaultdict(list)

    def hook(mod, inputs, out):
        wq, ws = quantize_weight(mod.weight)
        y = fp8_linear(inputs[0], wq, ws, mod.bias).float()
        ref = out.float()
        errs[names[mod].rsplit(".", 1)[-1]].append(((y - ref).norm() / ref.norm()).item())

    step_logits(llm, prompts, hook)
    return dict(errs)


def greedy(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [o.output_token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]


def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    matched = []
    for x, y in zip(a, b, strict=True):
        n = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
        matched.append(n / max(len(x), 1))
    return {"first_token_equal": sum(x[:1] == y[:1] for x, y in zip(a, b)) / len(a),
            "matched_prefix_fraction_mean": sum(matched) / len(matched),
            "sequences_equal": sum(x == y for x, y in zip(a, b)) / len(a)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.engine.fp8_check", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=MODEL_8B, help="model directory ('tiny': the embedded default)")
    p.add_argument("--load-format", default="dummy", choices=("auto", "dummy"))
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kv", action="store_true", help="also quantization fp8 + kv_cache_dtype fp8 (variant fp8kv)")
    p.add_argument("--engine-json", default="{}", help="more engine fields for both engines (JSON object)")
    p.add_argument("--out", default=None, help="write the figures here (JSON)")
    a = p.parse_args(argv)
    model = resolve_model(a.model)
    length = a.prompt_len + a.max_tokens
    extra = engine_fields_from_json(a.engine_json)
    bs = extra.get("block_size", CacheConfig().block_size)
    # a pool for the prompts and their outputs (the teacher-forced step reuses blocks from 0), not a memory share
    fields = {"load_format": a.load_format, "max_model_len": max(length, 128), "max_num_seqs": a.prompts,
              "max_num_batched_tokens": max(a.prompts * a.prompt_len, length, 128), "enable_prefix_caching": False,
              "num_kvcache_blocks": a.prompts * (-(-length // bs)) + 8, **extra}
    variants = {"fp8": {"quantization": "fp8"}}
    if a.kv:
        variants["fp8kv"] = {"quantization": "fp8", "kv_cache_dtype": "fp8"}
    base = LLM(model, **fields)
    prompts = make_prompts(a.prompts, a.prompt_len, base.engine.model_runner.vocab_size, a.seed)
    out_base = greedy(base, prompts, a.max_tokens)
    errs = layer_errors(base, prompts)
    lb = step_logits(base, prompts)
    compared = {}
    for name, extra in variants.items():
        llm = LLM(model, **{**fields, **extra})
        out = greedy(llm, prompts, a.max_tokens)
        lf = step_logits(llm, prompts)
        cos = torch.nn.functional.cosine_similarity(lf, lb, dim=-1)
        argmax = (lf.argmax(-1) == lb.argmax(-1)).float().mean().item()
        compared[name] = {"fields": extra, "greedy": agreement(out, out_base),
                          "teacher_forced": {"positions": len(cos), "logits_cosine_mean": cos.mean().item(),
                                             "logits_cosine_min": cos.min().item(), "argmax_agreement": argmax}}
        del llm, lf
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    res = {"model": os.path.basename(os.path.normpath(model)), "load_format": a.load_format,
           "device": str(base.engine.model_runner.device), "dtype": str(base.engine.model_runner.dtype),
           "prompts": a.prompts, "prompt_len": a.prompt_len, "max_tokens": a.max_tokens, "seed": a.seed,
           "layer_rel_error": {k: {"mean": sum(v) / len(v), "max": max(v), "per_layer": v} for k, v in errs.items()},
           "variants": compared}
    print(f"{res['model']} ({res['device']}, {res['dtype']} vs fp8), {a.prompts} prompts x {a.prompt_len} tokens")
    print("| projection | rel. error mean | max (over layers) |")
    print("|---|---|---|")
    for k, v in res["layer_rel_error"].items():
        print(f"| {k} | {v['mean']:.4f} | {v['max']:.4f} |")
    print(f"| vs {res['dtype']} | greedy first token equal | matched prefix ({a.max_tokens} tokens) | sequences "
          "equal | logits cosine mean (min) | argmax agreement |")
    print("|---|---|---|---|---|---|")
    for name, c in compared.items():
        g, t = c["greedy"], c["teacher_forced"]
        print(f"| {name} | {g['first_token_equal']:.3f} | {g['matched_prefix_fraction_mean']:.3f} | "
              f"{g['sequences_equal']:.3f} | {t['logits_cosine_mean']:.4f} ({t['logits_cosine_min']:.4f}) | "
              f"{t['argmax_agreement']:.3f} |")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
