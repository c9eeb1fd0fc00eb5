"""The service's configuration: one dataclass per part, each owned by the code it configures (placement
in actors/pinning.py, a shard's options in actors/engine_actor.py, the router's in router/policy.py,
the client's and Ray's here), composed into ServiceConfig. The YAML file has one section per part:

    model: configs/models/llama-3.1-8b
    load_format: dummy
    engine: {max_model_len: 32768, enable_chunked_prefill: true}   # flame_llm Config fields
    placement: {num_shards: auto}
    router: {policy: cumulative}
    ray: {namespace: flame}
    http: {port: 8000}                                              # the OpenAI front door

Every field is checked with an error naming section and field. `python -m flame_llm.serving.service_config`
prints the reference of every field with its default (configs/service.reference.yaml, tested to match)."""
from __future__ import annotations

import dataclasses
import inspect
import re
import sys
from dataclasses import dataclass, field

import yaml

from actors.engine_actor import ShardOptions
from actors.pinning import PlacementConfig
from flame_llm.protocol.types import MAX_BATCH_REQUESTS
from flame_llm.serving.http_app import HttpConfig
from router.policy import RouterConfig

DEFAULT_NAMESPACE = "flame"  # the Ray namespace of a service, unless configured


@dataclass(slots=True)
class ClientConfig:
    """The Python client's batching and retries (the `client` section)."""
    max_batch_prompts: int = 128  # a shard's batch leaves at this many prompts,
    batch_window_ms: float = 10.0  # this long after its first one, or at the payload budget
    max_retries: int = 20  # resubmissions of one request (overloaded, draining or dead shard)
    restart_timeout_s: float = 300.0  # how long to wait for a dead shard to come back
    flush_formed: bool = True  # send a generate() call's batches at once (false: the three rules above only)
    flow_control: bool = True  # at most a shard's admission capacity unanswered there (false: rejections retried)
    results_as_finished: bool = True  # each result as it finishes on its shard (false: a batch's results at once)
    overload_deadline_s: float = 300.0  # a request is retried on overloaded shards this long before it fails

    def __post_init__(self) -> None:
        _need("client", "max_batch_prompts", _int(self.max_batch_prompts)
              and 1 <= self.max_batch_prompts <= MAX_BATCH_REQUESTS,
              f"an integer in [1, {MAX_BATCH_REQUESTS}]", self.max_batch_prompts)
        _need("client", "batch_window_ms", _num(self.batch_window_ms) and 0 <= self.batch_window_ms <= 10_000,
              "a number in [0, 10000]", self.batch_window_ms)
        _need("client", "max_retries", _int(self.max_retries) and self.max_retries >= 0, "an integer >= 0",
              self.max_retries)
        _need("client", "restart_timeout_s", _num(self.restart_timeout_s) and self.restart_timeout_s > 0,
              "a number > 0", self.restart_timeout_s)
        _need("client", "flush_formed", isinstance(self.flush_formed, bool), "true or false", self.flush_formed)
        _need("client", "flow_control", isinstance(self.flow_control, bool), "true or false", self.flow_control)
        _need("client", "results_as_finished", isinstance(self.results_as_finished, bool), "true or false",
              self.results_as_finished)
        _need("client", "overload_deadline_s", _num(self.overload_deadline_s) and self.overload_deadline_s >= 0,
              "a number >= 0", self.overload_deadline_s)


@dataclass(slots=True)
class RayConfig:
    """The Ray cluster the service runs in (the `ray` section)."""
    address: str | None = None  # None: start a local Ray; "auto" or "host:port": join a cluster
    namespace: str = DEFAULT_NAMESPACE  # flame-llm submit, status and stop find the service by it
    num_cpus: int | None = None  # CPUs of a locally started Ray (None: every core)
    startup_timeout_s: float = 600.0  # per shard, until it answers health

    def __post_init__(self) -> None:
        a, ns = self.address, self.namespace
        _need("ray", "address", a is None or (isinstance(a, str) and a != ""), "null, 'auto' or 'host:port'", a)
        _need("ray", "namespace", isinstance(ns, str) and ns.replace("-", "").replace("_", "").isalnum(),
              "a non-empty name of letters, digits, '-' and '_'", ns)
        _need("ray", "num_cpus", self.num_cpus is None or (_int(self.num_cpus) and self.num_cpus >= 1),
              "null or an integer >= 1", self.num_cpus)
        _need("ray", "startup_timeout_s", _num(self.startup_timeout_s) and self.startup_timeout_s > 0,
              "a number > 0", self.startup_timeout_s)


SECTIONS = {"placement": PlacementConfig, "shard": ShardOptions, "router": RouterConfig, "client": ClientConfig,
            "ray": RayConfig, "http": HttpConfig}


@dataclass(slots=True)
class ServiceConfig:
    model: str = "tiny"  # a model directory, or "tiny" for the embedded default checkpoint
    load_format: str = "auto"  # "auto" (safetensors) | "dummy" (random weights from config.json)
    engine: dict = field(default_factory=dict)  # flame_llm Config fields for every engine (flat names)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    shard: ShardOptions = field(default_factory=ShardOptions)
    router: RouterConfig = field(default_factory=RouterConfig)
    client: ClientConfig = field(default_factory=ClientConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    http: HttpConfig = field(default_factory=HttpConfig)

    def __post_init__(self) -> None:
        from flame_llm.config import FIELD_NAMES

        _need("", "model", isinstance(self.model, str) and self.model != "", "a model directory or 'tiny'",
              self.model)
        _need("", "load_format", self.load_format in ("auto", "dummy"), "one of 'auto', 'dummy'", self.load_format)
        _need("", "engine", isinstance(self.engine, dict), "a mapping of flame_llm Config fields", self.engine)
        known = set(FIELD_NAMES) - {"load_format"}
        unknown = sorted(map(str, set(self.engine) - known))
        _need("", "engine", not unknown, f"a mapping of flame_llm Config fields ({', '.join(sorted(known))})",
              unknown)

    @classmethod
    def from_kwargs(cls, **kwargs) -> ServiceConfig:
        """From flat field names (each unique across the sections): ServiceConfig.from_kwargs(model=...,
        num_shards=2, namespace="x")."""
        top = {k: kwargs.pop(k) for k in ("model", "load_format", "engine") if k in kwargs}
        parts: dict[str, dict] = {s: {} for s in SECTIONS}
        for k, v in kwargs.items():
            section = _SECTION_OF.get(k)
            if section is None:
                raise ValueError(f"unknown service config field {k!r}; known: {', '.join(sorted(_SECTION_OF))}")
            parts[section][k] = v
        return cls(**top, **{s: SECTIONS[s](**p) for s, p in parts.items()})

    def engine_kwargs(self) -> dict:
        return {"load_format": self.load_format, **self.engine}


_SECTION_OF = {f.name: s for s, cls in SECTIONS.items() for f in dataclasses.fields(cls)}


def load_service_config(path: str, namespace: str | None = None, address: str | None = None) -> ServiceConfig:
    """Read a YAML file of ServiceConfig sections; namespace/address override the file's `ray` section."""
    with open(path) as f:
        try:
            raw = yaml.safe_load(f)
        except yaml.YAMLError as e:
            raise ValueError(f"{path}: not valid YAML: {e}") from None
    raw = {} if raw is None else raw
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: the top level must be a mapping of config sections; got {type(raw).__name__}")
    cfg = config_from_dict(raw, source=path)
    return with_ray(cfg, namespace, address)


def with_ray(cfg: ServiceConfig, namespace: str | None = None, address: str | None = None) -> ServiceConfig:
    """cfg with the Ray namespace and/or address replaced (None keeps the config's)."""
    ray_cfg = dataclasses.replace(cfg.ray, **{k: v for k, v in (("namespace", namespace), ("address", address))
                                              if v is not None})
    return dataclasses.replace(cfg, ray=ray_cfg)


def config_from_dict(raw: dict, source: str = "config") -> ServiceConfig:
    """A ServiceConfig from a mapping of top-level fields and sections; ValueError names what is wrong."""
    top = {f.name for f in dataclasses.fields(ServiceConfig)}
    unknown = sorted(str(k) for k in raw if k not in top)
    if unknown:
        flat = [k for k in unknown if k in _SECTION_OF]
        hint = f" ({', '.join(f'{k} belongs in section {_SECTION_OF[k]!r}' for k in flat)})" if flat else ""
        raise ValueError(f"{source}: unknown field(s) {unknown}{hint}; known: {', '.join(sorted(top))}")
    kwargs = {}
    try:
        for name, value in raw.items():
            if name in SECTIONS:
                cls = SECTIONS[name]
                value = {} if value is None else value
                if not isinstance(value, dict):
                    raise ValueError(f"section {name!r} must be a mapping of its fields; got {value!r:.80}")
                fields_ = {f.name for f in dataclasses.fields(cls)}
                bad = sorted(str(k) for k in value if k not in fields_)
                if bad:
                    raise ValueError(f"unknown field(s) {bad} in section {name!r}; known: {', '.join(sorted(fields_))}")
                value = cls(**value)
            kwargs[name] = value
        return ServiceConfig(**kwargs)
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from None


def reference_yaml() -> str:
    """Every field of every section with its default and its comment, as YAML."""
    lines = ["# flame-llm service config: every field with its default (generated by",
             "# `python -m flame_llm.serving.service_config`; a config file may leave any field out)."]
    for name, value, doc in _field_docs(ServiceConfig):
        if name in SECTIONS:
            lines.append(f"{name}:")
            for sub, subvalue, subdoc in _field_docs(SECTIONS[name]):
                lines.append(_yaml_line(f"  {sub}: {_dump(subvalue)}", subdoc))
        else:
            lines.append(_yaml_line(f"{name}: {_dump(value)}", doc))
    return "\n".join(lines) + "\n"


def _field_docs(cls) -> list[tuple[str, object, str]]:
    """(name, default, the comment on its line in the source) per field of a dataclass."""
    comments = {}
    for line in inspect.getsource(cls).splitlines():
        m = re.match(r"\s+(\w+): [^=]+= .*?  # (.*)$", line)
        if m:
            comments[m.group(1)] = m.group(2)
    default = cls()
    return [(f.name, getattr(default, f.name), comments.get(f.name, "")) for f in dataclasses.fields(cls)]


def _dump(value: object) -> str:
    return yaml.safe_dump(value, default_flow_style=True, width=1 << 20).strip().removesuffix("\n...")


def _yaml_line(text: str, doc: str) -> str:
    return f"{text:<40} # {doc}" if doc else text


def _int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _num(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _need(section: str, name: str, ok: bool, limit: str, value: object) -> None:
    if not ok:
        where = f"{section}.{name}" if section else name
        raise ValueError(f"service config field {where!r} must be {limit}; got {value!r}")


if __name__ == "__main__":
    sys.stdout.write(reference_yaml())
