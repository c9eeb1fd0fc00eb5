"""The draft model: its own weights and KV pool, addressed by the target's block tables.

The draft pool has as many blocks as the target's and block i of one mirrors block i of the other,
so the draft needs no block manager: a sequence's block table (and every prefix-cache hit) is valid
for both. The engine splits one memory budget between the two pools (ModelRunner's
extra_block_bytes)."""
from __future__ import annotations

import logging

import torch

from flame_llm.config import Config
from flame_llm.engine.model_runner import ModelRunner
from flame_llm.engine.sequence import Sequence

logger = logging.getLogger(__name__)
MAX_SPECULATIVE_TOKENS = 16


def check_speculative_config(config: Config) -> None:
    """Raise ValueError naming the field and its limit."""
    k = config.speculative_config.num_speculative_tokens
    if config.speculative_config.speculative_model is None:
        if k:
            raise ValueError(f"config field 'num_speculative_tokens' is {k} but 'speculative_model' is not set")
        return
    if not 1 <= k <= MAX_SPECULATIVE_TOKENS:
        raise ValueError(f"config field 'num_speculative_tokens' must be in [1, {MAX_SPECULATIVE_TOKENS}] "
                         f"when 'speculative_model' is set; got {k!r}")
    if config.speculative_config.speculative_max_batch_size < 0:
        raise ValueError("config field 'speculative_max_batch_size' must be >= 0 (0: never speculate); "
                         f"got {config.speculative_config.speculative_max_batch_size!r}")


def make_draft_config(config: Config) -> Config:
    """The target's config with the draft's model; its KV pool is sized later (allocate)."""
    check_speculative_config(config)
    sp = config.speculative_config
    kwargs = config.to_kwargs() | dict(num_kvcache_blocks=1, enforce_eager=True, speculative_model=None,
                                       num_speculative_tokens=0, model_revision="", eos_token_ids=())
    del kwargs["model"]
    draft = Config.from_kwargs(sp.speculative_model, **kwargs)
    target_vocab = config.model_config.hf_config.vocab_size
    draft_vocab = draft.model_config.hf_config.vocab_size
    if draft_vocab != target_vocab:
        raise ValueError(f"speculative_model {sp.speculative_model!r} has vocab_size {draft_vocab}; "
                         f"it must equal the target's vocab_size {target_vocab}")
    if draft.model_config.max_model_len < config.model_config.max_model_len:
        raise ValueError(f"speculative_model {sp.speculative_model!r} supports {draft.model_config.max_model_len} "
                         f"positions; max_model_len is {config.model_config.max_model_len}")
    return draft


class DraftRunner:
    def __init__(self, config: Config) -> None:
        self.config = make_draft_config(config)
        self.runner = ModelRunner(self.config)  # weights now, a one-block placeholder pool until allocate
        self.model = self.runner.model
        self.block_size = self.config.cache_config.block_size
        self.max_num_batched_tokens = self.config.scheduler_config.max_num_batched_tokens

    def block_bytes(self) -> int:
        return self.runner.block_bytes()

    def allocate(self, num_blocks: int) -> None:
        """A pool of num_blocks blocks (the target's count), replacing the placeholder."""
        self.runner.allocate_kv_cache(num_blocks)

    @torch.inference_mode()
    def extend(self, seqs: list[Sequence], starts: list[int], ends: list[int]) -> None:
        """Write the draft KV of positions [start, end) of each sequence (no logits), in passes of at most
        max_num_batched_tokens tokens."""
        todo = [(s, a, e) for s, a, e in zip(seqs, starts, ends) if e > a]
        while todo:
            budget = self.max_num_batched_tokens
            batch, rest = [], []
            for seq, start, end in todo:
                n = min(end - start, budget)
                if n > 0:
                    batch.append((seq, start, start + n))
                    budget -= n
                if start + n < end:
                    rest.append((seq, start + n, end))
            self._forward(batch)
            todo = rest

    def _forward(self, batch: list[tuple[Sequence, int, int]]) -> None:
        seqs = [s for s, _, _ in batch]
        assert all(len(s.block_table) * self.block_size >= e for s, _, e in batch), \
            "the block table covers every position the draft writes"
        x = self.runner.prepare(seqs, [e - a for _, a, e in batch], starts=[a for _, a, _ in batch])
        self.runner.forward(self.runner.upload(x))
