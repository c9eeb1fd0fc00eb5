"""Reusing flash-attn-4's launch across one step's layers (RunnerConfig.fa4_call_reuse, off until measured).

FA4's forward (`flash_attn.cute.interface._flash_attn_fwd`) works out its kernel variant and the kernel's arguments
in Python on every call: several hundred lines of checks and branches before one call of the compiled kernel, and
an eager step calls it once per layer (32 times for Llama-3.1-8B) with the same step metadata (segments, page
table, scale) on tensors of the same shapes; only q, the layer's K/V cache and the output differ. The host time of
a long eager step delays the tokens of the step before it (asynchronous scheduling) and leaves the GPU idle where
a step is launch-bound. So the step's first call at a call site runs FA4 in full while its compiled kernel's call
is recorded; the step's later layers call that kernel directly with their own q, K/V and output.

A call is recorded only when FA4 made exactly one kernel call whose first four arguments are q, k, v and out (the
caller's own output tensor), and touched no split-KV combine; otherwise every layer runs FA4 in full. A recording
is kept for one step (it lives in that step's AttentionMetadata) and used only for tensors of the same shapes,
strides and dtypes."""
from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(slots=True)
class RecordedCall:
    signature: tuple
    fn: Callable  # FA4's compiled kernel
    rest: tuple  # its arguments past q, k, v, out


# what became of each call at a reuse site, by outcome ("replayed", "recorded" or why not): the H200 saw no call
# recorded for the tiny test model, so the reason is kept where a GPU run can print it (bench.launch_cost, the test)
OUTCOMES: Counter = Counter()


def signature(*tensors: torch.Tensor) -> tuple:
    return tuple((tuple(t.shape), t.stride(), t.dtype) for t in tensors)


class _Recorder:
    """Stands in for one of FA4's JIT caches while a call runs: hands out the compiled functions as usual and
    records each call made through them."""

    def __init__(self, inner) -> None:
        self.inner, self.calls, self.touched = inner, [], False

    def __contains__(self, key) -> bool:
        self.touched = True
        return key in self.inner

    def __setitem__(self, key, fn) -> None:
        self.inner[key] = fn

    def __getitem__(self, key):
        self.touched = True
        fn = self.inner[key]

        def call(*args):
            self.calls.append((fn, args))
            return fn(*args)
        return call

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


def _interface():
    from flash_attn.cute import interface
    return interface


def reuse_call(calls: dict | None, site: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
               full: Callable[[], torch.Tensor]) -> torch.Tensor:
    """FA4's attention of q over k/v into `out`: through the step's recorded kernel call at `site` when one fits,
    else `full()` (FA4 in full, which must write into `out`), recorded for the step's next layers when it can be.
    calls None: `full()` alone."""
    if calls is None:
        return full()
    sig = signature(q, k, v, out)
    rec = calls.get(site)
    if rec is not None and rec.signature == sig:
        rec.fn(q.detach(), k.detach(), v.detach(), out.detach(), *rec.rest)
        OUTCOMES["replayed"] += 1
        return out
    fa = _interface()
    fwd, combine = fa._flash_attn_fwd, fa._flash_attn_fwd_combine
    main, comb = _Recorder(fwd.compile_cache), _Recorder(combine.compile_cache)
    fwd.compile_cache, combine.compile_cache = main, comb
    try:
        res = full()
    finally:
        fwd.compile_cache, combine.compile_cache = main.inner, comb.inner
    why = _unrecordable(main, comb, (q, k, v, out))
    OUTCOMES[why or "recorded"] += 1
    if why is None:
        fn, args = main.calls[0]
        calls[site] = RecordedCall(sig, fn, tuple(args[4:]))
    return res


def _unrecordable(main: _Recorder, comb: _Recorder, mine: tuple) -> str | None:
    """Why FA4's call just made cannot be replayed for the step's next layers (None: it can)."""
    if comb.touched:
        return "split-KV combine"
    if len(main.calls) != 1:
        return f"{len(main.calls)} kernel calls"
    args = main.calls[0][1]
    for i, (a, t) in enumerate(zip(args[:4], mine)):
        if not isinstance(a, torch.Tensor):
            return f"argument {i} is a {type(a).__name__}"
        if a.data_ptr() != t.data_ptr() or a.shape != t.shape:
            return f"argument {i} is not ours ({'same' if a.data_ptr() == t.data_ptr() else 'other'} memory, " \
                   f"shape {tuple(a.shape)} vs {tuple(t.shape)})"
    if any(isinstance(a, torch.Tensor) and any(a.data_ptr() == t.data_ptr() for t in mine) for a in args[4:]):
        return "a later argument shares our memory"
    return None
