"""The protocol's one set of types: requests, results, error codes and the limits an engine publishes,
with their wire maps (see flame_llm.protocol.wire) and the plain dicts of JSON records (to_dict). The client,
its batcher, the engine actor, the router, the HTTP server and the bench all use these.

Requests are checked against the EngineLimits the engines publish in health(), by the same checks wherever
they enter (the client, the wire decoder, the HTTP server); an invalid request is a RequestError naming its
field (the error types are in flame_llm.protocol.errors).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import numpy as np

from flame_llm.limits import max_prompt_tokens
from flame_llm.outputs import RequestOutput
from flame_llm.protocol.checks import fits_utf8, key_list, token_bytes
from flame_llm.protocol.checks import prompt_digest as prompt_digest  # re-exported: part of the protocol's types
from flame_llm.protocol.errors import ErrorCode, ErrorInfo, RequestError, WireError
from flame_llm.sampling_params import SamplingParams, brief

DEFAULT_MAX_PAYLOAD_BYTES = 4 << 20  # decoded bytes of one request batch
DEFAULT_ZSTD_LEVEL = 1  # zstd level of request and result payloads
MAX_RESULT_PAYLOAD_BYTES = 256 << 20  # decoded bytes of one result payload a client accepts
MAX_ID_BYTES = 256  # UTF-8 bytes of a request id
MAX_USER_BYTES = 128  # UTF-8 bytes of a request's user (its turn in the shard's fair admission)
MAX_BATCH_REQUESTS = 8192  # requests in one batch (and results in one result payload); an invalid slot costs ~0.5 kB
TOKEN_COUNT_LIMIT = 1 << 32  # prompt and cached token counts in results are below this
SAMPLING_FIELDS = tuple(f.name for f in fields(SamplingParams))
_SAMPLING_FIELD_SET = frozenset(SAMPLING_FIELDS)


@dataclass(slots=True, frozen=True)
class EngineLimits:
    """What an engine accepts, published in its health(); every entry checks requests against these."""
    vocab_size: int
    max_model_len: int
    max_prompt_tokens: int  # flame_llm.limits.max_prompt_tokens(max_model_len): room for one output token
    max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES

    @classmethod
    def of(cls, vocab_size: int, max_model_len: int,
           max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES) -> EngineLimits:

        return cls(vocab_size, max_model_len, max_prompt_tokens(max_model_len), max_payload_bytes)

    @classmethod
    def tightest(cls, published: list[EngineLimits]) -> EngineLimits:
        """What every shard accepts, from the limits their health() publishes."""
        return cls(**{f.name: min(getattr(x, f.name) for x in published) for f in fields(cls)})

    def to_dict(self) -> dict:
        return asdict(self)

    def check_prompt(self, tokens: np.ndarray) -> None:
        """Raise RequestError (field 'prompt') unless the prompt is 1..max_prompt_tokens ids in the vocabulary."""
        n = len(tokens)
        if n == 0:
            raise RequestError(ErrorCode.EMPTY_PROMPT, "prompt must hold at least 1 token; got 0", "prompt")
        if n > self.max_prompt_tokens:
            raise RequestError(ErrorCode.PROMPT_TOO_LONG,
                               f"prompt has {n} tokens; the limit is {self.max_prompt_tokens} (max_model_len "
                               f"{self.max_model_len}, and a prompt must leave room for one output token)", "prompt")
        lo, hi = int(tokens.min()) if tokens.dtype.kind == "i" else 0, int(tokens.max())
        if lo < 0:
            raise RequestError(ErrorCode.TOKEN_OUT_OF_RANGE, f"token id {lo} at position {int(tokens.argmin())} is < 0",
                               "prompt")
        if hi >= self.vocab_size:
            raise RequestError(ErrorCode.TOKEN_OUT_OF_RANGE, f"token id {hi} at position {int(tokens.argmax())} is >= "
                                                             f"vocab_size {self.vocab_size}", "prompt")


@dataclass(slots=True, frozen=True)
class ShardHealth:
    """What an engine actor's health() answers: its placement, identity and state, and the limits requests
    are checked against. `admission_capacity`: requests one caller may have there without a rejection (in
    flight + queued), a client's flow-control credit."""
    shard: int
    name: str
    device: str  # the GPU UUID or cpu-k
    node: str
    pid: int
    model: str  # the model directory it loaded
    model_revision: str
    incarnation: str  # a new one after each restart: tells a restarted actor from the old one
    restarted: bool
    limits: EngineLimits
    admission_capacity: int
    draining: bool = False
    engine_failed: bool = False
    eos_token_ids: tuple[int, ...] = ()  # the model's: a streamed one of these ended the request (unless ignore_eos)
    tokenizer: str = ""  # the engine's `tokenizer` field (clients load the model's tokenizer with it)

    def to_dict(self) -> dict:
        """A flat map (the limits' fields beside the others), for JSON records and status()."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "limits"}
        return {**out, **self.limits.to_dict()}


def sampling_from_map(m: Any) -> SamplingParams:
    """SamplingParams from a map of its fields; RequestError (bad_sampling) naming the field at fault."""
    if not isinstance(m, dict):
        raise RequestError(ErrorCode.BAD_SAMPLING, f"sampling must be a map; got {type(m).__name__}", "sampling")
    unknown = m.keys() - _SAMPLING_FIELD_SET
    if unknown:
        raise RequestError(ErrorCode.BAD_SAMPLING, f"unknown sampling fields {key_list(unknown)}; "
                                                   f"known: {', '.join(SAMPLING_FIELDS)}", "sampling")
    for name, v in m.items():
        if name == "ignore_eos" and not isinstance(v, bool):
            raise RequestError(ErrorCode.BAD_SAMPLING, f"field 'ignore_eos' must be true or false; got "
                                                       f"{brief(v, 40)}", name)
        if name != "ignore_eos" and isinstance(v, bool):
            raise RequestError(ErrorCode.BAD_SAMPLING, f"field {name!r} must be a number, not {v}", name)
        if name == "stop_token_ids" and not isinstance(v, (list, tuple)):
            raise RequestError(ErrorCode.BAD_SAMPLING, f"field 'stop_token_ids' must be a list of token ids; "
                                                       f"got {type(v).__name__}", name)
    try:
        return SamplingParams(**m)
    except (TypeError, ValueError) as e:
        name = getattr(e, "field", "sampling")  # SamplingParamsError names its field; a TypeError does not
        raise RequestError(ErrorCode.BAD_SAMPLING, str(e), name) from None


@dataclass(slots=True)
class Request:
    id: str
    prompt_token_ids: list[int] | np.ndarray  # decoded requests carry a read-only uint32 array
    sampling: SamplingParams
    # whom the request is for, among its sender's users: the shard's fair admission gives each (sender, user) its
    # own turn (the HTTP front door's users: an API key, an OpenAI `user`, an address). "": the sender's own turn,
    # and not on the wire
    user: str = ""

    def to_wire(self) -> dict:
        prompt = token_bytes(self.prompt_token_ids, f"request {self.id!r}: prompt_token_ids")
        sp = self.sampling  # not asdict(): its deep copy was most of a request's encode time
        m = {"id": self.id, "prompt": prompt, "sampling": {f: getattr(sp, f) for f in SAMPLING_FIELDS}}
        if self.user:
            m["user"] = self.user
        return m

    @classmethod
    def from_wire(cls, r: Any, limits: EngineLimits, seen: set[str]) -> Request | RequestError:
        """One request map of a batch, checked against the engine's limits; an invalid one comes back as its
        RequestError (the batch's other requests proceed). `seen`: the ids before it in its batch."""
        rid = r.get("id") if isinstance(r, dict) else None
        if not rid or not fits_utf8(rid, MAX_ID_BYTES):
            return RequestError(ErrorCode.BAD_ID, f"id must be a non-empty str of at most {MAX_ID_BYTES} UTF-8 "
                                                  f"bytes; got {brief(rid)}", "id")
        try:
            if rid in seen:
                raise RequestError(ErrorCode.DUPLICATE_ID, f"id {rid!r} appears more than once in the batch", "id")
            seen.add(rid)
            user = r.get("user", "")
            if set(r) - {"user"} != {"id", "prompt", "sampling"}:
                raise RequestError(ErrorCode.BAD_REQUEST, "request keys must be exactly id, prompt, sampling and "
                                                          f"optionally user; got {key_list(r)}", "request")
            if not user and "user" in r or not fits_utf8(user, MAX_USER_BYTES):
                raise RequestError(ErrorCode.BAD_REQUEST, f"user must be a non-empty str of at most {MAX_USER_BYTES} "
                                                          f"UTF-8 bytes when given; got {brief(user)}", "user")
            prompt = r["prompt"]
            if not isinstance(prompt, bytes):
                raise RequestError(ErrorCode.BAD_PROMPT, "prompt must be bytes (little-endian uint32 token ids); "
                                                         f"got {type(prompt).__name__}", "prompt")
            if len(prompt) % 4:
                raise RequestError(ErrorCode.BAD_PROMPT, f"prompt length {len(prompt)} bytes is not a multiple "
                                                         "of 4 (uint32 token ids)", "prompt")
            tokens = np.frombuffer(prompt, dtype="<u4")
            limits.check_prompt(tokens)
            return cls(rid, tokens, sampling_from_map(r["sampling"]), user)
        except RequestError as e:
            e.id = rid
            return e


RESULT_FIELDS = ("id", "output_token_ids", "finish_reason", "prompt_tokens", "cached_tokens", "shard", "device",
                 "node", "timings", "error", "prompt_digest")
_WIRE_TYPES: dict[str, tuple[type, ...]] = {
    "id": (str, type(None)), "output_token_ids": (bytes,), "finish_reason": (str, type(None)),
    "prompt_tokens": (int,), "cached_tokens": (int,), "shard": (int,), "device": (str,), "node": (str,),
    "timings": (dict,), "error": (dict, type(None)), "prompt_digest": (str,),
}


@dataclass(slots=True)
class Result:
    """One request's outcome. device: the GPU UUID or cpu-k that served it; cached_tokens: prompt tokens
    served from the prefix cache; prompt_digest: the digest of the prompt as served."""
    id: str | None
    output_token_ids: list[int] | np.ndarray = ()
    finish_reason: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    shard: int = -1
    device: str = ""
    node: str = ""
    timings: dict[str, float] = field(default_factory=dict)
    error: ErrorInfo | None = None
    prompt_digest: str = ""
    text: str | None = None  # the decoded output, added by a client with a tokenizer (never on the wire)

    @classmethod
    def from_output(cls, out: RequestOutput, prompt_token_ids: list[int] | np.ndarray, timings: dict[str, float],
                    **placement: Any) -> Result:
        """The result of a finished engine request whose prompt was `prompt_token_ids` (as it arrived: its digest
        is the result's); `placement`: shard, device, node; `timings` gets the engine's own (output_timings)."""
        return cls(out.request_id, output_token_ids=out.output_token_ids, finish_reason=out.finish_reason,
                   prompt_tokens=out.num_prompt_tokens, cached_tokens=out.num_cached_tokens,
                   timings={**timings, **output_timings(out)}, prompt_digest=prompt_digest(prompt_token_ids),
                   **placement)

    def to_wire(self) -> dict:
        rec = {k: getattr(self, k) for k in RESULT_FIELDS}
        rec["output_token_ids"] = token_bytes(self.output_token_ids, f"result {self.id!r}: output_token_ids")
        rec["error"] = None if self.error is None else self.error.to_dict()
        return rec

    @classmethod
    def from_wire(cls, rec: Any, i: int) -> Result:
        """Result i of a payload; WireError (bad_result) unless it is a well-formed result map."""
        if not isinstance(rec, dict) or set(rec) != set(RESULT_FIELDS):
            got = key_list(rec) if isinstance(rec, dict) else type(rec).__name__
            raise WireError(ErrorCode.BAD_RESULT, f"result {i} must be a map with keys {', '.join(RESULT_FIELDS)}; "
                                                  f"got {got}")
        for key, types in _WIRE_TYPES.items():
            if not isinstance(rec[key], types):
                raise WireError(ErrorCode.BAD_RESULT, f"result {i} field {key!r} must be "
                                                      f"{' or '.join(t.__name__ for t in types)}; "
                                                      f"got {type(rec[key]).__name__}")
        out = rec["output_token_ids"]
        if len(out) % 4:
            raise WireError(ErrorCode.BAD_RESULT,
                            f"result {i} output_token_ids is {len(out)} bytes, not a multiple of 4")
        _check_numbers(rec, i)
        err = None if rec["error"] is None else ErrorInfo.from_dict(rec["error"], f"result {i}")
        return cls(**{**rec, "output_token_ids": np.frombuffer(out, dtype="<u4").tolist(), "error": err})

    def to_dict(self) -> dict:
        """The plain dict of a JSON record (the bench's records, `flame-llm submit --output`)."""
        out = {k: getattr(self, k) for k in RESULT_FIELDS}
        ids = self.output_token_ids
        out["output_token_ids"] = ids.tolist() if isinstance(ids, np.ndarray) else list(ids)
        out["error"] = None if self.error is None else self.error.to_dict()
        if self.text is not None:
            out["text"] = self.text
        return out


def output_timings(out: RequestOutput) -> dict[str, float]:
    """The engine's timings of a finished request that a result carries (ttft, tpot; seconds): the one place
    that reads RequestOutput.metrics."""
    m = out.metrics
    return {k: float(v) for k, v in (("ttft", m.ttft), ("tpot", m.tpot)) if v is not None}


def _check_numbers(rec: dict, i: int) -> None:
    """WireError (bad_result) unless result i's counts are in range (cached within prompt) and its timings are
    finite numbers: the client computes with them."""
    prompt, cached, shard = rec["prompt_tokens"], rec["cached_tokens"], rec["shard"]
    if not (type(prompt) is int and 0 <= prompt < TOKEN_COUNT_LIMIT and type(cached) is int and 0 <= cached <= prompt
            and type(shard) is int and -1 <= shard < 1 << 31):
        for name, v, lo, hi in (("prompt_tokens", prompt, 0, TOKEN_COUNT_LIMIT - 1),
                                ("cached_tokens", cached, 0, prompt), ("shard", shard, -1, (1 << 31) - 1)):
            if type(v) is not int or not lo <= v <= hi:
                raise WireError(ErrorCode.BAD_RESULT, f"result {i} field {name!r} must be an integer in [{lo}, {hi}]"
                                                      f"{' (prompt_tokens)' if name == 'cached_tokens' else ''}; "
                                                      f"got {brief(v, 40)}")
    for k, v in rec["timings"].items():
        if not (type(k) is str and (type(v) is int or (type(v) is float and math.isfinite(v)))):
            raise WireError(ErrorCode.BAD_RESULT, f"result {i} timings must map str to finite numbers; "
                                                  f"got {brief(rec['timings'], 120)}")
