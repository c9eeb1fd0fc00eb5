"""Speculative decoding on one GPU (issue 5): Qwen3-8B-shaped target, Qwen3-0.6B-shaped draft, dummy
weights shaped by bench/engine/draft_model.py so the draft's greedy agreement is set (and the acceptance
measured). One engine, in one process: the target alone (the plain engine step), speculative decoding
for each batch size x K x agreement, the auto-off path (speculation configured, batch above its
limit), one eager point, and a profiled run per batch size and K (FLAME_SPEC_PROFILE segments).
Writes JSON to --out and prints a table last (~4-5 min on an H200).

    python -m bench.engine.spec_bench --out $OUT/spec.json [--batches 1,4,16,64] [--ks 1,2,3,4]
        [--agreements 0.6,0.76,0.9] [--prompt-len 256] [--max-tokens 128]

CPU dry run of the script itself (tiny shapes): --target DIR --draft-base DIR with two tiny model dirs.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import tempfile
import time

import torch

from bench.engine.draft_model import CONFIGS, set_agreement, shape_pair, write_draft_config
from flame_llm import LLM, SamplingParams
from flame_llm.engine.speculative.profiler import StepProfiler

TARGET = os.path.join(CONFIGS, "qwen3-8b")


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n, length), generator=g).tolist()


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def measure(llm: LLM, ps: list[list[int]], max_tokens: int) -> tuple[dict, list[list[int]]]:
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    sync()
    t = time.perf_counter()
    outs = llm.generate(ps, sp, use_tqdm=False)
    sync()
    wall = time.perf_counter() - t
    first = max(o.metrics.first_token_time for o in outs)
    finish = max(o.metrics.finish_time for o in outs)
    decoded = sum(len(o.output_token_ids) - 1 for o in outs)
    res = {"wall_s": wall, "tpot_p50_ms": 1e3 * statistics.median(o.metrics.tpot for o in outs),
           "decode_tok_s": decoded / (finish - first), "decode_s": finish - first}
    return res, [o.output_token_ids for o in outs]


def spec_stats(llm: LLM) -> dict:
    s = llm.engine.stats()
    out = {"acceptance": s["spec_acceptance_rate"], "mean_accepted_len": s["spec_mean_accepted_length"],
           "spec_steps": s["spec_steps"], "plain_decode_steps": s["spec_plain_decode_steps"]}
    if "spec_profile_ms" in s:
        out["profile_ms"] = s["spec_profile_ms"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--batches", default="1,4,16,64")
    ap.add_argument("--ks", default="1,2,3,4")
    ap.add_argument("--agreements", default="0.6,0.76,0.9")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--eager-k", type=int, default=3)
    ap.add_argument("--target", default=TARGET)
    ap.add_argument("--draft-base", default=os.path.join(CONFIGS, "qwen3-0.6b"))
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    batches = [int(x) for x in args.batches.split(",")]
    ks = [int(x) for x in args.ks.split(",")]
    agreements = [float(x) for x in args.agreements.split(",")]
    t0 = time.perf_counter()
    draft_dir = write_draft_config(os.path.join(tempfile.mkdtemp(), "draft-untied"), args.draft_base)
    llm = LLM(args.target, load_format="dummy", speculative_model=draft_dir, num_speculative_tokens=max(ks),
              speculative_max_batch_size=max(batches), max_num_seqs=max(batches), max_model_len=2048,
              max_num_batched_tokens=max(16384, max(batches) * args.prompt_len), enable_prefix_caching=False,
              attention_backend=args.backend)
    eng = llm.engine
    spec = eng.spec
    pi = shape_pair(eng.model_runner.model, spec.draft.model, agreements[0])
    for k in ks:
        spec.set_num_speculative_tokens(k)  # captures each K's graphs now, outside the measurements
    vocab = eng.vocab_size
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    res: dict = {"device": device, "torch": torch.__version__,
                 "attention_backend": eng.model_runner.backend, "num_kv_blocks": eng.block_manager.num_blocks,
                 "prompt_len": args.prompt_len, "max_tokens": args.max_tokens, "setup_s": time.perf_counter() - t0,
                 "runs": []}
    seed = [0]

    def run(label: str, batch: int, use_spec: bool, k: int | None = None, agreement: float | None = None,
            profile: bool = False, max_batch: int | None = None) -> dict:
        seed[0] += 1
        eng.spec = spec if use_spec else None
        if use_spec:
            spec.max_batch_size = max(batches) if max_batch is None else max_batch
            spec.set_num_speculative_tokens(k)
            if agreement is not None:
                set_agreement(spec.draft.model, pi, agreement)
            spec.profiler = StepProfiler(eng.model_runner.device) if profile else None
        row, outs = measure(llm, prompts(batch, args.prompt_len, vocab, seed[0]), args.max_tokens)
        row.update(label=label, batch=batch, k=k, agreement=agreement)
        if use_spec:
            row.update(spec_stats(llm))
        spec.profiler = None
        eng.spec = spec
        row["outputs"] = outs
        return row

    def save():
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)

    for batch in batches:
        run("warmup", batch, False)
        run("warmup", batch, True, ks[-1], agreements[-1])
        base = run("target", batch, False)
        rows = [base]
        for agreement in agreements:
            for k in ks:
                rows.append(run("spec", batch, True, k, agreement))
        for k in ks:
            rows.append(run("spec-profiled", batch, True, k, agreements[len(agreements) // 2], profile=True))
        rows.append(run("auto-off", batch, True, ks[-1], agreements[-1], max_batch=batch - 1))
        if batch == batches[0]:  # one eager point: the plain step and the speculative runner without graphs
            runner_graphs = {k: spec.runners[k].use_graphs for k in spec.runners}
            target_graphs, eng.model_runner.use_graphs = eng.model_runner.use_graphs, False
            for r in spec.runners.values():
                r.use_graphs = r.pad_batches = False
            eager_base = run("target-eager", batch, False)
            rows += [eager_base, run("spec-eager", batch, True, args.eager_k, agreements[-1])]
            eng.model_runner.use_graphs = target_graphs
            for k, r in spec.runners.items():
                r.use_graphs = r.pad_batches = runner_graphs[k]
        for row in rows:
            ref = eager_base if row["label"].endswith("eager") else base
            row["speedup"] = row["decode_tok_s"] / ref["decode_tok_s"]
        # every run has fresh prompts (no cache effects), so token identity is checked on one shared set
        check = prompts(batch, args.prompt_len, vocab, 10_000 + batch)
        eng.spec = None
        _, want = measure(llm, check, 32)
        eng.spec = spec
        spec.max_batch_size = max(batches)
        spec.set_num_speculative_tokens(ks[-1])
        set_agreement(spec.draft.model, pi, agreements[0])
        _, got = measure(llm, check, 32)
        res.setdefault("greedy_identical", {})[batch] = got == want
        for row in rows:
            row.pop("outputs")
        res["runs"] += rows
        res["elapsed_s"] = time.perf_counter() - t0
        save()
    print_table(res)


def print_table(res: dict) -> None:
    print(f"\n{res['device']}  torch {res['torch']}  attention {res['attention_backend']}  "
          f"prompt {res['prompt_len']}  output {res['max_tokens']}  setup {res['setup_s']:.0f}s  "
          f"total {res['elapsed_s']:.0f}s  greedy identical to target: {res['greedy_identical']}")
    print(f"{'run':<14}{'B':>4}{'K':>3}{'agree':>7}{'accept':>8}{'len':>6}{'TPOT p50':>10}{'tok/s':>9}"
          f"{'speedup':>9}{'wall s':>8}   profile ms/step")
    for r in res["runs"]:
        if r["label"] == "warmup":
            continue
        prof = " ".join(f"{k}={v:.2f}" for k, v in r.get("profile_ms", {}).items())
        print(f"{r['label']:<14}{r['batch']:>4}{r['k'] or '-':>3}"
              f"{'-' if r['agreement'] is None else format(r['agreement'], '.2f'):>7}"
              f"{'-' if 'acceptance' not in r else format(r['acceptance'], '.2f'):>8}"
              f"{'-' if 'mean_accepted_len' not in r else format(r['mean_accepted_len'], '.2f'):>6}"
              f"{r['tpot_p50_ms']:>10.2f}{r['decode_tok_s']:>9.0f}{r['speedup']:>9.2f}{r['wall_s']:>8.2f}   {prof}")


if __name__ == "__main__":
    main()
