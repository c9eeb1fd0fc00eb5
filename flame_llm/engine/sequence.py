from __future__ import annotations

import itertools
import time
from enum import Enum, auto

from flame_llm.sampling_params import SamplingParams


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    """One request's tokens and KV bookkeeping.

    num_computed_tokens counts tokens whose K/V are in the cache; num_cached_tokens counts prompt
    tokens that came from the prefix cache (what results report as cached)."""

    counter = itertools.count()

    def __init__(self, token_ids: list[int], sampling_params: SamplingParams, block_size: int,
                 request_id: str | None = None) -> None:
        self.seq_id = next(Sequence.counter)
        self.request_id = request_id if request_id is not None else str(self.seq_id)
        self.status = SequenceStatus.WAITING
        self.token_ids = list(token_ids)
        self.num_tokens = len(self.token_ids)
        self.num_prompt_tokens = len(self.token_ids)
        self.num_cached_tokens = 0
        self.num_computed_tokens = 0
        # tokens a launched step is sampling that are not appended yet (asynchronous scheduling: at most 2,
        # between launching step N+1 and reading step N's tokens)
        self.num_pending_tokens = 0
        self.block_size = block_size
        self.block_table: list[int] = []
        self.num_published_blocks = 0  # leading blocks whose hashes are in the prefix cache
        self.last_block_hash = -1
        self.prompt_block_hashes: list[int] = []  # chained hashes of full prompt blocks, filled lazily
        self.sampling_params = sampling_params
        self.max_tokens = sampling_params.max_tokens
        self.ignore_eos = sampling_params.ignore_eos
        self.finish_reason: str | None = None
        self.error: str | None = None  # why it finished with reason "error" (its sampling failed alone)
        self.num_preemptions = 0
        self.schedule_skips = 0  # times passed over by the cache-aware ordering (aging)
        self.arrival_time = time.perf_counter()
        self.first_token_time: float | None = None
        self.finish_time: float | None = None
        self.token_times: list[float] = []

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def num_completion_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def completion_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_blocks(self) -> int:
        return (self.num_tokens + self.block_size - 1) // self.block_size

    def block(self, i: int) -> list[int]:
        assert 0 <= i < self.num_blocks
        return self.token_ids[i * self.block_size: (i + 1) * self.block_size]

    def append_token(self, token_id: int, now: float) -> None:
        """Append a sampled token read at time `now`."""
        self.token_ids.append(token_id)
        self.num_tokens += 1
        if self.first_token_time is None:
            self.first_token_time = now
        self.token_times.append(now)
