from __future__ import annotations

import logging
import time
from collections.abc import Callable
from collections.abc import Sequence as Seq

import numpy as np
from tqdm.auto import tqdm

from flame_llm.config import Config
from flame_llm.engine.block_manager import BlockManager
from flame_llm.engine.model_runner import ModelRunner, PreparedStep, StepHandle
from flame_llm.engine.scheduler import Scheduler
from flame_llm.engine.sequence import Sequence
from flame_llm.engine.speculative.decoder import SpecDecoder
from flame_llm.engine.speculative.draft_runner import DraftRunner
from flame_llm.engine.stalls import process_gc_pauses, triton_kernel_variants
from flame_llm.limits import max_output_tokens, max_prompt_tokens
from flame_llm.outputs import RequestMetrics, RequestOutput
from flame_llm.prefix import revision_seed
from flame_llm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
# eager steps at least this long are "long launches" in stats(): with asynchronous scheduling the tokens of the
# step before one wait for its host launch (on the H200 an 8K-token step's made the gap before it 45 ms, not ~6)
LONG_LAUNCH_TOKENS = 2048


class LLMEngine:
    def __init__(self, config: Config) -> None:
        self.config = config
        # the draft is loaded first: the target's KV budget leaves room for its pool
        draft = DraftRunner(config) if config.speculative else None
        self.model_runner = ModelRunner(config, extra_block_bytes=draft.block_bytes() if draft else 0)
        cc = config.cache_config
        # with cache events the chain starts from the model revision's seed, as the router's routing key does
        seed = revision_seed(config.model_config.model_revision) if cc.enable_kv_events else -1
        self.block_manager = BlockManager(self.model_runner.num_blocks, cc.block_size, cc.enable_prefix_caching,
                                          cc.enable_lru, cc.enable_kv_events, seed)
        self.scheduler = Scheduler(config, self.block_manager)
        self.spec = SpecDecoder(config, self.model_runner, draft, self.scheduler) if draft is not None else None
        self._tokenizer = None
        self.vocab_size = config.model_config.hf_config.vocab_size
        self.async_scheduling = config.scheduler_config.async_scheduling
        if self.async_scheduling is None:
            self.async_scheduling = self.model_runner.device.type == "cuda" and self.spec is None
        self._inflight: StepHandle | None = None  # the launched step whose tokens are not read yet
        self.emit_before_long_launch = config.scheduler_config.emit_before_long_launch if self.async_scheduling else 0
        self._idle = True  # the last step() left nothing to run (the step timeline's idle break)
        self.num_early_commits = 0  # steps read (and handed out) before the long step after them was enqueued
        # eager steps of LONG_LAUNCH_TOKENS or more: how many, and the host seconds preparing and enqueueing them
        self.num_long_launches, self.long_launch_s, self.long_launch_max_s = 0, 0.0, 0.0
        self._gc = process_gc_pauses()
        self._jit_base = triton_kernel_variants()  # variants compiled by startup (graph capture, warmup)
        logger.info("scheduling: %s", "asynchronous (step N+1 launched before step N's tokens are read)"
                    if self.async_scheduling else "synchronous")

    @classmethod
    def from_args(cls, model: str, **kwargs) -> LLMEngine:
        return cls(Config.from_kwargs(model, **kwargs))

    @property
    def tokenizer(self):  # -> transformers.PreTrainedTokenizerBase (loaded lazily)
        if self._tokenizer is None:
            from flame_llm.models.tokenizer import load_tokenizer

            mc = self.config.model_config
            self._tokenizer = load_tokenizer(mc.model, mc.tokenizer, self.vocab_size)
        return self._tokenizer

    def to_token_ids(self, prompt: str | Seq[int] | np.ndarray) -> list[int]:
        """The prompt as a list of in-vocabulary token ids, checked once in numpy (a uint32 array from the
        wire costs microseconds, not a Python pass over 8K tokens); ValueError naming the field."""
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        arr = prompt if isinstance(prompt, np.ndarray) else np.asarray(prompt)
        if arr.size:
            if arr.ndim != 1 or arr.dtype.kind not in "iu":
                raise ValueError("prompt_token_ids must be a flat sequence of integers")
            lo, hi = int(arr.min()), int(arr.max())
            if lo < 0 or hi >= self.vocab_size:
                raise ValueError(f"prompt_token_ids must lie in [0, vocab_size={self.vocab_size}); "
                                 f"got {lo if lo < 0 else hi}")
        return arr.tolist() if isinstance(prompt, np.ndarray) else list(prompt)

    def check_request(self, prompt_token_ids: list[int], sp: SamplingParams) -> None:
        """Raise ValueError naming the field and the limit; touches no engine state (any thread). The ids'
        type and range were checked by to_token_ids, the one way prompts enter the engine."""
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("prompt_token_ids is empty; a prompt needs at least 1 token")
        max_len = self.config.model_config.max_model_len
        limit = max_prompt_tokens(max_len)
        if n > limit:
            raise ValueError(f"prompt_token_ids has {n} tokens; the limit is {limit} (max_model_len {max_len}, "
                             "and a prompt must leave room for one output token)")
        sp.validate()
        self.check_fits(n, sp)

    def check_fits(self, n: int, sp: SamplingParams) -> None:
        """The engine's own limit, which no boundary before it knows: a request of `n` prompt tokens fits the KV
        pool with the output it may produce. ValueError naming the need and the pool."""
        max_len, bs = self.config.model_config.max_model_len, self.config.cache_config.block_size
        need = (n + max_output_tokens(n, sp.max_tokens, max_len) + bs - 1) // bs
        if need > self.block_manager.num_blocks:
            raise ValueError(f"request needs {need} KV blocks (prompt {n} + max_tokens {sp.max_tokens}); "
                             f"the KV pool has {self.block_manager.num_blocks}")

    def add_request(self, prompt: str | Seq[int], sampling_params: SamplingParams,
                    request_id: str | None = None) -> Sequence:
        """Check a request (to_token_ids, check_request) and queue it."""
        token_ids = self.to_token_ids(prompt)
        self.check_request(token_ids, sampling_params)
        return self._add_checked(token_ids, sampling_params, request_id)

    def _add_checked(self, token_ids: list[int], sampling_params: SamplingParams,
                     request_id: str | None = None) -> Sequence:
        """Queue a request its entry point has checked (add_request, LLM.generate, AsyncEngine)."""
        seq = Sequence(token_ids, sampling_params, self.config.cache_config.block_size, request_id)
        self.scheduler.add(seq)
        return seq

    def step(self, on_commit: Callable[[list[Sequence]], None] | None = None) -> tuple[list[Sequence], int]:
        """Schedule and launch a step, then finish one: this one (synchronous) or the one launched before
        it (asynchronous). Returns the finished sequences and the tokens launched. on_commit(finished), when
        given, runs as soon as the finished step's tokens are committed: with emit_before_long_launch, before a
        long eager step is enqueued (its callers get their tokens before the host spends that launch). It must
        not call into the engine."""
        if self.spec is not None:
            finished, n = self.spec.step()
            if on_commit is not None:
                on_commit(finished)
            return finished, n
        sched = self.scheduler
        t_step = time.perf_counter()
        if self._idle:  # the GPU had nothing to run: the wait before this step is not a late launch
            self.model_runner.timeline.idle_break()
        scheduled = sched.schedule()
        t0 = time.perf_counter()
        prepared = self.model_runner.prepare_launch(scheduled, self._inflight) if scheduled.seqs else None
        prepare_s = time.perf_counter() - t0
        if not self.async_scheduling:
            done = self._launch(prepared, prepare_s)
        elif on_commit is not None and self._inflight is not None and self._emit_first(prepared):
            # read the running step and hand its tokens out first; the prepared step's blocks stay as prepared,
            # since nothing is scheduled before it is enqueued
            done = self._inflight
            finished = sched.update_from_output(done.output())
            on_commit(finished)
            self._inflight = self._launch(prepared, prepare_s)
            self.num_early_commits += 1
            self._timed(done, t_step)
            return finished, scheduled.total_num_scheduled_tokens
        else:
            done, self._inflight = self._inflight, self._launch(prepared, prepare_s)
        finished = sched.update_from_output(done.output() if done is not None else None)
        if on_commit is not None:
            on_commit(finished)
        self._timed(done, t_step)
        return finished, scheduled.total_num_scheduled_tokens

    def _timed(self, done: StepHandle | None, t_step: float) -> None:
        """Count a step() on the step timeline: the read step's GPU time, and this call's host time less its wait."""
        timeline = self.model_runner.timeline
        if done is not None:
            timeline.finish(done.events)
        timeline.count_host(time.perf_counter() - t_step, done.sync_s if done is not None else 0.0)
        self._idle = self.is_finished()

    def _launch(self, prepared: PreparedStep | None, prepare_s: float) -> StepHandle | None:
        """Enqueue a prepared step; the host time of an eager one of LONG_LAUNCH_TOKENS or more (with its
        preparation) is counted: the time the tokens of the step before it wait with asynchronous scheduling."""
        if prepared is None:
            return None
        t0 = time.perf_counter()
        handle = self.model_runner.launch_prepared(prepared)
        if prepared.path == "eager" and prepared.scheduled.total_num_scheduled_tokens >= LONG_LAUNCH_TOKENS:
            s = prepare_s + time.perf_counter() - t0
            self.num_long_launches += 1
            self.long_launch_s += s
            self.long_launch_max_s = max(self.long_launch_max_s, s)
        return handle

    def _emit_first(self, prepared: PreparedStep | None) -> bool:
        """A long eager step after a short one: the short one's tokens would wait out the long launch. After a long
        step they would not gain (each hand-out shifts by a launch, the gaps stay), so back-to-back long steps (a
        burst's prefill) keep the GPU fed."""
        n = self.emit_before_long_launch
        return bool(n) and prepared is not None and prepared.path == "eager" and \
            prepared.scheduled.total_num_scheduled_tokens >= n and \
            self._inflight.scheduled.total_num_scheduled_tokens < n

    def abort(self, request_id: str) -> Sequence | None:
        return self.scheduler.abort(request_id)

    def is_finished(self) -> bool:
        return self._inflight is None and self.scheduler.is_finished()

    def stats(self) -> dict:
        runner = self.model_runner
        attention_jit = runner.attention_jit_compiles()
        return {**self.scheduler.stats(), "attention_backend": runner.backend, "cuda_graphs": runner.use_graphs,
                "async_scheduling": self.async_scheduling, "attention_jit_compiles": attention_jit,
                # stalls: kernel variants compiled after startup (Triton's and FA4's), collector pauses
                "jit_compiles": triton_kernel_variants() - self._jit_base + attention_jit,
                "gc_pauses_over_10ms": self._gc.num_over, "gc_pause_max_s": self._gc.max_s,
                "mixed_graph_steps": runner.mixed.replays if runner.mixed is not None else 0,
                "early_commits": self.num_early_commits, "long_launches": self.num_long_launches,
                "long_launch_s": self.long_launch_s, "long_launch_max_s": self.long_launch_max_s,
                **runner.timeline.stats(),
                **(self.spec.stats() if self.spec else {})}

    def make_output(self, seq: Sequence) -> RequestOutput:
        n = seq.num_completion_tokens
        text = None
        if self._tokenizer is not None:
            text = self._tokenizer.decode(seq.completion_token_ids, skip_special_tokens=True)
        metrics = RequestMetrics(
            seq.arrival_time, seq.first_token_time, seq.finish_time,
            ttft=(seq.first_token_time - seq.arrival_time) if seq.first_token_time else None,
            tpot=(seq.token_times[-1] - seq.token_times[0]) / (n - 1) if n > 1 else None,
            num_preemptions=seq.num_preemptions)
        return RequestOutput(seq.request_id, seq.prompt_token_ids, seq.completion_token_ids, seq.finish_reason,
                             seq.num_prompt_tokens, seq.num_cached_tokens, text, metrics, seq.error)


class LLM:
    """Offline generation: `LLM(model_dir, **config).generate(prompts, sampling_params)`."""

    def __init__(self, model: str, **kwargs) -> None:
        self.engine = LLMEngine(Config.from_kwargs(model, **kwargs))

    def generate(self, prompts: Seq[str] | Seq[Seq[int]], sampling_params: SamplingParams | Seq[SamplingParams]
                 | None = None, use_tqdm: bool = True) -> list[RequestOutput]:
        sampling_params = sampling_params or SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"sampling_params has {len(sampling_params)} entries for {len(prompts)} prompts")
        engine = self.engine
        token_ids = [engine.to_token_ids(p) for p in prompts]
        for ids, sp in zip(token_ids, sampling_params):  # check all before admitting any
            engine.check_request(ids, sp)
        seqs = [engine._add_checked(ids, sp) for ids, sp in zip(token_ids, sampling_params)]
        if any(isinstance(p, str) for p in prompts):
            engine.tokenizer  # noqa: B018 - decode text outputs too
        with tqdm(total=len(seqs), desc="generate", disable=not use_tqdm) as bar:
            while not engine.is_finished():
                finished, _ = engine.step()
                bar.update(len(finished))
        return [engine.make_output(s) for s in seqs]
