"""The engine step when speculative decoding is configured (LLMEngine delegates step() here).

A step is speculative when the scheduler returns decodes only, at most speculative_max_batch_size of
them, and reserves K more slots for each (Scheduler.reserve_lookahead, without preempting anyone).
Otherwise it is a plain target step; prefill chunks then also run through the draft, so their blocks
can be published at once.

Commits are transactional (a SpeculativeOutput to Scheduler.update_from_output): num_computed_tokens
advances over verified positions only (the last input and the accepted proposals), so rejected positions
are recomputed next step, and a block is published only when both the target's and the draft's KV cover
it: a later prefix hit must be valid for both pools. The draft trails by one token after a fully accepted
step (its first forward catches up) and by more after plain decode steps (caught up eagerly before the
next speculative step)."""
from __future__ import annotations

import logging
import weakref

import torch

from flame_llm.config import Config
from flame_llm.engine.model_runner import ModelRunner
from flame_llm.engine.outputs import SchedulerOutput, SpeculativeOutput
from flame_llm.engine.scheduler import Scheduler
from flame_llm.engine.sequence import Sequence
from flame_llm.engine.speculative.draft_runner import MAX_SPECULATIVE_TOKENS, DraftRunner
from flame_llm.engine.speculative.profiler import StepProfiler, profiling_enabled
from flame_llm.engine.speculative.spec_runner import SampledRows, SpecRunner
from flame_llm.layers.sampler import make_sampling_batch

logger = logging.getLogger(__name__)


class SpecDecoder:
    def __init__(self, config: Config, target: ModelRunner, draft: DraftRunner, scheduler: Scheduler) -> None:
        self.target, self.draft, self.scheduler = target, draft, scheduler
        self.k = config.speculative_config.num_speculative_tokens
        self.max_batch_size = min(config.speculative_config.speculative_max_batch_size,
                                  config.scheduler_config.max_num_seqs)
        self.max_model_len = config.model_config.max_model_len
        draft.allocate(target.num_blocks)
        self.runner = SpecRunner(target, draft, self.k, self.max_batch_size, target.use_graphs)
        self.runners = {self.k: self.runner}
        # per sequence: (draft KV valid below this position, the sequence's preemption count then)
        self.draft_state: weakref.WeakKeyDictionary[Sequence, tuple[int, int]] = weakref.WeakKeyDictionary()
        self.profiler = StepProfiler(target.device) if profiling_enabled() else None
        self.reset_stats()
        logger.info("speculative decoding: K=%d, up to %d sequences, draft %s, CUDA graphs %s", self.k,
                    self.max_batch_size, config.speculative_config.speculative_model, self.runner.use_graphs)

    def reset_stats(self) -> None:
        self.num_spec_steps = 0
        self.num_plain_decode_steps = 0  # decode steps that did not speculate (auto-off and fallbacks)
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.num_emitted_tokens = 0
        self.accepted_per_position = [0] * self.k
        if self.profiler is not None:
            self.profiler = StepProfiler(self.target.device)

    def set_num_speculative_tokens(self, k: int) -> None:
        """Switch K between requests (benchmarks); each K keeps its runner and CUDA graphs."""
        if not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens must be in [1, {MAX_SPECULATIVE_TOKENS}]; got {k!r}")
        if k not in self.runners:
            self.runners[k] = SpecRunner(self.target, self.draft, k, self.max_batch_size, self.runner.use_graphs)
        self.k, self.runner = k, self.runners[k]
        self.reset_stats()

    # ---- the step ----------------------------------------------------------------------------------
    def step(self) -> tuple[list[Sequence], int]:
        scheduled = self.scheduler.schedule()
        seqs = scheduled.seqs
        if not seqs:
            return [], 0
        drafted = [self._draft_computed(s) for s in seqs]
        if self._speculates(scheduled) and self.scheduler.reserve_lookahead(scheduled, self.k):
            return self._spec_step(scheduled, drafted), len(seqs) * (self.k + 1)
        return self._plain_step(scheduled, drafted), scheduled.total_num_scheduled_tokens

    def _draft_computed(self, seq: Sequence) -> int:
        state = self.draft_state.get(seq)
        if state is None or state[1] != seq.num_preemptions:
            return seq.num_computed_tokens  # new or readmitted: prefix-cache hits hold valid draft KV
        assert state[0] <= seq.num_computed_tokens
        return state[0]

    def _speculates(self, scheduled: SchedulerOutput) -> bool:
        """Whether the step may speculate: few enough decodes, each with K positions left before max_model_len
        (the scheduler still has to find the slots)."""
        if not 0 < len(scheduled.seqs) <= self.max_batch_size:
            return False
        for seq, n in zip(scheduled.seqs, scheduled.num_scheduled_tokens):
            if n != 1 or seq.num_tokens < 2 or seq.num_computed_tokens != seq.num_tokens - 1:
                return False
            if seq.num_tokens + self.k > self.max_model_len:
                return False
        return True

    def _spec_step(self, scheduled: SchedulerOutput, drafted: list[int]) -> list[Sequence]:
        seqs, prof = scheduled.seqs, self.profiler
        if prof is not None:
            prof.start()
        lagging = [(s, d) for s, d in zip(seqs, drafted) if d < s.num_tokens - 2]
        if lagging:  # after plain decode steps: write the draft KV up to the first forward's segment
            self.draft.extend([s for s, _ in lagging], [d for _, d in lagging], [s.num_tokens - 2 for s, _ in lagging])
            if prof is not None:
                prof.mark("catch_up")
        starts = [s.num_tokens for s in seqs]
        v = self.runner.step(seqs, self._sampled_rows(seqs), prof)
        k = self.k
        for a in v.num_accepted:
            self.num_accepted_tokens += a
            for i in range(a):
                self.accepted_per_position[i] += 1
        # the draft wrote t[n-2], t[n-1] and x1..x(K-1); those up to the accepted ones hold right tokens
        finished = self._commit(SpeculativeOutput(
            scheduled, [v.new_token_ids(i) for i in range(len(seqs))], [1 + a for a in v.num_accepted],
            [n + min(a, k - 1) for n, a in zip(starts, v.num_accepted)]))
        self.num_spec_steps += 1
        self.num_draft_tokens += k * len(seqs)
        self.num_emitted_tokens += sum(a + 1 for a in v.num_accepted)
        if prof is not None:
            prof.mark("commit")
            prof.stop()
        return finished

    def _plain_step(self, scheduled: SchedulerOutput, drafted: list[int]) -> list[Sequence]:
        seqs, num_tokens = scheduled.seqs, scheduled.num_scheduled_tokens
        prefill = [i for i, (s, n) in enumerate(zip(seqs, num_tokens))
                   if n > 1 or s.num_completion_tokens == 0]
        ends = [s.num_computed_tokens + n for s, n in zip(seqs, num_tokens)]
        if prefill:
            self.draft.extend([seqs[i] for i in prefill], [drafted[i] for i in prefill], [ends[i] for i in prefill])
            for i in prefill:
                drafted[i] = ends[i]
        else:
            self.num_plain_decode_steps += 1
        out = self.target.run(scheduled)  # a failed row's token is None: its greedy placeholder is not its token
        return self._commit(SpeculativeOutput(scheduled, [[] if t is None else [t] for t in out.sampled_token_ids],
                                              num_tokens, drafted, out.failed))

    def _commit(self, output: SpeculativeOutput) -> list[Sequence]:
        """Complete the step in the scheduler, publishing only blocks the draft's KV covers too; remember
        how far the draft's KV of each unfinished sequence is valid. Returns the finished sequences."""
        finished = self.scheduler.update_from_output(output)
        for seq, d in zip(output.scheduled.seqs, output.publish_upto):
            if not seq.is_finished:
                self.draft_state[seq] = (min(d, seq.num_computed_tokens), seq.num_preemptions)
        return finished

    def _sampled_rows(self, seqs: list[Sequence]) -> SampledRows | None:
        idx = [i for i, s in enumerate(seqs) if not s.sampling_params.greedy]
        if not idx:
            return None
        params = [seqs[i].sampling_params for i in idx]
        positions = [seqs[i].num_completion_tokens for i in idx]
        batch = make_sampling_batch(params, positions, self.target.vocab_size, self.target.device)
        index = torch.tensor(idx, dtype=torch.int64).to(self.target.device, non_blocking=True)
        return SampledRows(index, batch.temperatures, batch.top_ks, batch.top_ps, [p.seed for p in params],
                           positions)

    def stats(self) -> dict:
        out = {"spec_steps": self.num_spec_steps, "spec_plain_decode_steps": self.num_plain_decode_steps,
               "spec_draft_tokens": self.num_draft_tokens, "spec_accepted_tokens": self.num_accepted_tokens,
               "spec_emitted_tokens": self.num_emitted_tokens,
               "spec_acceptance_rate": self.num_accepted_tokens / max(1, self.num_draft_tokens),
               # tokens a sequence gains per speculative step: accepted proposals plus the target's token
               "spec_mean_accepted_length": self.num_emitted_tokens / max(1, self.num_draft_tokens // self.k),
               "spec_accepted_per_position": list(self.accepted_per_position),
               "spec_cuda_graphs": self.runner.use_graphs}
        if self.profiler is not None:
            out["spec_profile_ms"] = self.profiler.summary()
        return out
