"""Runs the model for one scheduled step: builds inputs and attention metadata, owns the KV cache,
samples, and replays CUDA graphs for decode steps."""
from __future__ import annotations

import logging

import numpy as np
import torch

from flame_llm.config import Config
from flame_llm.engine.context import AttentionMetadata, set_context
from flame_llm.engine.sequence import Sequence
from flame_llm.layers.attention import Attention
from flame_llm.layers.layers import RMSNorm, RotaryEmbedding, SiluAndMul
from flame_llm.layers.sampler import make_sampling_batch, sample
from flame_llm.models.llama import MODELS
from flame_llm.models.loader import init_dummy, load_model

logger = logging.getLogger(__name__)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"config field 'device' is {name!r} but CUDA is not available")
    return device


def resolve_backend(name: str, device: torch.device, block_size: int) -> str:
    if name != "auto":
        if name == "flash_attn" and block_size % 256:
            raise ValueError(f"attention_backend 'flash_attn' needs block_size % 256 == 0; got {block_size}")
        return name
    if device.type != "cuda":
        return "torch"
    from flame_llm.kernels.flash_backend import FLASH_ATTN_AVAILABLE
    return "flash_attn" if FLASH_ATTN_AVAILABLE and block_size % 256 == 0 else "triton"


def append_slots(slots: list[int], block_table: list[int], start: int, end: int, block_size: int) -> None:
    """Cache slots of positions [start, end) of one sequence, a block-sized range at a time."""
    for b in range(start // block_size, (end - 1) // block_size + 1):
        base = block_table[b] * block_size - b * block_size
        slots.extend(range(base + max(start, b * block_size), base + min(end, (b + 1) * block_size)))


class ModelRunner:
    def __init__(self, config: Config, extra_block_bytes: int = 0) -> None:
        """extra_block_bytes: bytes per block another KV pool indexed by the same block ids needs (the
        speculative draft's); the memory budget is split so that both fit."""
        self.config = config
        self.extra_block_bytes = extra_block_bytes
        hf = config.hf_config
        self.device = resolve_device(config.device)
        dtype = config.dtype if config.dtype != "auto" else ("bfloat16" if self.device.type == "cuda" else "float32")
        self.dtype = _DTYPES[dtype]
        self.block_size = config.block_size
        self.vocab_size = hf.vocab_size
        prev_dtype = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device):
                self.model = MODELS[hf.architectures[0]](hf)
        finally:
            torch.set_default_dtype(prev_dtype)
        if config.load_format == "dummy":
            init_dummy(self.model, config.seed)
        else:
            load_model(self.model, config.model)
        self.model.eval()
        self.attn_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        self.backend = resolve_backend(config.attention_backend, self.device, config.block_size)
        for layer in self.attn_layers:
            layer.set_backend(self.backend, config.fresh_prefill_backend)
        if self.device.type == "cuda" and config.fused_ops:
            for m in self.model.modules():
                if isinstance(m, (RMSNorm, RotaryEmbedding, SiluAndMul)):
                    m.fused = True
        torch.manual_seed(config.seed)
        self.num_blocks = self.allocate_kv_cache()
        self.max_blocks_per_seq = (config.max_model_len + self.block_size - 1) // self.block_size
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.use_graphs = (self.device.type == "cuda" and not config.enforce_eager and self.backend != "torch")
        if self.use_graphs:
            self.capture_cudagraphs()

    # ---- KV cache -------------------------------------------------------------------------------
    def block_bytes(self) -> int:
        layer = self.attn_layers[0]
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * len(self.attn_layers) * self.block_size * layer.num_kv_heads * layer.head_dim * itemsize

    def allocate_kv_cache(self) -> int:
        cfg = self.config
        if cfg.num_kvcache_blocks > 0:
            num_blocks = cfg.num_kvcache_blocks
        elif self.device.type == "cuda":
            num_blocks = self.profile_num_blocks()
        else:
            num_blocks = int(cfg.cpu_kvcache_gib * (1 << 30)) // (self.block_bytes() + self.extra_block_bytes)
        if num_blocks < 1:
            raise ValueError("no memory left for the KV cache; lower max_num_batched_tokens or raise "
                             "gpu_memory_utilization, or set num_kvcache_blocks")
        layer = self.attn_layers[0]
        self.kv_cache = torch.empty(2, len(self.attn_layers), num_blocks, self.block_size, layer.num_kv_heads,
                                    layer.head_dim, dtype=self.dtype, device=self.device)
        for i, attn in enumerate(self.attn_layers):
            attn.k_cache, attn.v_cache = self.kv_cache[0, i], self.kv_cache[1, i]
        logger.info("KV cache: %d blocks of %d tokens (%.2f GiB)", num_blocks, self.block_size,
                    num_blocks * self.block_bytes() / (1 << 30))
        return num_blocks

    @torch.inference_mode()
    def profile_num_blocks(self) -> int:
        """Peak activation memory of a full-budget prefill, then the rest of the budget for KV."""
        cfg = self.config
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        n = min(cfg.max_num_batched_tokens, cfg.max_model_len * cfg.max_num_seqs)
        m = cfg.max_model_len
        lens = [m] * (n // m) + ([n % m] if n % m else [])
        cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()), dtype=torch.int32, device=self.device)
        positions = torch.cat([torch.arange(m, device=self.device) for m in lens])
        set_context(AttentionMetadata(cu, cu[1:] - cu[:-1], torch.zeros(len(lens), 1, dtype=torch.int32,
                    device=self.device), torch.full((n,), -1, dtype=torch.int64, device=self.device),
                    max(lens), max(lens), fresh_only=True))
        hidden = self.model(torch.zeros(n, dtype=torch.int64, device=self.device), positions)
        self.model.compute_logits(hidden[cu[1:] - 1])
        set_context(None)
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        used = total - free
        peak, current = torch.cuda.max_memory_allocated(), torch.cuda.memory_allocated()
        budget = total * cfg.gpu_memory_utilization - used - (peak - current)
        return int(budget) // (self.block_bytes() + self.extra_block_bytes)

    # ---- step inputs ----------------------------------------------------------------------------
    def prepare(self, seqs: list[Sequence], num_tokens: list[int]) -> tuple:
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        cu_q = [0]
        seq_lens: list[int] = []
        logits_rows: list[int] = []
        sample_idx: list[int] = []
        fresh_only = True
        for i, (seq, n) in enumerate(zip(seqs, num_tokens)):
            start = seq.num_computed_tokens
            end = start + n
            fresh_only &= start == 0
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            append_slots(slot_mapping, seq.block_table, start, end, bs)
            cu_q.append(cu_q[-1] + n)
            seq_lens.append(end)
            if end == seq.num_tokens:
                logits_rows.append(cu_q[-1] - 1)
                sample_idx.append(i)
        max_blocks = max(len(s.block_table) for s in seqs)
        block_tables = [s.block_table + [0] * (max_blocks - len(s.block_table)) for s in seqs]
        return input_ids, positions, slot_mapping, cu_q, seq_lens, block_tables, logits_rows, sample_idx, fresh_only

    def _tensor(self, data, dtype) -> torch.Tensor:
        t = torch.tensor(data, dtype=dtype, pin_memory=self.device.type == "cuda")
        return t.to(self.device, non_blocking=True)

    @torch.inference_mode()
    def run(self, seqs: list[Sequence], num_tokens: list[int]) -> list[int | None]:
        """One step; returns the sampled token per sequence (None where a prefill chunk stops short)."""
        (input_ids, positions, slots, cu_q, seq_lens, block_tables, logits_rows, sample_idx,
         fresh_only) = self.prepare(seqs, num_tokens)
        out: list[int | None] = [None] * len(seqs)
        is_decode = len(input_ids) == len(seqs)
        if is_decode and self.use_graphs and len(seqs) <= self.max_graph_bs:
            logits = self.replay_graph(input_ids, positions, slots, seq_lens, block_tables)  # every row's
            if len(sample_idx) < len(seqs):
                logits = logits[self._tensor(sample_idx, torch.int64)]
        else:
            meta = AttentionMetadata(self._tensor(cu_q, torch.int32), self._tensor(seq_lens, torch.int32),
                                     self._tensor(block_tables, torch.int32), self._tensor(slots, torch.int64),
                                     max(n for n in num_tokens), max(seq_lens), is_decode=is_decode,
                                     fresh_only=fresh_only)
            set_context(meta)
            hidden = self.model(self._tensor(input_ids, torch.int64), self._tensor(positions, torch.int64))
            set_context(None)
            if not sample_idx:
                return out
            logits = self.model.compute_logits(hidden[self._tensor(logits_rows, torch.int64)])
        if not sample_idx:
            return out
        params = [seqs[i].sampling_params for i in sample_idx]
        batch = make_sampling_batch(params, [seqs[i].num_completion_tokens for i in sample_idx],
                                    self.vocab_size, self.device)
        for i, tok in zip(sample_idx, sample(logits, batch).tolist()):
            out[i] = tok
        return out

    # ---- CUDA graphs for decode -----------------------------------------------------------------
    @torch.inference_mode()
    def capture_cudagraphs(self) -> None:
        """One graph per bucketed batch size, LM head included. The step inputs live in two packed
        buffers (int64: ids, positions, slots; int32: seq lens, block tables) filled from numpy
        host mirrors with two copies per step."""
        cfg = self.config
        max_bs = min(cfg.max_num_seqs, 512)
        self.graph_bs = sorted({b for b in [1, 2, 4, 8] + list(range(16, max_bs + 1, 16)) if b <= max_bs} | {max_bs})
        self.max_graph_bs = max_bs
        mb = self.max_blocks_per_seq
        dev = self.device
        self.g_i64 = torch.zeros(3 * max_bs, dtype=torch.int64, device=dev)
        self.g_i32 = torch.zeros(max_bs * (1 + mb), dtype=torch.int32, device=dev)
        self.h_i64 = np.zeros((3, max_bs), dtype=np.int64)  # host mirrors, copied with two H2D copies
        self.h_i32 = np.zeros(max_bs * (1 + mb), dtype=np.int32)
        g_ids, g_pos, g_slots = self.g_i64.view(3, max_bs)
        g_seq_lens = self.g_i32[:max_bs]
        g_tables = self.g_i32[max_bs:].view(max_bs, mb)
        # kept on self: a graph holds raw pointers, so every tensor it reads must outlive the capture
        self.g_cu_q = g_cu_q = torch.arange(max_bs + 1, dtype=torch.int32, device=dev)
        self.graph_out: dict[int, torch.Tensor] = {}
        pool = None
        for b in reversed(self.graph_bs):
            meta = AttentionMetadata(g_cu_q[: b + 1], g_seq_lens[:b], g_tables[:b], g_slots[:b], 1,
                                     cfg.max_model_len, is_decode=True)
            set_context(meta)
            self.g_i64.view(3, max_bs)[2].fill_(-1)
            self.model.compute_logits(self.model(g_ids[:b], g_pos[:b]))  # warm up (Triton compile)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool):
                self.graph_out[b] = self.model.compute_logits(self.model(g_ids[:b], g_pos[:b]))
            pool = graph.pool()
            self.graphs[b] = graph
            set_context(None)
        torch.cuda.synchronize()

    def replay_graph(self, input_ids, positions, slots, seq_lens, block_tables) -> torch.Tensor:
        n = len(input_ids)
        b = next(x for x in self.graph_bs if x >= n)
        max_bs, mb = self.max_graph_bs, self.max_blocks_per_seq
        h64 = self.h_i64
        h64[0, :n] = input_ids
        h64[1, :n] = positions
        h64[2, :n] = slots
        h64[2, n:b] = -1  # padded rows store nothing
        h32 = self.h_i32
        h32[:n] = seq_lens
        h32[n:b] = 0
        width = len(block_tables[0])
        h32[max_bs:].reshape(max_bs, mb)[:n, :width] = block_tables
        self.g_i64.copy_(torch.from_numpy(h64).view(-1))
        self.g_i32[: max_bs + b * mb].copy_(torch.from_numpy(h32[: max_bs + b * mb]))
        self.graphs[b].replay()
        return self.graph_out[b][:n]
