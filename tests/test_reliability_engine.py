"""A poison request fails alone (issue 14): its neighbours in the same step complete with the tokens they get
without it, it gets its error, and the engine keeps serving. A failure no request causes alone still fails
every waiting request and marks the AsyncEngine failed.

Validation now rejects top_k = 2**63 (and the sampler treats top_k above the vocabulary as off), so the
poison here is a request whose parameters turn bad after validation: a temperature of 10**400, which
overflows torch.tensor while the step builds its sampling batch."""
import asyncio
import dataclasses

import pytest

import flame_llm.layers.sampler as sampler
from flame_llm import AsyncEngine, SamplingParams
from flame_llm.config import Config
from flame_llm.engine.async_engine import RequestFailed
from flame_llm.engine.llm_engine import LLMEngine

POISON_TEMPERATURE = 10**400  # int too large to convert to float


class Unchecked(SamplingParams):
    """Fault injection: sampling parameters that skip validation, as a bug past the front doors would."""

    def validate(self) -> None:
        pass


def _valid_params() -> list[SamplingParams]:
    """15 requests that sample (greedy, seeded, top-k, top-p): their tokens do not depend on the batch."""
    return [SamplingParams(temperature=0.0 if i % 3 == 0 else 0.9, top_k=-1 if i % 2 else 40,
                           top_p=1.0 if i % 4 else 0.8, seed=1000 + i, max_tokens=6, ignore_eos=True)
            for i in range(15)]


def _prompts() -> list[list[int]]:
    return [[3 + i, 7, 11 + 2 * i, 13, 5] for i in range(16)]


def _run_engine(engine: LLMEngine, with_poison: bool) -> dict:
    prompts, params = _prompts(), _valid_params()
    for i, sp in enumerate(params):
        engine.add_request(prompts[i], sp, f"ok-{i}")
    if with_poison:
        bad = SamplingParams(temperature=0.7, max_tokens=6, ignore_eos=True)
        engine.add_request(prompts[15], bad, "poison")
        bad.temperature = POISON_TEMPERATURE  # after validation: it reaches the step
    finished = []
    while not engine.is_finished():
        finished += engine.step()[0]
    return {s.request_id: engine.make_output(s) for s in finished}


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async-sched"])
def test_poison_fails_alone_in_the_step_it_shares(tiny_llama, async_scheduling):
    kw = dict(block_size=16, async_scheduling=async_scheduling)
    reference = _run_engine(LLMEngine(Config.from_kwargs(tiny_llama, **kw)), with_poison=False)
    engine = LLMEngine(Config.from_kwargs(tiny_llama, **kw))
    outs = _run_engine(engine, with_poison=True)
    poison = outs.pop("poison")
    assert poison.finish_reason == "error" and poison.output_token_ids == []
    assert poison.error == ("sampling failed for this request (OverflowError: int too large to "
                            "convert to float)")
    assert {k: (o.output_token_ids, o.finish_reason) for k, o in outs.items()} == \
        {k: (o.output_token_ids, o.finish_reason) for k, o in reference.items()}
    assert len(outs) == 15 and all(len(o.output_token_ids) == 6 for o in outs.values())
    # the engine serves on, and every block came back
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    again = _run_engine(engine, with_poison=False)
    assert {k: o.output_token_ids for k, o in again.items()} == {k: o.output_token_ids for k, o in reference.items()}


def test_poison_fails_alone_with_speculative_decoding(tiny_llama):
    """The speculative engine's plain step (the poison's prefill) finishes the poison with its error instead of
    committing its placeholder token (the next step then died on its parameters)."""
    engine = LLMEngine(Config.from_kwargs(tiny_llama, block_size=16, speculative_model=tiny_llama,
                                          num_speculative_tokens=2))
    outs = _run_engine(engine, with_poison=True)
    poison = outs.pop("poison")
    assert poison.finish_reason == "error" and poison.output_token_ids == []
    assert poison.error.startswith("sampling failed for this request (OverflowError")
    assert len(outs) == 15 and all(len(o.output_token_ids) == 6 for o in outs.values())
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.fixture(scope="module")
def engine(tiny_llama):
    eng = AsyncEngine.from_args(tiny_llama, block_size=16)
    yield eng
    eng.shutdown()


def test_async_engine_delivers_the_poisons_error_to_it_alone(engine):
    prompts, params = _prompts(), _valid_params()
    poison = Unchecked(temperature=POISON_TEMPERATURE, max_tokens=6, ignore_eos=True)

    async def batch(with_poison: bool):
        calls = [engine.generate(p, sp) for p, sp in zip(prompts, params)]
        if with_poison:
            calls.append(engine.generate(prompts[15], poison, request_id="poison"))
        return await asyncio.gather(*calls, return_exceptions=True)

    reference = asyncio.run(batch(False))
    outs = asyncio.run(batch(True))
    err = outs.pop()
    assert isinstance(err, RequestFailed) and isinstance(err, ValueError) and err.request_id == "poison"
    assert str(err) == ("request 'poison' failed in the engine: sampling failed for this request (OverflowError: "
                        "int too large to convert to float)")
    assert [o.output_token_ids for o in outs] == [o.output_token_ids for o in reference]
    assert not engine.failed

    async def stream_poison():
        return [t async for t in engine.stream(prompts[15], poison)]

    with pytest.raises(RequestFailed, match="OverflowError"):
        asyncio.run(stream_poison())
    assert [o.output_token_ids for o in asyncio.run(batch(False))] == [o.output_token_ids for o in reference]
    assert engine.stats()["num_in_flight"] == 0


def test_a_failure_no_request_causes_alone_fails_everyone(tiny_llama, monkeypatch):
    """Every row samples fine alone, the batch does not: nobody can be blamed, so every waiting request gets
    the error and the engine reports failed (the engine actor then exits and Ray restarts it)."""
    eng = AsyncEngine.from_args(tiny_llama, block_size=16)
    real = sampler.make_sampling_batch

    def fails_in_company(params, *args, **kwargs):
        if len(params) > 1:
            raise RuntimeError("batch-level failure")
        return real(params, *args, **kwargs)

    monkeypatch.setattr(sampler, "make_sampling_batch", fails_in_company)
    sp = SamplingParams(temperature=0.8, seed=1, max_tokens=4, ignore_eos=True)

    async def main():
        return await asyncio.gather(*(eng.generate([5, 6, 7 + i], sp) for i in range(4)), return_exceptions=True)

    outs = asyncio.run(main())
    assert [str(o) for o in outs] == ["batch-level failure"] * 4 and all(isinstance(o, RuntimeError) for o in outs)
    assert eng.failed and "batch-level failure" in repr(eng.error)
    eng.shutdown()


def test_an_output_that_cannot_be_made_fails_that_request_alone(engine, monkeypatch):
    real = engine.engine.make_output

    def make_output(seq):
        if seq.request_id == "undecodable":
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")
        return real(seq)

    monkeypatch.setattr(engine.engine, "make_output", make_output)
    sp = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)

    async def main():
        return await asyncio.gather(engine.generate([5, 6], sp, request_id="undecodable"),
                                    engine.generate([5, 6], sp), return_exceptions=True)

    bad, good = asyncio.run(main())
    assert isinstance(bad, RequestFailed) and "its output could not be made (UnicodeDecodeError" in str(bad)
    assert len(good.output_token_ids) == 3 and not engine.failed


def test_a_request_the_engine_cannot_add_fails_alone(engine, monkeypatch):
    real = engine.engine._add_checked  # the engine thread adds what AsyncEngine's entry checked

    def add_checked(token_ids, params, request_id=None):
        if request_id == "late-reject":
            raise ValueError("request needs 99 KV blocks; the KV pool has 4")
        return real(token_ids, params, request_id)

    monkeypatch.setattr(engine.engine, "_add_checked", add_checked)
    sp = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)

    async def main():
        return await asyncio.gather(engine.generate([5, 6], sp, request_id="late-reject"),
                                    engine.generate([5, 6], sp), return_exceptions=True)

    bad, good = asyncio.run(main())
    assert isinstance(bad, ValueError) and str(bad) == "request needs 99 KV blocks; the KV pool has 4"
    assert len(good.output_token_ids) == 3 and not engine.failed


def test_unchecked_params_are_what_validation_would_reject():
    """The fault injection is only needed because the boundary rejects the poison now."""
    with pytest.raises(ValueError, match="'temperature' must be a number in \\[0, 100\\]; got <int of 1329 bits>"):
        SamplingParams(temperature=POISON_TEMPERATURE)
    with pytest.raises(ValueError, match="'top_k' must be -1 \\(off\\) or an integer in \\[1, 2147483647\\]"):
        dataclasses.replace(SamplingParams(), top_k=2**63)
