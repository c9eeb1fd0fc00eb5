"""A client's requests as they are made: the prompt as uint32 token ids (text through the model's tokenizer),
checked against the limits every shard publishes, its prefix chain and the router's estimates; a request that
cannot be sent gets its error result at once."""
from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass

import numpy as np

from flame_llm.protocol.errors import ErrorCode, RequestError
from flame_llm.protocol.types import EngineLimits, Request
from flame_llm.protocol.wire import BATCH_OVERHEAD, request_wire_size
from flame_llm.sampling_params import SamplingParams
from flame_llm.serving.pending import Pending, failed_result, set_estimates


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
                 deadline_s: float | None = None) -> Pending:
        """A request for `prompt`, checked against the shards' limits; its future already holds the error
        result when it cannot be sent. deadline_s: its overload deadline, from now (None: the config's)."""
        if deadline_s is None:
            deadline_s = self.overload_deadline_s
        p = Pending(Request(next(self.ids), np.zeros(0, dtype=np.uint32), sp), [], 0.0, 0, loop.create_future(),
                    deadline=time.monotonic() + deadline_s)
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

