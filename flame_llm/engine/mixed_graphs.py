"""CUDA graphs for small steps that carry prefill tokens (Config.cuda_graph_mixed_tokens).

Eager, a step costs ~16 ms of kernel launches for a 32-layer model on the H200 whatever its size (bench/RESULTS.md,
issue 3), and every stream decoding in that step waits for it: under a sustained load of questions over cached
documents, each question's short prefill made flame's TTFT and inter-token tail 2-3x vLLM's, which replays graphs
for such steps (issue 18). Here a step of n tokens is padded to the smallest token bucket T >= n; the graph of T
holds min(T, max_num_seqs) query segments (each segment has a token, so no step of T tokens has more). Attention
runs our Triton paged kernel whatever the backend, with a grid fixed at capture (kernels/triton_attention.py:
mixed_launch): padded segments have no queries, so their programs return at once; padded rows store nothing (slot
-1), attend to nothing and are never sampled. The LM head runs on the sampling rows only (padded with row 0).

capture=False (CPU tests, where no graph exists) runs the same padded forward eagerly, so the padding and the
fixed launch are tested token for token against unpadded steps."""
from __future__ import annotations

import numpy as np
import torch

from flame_llm.config import MIXED_GRAPH_TOKENS, Config
from flame_llm.engine.cuda_graphs import capture_graph
from flame_llm.engine.step_inputs import Staging, StepInputs
from flame_llm.kernels.metadata import AttentionMetadata, set_context

SMALL_BUCKETS = (16, 32, 64, 128, 256, 512)
# past 512 tokens a step's GEMMs are compute-bound: padded to the next power of two it could run up to twice its
# length, so the buckets there are this far apart (a 1,100-token step runs as 1,280, not 2,048)
LARGE_BUCKET_STEP = 256


def token_buckets(max_tokens: int) -> list[int]:
    """The graphs' token counts below max_tokens: powers of two from 16 to 512, then every LARGE_BUCKET_STEP tokens;
    and max_tokens itself."""
    assert max_tokens >= 1
    large = range(512 + LARGE_BUCKET_STEP, max_tokens, LARGE_BUCKET_STEP)
    return sorted({t for t in SMALL_BUCKETS if t < max_tokens} | set(large) | {max_tokens})


def build_mixed_graphs(model: torch.nn.Module, config: Config, backend: str, use_graphs: bool,
                       max_blocks_per_seq: int, layer: torch.nn.Module, device: torch.device,
                       pool=None) -> MixedGraphs | None:
    """The runner's mixed-step graphs (captured in `pool` when use_graphs), or None where Config leaves them off:
    cuda_graph_mixed_tokens 0, the torch backend (no Triton kernel), enforce_eager; None means MIXED_GRAPH_TOKENS
    where decode steps replay graphs."""
    rc, sc = config.runner_config, config.scheduler_config
    tokens = rc.cuda_graph_mixed_tokens
    if tokens is None:
        tokens = MIXED_GRAPH_TOKENS if use_graphs else 0
    if not tokens or backend == "torch" or rc.enforce_eager:
        return None
    graphs = MixedGraphs(model, min(tokens, sc.max_num_batched_tokens), sc.max_num_seqs, max_blocks_per_seq,
                         config.model_config.max_model_len, layer.num_heads // layer.num_kv_heads, device,
                         capture=use_graphs)
    graphs.capture(pool)
    return graphs


class MixedGraphs:
    def __init__(self, model: torch.nn.Module, max_tokens: int, max_num_seqs: int, max_blocks_per_seq: int,
                 max_model_len: int, group: int, device: torch.device, capture: bool = True) -> None:
        from flame_llm.kernels.triton_attention import mixed_launch  # imports Triton: only where graphs are made

        self.model = model
        self.max_tokens = max_tokens
        self.buckets = token_buckets(max_tokens)
        self.seats = {t: min(t, max_num_seqs) for t in self.buckets}
        self.launch = {t: mixed_launch(t, group) for t in self.buckets}
        self.width = max_blocks_per_seq
        self.max_model_len = max_model_len
        self.use_graphs = capture
        tmax, bmax = max_tokens, self.seats[max_tokens]
        # static inputs, kept on self (a graph holds raw pointers): int64 ids | positions | slots, sampling rows;
        # int32 cu_seqlens_q | seq_lens | block tables
        self.g_tok = torch.zeros(3, tmax, dtype=torch.int64, device=device)
        self.g_rows = torch.zeros(bmax, dtype=torch.int64, device=device)
        self.g_cu = torch.zeros(bmax + 1, dtype=torch.int32, device=device)
        self.g_lens = torch.zeros(bmax, dtype=torch.int32, device=device)
        self.g_tables = torch.zeros(bmax, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.out: dict[int, torch.Tensor] = {}
        self.replays = 0

    def fits(self, x: StepInputs) -> bool:
        return not x.is_decode and len(x.input_ids) <= self.max_tokens

    def _meta(self, t: int) -> AttentionMetadata:
        b = self.seats[t]
        return AttentionMetadata(self.g_cu[: b + 1], self.g_lens[:b], self.g_tables[:b], self.g_tok[2, :t], t,
                                 self.max_model_len, fixed_launch=self.launch[t])

    def _logits(self, t: int) -> torch.Tensor:
        hidden = self.model(self.g_tok[0, :t], self.g_tok[1, :t])
        return self.model.compute_logits(hidden[self.g_rows[: self.seats[t]]])

    @torch.inference_mode()
    def capture(self, pool=None):
        """Capture every bucket's graph (largest first, sharing `pool`, e.g. the decode graphs'); returns the pool."""
        if not self.use_graphs:
            return pool
        for t in reversed(self.buckets):
            self.g_cu.zero_()  # every segment empty: the capture run stores and attends nothing
            self.g_lens.zero_()
            self.g_tok[2].fill_(-1)
            set_context(self._meta(t))
            try:
                self.graphs[t], self.out[t] = capture_graph(self._logits, t, pool=pool)
            finally:
                set_context(None)
            pool = self.graphs[t].pool()
        torch.cuda.synchronize()
        return pool

    def replay(self, x: StepInputs, staging: Staging, prev_sampled: torch.Tensor | None) -> torch.Tensor:
        """Logits [S, V] of the step's sampling rows (x.logits_rows, in order)."""
        n, s, b_real = len(x.input_ids), len(x.logits_rows), len(x.seq_lens)
        t = next(k for k in self.buckets if k >= n)
        b = self.seats[t]
        assert b_real <= b and s <= b
        tok = np.zeros((3, t), dtype=np.int64)
        tok[0, :n], tok[1, :n], tok[2, :n] = x.input_ids, x.positions, x.slot_mapping
        tok[2, n:] = -1  # padded rows store nothing
        rows = np.zeros(b, dtype=np.int64)
        rows[:s] = x.logits_rows
        i32 = np.zeros(2 * b + 1 + b * self.width, dtype=np.int32)
        i32[: b_real + 1] = x.cu_seqlens_q
        i32[b_real + 1: b + 1] = n  # padded segments are empty
        i32[b + 1: b + 1 + b_real] = x.seq_lens
        i32[2 * b + 1:].reshape(b, self.width)[:b_real, : x.block_tables.shape[1]] = x.block_tables
        arrays = {"tok": tok, "rows": rows, "i32": i32, "prows": x.pending_rows, "src": x.pending_src}
        h = staging.put(arrays)
        self.g_tok[:, :t].copy_(h["tok"])
        self.g_rows[:b].copy_(h["rows"])
        self.g_cu[: b + 1].copy_(h["i32"][: b + 1])
        self.g_lens[:b].copy_(h["i32"][b + 1: 2 * b + 1])
        self.g_tables[:b].copy_(h["i32"][2 * b + 1:].view(b, self.width))
        if len(x.pending_rows):
            self.g_tok[0][h["prows"]] = prev_sampled[h["src"]]
        self.replays += 1
        if self.use_graphs:
            self.graphs[t].replay()
            return self.out[t][:s]
        set_context(self._meta(t))
        try:
            return self._logits(t)[:s]
        finally:
            set_context(None)
