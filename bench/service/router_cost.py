"""What routing costs: route calls/s and requests/s for 1..64 simulated shards, through the pure policy
and through the named Ray actor, with batches of 128 prompts of ~8K tokens (chains precomputed; chain
computation is timed on its own).

The workload is the reuse trace's shape: documents of `--prompt-tokens` tokens asked `--reuse` times
each, shuffled. After each routed batch the previous batch's completions are fed back (one batch in
flight), with cached tokens = the document's length when its shard had already seen it.

    python -m bench.service.router_cost --out bench/results/router_cost.json
"""
from __future__ import annotations

import argparse
import json
import logging
import statistics
import time
import uuid

import numpy as np
import ray
from tqdm import tqdm

from flame_llm.protocol.routing_key import Completion, RouteItem, estimate_prefill_work, prefix_chain
from router.actor import Router
from router.policy import RouterConfig, RouterPolicy

log = logging.getLogger("bench.service.router_cost")
REVISION = "bench-router-cost"


def make_workload(num_requests: int, prompt_tokens: int, reuse: int, vocab: int, seed: int):
    """(document per request, question tokens) and the documents' token arrays."""
    rng = np.random.default_rng(seed)
    num_docs = max(1, num_requests // reuse)
    docs = rng.integers(0, vocab, (num_docs, prompt_tokens), dtype=np.uint32)
    order = rng.permutation(np.arange(num_requests) % num_docs)
    return docs, order


def time_chains(docs: np.ndarray, question_tokens: int, sample: int) -> dict:
    """prefix_chain per prompt (document + question), as a uint32 array and as a Python list."""
    rng = np.random.default_rng(1)
    prompts = [np.concatenate([d, rng.integers(0, 1000, question_tokens, dtype=np.uint32)])
               for d in docs[:sample]]
    out = {"prompts": len(prompts), "prompt_tokens": int(prompts[0].size)}
    for kind, data in [("array", prompts), ("list", [p.tolist() for p in prompts])]:
        t0 = time.perf_counter()
        for p in data:
            prefix_chain(p, REVISION)
        out[f"{kind}_us_per_prompt"] = (time.perf_counter() - t0) / len(data) * 1e6
    return out


def run_policy(route, complete, batches, doc_of, doc_tokens: int, decode_tokens: int, num_shards: int):
    """Route every batch through route(items); returns per-call seconds, hit fraction and seconds spent
    sending completions. complete(list) is called with the previous batch's completions."""
    work = estimate_prefill_work(doc_tokens)
    seen: set[tuple[int, int]] = set()
    lat, pending, cached, t_complete = [], [], 0, 0.0
    for items, docs in zip(batches, doc_of, strict=True):
        t0 = time.perf_counter()
        shards = route(items)
        lat.append(time.perf_counter() - t0)
        if pending:
            t0 = time.perf_counter()
            complete(pending)
            t_complete += time.perf_counter() - t0
        pending = []
        for s, d in zip(shards, docs, strict=True):
            hit = (s, d) in seen
            seen.add((s, d))
            cached += doc_tokens if hit else 0
            pending.append(Completion(s, work, decode_tokens, doc_tokens, doc_tokens if hit else 0))
    if pending:
        complete(pending)
    n_req = sum(len(b) for b in batches)
    return lat, cached / (n_req * doc_tokens), t_complete


def summarize(lat: list[float], batch_size: int) -> dict:
    total = sum(lat)
    q = statistics.quantiles(lat, n=100) if len(lat) >= 2 else lat * 99
    return {"calls": len(lat), "calls_per_s": len(lat) / total, "requests_per_s": len(lat) * batch_size / total,
            "p50_ms": q[49] * 1e3, "p99_ms": q[98] * 1e3}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shards", default="1,2,4,8,16,32,64")
    ap.add_argument("--policies", default="cumulative,load_guarded,round_robin")
    ap.add_argument("--batches", type=int, default=64, help="routed batches per (shards, policy), pure policy")
    ap.add_argument("--actor-batches", type=int, default=64, help="routed batches per shards count, Ray actor")
    ap.add_argument("--actor-policy", default="load_guarded", help="policy measured through the actor")
    ap.add_argument("--no-actor", action="store_true")
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--prompt-tokens", type=int, default=8192)
    ap.add_argument("--question-tokens", type=int, default=64)
    ap.add_argument("--reuse", type=int, default=4, help="questions per document")
    ap.add_argument("--decode-tokens", type=int, default=16)
    ap.add_argument("--chain-sample", type=int, default=512, help="prompts timed for chain computation")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)
    shard_counts = [int(x) for x in args.shards.split(",")]
    policies = args.policies.split(",")
    for p in policies + [args.actor_policy]:
        RouterPolicy(1, RouterConfig(p))  # an unknown policy fails here, before any work
    num_batches = max(args.batches, args.actor_batches)
    num_requests = num_batches * args.batch_size
    docs, order = make_workload(num_requests, args.prompt_tokens, args.reuse, 50_000, args.seed)
    chains = [prefix_chain(d, REVISION) for d in tqdm(docs, desc="document chains", leave=False)]
    work = estimate_prefill_work(args.prompt_tokens + args.question_tokens)
    doc_of = [order[i:i + args.batch_size].tolist() for i in range(0, num_requests, args.batch_size)]
    batches = [[RouteItem(chains[d], work, args.decode_tokens) for d in b] for b in doc_of]  # as the client sends

    result = {"config": vars(args), "chain": time_chains(docs, args.question_tokens, args.chain_sample), "rows": []}
    combos = [("policy", n, p) for n in shard_counts for p in policies]
    if not args.no_actor:
        combos += [("actor", n, args.actor_policy) for n in shard_counts]
    actors = _start_actors(shard_counts, args.actor_policy) if not args.no_actor else {}
    try:
        for path, n, policy in tqdm(combos, desc="router cost"):
            if path == "policy":
                pol = RouterPolicy(n, RouterConfig(policy))
                route, complete = pol.route_batch, pol.complete_many
                k = args.batches
            else:
                actor = actors[n]
                route = lambda items, a=actor: ray.get(a.route.remote(items))
                complete = lambda c, a=actor: a.complete.remote(c)  # fire and forget, as the client does
                route(batches[0][:1])  # warm the call path
                k = args.actor_batches
            t0 = time.perf_counter()
            lat, hit, t_complete = run_policy(route, complete, batches[:k], doc_of[:k], args.prompt_tokens,
                                              args.decode_tokens, n)
            stats = pol.stats() if path == "policy" else ray.get(actor.stats.remote())
            wall = time.perf_counter() - t0
            c = stats["counters"]
            routed = max(1, c["hit"] + c["new"] + c["spill"] + c["moved"] + c["round_robin"])
            result["rows"].append({"path": path, "shards": n, "policy": policy, **summarize(lat, args.batch_size),
                                   "complete_ms_per_batch": t_complete / max(1, k - 1) * 1e3, "wall_s": wall,
                                   "cached_fraction": hit, "spill_fraction": c["spill"] / routed,
                                   "entries": stats["entries"]})
    finally:
        if actors:
            for a in actors.values():
                ray.kill(a)
            ray.shutdown()
    print_table(result)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return result


def _start_actors(shard_counts: list[int], policy: str) -> dict:
    """One router actor per shard count, created together so their worker processes start in parallel."""
    if not ray.is_initialized():
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
                 logging_level=logging.WARNING)
    ns = f"router-cost-{uuid.uuid4().hex[:8]}"
    actors = {n: Router.options(name=f"router-{n}", namespace=ns).remote(n, RouterConfig(policy)) for n in shard_counts}
    ray.get([a.config.remote() for a in actors.values()])
    return actors


def print_table(result: dict) -> None:
    ch = result["chain"]
    print(f"prefix_chain on {ch['prompt_tokens']}-token prompts: {ch['array_us_per_prompt']:.1f} us (uint32 array), "
          f"{ch['list_us_per_prompt']:.1f} us (list)")
    print(f"{'path':<7}{'shards':>7}  {'policy':<13}{'calls/s':>10}{'req/s':>12}{'p50 ms':>9}{'p99 ms':>9}"
          f"{'cached':>8}{'spill':>7}")
    for r in result["rows"]:
        print(f"{r['path']:<7}{r['shards']:>7}  {r['policy']:<13}{r['calls_per_s']:>10.0f}{r['requests_per_s']:>12.0f}"
              f"{r['p50_ms']:>9.3f}{r['p99_ms']:>9.3f}{r['cached_fraction']:>8.1%}{r['spill_fraction']:>7.1%}")


if __name__ == "__main__":
    main()
