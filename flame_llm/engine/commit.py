"""Committing a step's tokens to its sequences (the Scheduler's update_from_output calls these): a launched
step's sampled tokens, a speculative step's verified ones, and the rows whose sampling failed on their own.
`finish(seq, reason)` is the Scheduler's (it frees blocks and leaves the queues), called where a sequence stops,
before the next row is committed."""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from flame_llm.engine.block_manager import BlockManager
from flame_llm.engine.outputs import ModelRunnerOutput, SpeculativeOutput
from flame_llm.engine.sequence import Sequence, SequenceStatus
from flame_llm.sampling_params import stop_reason

logger = logging.getLogger(__name__)

Finish = Callable[[Sequence, str], None]


@dataclass(slots=True)
class StopRule:
    """When an appended token ends its sequence."""
    eos_token_ids: frozenset[int]
    max_model_len: int

    def append(self, seq: Sequence, token_id: int, now: float) -> str | None:
        """Append a sampled token; the stop reason it triggers, if any."""
        seq.append_token(token_id, now)
        return stop_reason(token_id, seq.sampling_params, self.eos_token_ids, seq.num_completion_tokens,
                           seq.num_tokens, self.max_model_len)


def commit_sampled(output: ModelRunnerOutput, now: float, stop: StopRule, bm: BlockManager,
                   finish: Finish) -> list[Sequence]:
    """Append the sampled tokens of a launched step; return the sequences that finished."""
    finished = []
    for seq, token_id in zip(output.scheduled.seqs, output.sampled_token_ids):
        if token_id is None or seq.status == SequenceStatus.FINISHED:
            continue  # a chunk short of the end, a failed row, or a sequence that stopped (or was aborted)
        seq.num_pending_tokens -= 1
        reason = stop.append(seq, token_id, now)
        bm.publish(seq)
        if reason is not None:
            finish(seq, reason)
            finished.append(seq)
    return finished


def commit_speculative(output: SpeculativeOutput, now: float, stop: StopRule, bm: BlockManager,
                       finish: Finish) -> list[Sequence]:
    """Commit a step run by speculative decoding (not launched): append each sequence's tokens up to a stop,
    count num_verified more of its positions as computed, publish its full blocks below publish_upto. Returns
    the sequences that finished."""
    finished = []
    for seq, tokens, n, upto in zip(output.scheduled.seqs, output.token_ids, output.num_verified,
                                    output.publish_upto):
        reason = None
        for token_id in tokens:
            reason = stop.append(seq, token_id, now)
            if reason is not None:
                break
        seq.num_computed_tokens = min(seq.num_computed_tokens + n, seq.num_tokens)
        bm.publish(seq, upto=min(seq.num_computed_tokens, upto))
        if reason is not None:
            finish(seq, reason)
            finished.append(seq)
    return finished


def fail_rows(output: ModelRunnerOutput | SpeculativeOutput, finished: list[Sequence], finish: Finish) -> None:
    """Finish the rows whose sampling failed on their own (a poison request; their token was not appended) with
    reason "error" and the message in seq.error, adding them to `finished`; their neighbours are done as usual."""
    for i, message in output.failed.items():
        seq = output.scheduled.seqs[i]
        if seq.is_finished:  # aborted meanwhile
            continue
        logger.warning("request %s failed in the step and is finished alone: %s", seq.request_id, message)
        seq.error = message
        finish(seq, "error")
        finished.append(seq)
