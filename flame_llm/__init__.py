"""flame-llm: a nano-vllm-style engine behind GPU-pinned Ray actors and a prefix router.

Engine names load lazily, so light modules (wire, prefix, routing_key) import without torch."""
from typing import TYPE_CHECKING

__all__ = ["LLM", "LLMEngine", "AsyncEngine", "Config", "RequestOutput", "SamplingParams"]
_WHERE = {"LLM": "flame_llm.engine.llm_engine", "LLMEngine": "flame_llm.engine.llm_engine",
          "AsyncEngine": "flame_llm.engine.async_engine", "Config": "flame_llm.config",
          "RequestOutput": "flame_llm.outputs", "SamplingParams": "flame_llm.sampling_params"}

if TYPE_CHECKING:
    from flame_llm.config import Config
    from flame_llm.engine.async_engine import AsyncEngine
    from flame_llm.engine.llm_engine import LLM, LLMEngine
    from flame_llm.outputs import RequestOutput
    from flame_llm.sampling_params import SamplingParams


def __getattr__(name: str):
    if name in _WHERE:
        import importlib
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'flame_llm' has no attribute {name!r}")
