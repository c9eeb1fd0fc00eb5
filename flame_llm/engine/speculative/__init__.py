"""Draft-target speculative decoding (issue 5), a part of the engine that LLMEngine delegates its step to:
decoder.py drives the step through the Scheduler's and ModelRunner's public methods, spec_runner.py the
device side (draft proposals, the K+1-token verify, CUDA graphs), rejection.py the acceptance rules,
draft_runner.py the draft model and its KV pool, profiler.py per-segment step times."""
