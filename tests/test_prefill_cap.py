"""max_prefill_tokens_with_decode (issue 39): with chunked prefill, a step that carries decode rows takes at most
that many prefill tokens; a step without decode rows still fills the token budget; 0 is the schedule before."""
import json

import pytest
from helpers import BS, FakeRunner, expected_outputs, make_prompts, make_scheduler, make_workload, replay

from flame_llm import LLM
from flame_llm.config import Config
from flame_llm.engine.sequence import Sequence
from flame_llm.sampling_params import SamplingParams


def seq_of(tokens, max_tokens: int, rid: str) -> Sequence:
    return Sequence(list(tokens), SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True), BS, rid)


def step(sched, runner) -> list[tuple[str, int]]:
    out = sched.schedule()
    if out.seqs:
        sched.update_from_output(runner.run(out))
    return [(s.request_id, n) for s, n in zip(out.seqs, out.num_scheduled_tokens)]


def record_steps(sched) -> list[tuple[int, int]]:
    """(prefill tokens, decode rows) of every step the scheduler builds, as it counts them."""
    steps, schedule, c = [], sched.schedule, sched.counts

    def spy():
        before = (c.num_prefill_tokens, c.num_decode_tokens)
        out = schedule()
        if out.seqs:
            steps.append((c.num_prefill_tokens - before[0], c.num_decode_tokens - before[1]))
        return out
    sched.schedule = spy
    return steps


def test_a_step_with_decode_rows_takes_at_most_the_cap(tiny_llama):
    sched = make_scheduler(tiny_llama, 64, enable_chunked_prefill=True, max_num_batched_tokens=32,
                           max_prefill_tokens_with_decode=8)
    runner = FakeRunner(BS)
    for i in range(3):
        sched.add(seq_of(range(10 + i, 15 + i), 6, f"d{i}"))
    assert step(sched, runner) == [("d0", 5), ("d1", 5), ("d2", 5)]  # no decode rows yet: the whole budget
    long = seq_of(range(100, 130), 2, "long")
    sched.add(long)
    assert step(sched, runner) == [("d0", 1), ("d1", 1), ("d2", 1), ("long", 8)]  # not 29: the cap
    assert step(sched, runner) == [("d0", 1), ("d1", 1), ("d2", 1), ("long", 8)]
    late = seq_of(range(300, 320), 1, "late")
    sched.add(late)  # the cap is spent on long's chunk: late waits, though 21 budget tokens are left
    assert step(sched, runner) == [("d0", 1), ("d1", 1), ("d2", 1), ("long", 8)]
    assert step(sched, runner) == [("d0", 1), ("d1", 1), ("d2", 1), ("long", 6), ("late", 2)]  # cap shared
    assert long.num_completion_tokens == 1 and late.num_computed_tokens == 2


@pytest.mark.parametrize("asynchronous", [False, True])
@pytest.mark.parametrize("cap", [1, 7, 16])
@pytest.mark.parametrize("seed,num_blocks", [(0, 24), (3, 10)])
def test_the_cap_keeps_outputs_and_kv_correct(tiny_llama, asynchronous, cap, seed, num_blocks):
    work = make_workload(seed, 60)
    sched = make_scheduler(tiny_llama, num_blocks, enable_chunked_prefill=True, max_num_batched_tokens=64,
                           max_prefill_tokens_with_decode=cap, enable_lru=True, enable_cache_aware_schedule=True,
                           enable_same_step_prefix_sharing=True)
    steps = record_steps(sched)
    _, outputs = replay(sched, work, asynchronous=asynchronous)  # the fake runner checks every KV read
    assert [outputs[f"r{i}"][0] for i in range(len(work))] == expected_outputs(work, 128)
    assert steps and all(p <= cap for p, d in steps if d)
    assert any(p > cap for p, d in steps if not d)  # without decode rows a step still takes the whole budget
    assert any(p and d for p, d in steps)  # mixed steps happen: the cap was exercised


def test_cap_off_is_the_schedule_before(tiny_llama):
    work = make_workload(5, 60)
    kw = dict(enable_chunked_prefill=True, max_num_batched_tokens=40)
    before = replay(make_scheduler(tiny_llama, 16, **kw), work)
    assert replay(make_scheduler(tiny_llama, 16, max_prefill_tokens_with_decode=0, **kw), work) == before
    capped = replay(make_scheduler(tiny_llama, 16, max_prefill_tokens_with_decode=4, **kw), work)
    def tokens(outputs):  # tokens and finish reasons (the cached-token counts follow the schedule)
        return {rid: out[:2] for rid, out in outputs.items()}
    assert tokens(capped[1]) == tokens(before[1]) and capped[0] != before[0]  # same answers, another schedule


def test_engine_greedy_tokens_with_the_cap_equal_without(tiny_llama):
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    kw = dict(block_size=16, num_kvcache_blocks=256, max_model_len=256, enable_chunked_prefill=True,
              max_num_batched_tokens=64)
    outs = {}
    for cap in (0, 8):
        llm = LLM(tiny_llama, max_prefill_tokens_with_decode=cap, **kw)
        outs[cap] = [o.output_token_ids for o in llm.generate(make_prompts(), sp, use_tqdm=False)]
        stats = llm.engine.scheduler.stats()
        assert stats["num_mixed_steps"] > 0
    assert outs[8] == outs[0]


@pytest.mark.parametrize("bad", [-1, 1.5, "8", True])
def test_bad_cap_names_the_field(tiny_llama, bad):
    with pytest.raises(ValueError, match="max_prefill_tokens_with_decode"):
        Config.from_kwargs(tiny_llama, max_prefill_tokens_with_decode=bad)


def test_the_simulated_ab_runs_and_the_cap_shortens_the_longest_gaps(tmp_path):
    """bench/service/sim/prefill_cap.py (a prediction for the GPU A/B): seeded, simulated time, so exact."""
    from bench.service.sim import prefill_cap
    out = tmp_path / "cap.json"
    assert prefill_cap.main(["--rates", "12", "--caps", "0,1024", "--duration-s", "4", "--warmup-s", "2",
                             "--num-docs", "16", "--kv-tokens", "65536", "--out", str(out)]) == 0
    off, on = json.load(open(out))["runs"]
    assert (off["cap"], on["cap"]) == (0, 1024) and off["requests"] == on["requests"] > 20
    assert on["itl_s"]["p99"] < off["itl_s"]["p99"]  # cold 8K prefills: one ~200 ms step, or eight short ones
