import os

import pytest

from flame_llm.tiny import make_tiny_model


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
