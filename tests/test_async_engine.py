import asyncio
import time

import pytest

from flame_llm import LLM, AsyncEngine, SamplingParams


@pytest.fixture(scope="module")
def engine(tiny_llama):
    eng = AsyncEngine.from_args(tiny_llama, block_size=16)
    yield eng
    eng.shutdown()


def test_concurrent_generate_matches_offline(engine, tiny_llama):
    prompts = [[5, 6, 7, 8], list(range(10, 60)), [100, 200]]
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    ref = LLM(tiny_llama, block_size=16).generate(prompts, sp, use_tqdm=False)

    async def main():
        return await asyncio.gather(*(engine.generate(p, sp) for p in prompts))

    outs = asyncio.run(main())
    assert [o.output_token_ids for o in outs] == [r.output_token_ids for r in ref]
    assert all(o.metrics.ttft is not None for o in outs)


def test_stream_yields_tokens_in_order(engine):
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

    async def main():
        toks = [t async for t in engine.stream([9, 8, 7], sp)]
        full = await engine.generate([9, 8, 7], sp)
        return toks, full

    toks, full = asyncio.run(main())
    assert toks == full.output_token_ids and len(toks) == 8


def test_stream_chunks_end_with_the_output_and_an_early_close_aborts(engine):
    """stream_chunks: lists of new token ids, then the RequestOutput; leaving the loop early aborts the request
    (the engine is idle again long before 4,000 tokens would have been sampled)."""
    from flame_llm.outputs import RequestOutput

    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    long = SamplingParams(temperature=0, max_tokens=4000, ignore_eos=True)

    async def main():
        items = [x async for x in engine.stream_chunks([9, 8, 7], sp, request_id="chunks")]
        agen = engine.stream_chunks([1, 2, 3], long, request_id="left-early")
        first = await agen.__anext__()
        await agen.aclose()
        deadline = time.monotonic() + 10
        while not engine.engine.scheduler.is_finished():
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        return items, first

    items, first = asyncio.run(main())
    *chunks, out = items
    assert isinstance(out, RequestOutput) and out.finish_reason == "length"
    assert all(isinstance(c, list) and c for c in chunks)
    assert [t for c in chunks for t in c] == out.output_token_ids and len(out.output_token_ids) == 8
    assert isinstance(first, list) and first


def test_abort_finishes_with_abort(engine):
    sp = SamplingParams(temperature=0, max_tokens=4000, ignore_eos=True)

    async def main():
        task = asyncio.ensure_future(engine.generate([1, 2, 3], sp, request_id="long"))
        await asyncio.sleep(0.2)
        engine.abort("long")
        return await task

    out = asyncio.run(main())
    assert out.finish_reason == "abort" and len(out.output_token_ids) < 4000


def test_bad_request_raises_in_caller_and_engine_keeps_serving(engine):
    async def main():
        with pytest.raises(ValueError, match="vocab_size"):
            await engine.generate([1, 10_000], SamplingParams(max_tokens=2))
        with pytest.raises(ValueError, match="already in flight"):
            await asyncio.gather(engine.generate([1, 2], SamplingParams(max_tokens=50), request_id="dup"),
                                 engine.generate([1, 2], SamplingParams(max_tokens=50), request_id="dup"))
        return await engine.generate([1, 2], SamplingParams(max_tokens=2))

    assert len(asyncio.run(main()).output_token_ids) == 2
    # the first "dup" outlives its caller's closed loop; it finishes without harming the engine
    deadline = time.time() + 30
    while engine.stats()["num_in_flight"] and time.time() < deadline:
        time.sleep(0.05)
    assert engine.stats()["num_in_flight"] == 0

    async def after():
        return await engine.generate([3, 4], SamplingParams(max_tokens=2))

    assert len(asyncio.run(after()).output_token_ids) == 2


def test_shutdown_fails_pending_and_refuses_new(tiny_llama):
    eng = AsyncEngine.from_args(tiny_llama, block_size=16)
    eng.shutdown()

    async def main():
        await eng.generate([1, 2], SamplingParams(max_tokens=2))

    with pytest.raises(RuntimeError, match="shut down"):
        asyncio.run(main())


def test_failed_step_loop_is_reported(tiny_llama):
    eng = AsyncEngine.from_args(tiny_llama, block_size=16)
    assert not eng.failed and eng.error is None

    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    eng.engine.model_runner.prepare_launch = broken

    async def main():
        await eng.generate([1, 2], SamplingParams(max_tokens=2))

    with pytest.raises(RuntimeError, match="boom"):
        asyncio.run(main())
    assert eng.failed and "boom" in repr(eng.error)
    with pytest.raises(RuntimeError, match="engine loop failed"):
        asyncio.run(main())
    eng.shutdown()


def test_numpy_prompt_equals_list_prompt(engine):
    """The actor hands the wire's uint32 array straight in; it is checked in numpy and served the same."""
    import numpy as np

    sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)

    async def main():
        a = await engine.generate(np.array([7, 8, 9, 10], dtype=np.uint32), sp)
        b = await engine.generate([7, 8, 9, 10], sp)
        with pytest.raises(ValueError, match="vocab_size"):
            await engine.generate(np.array([7, 600], dtype=np.uint32), sp)
        return a, b

    a, b = asyncio.run(main())
    assert a.prompt_token_ids == [7, 8, 9, 10] and a.output_token_ids == b.output_token_ids
    assert all(type(t) is int for t in a.prompt_token_ids)


def test_a_steps_tokens_wake_each_callers_loop_once_not_once_per_stream(tiny_llama):
    """Issue 39: every call_soon_threadsafe writes the loop's self-pipe and wakes it; one per stream per token was
    ~14% of the engine actor's samples under streaming load (bench.service.stream_cpu). A step's tokens for 6 streams on
    one loop now travel in one call per step, in order, and every stream still gets exactly its tokens."""
    eng = AsyncEngine.from_args(tiny_llama, block_size=16, handoff_wait_ms=0)  # no hand-off waits: their calls
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [[3 + k, 4, 5, 6 + k] for k in range(6)]
    calls = []

    async def main():
        loop = asyncio.get_running_loop()
        plain = loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda *a, **k: (calls.append(a[0]), plain(*a, **k))[1]

        async def one(p):
            return [t async for t in eng.stream(p, sp)]

        return await asyncio.gather(*(one(p) for p in prompts))

    try:
        got = asyncio.run(main())
        steps = eng.stats()
    finally:
        eng.shutdown()
    ref = LLM(tiny_llama, block_size=16).generate(prompts, sp, use_tqdm=False)
    assert got == [r.output_token_ids for r in ref]
    tokens = sum(len(t) for t in got)
    n_steps = steps["num_prefill_steps"] + steps["num_decode_steps"] + steps.get("num_mixed_steps", 0)
    assert tokens == 72 and len(calls) <= n_steps + 2 < tokens / 4, (len(calls), n_steps)
