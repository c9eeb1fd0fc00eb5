"""flame-llm: a nano-vllm-style engine behind GPU-pinned Ray actors and a prefix router."""
from flame_llm.config import Config
from flame_llm.engine.async_engine import AsyncEngine
from flame_llm.engine.llm_engine import LLM, LLMEngine
from flame_llm.outputs import RequestOutput
from flame_llm.sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "AsyncEngine", "Config", "RequestOutput", "SamplingParams"]
