"""One simulated engine shard: the real Scheduler and BlockManager (prefix cache, cache events), a step-time
model instead of the model runner. A step's sampled token is a constant (requests ignore EOS and stop by
length), so the bookkeeping is the engine's own: admission, chunking, preemption, publishing, eviction."""
from __future__ import annotations

from dataclasses import dataclass

from flame_llm.config import Config
from flame_llm.engine.block_manager import BlockManager
from flame_llm.engine.outputs import ModelRunnerOutput
from flame_llm.engine.scheduler import Scheduler
from flame_llm.engine.sequence import Sequence
from flame_llm.prefix import revision_seed
from flame_llm.protocol.kv_events import KvEventBatch, KvEventLog

TOKEN = 7  # every sampled token


@dataclass(slots=True, frozen=True)
class StepModel:
    """Seconds per engine step: fixed + per computed prefill token + per decode row. Defaults from the H200 with
    Llama-3.1-8B (bench/RESULTS.md): ~38k prefill tokens/s (0.026 ms/token), a batch-64 decode step ~21.6 ms."""
    fixed_s: float = 0.004
    prefill_token_s: float = 0.026e-3
    decode_row_s: float = 0.27e-3

    def step_s(self, prefill_tokens: int, decode_rows: int) -> float:
        return self.fixed_s + self.prefill_token_s * prefill_tokens + self.decode_row_s * decode_rows


@dataclass(slots=True)
class StepResult:
    """One simulated step: how long it took, the sequences that got their first token and those that finished,
    and the cache events it produced (None: none)."""
    duration_s: float
    first_token: list[Sequence]
    finished: list[Sequence]
    events: KvEventBatch | None


class SimShard:
    def __init__(self, shard: int, config: Config, num_blocks: int, model: StepModel, kv_events: bool = True) -> None:
        cc = config.cache_config
        self.shard, self.model = shard, model
        self.bm = BlockManager(num_blocks, cc.block_size, True, cc.enable_lru, kv_events,
                               revision_seed(config.model_config.model_revision) if kv_events else -1)
        self.scheduler = Scheduler(config, self.bm)
        self.log = KvEventLog(shard, self.bm) if kv_events else None
        self.busy = False
        self.prefill_tokens = 0
        self.load_seq = 0  # load reports made (their stamps)

    def add(self, seq: Sequence) -> None:
        self.scheduler.add(seq)

    def step(self) -> StepResult | None:
        """Schedule and run one step (None when there is nothing to run)."""
        out = self.scheduler.schedule()
        if not out.seqs:
            return None
        decode_rows = sum(1 for s, n in zip(out.seqs, out.num_scheduled_tokens) if n == 1 and s.num_completion_tokens)
        prefill = out.total_num_scheduled_tokens - decode_rows
        self.prefill_tokens += prefill
        sampled = [TOKEN if s.num_pending_tokens > 0 else None for s in out.seqs]
        first = [s for s, t in zip(out.seqs, sampled) if t is not None and s.num_completion_tokens == 0]
        finished = self.scheduler.update_from_output(ModelRunnerOutput(out, sampled))
        events = self.log.cut() if self.log is not None else None
        return StepResult(self.model.step_s(prefill, decode_rows), first, finished, events)
