import os

import pytest
import torch
from helpers import MAX_TOKENS, make_prompts
from transformers import AutoModelForCausalLM

from flame_llm.models.tiny import make_tiny_model


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> str:
    return make_tiny_model(str(tmp_path_factory.mktemp("tiny-llama")), "llama")


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory) -> str:
    return make_tiny_model(str(tmp_path_factory.mktemp("tiny-qwen3")), "qwen3", sharded=True)


@pytest.fixture(scope="session", params=["llama", "qwen3"])
def tiny_model(request, tiny_llama, tiny_qwen3) -> str:
    return tiny_llama if request.param == "llama" else tiny_qwen3


def pytest_report_header(config):
    return f"TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', '')}"


def pytest_runtest_setup(item):
    # beside another xdist worker's Ray, `flame-llm serve` refuses to start: say how to run these, not that serve failed
    if item.get_closest_marker("serial") and os.environ.get("PYTEST_XDIST_WORKER"):
        pytest.fail(f"{item.nodeid} is marked serial (it runs `flame-llm serve`, which refuses to start beside another "
                    "Ray cluster on this machine): run it apart, `pytest tests -m serial`, as the README's test "
                    "command does", pytrace=False)


@pytest.fixture(scope="session")
def reference(tiny_llama, tiny_qwen3):
    """transformers' greedy continuation of each prompt, per architecture."""
    refs = {}
    for name, path in (("llama", tiny_llama), ("qwen3", tiny_qwen3)):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        outs = []
        for p in make_prompts():
            ids = torch.tensor([p])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS,
                                 do_sample=False, eos_token_id=None, pad_token_id=0)
            outs.append(gen[0, len(p):].tolist())
        refs[name] = outs
    return refs
