"""What passes between the scheduler, the model runner and the engine in one step (after vLLM v1's
SchedulerOutput / ModelRunnerOutput): `Scheduler.schedule()` returns a SchedulerOutput, the runner turns
it into a ModelRunnerOutput (or, for a speculative step, a SpeculativeOutput), and
`Scheduler.update_from_output` takes them back.

Asynchronous scheduling (the engine's async_scheduling): the engine launches step N+1 before it reads
step N's tokens. A launched step advances num_computed_tokens and publishes blocks when it is enqueued
(steps run in order on one stream, so a later step reads what an earlier one wrote), counts the token
each sampling sequence is waiting for (num_pending_tokens), and retires a sequence whose pending token
surely ends it (max_tokens, max_model_len) so it takes no seat in the next step; its blocks are freed as
soon as every token it fed is known. The tokens are appended once read. For workloads that stop only by
length this reproduces the synchronous schedule step for step; a token that turns out to be a stop token
ends its sequence one step late (that step's token is dropped).

Like vLLM v1's scheduler, schedule() does the launch bookkeeping of the step it returns before the runner
launches it (the runner reads the step's start positions from SchedulerOutput.num_computed_tokens, not
from the sequences), so one entry point is left after the step: `update_from_output(output)` with the
tokens read now - the same step's when synchronous, the step before's when asynchronous, None when
nothing was read (a first step: it still frees retired sequences' blocks, which must wait until the step
that reads them is launched). The scheduler's state changes in the same order as when the engine called
launched/complete/release_retired, so the recorded schedules are unchanged."""
from __future__ import annotations

from dataclasses import dataclass, field

from flame_llm.engine.sequence import Sequence


@dataclass(slots=True)
class SchedulerOutput:
    """One scheduled step: sequence i computes num_scheduled_tokens[i] positions from num_computed_tokens[i]
    (its own counter is already advanced past them, except with speculative decoding)."""
    seqs: list[Sequence]
    num_scheduled_tokens: list[int]
    num_computed_tokens: list[int]
    total_num_scheduled_tokens: int
    schedule_time: float  # perf_counter at schedule(): the step's time is counted from here
    has_prefill: bool  # any prefill tokens (the step's time counts as prefill time)


@dataclass(slots=True)
class ModelRunnerOutput:
    """The sampled tokens of a launched step, read back on the host."""
    scheduled: SchedulerOutput
    sampled_token_ids: list[int | None]  # per scheduled sequence; None: a chunk short of its end, or failed
    failed: dict[int, str] = field(default_factory=dict)  # index in seqs -> why its sampling failed (its own)


@dataclass(slots=True)
class SpeculativeOutput:
    """A step of speculative decoding (or a plain step while it is configured), committed transactionally:
    per scheduled sequence the tokens to append (up to a stop), how many of its positions count as computed
    now (the last input and the accepted proposals; the rest are recomputed), and the position below which
    its full blocks may be published (both the target's and the draft's KV cover them)."""
    scheduled: SchedulerOutput
    token_ids: list[list[int]]
    num_verified: list[int]
    publish_upto: list[int]
    failed: dict[int, str] = field(default_factory=dict)
