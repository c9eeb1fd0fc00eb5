"""Burst traces: documents of generated token ids, each followed by questions, shuffled with a seed.

no-reuse: num_docs documents x 1 question; reuse: num_docs x questions. A request's prompt is its
document's tokens followed by its question's tokens, so every question of a document shares the whole
document as its prefix and nothing else is shared. Token ids are drawn uniformly from the model's
vocabulary [token_low, vocab_size) by a seeded generator (dummy-weight models have no tokenizer).

decode (issue 39, not the seed's): num_docs prompts sharing nothing, each a document of a drawn length in
[min_doc_tokens, doc_tokens] plus its question, each answered with a drawn length in [output_tokens,
max_output_tokens] (uniform, seeded; EOS ignored): a burst whose time is mostly decode steps.

Warmup rounds apply a per-round shift within the vocabulary to every token: lengths and prefix relations
stay, but no warmup prefix equals a measured one, so the measured prefixes are unseen by the engines.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
import xxhash

from flame_llm.protocol.types import prompt_digest  # the one digest: client, servers and bench agree
from flame_llm.validate import check_choice, check_int

TRACE_NAMES = ("no-reuse", "reuse")  # the seed's traces (the default of every tool that runs traces)
DECODE_TRACE = "decode"
BURST_TRACES = (*TRACE_NAMES, DECODE_TRACE)  # what bench.burst.pairs and bench.burst.runner accept
# the seed's engine limits, the same for every system of a comparison (flame, engine, vLLM)
SEED_LIMITS = {"max_model_len": 32768, "max_num_seqs": 64, "max_num_batched_tokens": 8192}


@dataclass(slots=True)
class TraceConfig:
    name: str = "reuse"  # "no-reuse": 1 question per document; "reuse": `questions` per document; "decode"
    num_docs: int = 64
    questions: int = 4  # per document in the reuse trace
    doc_tokens: int = 8192
    question_tokens: int = 64
    output_tokens: int = 16
    seed: int = 0
    vocab_size: int = 128256
    token_low: int = 0  # ids are drawn from [token_low, vocab_size)
    min_doc_tokens: int = 0  # decode only: document lengths drawn in [min_doc_tokens, doc_tokens]
    max_output_tokens: int = 0  # decode only: answer lengths drawn in [output_tokens, max_output_tokens]

    def __post_init__(self) -> None:
        check_choice("name", self.name, BURST_TRACES, where="trace field")
        for name in ("num_docs", "questions", "doc_tokens", "question_tokens", "output_tokens"):
            check_int(name, getattr(self, name), 1, where="trace field")
        check_int("seed", self.seed, 0, where="trace field")
        check_int("token_low", self.token_low, 0, where="trace field")
        check_int("vocab_size", self.vocab_size, self.token_low + 4,
                  limit=f"an integer >= token_low + 4 ({self.token_low + 4})", where="trace field")
        if self.name == DECODE_TRACE:
            check_int("min_doc_tokens", self.min_doc_tokens, 1, self.doc_tokens,
                      limit=f"an integer in [1, doc_tokens ({self.doc_tokens})] for the decode trace",
                      where="trace field")
            check_int("max_output_tokens", self.max_output_tokens, self.output_tokens,
                      limit=f"an integer >= output_tokens ({self.output_tokens}) for the decode trace",
                      where="trace field")
        else:
            for name in ("min_doc_tokens", "max_output_tokens"):
                check_int(name, getattr(self, name), 0, 0, limit=f"0 (only the {DECODE_TRACE} trace draws lengths)",
                          where="trace field")

    @property
    def questions_per_doc(self) -> int:
        return self.questions if self.name == "reuse" else 1

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
    max_tokens: int = 0  # its answer's length (EOS ignored); every trace's requests carry it


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
            if s.name == DECODE_TRACE:  # its answers' lengths are part of what it asks (the seed's: one length)
                digest.update(r.max_tokens.to_bytes(4, "little"))
        shape = ({"prompt_tokens": s.doc_tokens + s.question_tokens, "shared_prefix_tokens": s.doc_tokens,
                  "prefix_relation": "the questions of one document share exactly its doc_tokens-token prefix; "
                                     "different documents share nothing"} if s.name != DECODE_TRACE else
                 {"prompt_tokens": _range_of([len(r.token_ids) for r in self.requests]), "shared_prefix_tokens": 0,
                  "output_tokens_drawn": _range_of([r.max_tokens for r in self.requests]),
                  "total_output_tokens": sum(r.max_tokens for r in self.requests),
                  "prefix_relation": "prompts share nothing (a document of a drawn length and its question each)"})
        return {**asdict(s), "questions_per_doc": s.questions_per_doc, "num_requests": s.num_requests, **shape,
                "token_source": f"generated: uniform over [{s.token_low}, {s.vocab_size}) with numpy "
                                f"default_rng(seed={s.seed}); no tokenizer, no natural text",
                "order": "shuffled with the same seed", "shift": self.shift, "trace_digest": digest.hexdigest()}


def _range_of(xs: list[int]) -> dict:
    return {"min": min(xs), "median": float(np.median(xs)), "max": max(xs)} if xs else {}


def make_trace(cfg: TraceConfig, shift: int = 0, id_prefix: str = "") -> Trace:
    """The seeded trace; shift != 0 maps every id t to low + (t - low + shift) mod (vocab - low)."""
    if cfg.name == DECODE_TRACE:
        return make_decode_trace(cfg, shift, id_prefix)
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
        requests.append(TraceRequest(f"{id_prefix}d{d}q{j}", d, j, ids, prompt_digest(ids), cfg.output_tokens))
    return Trace(cfg, requests, shift)


def make_decode_trace(cfg: TraceConfig, shift: int = 0, id_prefix: str = "") -> Trace:
    """The decode trace: lengths first (documents', then answers'), then each prompt's ids, then the order, all from
    one seeded generator; the shift maps ids as make_trace does (the lengths stay)."""
    rng = np.random.default_rng(cfg.seed)
    lo, hi, n = cfg.token_low, cfg.vocab_size, cfg.num_docs
    doc_lens = rng.integers(cfg.min_doc_tokens, cfg.doc_tokens + 1, size=n)
    out_lens = rng.integers(cfg.output_tokens, cfg.max_output_tokens + 1, size=n)
    prompts = [rng.integers(lo, hi, size=int(k) + cfg.question_tokens, dtype=np.int64) for k in doc_lens]
    requests = []
    for d in rng.permutation(n).tolist():
        ids = prompts[d] if not shift else lo + (prompts[d] - lo + shift) % (hi - lo)
        ids = ids.astype(np.uint32)
        requests.append(TraceRequest(f"{id_prefix}d{d}q0", d, 0, ids, prompt_digest(ids), int(out_lens[d])))
    return Trace(cfg, requests, shift)


def warmup_traces(cfg: TraceConfig, rounds: int = 2) -> list[Trace]:
    """`rounds` shifted copies of the trace, each with its own nonzero shift (distinct modulo the range)."""
    check_int("rounds", rounds, 0, where="warmup")
    span = cfg.vocab_size - cfg.token_low
    step = max(1, span // (rounds + 1))
    return [make_trace(cfg, shift=k * step, id_prefix=f"w{k}-") for k in range(1, rounds + 1)]
