"""The client's requests: made from prompts (RequestMaker: the prompt as uint32 token ids, text through the model's
tokenizer, checked against the limits every shard publishes, its prefix chain and the router's estimates; a request
that cannot be sent gets its error result at once), their state (Pending), the client's counters, what a stream
hands its caller (StreamChunk, StreamError), and ClientCodec: the client's use of the one wire codec
(flame_llm/protocol/wire.py): request payloads encoded for the service's model revision and zstd level, result
payloads decoded, their sizes and times added to the client's counters."""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import math
import time
from dataclasses import asdict, dataclass

import numpy as np

from flame_llm.limits import max_output_tokens
from flame_llm.protocol.errors import ErrorCode, ErrorInfo, RequestError
from flame_llm.protocol.routing_key import estimate_prefill_work, prefix_chain
from flame_llm.protocol.types import EngineLimits, Request, Result
from flame_llm.protocol.wire import BATCH_OVERHEAD, decode_results, decoded_size, encode_requests, request_wire_size
from flame_llm.sampling_params import SamplingParams
from router.replica_client import NO_CHARGE, Charge


@dataclass(slots=True)
class Pending:
    """A request in the client's hands: routed, queued, in flight or waiting to be retried."""
    request: Request  # prompt_token_ids: uint32 array
    chain: list[int]
    est_work: float
    wire_bytes: int
    future: asyncio.Future
    shard: int = -1
    attempts: int = 0  # sends after the first, of any kind
    overloads: int = 0  # of those, resends after an overloaded answer: not counted against max_retries
    est_decode: int = 0  # output tokens it can produce (flame_llm.limits.max_output_tokens): the router's estimate
    deadline: float = math.inf  # time.monotonic() past which an overloaded answer is its result (no retry)
    charged: Charge = NO_CHARGE  # the router replica that counts its work (router/replica_client.py)


@dataclass(slots=True)
class StreamChunk:
    """Token ids the shard sent at once; the last chunk of a stream carries its Result."""
    token_ids: list[int]
    result: Result | None = None


class StreamError(RuntimeError):
    """A streamed request failed; `result` is its Result (error code, message, tokens it had)."""

    def __init__(self, result: Result) -> None:
        super().__init__(f"{result.error.code}: {result.error.message}")
        self.result = result


def set_estimates(p: Pending, model_revision: str, max_model_len: int) -> None:
    """p's routing identity and the router's estimates, from its (checked) request: the prompt's prefix chain,
    its prefill work, and the output tokens it can produce."""
    n = len(p.request.prompt_token_ids)
    p.chain = prefix_chain(p.request.prompt_token_ids, model_revision)
    p.est_work = estimate_prefill_work(n)
    p.est_decode = max_output_tokens(n, p.request.sampling.max_tokens, max_model_len)


def attempt_id(p: Pending) -> str:
    """The id p's current attempt carries to its shard: the caller's id on the first send, `id~k` on the k-th send
    after it. A shard holds one request per id (AsyncEngine refuses a second while the first is in flight), and an
    attempt the client walked away from may still be there, being aborted (its connection closed) or not yet
    stopped, when the next attempt arrives; and an abort then names one attempt, not its successor."""
    return p.request.id if p.attempts == 0 else f"{p.request.id}~{p.attempts}"


def failed_result(p: Pending, error: ErrorInfo) -> Result:
    return Result(p.request.id, prompt_tokens=len(p.request.prompt_token_ids), shard=p.shard, error=error)


@dataclass(slots=True)
class ClientCounters:
    """One client's running totals, owned by its Dispatcher (Client.counters and the shard channels see it)."""
    batches: int = 0  # request payloads sent
    result_payloads: int = 0  # result payloads received (several per batch when results come as they finish)
    streams: int = 0
    aborts_sent: int = 0
    route_calls: int = 0
    complete_calls: int = 0  # router `complete` calls (completions go in one call per loop tick)
    local_routes: int = 0  # streams placed without a router call (routing.py)
    route_retries: int = 0
    retries: int = 0  # requests sent again (overloaded, draining or dead shard)
    stream_resumes: int = 0  # of those, streams that went on from their last token (retry.py)
    restarts_seen: int = 0
    credit_waits: int = 0
    # per-batch costs, summed: decoded (raw) vs compressed payload bytes, seconds in routing calls, request
    # encoding and result decoding
    payload_raw_bytes: int = 0
    payload_wire_bytes: int = 0
    route_s: float = 0.0
    encode_s: float = 0.0
    result_decode_s: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)


class ClientCodec:
    def __init__(self, model_revision: str, zstd_level: int, counters: ClientCounters) -> None:
        self.model_revision, self.zstd_level, self.counters = model_revision, zstd_level, counters

    def encode(self, batch: list[Pending]) -> bytes:
        """The batch's payload; a request sent again goes under its attempt's id (pending.attempt_id)."""
        t0 = time.perf_counter()
        reqs = [p.request if not p.attempts else dataclasses.replace(p.request, id=attempt_id(p)) for p in batch]
        payload = encode_requests(reqs, self.model_revision, self.zstd_level)
        c = self.counters
        c.encode_s += time.perf_counter() - t0
        c.payload_wire_bytes += len(payload)
        c.payload_raw_bytes += decoded_size(payload)  # the msgpack size, from the header
        return payload

    def decode(self, reply: bytes) -> list[Result]:
        t0 = time.perf_counter()
        results = decode_results(reply)
        self.counters.result_decode_s += time.perf_counter() - t0
        self.counters.result_payloads += 1
        return results


@dataclass(slots=True, frozen=True)
class CheckedPrompt:
    """Token ids already checked against the limits every shard publishes (the front door's parse:
    openai_api.parse): the client takes them as they are instead of checking them again."""
    token_ids: np.ndarray  # uint32, 1..max_prompt_tokens ids in the vocabulary


class RequestMaker:
    def __init__(self, limits: EngineLimits, model_revision: str, model_dir: str | None, client_id: str,
                 overload_deadline_s: float, tokenizer_field: str = "") -> None:
        self.limits, self.model_revision, self.model_dir = limits, model_revision, model_dir
        self.tokenizer_field = tokenizer_field  # the engines' `tokenizer` ("": the model directory's)
        self.overload_deadline_s = overload_deadline_s  # ClientConfig's: a request's deadline when its call names none
        self.ids = (f"{client_id}-{i}" for i in itertools.count())
        self.tokenizer = None  # loaded with the first text prompt

    def prepare(self, prompt, sp: SamplingParams, loop: asyncio.AbstractEventLoop,
                deadline_s: float | None = None, user: str = "") -> Pending:
        """A request for `prompt` (on behalf of `user`), checked against the shards' limits; its future already holds
        the error result when it cannot be sent. deadline_s: its overload deadline, from now (None: the config's)."""
        if deadline_s is None:
            deadline_s = self.overload_deadline_s
        p = Pending(Request(next(self.ids), np.zeros(0, dtype=np.uint32), sp, user), [], 0.0, 0,
                    loop.create_future(), deadline=time.monotonic() + deadline_s)
        try:
            tokens = p.request.prompt_token_ids = self.tokens(prompt)
            p.wire_bytes = request_wire_size(len(tokens), len(sp.stop_token_ids))
            if not isinstance(prompt, CheckedPrompt):
                self.limits.check_prompt(tokens)
            if p.wire_bytes + BATCH_OVERHEAD > self.limits.max_payload_bytes:
                raise RequestError(ErrorCode.OVER_BUDGET, f"request needs {p.wire_bytes} decoded bytes; "
                                   f"max_payload_bytes is {self.limits.max_payload_bytes}", "prompt")
        except RequestError as e:
            p.future.set_result(failed_result(p, e.info()))
            return p
        set_estimates(p, self.model_revision, self.limits.max_model_len)
        return p

    def tokens(self, prompt) -> np.ndarray:
        """The prompt as uint32 token ids; RequestError (bad_prompt) when it cannot be one."""
        if isinstance(prompt, CheckedPrompt):
            return prompt.token_ids
        if isinstance(prompt, str):
            return np.asarray(self.tokenize(prompt), dtype=np.uint32)
        arr = prompt if isinstance(prompt, np.ndarray) else np.asarray(prompt)
        if arr.ndim != 1 or arr.size and arr.dtype.kind not in "iu":
            raise RequestError(ErrorCode.BAD_PROMPT, "prompt must be text or a flat sequence of token ids; "
                                                     f"got dtype {arr.dtype}, shape {arr.shape}", "prompt")
        if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= 1 << 32):
            raise RequestError(ErrorCode.BAD_PROMPT, "token ids must be in [0, 2**32); got min "
                                                     f"{int(arr.min())}, max {int(arr.max())}", "prompt")
        return arr.astype(np.uint32, copy=False)

    def tokenize(self, text: str) -> list[int]:
        if self.tokenizer is None:
            from flame_llm.models.tokenizer import load_tokenizer

            self.tokenizer = load_tokenizer(self.model_dir or "", self.tokenizer_field, self.limits.vocab_size)
        return self.tokenizer.encode(text)
