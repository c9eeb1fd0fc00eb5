"""Who an HTTP request is, for both front doors: its bearer token checked against the configured keys in constant
time (hmac.compare_digest), the keys read from http.api_key, the file http.api_key_file (one key a line) or the
environment variable FLAME_API_KEY (neither shows in `ps`), the caller it takes turns as in the shards' fair
queue, and the warning for a door that listens beyond loopback with no key."""
from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import os

log = logging.getLogger(__name__)
API_KEY_ENV = "FLAME_API_KEY"  # the front door's bearer token, when neither --api-key nor a key file is given


def read_key_file(path: str) -> tuple[str, ...]:
    """The keys of an API key file: one a line; blank lines and lines starting with '#' skipped. ValueError naming
    the field when it cannot be read or holds none."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise ValueError(f"http field 'api_key_file': cannot read {path!r} ({e.strerror or e})") from None
    keys = tuple(s for s in (line.strip() for line in lines) if s and not s.startswith("#"))
    if not keys:
        raise ValueError(f"http field 'api_key_file': {path!r} holds no key (one key a line)")
    return keys


def key_from_env(api_key: str | None, api_key_file: str | None) -> str | None:
    """api_key, or FLAME_API_KEY from this process's environment when no key is configured otherwise (the CLI
    reads it: a Ray actor does not share the shell's environment)."""
    if api_key or api_key_file:
        return api_key
    return os.environ.get(API_KEY_ENV) or None


class Keys:
    """The accepted bearer tokens; each key is one user in the shards' fair queue."""

    def __init__(self, api_key: str | None, api_key_file: str | None) -> None:
        keys = ((api_key,) if api_key else ()) + (read_key_file(api_key_file) if api_key_file else ())
        self.headers = [b"Bearer " + k.encode() for k in keys]
        self.ids = [f"key:{hashlib.sha256(k.encode()).hexdigest()[:16]}" for k in keys]

    def __bool__(self) -> bool:
        return bool(self.headers)

    def match(self, authorization: str) -> str | None:
        """The caller id of the key the Authorization header carries, or None. Every key is compared, each in
        constant time: how far a guess matches takes no longer to refuse."""
        sent = authorization.encode("utf-8", "surrogateescape")
        found = None
        for header, caller in zip(self.headers, self.ids, strict=True):
            if hmac.compare_digest(sent, header):
                found = caller
        return found


def caller_of(key_id: str | None, user: str, remote: str | None) -> str:
    """Whom an HTTP request takes turns as, at the client's credit and in the shards' fair queue: its API key when
    keys are configured, else the request's OpenAI `user` (digested: it travels to the shards, at a fixed size),
    else the client's address."""
    if key_id:
        return key_id
    if user:
        return f"user:{hashlib.sha256(user.encode()).hexdigest()[:16]}"
    return f"addr:{remote}"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve anywhere
        return False


def exposure_warning(host: str, keyed: bool) -> str | None:
    """The warning for a door that anyone on the network can use: it listens beyond loopback with no key."""
    if keyed or is_loopback(host):
        return None
    return (f"the HTTP front door listens on {host}, beyond loopback, with no API key: anyone who can reach the port "
            f"can generate (set http.api_key_file, {API_KEY_ENV} or --api-key-file; or bind http.host 127.0.0.1)")
