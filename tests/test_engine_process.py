"""engine_process (flame_llm/engine/engine_process.py): the step loop in a spawned child process behind AsyncEngine's
surface. Real parts: the tiny Llama on CPU, a real child process and pipes, AsyncEngine (engine_process off) as the
reference. One child is shared by the module (spawning one imports torch: seconds); the tests that end an engine run
last on it, or on one of their own."""
import asyncio
import os
import signal
import time

import pytest

from flame_llm import AsyncEngine, SamplingParams
from flame_llm.config import Config, EngineConfig
from flame_llm.engine.async_engine import RequestFailed
from flame_llm.engine.engine_process import ProcessEngine, make_async_engine
from flame_llm.outputs import RequestOutput

FIELDS = {"block_size": 16, "num_kvcache_blocks": 24, "max_model_len": 512, "max_num_batched_tokens": 512}
PROMPTS = [[5, 6, 7, 8], list(range(10, 60)), [100, 200], [7] * 30, [300, 301, 302]]


@pytest.fixture(scope="module")
def ref(tiny_llama):
    eng = make_async_engine(Config.from_kwargs(tiny_llama, **FIELDS))
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def proc(tiny_llama):
    eng = make_async_engine(Config.from_kwargs(tiny_llama, engine_process=True, **FIELDS))
    yield eng
    eng.shutdown()


def _wait(cond, timeout_s=30.0, what=""):
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (not reaped yet) is dead too
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(") ")[1][0] != "Z"


async def _run_all(eng, sps: list[SamplingParams]) -> tuple[list, list]:
    """Every prompt with its params through generate and, concurrently, stream_chunks."""
    async def chunks(p, sp):
        return [x async for x in eng.stream_chunks(p, sp)]

    gens = [eng.generate(p, sp) for p, sp in zip(PROMPTS, sps)]
    streams = [chunks(p, sp) for p, sp in zip(PROMPTS, sps)]
    out = await asyncio.gather(*gens, *streams)
    return out[:len(PROMPTS)], out[len(PROMPTS):]


def test_the_flag_off_is_the_same_async_engine(ref, proc):
    assert type(ref) is AsyncEngine and type(proc) is ProcessEngine
    assert EngineConfig().scheduler_config.engine_process is False


def test_engine_process_with_kv_events_is_refused_naming_both_fields():
    with pytest.raises(ValueError, match="'engine_process' must be off with enable_kv_events"):
        EngineConfig.from_kwargs(engine_process=True, enable_kv_events=True)


def test_greedy_outputs_are_token_identical_to_the_thread_engine(ref, proc):
    """generate and stream_chunks, ten requests at once, lengths by max_tokens and by a stop token."""
    base = [SamplingParams(temperature=0, max_tokens=4 + 3 * i, ignore_eos=True) for i in range(len(PROMPTS))]
    want_gen, _ = asyncio.run(_run_all(ref, base))
    stop = want_gen[1].output_token_ids[2]  # a token the second prompt samples third
    sps = [SamplingParams(temperature=0, max_tokens=sp.max_tokens, ignore_eos=True, stop_token_ids=(stop,))
           for sp in base]
    want_gen, want_stream = asyncio.run(_run_all(ref, sps))
    got_gen, got_stream = asyncio.run(_run_all(proc, sps))
    assert want_gen[1].finish_reason == "stop" and len(want_gen[1].output_token_ids) == 3
    for w, g in zip(want_gen, got_gen):
        assert isinstance(g, RequestOutput)
        assert (g.output_token_ids, g.finish_reason, g.prompt_token_ids, g.num_prompt_tokens) == \
            (w.output_token_ids, w.finish_reason, w.prompt_token_ids, w.num_prompt_tokens)
        assert g.metrics.ttft is not None
    for w, g in zip(want_stream, got_stream):
        *chunks, out = g
        assert all(isinstance(c, list) and c for c in chunks)
        assert [t for c in chunks for t in c] == out.output_token_ids == w[-1].output_token_ids
        assert out.finish_reason == w[-1].finish_reason


def test_stream_yields_the_tokens_of_generate(proc):
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

    async def main():
        return [t async for t in proc.stream([9, 8, 7], sp)], await proc.generate([9, 8, 7], sp)

    toks, full = asyncio.run(main())
    assert toks == full.output_token_ids and len(toks) == 8


def test_a_closed_stream_and_an_abort_stop_the_request_in_the_child(proc):
    long = SamplingParams(temperature=0, max_tokens=300, ignore_eos=True)

    async def main():
        agen = proc.stream_chunks([1, 2, 3], long, request_id="left-early")
        first = await agen.__anext__()
        await agen.aclose()
        # aborted once its first tokens are out (a timed abort lost the race on a fast, idle machine: 300 tiny-model
        # tokens can be done in 0.2 s)
        items = []
        async for item in proc.stream_chunks([4, 5, 6], long, request_id="aborted"):
            if not items:
                proc.abort("aborted")
            items.append(item)
        return first, items[-1]

    first, out = asyncio.run(main())
    assert isinstance(first, list) and first
    assert out.finish_reason == "abort" and len(out.output_token_ids) < 300
    # the child went idle long before 300 tokens: its stats (sent when idle) hold no running request or block
    _wait(lambda: proc.stats()["num_running"] == 0 and proc.stats()["num_waiting"] == 0, 20, "still running")
    s = proc.stats()
    assert s["num_free_blocks"] == s["num_blocks"] and s["num_in_flight"] == 0


@pytest.mark.parametrize("prompt,sp,checked", [
    ([], SamplingParams(max_tokens=4), False),
    ([1] * 600, SamplingParams(max_tokens=4), False),
    ([1, 10 ** 6], SamplingParams(max_tokens=4), False),
    ([1] * 400, SamplingParams(max_tokens=8), True),
])
def test_a_bad_request_is_refused_in_the_parent_with_the_same_message(ref, proc, prompt, sp, checked):
    async def refusal(eng):
        with pytest.raises(ValueError) as e:
            await eng.generate(prompt, sp, checked=checked)
        return str(e.value)

    want = asyncio.run(refusal(ref))
    assert asyncio.run(refusal(proc)) == want
    assert proc.stats()["num_in_flight"] == 0


def test_check_request_and_tokenizer_are_the_engines(ref, proc):
    sp = SamplingParams(max_tokens=10 ** 6)
    with pytest.raises(ValueError) as want:
        ref.check_request([1] * 400, sp)
    with pytest.raises(ValueError) as got:
        proc.check_request([1] * 400, sp)
    assert str(got.value) == str(want.value) and "KV" in str(got.value)
    with pytest.raises(ValueError, match="engine_process"):
        proc.block_manager  # noqa: B018 - cache events are refused with engine_process


def test_a_duplicate_request_id_is_refused(proc):
    sp = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)

    async def main():
        task = asyncio.ensure_future(proc.generate([1, 2, 3], sp, request_id="dup"))
        await asyncio.sleep(0)
        with pytest.raises(ValueError, match="already in flight"):
            await proc.generate([1, 2, 3], sp, request_id="dup")
        return await task

    assert asyncio.run(main()).finish_reason == "length"


class Unchecked(SamplingParams):
    """Fault injection: sampling parameters that skip validation (tests/test_reliability_engine.py's poison); the
    child unpickles it from this module."""

    def validate(self) -> None:
        pass


def test_a_poison_request_fails_alone_in_the_child_with_request_failed(proc):
    ok = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    poison = Unchecked(temperature=10**400, max_tokens=6, ignore_eos=True)

    async def main(with_poison: bool):
        calls = [proc.generate(p, ok) for p in PROMPTS[:3]]
        if with_poison:
            calls.append(proc.generate([1, 2, 3], poison, request_id="poison"))
        return await asyncio.gather(*calls, return_exceptions=True)

    reference = asyncio.run(main(False))
    outs = asyncio.run(main(True))
    err = outs.pop()
    assert isinstance(err, RequestFailed) and err.request_id == "poison"
    assert str(err) == ("request 'poison' failed in the engine: sampling failed for this request (OverflowError: "
                        "int too large to convert to float)")
    assert [o.output_token_ids for o in outs] == [o.output_token_ids for o in reference]
    assert not proc.failed and proc.stats()["num_in_flight"] == 0


def test_a_killed_child_fails_waiting_requests_and_sets_failed(tiny_llama):
    eng = ProcessEngine(Config.from_kwargs(tiny_llama, engine_process=True, **FIELDS))
    try:
        long = SamplingParams(temperature=0, max_tokens=300, ignore_eos=True)

        async def main():
            gen = asyncio.ensure_future(eng.generate([1, 2, 3], long))
            agen = eng.stream_chunks([4, 5, 6], long)
            await agen.__anext__()
            os.kill(eng.pid, signal.SIGKILL)
            with pytest.raises(RuntimeError) as e:
                async for _ in agen:
                    pass
            with pytest.raises(RuntimeError) as e2:
                await gen
            return str(e.value), str(e2.value)

        errors = asyncio.run(main())
        assert all(f"engine process {eng.pid} died (killed by signal 9)" in m for m in errors), errors
        assert eng.failed and "died" in str(eng.error)
        with pytest.raises(RuntimeError, match="engine loop failed"):
            asyncio.run(eng.generate([1, 2], long))
    finally:
        eng.shutdown()
    assert not _alive(eng.pid)


def test_a_broken_engine_fails_its_requests_then_shutdown_leaves_no_child(proc):
    """Fault injection forwarded to the child: its next step raises; the request fails with the step's error,
    `failed` turns True, the child ends. Shutdown (again, the fixture's) leaves no process."""
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    proc.break_engine("shard-t")

    async def main():
        with pytest.raises(RuntimeError, match="injected engine step failure on shard shard-t"):
            await proc.generate([1, 2, 3], sp)

    asyncio.run(main())
    assert proc.failed
    pid = proc.pid
    proc.shutdown()
    assert not _alive(pid) and not proc._proc.is_alive()
