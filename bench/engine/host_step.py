"""Host-side cost of one decode step: the scheduler's schedule() and update_from_output() ("postprocess")
and the runner's input preparation, timed around a real step of the tiny model (the forward itself is not
counted). These are the parts of a step that no GPU work overlaps (the step ends with a sync on the sampled
tokens), so they bound what an asynchronous scheduler could save. Since issue 21 schedule() also does the
step's launch bookkeeping that postprocess did before: compare schedule + postprocess across that change.

    python -m bench.engine.host_step --batches 1,16,64 --context 4000 --out /tmp/host_step.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
from tqdm import tqdm

from flame_llm import LLM, SamplingParams
from flame_llm.models.tiny import make_tiny_model


def measure(model: str, batch: int, context: int, block_size: int, steps: int) -> dict:
    # with chunked prefill the first sequences decode while later ones still prefill: room for that too
    max_tokens = steps + 2 + batch * context // 8192 + 1
    blocks_per_seq = (context + max_tokens + block_size) // block_size + 1
    llm = LLM(model, max_model_len=context + max_tokens + 8, max_num_seqs=max(batch, 1), max_num_batched_tokens=8192,
              block_size=block_size, num_kvcache_blocks=batch * blocks_per_seq + 8, enable_chunked_prefill=True,
              device="cpu")
    eng = llm.engine
    g = torch.Generator().manual_seed(0)
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for _ in range(batch):
        eng.add_request(torch.randint(3, 500, (context,), generator=g).tolist(), sp)
    sch, runner = eng.scheduler, eng.model_runner
    while sch.waiting or any(s.num_completion_tokens == 0 for s in sch.running):
        eng.step()
    parts: dict[str, list[float]] = {"schedule": [], "prepare": [], "postprocess": []}
    for _ in range(steps):
        t0 = time.perf_counter()
        scheduled = sch.schedule()
        t1 = time.perf_counter()
        runner.prepare(scheduled.seqs, scheduled.num_scheduled_tokens, scheduled.num_computed_tokens)  # timed only
        t2 = time.perf_counter()
        output = runner.run(scheduled)
        t3 = time.perf_counter()
        sch.update_from_output(output)
        t4 = time.perf_counter()
        assert len(scheduled.seqs) == batch == scheduled.total_num_scheduled_tokens, "every step decodes the batch"
        for k, dt in zip(parts, (t1 - t0, t2 - t1, t4 - t3), strict=True):
            parts[k].append(dt)
    med = {k: 1e6 * statistics.median(v) for k, v in parts.items()}
    return {"batch": batch, "context": context, "block_size": block_size, "steps": steps,
            "median_us": med, "total_us": sum(med.values())}


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model dir (default: a tiny random Llama made here)")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--context", type=int, default=4000)
    ap.add_argument("--block-size", type=int, default=256)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    model = a.model
    if model is None:
        import tempfile
        model = make_tiny_model(tempfile.mkdtemp(prefix="host-step-"), "llama",
                                max_position_embeddings=2 * a.context + 1024)
    rows = [measure(model, int(b), a.context, a.block_size, a.steps)
            for b in tqdm(a.batches.split(","), desc="batch sizes")]
    for r in rows:
        m = r["median_us"]
        print(f"batch {r['batch']:>3} x {r['context']} ctx: schedule {m['schedule']:.0f} us, prepare "
              f"{m['prepare']:.0f} us, postprocess {m['postprocess']:.0f} us, total {r['total_us']:.0f} us")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"argv": sys.argv[1:] if argv is None else argv, "rows": rows}, f, indent=2)
    return rows


if __name__ == "__main__":
    main()
