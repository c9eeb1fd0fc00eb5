"""The service's configuration: one dataclass per part, each owned by the code it configures (placement
in actors/pinning.py, a shard's options in actors/shard_options.py, the router's in router/policy.py,
the client's in client_config.py, Ray's here), composed into ServiceConfig. The YAML file has one section per part:

    model: configs/models/llama-3.1-8b
    engine: {load_format: dummy, max_model_len: 32768}              # flame_llm engine fields (EngineConfig)
    placement: {num_shards: auto}
    router: {policy: cumulative}
    ray: {namespace: flame}
    http: {port: 8000}                                              # the OpenAI front door

Every field is checked with an error naming section and field (`engine field 'max_num_seqs' must be ...`).
 `python -m flame_llm.serving.service_config`
prints the reference of every field with its default (configs/service.reference.yaml, tested to match)."""
from __future__ import annotations

import dataclasses
import inspect
import re
import sys
from dataclasses import dataclass, field

import yaml

from actors.pinning import PlacementConfig
from actors.shard_options import ShardOptions
from flame_llm.config import FIELD_NAMES, GROUPS, EngineConfig
from flame_llm.serving.client_config import DEFAULT_NAMESPACE, ClientConfig
from flame_llm.serving.http_app import HttpConfig
from flame_llm.validate import check, check_int, check_number, check_str
from router.policy import RouterConfig


@dataclass(slots=True)
class RayConfig:
    """The Ray cluster the service runs in (the `ray` section)."""
    address: str | None = None  # None: start a local Ray; "auto" or "host:port": join a cluster
    namespace: str = DEFAULT_NAMESPACE  # flame-llm submit, status and stop find the service by it
    num_cpus: int | None = None  # CPUs of a locally started Ray (None: every core)
    startup_timeout_s: float = 600.0  # per shard, until it answers health

    def __post_init__(self) -> None:
        a, ns, w = self.address, self.namespace, "ray field"
        check(a is None or (isinstance(a, str) and a != ""), "address", "null, 'auto' or 'host:port'", a, where=w)
        check(isinstance(ns, str) and ns.replace("-", "").replace("_", "").isalnum(), "namespace",
              "a non-empty name of letters, digits, '-' and '_'", ns, where=w)
        check_int("num_cpus", self.num_cpus, 1, optional=True, where=w)
        check_number("startup_timeout_s", self.startup_timeout_s, 0, low_open=True, where=w)


def _article(name: str) -> str:
    return f"{'an' if name[0] in 'AEIOU' else 'a'} {name}"


SECTIONS = {"placement": PlacementConfig, "shard": ShardOptions, "router": RouterConfig, "client": ClientConfig,
            "ray": RayConfig, "http": HttpConfig}


# the `engine` section's (flat) field names; the model and its tokenizer are the service's top-level fields
ENGINE_FIELDS = tuple(n for n in FIELD_NAMES if n not in ("model", "tokenizer"))


@dataclass(slots=True)
class ServiceConfig:
    model: str = "tiny"  # a model directory, or "tiny" for the embedded default checkpoint
    tokenizer: str = ""  # an HF tokenizer directory or "tiny" (the embedded BPE); "": the model directory's
    engine: EngineConfig = field(default_factory=EngineConfig)  # every engine's fields (flat names)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    shard: ShardOptions = field(default_factory=ShardOptions)
    router: RouterConfig = field(default_factory=RouterConfig)
    client: ClientConfig = field(default_factory=ClientConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    http: HttpConfig = field(default_factory=HttpConfig)

    def __post_init__(self) -> None:
        check_str("model", self.model, what="a model directory or 'tiny'", where="service config field")
        check_str("tokenizer", self.tokenizer, empty=True, what="an HF tokenizer directory or 'tiny'",
                  where="service config field")
        for name, cls in (("engine", EngineConfig), *SECTIONS.items()):
            check(isinstance(getattr(self, name), cls), name, f"{_article(cls.__name__)} (config_from_dict parses a "
                  "mapping)", getattr(self, name), where="service config field")
        if self.router.policy == "events" and not self.engine.cache_config.enable_kv_events:
            raise ValueError("router field 'policy' is 'events', which routes on the engines' cache events: set the "
                             "engine field 'enable_kv_events' to true")

    @classmethod
    def from_kwargs(cls, **kwargs) -> ServiceConfig:
        """From flat field names (each unique across the sections and the engine's fields): ServiceConfig.from_kwargs(
        model=..., num_shards=2, namespace="x", load_format="dummy"); `engine` may also be a mapping of engine
        fields, or an EngineConfig (passed through unchanged)."""
        top = {k: kwargs.pop(k) for k in ("model", "tokenizer") if k in kwargs}
        engine = kwargs.pop("engine", {})
        if isinstance(engine, EngineConfig):  # taken as it is; flat engine fields beside it would be ambiguous
            flat = sorted(k for k in kwargs if _SECTION_OF.get(k) == "engine")
            if flat:
                raise ValueError(f"service config field(s) {flat} are given beside an EngineConfig `engine`; set "
                                 "them in it")
        parts: dict[str, dict] = {"engine": engine if isinstance(engine, EngineConfig) else dict(engine)}
        parts |= {s: {} for s in SECTIONS}
        for k, v in kwargs.items():
            section = _SECTION_OF.get(k)
            if section is None:
                raise ValueError(f"unknown service config field {k!r}; known: {', '.join(sorted(_SECTION_OF))}")
            if k in parts[section]:
                raise ValueError(f"service config field {k!r} is given twice (flat and in engine)")
            parts[section][k] = v
        return cls(**top, **{s: _section(s, p) for s, p in parts.items()})

    def engine_kwargs(self) -> dict:
        """The engine fields this config changes from their defaults, as flat keywords (Config.from_kwargs); the
        top-level tokenizer among them when set."""
        return {**self.engine.to_kwargs(changed_only=True), **({"tokenizer": self.tokenizer} if self.tokenizer else {})}


_SECTION_OF = {f.name: s for s, cls in SECTIONS.items() for f in dataclasses.fields(cls)}
assert not set(_SECTION_OF) & set(ENGINE_FIELDS), "a field name is in a section and the engine"
_SECTION_OF |= {name: "engine" for name in ENGINE_FIELDS}


def _section(name: str, value: object) -> object:
    """A section's dataclass from a mapping of its fields (an engine section that is one already stays)."""
    if name == "engine" and isinstance(value, EngineConfig):
        return value
    value = {} if value is None else value
    if not isinstance(value, dict):
        raise ValueError(f"section {name!r} must be a mapping of its fields; got {value!r:.80}")
    known = ENGINE_FIELDS if name == "engine" else [f.name for f in dataclasses.fields(SECTIONS[name])]
    bad = sorted(str(k) for k in value if k not in known)
    if bad:
        raise ValueError(f"unknown field(s) {bad} in section {name!r}; known: {', '.join(sorted(known))}")
    return EngineConfig.from_kwargs(**value) if name == "engine" else SECTIONS[name](**value)


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
    try:
        return ServiceConfig(**{k: v if k in ("model", "tokenizer") else _section(k, v) for k, v in raw.items()})
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from None


def reference_yaml() -> str:
    """Every field of every section with its default and its comment, as YAML."""
    lines = ["# flame-llm service config: every field with its default (generated by",
             "# `python -m flame_llm.serving.service_config`; a config file may leave any field out)."]
    default = ServiceConfig()
    for name, value, doc in _field_docs(ServiceConfig, default):
        if name == "engine":
            lines.append(_yaml_line("engine:", doc))
            for group in GROUPS:
                for sub, subvalue, subdoc in _field_docs(GROUPS[group], getattr(value, group)):
                    if sub in ENGINE_FIELDS:
                        lines.append(_yaml_line(f"  {sub}: {_dump(subvalue)}", subdoc))
        elif name in SECTIONS:
            lines.append(f"{name}:")
            for sub, subvalue, subdoc in _field_docs(SECTIONS[name], value):
                lines.append(_yaml_line(f"  {sub}: {_dump(subvalue)}", subdoc))
        else:
            lines.append(_yaml_line(f"{name}: {_dump(value)}", doc))
    return "\n".join(lines) + "\n"


def _field_docs(cls, default: object) -> list[tuple[str, object, str]]:
    """(name, value in `default`, the comment on its line in the source) per field of a dataclass."""
    comments = {}
    for line in inspect.getsource(cls).splitlines():
        m = re.match(r"\s+(\w+): [^=]+= .*?  # (.*)$", line)
        if m:
            comments[m.group(1)] = m.group(2)
    return [(f.name, getattr(default, f.name), comments.get(f.name, "")) for f in dataclasses.fields(cls)]


def _dump(value: object) -> str:
    value = list(value) if isinstance(value, tuple) else value
    return yaml.safe_dump(value, default_flow_style=True, width=1 << 20).strip().removesuffix("\n...")


def _yaml_line(text: str, doc: str) -> str:
    return f"{text:<40} # {doc}" if doc else text


if __name__ == "__main__":
    sys.stdout.write(reference_yaml())
