"""Continuous batching.

The original policy (every flag off) is nano-vllm's two-phase one: a step is either all prefill
(waiting prompts, FIFO, under the token and sequence budgets) or all decode (one token per running
sequence); when KV runs out the newest running sequence is preempted and recomputed later.

enable_chunked_prefill (mixed steps): running sequences go first, decodes before partially prefilled
ones, each taking as many tokens as the token budget and the KV pool allow; then waiting requests are
admitted, each with a chunk of what budget is left (none in a step that preempted). Blocks are
allocated per chunk; a chunk that stops short of its sequence's end yields no token. When KV runs out
the newest running sequence is preempted, as before; partially prefilled ones are the newest.

enable_cache_aware_schedule (LPM): admission picks, among the first cache_aware_window waiting
requests, the one with the longest cached prefix (ties: queue order). Each admission adds one to the
schedule_skips of every window request ahead of the one picked, and a request with
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

Asynchronous scheduling (the engine's async_scheduling): the engine launches step N+1 before it reads
step N's tokens. `launched` advances num_computed_tokens and publishes blocks when a step is enqueued
(steps run in order on one stream, so a later step reads what an earlier one wrote), counts the token
each sampling sequence is waiting for (num_pending_tokens), and retires a sequence whose pending token
surely ends it (max_tokens, max_model_len) so it takes no seat in the next step; its blocks are freed as
soon as every token it fed is known (release_retired). `complete` appends the tokens once read. For
workloads that stop only by length this reproduces the synchronous schedule step for step; a token
that turns out to be a stop token ends its sequence one step late (that step's token is dropped).
`postprocess` = launched + complete + release_retired: the synchronous step.
"""
from __future__ import annotations

import itertools
import time
from collections import deque

from flame_llm.config import Config
from flame_llm.engine.block_manager import BlockManager
from flame_llm.engine.sequence import Sequence, SequenceStatus


class Scheduler:
    def __init__(self, config: Config, block_manager: BlockManager) -> None:
        self.max_num_seqs = config.scheduler_config.max_num_seqs
        self.max_num_batched_tokens = config.scheduler_config.max_num_batched_tokens
        self.max_model_len = config.model_config.max_model_len
        self.eos_token_ids = frozenset(config.model_config.eos_token_ids)
        self.enable_chunked_prefill = config.scheduler_config.enable_chunked_prefill
        self.cache_aware = config.scheduler_config.enable_cache_aware_schedule
        self.cache_aware_window = config.scheduler_config.cache_aware_window
        self.cache_aware_max_skips = config.scheduler_config.cache_aware_max_skips
        self.prefix_dedup = config.scheduler_config.enable_prefix_dedup
        # speculative decoding publishes only blocks both KV pools hold, after the step
        # speculative decoding publishes only blocks both KV pools hold, after the step
        self.same_step_sharing = config.cache_config.enable_same_step_prefix_sharing and not config.speculative
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.retired: list[Sequence] = []  # sure to finish with their pending token; blocks not yet freed
        self._window: list[Sequence] = []  # LPM: a prefix of waiting, ranked by _window_cached
        self._window_cached: list[int] = []
        self._step_start = 0.0
        self._step_has_prefill = False
        self.reset_stats()

    def reset_stats(self) -> None:
        self.num_preemptions = 0
        self.num_deferred_admissions = 0  # prefix dedup: a request passed over for a step
        self.num_prefill_steps = 0  # steps with any prefill tokens (mixed steps included)
        self.num_decode_steps = 0  # steps of decodes only
        self.num_mixed_steps = 0
        self.num_prefill_tokens = 0
        self.num_decode_tokens = 0
        self.prefill_time_s = 0.0  # schedule-to-postprocess time of prefill steps
        self.decode_time_s = 0.0
        self.block_manager.reset_stats()

    def is_finished(self) -> bool:
        return not self.waiting and not self.running and not self.retired

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def schedule(self) -> tuple[list[Sequence], list[int]]:
        """Sequences to run this step and how many new tokens each computes."""
        self._step_start = time.perf_counter()
        if self.enable_chunked_prefill:
            return self._schedule_mixed()
        bm = self.block_manager
        scheduled: list[Sequence] = []
        num_tokens: list[int] = []
        num_batched = 0
        self._open_window()
        inflight = self._inflight_blocks() if self.prefix_dedup else None
        passed: set[int] = set()
        while self.waiting and len(scheduled) < self.max_num_seqs:
            i = self._pick_waiting(passed)
            if i is None:
                break
            seq = self.waiting[i]
            cached = bm.can_allocate(seq)
            if inflight is not None and cached >= 0 and self._waits_for(seq, cached, inflight):
                passed.add(id(seq))
                continue
            if cached < 0 or num_batched + seq.num_tokens - cached > self.max_num_batched_tokens:
                break
            bm.allocate(seq)
            n = seq.num_tokens - seq.num_computed_tokens
            bm.append_slots(seq, n)
            self._share(seq, n)
            num_batched += n
            self._admit(i)
            if inflight is not None:
                bm.add_unpublished_prompt_hashes(seq, inflight)
            scheduled.append(seq)
            num_tokens.append(n)
        if scheduled:
            self._count_step(num_batched, 0)
            return scheduled, num_tokens
        while self.running and len(scheduled) < self.max_num_seqs:
            seq = self.running.popleft()
            if self._make_room(seq, lambda s: bm.can_append(s, 1)):
                bm.append_slots(seq, 1)
                scheduled.append(seq)
        self.running.extendleft(reversed(scheduled))
        if scheduled:
            self._count_step(0, len(scheduled))
        return scheduled, [1] * len(scheduled)

    def _schedule_mixed(self) -> tuple[list[Sequence], list[int]]:
        bm = self.block_manager
        budget = self.max_num_batched_tokens
        scheduled: list[Sequence] = []
        num_tokens: list[int] = []
        num_prefill = 0
        preemptions = self.num_preemptions
        # running order is decode-first: a chunk stops short of its sequence's end only by using up the
        # budget or the free pool, so nothing is admitted after it and the one partially prefilled
        # sequence is always the newest (tests assert this)
        while self.running and len(scheduled) < self.max_num_seqs and budget > 0:
            seq = self.running.popleft()
            if self._make_room(seq, lambda s: bm.num_appendable_tokens(s) >= 1):
                room = bm.num_appendable_tokens(seq)
                remaining = seq.num_tokens + seq.num_pending_tokens - seq.num_computed_tokens
                n = min(remaining, budget, room)
                if remaining > 1 or seq.num_completion_tokens + seq.num_pending_tokens == 0:
                    num_prefill += n
                bm.append_slots(seq, n)
                self._share(seq, n)
                scheduled.append(seq)
                num_tokens.append(n)
                budget -= n
        self.running.extendleft(reversed(scheduled))
        if self.num_preemptions == preemptions:
            self._open_window()
            inflight = self._inflight_blocks() if self.prefix_dedup else None
            passed: set[int] = set()
            while self.waiting and len(self.running) < self.max_num_seqs and budget > 0:
                i = self._pick_waiting(passed)
                if i is None:
                    break
                seq = self.waiting[i]
                cached, room = bm.allocation_room(seq)
                if inflight is not None and self._waits_for(seq, cached, inflight):
                    passed.add(id(seq))
                    continue
                n = min(seq.num_tokens - cached, budget, room)
                if n < 1:
                    break
                bm.allocate(seq)
                bm.append_slots(seq, n)
                self._share(seq, n)
                self._admit(i)
                if inflight is not None:
                    bm.add_unpublished_prompt_hashes(seq, inflight)
                scheduled.append(seq)
                num_tokens.append(n)
                budget -= n
                num_prefill += n
        if scheduled:
            self._count_step(num_prefill, self.max_num_batched_tokens - budget - num_prefill)
        return scheduled, num_tokens

    # ---- waiting-queue order (FIFO, or LPM with aging) --------------------------------------------
    def _open_window(self) -> None:
        if self.cache_aware:
            self._window = list(itertools.islice(self.waiting, self.cache_aware_window))
            self._window_cached = [self.block_manager.num_cached_prefix_tokens(s) for s in self._window]

    def _pick_waiting(self, passed: set[int] | None = None) -> int | None:
        """Index in waiting of the next request to admit: the head, or the LPM pick (module doc),
        leaving out the requests in `passed` (ids; prefix dedup). None when every candidate is passed.

        Cached lengths are measured once per step; admission re-checks the exact hit."""
        if not self.cache_aware:
            if not passed:
                return 0
            window = itertools.islice(self.waiting, self.cache_aware_window)
            return next((i for i, seq in enumerate(window) if id(seq) not in passed), None)
        if not self._window:
            self._open_window()
        best = None
        for i, seq in enumerate(self._window):
            if passed and id(seq) in passed:
                continue
            if seq.schedule_skips >= self.cache_aware_max_skips:
                return i
            if best is None or self._window_cached[i] > self._window_cached[best]:
                best = i
        return best

    # ---- prefix dedup ------------------------------------------------------------------------------
    def _inflight_blocks(self) -> set[int]:
        """Hashes of the prompt blocks running sequences will write but have not published yet."""
        inflight: set[int] = set()
        if self.waiting:
            for seq in self.running:
                if seq.num_computed_tokens < seq.num_prompt_tokens:
                    self.block_manager.add_unpublished_prompt_hashes(seq, inflight)
        return inflight

    def _waits_for(self, seq: Sequence, cached: int, inflight: set[int]) -> bool:
        if inflight and self.block_manager.next_block_hash(seq, cached) in inflight:
            self.num_deferred_admissions += 1
            return True
        return False

    def _share(self, seq: Sequence, n: int) -> None:
        """With same-step sharing, the blocks this step completes for seq are hits for the rest of it."""
        if self.same_step_sharing:
            self.block_manager.publish(seq, upto=seq.num_computed_tokens + n)

    def _admit(self, i: int) -> None:
        seq = self.waiting[i]
        # only a sequence preempted in this very schedule call can still wait for a token, and neither
        # policy admits in the call that preempted
        assert seq.num_pending_tokens == 0
        del self.waiting[i]
        if self.cache_aware:  # the window is a prefix of waiting: index i is the same request
            for passed in self._window[:i]:
                passed.schedule_skips += 1
            del self._window[i], self._window_cached[i]
        seq.schedule_skips = 0
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def step_info(self) -> tuple[float, bool]:
        """(schedule time, has prefill) of the step schedule() just returned, for complete()'s accounting."""
        return self._step_start, self._step_has_prefill

    def _count_step(self, num_prefill: int, num_decode: int) -> None:
        self._step_has_prefill = num_prefill > 0
        if num_prefill:
            self.num_prefill_steps += 1
            self.num_mixed_steps += num_decode > 0
        else:
            self.num_decode_steps += 1
        self.num_prefill_tokens += num_prefill
        self.num_decode_tokens += num_decode

    def _make_room(self, seq: Sequence, fits) -> bool:
        """Preempt the newest running sequences until fits(seq); False if seq itself had to go."""
        while not fits(seq):
            if not self.running:
                self.preempt(seq)
                return False
            self.preempt(self.running.pop())
        return True

    def preempt(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.block_manager.deallocate(seq)
        self.waiting.appendleft(seq)

    def postprocess(self, seqs: list[Sequence], num_tokens: list[int],
                    token_ids: list[int | None]) -> list[Sequence]:
        """The synchronous step's bookkeeping: launched, complete, release_retired; returns finished."""
        info = self.step_info()
        self.launched(seqs, num_tokens)
        finished = self.complete(seqs, token_ids, info)
        self.release_retired()
        return finished

    def launched(self, seqs: list[Sequence], num_tokens: list[int]) -> None:
        """A step computing num_tokens positions of each seq is enqueued: advance, publish, count pending."""
        bm = self.block_manager
        for seq, n in zip(seqs, num_tokens):
            seq.num_computed_tokens += n
            bm.publish(seq)
            if seq.num_computed_tokens >= seq.num_tokens:  # the segment reaches the end: it samples
                seq.num_pending_tokens += 1
                if self._ends_by_length(seq):
                    self.running.remove(seq)
                    self.retired.append(seq)

    def _ends_by_length(self, seq: Sequence) -> bool:
        n = seq.num_pending_tokens
        return seq.num_completion_tokens + n >= seq.max_tokens or seq.num_tokens + n >= self.max_model_len

    def complete(self, seqs: list[Sequence], token_ids: list[int | None],
                 info: tuple[float, bool] | None = None) -> list[Sequence]:
        """Append the sampled tokens of a launched step; return the sequences that finished."""
        finished = []
        now = time.perf_counter()
        start, has_prefill = info if info is not None else self.step_info()
        if has_prefill:
            self.prefill_time_s += now - start
        else:
            self.decode_time_s += now - start
        for seq, token_id in zip(seqs, token_ids):
            if token_id is None or seq.status == SequenceStatus.FINISHED:
                continue  # a chunk short of the end, or a sequence that stopped (or was aborted) meanwhile
            seq.num_pending_tokens -= 1
            reason = self.append_token(seq, token_id, now)
            self.block_manager.publish(seq)
            if reason is not None:
                self.finish(seq, reason)
                finished.append(seq)
        return finished

    def release_retired(self) -> None:
        """Free the blocks of retired sequences whose fed tokens are all known (only the last is pending)."""
        if not self.retired:
            return
        keep = []
        for seq in self.retired:
            if seq.status == SequenceStatus.FINISHED:
                continue
            if seq.num_pending_tokens > 1:
                keep.append(seq)
                continue
            self.block_manager.publish(seq)
            self.block_manager.deallocate(seq)
        self.retired = keep

    def append_token(self, seq: Sequence, token_id: int, now: float) -> str | None:
        """Append a sampled token with its time; the stop reason it triggers, if any."""
        seq.append_token(token_id)
        if seq.first_token_time is None:
            seq.first_token_time = now
        seq.token_times.append(now)
        return self.stop_reason(seq, token_id)

    def stop_reason(self, seq: Sequence, token_id: int) -> str | None:
        if not seq.ignore_eos and token_id in self.eos_token_ids:
            return "stop"
        if token_id in seq.sampling_params.stop_token_ids:
            return "stop"
        if seq.num_completion_tokens >= seq.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.finish_time = time.perf_counter()
        seq.num_pending_tokens = 0  # a token still being sampled for it is dropped when read
        self.block_manager.deallocate(seq)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:  # preempted while its token was pending (asynchronous scheduling)
            self.waiting.remove(seq)

    def abort(self, request_id: str) -> Sequence | None:
        for queue in (self.waiting, self.running):
            for seq in queue:
                if seq.request_id == request_id:
                    if seq.status == SequenceStatus.RUNNING:
                        self.finish(seq, "abort")
                    else:
                        queue.remove(seq)
                        seq.status, seq.finish_reason = SequenceStatus.FINISHED, "abort"
                        seq.finish_time = time.perf_counter()
                    return seq
        return None

    def stats(self) -> dict:
        return {"num_waiting": len(self.waiting), "num_running": len(self.running),
                "num_preemptions": self.num_preemptions, "num_deferred_admissions": self.num_deferred_admissions,
                "num_prefill_steps": self.num_prefill_steps,
                "num_decode_steps": self.num_decode_steps, "num_mixed_steps": self.num_mixed_steps,
                "num_prefill_tokens": self.num_prefill_tokens, "num_decode_tokens": self.num_decode_tokens,
                "prefill_time_s": self.prefill_time_s, "decode_time_s": self.decode_time_s,
                **self.block_manager.stats()}
