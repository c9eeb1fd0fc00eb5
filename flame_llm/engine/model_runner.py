"""Runs the model for one scheduled step: builds inputs and attention metadata, owns the KV cache,
samples, and replays CUDA graphs for decode steps (and small steps with prefill tokens: mixed_graphs.py).

`launch` enqueues a scheduled step (SchedulerOutput) on the device and returns a StepHandle at once;
`StepHandle.output()` waits for its sampled tokens (a ModelRunnerOutput). Under asynchronous scheduling
the engine launches step N+1 before it reads step N's tokens: a sequence whose next input is the token
step N is still sampling gets it on the device (`prev`), so the host prepares step N+1 while the GPU runs
step N."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from flame_llm.config import Config
from flame_llm.engine.cuda_graphs import DecodeGraphs
from flame_llm.engine.kv_sizing import cpu_num_blocks, kv_block_bytes, profile_num_blocks
from flame_llm.engine.mixed_graphs import MixedGraphs, build_mixed_graphs
from flame_llm.engine.outputs import ModelRunnerOutput, SchedulerOutput
from flame_llm.engine.selector import BACKEND_STEPS, resolve_backend, resolve_device, resolve_dtype
from flame_llm.engine.sequence import Sequence
from flame_llm.engine.step_inputs import DeviceInputs, Staging, StepInputs, build_step_inputs, upload
from flame_llm.engine.step_timeline import StepEvents, StepTimeline
from flame_llm.engine.warmup import warmup_fa4, warmup_triton
from flame_llm.kernels.metadata import set_context
from flame_llm.layers.attention import Attention
from flame_llm.layers.fp8 import set_fp8_producers
from flame_llm.layers.layers import RMSNorm, RotaryEmbedding, SiluAndMul
from flame_llm.layers.sampler import sample_rows
from flame_llm.models.fp8_checkpoint import load_weights
from flame_llm.models.llama import MODELS

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, config: Config, extra_block_bytes: int = 0) -> None:
        """extra_block_bytes: bytes per block another KV pool indexed by the same block ids needs (the
        speculative draft's); the memory budget is split so that both fit."""
        self.config = config
        self.extra_block_bytes = extra_block_bytes
        mc, rc = config.model_config, config.runner_config
        hf = mc.hf_config
        self.device = resolve_device(mc.device)
        self.timeline = StepTimeline(self.device.type == "cuda")
        self.dtype = resolve_dtype(mc.dtype, self.device)
        # the KV pool's: the model dtype, or e4m3 with kv_cache_dtype fp8 (half the bytes a token)
        self.kv_dtype = torch.float8_e4m3fn if config.cache_config.kv_cache_dtype == "fp8" else self.dtype
        self.block_size = config.cache_config.block_size
        self.vocab_size = hf.vocab_size
        prev_dtype = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device):
                self.model = MODELS[hf.architectures[0]](hf)
        finally:
            torch.set_default_dtype(prev_dtype)
        load_weights(self.model, mc, self.device)  # dummy or safetensors; FP8 projections with quantization fp8
        self.model.eval()
        self.attn_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        self.backend = resolve_backend(rc.attention_backend, self.device, self.block_size, self.dtype,
                                       self.attn_layers[0].head_dim, config.cache_config.kv_cache_dtype)
        self.uses_fa4 = self.backend == "fa4"  # FA4 kernels run in some steps (their JIT compiles are counted, logged)
        for layer in self.attn_layers:
            layer.set_backend(self.backend)
        if self.device.type == "cuda" and rc.fused_ops:
            for m in self.model.modules():
                if isinstance(m, (RMSNorm, RotaryEmbedding, SiluAndMul)):
                    m.fused = True
        if mc.quantization == "fp8":
            set_fp8_producers(self.model, mc.fp8_fused_quant, mc.fp8_small_m_gemv)
        torch.manual_seed(mc.seed)
        self.allocate_kv_cache()
        self.max_blocks_per_seq = (mc.max_model_len + self.block_size - 1) // self.block_size
        self.staging = Staging(self.device)
        self.split_decodes = self.backend == "fa4" and rc.mixed_decode_attention == "triton"
        self.prune = rc.prune_last_layer  # eager steps: the last layer past its KV store on sampled rows only
        self._jit_logged = 0
        if self.backend != "torch":  # our Triton decode kernel runs this process's decode steps
            from flame_llm.kernels.triton_attention import set_decode_split_waves
            set_decode_split_waves(rc.decode_split_waves)
        if self.backend == "fa4":
            warmup_fa4(config, self.attn_layers[0])  # compiles our Triton kernel's decode-row variants too
        elif self.backend == "triton" and self.device.type == "cuda":
            warmup_triton(config, self.attn_layers[0])
        elif self.backend == "flash_attn" and rc.prune_last_layer:  # its kept rows run on our decode kernel
            from flame_llm.kernels.triton_attention import warmup_all_variants
            a = self.attn_layers[0]
            warmup_all_variants(a.k_cache, a.v_cache, a.num_heads, a.scale, decode_only=True)
        self.use_graphs = self.device.type == "cuda" and not rc.enforce_eager and self.backend != "torch"
        self.graphs: DecodeGraphs | None = None
        if self.use_graphs:
            self.graphs = DecodeGraphs(self.model, config.scheduler_config.max_num_seqs, self.max_blocks_per_seq,
                                       mc.max_model_len, self.device)
            self.graphs.capture()
        self.mixed: MixedGraphs | None = None
        self.mixed = build_mixed_graphs(self.model, config, self.backend, self.use_graphs, self.max_blocks_per_seq,
                                        self.attn_layers[0], self.device,
                                        self.graphs.graphs[self.graphs.buckets[0]].pool() if self.graphs else None)
        logger.info("attention: %s; decode-only steps: %s; steps with prefill tokens: %s", BACKEND_STEPS[self.backend],
                    "CUDA graphs" if self.use_graphs else "eager",
                    f"CUDA graphs up to {self.mixed.max_tokens} tokens" if self.mixed and self.use_graphs
                    else "padded, eager" if self.mixed else "eager")

    # ---- KV cache -------------------------------------------------------------------------------
    def block_bytes(self) -> int:
        layer = self.attn_layers[0]
        itemsize = torch.empty((), dtype=self.kv_dtype).element_size()
        return kv_block_bytes(len(self.attn_layers), self.block_size, layer.num_kv_heads, layer.head_dim, itemsize)

    def allocate_kv_cache(self, num_blocks: int | None = None) -> None:
        """A KV pool of num_blocks blocks (default: from the config or the memory budget), replacing any
        pool held; sets num_blocks."""
        cc = self.config.cache_config
        why = "num_kvcache_blocks"
        if num_blocks is None:
            if cc.num_kvcache_blocks > 0:
                num_blocks = cc.num_kvcache_blocks
            elif self.device.type == "cuda":
                num_blocks = profile_num_blocks(self.model, self.config, self.device,
                                                self.block_bytes() + self.extra_block_bytes)
                why = "gpu_memory_utilization"
            else:
                num_blocks, why = cpu_num_blocks(cc.cpu_kvcache_gib, self.block_bytes() + self.extra_block_bytes,
                                                 self.config.scheduler_config.max_num_seqs,
                                                 self.config.model_config.max_model_len, self.block_size)
        if num_blocks < 1:
            raise ValueError("no memory left for the KV cache; lower max_num_batched_tokens or raise "
                             "gpu_memory_utilization, or set num_kvcache_blocks")
        layer = self.attn_layers[0]
        # zeros, not empty: kernels that load whole pages (FA4's TMA path) read rows past a sequence's end,
        # and a masked score times a NaN value row would still be NaN
        self.kv_cache = torch.zeros(2, len(self.attn_layers), num_blocks, self.block_size, layer.num_kv_heads,
                                    layer.head_dim, dtype=self.kv_dtype, device=self.device)
        for i, attn in enumerate(self.attn_layers):
            attn.k_cache, attn.v_cache = self.kv_cache[0, i], self.kv_cache[1, i]
        self.num_blocks = num_blocks
        logger.info("KV cache: %d blocks of %d tokens (%.3f GiB), sized by %s", num_blocks, self.block_size,
                    num_blocks * self.block_bytes() / (1 << 30), why)

    def attention_jit_compiles(self) -> int:
        """Attention kernels compiled since startup (FA4's JIT; 0 for backends compiled at startup). A new
        one is logged with FA4's key the first time it is seen, so a warmup gap can be found."""
        if not self.uses_fa4:
            return 0
        from flame_llm.kernels.fa4_backend import jit_compiles, new_variants
        n = jit_compiles()
        if n > self._jit_logged:
            logger.warning("flash-attn-4 compiled %d kernel variant(s) after warmup: %s", n - self._jit_logged,
                           new_variants()[self._jit_logged:])
            self._jit_logged = n
        return n

    # ---- steps ----------------------------------------------------------------------------------
    def prepare(self, seqs: list[Sequence], num_tokens: list[int], starts: list[int] | None = None) -> StepInputs:
        return build_step_inputs(seqs, num_tokens, self.block_size, starts)

    def upload(self, x: StepInputs, prune: bool = False) -> DeviceInputs:
        return upload(self.staging, x, self.split_decodes, prune)

    def forward(self, dev: DeviceInputs, prune: bool = False) -> torch.Tensor:
        """Hidden states [T, hidden] of a forward's inputs (stores their K/V); prune: of dev.logits_rows only
        (upload(x, prune=True) built the metadata of those rows' last-layer attention)."""
        set_context(dev.meta)
        try:
            if prune:
                return self.model(dev.input_ids, dev.positions, keep_rows=dev.logits_rows)
            return self.model(dev.input_ids, dev.positions)
        finally:
            set_context(None)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [N, vocab] of N hidden-state rows."""
        return self.model.compute_logits(hidden)

    def launch(self, scheduled: SchedulerOutput, prev: StepHandle | None = None) -> StepHandle:
        """Enqueue one step; sequences whose next input the running step `prev` samples take it from there."""
        return self.launch_prepared(self.prepare_launch(scheduled, prev))

    def prepare_launch(self, scheduled: SchedulerOutput, prev: StepHandle | None = None) -> PreparedStep:
        """The step's inputs on the host (block tables and positions copied out of its sequences, so committing
        the step before it may free their blocks meanwhile) and the path it will take; nothing is enqueued."""
        seqs = scheduled.seqs
        x = self.prepare(seqs, scheduled.num_scheduled_tokens, scheduled.num_computed_tokens)
        prev_sampled = None
        if x.pending_seqs:
            assert prev is not None and prev.sampled is not None, "a pending token needs the step that samples it"
            x.pending_src = np.asarray([prev.rows[seqs[i].seq_id] for i in x.pending_seqs], dtype=np.int64)
            prev_sampled = prev.sampled
        if self.use_graphs and self.graphs is not None and self.graphs.fits(x):
            path = "decode graph"
        elif self.mixed is not None and self.mixed.fits(x):
            path = "mixed graph"
        else:
            path = "eager"
        return PreparedStep(scheduled, x, prev_sampled, path)

    def launch_prepared(self, p: PreparedStep) -> StepHandle:
        """Enqueue a prepared step (before any later step is scheduled: its blocks are as prepare_launch saw),
        between the timing events of the step timeline (CUDA)."""
        events = self.timeline.begin()
        handle = self._enqueue(p)
        self.timeline.end(events, p.path, len(p.scheduled.seqs))
        handle.events = events
        return handle

    @torch.inference_mode()
    def _enqueue(self, p: PreparedStep) -> StepHandle:
        seqs, x, prev_sampled = p.scheduled.seqs, p.x, p.prev_sampled
        handle = StepHandle(p.scheduled, x.sample_idx)
        if p.path == "decode graph":
            logits = self.graphs.replay(x, self.staging, prev_sampled)  # every row's
            if len(x.sample_idx) < len(seqs):
                logits = logits[self.staging.put({"idx": np.asarray(x.sample_idx, dtype=np.int64)})["idx"]]
        elif p.path == "mixed graph":
            logits = self.mixed.replay(x, self.staging, prev_sampled)  # the sampling rows'
            if not x.sample_idx:
                return handle
        else:
            dev = self.upload(x, self.prune)
            if prev_sampled is not None:
                dev.input_ids[dev.pending_rows] = prev_sampled[dev.pending_src]
            hidden = self.forward(dev, self.prune)  # pruned: the logits_rows' alone
            if self.uses_fa4:
                self.attention_jit_compiles()  # logs a variant the warmup missed
            if not x.sample_idx:
                return handle
            logits = self.compute_logits(hidden if self.prune else hidden[dev.logits_rows])
        if not x.sample_idx:
            return handle
        params = [seqs[i].sampling_params for i in x.sample_idx]
        # the output index each row samples: its sequence's length after this step, minus the prompt
        positions = [int(x.seq_lens[i]) - seqs[i].num_prompt_tokens for i in x.sample_idx]
        sampled, failed = sample_rows(logits, params, positions, self.vocab_size, self.device)
        handle.set_sampled(sampled, {seqs[i].seq_id: r for r, i in enumerate(x.sample_idx)})
        handle.failed = {x.sample_idx[r]: msg for r, msg in failed.items()}
        return handle

    def run(self, scheduled: SchedulerOutput) -> ModelRunnerOutput:
        """One step, waited for."""
        return self.launch(scheduled).output()


@dataclass(slots=True)
class PreparedStep:
    """A step's inputs built on the host, not yet enqueued (ModelRunner.prepare_launch)."""
    scheduled: SchedulerOutput
    x: StepInputs
    prev_sampled: torch.Tensor | None  # the running step's sampled tokens, where this step's pending rows read
    path: str  # "decode graph" | "mixed graph" | "eager"


@dataclass(slots=True)
class StepHandle:
    """A launched step. `sampled` stays on the device (the next step may read it); `output()` waits."""
    scheduled: SchedulerOutput
    sample_idx: list[int]
    sampled: torch.Tensor | None = None  # int64 [S] on the device
    rows: dict[int, int] | None = None  # seq_id -> row of sampled
    host: torch.Tensor | None = None
    event: torch.cuda.Event | None = None
    failed: dict[int, str] = field(default_factory=dict)  # index in seqs -> why its sampling failed (its own)
    events: StepEvents | None = None  # the step timeline's timing events (CUDA)
    sync_s: float = 0.0  # host seconds output() waited for the step's tokens

    def set_sampled(self, sampled: torch.Tensor, rows: dict[int, int]) -> None:
        self.sampled, self.rows = sampled, rows
        if sampled.device.type == "cuda":
            self.host = torch.empty(sampled.shape, dtype=sampled.dtype, pin_memory=True)
            self.host.copy_(sampled, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host = sampled

    def output(self) -> ModelRunnerOutput:
        """The sampled token per sequence (None where a prefill chunk stops short or its sampling failed)."""
        out: list[int | None] = [None] * len(self.scheduled.seqs)
        if self.host is not None:
            if self.event is not None:
                t0 = time.perf_counter()
                self.event.synchronize()
                self.sync_s = time.perf_counter() - t0
            for i, tok in zip(self.sample_idx, self.host.tolist()):
                out[i] = tok
            for i in self.failed:  # its greedy placeholder is not its token
                out[i] = None
        return ModelRunnerOutput(self.scheduled, out, self.failed)
