"""Fault injection for tests and drills, reached through the engine actor's debug_* methods and the engine's
break_engine / slow_engine (AsyncEngine's, or forwarded to the engine process as commands): each changes the live
LLMEngine of one shard as a real fault would. In the engine layer so the engine process can run them."""
from __future__ import annotations

import time


def break_engine(llm_engine, shard_name: str) -> None:
    """The engine's next step raises, as a real step failure would."""
    def broken(*args, **kwargs):
        raise RuntimeError(f"injected engine step failure on shard {shard_name}")

    llm_engine.model_runner.prepare_launch = broken


def slow_engine(llm_engine, pause_s: float) -> None:
    """The engine thread pauses pause_s after each step (0: no more), as one away in a long GPU step is: requests
    and aborts that arrive meanwhile wait for it."""
    llm_engine.__dict__.pop("step", None)
    step = llm_engine.step

    def slow(*args, **kwargs):
        out = step(*args, **kwargs)
        time.sleep(pause_s)
        return out

    if pause_s > 0:
        llm_engine.step = slow
