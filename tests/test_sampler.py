import pytest
import torch

from flame_llm.layers.sampler import make_sampling_batch, sample
from flame_llm.sampling_params import SamplingParams

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


@pytest.mark.parametrize("kwargs,field", [
    (dict(temperature=-0.1), "temperature"), (dict(top_k=0), "top_k"), (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"), (dict(max_tokens=0), "max_tokens"), (dict(seed=-1), "seed"),
    (dict(stop_token_ids=[-3]), "stop_token_ids"),
])
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)
