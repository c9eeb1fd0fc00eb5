"""Continuous batching. The original policy is nano-vllm's two-phase one: a step is either all
prefill (waiting prompts, FIFO, under the token and sequence budgets) or all decode (one token per
running sequence); when KV runs out the newest running sequence is preempted and recomputed later."""
from __future__ import annotations

import time
from collections import deque

from flame_llm.config import Config
from flame_llm.engine.block_manager import BlockManager
from flame_llm.engine.sequence import Sequence, SequenceStatus


class Scheduler:
    def __init__(self, config: Config, block_manager: BlockManager) -> None:
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_model_len = config.max_model_len
        self.eos_token_ids = frozenset(config.eos_token_ids)
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.num_preemptions = 0
        self.num_prefill_steps = 0
        self.num_decode_steps = 0

    def is_finished(self) -> bool:
        return not self.waiting and not self.running

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def schedule(self) -> tuple[list[Sequence], list[int]]:
        """Sequences to run this step and how many new tokens each computes."""
        bm = self.block_manager
        scheduled: list[Sequence] = []
        num_tokens: list[int] = []
        num_batched = 0
        while self.waiting and len(scheduled) < self.max_num_seqs:
            seq = self.waiting[0]
            cached = bm.can_allocate(seq)
            if cached < 0 or num_batched + seq.num_tokens - cached > self.max_num_batched_tokens:
                break
            bm.allocate(seq)
            n = seq.num_tokens - seq.num_computed_tokens
            bm.append_slots(seq, n)
            num_batched += n
            seq.status = SequenceStatus.RUNNING
            self.waiting.popleft()
            self.running.append(seq)
            scheduled.append(seq)
            num_tokens.append(n)
        if scheduled:
            self.num_prefill_steps += 1
            return scheduled, num_tokens
        while self.running and len(scheduled) < self.max_num_seqs:
            seq = self.running.popleft()
            while not bm.can_append(seq, 1):
                if self.running:
                    self.preempt(self.running.pop())
                else:
                    self.preempt(seq)
                    break
            else:
                bm.append_slots(seq, 1)
                scheduled.append(seq)
        self.running.extendleft(reversed(scheduled))
        if scheduled:
            self.num_decode_steps += 1
        return scheduled, [1] * len(scheduled)

    def preempt(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.block_manager.deallocate(seq)
        self.waiting.appendleft(seq)

    def postprocess(self, seqs: list[Sequence], num_tokens: list[int],
                    token_ids: list[int | None]) -> list[Sequence]:
        """Advance computed counts, publish written blocks, append sampled tokens; return finished."""
        finished = []
        now = time.perf_counter()
        for seq, n, token_id in zip(seqs, num_tokens, token_ids):
            seq.num_computed_tokens += n
            self.block_manager.publish(seq)
            if token_id is None:  # a prefill chunk that does not reach the end of the sequence
                continue
            seq.append_token(token_id)
            if seq.first_token_time is None:
                seq.first_token_time = now
            seq.token_times.append(now)
            reason = self.stop_reason(seq, token_id)
            if reason is not None:
                self.finish(seq, reason)
                finished.append(seq)
        return finished

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
        self.block_manager.deallocate(seq)
        self.running.remove(seq)

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
                "num_preemptions": self.num_preemptions, "num_prefill_steps": self.num_prefill_steps,
                "num_decode_steps": self.num_decode_steps, **self.block_manager.stats()}
