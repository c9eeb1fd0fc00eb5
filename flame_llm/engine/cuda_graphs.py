"""CUDA graphs for decode steps: one graph per bucketed batch size, LM head included.

The graphs read static buffers (int64: ids, positions, slots; int32: seq lens, block tables); a replay
fills them from one pinned staging upload (three small device copies) and, under asynchronous
scheduling, scatters the previous step's sampled tokens into the id rows that wait for them."""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from flame_llm.engine.step_inputs import Staging, StepInputs
from flame_llm.kernels.metadata import AttentionMetadata, set_context

BUCKETS = (1, 2, 4, 8)  # then every multiple of 16 up to max_num_seqs


def capture_graph(fn: Callable[..., torch.Tensor], *args, pool=None) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """fn(*args) run once outside a capture (Triton compiles, allocator warm-up), then captured: the graph and
    the output tensor its replays overwrite. pool: a memory pool the graph shares with others."""
    fn(*args)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn(*args)
    return graph, out


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, max_num_seqs: int, max_blocks_per_seq: int, max_model_len: int,
                 device: torch.device) -> None:
        self.model = model
        self.max_bs = max_bs = min(max_num_seqs, 512)
        self.buckets = sorted({b for b in BUCKETS + tuple(range(16, max_bs + 1, 16)) if b <= max_bs} | {max_bs})
        self.width = max_blocks_per_seq
        self.max_model_len = max_model_len
        self.g_i64 = torch.zeros(3 * max_bs, dtype=torch.int64, device=device)
        self.g_i32 = torch.zeros(max_bs * (1 + max_blocks_per_seq), dtype=torch.int32, device=device)
        # kept on self: a graph holds raw pointers, so every tensor it reads must outlive the capture
        self.g_cu_q = torch.arange(max_bs + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.out: dict[int, torch.Tensor] = {}

    @property
    def g_ids(self) -> torch.Tensor:
        return self.g_i64.view(3, self.max_bs)[0]

    @property
    def g_tables(self) -> torch.Tensor:
        return self.g_i32[self.max_bs:].view(self.max_bs, self.width)

    def fits(self, x: StepInputs) -> bool:
        return x.is_decode and len(x.seq_lens) <= self.max_bs

    @torch.inference_mode()
    def capture(self) -> None:
        g_slots = self.g_i64.view(3, self.max_bs)[2]
        pool = None
        for b in reversed(self.buckets):
            meta = AttentionMetadata(self.g_cu_q[: b + 1], self.g_i32[:b], self.g_tables[:b], g_slots[:b], 1,
                                     self.max_model_len, is_decode=True)
            set_context(meta)
            g_slots.fill_(-1)
            self.graphs[b], self.out[b] = capture_graph(self._logits, b, pool=pool)
            pool = self.graphs[b].pool()
            set_context(None)
        torch.cuda.synchronize()

    def _logits(self, b: int) -> torch.Tensor:
        g_ids, g_pos, _ = self.g_i64.view(3, self.max_bs)
        return self.model.compute_logits(self.model(g_ids[:b], g_pos[:b]))

    def replay(self, x: StepInputs, staging: Staging, prev_sampled: torch.Tensor | None) -> torch.Tensor:
        """Logits [n, V] of the decode step x (every row's)."""
        n = len(x.seq_lens)
        b = next(k for k in self.buckets if k >= n)
        h64 = np.zeros((3, b), dtype=np.int64)
        h64[0, :n], h64[1, :n], h64[2, :n] = x.input_ids, x.positions, x.slot_mapping
        h64[2, n:] = -1  # padded rows store nothing
        lens = np.zeros(b, dtype=np.int32)
        lens[:n] = x.seq_lens
        tables = np.zeros((b, self.width), dtype=np.int32)
        tables[:n, : x.block_tables.shape[1]] = x.block_tables
        arrays = {"i64": h64, "lens": lens, "tables": tables, "rows": x.pending_rows, "src": x.pending_src}
        t = staging.put(arrays)
        self.g_i64.view(3, self.max_bs)[:, :b].copy_(t["i64"])
        self.g_i32[:b].copy_(t["lens"])
        self.g_tables[:b].copy_(t["tables"])
        if len(x.pending_rows):
            self.g_ids[t["rows"]] = prev_sampled[t["src"]]
        self.graphs[b].replay()
        return self.out[b][:n]
