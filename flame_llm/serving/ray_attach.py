"""Joining Ray: start a local Ray for a service, or attach to a running cluster, with the errors a user can act on;
finding a running service's actors by name.

Ray (2.52 and newer) starts clusters with token authentication: a process joining one needs RAY_AUTH_MODE=token
and the token (~/.ray/auth_token on the machine that started it, or RAY_AUTH_TOKEN). When RAY_AUTH_MODE is not
set and a token is at hand, it is set here (token mode also joins a cluster without authentication). A join
that fails for want of a token says so in one line, instead of Ray's twenty `InvalidAuthToken` warnings and
a connection error that never mentions authentication."""
from __future__ import annotations

import logging
import os
import sys
import tempfile
from typing import TYPE_CHECKING

import ray

from flame_llm.serving.client_config import DEFAULT_NAMESPACE

if TYPE_CHECKING:
    from flame_llm.serving.service_config import ServiceConfig

log = logging.getLogger(__name__)
SHARD_PREFIX = "flame-shard-"  # an engine actor's name: this and its shard number
STOP_KEY = b"flame-llm-stop"  # the stop mark's key in Ray's key-value store, one per namespace (mark_stop)
TOKEN_PATH = os.path.join(os.path.expanduser("~"), ".ray", "auth_token")


def token_available() -> bool:
    """A token in RAY_AUTH_TOKEN, or its file (RAY_AUTH_TOKEN_PATH, else ~/.ray/auth_token)."""
    return bool(os.environ.get("RAY_AUTH_TOKEN")) or os.path.isfile(os.environ.get("RAY_AUTH_TOKEN_PATH",
                                                                                  TOKEN_PATH))


def join(address: str, namespace: str) -> None:
    """ray.init(address) for this process; RuntimeError in one line when the cluster cannot be joined."""
    if "RAY_AUTH_MODE" not in os.environ and token_available():
        os.environ["RAY_AUTH_MODE"] = "token"
        from ray._raylet import Config

        Config.initialize("")  # Ray caches its config at import: refresh it, as Ray does when it turns token mode on
    with _captured_stderr() as captured:
        try:
            ray.init(address=address, namespace=namespace, logging_level=logging.WARNING, log_to_driver=False)
            error = None
        except (ConnectionError, RuntimeError, ValueError) as e:
            error = e
    text = captured.read()
    if error is None:
        sys.stderr.write("".join(line for line in text.splitlines(keepends=True) if "InvalidAuthToken" not in line))
        return
    if "InvalidAuthToken" in text or "Unauthenticated" in text:
        mode = os.environ.get("RAY_AUTH_MODE") or "unset"
        raise RuntimeError(f"the Ray cluster at {address} uses token authentication and refused this process "
                           f"(RAY_AUTH_MODE={mode}): set RAY_AUTH_MODE=token and make the cluster's token available "
                           f"({TOKEN_PATH} from the machine that started it, or RAY_AUTH_TOKEN)") from None
    raise RuntimeError(f"cannot join the Ray cluster at {address}: {error}") from None


class _captured_stderr:
    """Route file descriptor 2 (where Ray's C++ core logs) to a temporary file; `read()` gives what was written."""

    def __enter__(self) -> _captured_stderr:
        sys.stderr.flush()
        self._file = tempfile.TemporaryFile(mode="w+b")
        self._saved = os.dup(2)
        os.dup2(self._file.fileno(), 2)
        return self

    def __exit__(self, *exc) -> None:
        sys.stderr.flush()
        os.dup2(self._saved, 2)
        os.close(self._saved)

    def read(self) -> str:
        self._file.seek(0)
        text = self._file.read().decode(errors="replace")
        self._file.close()
        return text


def local_addresses() -> list[str]:
    """The addresses of the Ray clusters running on this machine now (their GCS processes), sorted."""
    from ray._private import services

    # Ray caches the first answer for the process's life: a process that asks again (a test's wait, a second
    # service started by one process) would see a cluster that has since ended
    getattr(services.find_gcs_addresses, "cache_clear", lambda: None)()  # private to Ray: absent in some release
    try:
        return sorted(services.find_gcs_addresses())
    except Exception:  # noqa: BLE001 - no process table to read: nothing found
        return []


def running_local_address() -> str | None:
    """The address of a Ray cluster already running on this machine (its GCS process), or None."""
    found = local_addresses()
    return found[0] if found else None


def init_ray(cfg: ServiceConfig) -> bool:
    """Join cfg.ray.address, or start a local Ray when it is None. True when this call started Ray."""
    if ray.is_initialized():
        return False
    if cfg.ray.address is not None:
        join(cfg.ray.address, cfg.ray.namespace)
        return False
    # workers of a local Ray inherit this environment: let them import our packages from a checkout
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if root not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([root, *filter(None, paths)])
    # "local": a bare ray.init() would join the cluster `ray start` last registered on this machine (another
    # service's, a test's) rather than start one
    ray.init(address="local", num_cpus=cfg.ray.num_cpus, include_dashboard=False, namespace=cfg.ray.namespace,
             logging_level=logging.WARNING, log_to_driver=False)
    return True


def attach(namespace: str, address: str | None = "auto") -> None:
    """Join the Ray cluster at `address` (no-op when this process already is attached)."""
    if not ray.is_initialized():
        join(address or "auto", namespace)


def service_namespaces() -> list[str]:
    """The Ray namespaces that run a flame-llm service (a router), in the attached cluster."""
    from router.replicas import ROUTER_NAME

    return sorted({n["namespace"] for n in ray.util.list_named_actors(all_namespaces=True)
                   if n["name"] == ROUTER_NAME})


def resolve_namespace(namespace: str | None) -> str:
    """`namespace`, or when None: the default namespace if it runs a service, else the one namespace that does."""
    if namespace is not None:
        return namespace
    found = service_namespaces()
    if DEFAULT_NAMESPACE in found or not found:
        return DEFAULT_NAMESPACE
    if len(found) == 1:
        return found[0]
    raise RuntimeError(f"services run in several Ray namespaces ({', '.join(found)}); name one with --namespace")


def mark_stop(namespace: str, stopping: bool = True) -> None:
    """Set (or clear) the service's stop mark in Ray's key-value store: `flame-llm stop` sets it before it kills
    anything, so the serve process's supervisor, which would otherwise start a router the stop killed again (a
    dead replica looks like a crash to it), leaves the service down and exits."""
    from ray.experimental import internal_kv

    if stopping:
        internal_kv._internal_kv_put(STOP_KEY, b"1", overwrite=True, namespace=namespace)
    else:
        internal_kv._internal_kv_del(STOP_KEY, namespace=namespace)


def stop_requested(namespace: str) -> bool:
    """True once `flame-llm stop` marked the service in `namespace` (mark_stop)."""
    from ray.experimental import internal_kv

    return internal_kv._internal_kv_exists(STOP_KEY, namespace=namespace)


def find_service(namespace: str | None = None) -> tuple[list[ray.actor.ActorHandle], dict[int, ray.actor.ActorHandle]]:
    """The router replicas (replica 0 first) and engine actors of the service in `namespace` (None: see
    resolve_namespace)."""
    from router.replicas import ROUTER_NAME

    namespace = resolve_namespace(namespace)
    names = [n["name"] for n in ray.util.list_named_actors(all_namespaces=True) if n["namespace"] == namespace]
    shards = sorted(int(n[len(SHARD_PREFIX):]) for n in names if n.startswith(SHARD_PREFIX))
    if not shards or ROUTER_NAME not in names:
        others = [ns for ns in service_namespaces() if ns != namespace]
        hint = f"; services run in: {', '.join(others)}" if others else ""
        raise RuntimeError(f"no flame-llm service in Ray namespace {namespace!r} (found actors: {sorted(names)})"
                           f"{hint}")
    from router.replicas import replica_name

    num_routers = ray.get(ray.get_actor(ROUTER_NAME, namespace=namespace).config.remote(), timeout=60)[1].replicas
    return ([ray.get_actor(replica_name(ROUTER_NAME, r), namespace=namespace) for r in range(num_routers)],
            {k: ray.get_actor(f"{SHARD_PREFIX}{k}", namespace=namespace) for k in shards})
