"""What cache events cost the engine's host step: one SimShard (the real Scheduler and BlockManager) runs the same
document-QA stream with enable_kv_events off and on (recording, plus cutting a batch after every step, which the
actor does on its own thread), A-B-B-A; host seconds per step and the difference.
`python -m bench.service.sim.event_cost` (no model, no GPU)."""
from __future__ import annotations

import json
import logging
import time

import numpy as np

from bench.service.sim.shard import SimShard, StepModel
from flame_llm.config import Config
from flame_llm.engine.sequence import Sequence
from flame_llm.sampling_params import SamplingParams

log = logging.getLogger(__name__)


def host_s_per_step(model_dir: str, kv_events: bool, n_req: int = 600, seed: int = 0) -> float:
    cfg = Config.from_kwargs(model_dir, model_revision="sim", max_model_len=4096, enable_kv_events=kv_events)
    shard = SimShard(0, cfg, 1024, StepModel(), kv_events)
    rng = np.random.default_rng(seed)
    docs = [rng.integers(0, 256, 2048).tolist() for _ in range(40)]
    sp = SamplingParams(max_tokens=16, ignore_eos=True)
    seqs = [Sequence(docs[int(rng.integers(40))] + rng.integers(0, 256, 64).tolist(), sp, 128) for _ in range(n_req)]
    steps, t0 = 0, time.perf_counter()
    for i in range(0, n_req, 8):  # 8 arrivals a step
        for s in seqs[i:i + 8]:
            shard.add(s)
        steps += shard.step() is not None
    while shard.step() is not None:
        steps += 1
    return (time.perf_counter() - t0) / steps


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from flame_llm.models.tiny import resolve_model
    d = resolve_model("tiny")
    off, on = [], []
    for events in (False, True, True, False, False, True, True, False):
        (on if events else off).append(host_s_per_step(d, events))
    res = {"host_ms_per_step_off": 1e3 * float(np.median(off)), "host_ms_per_step_on": 1e3 * float(np.median(on))}
    res["extra_us_per_step"] = 1e3 * (res["host_ms_per_step_on"] - res["host_ms_per_step_off"])
    log.info("%s", json.dumps(res))


if __name__ == "__main__":
    main()
