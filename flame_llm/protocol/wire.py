"""The one wire codec: batches of requests and their results as zstd-compressed msgpack.

Requests: msgpack map {version, model_revision, requests: [{id, prompt, sampling}]} where prompt is
the token ids as little-endian uint32 bytes and sampling a map of SamplingParams fields. Results: a
msgpack list of result maps (RESULT_FIELDS), output token ids as little-endian uint32 bytes.

Decoding never inflates more than its budget: a frame that declares its content size is refused
from the header alone when over budget; a frame without a declared size is inflated in chunks and
abandoned as soon as the output passes the budget. A batch that cannot be read raises WireError;
a request that is readable but invalid becomes a RequestError in its slot, the others proceed.
"""
from __future__ import annotations

import threading
from dataclasses import asdict, dataclass, fields
from typing import Any

import msgpack
import numpy as np
import xxhash
import zstandard

from flame_llm.sampling_params import SamplingParams

WIRE_VERSION = 1
MAX_ID_BYTES = 256  # UTF-8 bytes
MAX_REVISION_BYTES = 256
MIN_LEVEL, MAX_LEVEL = -7, 19  # levels above 19 need windows the decoder refuses (MAX_WINDOW)
MAX_WINDOW = 1 << 23  # level 19 uses an 8 MiB window; a bigger one is refused before allocation
_CHUNK = 1 << 20
# Upper bounds of one request's msgpack bytes besides its prompt (id at MAX_ID_BYTES, all sampling
# fields at their widest, per stop token) and of the batch's envelope; test_wire checks them.
REQUEST_OVERHEAD = 420
STOP_TOKEN_BYTES = 9
BATCH_OVERHEAD = 320

SAMPLING_FIELDS = tuple(f.name for f in fields(SamplingParams))
RESULT_FIELDS = ("id", "output_token_ids", "finish_reason", "prompt_tokens", "cached_tokens", "shard",
                 "gpu_uuid", "node", "timings", "error", "prompt_hash")
_RESULT_DEFAULTS: dict[str, Any] = {"id": None, "output_token_ids": (), "finish_reason": None,
                                    "prompt_tokens": 0, "cached_tokens": 0, "shard": -1, "gpu_uuid": "",
                                    "node": "", "timings": {}, "error": None, "prompt_hash": ""}
_ERROR_FIELDS = ("code", "message", "retry_after_s")


def prompt_digest(token_ids) -> str:
    """xxh64 over a prompt's little-endian uint32 ids: what served it, compared with what was sent."""
    return xxhash.xxh64(np.asarray(token_ids, dtype="<u4").tobytes()).hexdigest()


class WireError(ValueError):
    """The whole payload is unusable. code: bad_zstd | over_budget | bad_msgpack | bad_schema |
    bad_version | wrong_revision | bad_result."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code


@dataclass(slots=True)
class WireRequest:
    id: str
    prompt_token_ids: list[int] | np.ndarray  # decoded requests carry a read-only uint32 array
    sampling: SamplingParams


@dataclass(slots=True)
class RequestError:
    """One request that cannot be served. code: bad_request | bad_id | duplicate_id | empty_prompt |
    bad_prompt | token_out_of_range | prompt_too_long | bad_sampling; actors add their own (for
    example queue_full with retry_after_s). id is None when the request's id itself is unreadable."""
    id: str | None
    code: str
    message: str
    retry_after_s: float | None = None

    def to_dict(self) -> dict:
        """The error map of a result record."""
        return {"code": self.code, "message": self.message, "retry_after_s": self.retry_after_s}


@dataclass(slots=True)
class DecodedBatch:
    model_revision: str
    items: list[WireRequest | RequestError]  # input order


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


def _inflate(payload: bytes, budget: int, what: str) -> bytes:
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise WireError("bad_zstd", f"{what} payload must be bytes; got {type(payload).__name__}")
    try:
        declared = zstandard.frame_content_size(payload)  # -1: not declared
    except zstandard.ZstdError as e:
        raise WireError("bad_zstd", f"{what} payload is not a zstd frame ({e})") from None
    if declared > budget:
        raise WireError("over_budget", f"{what} payload declares {declared} decoded bytes; "
                                       f"max_decoded_bytes is {budget}")
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
                    raise WireError("over_budget", f"{what} payload inflates past max_decoded_bytes "
                                                   f"{budget} (no declared content size)")
        return b"".join(parts)
    except zstandard.ZstdError as e:
        raise WireError("bad_zstd", f"{what} payload is corrupt zstd ({e})") from None


def _unpack(raw: bytes, what: str) -> Any:
    try:
        return msgpack.unpackb(raw, raw=False, strict_map_key=True, use_list=True)
    except (ValueError, TypeError, msgpack.UnpackException) as e:
        raise WireError("bad_msgpack", f"{what} payload is not valid msgpack ({type(e).__name__}: {e})") \
            from None


def _short_str(s: Any, max_bytes: int) -> bool:
    if not isinstance(s, str) or len(s) > max_bytes:
        return False
    return len(s) * 4 <= max_bytes or len(s.encode()) <= max_bytes


def _token_bytes(token_ids: list[int] | np.ndarray, where: str) -> bytes:
    if isinstance(token_ids, np.ndarray) and token_ids.dtype == np.uint32:
        return token_ids.astype("<u4", copy=False).tobytes()
    arr = np.asarray(token_ids)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise ValueError(f"{where} must be a flat sequence of integers; got dtype {arr.dtype}, "
                         f"shape {arr.shape}")
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= 1 << 32):
        raise ValueError(f"{where} must be in [0, 2**32); got min {arr.min()}, max {arr.max()}")
    return arr.astype("<u4").tobytes()


def encode_requests(requests: list[WireRequest], model_revision: str, level: int = 1) -> bytes:
    """One batch of requests as a compressed payload (token ids checked to fit uint32)."""
    if not _short_str(model_revision, MAX_REVISION_BYTES):
        raise ValueError(f"model_revision must be a str of at most {MAX_REVISION_BYTES} UTF-8 bytes; "
                         f"got {model_revision!r:.80}")
    reqs = []
    for r in requests:
        prompt = _token_bytes(r.prompt_token_ids, f"request {r.id!r}: prompt_token_ids")
        reqs.append({"id": r.id, "prompt": prompt, "sampling": asdict(r.sampling)})
    raw = msgpack.packb({"version": WIRE_VERSION, "model_revision": model_revision, "requests": reqs},
                        use_bin_type=True)
    return _compressor(level).compress(raw)


def request_wire_size(num_tokens: int, num_stop_tokens: int = 0) -> int:
    """Upper bound of one request's decoded bytes inside a batch (add BATCH_OVERHEAD once per
    batch), for the client's decoded-payload budget."""
    return 4 * num_tokens + REQUEST_OVERHEAD + STOP_TOKEN_BYTES * num_stop_tokens


def decode_requests(payload: bytes, *, vocab_size: int, max_model_len: int,
                    max_decoded_bytes: int = 4 << 20, expected_revision: str | None = None) -> DecodedBatch:
    """Inflate (within max_decoded_bytes) and validate a request batch; see the module docstring."""
    obj = _unpack(_inflate(payload, max_decoded_bytes, "request"), "request")
    if not isinstance(obj, dict):
        raise WireError("bad_schema", f"request payload must be a map; got {type(obj).__name__}")
    keys = set(obj)
    if keys != {"version", "model_revision", "requests"}:
        raise WireError("bad_schema", "request payload keys must be exactly version, model_revision, "
                                      f"requests; got {sorted(map(str, keys))}")
    if obj["version"] != WIRE_VERSION or type(obj["version"]) is not int:
        raise WireError("bad_version", f"version must be {WIRE_VERSION}; got {obj['version']!r:.40}")
    revision = obj["model_revision"]
    if not _short_str(revision, MAX_REVISION_BYTES):
        raise WireError("bad_schema", f"model_revision must be a str of at most {MAX_REVISION_BYTES} "
                                      f"UTF-8 bytes; got {revision!r:.80}")
    if expected_revision is not None and revision != expected_revision:
        raise WireError("wrong_revision", f"model_revision {revision!r} does not match the served "
                                          f"model's {expected_revision!r}")
    if not isinstance(obj["requests"], list):
        raise WireError("bad_schema", f"requests must be a list; got {type(obj['requests']).__name__}")
    seen: set[str] = set()
    items = [_decode_one(r, vocab_size, max_model_len, seen) for r in obj["requests"]]
    return DecodedBatch(revision, items)


def _decode_one(r: Any, vocab_size: int, max_model_len: int, seen: set[str]) -> WireRequest | RequestError:
    rid = r.get("id") if isinstance(r, dict) else None
    if not rid or not _short_str(rid, MAX_ID_BYTES):
        return RequestError(None, "bad_id", f"id must be a non-empty str of at most {MAX_ID_BYTES} "
                                            f"UTF-8 bytes; got {rid!r:.80}")
    if rid in seen:
        return RequestError(rid, "duplicate_id", f"id {rid!r} appears more than once in the batch")
    seen.add(rid)
    if set(r) != {"id", "prompt", "sampling"}:
        return RequestError(rid, "bad_request", "request keys must be exactly id, prompt, sampling; "
                                                f"got {sorted(map(str, r))}")
    prompt = r["prompt"]
    if not isinstance(prompt, bytes):
        return RequestError(rid, "bad_prompt", f"prompt must be bytes (little-endian uint32 token ids); "
                                               f"got {type(prompt).__name__}")
    if not prompt:
        return RequestError(rid, "empty_prompt", "prompt must hold at least 1 token; got 0")
    if len(prompt) % 4:
        return RequestError(rid, "bad_prompt", f"prompt length {len(prompt)} bytes is not a multiple of 4 "
                                               "(uint32 token ids)")
    n = len(prompt) // 4
    if n > max_model_len:
        return RequestError(rid, "prompt_too_long",
                            f"prompt has {n} tokens; max_model_len is {max_model_len}")
    tokens = np.frombuffer(prompt, dtype="<u4")
    top = int(tokens.max())
    if top >= vocab_size:
        return RequestError(rid, "token_out_of_range",
                            f"token id {top} at position {int(tokens.argmax())} is >= vocab_size "
                            f"{vocab_size}")
    sampling = r["sampling"]
    if not isinstance(sampling, dict):
        return RequestError(rid, "bad_sampling", f"sampling must be a map; got {type(sampling).__name__}")
    unknown = set(sampling) - set(SAMPLING_FIELDS)
    if unknown:
        return RequestError(rid, "bad_sampling", f"unknown sampling fields {sorted(map(str, unknown))}; "
                                                 f"known: {', '.join(SAMPLING_FIELDS)}")
    try:
        sp = SamplingParams(**sampling)
    except (TypeError, ValueError) as e:
        return RequestError(rid, "bad_sampling", str(e))
    return WireRequest(rid, tokens, sp)


def encode_results(results: list[dict], level: int = 1) -> bytes:
    """Result records (keys from RESULT_FIELDS; missing ones take their defaults) as a payload."""
    out = []
    for res in results:
        unknown = set(res) - set(RESULT_FIELDS)
        if unknown:
            raise ValueError(f"result {res.get('id')!r} has unknown fields {sorted(unknown)}; "
                             f"known: {', '.join(RESULT_FIELDS)}")
        rec = {**_RESULT_DEFAULTS, **res}
        rec["output_token_ids"] = _token_bytes(rec["output_token_ids"],
                                               f"result {rec['id']!r}: output_token_ids")
        err = rec["error"]
        if isinstance(err, RequestError):
            rec["error"] = err.to_dict()
        out.append(rec)
    return _compressor(level).compress(msgpack.packb(out, use_bin_type=True))


_RESULT_TYPES: dict[str, tuple[type, ...]] = {
    "id": (str, type(None)), "output_token_ids": (bytes,), "finish_reason": (str, type(None)),
    "prompt_tokens": (int,), "cached_tokens": (int,), "shard": (int,), "gpu_uuid": (str,), "node": (str,),
    "timings": (dict,), "error": (dict, type(None)), "prompt_hash": (str,),
}


def decode_results(payload: bytes, max_decoded_bytes: int = 256 << 20) -> list[dict]:
    """Inflate and validate result records; output_token_ids come back as list[int]."""
    obj = _unpack(_inflate(payload, max_decoded_bytes, "result"), "result")
    if not isinstance(obj, list):
        raise WireError("bad_schema", f"result payload must be a list; got {type(obj).__name__}")
    for i, rec in enumerate(obj):
        if not isinstance(rec, dict) or set(rec) != set(RESULT_FIELDS):
            got = sorted(map(str, rec)) if isinstance(rec, dict) else type(rec).__name__
            raise WireError("bad_result", f"result {i} must be a map with keys {', '.join(RESULT_FIELDS)}; "
                                          f"got {got}")
        for key, types in _RESULT_TYPES.items():
            if not isinstance(rec[key], types):
                raise WireError("bad_result", f"result {i} field {key!r} must be "
                                              f"{' or '.join(t.__name__ for t in types)}; "
                                              f"got {type(rec[key]).__name__}")
        out = rec["output_token_ids"]
        if len(out) % 4:
            raise WireError("bad_result",
                            f"result {i} output_token_ids is {len(out)} bytes, not a multiple of 4")
        rec["output_token_ids"] = np.frombuffer(out, dtype="<u4").tolist()
        if not all(isinstance(k, str) and isinstance(v, (int, float)) for k, v in rec["timings"].items()):
            raise WireError("bad_result", f"result {i} timings must map str to numbers; "
                                          f"got {rec['timings']!r:.120}")
        err = rec["error"]
        if err is not None and (set(err) != set(_ERROR_FIELDS) or not isinstance(err["code"], str)
                                or not isinstance(err["message"], str)
                                or not isinstance(err["retry_after_s"], (int, float, type(None)))):
            raise WireError("bad_result", f"result {i} error must be a map {{code: str, message: str, "
                                          f"retry_after_s: number or None}}; got {err!r:.120}")
    return obj
