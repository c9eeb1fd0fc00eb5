"""Device side of one speculative step for B sequences, each with n tokens of which the target has
computed n-1 and the draft at least n-2:

1. draft, first forward: a 2-token segment (t[n-2], t[n-1]) per sequence. It catches the draft's KV up
   by the token it could not have seen (the last proposal of a fully accepted step) and proposes x1;
2. draft, K-1 one-token forwards proposing x2..xK;
3. target, one (K+1)-token segment (t[n-1], x1..xK) per sequence: logits at all K+1 positions;
4. acceptance (rejection.py), one host sync for the whole step.

Every forward reads fixed-shape static buffers, so each is a CUDA-graph replay (per batch-size
bucket); positions, slots and the next inputs are derived on the device between replays. Without
graphs (CPU, enforce_eager) the same buffers feed eager forwards, unpadded."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from flame_llm.engine.cuda_graphs import capture_graph
from flame_llm.engine.model_runner import ModelRunner
from flame_llm.engine.sequence import Sequence
from flame_llm.engine.speculative.draft_runner import DraftRunner
from flame_llm.engine.speculative.profiler import StepProfiler
from flame_llm.engine.speculative.rejection import (
    ACCEPT_STREAM,
    DRAFT_STREAM,
    FINAL_STREAM,
    fill_random,
    greedy_accept,
    rejection_sample,
    stream_key,
    to_probs,
)
from flame_llm.engine.step_inputs import DeviceInputs
from flame_llm.kernels.metadata import AttentionMetadata

GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


@dataclass(slots=True)
class StepBuffers:
    """Inputs of one forward kind: q_len tokens per sequence, max_bs sequences."""
    q_len: int
    ids: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    seq_lens: torch.Tensor
    cu_q: torch.Tensor


@dataclass(slots=True)
class VerifiedTokens:
    """What one speculative step verified, per sequence: the draft's proposals x1..xK, how many of them the
    target accepted (a), and the target's own next token; the sequence's new tokens are x1..xa, then next."""
    num_accepted: list[int]
    draft_token_ids: list[list[int]]
    next_token_ids: list[int]

    def new_token_ids(self, i: int) -> list[int]:
        return self.draft_token_ids[i][: self.num_accepted[i]] + [self.next_token_ids[i]]


@dataclass(slots=True)
class SampledRows:
    """The rows of a step that sample (temperature > 0), built on the host."""
    index: torch.Tensor  # int64 [S]: rows in the batch
    temperatures: torch.Tensor  # float32 [S]
    top_ks: torch.Tensor | None
    top_ps: torch.Tensor | None
    seeds: list[int | None]
    positions: list[int]  # output position of each row's first proposal

    def keys(self, stream: int, offset: int = 0) -> list[int | None]:
        return [None if s is None else stream_key(s, p + offset, stream) for s, p in zip(self.seeds, self.positions)]


class SpecRunner:
    def __init__(self, target: ModelRunner, draft: DraftRunner, num_speculative_tokens: int,
                 max_batch_size: int, use_graphs: bool) -> None:
        self.target, self.draft = target, draft
        self.k = k = num_speculative_tokens
        self.block_size = target.block_size
        self.max_model_len = target.config.model_config.max_model_len
        self.max_bs = max(1, max_batch_size)
        self.device = dev = target.device
        self.width = target.max_blocks_per_seq
        self.block_tables = torch.zeros(self.max_bs, self.width, dtype=torch.int32, device=dev)
        self.offsets = torch.arange(-1, k + 1, device=dev)  # positions n-2 .. n+K-1, relative to n-1
        self.bufs = {kind: self._buffers(q_len) for kind, q_len in (("first", 2), ("draft", 1), ("verify", k + 1))}
        self.metas: dict[tuple[str, int], AttentionMetadata] = {}
        self.graphs: dict[tuple[str, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.graph_bs = sorted({b for b in GRAPH_BATCH_SIZES if b <= self.max_bs} | {self.max_bs})
        self.use_graphs = use_graphs
        self.pad_batches = use_graphs  # pad to a bucket (graphs need it; tests set it on CPU too)
        if use_graphs:
            self.capture()

    def _buffers(self, q_len: int) -> StepBuffers:
        n, dev = self.max_bs * q_len, self.device
        return StepBuffers(q_len, torch.zeros(n, dtype=torch.int64, device=dev),
                           torch.zeros(n, dtype=torch.int64, device=dev),
                           torch.full((n,), -1, dtype=torch.int64, device=dev),
                           torch.full((self.max_bs,), q_len, dtype=torch.int32, device=dev),
                           torch.arange(0, n + 1, q_len, dtype=torch.int32, device=dev))

    def _meta(self, kind: str, b: int) -> AttentionMetadata:
        meta = self.metas.get((kind, b))
        if meta is None:
            buf = self.bufs[kind]
            meta = AttentionMetadata(buf.cu_q[: b + 1], buf.seq_lens[:b], self.block_tables[:b],
                                     buf.slots[: b * buf.q_len], buf.q_len, self.max_model_len,
                                     is_decode=buf.q_len == 1)
            self.metas[kind, b] = meta
        return meta

    def _forward(self, kind: str, b: int) -> torch.Tensor:
        buf = self.bufs[kind]
        n = b * buf.q_len
        runner = self.target if kind == "verify" else self.draft.runner
        hidden = runner.forward(DeviceInputs(buf.ids[:n], buf.positions[:n], self._meta(kind, b)))
        if kind == "first":
            hidden = hidden[1::2]  # the proposal comes from the segment's last token
        return runner.compute_logits(hidden)

    def _run(self, kind: str, b: int) -> torch.Tensor:
        if not self.use_graphs:
            return self._forward(kind, b)
        graph, out = self.graphs[kind, b]
        graph.replay()
        return out

    @torch.inference_mode()
    def capture(self) -> None:
        """Graphs for every (forward kind, batch bucket), sharing one memory pool."""
        pool = torch.cuda.graph_pool_handle()
        for b in reversed(self.graph_bs):
            for kind in ("verify", "first", "draft"):
                self.graphs[kind, b] = capture_graph(self._forward, kind, b, pool=pool)
        torch.cuda.synchronize()

    @torch.inference_mode()
    def step(self, seqs: list[Sequence], sampled: SampledRows | None,
             profiler: StepProfiler | None = None) -> VerifiedTokens:
        num, k, q, bs = len(seqs), self.k, self.k + 1, self.block_size
        assert 0 < num <= self.max_bs
        b = next(x for x in self.graph_bs if x >= num) if self.pad_batches or self.use_graphs else num
        pad = [0] * self.width
        host = [[s.num_tokens - 1, s.token_ids[-2], s.token_ids[-1], *s.block_table, *pad[len(s.block_table):]]
                for s in seqs]
        host += [[k + 1, 0, 0, *pad]] * (b - num)  # padded rows: small valid positions, slots -1 below
        packed = self.target.staging.put({"p": np.asarray(host, dtype=np.int64)})["p"]
        base, tokens = packed[:, 0], packed[:, 1:3]
        self.block_tables[:b].copy_(packed[:, 3:])
        pos = base[:, None] + self.offsets  # [b, K+2]
        slots = self.block_tables[:b].gather(1, pos // bs).to(torch.int64) * bs + pos % bs
        slots[num:] = -1

        first, draft, verify = self.bufs["first"], self.bufs["draft"], self.bufs["verify"]
        vids = verify.ids[: b * q].view(b, q)  # column 0: t[n-1]; columns 1..K: the proposals
        vids[:, 0].copy_(tokens[:, 1])
        first.ids[: 2 * b].copy_(tokens.reshape(-1))
        first.positions[: 2 * b].copy_(pos[:, :2].reshape(-1))
        first.slots[: 2 * b].copy_(slots[:, :2].reshape(-1))
        first.seq_lens[:b].copy_(base + 1)
        draft_probs = None
        if sampled is not None:
            draft_probs = torch.empty(len(sampled.seeds), k, self.target.vocab_size, device=self.device)
        self._propose(self._run("first", b)[:num], 0, vids, sampled, draft_probs)
        for j in range(1, k):
            draft.ids[:b].copy_(vids[:, j])
            draft.positions[:b].copy_(pos[:, j + 1])
            draft.slots[:b].copy_(slots[:, j + 1])
            draft.seq_lens[:b].copy_(base + j + 1)
            self._propose(self._run("draft", b)[:num], j, vids, sampled, draft_probs)
        if profiler is not None:
            profiler.mark("draft")

        verify.positions[: b * q].view(b, q).copy_(pos[:, 1:])
        verify.slots[: b * q].view(b, q).copy_(slots[:, 1:])
        verify.seq_lens[:b].copy_(base + q)
        logits = self._run("verify", b).view(b, q, -1)[:num]
        if profiler is not None:
            profiler.mark("verify")

        draft_ids = vids[:num, 1:]
        num_accepted, next_ids = greedy_accept(logits.argmax(dim=-1), draft_ids)
        if sampled is not None:
            rows, s = sampled.index, len(sampled.seeds)
            p = to_probs(logits[rows].flatten(0, 1), sampled.temperatures.repeat_interleave(q),
                         None if sampled.top_ks is None else sampled.top_ks.repeat_interleave(q),
                         None if sampled.top_ps is None else sampled.top_ps.repeat_interleave(q)).view(s, q, -1)
            uniforms = fill_random(torch.empty(s, k, device=self.device), sampled.keys(ACCEPT_STREAM), "uniform")
            noise = fill_random(torch.empty(s, p.shape[-1], device=self.device), sampled.keys(FINAL_STREAM),
                                "exponential")
            acc, nxt = rejection_sample(p, draft_probs, draft_ids[rows], uniforms, noise)
            num_accepted[rows], next_ids[rows] = acc, nxt
        rows = torch.cat([num_accepted[:, None], draft_ids, next_ids[:, None]], dim=1).tolist()  # one host sync
        if profiler is not None:
            profiler.mark("sample")
        return VerifiedTokens([r[0] for r in rows], [r[1:k + 1] for r in rows], [r[k + 1] for r in rows])

    def _propose(self, logits: torch.Tensor, j: int, vids: torch.Tensor, sampled: SampledRows | None,
                 draft_probs: torch.Tensor | None) -> None:
        """Proposal x_{j+1} from the draft's logits [B, V]: argmax, or a draw from q for sampled rows."""
        x = logits.argmax(dim=-1)
        if sampled is not None:
            probs = to_probs(logits[sampled.index], sampled.temperatures, sampled.top_ks, sampled.top_ps)
            draft_probs[:, j] = probs
            noise = fill_random(torch.empty_like(probs), sampled.keys(DRAFT_STREAM, j), "exponential")
            x[sampled.index] = (probs / noise).argmax(dim=-1)
        vids[: x.shape[0], 1 + j].copy_(x)
