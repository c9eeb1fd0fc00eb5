"""How much of a trace's decode-row attention reads a prefix that other rows of the same step share: the engine
runs the trace offline (tiny random model on CPU, the seed's limits and block size; the schedule, not the
arithmetic, is what counts), and every step's decode rows are cut into shared-prefix segments as
RunnerConfig.shared_prefix_decode would (kernels/shared_prefix.plan_segments). Per path the rows would take on a GPU
(decode graph; mixed-step graph up to 512 tokens, its leading decode rows; eager with its decode rows split off on
the fa4 backend; the pruned last layer's rows of eager steps): steps, rows, keys read without and with
the segments, and how many rows share their document with 0, 1, 2, ... others.

    python -m bench.decode_sharing --trace reuse --out sharing.json      (about a minute on 2 CPU cores)"""
from __future__ import annotations

import argparse
import collections
import logging
import sys
import tempfile

import numpy as np

from bench.provenance import write_json
from bench.traces import SEED_LIMITS, TraceConfig, make_trace, warmup_traces
from flame_llm.config import engine_fields_from_json

log = logging.getLogger(__name__)


def _account(rows: dict, sizes: dict, path: str, tables: np.ndarray, lens: np.ndarray, block_size: int) -> None:
    from flame_llm.kernels.shared_prefix import plan_segments

    segs = plan_segments(tables, lens, block_size)[0]
    r = rows[path]
    r["steps"] += 1
    r["rows"] += len(lens)
    r["keys"] += int(lens.sum())
    r["keys_shared"] += int((segs[:, 2] - segs[:, 1]).sum())
    sizes[path].update(collections.Counter(collections.Counter(tables[:, 0].tolist()).values()))


def run(trace: str, block_size: int, mixed_tokens: int, engine_json: dict | None = None) -> dict:
    from flame_llm import LLM, SamplingParams
    from flame_llm.models.tiny import make_tiny_model

    path = make_tiny_model(tempfile.mkdtemp(prefix="sharing-"), num_layers=1, max_position_embeddings=32768)
    llm = LLM(path, attention_backend="torch", block_size=block_size, cpu_kvcache_gib=4.0, enable_prefix_caching=True,
              enable_chunked_prefill=True, **(SEED_LIMITS | (engine_json or {})))
    runner = llm.engine.model_runner
    rows = collections.defaultdict(lambda: dict(steps=0, rows=0, keys=0, keys_shared=0))
    sizes: dict = collections.defaultdict(collections.Counter)
    prepare = runner.prepare_launch

    def spy(scheduled, prev=None):
        p = prepare(scheduled, prev)
        x = p.x
        q = np.diff(x.cu_seqlens_q)
        d = len(q) if x.is_decode else int(np.argmin(q == 1)) if (q == 1).any() else 0
        where = ("decode graph" if x.is_decode else
                 f"mixed graph (<= {mixed_tokens} tokens)" if q.sum() <= mixed_tokens else "eager (decode rows split)")
        if d:
            _account(rows, sizes, where, x.block_tables[:d], x.seq_lens[:d], block_size)
        kept = [i for i in x.sample_idx if q[i] > 1]
        if kept and where.startswith("eager"):
            _account(rows, sizes, "pruned rows (eager)", x.block_tables[kept], x.seq_lens[kept], block_size)
        return p

    runner.prepare_launch = spy
    cfg = TraceConfig(name=trace, vocab_size=512, seed=0)
    sp = SamplingParams(temperature=0, max_tokens=cfg.output_tokens, ignore_eos=True)
    llm.generate([r.token_ids.tolist() for r in warmup_traces(cfg, 1)[0].requests], sp, use_tqdm=False)
    rows.clear()
    sizes.clear()
    llm.generate([r.token_ids.tolist() for r in make_trace(cfg).requests], sp, use_tqdm=False)
    return {"trace": trace, "paths": {k: {**v, "group_sizes": dict(sorted(sizes[k].items()))} for k, v in rows.items()}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.decode_sharing", description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", default="reuse")
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--mixed-tokens", type=int, default=512, help="cuda_graph_mixed_tokens on the GPU")
    p.add_argument("--engine-json", default="{}", help="more engine fields (JSON), e.g. the scheduler's flags")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    res = run(a.trace, a.block_size, a.mixed_tokens, engine_fields_from_json(a.engine_json))
    write_json(a.out, {"argv": sys.argv, **res})
    print("| path | steps | decode rows | keys read (M) | with shared segments (M) | ratio | rows per document |")
    print("|---|---|---|---|---|---|---|")
    for k, v in res["paths"].items():
        print(f"| {k} | {v['steps']} | {v['rows']} | {v['keys'] / 1e6:.2f} | {v['keys_shared'] / 1e6:.2f} | "
              f"{v['keys_shared'] / max(v['keys'], 1):.2f} | {v['group_sizes']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
