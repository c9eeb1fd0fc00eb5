"""The scheduler scenarios scaled down on CPU: each feature moves its metric the seed's way. Asserts use
count metrics (steps, hit rates, evictions), which depend on the schedule alone, not on timing."""
import json

import pytest

from bench.load.scenario_workloads import SCENARIOS, build_requests, scenario, shifted
from bench.load.scenarios import change, compare, main, run, run_isolated, run_variant
from bench.metrics import percentile, summarize
from flame_llm.outputs import RequestMetrics, RequestOutput

COUNTS = ("prefix_hit_rate", "evictions", "saved_tokens", "steps", "prefill_steps", "decode_steps", "preemptions")


@pytest.fixture(scope="module")
def report(tiny_llama):
    return run(list(SCENARIOS), "small", "cpu", tiny_llama, isolate=False)


def variants(report, name):
    return report["scenarios"][name]["variants"]


def test_chunked_prefill_lowers_victim_tpot(report):
    v = variants(report, "starvation")
    base, chunked = v["baseline"], v["chunked"]
    assert base["victim_tpot_p99_steps"] >= 4 * chunked["victim_tpot_p99_steps"]  # blocked behind prefills
    assert chunked["victim_tpot_p99_steps"] == 1  # a victim decodes in the very next (mixed) step
    assert chunked["mixed_steps"] > 0 and base["mixed_steps"] == 0
    assert base["num_requests"] == chunked["num_requests"] == 16


def test_shared_prefix_raises_hit_rate_and_saves_prefill(report):
    v = variants(report, "prefix")
    assert v["unique"]["prefix_hit_rate"] == 0 and v["unique"]["saved_tokens"] == 0
    assert v["shared"]["prefix_hit_rate"] > 0.7
    assert v["shared"]["prefill_steps"] < v["unique"]["prefill_steps"]
    # prefix dedup: the burst's followers wait for the first request's prefix instead of computing it
    dd, sh = v["shared-dedup"], v["shared"]
    assert sh["deferred_admissions"] == 0 < dd["deferred_admissions"]
    assert dd["prefix_hit_rate"] > sh["prefix_hit_rate"] and dd["prefill_tokens"] < sh["prefill_tokens"]
    if dd["preemptions"] == 0:  # every prompt token is either a hit or computed once
        assert dd["prefill_tokens"] == dd["prompt_tokens"] - dd["cached_prompt_tokens"]
    # same-step sharing: followers admitted beside the first request hit its blocks, nobody waits
    ss = v["shared-same-step"]
    assert ss["deferred_admissions"] == 0 and ss["prefix_hit_rate"] > sh["prefix_hit_rate"]
    assert ss["prefill_tokens"] < sh["prefill_tokens"]
    if ss["preemptions"] == 0:
        assert ss["prefill_tokens"] == ss["prompt_tokens"] - ss["cached_prompt_tokens"]


def test_lru_evicts_less_than_fifo_under_power_law_reuse(report):
    v = variants(report, "lru_pressure")
    assert v["lru"]["evictions"] < v["fifo"]["evictions"]
    assert v["lru"]["prefix_hit_rate"] > v["fifo"]["prefix_hit_rate"]
    assert v["fifo"]["evictions"] > 0  # the cache is below the working set


def test_cache_aware_order_raises_hit_rate(report):
    v = variants(report, "cache_aware")
    assert v["fifo"]["prefix_hit_rate"] == 0  # round-robin over more prefixes than fit: FIFO never hits
    assert v["lpm"]["prefix_hit_rate"] > 0.3 and v["lpm"]["evictions"] < v["fifo"]["evictions"] / 2
    assert v["lpm"]["steps"] < v["fifo"]["steps"]
    assert v["lpm-wide"]["prefix_hit_rate"] > v["lpm"]["prefix_hit_rate"]  # looser aging, more hits


def test_report_compares_against_the_seed_and_renders_tables(report):
    rows = report["scenarios"]["cache_aware"]["changes"]
    assert {r["variant"] for r in rows} == {"lpm", "lpm-wide"}
    hit = next(r for r in rows if r["variant"] == "lpm" and r["metric"] == "prefix_hit_rate")
    assert hit["ours"] == pytest.approx(100 * variants(report, "cache_aware")["lpm"]["prefix_hit_rate"])
    assert hit["seed"] == 72.9 and hit["meets_seed"] == (hit["ours"] >= 72.9)
    md = report["scenarios"]["starvation"]["markdown"]
    assert "| chunked |" in md and "822.9 → 117.6 ms" in md
    json.dumps(report)  # the report is plain JSON


def test_counts_are_deterministic_and_isolated_run_matches(tiny_llama, report):
    job = dict(scenario="lru_pressure", variant="lru", scale="small", device="cpu", model=tiny_llama, seed=0)
    again = run_isolated(job)  # a spawned process, as the GPU benchmark runs every variant
    ref = variants(report, "lru_pressure")["lru"]
    assert {k: again[k] for k in COUNTS} == {k: ref[k] for k in COUNTS}


def test_cli_writes_json(tiny_llama, tmp_path, capsys):
    out = tmp_path / "r" / "s.json"
    main(["--scenario", "prefix", "--device", "cpu", "--scale", "small", "--model", tiny_llama, "--in-process",
          "--out", str(out)])
    data = json.loads(out.read_text())
    assert list(data["scenarios"]) == ["prefix"] and data["scale"] == "small"
    assert "#### prefix" in capsys.readouterr().out


def test_workloads_are_seeded_and_warmup_ids_are_disjoint():
    sc = scenario("cache_aware", "small")
    a = build_requests(sc, sc.variants[0], 512, seed=0)
    assert [r.prompt for r in a] == [r.prompt for r in build_requests(sc, sc.variants[1], 512, seed=0)]
    assert [r.prompt for r in a] != [r.prompt for r in build_requests(sc, sc.variants[0], 512, seed=1)]
    p = sc.params
    assert a[0].prompt[: p["prefix_len"]] == a[p["prefixes"]].prompt[: p["prefix_len"]]  # round-robin
    w = shifted(a, 7919, 512)
    assert [len(r.prompt) for r in w] == [len(r.prompt) for r in a]
    assert w[0].prompt[: p["prefix_len"]] == w[p["prefixes"]].prompt[: p["prefix_len"]]
    assert all(x != y for r, s in zip(a, w) for x, y in zip(r.prompt, s.prompt))
    assert all(3 <= t < 512 for r in w for t in r.prompt)


@pytest.mark.parametrize("name,scale,match", [("nope", "small", "scenario"), ("prefix", "huge", "scale")])
def test_unknown_scenario_or_scale_is_rejected(name, scale, match):
    with pytest.raises(ValueError, match=match):
        scenario(name, scale)


def test_unknown_variant_is_rejected(tiny_llama):
    with pytest.raises(ValueError, match="variant of 'prefix' must be one of"):
        run_variant(dict(scenario="prefix", variant="nope", scale="small", device="cpu", model=tiny_llama, seed=0))


def test_percentile_and_change():
    assert percentile([], 50) is None
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([0.0, 10.0], 99) == pytest.approx(9.9)
    with pytest.raises(ValueError, match="q must be in"):
        percentile([1.0], 101)
    assert change("pct", 200.0, 50.0) == -75.0 and change("pp", 0.5, 0.52) == pytest.approx(2.0)
    assert change("level", None, 0.729) == pytest.approx(72.9) and change("pct", 0, 5) is None
    rows = compare("lru_pressure", {"fifo": {"evictions": 100, "prefix_hit_rate": 0.5},
                                    "lru": {"evictions": 70, "prefix_hit_rate": 0.51}})
    assert [(r["metric"], round(r["ours"], 1), r["meets_seed"]) for r in rows] == [
        ("evictions", -30.0, True), ("prefix_hit_rate", 1.0, False)]


def out(ttft, tpot, n_out=3, prompt=10, cached=4):
    return RequestOutput("r", [1] * prompt, [5] * n_out, "length", prompt, cached,
                         metrics=RequestMetrics(0.0, ttft=ttft, tpot=tpot))


def test_summarize_reads_outputs_and_engine_counters():
    stats = dict(num_prefill_tokens=1000, prefill_time_s=0.5, num_decode_tokens=300, decode_time_s=1.5,
                 num_prefill_steps=4, num_decode_steps=10, num_mixed_steps=2, num_preemptions=1,
                 prefix_hit_tokens=250, prefix_query_tokens=1000, evictions=7)
    s = summarize([out(0.1, 0.02), out(0.3, None, n_out=1)], stats, wall_s=2.0)
    assert s["ttft_p50_ms"] == pytest.approx(200.0) and s["tpot_p99_ms"] == pytest.approx(20.0)
    assert s["prefill_tokens_per_s"] == 2000 and s["decode_tokens_per_s"] == 200
    assert s["prefix_hit_rate"] == 0.25 and s["saved_tokens"] == 250 and s["evictions"] == 7
    assert (s["prefill_steps"], s["decode_steps"], s["mixed_steps"], s["preemptions"]) == (4, 10, 2, 1)
    assert s["output_tokens"] == 4 and s["cached_prompt_tokens"] == 8 and s["requests_per_s"] == 1.0
    assert s["prefill_tokens"] == 1000 and s["deferred_admissions"] is None  # not in these stats
    assert s["peak_memory_bytes"] > 0
    empty = summarize([], {}, wall_s=1.0)
    assert empty["ttft_p50_ms"] is None and empty["prefix_hit_rate"] is None
    with pytest.raises(ValueError, match="wall_s"):
        summarize([], stats, wall_s=0.0)
