"""Router simulation (issue 42): `python -m bench.service.router_sim --policies load_guarded,events,oracle ...` runs the
same simulated cluster and workload under each policy and prints one JSON line per run (bench/service/sim/)."""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import time

from bench.service.sim.cluster import Cluster, SimConfig
from bench.service.sim.report import summarize

log = logging.getLogger(__name__)


def run(cfg: SimConfig, model_dir: str) -> dict:
    t0 = time.perf_counter()
    c = Cluster(cfg, model_dir)
    c.run()
    return summarize(c, time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--policies", default="load_guarded,events,oracle")
    ap.add_argument("--out", default="", help="append the JSON lines to this file")
    for f in dataclasses.fields(SimConfig):
        if f.name in ("policy", "step"):
            continue
        kind = float if f.type in ("float", "float | None") else int if f.type == "int" else str
        ap.add_argument("--" + f.name.replace("_", "-"), type=kind, default=f.default)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from flame_llm.models.tiny import resolve_model
    model_dir = resolve_model("tiny")  # its config.json only: the simulation runs no model
    fields = {f.name: getattr(args, f.name) for f in dataclasses.fields(SimConfig) if f.name not in ("policy", "step")}
    for policy in args.policies.split(","):
        res = run(SimConfig(policy=policy, **fields), model_dir)
        line = json.dumps(res)
        log.info("%s", line)
        if args.out:
            with open(args.out, "a") as fh:
                fh.write(line + "\n")


if __name__ == "__main__":
    main()
