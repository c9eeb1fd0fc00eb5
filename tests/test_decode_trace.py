"""Issue 39's decode-heavy burst trace: drawn prompt and answer lengths, seeded; the seed's traces exactly as before
(digests pinned from main at 3cf5b5c); through bench.burst.pairs on CPU (flame and engine each answer every request with
its own length) with req/s and output tok/s per system and as ratios in the paired report."""
import json
import os

import numpy as np
import pytest

from bench.burst import pairs
from bench.burst.report import build_report, render_markdown
from bench.burst.runner import check_run
from bench.burst.traces import TraceConfig, make_trace, warmup_traces
from bench.run_options import RunOptions

# (trace digest, warmup digests) of main at 3cf5b5c, before the decode trace: the seed's traces must not move
SEED_DIGESTS = {
    ("no-reuse", "gpu"): ("0cbeca15db24451b", ["37e1ada0a62aa6d9", "ddbeeeeaecac10cb"]),
    ("no-reuse", "cpu"): ("14e91ca4bcad69c3", ["8cf9eb8f4c47e558", "be9fbdd15ba8e3ef"]),
    ("reuse", "gpu"): ("36453b84cb0a4a2b", ["51bf8538569b3005", "935ec6bfbc582893"]),
    ("reuse", "cpu"): ("a82ab4f816c2a533", ["0e9db859705be75c", "0a8ca32a619fe69f"]),
}
CPU_SHAPE = {"num_docs": 16, "doc_tokens": 1024, "question_tokens": 16, "vocab_size": 4096}


def test_the_seeds_traces_keep_their_digests_lengths_and_answer_length():
    for (name, size), (digest, warm) in SEED_DIGESTS.items():
        cfg = TraceConfig(name=name, **(CPU_SHAPE if size == "cpu" else {}))
        t = make_trace(cfg)
        d = t.describe()
        assert d["trace_digest"] == digest and [w.describe()["trace_digest"] for w in warmup_traces(cfg, 2)] == warm
        assert d["prompt_tokens"] == cfg.doc_tokens + cfg.question_tokens
        assert {len(r.token_ids) for r in t.requests} == {d["prompt_tokens"]}
        assert {r.max_tokens for r in t.requests} == {16}
        assert len(t.requests) == (64 if size == "gpu" else 16) * (4 if name == "reuse" else 1)


def _decode(**kw) -> TraceConfig:
    return TraceConfig(**{"name": "decode", "num_docs": 256, "doc_tokens": 2048 - 64, "min_doc_tokens": 1024 - 64,
                          "question_tokens": 64, "output_tokens": 128, "max_output_tokens": 1024, **kw})


def test_the_decode_trace_draws_prompt_and_answer_lengths_seeded():
    t = make_trace(_decode())
    lens = np.array([len(r.token_ids) for r in t.requests])
    outs = np.array([r.max_tokens for r in t.requests])
    assert len(t.requests) == 256 and lens.min() >= 1024 and lens.max() <= 2048 and len(set(lens)) > 100
    assert outs.min() >= 128 and outs.max() <= 1024 and len(set(outs)) > 100
    assert abs(np.median(outs) - 576) < 60 and abs(np.median(lens) - 1536) < 100  # uniform
    again = make_trace(_decode())
    assert [(r.rid, r.prompt_digest, r.max_tokens) for r in again.requests] == \
        [(r.rid, r.prompt_digest, r.max_tokens) for r in t.requests]
    assert make_trace(_decode(seed=1)).describe()["trace_digest"] != t.describe()["trace_digest"]
    # the answers' lengths are part of the digest: the same prompts asked for other lengths are another trace
    assert make_trace(_decode(max_output_tokens=1023)).describe()["trace_digest"] != t.describe()["trace_digest"]
    d = t.describe()
    assert d["shared_prefix_tokens"] == 0 and d["total_output_tokens"] == int(outs.sum())
    assert d["prompt_tokens"]["min"] == lens.min() and d["output_tokens_drawn"]["max"] == outs.max()
    firsts = {r.token_ids[:64].tobytes() for r in t.requests}
    assert len(firsts) == 256  # nothing shared
    by = {r.doc: r for r in t.requests}
    for w in warmup_traces(t.config, 2):  # same lengths, ids shifted: unseen prompts
        for r in w.requests:
            assert len(r.token_ids) == len(by[r.doc].token_ids) and r.max_tokens == by[r.doc].max_tokens
            assert not np.array_equal(r.token_ids, by[r.doc].token_ids)


def test_decode_trace_fields_and_options_are_checked():
    with pytest.raises(ValueError, match="'min_doc_tokens' must be an integer in \\[1, doc_tokens"):
        _decode(min_doc_tokens=0)
    with pytest.raises(ValueError, match="'max_output_tokens' must be an integer >= output_tokens"):
        _decode(max_output_tokens=100)
    with pytest.raises(ValueError, match="'max_output_tokens' must be 0 \\(only the decode trace"):
        TraceConfig(name="reuse", max_output_tokens=64)
    with pytest.raises(ValueError, match="trace field 'name'"):
        TraceConfig(name="decoding")
    o = RunOptions(decode_prompt_tokens="1024-2048", decode_output_tokens="9-3")
    assert o.decode_range("decode_prompt_tokens") == (1024, 2048)
    with pytest.raises(ValueError, match="--decode-output-tokens needs 1 <= LO <= HI; got '9-3'"):
        o.decode_range("decode_output_tokens")
    with pytest.raises(ValueError, match="--decode-prompt-tokens must be LO-HI"):
        RunOptions(decode_prompt_tokens="many").decode_range("decode_prompt_tokens")
    with pytest.raises(SystemExit, match="--decode-prompt-tokens needs 2 <= LO"):
        pairs.main(["--traces", "decode", "--decode-prompt-tokens", "1-4", "--out", "/nonexistent/x"])
    with pytest.raises(SystemExit, match="--traces must be a comma-separated subset of"):
        pairs.main(["--traces", "decoding", "--out", "/nonexistent/x"])


def test_every_request_is_checked_against_its_own_answer_length():
    t = make_trace(_decode(num_docs=4, doc_tokens=40, min_doc_tokens=10, question_tokens=4, output_tokens=3,
                           max_output_tokens=30, vocab_size=97))
    recs = [{"id": r.rid, "error": None, "prompt_digest": r.prompt_digest, "prompt_tokens": len(r.token_ids),
             "output_len": r.max_tokens, "finish_reason": "length", "shard": 0, "device": "cpu-0"}
            for r in t.requests]
    assert check_run(t, recs, ["cpu-0"])["ok"]
    recs[0]["output_len"] = 16  # the seed's fixed length is wrong here
    assert check_run(t, recs, ["cpu-0"])["failures"] == {"output_len": 1}


def _run(label: str, pair: int, done_s: float, lens: list[int]) -> dict:
    tr = make_trace(_decode(num_docs=len(lens)))
    return {"format": "flame-bench-raw/1", "label": label, "pair": pair, "position": 0, "policy": "cumulative",
            "trace": tr.describe(), "checks": {"ok": True}, "engine_config": {}, "placement": ["GPU-a"],
            "requests": [{"done_s": done_s, "prompt_tokens": 1500, "cached_tokens": 0, "output_len": n}
                         for n in lens]}


def test_the_paired_report_gives_output_tokens_per_second_and_its_ratios():
    runs = [_run("flame", 0, 2.0, [100, 300]), _run("engine", 0, 4.0, [100, 300]),
            _run("flame", 1, 2.5, [100, 300]), _run("engine", 1, 2.5, [100, 300])]
    rep = build_report(runs, ["flame", "engine"])
    t = rep["traces"]["decode"]
    assert t["stats"]["flame"]["out_tok_s"] == {"median": 180.0, "min": 160.0, "max": 200.0}
    (r,) = t["ratios"]
    assert r["out_tok_s"]["paired"] == {0: pytest.approx(2.0), 1: pytest.approx(1.0)}
    assert r["out_tok_s"]["ratio_of_medians"] == pytest.approx(180.0 / 130.0)
    md = render_markdown(rep, "x")
    assert "| flame | 2/2 | 0.900 [0.800-1.000] | 180.0 [160.0-200.0] |" in md
    assert "| flame / engine | 1.3846 | [1.0000-2.0000] | 2/2 | 1.3846 | [1.0000-2.0000] |" in md
    assert "prompts sharing nothing" in md and "answers 128-1024" not in md  # the drawn range of 2 requests


@pytest.mark.slow
def test_the_decode_trace_through_bench_pairs_on_cpu(tmp_path):
    """flame (the service through its client) and engine (serve-http): every request gets exactly the length it
    asked for (the checks compare each with its own), and the report holds both systems' req/s and output tok/s."""
    os.environ.pop("RAY_ADDRESS", None)
    out = str(tmp_path / "decode")
    rc = pairs.main(["--systems", "flame,engine", "--traces", "decode", "--pairs", "1", "--warmup-rounds", "1",
                     "--model", "tiny", "--load-format", "auto", "--decode-prompts", "6", "--decode-prompt-tokens",
                     "40-120", "--decode-output-tokens", "4-40", "--question-tokens", "8", "--max-model-len", "512",
                     "--max-num-batched-tokens", "256", "--max-num-seqs", "8", "--engine-json",
                     '{"cpu_kvcache_gib": 0.0625}', "--out", out])
    assert rc == 0
    rep = json.load(open(os.path.join(out, "report.json")))
    t = rep["traces"]["decode"]
    want = {r.rid: r.max_tokens for r in make_trace(TraceConfig(**{k: t["trace"][k] for k in (
        "name", "num_docs", "doc_tokens", "min_doc_tokens", "question_tokens", "output_tokens", "max_output_tokens",
        "seed", "vocab_size")})).requests}
    assert len(set(want.values())) > 1
    for label in ("flame", "engine"):
        raw = json.load(open(os.path.join(out, "raw", "decode", label, "pair00.json")))
        assert raw["checks"]["ok"], raw["checks"]
        assert {r["id"]: r["output_len"] for r in raw["requests"]} == want
        s = t["stats"][label]
        burst = max(r["done_s"] for r in raw["requests"])
        assert s["out_tok_s"]["median"] == pytest.approx(sum(want.values()) / burst)
    assert t["ratios"][0]["out_tok_s"]["pairs"] == 1
