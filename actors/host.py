"""One process's engine: the host both the engine actor and the standalone HTTP server run in.

`EngineHost.start` pins the process to its GPU by UUID before anything touches CUDA (or sets the CPU
threads of a CPU shard), verifies the device through torch, loads the engine once, and freezes the
startup heap so the garbage collector never walks it again; `stop` undoes the freeze and shuts the
engine down. The model name "tiny" means the embedded default checkpoint."""
from __future__ import annotations

import gc
import logging
import time
from dataclasses import dataclass

from actors.pinning import pin_visible_device, verify_device
from flame_llm.config import Config
from flame_llm.engine.async_engine import AsyncEngine
from flame_llm.engine.engine_process import ProcessEngine, make_async_engine

log = logging.getLogger(__name__)


@dataclass(slots=True)
class EngineHost:
    engine: AsyncEngine | ProcessEngine  # engine_process: the step loop in a child process
    model: str  # the resolved model directory
    device: str  # what results report: the GPU UUID, or the CPU shard's name (cpu-k)
    load_s: float
    frozen_objects: int

    @classmethod
    def start(cls, model: str, engine_kwargs: dict, gpu_uuid: str | None = None, name: str = "cpu-0",
              torch_threads: int = 0) -> EngineHost:
        """Pin, verify, load and freeze. torch_threads: intra-op threads of a CPU host (0: torch's default)."""
        pin_visible_device(gpu_uuid)
        import torch

        from flame_llm.models.tiny import resolve_model

        kwargs = dict(engine_kwargs)
        if gpu_uuid is not None:
            verify_device(gpu_uuid, name)
            kwargs.setdefault("device", "cuda")
        else:
            if torch_threads:
                torch.set_num_threads(torch_threads)
            kwargs.setdefault("device", "cpu")
        t0 = time.perf_counter()
        model = resolve_model(model)
        engine = make_async_engine(Config.from_kwargs(model, **kwargs))
        load_s = time.perf_counter() - t0
        gc.collect()
        gc.freeze()  # everything allocated so far lives as long as the process
        host = cls(engine, model, gpu_uuid or name, load_s, gc.get_freeze_count())
        log.info("%s: engine loaded in %.1fs on %s, %d objects frozen", name, load_s, host.device,
                 host.frozen_objects)
        return host

    def stop(self) -> None:
        gc.unfreeze()
        self.engine.shutdown()
