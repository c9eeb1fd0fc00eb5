import pytest
import torch

from flame_llm.layers.sampler import make_sampling_batch, sample, sample_rows
from flame_llm.sampling_params import (
    MAX_OUTPUT_TOKENS,
    MAX_STOP_TOKEN_IDS,
    MAX_TOP_K,
    SamplingParams,
    SamplingParamsError,
)

V = 64


def draw(logits, params, positions, n=1):
    batch = make_sampling_batch(params, positions, V, torch.device("cpu"))
    return sample(logits, batch)


def test_greedy_is_argmax():
    logits = torch.randn(3, V)
    out = draw(logits, [SamplingParams(temperature=0)] * 3, [0, 0, 0])
    assert out.tolist() == logits.argmax(-1).tolist()


def test_mixed_greedy_and_sampled_rows():
    logits = torch.randn(2, V)
    out = draw(logits, [SamplingParams(temperature=0), SamplingParams(temperature=1.0, seed=3)], [0, 0])
    assert out[0].item() == logits[0].argmax().item()


def test_seed_reproducible_and_position_dependent():
    logits = torch.randn(1, V)
    sp = SamplingParams(temperature=1.0, seed=7)
    a = [draw(logits, [sp], [i]).item() for i in range(20)]
    b = [draw(logits, [sp], [i]).item() for i in range(20)]
    assert a == b and len(set(a)) > 1


def test_top_k_support_set():
    torch.manual_seed(0)
    logits = torch.randn(1, V)
    allowed = set(logits[0].topk(5).indices.tolist())
    seen = {draw(logits, [SamplingParams(temperature=2.0, top_k=5)], [0]).item() for _ in range(300)}
    assert seen <= allowed and len(seen) == 5


def test_top_p_support_set():
    logits = torch.full((1, V), -10.0)
    logits[0, :4] = torch.tensor([3.0, 2.0, 1.0, 0.0])
    probs = logits.softmax(-1)[0]
    # top_p just above the two largest masses keeps exactly three tokens
    p = (probs[0] + probs[1]).item() + 1e-3
    seen = {draw(logits, [SamplingParams(temperature=1.0, top_p=p)], [0]).item() for _ in range(400)}
    assert seen == {0, 1, 2}


def test_sampling_follows_distribution():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2] + [1e-9] * (V - 3)]))
    counts = torch.zeros(V)
    for i in range(2000):
        counts[draw(logits, [SamplingParams(temperature=1.0, seed=i)], [0]).item()] += 1
    freq = counts[:3] / 2000
    assert torch.allclose(freq, torch.tensor([0.5, 0.3, 0.2]), atol=0.04)


TOP_K = "-1 (off) or an integer in [1, 2147483647] (above the vocabulary: off); got "


@pytest.mark.parametrize("kwargs,field,limit", [
    (dict(temperature=-0.1), "temperature", "a number in [0, 100]; got -0.1"),
    (dict(temperature=float("nan")), "temperature", "a number in [0, 100]; got nan"),
    (dict(temperature=float("inf")), "temperature", "a number in [0, 100]; got inf"),
    (dict(temperature=10**400), "temperature", "a number in [0, 100]; got <int of 1329 bits>"),
    (dict(temperature=True), "temperature", "a number in [0, 100]; got True"),
    (dict(top_k=0), "top_k", f"{TOP_K}0"),
    (dict(top_k=2**63), "top_k", f"{TOP_K}9223372036854775808"),
    (dict(top_k=2**31), "top_k", f"{TOP_K}2147483648"),
    (dict(top_k=5.0), "top_k", f"{TOP_K}5.0"),
    (dict(top_p=0.0), "top_p", "in (0, 1]; got 0.0"),
    (dict(top_p=1.5), "top_p", "in (0, 1]; got 1.5"),
    (dict(top_p=float("nan")), "top_p", "in (0, 1]; got nan"),
    (dict(max_tokens=0), "max_tokens", "an integer >= 1 and <= 2147483647; got 0"),
    (dict(max_tokens=10**9 * 3), "max_tokens", "an integer >= 1 and <= 2147483647; got 3000000000"),
    (dict(seed=-1), "seed", "None or an integer in [0, 2**63); got -1"),
    (dict(seed=2**63), "seed", "None or an integer in [0, 2**63); got 9223372036854775808"),
    (dict(stop_token_ids=[-3]), "stop_token_ids", "non-negative integers < 2**32; got (-3,)"),
    (dict(stop_token_ids=[2**32]), "stop_token_ids", "non-negative integers < 2**32; got (4294967296,)"),
    (dict(stop_token_ids=[[[1]]]), "stop_token_ids", "non-negative integers < 2**32; got ([<list of 1>],)"),
    (dict(stop_token_ids=list(range(257))), "stop_token_ids",
     "at most 256 token ids; got (0, 1, 2, 3, 4, 5, 6, 7, ... (257 in all))"),
    (dict(stop_token_ids=5), "stop_token_ids", "a list or tuple of token ids; got 5"),
    (dict(ignore_eos="yes"), "ignore_eos", "true or false; got 'yes'"),
])
def test_bad_sampling_params_name_the_field_and_the_limit(kwargs, field, limit):
    with pytest.raises(SamplingParamsError) as e:
        SamplingParams(**kwargs)
    assert e.value.field == field and isinstance(e.value, ValueError)
    assert str(e.value) == f"sampling parameter {field!r} must be {limit}"


def test_sampling_params_at_their_limits_are_accepted():
    sp = SamplingParams(temperature=100, top_k=MAX_TOP_K, top_p=1e-9, max_tokens=MAX_OUTPUT_TOKENS,
                        stop_token_ids=[2**32 - 1] * MAX_STOP_TOKEN_IDS, seed=2**63 - 1)
    assert sp.stop_token_ids == (2**32 - 1,) * 256


def test_top_k_above_the_vocabulary_is_off():
    batch = make_sampling_batch([SamplingParams(top_k=MAX_TOP_K), SamplingParams(top_k=5)], [0, 0], V,
                                torch.device("cpu"))
    assert batch.top_ks.tolist() == [V, 5]
    logits = torch.randn(1, V)
    big = [draw(logits, [SamplingParams(temperature=1.0, top_k=MAX_TOP_K, seed=s)], [0]).item() for s in range(50)]
    off = [draw(logits, [SamplingParams(temperature=1.0, seed=s)], [0]).item() for s in range(50)]
    assert big == off


class Unchecked(SamplingParams):
    def validate(self) -> None:  # fault injection: a poison past validation
        pass


def test_sample_rows_fails_the_poison_row_alone():
    torch.manual_seed(0)
    logits = torch.randn(3, V)
    good = [SamplingParams(temperature=0), SamplingParams(temperature=1.0, top_k=7, seed=5)]
    alone, failed = sample_rows(logits[[0, 2]], good, [0, 3], V, torch.device("cpu"))
    assert failed == {}
    poison = Unchecked(temperature=10**400)
    with pytest.raises(OverflowError):  # what the step hit before: the whole batch fails
        make_sampling_batch([good[0], poison, good[1]], [0, 0, 3], V, torch.device("cpu"))
    tokens, failed = sample_rows(logits, [good[0], poison, good[1]], [0, 0, 3], V, torch.device("cpu"))
    assert failed == {1: "sampling failed for this request (OverflowError: int too large to convert to float)"}
    assert tokens[[0, 2]].tolist() == alone.tolist() and tokens[1].item() == logits[1].argmax().item()


def test_sample_rows_reraises_a_failure_no_row_causes_alone(monkeypatch):
    import flame_llm.layers.sampler as sampler

    real = sampler.make_sampling_batch

    def fails_in_company(params, *args):
        if len(params) > 1:
            raise RuntimeError("batch-level failure")
        return real(params, *args)

    monkeypatch.setattr(sampler, "make_sampling_batch", fails_in_company)
    with pytest.raises(RuntimeError, match="batch-level failure"):
        sample_rows(torch.randn(2, V), [SamplingParams(seed=1)] * 2, [0, 0], V, torch.device("cpu"))
