"""The service's YAML config: one flat dataclass, every field validated with an error naming it."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import yaml

from flame_llm.protocol.types import DEFAULT_MAX_PAYLOAD_BYTES
from router.policy import POLICIES as ROUTER_POLICIES

DEFAULT_NAMESPACE = "flame"  # the Ray namespace of a service, unless configured


@dataclass(slots=True)
class ServiceConfig:
    model: str = "tiny"  # a model directory, or "tiny" for the embedded default checkpoint
    load_format: str = "auto"  # "auto" (safetensors) | "dummy"
    engine: dict = field(default_factory=dict)  # extra flame_llm.config.Config fields
    num_shards: int | str = "auto"  # "auto": one per GPU on every node, or cpu_shards without GPUs
    cpu_shards: int = 2
    cpu_per_shard: float = 0.5  # Ray CPUs reserved by each CPU shard (two fit on a 2-CPU machine)
    torch_threads: int = 1  # intra-op threads of a CPU shard
    gpu_uuids: list[str] = field(default_factory=list)  # restrict to these GPUs (empty: all)
    router_policy: str = "cumulative"  # the seed's; load_guarded spills long bursts on one prefix (router/policy.py)
    spill_factor: float = 1.25
    max_batch_prompts: int = 128
    batch_window_ms: float = 10.0
    max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES  # decoded payload budget of one batch
    zstd_level: int = 1
    # per shard: prompt + max output tokens of admitted requests; above the seed reuse trace's 1.06M per shard
    max_inflight_tokens: int = 1 << 22
    max_inflight_requests: int = 1024
    max_queued_requests: int = 4096  # waiting for admission; past this a request is rejected
    max_restarts: int = 3  # per engine actor (-1: unlimited)
    max_retries: int = 20  # client resubmissions of one request (overloaded or dead shard)
    ray_address: str | None = None  # None: start a local Ray; "auto" or "host:port": join
    namespace: str = DEFAULT_NAMESPACE
    ray_num_cpus: int | None = None  # for a locally started Ray only
    startup_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        from flame_llm.config import FIELD_NAMES

        known = set(FIELD_NAMES) - {"load_format"}
        unknown = sorted(set(self.engine) - known) if isinstance(self.engine, dict) else []
        _need(not unknown, "engine", f"Config fields only ({', '.join(sorted(known))})", unknown)
        ns = self.namespace
        name_ok = isinstance(ns, str) and ns.replace("-", "").replace("_", "").isalnum()
        checks = [
            ("model", isinstance(self.model, str) and self.model != "", "a model directory or 'tiny'"),
            ("load_format", self.load_format in ("auto", "dummy"), "one of 'auto', 'dummy'"),
            ("engine", isinstance(self.engine, dict), "a mapping of Config field names to values"),
            ("num_shards", self.num_shards == "auto" or _int(self.num_shards) and self.num_shards >= 1,
             "'auto' or an integer >= 1"),
            ("cpu_shards", _int(self.cpu_shards) and self.cpu_shards >= 1, "an integer >= 1"),
            ("cpu_per_shard", _num(self.cpu_per_shard) and self.cpu_per_shard >= 0, ">= 0"),
            ("torch_threads", _int(self.torch_threads) and self.torch_threads >= 1, "an integer >= 1"),
            ("gpu_uuids", isinstance(self.gpu_uuids, list) and _strs(self.gpu_uuids),
             "a list of GPU UUID strings"),
            ("router_policy", self.router_policy in ROUTER_POLICIES, f"one of {ROUTER_POLICIES}"),
            ("spill_factor", _num(self.spill_factor) and self.spill_factor >= 1.0, "a number >= 1.0"),
            ("max_batch_prompts", _int(self.max_batch_prompts) and self.max_batch_prompts >= 1,
             "an integer >= 1"),
            ("batch_window_ms", _num(self.batch_window_ms) and 0 <= self.batch_window_ms <= 10_000,
             "in [0, 10000]"),
            ("max_payload_bytes", _int(self.max_payload_bytes) and 1024 <= self.max_payload_bytes <= 1 << 30,
             "an integer in [1024, 2**30]"),
            ("zstd_level", _int(self.zstd_level) and 1 <= self.zstd_level <= 22, "an integer in [1, 22]"),
            ("max_inflight_tokens", _int(self.max_inflight_tokens) and self.max_inflight_tokens >= 1,
             "an integer >= 1"),
            ("max_inflight_requests", _int(self.max_inflight_requests) and self.max_inflight_requests >= 1,
             "an integer >= 1"),
            ("max_queued_requests", _int(self.max_queued_requests) and self.max_queued_requests >= 0,
             "an integer >= 0"),
            ("max_restarts", _int(self.max_restarts) and self.max_restarts >= -1, "an integer >= -1"),
            ("max_retries", _int(self.max_retries) and self.max_retries >= 0, "an integer >= 0"),
            ("ray_address", self.ray_address is None or _strs([self.ray_address]) and self.ray_address != "",
             "null, 'auto' or 'host:port'"),
            ("namespace", name_ok, "a non-empty name of letters, digits, '-' and '_'"),
            ("ray_num_cpus", self.ray_num_cpus is None or _int(self.ray_num_cpus) and self.ray_num_cpus >= 1,
             "null or an integer >= 1"),
            ("startup_timeout_s", _num(self.startup_timeout_s) and self.startup_timeout_s > 0, "> 0"),
        ]
        for name, ok, limit in checks:
            _need(ok, name, limit, getattr(self, name))

    def engine_kwargs(self) -> dict:
        return {"load_format": self.load_format, **self.engine}


def load_service_config(path: str, **overrides) -> ServiceConfig:
    """Read a YAML file (a mapping of ServiceConfig fields); `overrides` win over the file."""
    with open(path) as f:
        try:
            raw = yaml.safe_load(f)
        except yaml.YAMLError as e:
            raise ValueError(f"{path}: not valid YAML: {e}") from None
    raw = {} if raw is None else raw
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: the top level must be a mapping of config fields; "
                         f"got {type(raw).__name__}")
    raw.update({k: v for k, v in overrides.items() if v is not None})
    return config_from_dict(raw, source=path)


def config_from_dict(raw: dict, source: str = "config") -> ServiceConfig:
    known = {f.name for f in dataclasses.fields(ServiceConfig)}
    unknown = sorted(str(k) for k in raw if k not in known)
    if unknown:
        raise ValueError(f"{source}: unknown field(s) {unknown}; known: {', '.join(sorted(known))}")
    try:
        return ServiceConfig(**raw)
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from None


def _int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _strs(v: list) -> bool:
    return all(isinstance(x, str) for x in v)


def _num(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _need(ok: bool, name: str, limit: str, value: object) -> None:
    if not ok:
        raise ValueError(f"service config field {name!r} must be {limit}; got {value!r}")
