"""Draft-target speculative decoding (issue 5): decoder.py drives the engine step, spec_runner.py the
device side (draft proposals, the K+1-token verify, CUDA graphs), rejection.py the acceptance rules,
draft_runner.py the draft model and its KV pool."""
