"""The order in which the scheduler admits waiting requests.

FIFO by default. enable_cache_aware_schedule (LPM): admission picks, among the first cache_aware_window
waiting requests, the one with the longest cached prefix (ties: queue order). Each admission adds one
to the schedule_skips of every window request ahead of the one picked, and a request with
cache_aware_max_skips skips is picked first (the earliest such). Bound: while in the window a request
is passed over at most cache_aware_max_skips times, and outside it nobody behind it can pass it, so it
is admitted at most cache_aware_max_skips admissions later than FIFO order would admit it.

enable_prefix_dedup: a block's hash is published only after its K/V are written, so two requests
sharing a new prefix admitted while it is still being computed would each compute it. With the flag,
a waiting request whose next uncached full block is one that a running sequence will write (a
partially prefilled one, or one admitted earlier in this step) is passed over for this step; requests
behind it may go instead. It waits at most until that sequence's prompt is written (or it is
preempted), then hits the published blocks. Only the first cache_aware_window waiting requests are
considered when some are passed over.
"""
from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterable

from flame_llm.config import SchedulerConfig
from flame_llm.engine.block_manager import BlockManager
from flame_llm.engine.sequence import Sequence


class WaitingOrder:
    """One admission pass per step: start(), then for each candidate next(), and passes_over() or
    admitted() as the scheduler decides."""

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager) -> None:
        self.block_manager = block_manager
        self.cache_aware = config.enable_cache_aware_schedule
        self.window_size = config.cache_aware_window
        self.max_skips = config.cache_aware_max_skips
        self.prefix_dedup = config.enable_prefix_dedup
        self.waiting: deque[Sequence] = deque()
        self.window: list[Sequence] = []  # LPM: a prefix of waiting, ranked by window_cached
        self.window_cached: list[int] = []
        self.inflight: set[int] | None = None  # prefix dedup: unpublished prompt-block hashes being written
        self.passed: set[int] = set()  # ids of the requests passed over in this pass

    def start(self, waiting: deque[Sequence], running: Iterable[Sequence]) -> None:
        """Begin a step's admission pass over waiting, beside the sequences already running."""
        self.waiting = waiting
        self._open_window()
        self.inflight = self._inflight_blocks(running) if self.prefix_dedup else None
        self.passed = set()

    def next(self) -> int | None:
        """Index in waiting of the next request to consider: the head, or the LPM pick, leaving out the
        requests passed over; None when every candidate is passed over.

        Cached lengths are measured once per pass; admission re-checks the exact hit."""
        passed = self.passed
        if not self.cache_aware:
            if not passed:
                return 0
            window = itertools.islice(self.waiting, self.window_size)
            return next((i for i, seq in enumerate(window) if id(seq) not in passed), None)
        if not self.window:
            self._open_window()
        best = None
        for i, seq in enumerate(self.window):
            if passed and id(seq) in passed:
                continue
            if seq.schedule_skips >= self.max_skips:
                return i
            if best is None or self.window_cached[i] > self.window_cached[best]:
                best = i
        return best

    def passes_over(self, seq: Sequence, cached: int) -> bool:
        """Prefix dedup: whether seq, which would start with `cached` tokens, waits because a running
        sequence is writing its next block; it is then left out for the rest of the pass."""
        if self.inflight and self.block_manager.next_block_hash(seq, cached) in self.inflight:
            self.passed.add(id(seq))
            return True
        return False

    def admitted(self, i: int, seq: Sequence) -> None:
        """Candidate i (seq) was admitted, and its blocks for this step are allocated."""
        if self.cache_aware:  # the window is a prefix of waiting: index i is the same request
            for ahead in self.window[:i]:
                ahead.schedule_skips += 1
            del self.window[i], self.window_cached[i]
        seq.schedule_skips = 0
        if self.inflight is not None:
            self.block_manager.add_unpublished_prompt_hashes(seq, self.inflight)

    def _open_window(self) -> None:
        if self.cache_aware:
            self.window = list(itertools.islice(self.waiting, self.window_size))
            self.window_cached = [self.block_manager.num_cached_prefix_tokens(s) for s in self.window]

    def _inflight_blocks(self, running: Iterable[Sequence]) -> set[int]:
        inflight: set[int] = set()
        if self.waiting:
            for seq in running:
                if seq.num_computed_tokens < seq.num_prompt_tokens:
                    self.block_manager.add_unpublished_prompt_hashes(seq, inflight)
        return inflight
