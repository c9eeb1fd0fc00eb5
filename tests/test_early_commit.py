"""emit_before_long_launch: with asynchronous scheduling, an eager step of at least that many tokens is enqueued only
after the step before it is read and its tokens are handed out (LLMEngine.step's on_commit), so streams do not wait
out the long step's host launch. The order is checked event by event (it fails with the flag a no-op), outputs equal
the synchronous engine's under sampling, stops, chunked prefill and preemption, every block comes back, and a
serving engine (AsyncEngine) streams the same tokens with it."""
import asyncio

import numpy as np
import pytest

from flame_llm import LLM, SamplingParams
from flame_llm.config import Config
from flame_llm.engine.async_engine import AsyncEngine

# cuda_graph_mixed_tokens 0: on a GPU too, steps with prefill tokens run eagerly (CPU steps always do)
ENGINE = dict(block_size=16, enable_chunked_prefill=True, max_num_batched_tokens=64, max_num_seqs=8,
              max_model_len=320, cuda_graph_mixed_tokens=0)


def _drive(llm: LLM, prompts, params, log: list | None = None, later: dict | None = None) -> list:
    """Add every request (those in `later`, {step: (prompt, params)}, at that step), then step with an on_commit
    hook until done (as AsyncEngine does); outputs in order, the later ones last."""
    eng = llm.engine
    seqs = [eng.add_request(p, sp) for p, sp in zip(prompts, params)]
    later = dict(later or {})

    def commit(finished):
        if log is not None:
            log.append(("commit", len(finished)))
    step = 0
    while later or not eng.is_finished():
        if step in later:
            seqs.append(eng.add_request(*later.pop(step)))
        if log is not None:
            log.append(("step",))
        eng.step(commit)
        step += 1
    return [(list(s.completion_token_ids), s.finish_reason) for s in seqs]


def _logged_launches(llm: LLM, log: list) -> None:
    runner = llm.engine.model_runner
    orig = runner.launch_prepared

    def launch_prepared(p):
        log.append(("launch", p.scheduled.total_num_scheduled_tokens, p.path))
        return orig(p)
    runner.launch_prepared = launch_prepared


@pytest.mark.parametrize("threshold", [40, 0])
def test_a_long_step_is_enqueued_after_the_step_before_it_is_handed_out(tiny_llama, threshold):
    llm = LLM(tiny_llama, async_scheduling=True, emit_before_long_launch=threshold, **ENGINE)
    log: list = []
    _logged_launches(llm, log)
    rng = np.random.default_rng(1)
    decode = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    prompts = [rng.integers(3, 500, 6).tolist() for _ in range(3)]
    _drive(llm, prompts, [decode] * 3, log, later={5: (rng.integers(3, 500, 200).tolist(), decode)})
    # each step() logs ("step",), then its launch (if it scheduled anything) and its one commit: a launch of >=
    # threshold tokens comes after the commit of the step before it (where one was in flight), any other before
    steps, group = [], []
    for ev in log:
        if ev[0] == "step" and group:
            steps.append(group)
            group = []
        group.append(ev)
    steps.append(group)
    early = late = 0
    launched = []  # tokens of each launch so far
    for g in steps:
        kinds = [e[0] for e in g]
        assert kinds.count("commit") == 1 and kinds.count("launch") <= 1, g
        if "launch" not in kinds:
            continue
        launch = g[kinds.index("launch")]
        # the rule: a long eager step right after a shorter launched one (back-to-back long steps keep the order)
        expect = bool(threshold) and launch[1] >= threshold and launch[2] == "eager" and bool(launched) and \
            launched[-1] < threshold
        assert kinds == (["step", "commit", "launch"] if expect else ["step", "launch", "commit"]), (g, launched)
        early += expect
        late += not expect
        launched.append(launch[1])
    stats = llm.engine.stats()
    if threshold:
        # the 200-token prompt arrives among decode steps: its first chunk (61 tokens) follows one, the rest follow
        # a chunk
        assert early == 1 and stats["early_commits"] == early
    else:
        assert early == 0 and stats["early_commits"] == 0
    assert late > 0
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_outputs_equal_the_synchronous_engines_with_sampling_stops_and_preemption(tiny_llama):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 500, int(rng.integers(1, 140))).tolist() for _ in range(20)]
    params = [SamplingParams(temperature=0.0 if i % 3 == 0 else 0.9, top_k=-1 if i % 2 else 40, seed=i,
                             max_tokens=int(rng.integers(1, 30)), ignore_eos=i % 4 == 0,
                             stop_token_ids=(int(rng.integers(3, 500)),)) for i in range(20)]
    runs = {}
    for name, kw in (("sync", dict(async_scheduling=False)), ("async", dict(async_scheduling=True)),
                     ("early", dict(async_scheduling=True, emit_before_long_launch=24))):
        llm = LLM(tiny_llama, num_kvcache_blocks=24, eos_token_ids=(2, 5, 9), **ENGINE, **kw)
        runs[name] = _drive(llm, prompts, params)
        st = llm.engine.stats()
        assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks
        if name == "early":
            assert st["early_commits"] > 0 and st["num_preemptions"] > 0  # both paths ran, under KV pressure
    assert runs["early"] == runs["sync"] == runs["async"]
    assert {r for _, r in runs["sync"]} == {"stop", "length"}


def test_the_flag_is_off_without_asynchronous_scheduling_and_checked(tiny_llama):
    llm = LLM(tiny_llama, async_scheduling=False, emit_before_long_launch=8, **ENGINE)
    assert llm.engine.emit_before_long_launch == 0
    _drive(llm, [[5] * 100], [SamplingParams(temperature=0, max_tokens=4)])
    assert llm.engine.stats()["early_commits"] == 0
    with pytest.raises(ValueError, match="emit_before_long_launch"):
        Config.from_kwargs(tiny_llama, emit_before_long_launch=-1)
    assert Config.from_kwargs(tiny_llama).scheduler_config.emit_before_long_launch == 2048  # on by default


def test_a_serving_engine_streams_the_same_tokens_with_it(tiny_llama):
    sp = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)  # still decoding when the long one comes
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, 500, 8).tolist() for _ in range(3)]
    long_prompt = rng.integers(3, 500, 250).tolist()
    async def run(eng: AsyncEngine):
        decoding = [asyncio.Event() for _ in prompts]

        async def collect(p, started: asyncio.Event):
            out = []
            async for t in eng.stream(p, sp):
                out.append(t)
                started.set()
            return out
        streams = [asyncio.ensure_future(collect(p, e)) for p, e in zip(prompts, decoding)]
        for e in decoding:  # the long prompt arrives while every stream decodes (its chunks follow decode steps)
            await e.wait()
        long = await eng.generate(long_prompt, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
        return [await s for s in streams], long.output_token_ids

    got = {}
    for threshold in (0, 32):
        eng = AsyncEngine.from_args(tiny_llama, async_scheduling=True, emit_before_long_launch=threshold, **ENGINE)
        try:
            got[threshold] = asyncio.run(run(eng))
            early = eng.stats()["early_commits"]
            assert early > 0 if threshold else early == 0
        finally:
            eng.shutdown()
    assert got[0] == got[32] and all(len(s) == 200 for s in got[0][0])


def test_long_eager_launches_are_counted_and_exported(tiny_llama):
    from flame_llm.engine.llm_engine import LONG_LAUNCH_TOKENS
    from flame_llm.serving.metrics import render_engine

    llm = LLM(tiny_llama, block_size=16, enable_chunked_prefill=True, max_num_batched_tokens=4096, max_model_len=4096)
    sp = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    _drive(llm, [[7] * (LONG_LAUNCH_TOKENS + 50), [8] * 40], [sp, sp])  # one long prefill step, then decodes
    st = llm.engine.stats()
    assert st["long_launches"] == 1 and 0 < st["long_launch_max_s"] == st["long_launch_s"]
    text = render_engine({"device": "cpu"}, st, {"requests": 2}).decode()
    assert 'flame_shard_long_launches_total{device="cpu",shard="0"} 1.0' in text
    assert "flame_shard_long_launch_seconds_total" in text and "flame_shard_early_commits_total" in text


def test_aborts_and_long_prompts_mixed_leave_no_block_behind(tiny_llama):
    """The early path under churn: streams aborted while long prompts arrive among them (their first chunks go
    after a hand-out); the engine never fails and every block comes back."""
    eng = AsyncEngine.from_args(tiny_llama, async_scheduling=True, emit_before_long_launch=32, **ENGINE)
    rng = np.random.default_rng(5)

    async def main():
        decoding = [asyncio.Event() for _ in range(6)]

        async def stream(i):
            rid = f"s{i}"
            got = []
            async for t in eng.stream(rng.integers(3, 500, 8).tolist(),
                                      SamplingParams(temperature=0, max_tokens=60, ignore_eos=True), request_id=rid):
                got.append(t)
                decoding[i].set()
                if i % 3 == 0 and len(got) == 5:
                    eng.abort(rid)
            return got

        async def long(i):
            for e in decoding:  # among decoding streams: the first chunk of each goes after a hand-out
                await e.wait()
            await asyncio.sleep(0.01 * i)
            return await eng.generate(rng.integers(3, 500, 150 + 20 * i).tolist(),
                                      SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        return await asyncio.gather(*[stream(i) for i in range(6)], *[long(i) for i in range(4)],
                                    return_exceptions=True)

    try:
        res = asyncio.run(main())
        assert not eng.failed and not [r for r in res if isinstance(r, BaseException)], res
        assert all(len(r) == 60 for i, r in enumerate(res[:6]) if i % 3) and all(len(r.output_token_ids) == 4
                                                                               for r in res[6:])
        bm = eng.engine.block_manager
        for _ in range(100):  # the loop frees the last blocks after the callers are answered
            if bm.num_free_blocks == bm.num_blocks:
                break
            asyncio.run(asyncio.sleep(0.02))
        assert bm.num_free_blocks == bm.num_blocks and eng.stats()["early_commits"] > 0
    finally:
        eng.shutdown()
