"""The two engines bench/engine/decode_profile.py steps by hand, behind the same few calls: add a prompt, step, abort
rows,
wait for the device; our LLMEngine, or vLLM's offline LLMEngine with its engine core in this process."""
from __future__ import annotations

import itertools
import os
import time
from collections import Counter


def make_driver(system: str, model: str, limits: dict):
    return FlameDriver(model, limits) if system == "engine" else VllmDriver(model, limits)


class FlameDriver:
    """Our engine. The time each step waits for its tokens (StepHandle.output: the event sync and the read-back) is
    summed, so a step's host time is its wall minus that wait; every launch's path is counted."""
    counts_wait = True

    def __init__(self, model: str, limits: dict) -> None:
        import torch

        from flame_llm import LLM
        from flame_llm.engine import model_runner as mr
        from flame_llm.models.tiny import resolve_model

        fmt = "auto" if model == "tiny" else "dummy"
        self.llm = LLM(resolve_model(model), load_format=fmt, enable_prefix_caching=True,
                       enable_chunked_prefill=True, **limits)
        self.eng = self.llm.engine
        self.vocab = self.eng.vocab_size
        self.on_cuda = self.eng.model_runner.device.type == "cuda"
        self._torch = torch
        self._wait = [0.0]
        self._paths: Counter = Counter()
        output = mr.StepHandle.output

        def timed_output(handle, _wait=self._wait):
            t = time.perf_counter()
            try:
                return output(handle)
            finally:
                _wait[0] += time.perf_counter() - t

        mr.StepHandle.output = timed_output  # this process is the profile's own
        runner = self.eng.model_runner
        prepare = runner.prepare_launch

        def counted(scheduled, prev=None):
            p = prepare(scheduled, prev)
            self._paths[p.path] += 1
            return p

        runner.prepare_launch = counted
        self._seqs: dict[str, object] = {}

    def info(self) -> dict:
        r = self.eng.model_runner
        return {"attention_backend": r.backend, "cuda_graphs": r.use_graphs,
                "async_scheduling": self.eng.async_scheduling,
                "graph_sizes": list(r.graphs.buckets) if r.use_graphs and r.graphs is not None else [],
                "mixed_graph_tokens": r.mixed.max_tokens if r.mixed is not None else 0,
                "kv_capacity_tokens": self.capacity_tokens()}

    def capacity_tokens(self) -> int:
        return self.eng.block_manager.num_blocks * self.eng.config.cache_config.block_size

    def add(self, ids: list[int], max_tokens: int) -> str:
        from flame_llm import SamplingParams

        seq = self.eng.add_request(ids, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
        self._seqs[seq.request_id] = seq
        return seq.request_id

    def step(self) -> None:
        self.eng.step()

    def prefill_all(self) -> None:
        live = [s for s in self._seqs.values() if not s.is_finished]
        while any(s.num_completion_tokens == 0 for s in live):
            self.eng.step()

    def abort(self, rids: list[str]) -> None:
        for rid in rids:
            self.eng.abort(rid)
            self._seqs.pop(rid, None)

    def drain(self) -> None:
        while not self.eng.is_finished():
            self.eng.step()
        self._seqs = {k: s for k, s in self._seqs.items() if not s.is_finished}

    def sync(self) -> None:
        if self.on_cuda:
            self._torch.cuda.synchronize()

    def wait_s(self) -> float:
        return self._wait[0]

    def paths(self) -> dict:
        return dict(self._paths)


class VllmDriver:
    """vLLM's LLMEngine stepped by hand (VLLM_ENABLE_V1_MULTIPROCESSING=0: the engine core runs in this process, so
    the profiler sees its kernels and a step returns when its outputs are processed)."""
    counts_wait = False
    on_cuda = True

    def __init__(self, model: str, limits: dict) -> None:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        import torch
        from vllm import LLM

        extra = {k: v for k, v in limits.items() if k not in ("max_num_seqs", "max_num_batched_tokens",
                                                              "max_model_len")}
        self.llm = LLM(model=model, load_format="dummy", skip_tokenizer_init=True, enable_prefix_caching=True,
                       gpu_memory_utilization=0.9, seed=0, max_num_seqs=limits["max_num_seqs"],
                       max_num_batched_tokens=limits["max_num_batched_tokens"],
                       max_model_len=limits["max_model_len"], **extra)
        self.eng = self.llm.llm_engine
        self.cfg = getattr(self.eng, "vllm_config", None)
        self.vocab = self.eng.model_config.get_vocab_size()
        self._torch = torch
        self._ids = itertools.count()
        self._tokens: dict[str, int] = {}  # live request -> tokens out so far

    def info(self) -> dict:
        import vllm

        comp = getattr(self.cfg, "compilation_config", None)
        sizes = getattr(comp, "cudagraph_capture_sizes", None)
        return {"vllm": vllm.__version__, "graph_sizes": sorted(sizes) if sizes else None,
                "cudagraph_mode": str(getattr(comp, "cudagraph_mode", "")),
                "kv_capacity_tokens": self.capacity_tokens()}

    def capacity_tokens(self) -> int:
        cache = getattr(self.cfg, "cache_config", None)
        blocks, size = getattr(cache, "num_gpu_blocks", None), getattr(cache, "block_size", None)
        return blocks * size if blocks and size else 1 << 40  # unknown: every point is tried

    def add(self, ids: list[int], max_tokens: int) -> str:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        rid = f"p{next(self._ids)}"
        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
        self.eng.add_request(rid, TokensPrompt(prompt_token_ids=ids), sp)
        self._tokens[rid] = 0
        return rid

    def step(self) -> None:
        for out in self.eng.step():
            if out.finished:
                self._tokens.pop(out.request_id, None)
            elif out.request_id in self._tokens:
                self._tokens[out.request_id] = len(out.outputs[0].token_ids)

    def prefill_all(self) -> None:
        while any(n == 0 for n in self._tokens.values()):
            self.step()

    def abort(self, rids: list[str]) -> None:
        if rids:
            self.eng.abort_request(list(rids))
        for rid in rids:
            self._tokens.pop(rid, None)

    def drain(self) -> None:
        while self.eng.has_unfinished_requests():
            self.step()

    def sync(self) -> None:
        self._torch.cuda.synchronize()

    def wait_s(self) -> float:
        return 0.0

    def paths(self) -> None:
        return None
