"""GPU checks of pinning and the service (skipped with a reason on machines without CUDA): each shard
lands on its planned GPU by UUID, torch confirms it, a wrong pin fails loudly, and the service's results
name the GPU that served them and equal the standalone engine's."""
import os
import subprocess
import sys

import pytest
import torch

from actors.pinning import local_gpu_uuids

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

PIN = """
import sys, torch
from actors.pinning import pin_visible_device, verify_device
pin_visible_device(sys.argv[1])
verify_device(sys.argv[2], "t")
print(torch.cuda.get_device_properties(0).uuid)
"""
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _pin(pin: str, expect: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-c", PIN, pin, expect], capture_output=True, text=True, env=env,
                          timeout=120)


def test_each_gpu_uuid_pins_and_verifies_in_a_fresh_process():
    uuids = local_gpu_uuids()
    assert len(uuids) == torch.cuda.device_count() >= 1
    for u in uuids:
        out = _pin(u, u)
        assert out.returncode == 0, out.stderr
        assert u.lower().endswith(out.stdout.strip().lower())


def test_a_wrong_pin_fails_loudly():
    uuids = local_gpu_uuids()
    if len(uuids) >= 2:
        out = _pin(uuids[0], uuids[1])
        assert out.returncode != 0 and f"pinned to {uuids[1]} but cuda:0 is" in out.stderr
    out = _pin("GPU-00000000-0000-0000-0000-000000000000", "GPU-00000000-0000-0000-0000-000000000000")
    assert out.returncode != 0 and "torch sees 0 CUDA devices" in out.stderr


def test_service_shards_on_their_gpus_match_the_engine(tiny_llama):
    ray = pytest.importorskip("ray", reason="the service needs Ray")
    from flame_llm import LLM, SamplingParams
    from flame_llm.serving.client import make_client
    from flame_llm.serving.service import start_service
    from flame_llm.serving.service_config import ServiceConfig

    engine = {"max_model_len": 1024, "max_num_batched_tokens": 1024, "max_num_seqs": 16, "dtype": "float32",
              "num_kvcache_blocks": 256, "block_size": 16}
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (5, 40, 300, 77, 600, 18)]
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ref = [o.output_token_ids for o in LLM(tiny_llama, **engine).generate(prompts, sp, use_tqdm=False)]
    torch.cuda.empty_cache()
    uuids = local_gpu_uuids()
    os.environ.pop("RAY_ADDRESS", None)
    cfg = ServiceConfig.from_kwargs(model=tiny_llama, engine=engine, num_shards="auto", namespace="test-gpu-service")
    svc = start_service(cfg)
    try:
        assert [p.gpu_uuid for p in svc.placements] == uuids  # one shard per GPU, in index order
        assert [h.device for h in svc.health] == uuids
        client = make_client(cfg, svc.router, svc.actors)
        try:
            results = client.generate(prompts, sp)
        finally:
            client.close()
        assert [r.error for r in results] == [None] * len(prompts)
        assert [r.output_token_ids for r in results] == ref
        assert all(r.device == uuids[r.shard] for r in results)
    finally:
        svc.stop()
        ray.shutdown()
