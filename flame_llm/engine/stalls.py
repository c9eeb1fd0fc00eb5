"""Counters of host stalls that no step timer explains, for the engine's stats() (a load bench reads them
per window): kernel variants compiled after startup (a Triton JIT compile or an FA4 compile mid-burst costs
from milliseconds to seconds) and garbage-collector pauses.

Nothing here runs per token: the JIT count is read from the kernels' caches when stats() is called, and the
GC hook runs once per collection (two perf_counter calls)."""
from __future__ import annotations

import gc
import sys
import time

GC_PAUSE_THRESHOLD_S = 0.010


class GcPauses:
    """Collections slower than threshold_s, and the slowest, via gc.callbacks (process-wide: a pause
    stops every thread holding the GIL, the engine's included)."""

    def __init__(self, threshold_s: float = GC_PAUSE_THRESHOLD_S) -> None:
        self.threshold_s = threshold_s
        self.num_over = 0
        self.max_s = 0.0
        self.collections = 0
        self._start = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
            return
        dt = time.perf_counter() - self._start
        self.collections += 1
        if dt > self.threshold_s:
            self.num_over += 1
        if dt > self.max_s:
            self.max_s = dt

    def install(self) -> GcPauses:
        if self not in gc.callbacks:
            gc.callbacks.append(self)
        return self

    def uninstall(self) -> None:
        if self in gc.callbacks:
            gc.callbacks.remove(self)

    def __enter__(self) -> GcPauses:  # counts while entered (a load window)
        return self.install()

    def __exit__(self, *exc) -> None:
        self.uninstall()


_process_gc: GcPauses | None = None


def process_gc_pauses() -> GcPauses:
    """The one GcPauses of this process (installed on first use; every engine in the process shares it)."""
    global _process_gc
    if _process_gc is None:
        _process_gc = GcPauses().install()
    return _process_gc


def _jit_function(obj):  # -> triton.runtime.jit.JITFunction | None
    """The JITFunction under a kernel object (autotuner and heuristics wrappers keep it in .fn)."""
    from triton.runtime.jit import JITFunction

    for _ in range(4):
        if isinstance(obj, JITFunction):
            return obj
        obj = getattr(obj, "fn", None)
        if obj is None:
            return None
    return None


def triton_kernel_variants(prefix: str = "flame_llm.") -> int:
    """Compiled variants held by the Triton kernels of the loaded modules under `prefix` (0 without triton)."""
    if "triton" not in sys.modules:
        return 0
    total, seen = 0, set()
    for name, module in list(sys.modules.items()):
        if not name.startswith(prefix) or module is None:
            continue
        for obj in list(vars(module).values()):
            fn = _jit_function(obj) if hasattr(obj, "run") else None
            if fn is None or id(fn) in seen:
                continue
            seen.add(id(fn))
            caches = getattr(fn, "device_caches", None)
            if caches is not None:  # triton >= 3.x: device -> (kernel_cache, ...)
                total += sum(len(c[0]) for c in list(caches.values()))
            else:  # older triton: device -> {key: kernel}
                total += sum(len(c) for c in getattr(fn, "cache", {}).values())
    return total
