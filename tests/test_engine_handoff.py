"""AsyncEngine's bounded hand-off (SchedulerConfig.handoff_wait_ms): after a step hands tokens or results to
callers' loops, the engine thread waits (GIL released) until those loops ran them, never past the bound."""
import asyncio
import threading
import time

import pytest

from flame_llm import LLM, AsyncEngine, SamplingParams
from flame_llm.config import HANDOFF_WAIT_MAX_MS, Config, EngineConfig, engine_config_from_json
from flame_llm.validate import FieldError

PROMPTS = [[5, 6, 7, 8], list(range(10, 60)), [100, 200], [9, 8, 7]]


def _run_all(eng: AsyncEngine, sp: SamplingParams) -> tuple[list[list[int]], list[list[int]]]:
    """Streams of two prompts beside plain generate calls of the others, all at once: (streamed, generated)."""
    async def collect(p):
        return [t async for t in eng.stream(p, sp)]

    async def main():
        return await asyncio.gather(*(collect(p) for p in PROMPTS[:2]), *(eng.generate(p, sp) for p in PROMPTS[2:]))

    outs = asyncio.run(main())
    return outs[:2], [o.output_token_ids for o in outs[2:]]


def test_outputs_identical_with_and_without_the_hand_off(tiny_llama):
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ref = [o.output_token_ids for o in LLM(tiny_llama, block_size=16).generate(PROMPTS, sp, use_tqdm=False)]
    results = {}
    for ms in (0, 0.5, 5):
        eng = AsyncEngine.from_args(tiny_llama, block_size=16, handoff_wait_ms=ms)
        try:
            outs = _run_all(eng, sp)
            deadline = time.monotonic() + 5  # the last step's wait may still be under way when its callers return
            while ms and eng.stats()["handoff_waits"] < 12 and time.monotonic() < deadline:
                time.sleep(0.01)
            results[ms] = outs, eng.stats()
        finally:
            eng.shutdown()
    for ms, ((streamed, generated), _) in results.items():
        assert streamed == ref[:2] and generated == ref[2:], ms
    off = results[0][1]  # flag off: no wait at all, as before the flag
    assert off["handoff_waits"] == off["handoff_timeouts"] == 0 and off["handoff_wait_s"] == 0.0
    for ms in (0.5, 5):
        st = results[ms][1]
        assert st["handoff_waits"] >= 12, st  # one per step that handed tokens (12 decode steps at least)
        assert st["handoff_wait_max_s"] <= ms / 1000 + 0.25, st  # bounded (slack: a busy 2-core box)


def test_a_blocked_loop_cannot_hold_the_engine_past_the_bound(tiny_llama):
    """A stream whose loop runs none of its callbacks (its thread is stuck for 20 s) costs each step at most the
    bound: another caller's 64 tokens still come (an unbounded wait would hold them for 20 s)."""
    eng = AsyncEngine.from_args(tiny_llama, block_size=16, handoff_wait_ms=HANDOFF_WAIT_MAX_MS)
    stuck_loop = asyncio.new_event_loop()
    started, release = threading.Event(), threading.Event()

    async def stuck_stream():
        agen = eng.stream_chunks([1, 2, 3], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
        await agen.__anext__()  # the stream runs; from here its loop is blocked and takes nothing more
        started.set()
        release.wait(20)  # blocks the loop's thread: the engine's callbacks for this stream pile up unrun
        await agen.aclose()

    t = threading.Thread(target=stuck_loop.run_until_complete, args=(stuck_stream(),), daemon=True)
    t.start()
    try:
        assert started.wait(30)
        t0 = time.monotonic()
        sp = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
        out = asyncio.run(asyncio.wait_for(eng.generate([4, 5, 6], sp), 15))
        took = time.monotonic() - t0
        assert len(out.output_token_ids) == 64 and not release.is_set()
        st = eng.stats()
        assert st["handoff_timeouts"] >= 32, st  # the stuck loop's release never came: each such wait timed out
        assert took < 15 and st["handoff_wait_max_s"] < HANDOFF_WAIT_MAX_MS / 1000 + 0.25, (took, st)
    finally:
        release.set()
        t.join(30)
        stuck_loop.close()
        eng.shutdown()


def test_a_closed_loop_is_not_waited_for(tiny_llama):
    """A caller whose loop has closed gets nothing handed, so nothing is waited for on its behalf."""
    eng = AsyncEngine.from_args(tiny_llama, block_size=16, handoff_wait_ms=HANDOFF_WAIT_MAX_MS)
    try:
        sp = SamplingParams(temperature=0, max_tokens=2000, ignore_eos=True)

        async def start():
            agen = eng.stream_chunks([1, 2, 3], sp)
            await agen.__anext__()  # left open: its loop closes below while the request runs on

        loop = asyncio.new_event_loop()
        loop.run_until_complete(start())
        loop.close()
        time.sleep(0.2)
        before = eng.stats()["handoff_timeouts"]
        time.sleep(0.5)  # the engine keeps stepping the orphaned request; no step waits for the closed loop
        assert eng.stats()["handoff_timeouts"] == before
    finally:
        eng.shutdown()


@pytest.mark.parametrize("bad", [-0.1, HANDOFF_WAIT_MAX_MS + 1, float("nan"), "1", True, None])
def test_bad_handoff_wait_names_the_field(bad, tiny_llama):
    for build in (lambda: EngineConfig.from_kwargs(handoff_wait_ms=bad),
                  lambda: Config.from_kwargs(tiny_llama, handoff_wait_ms=bad)):
        with pytest.raises(FieldError, match=r"'handoff_wait_ms' must be a number in \[0, 10"):
            build()
    with pytest.raises(ValueError, match="--engine-json.*handoff_wait_ms"):
        engine_config_from_json('{"handoff_wait_ms": -1}')


def test_default_is_off():
    assert EngineConfig().scheduler_config.handoff_wait_ms == 0


def test_the_gil_switch_interval_is_set_only_when_asked(tiny_llama):
    """gil_switch_interval_ms (issue 39's A/B of the engine thread waiting for the GIL after each step): 0 leaves
    Python's interval as it is; a value sets the process's; beyond 5 ms or negative is refused, naming the field."""
    import sys
    before = sys.getswitchinterval()
    try:
        eng = AsyncEngine.from_args(tiny_llama, block_size=16)
        eng.shutdown()
        assert sys.getswitchinterval() == before
        eng = AsyncEngine.from_args(tiny_llama, block_size=16, gil_switch_interval_ms=0.5)
        try:
            assert sys.getswitchinterval() == pytest.approx(0.0005)
            sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
            ref = [o.output_token_ids for o in LLM(tiny_llama, block_size=16).generate(PROMPTS, sp, use_tqdm=False)]
            streamed, generated = _run_all(eng, sp)
            assert streamed + generated == ref
        finally:
            eng.shutdown()
    finally:
        sys.setswitchinterval(before)
    for bad in (-1, 6):
        with pytest.raises(FieldError, match="gil_switch_interval_ms"):
            Config.from_kwargs(tiny_llama, gil_switch_interval_ms=bad)
