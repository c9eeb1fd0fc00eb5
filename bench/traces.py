"""Burst traces: documents of generated token ids, each followed by questions, shuffled with a seed.

no-reuse: num_docs documents x 1 question; reuse: num_docs x questions. A request's prompt is its
document's tokens followed by its question's tokens, so every question of a document shares the whole
document as its prefix and nothing else is shared. Token ids are drawn uniformly from the model's
vocabulary [token_low, vocab_size) by a seeded generator (dummy-weight models have no tokenizer).

Warmup rounds apply a per-round shift within the vocabulary to every token: lengths and prefix relations
stay, but no warmup prefix equals a measured one, so the measured prefixes are unseen by the engines.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
import xxhash

from flame_llm.protocol.types import prompt_digest  # the one digest: client, servers and bench agree
from flame_llm.validate import check_choice, check_int

TRACE_NAMES = ("no-reuse", "reuse")
# the seed's engine limits, the same for every system of a comparison (flame, engine, vLLM)
SEED_LIMITS = {"max_model_len": 32768, "max_num_seqs": 64, "max_num_batched_tokens": 8192}


@dataclass(slots=True)
class TraceConfig:
    name: str = "reuse"  # "no-reuse": 1 question per document; "reuse": `questions` per document
    num_docs: int = 64
    questions: int = 4  # per document in the reuse trace
    doc_tokens: int = 8192
    question_tokens: int = 64
    output_tokens: int = 16
    seed: int = 0
    vocab_size: int = 128256
    token_low: int = 0  # ids are drawn from [token_low, vocab_size)

    def __post_init__(self) -> None:
        check_choice("name", self.name, TRACE_NAMES, where="trace field")
        for name in ("num_docs", "questions", "doc_tokens", "question_tokens", "output_tokens"):
            check_int(name, getattr(self, name), 1, where="trace field")
        check_int("seed", self.seed, 0, where="trace field")
        check_int("token_low", self.token_low, 0, where="trace field")
        check_int("vocab_size", self.vocab_size, self.token_low + 4,
                  limit=f"an integer >= token_low + 4 ({self.token_low + 4})", where="trace field")

    @property
    def questions_per_doc(self) -> int:
        return 1 if self.name == "no-reuse" else self.questions

    @property
    def num_requests(self) -> int:
        return self.num_docs * self.questions_per_doc


@dataclass(slots=True)
class TraceRequest:
    rid: str
    doc: int
    question: int
    token_ids: np.ndarray  # uint32
    prompt_digest: str  # prompt_digest(token_ids)


@dataclass(slots=True)
class Trace:
    config: TraceConfig
    requests: list[TraceRequest]  # in release order (shuffled)
    shift: int = 0  # 0 for the measured trace; warmup round k uses a nonzero shift

    def describe(self) -> dict:
        """What the report records about the trace: its config, lengths, prefix relations and a digest."""
        s = self.config
        digest = xxhash.xxh64()
        for r in self.requests:
            digest.update(r.prompt_digest.encode())
        return {**asdict(s), "questions_per_doc": s.questions_per_doc, "num_requests": s.num_requests,
                "prompt_tokens": s.doc_tokens + s.question_tokens, "shared_prefix_tokens": s.doc_tokens,
                "prefix_relation": "the questions of one document share exactly its doc_tokens-token prefix; "
                                   "different documents share nothing",
                "token_source": f"generated: uniform over [{s.token_low}, {s.vocab_size}) with numpy "
                                f"default_rng(seed={s.seed}); no tokenizer, no natural text",
                "order": "shuffled with the same seed", "shift": self.shift, "trace_digest": digest.hexdigest()}


def make_trace(cfg: TraceConfig, shift: int = 0, id_prefix: str = "") -> Trace:
    """The seeded trace; shift != 0 maps every id t to low + (t - low + shift) mod (vocab - low)."""
    rng = np.random.default_rng(cfg.seed)
    lo, hi, q = cfg.token_low, cfg.vocab_size, cfg.questions_per_doc
    docs = rng.integers(lo, hi, size=(cfg.num_docs, cfg.doc_tokens), dtype=np.int64)
    questions = rng.integers(lo, hi, size=(cfg.num_docs, q, cfg.question_tokens), dtype=np.int64)
    order = rng.permutation(cfg.num_docs * q)
    if shift:
        docs = lo + (docs - lo + shift) % (hi - lo)
        questions = lo + (questions - lo + shift) % (hi - lo)
    requests = []
    for k in order.tolist():
        d, j = divmod(k, q)
        ids = np.concatenate([docs[d], questions[d, j]]).astype(np.uint32)
        requests.append(TraceRequest(f"{id_prefix}d{d}q{j}", d, j, ids, prompt_digest(ids)))
    return Trace(cfg, requests, shift)


def warmup_traces(cfg: TraceConfig, rounds: int = 2) -> list[Trace]:
    """`rounds` shifted copies of the trace, each with its own nonzero shift (distinct modulo the range)."""
    check_int("rounds", rounds, 0, where="warmup")
    span = cfg.vocab_size - cfg.token_low
    step = max(1, span // (rounds + 1))
    return [make_trace(cfg, shift=k * step, id_prefix=f"w{k}-") for k in range(1, rounds + 1)]
