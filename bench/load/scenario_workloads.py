"""The seed's four scheduler scenarios as seeded workloads, at full scale (Qwen3-0.6B shapes, one H200)
or small scale (the tiny test model on CPU).

Each scenario names its engine limits (capacity set by an explicit KV block count) and its variants:
one engine flag flipped against the original scheduler (every scenario's engine starts from
config.SCHEDULER_FEATURES_OFF: the engine's defaults have those features on), except `prefix`, which flips the workload
(unique vs shared system prefix) on one engine, then the prefix-dedup flag and same-step sharing on the
shared workload.
Token ids are drawn uniformly from [TOKEN_LOW, vocab).
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field

from flame_llm.config import SCHEDULER_FEATURES_OFF

SCENARIOS = ("starvation", "prefix", "lru_pressure", "cache_aware")
SCALES = ("full", "small")
TOKEN_LOW = 3  # below: special ids of the tiny model (pad/bos/eos)


@dataclass(slots=True)
class Request:
    prompt: list[int]
    max_tokens: int
    group: str = ""  # e.g. "victim": metrics are also reported per group


@dataclass(slots=True)
class Variant:
    name: str
    engine: dict = field(default_factory=dict)  # Config overrides for this variant
    workload: str = ""  # prefix scenario only: "unique" | "shared"


@dataclass(slots=True)
class Scenario:
    name: str
    engine: dict  # Config limits shared by every variant
    variants: list[Variant]
    params: dict  # workload sizes, recorded in the results


FULL = dict(block_size=256, max_num_batched_tokens=8192, max_model_len=4096)
SMALL = dict(block_size=16, max_num_seqs=16, max_num_batched_tokens=512, max_model_len=512)
# scenario -> scale -> (engine limits, workload sizes)
SIZES = {
    "starvation": {
        "full": (dict(FULL, num_kvcache_blocks=1024, max_num_seqs=128),
                 dict(victims=96, victim_len=(32, 64), victim_out=2, blockers=96, blocker_len=(1200, 1600),
                      blocker_out=16)),
        "small": (dict(SMALL, num_kvcache_blocks=256, max_num_batched_tokens=256, max_model_len=256),
                  dict(victims=8, victim_len=(4, 8), victim_out=2, blockers=8, blocker_len=(150, 200),
                       blocker_out=8)),
    },
    "prefix": {
        "full": (dict(FULL, num_kvcache_blocks=1024, max_num_seqs=128),
                 dict(requests=128, prefix_len=1024, question_len=(32, 96), out=16)),
        "small": (dict(SMALL, num_kvcache_blocks=256),
                  dict(requests=24, prefix_len=128, question_len=(4, 12), out=4)),
    },
    "lru_pressure": {
        "full": (dict(FULL, num_kvcache_blocks=160, max_num_seqs=64),
                 dict(prefixes=128, prefix_len=512, requests=384, zipf=1.1, question_len=(16, 64), out=16)),
        "small": (dict(SMALL, num_kvcache_blocks=80),
                  dict(prefixes=32, prefix_len=64, requests=128, zipf=1.1, question_len=(2, 8), out=4)),
    },
    "cache_aware": {
        "full": (dict(FULL, num_kvcache_blocks=160, max_num_seqs=64),
                 dict(prefixes=64, prefix_len=1024, requests=512, question_len=(16, 64), out=16)),
        "small": (dict(SMALL, num_kvcache_blocks=72, cache_aware_window=16),
                  dict(prefixes=16, prefix_len=128, requests=128, question_len=(2, 8), out=4)),
    },
}

VARIANTS = {
    "starvation": [Variant("baseline"), Variant("chunked", dict(enable_chunked_prefill=True))],
    "prefix": [Variant("unique", dict(enable_same_step_prefix_sharing=False), workload="unique"),
               Variant("shared", dict(enable_same_step_prefix_sharing=False), workload="shared"),
               # the shared workload again, followers waiting for the in-flight prefix instead of recomputing it
               Variant("shared-dedup", dict(enable_prefix_dedup=True, enable_same_step_prefix_sharing=False),
                       workload="shared"),
               # ... or sharing the prefix blocks from the step that computes them (the engine's default)
               Variant("shared-same-step", dict(enable_same_step_prefix_sharing=True), workload="shared")],
    "lru_pressure": [Variant("fifo"), Variant("lru", dict(enable_lru=True))],
    "cache_aware": [Variant("fifo"), Variant("lpm", dict(enable_cache_aware_schedule=True)),
                    # a wider window and looser aging: more hits, a weaker fairness bound (module doc)
                    Variant("lpm-wide", dict(enable_cache_aware_schedule=True, cache_aware_window=256,
                                             cache_aware_max_skips=256))],
}


def scenario(name: str, scale: str) -> Scenario:
    if name not in SCENARIOS:
        raise ValueError(f"scenario must be one of {SCENARIOS}; got {name!r}")
    if scale not in SCALES:
        raise ValueError(f"scale must be one of {SCALES}; got {scale!r}")
    engine, params = SIZES[name][scale]
    return Scenario(name, {**SCHEDULER_FEATURES_OFF, **engine}, list(VARIANTS[name]), dict(params))


def find_variant(sc: Scenario, name: str) -> Variant:
    for v in sc.variants:
        if v.name == name:
            return v
    raise ValueError(f"variant of {sc.name!r} must be one of {[v.name for v in sc.variants]}; got {name!r}")


def build_requests(sc: Scenario, variant: Variant, vocab_size: int, seed: int = 0) -> list[Request]:
    """The measured requests in submission order (every variant of a scenario gets the same ones,
    except `prefix`, whose variants are the two workloads)."""
    rng = random.Random(seed)
    p = sc.params

    def tokens(n: int) -> list[int]:
        return [rng.randrange(TOKEN_LOW, vocab_size) for _ in range(n)]

    if sc.name == "starvation":
        victims = [Request(tokens(rng.randint(*p["victim_len"])), p["victim_out"], "victim")
                   for _ in range(p["victims"])]
        blockers = [Request(tokens(rng.randint(*p["blocker_len"])), p["blocker_out"], "blocker")
                    for _ in range(p["blockers"])]
        return victims + blockers  # victims are submitted first
    if sc.name == "prefix":
        shared = tokens(p["prefix_len"])
        return [Request((shared if variant.workload == "shared" else tokens(p["prefix_len"]))
                        + tokens(rng.randint(*p["question_len"])), p["out"]) for _ in range(p["requests"])]
    prefixes = [tokens(p["prefix_len"]) for _ in range(p["prefixes"])]
    if sc.name == "lru_pressure":  # power-law popularity, shuffled arrival
        weights = [1.0 / (k + 1) ** p["zipf"] for k in range(p["prefixes"])]
        picks = rng.choices(range(p["prefixes"]), weights, k=p["requests"])
    else:  # cache_aware: round-robin over the prefixes
        picks = [i % p["prefixes"] for i in range(p["requests"])]
    return [Request(prefixes[k] + tokens(rng.randint(*p["question_len"])), p["out"]) for k in picks]


def shifted(requests: list[Request], shift: int, vocab_size: int) -> list[Request]:
    """Same lengths and prefix relations, other ids: warmup that leaves the measured prefixes unseen."""
    span = vocab_size - TOKEN_LOW
    return [Request([TOKEN_LOW + (t - TOKEN_LOW + shift) % span for t in r.prompt], r.max_tokens, r.group)
            for r in requests]
