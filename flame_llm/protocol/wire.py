"""The one wire codec: batches of requests and their results as zstd-compressed msgpack.

Requests: msgpack map {version, model_revision, requests: [Request.to_wire()]}: id, prompt (token ids as
little-endian uint32 bytes) and sampling (a map of SamplingParams fields). Results: a msgpack list of
Result.to_wire() maps (RESULT_FIELDS), output token ids as little-endian uint32 bytes. The types, their
maps and their checks live in flame_llm.protocol.types.

Decoding never inflates more than its budget (max_payload_bytes): a frame that declares its content size
is refused from the header alone when over budget; a frame without a declared size is inflated in chunks
and abandoned as soon as the output passes the budget. A batch that cannot be read raises WireError; a
request that is readable but invalid becomes a RequestError in its slot, the others proceed.

Unpacking is bounded too: no ext types, strings and arrays capped (MAX_STR_BYTES, MAX_BATCH_REQUESTS), maps
at MAX_MAP_KEYS, at most one map or array per CONTAINER_BYTES decoded bytes (an empty one is 1 byte on the
wire and ~64 in memory), nesting at msgpack's 1,024 levels. Unpacked, a payload so takes at most ~21x its
decoded bytes (full arrays of 2-character strings), plus ~0.5 kB per invalid request slot (8,192 at most);
tests/fuzz_wire.py checks 24x the budget. Nothing deeper than the schema is ever walked, and error messages
show values through `brief`, so a deep or huge value costs its bytes, never a RecursionError or a megabyte
message.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import msgpack
import zstandard

from flame_llm.protocol.errors import ErrorCode, RequestError, WireError
from flame_llm.protocol.types import (
    DEFAULT_ZSTD_LEVEL,
    MAX_BATCH_REQUESTS,
    MAX_RESULT_PAYLOAD_BYTES,
    EngineLimits,
    Request,
    Result,
    fits_utf8,
    key_list,
)
from flame_llm.sampling_params import brief

WIRE_VERSION = 1
MAX_REVISION_BYTES = 256
MIN_LEVEL, MAX_LEVEL = -7, 19  # levels above 19 need windows the decoder refuses (MAX_WINDOW)
MAX_WINDOW = 1 << 23  # level 19 uses an 8 MiB window; a bigger one is refused before allocation
_CHUNK = 1 << 20
# Upper bounds of one request's msgpack bytes besides its prompt (id at MAX_ID_BYTES, all sampling
# fields at their widest, per stop token) and of the batch's envelope; test_wire checks them.
REQUEST_OVERHEAD = 540  # with a user at MAX_USER_BYTES (140 of it)
STOP_TOKEN_BYTES = 5  # a uint32 stop token id (SamplingParams bounds them below 2**32)
BATCH_OVERHEAD = 320
# Unpacking bounds (see the module docstring). A request map is at least ~29 bytes with 2-3 containers, a
# result map ~100 bytes with 2-3; the strings of a request batch are ids, keys and the revision.
CONTAINER_BYTES = 8
MAX_MAP_KEYS = 256
MAX_STR_BYTES = {"request": 1 << 16, "result": 1 << 20}


@dataclass(slots=True)
class DecodedBatch:
    model_revision: str
    items: list[Request | RequestError]  # input order


_local = threading.local()


def _compressor(level: int) -> zstandard.ZstdCompressor:
    if not (isinstance(level, int) and MIN_LEVEL <= level <= MAX_LEVEL):
        raise ValueError(f"zstd level must be an integer in [{MIN_LEVEL}, {MAX_LEVEL}]; got {level!r}")
    cache = getattr(_local, "cctx", None)
    if cache is None:
        cache = _local.cctx = {}
    cctx = cache.get(level)
    if cctx is None:
        cctx = cache[level] = zstandard.ZstdCompressor(level=level, write_content_size=True)
    return cctx


def _decompressor() -> zstandard.ZstdDecompressor:
    dctx = getattr(_local, "dctx", None)
    if dctx is None:
        dctx = _local.dctx = zstandard.ZstdDecompressor(max_window_size=MAX_WINDOW)
    return dctx


def decoded_size(payload: bytes) -> int:
    """The decoded (msgpack) size a readable payload's zstd frame header declares; -1 when it declares none."""
    return zstandard.frame_content_size(payload)


def _inflate(payload: bytes, budget: int, what: str) -> bytes:
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise WireError(ErrorCode.BAD_ZSTD, f"{what} payload must be bytes; got {type(payload).__name__}")
    try:
        declared = zstandard.frame_content_size(payload)  # -1: not declared
    except zstandard.ZstdError as e:
        raise WireError(ErrorCode.BAD_ZSTD, f"{what} payload is not a zstd frame ({e})") from None
    if declared > budget:
        raise WireError(ErrorCode.OVER_BUDGET, f"{what} payload declares {declared} decoded bytes; "
                                               f"max_payload_bytes is {budget}")
    dctx = _decompressor()
    try:
        if declared >= 0:
            return dctx.decompress(payload, allow_extra_data=False)
        # No declared size: inflate in bounded chunks and stop as soon as the budget is passed.
        parts, total = [], 0
        with dctx.stream_reader(payload, read_across_frames=True) as reader:
            while chunk := reader.read(min(_CHUNK, budget + 1 - total)):
                parts.append(chunk)
                total += len(chunk)
                if total > budget:
                    raise WireError(ErrorCode.OVER_BUDGET, f"{what} payload inflates past max_payload_bytes "
                                                           f"{budget} (no declared content size)")
        return b"".join(parts)
    except zstandard.ZstdError as e:
        raise WireError(ErrorCode.BAD_ZSTD, f"{what} payload is corrupt zstd ({e})") from None


class _TooManyContainers(Exception):
    pass


class _ContainerCount:
    """msgpack's list_hook and object_hook: counts maps and arrays, raising past the bound."""
    __slots__ = ("left",)

    def __init__(self, limit: int) -> None:
        self.left = limit

    def __call__(self, container: Any) -> Any:
        self.left -= 1
        if self.left < 0:
            raise _TooManyContainers
        return container


def _unpack(raw: bytes, what: str) -> Any:
    limit = len(raw) // CONTAINER_BYTES + 16
    count = _ContainerCount(limit)
    try:
        return msgpack.unpackb(raw, raw=False, strict_map_key=True, use_list=True, list_hook=count,
                               object_hook=count, max_ext_len=0, max_str_len=MAX_STR_BYTES[what],
                               max_array_len=MAX_BATCH_REQUESTS, max_map_len=MAX_MAP_KEYS)
    except _TooManyContainers:
        raise WireError(ErrorCode.OVER_BUDGET, f"{what} payload holds more than {limit} maps and arrays (one per "
                                               f"{CONTAINER_BYTES} decoded bytes)") from None
    except (ValueError, TypeError, RecursionError, msgpack.UnpackException) as e:
        raise WireError(ErrorCode.BAD_MSGPACK, f"{what} payload is not valid msgpack ({type(e).__name__}: "
                                               f"{brief(str(e), 200)})") from None


def encode_requests(requests: list[Request], model_revision: str, level: int = DEFAULT_ZSTD_LEVEL) -> bytes:
    """One batch of requests as a compressed payload (token ids checked to fit uint32)."""
    if not fits_utf8(model_revision, MAX_REVISION_BYTES):
        raise ValueError(f"model_revision must be a str of at most {MAX_REVISION_BYTES} UTF-8 bytes; "
                         f"got {brief(model_revision)}")
    if len(requests) > MAX_BATCH_REQUESTS:
        raise ValueError(f"a batch holds at most {MAX_BATCH_REQUESTS} requests; got {len(requests)}")
    reqs = [r.to_wire() for r in requests]
    raw = msgpack.packb({"version": WIRE_VERSION, "model_revision": model_revision, "requests": reqs},
                        use_bin_type=True)
    return _compressor(level).compress(raw)


def request_wire_size(num_tokens: int, num_stop_tokens: int = 0) -> int:
    """Upper bound of one request's decoded bytes inside a batch (add BATCH_OVERHEAD once per
    batch), for the client's decoded-payload budget."""
    return 4 * num_tokens + REQUEST_OVERHEAD + STOP_TOKEN_BYTES * num_stop_tokens


def decode_requests(payload: bytes, limits: EngineLimits, expected_revision: str | None = None) -> DecodedBatch:
    """Inflate (within limits.max_payload_bytes) and validate a request batch; see the module docstring."""
    obj = _unpack(_inflate(payload, limits.max_payload_bytes, "request"), "request")
    if not isinstance(obj, dict):
        raise WireError(ErrorCode.BAD_SCHEMA, f"request payload must be a map; got {type(obj).__name__}")
    keys = set(obj)
    if keys != {"version", "model_revision", "requests"}:
        raise WireError(ErrorCode.BAD_SCHEMA, "request payload keys must be exactly version, model_revision, "
                                              f"requests; got {key_list(keys)}")
    if type(obj["version"]) is not int or obj["version"] != WIRE_VERSION:
        raise WireError(ErrorCode.BAD_VERSION, f"version must be {WIRE_VERSION}; got {brief(obj['version'], 40)}")
    revision = obj["model_revision"]
    if not fits_utf8(revision, MAX_REVISION_BYTES):
        raise WireError(ErrorCode.BAD_SCHEMA, f"model_revision must be a str of at most {MAX_REVISION_BYTES} "
                                              f"UTF-8 bytes; got {brief(revision)}")
    if expected_revision is not None and revision != expected_revision:
        raise WireError(ErrorCode.WRONG_REVISION, f"model_revision {revision!r} does not match the served "
                                                  f"model's {expected_revision!r}")
    if not isinstance(obj["requests"], list):
        raise WireError(ErrorCode.BAD_SCHEMA, f"requests must be a list; got {type(obj['requests']).__name__}")
    seen: set[str] = set()
    return DecodedBatch(revision, [Request.from_wire(r, limits, seen) for r in obj["requests"]])


def encode_results(results: list[Result], level: int = DEFAULT_ZSTD_LEVEL) -> bytes:
    """Result records as a compressed payload."""
    return _compressor(level).compress(msgpack.packb([r.to_wire() for r in results], use_bin_type=True))


def decode_results(payload: bytes, max_payload_bytes: int = MAX_RESULT_PAYLOAD_BYTES) -> list[Result]:
    """Inflate and validate result records."""
    obj = _unpack(_inflate(payload, max_payload_bytes, "result"), "result")
    if not isinstance(obj, list):
        raise WireError(ErrorCode.BAD_SCHEMA, f"result payload must be a list; got {type(obj).__name__}")
    return [Result.from_wire(rec, i) for i, rec in enumerate(obj)]
