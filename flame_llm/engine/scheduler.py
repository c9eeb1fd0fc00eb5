"""Continuous batching: one loop under a token budget (max_num_batched_tokens) and a seat budget
(max_num_seqs), built from two phases: schedule the running sequences, and admit waiting requests in
WaitingOrder's order (waiting.py: FIFO, cache-aware, prefix dedup). When KV runs out the newest running
sequence is preempted and recomputed later.

Chunked prefill off (nano-vllm's two-phase policy): a step is all prefill or all decode. Admission goes
first, whole prompts only, until one does not fit the budgets or the KV pool; a step that admits nobody
decodes the running sequences, one token each.

enable_chunked_prefill (mixed steps): running sequences go first, decodes before partially prefilled
ones, each taking as many tokens as the token budget and the KV pool allow; then waiting requests are
admitted, each with a chunk of what budget is left (none in a step that preempted). Blocks are
allocated per chunk; a chunk that stops short of its sequence's end yields no token. Partially
prefilled sequences are the newest running ones, so they are the first preempted.

enable_same_step_prefix_sharing: the blocks a segment completes are published when it is scheduled, so a
request admitted later in the step hits them (each layer stores a step's K/V before it attends). Off with
speculative decoding, which publishes only blocks both KV pools hold, after the step.

schedule() also counts its step as launched (asynchronous scheduling, outputs.py); after the step one
entry point, `update_from_output(output)`, appends the tokens read.

Speculative decoding: `reserve_lookahead` gives a step's sequences slots for the proposals, and a
SpeculativeOutput commits what the target verified (schedule() counts nothing as launched: the commit
advances num_computed_tokens over verified positions only).
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import asdict, dataclass, field

from flame_llm.config import Config
from flame_llm.engine.block_manager import BlockManager
from flame_llm.engine.commit import StopRule, commit_sampled, commit_speculative, fail_rows
from flame_llm.engine.outputs import ModelRunnerOutput, SchedulerOutput, SpeculativeOutput
from flame_llm.engine.sequence import Sequence, SequenceStatus
from flame_llm.engine.stats import SchedulerStats
from flame_llm.engine.waiting import WaitingOrder


@dataclass(slots=True)
class _Batch:
    """The step being built."""
    budget: int  # tokens left
    share: bool  # publish the blocks each segment completes at once (same-step sharing)
    seqs: list[Sequence] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)  # num_computed_tokens of each when scheduled
    num_prefill: int = 0
    prefill_cap: int = 0  # max_prefill_tokens_with_decode (0: none): prefill tokens once a decode row is in
    num_decode_rows: int = 0

    def prefill_left(self) -> int:
        """Tokens a prefill chunk may take now: the budget, or less once the step carries decode rows."""
        if self.prefill_cap and self.num_decode_rows:
            return min(self.budget, self.prefill_cap - self.num_prefill)
        return self.budget


class Scheduler:
    def __init__(self, config: Config, block_manager: BlockManager) -> None:
        sc = config.scheduler_config
        self.max_num_seqs = sc.max_num_seqs
        self.max_num_batched_tokens = sc.max_num_batched_tokens
        self.max_model_len = config.model_config.max_model_len
        self.eos_token_ids = frozenset(config.model_config.eos_token_ids)
        self.enable_chunked_prefill = sc.enable_chunked_prefill
        self.prefill_cap = sc.max_prefill_tokens_with_decode if sc.enable_chunked_prefill else 0
        self.same_step_sharing = config.cache_config.enable_same_step_prefix_sharing and not config.speculative
        self.speculative = bool(config.speculative)  # steps are committed whole (SpeculativeOutput), not launched
        self.block_manager = block_manager
        self.order = WaitingOrder(sc, block_manager)
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.retired: list[Sequence] = []  # sure to finish with their pending token; blocks not yet freed
        self.reset_stats()

    def reset_stats(self) -> None:
        self.counts = SchedulerStats()
        self.block_manager.reset_stats()

    def is_finished(self) -> bool:
        return not self.waiting and not self.running and not self.retired

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def sequences(self) -> tuple[Sequence, ...]:
        """The waiting and running sequences, waiting first (not the retired: their last token is launched)."""
        return (*self.waiting, *self.running)

    # ---- scheduling --------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Sequences to run this step and how many new tokens each computes."""
        start = time.perf_counter()
        # publishing rows as they are scheduled only helps a waiting request admitted in this step
        batch = _Batch(self.max_num_batched_tokens, self.same_step_sharing and bool(self.waiting),
                       prefill_cap=self.prefill_cap)
        if self.enable_chunked_prefill:
            preemptions = self.counts.num_preemptions
            self._schedule_running(batch)
            if self.counts.num_preemptions == preemptions:
                self._admit_waiting(batch)
        else:
            self._admit_waiting(batch)
            if not batch.seqs:
                batch.share = False  # a decode-only step admits nobody who could hit its blocks early
                self._schedule_running(batch)
        total = self.max_num_batched_tokens - batch.budget
        out = SchedulerOutput(batch.seqs, batch.num_tokens, batch.starts, total, start, batch.num_prefill > 0)
        if batch.seqs:
            self.counts.count_step(batch.num_prefill, total - batch.num_prefill)
            if not self.speculative:
                self._launched(out)
        return out

    def _schedule_running(self, batch: _Batch) -> None:
        """Running sequences in order, each with as many tokens as it has left, the budget and the KV
        pool allow, preempting the newest when KV runs out. The order is decode-first: a chunk stops short
        of its sequence's end only by using up the budget or the free pool, so nothing is admitted after it
        and the one partially prefilled sequence is always the newest (tests assert this)."""
        bm = self.block_manager
        while self.running and len(batch.seqs) < self.max_num_seqs and batch.budget > 0:
            seq = self.running.popleft()
            if self._make_room(seq):
                remaining = seq.num_tokens + seq.num_pending_tokens - seq.num_computed_tokens
                prefill = remaining > 1 or seq.num_completion_tokens + seq.num_pending_tokens == 0
                # decode-first: every decode row is in the batch before a partial prefill comes up, and the cap
                # leaves it at least one token (cap > num_prefill: this is the step's first prefill row)
                n = min(remaining, batch.prefill_left() if prefill else batch.budget, bm.num_appendable_tokens(seq))
                assert n > 0, (seq.request_id, remaining, batch.budget, batch.num_prefill)
                self._add(batch, seq, n, prefill)
        self.running.extendleft(reversed(batch.seqs))

    def _admit_waiting(self, batch: _Batch) -> None:
        """Waiting requests in the order's sequence while seats, budget and KV last: whole prompts, or
        with chunked prefill a chunk of what budget is left."""
        bm, order, chunked = self.block_manager, self.order, self.enable_chunked_prefill
        order.start(self.waiting, self.running)
        # whole prompts: prefix dedup still passes over a request (and counts it) when the budget is spent
        while self.waiting and len(batch.seqs) < self.max_num_seqs and (batch.budget > 0 or not chunked):
            i = order.next()
            if i is None:
                break
            seq = self.waiting[i]
            if chunked:
                cached, room = bm.allocation_room(seq)
                n = min(seq.num_tokens - cached, batch.prefill_left(), room)
            else:
                cached = bm.can_allocate(seq)  # -1: the whole prompt's blocks do not fit
                n = seq.num_tokens - cached if 0 <= cached and seq.num_tokens - cached <= batch.budget else 0
            if cached >= 0 and order.passes_over(seq, cached):
                self.counts.num_deferred_admissions += 1
                continue
            if n < 1:
                break
            bm.allocate(seq)
            # only a sequence preempted in this very call can still wait for a token, and such a call admits
            # nobody (chunked: admission is skipped; two-phase: preemption comes after admission)
            assert seq.num_pending_tokens == 0
            del self.waiting[i]
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            self._add(batch, seq, n, True)
            order.admitted(i, seq)

    def _add(self, batch: _Batch, seq: Sequence, n: int, prefill: bool) -> None:
        self.block_manager.append_slots(seq, n)
        if batch.share:
            self.block_manager.publish(seq, upto=seq.num_computed_tokens + n)
        batch.seqs.append(seq)
        batch.num_tokens.append(n)
        batch.starts.append(seq.num_computed_tokens)
        batch.budget -= n
        if prefill:
            batch.num_prefill += n
        else:
            batch.num_decode_rows += 1

    def _make_room(self, seq: Sequence) -> bool:
        """Preempt the newest running sequences until seq's next token has a slot; False if seq itself
        had to go."""
        while self.block_manager.num_appendable_tokens(seq) < 1:
            if not self.running:
                self.preempt(seq)
                return False
            self.preempt(self.running.pop())
        return True

    def preempt(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.counts.num_preemptions += 1
        self.block_manager.deallocate(seq)
        self.waiting.appendleft(seq)

    def reserve_lookahead(self, scheduled: SchedulerOutput, k: int) -> bool:
        """Slots for k more tokens past each sequence's scheduled ones (speculative proposals), from free
        blocks only (nobody is preempted): for every sequence, or for none (False)."""
        bm, pairs = self.block_manager, list(zip(scheduled.seqs, scheduled.num_scheduled_tokens))
        if sum(bm.blocks_needed(s, n + k) for s, n in pairs) > bm.num_free_blocks:
            return False
        for seq, n in pairs:
            bm.append_slots(seq, n + k)
        return True

    # ---- after the step ----------------------------------------------------------------------------
    def update_from_output(self, output: ModelRunnerOutput | SpeculativeOutput | None) -> list[Sequence]:
        """After a step is launched: append the tokens of `output` (the step read now, if any; see outputs.py),
        finish its rows whose sampling failed on their own with reason "error", free retired sequences'
        blocks. Returns the sequences that finished."""
        finished: list[Sequence] = []
        if output is not None:
            now = time.perf_counter()  # the step's schedule-to-now time is counted as prefill or decode time
            self.counts.count_time(output.scheduled.schedule_time, output.scheduled.has_prefill, now)
            stop = StopRule(self.eos_token_ids, self.max_model_len)
            if isinstance(output, SpeculativeOutput):
                finished = commit_speculative(output, now, stop, self.block_manager, self.finish)
            else:
                assert not self.speculative, "a speculative engine's steps are committed whole (SpeculativeOutput)"
                finished = commit_sampled(output, now, stop, self.block_manager, self.finish)
            if output.failed:
                fail_rows(output, finished, self.finish)
        if self.retired:
            self._release_retired()
        return finished

    def _launched(self, scheduled: SchedulerOutput) -> None:
        """The step is as good as enqueued (the runner reads its starts from `scheduled`): advance, publish,
        count pending tokens, retire sequences their pending token surely ends."""
        bm = self.block_manager
        for seq, n in zip(scheduled.seqs, scheduled.num_scheduled_tokens):
            seq.num_computed_tokens += n
            bm.publish(seq)
            if seq.num_computed_tokens >= seq.num_tokens:  # the segment reaches the end: it samples
                seq.num_pending_tokens += 1
                n = seq.num_pending_tokens
                if seq.num_completion_tokens + n >= seq.max_tokens or seq.num_tokens + n >= self.max_model_len:
                    self.running.remove(seq)  # ends by length
                    self.retired.append(seq)

    def _release_retired(self) -> None:
        """Free the blocks of retired sequences whose fed tokens are all known (only the last is pending)."""
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
        return {"num_waiting": len(self.waiting), "num_running": len(self.running), **asdict(self.counts),
                **self.block_manager.stats()}
