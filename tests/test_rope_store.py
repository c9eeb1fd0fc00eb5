"""fused_rope_store: one Triton launch rotates q and k in place and writes k and v to the cache (CPU under
TRITON_INTERPRET=1, or a GPU). The kernel equals RoPE then the store, bit for bit, padded rows stored nowhere; an
engine with it gives the same tokens as one running the same RoPE kernel and the store apart, and its attention
backends store nothing themselves."""
import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from flame_llm import LLM, SamplingParams  # noqa: E402
from flame_llm.config import Config  # noqa: E402
from flame_llm.kernels import triton_attention  # noqa: E402
from flame_llm.kernels.fused import rope_qk_inplace, rope_store_kv  # noqa: E402
from flame_llm.kernels.triton_attention import store_kv  # noqa: E402
from flame_llm.layers.layers import RotaryEmbedding  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,hd", [(4, 2, 16), (32, 8, 128)])
def test_rope_store_equals_rope_then_store(dtype, heads, kv_heads, hd):
    t, blocks, bs = 9, 6, 4
    rope = RotaryEmbedding(hd, 512, {"rope_theta": 10000.0, "rope_type": "default"}).to(DEV)
    g = torch.Generator(device=DEV).manual_seed(0)
    pos = torch.randint(0, 512, (t,), device=DEV, generator=g)
    qkv = torch.randn(t, (heads + 2 * kv_heads) * hd, device=DEV, generator=g).to(dtype)  # views, as split
    slots = torch.tensor([3, 7, -1, 0, 12, 13, -1, 22, 5], device=DEV)  # -1: padded rows
    outs = []
    for fused in (False, True):
        x = qkv.clone()
        q, k, v = x.split([heads * hd, kv_heads * hd, kv_heads * hd], dim=-1)
        q, k, v = q.view(t, heads, hd), k.view(t, kv_heads, hd), v.view(t, kv_heads, hd)
        kc = torch.full((blocks, bs, kv_heads, hd), 7.0, device=DEV, dtype=dtype)
        vc = torch.full_like(kc, 7.0)
        if fused:
            rope_store_kv(q, k, v, pos, rope.cos_sin_cache, kc, vc, slots)
        else:
            rope_qk_inplace(q, k, pos, rope.cos_sin_cache)
            store_kv(k, v, kc, vc, slots)
        outs.append((x, kc, vc))
    (x0, kc0, vc0), (x1, kc1, vc1) = outs
    assert torch.equal(x0, x1) and torch.equal(kc0, kc1) and torch.equal(vc0, vc1)
    flat = kc1.view(-1, kv_heads, hd)
    untouched = [s for s in range(blocks * bs) if s not in slots.tolist()]
    assert (flat[untouched] == 7.0).all()  # padded rows wrote nowhere


def _tokens(model: str, fused_rope_store: bool, monkeypatch, stores: list) -> list:
    real = triton_attention.store_kv

    def counted(*args, **kwargs):
        stores.append(1)
        return real(*args, **kwargs)
    monkeypatch.setattr(triton_attention, "store_kv", counted)
    llm = LLM(model, dtype="float32", attention_backend="triton", block_size=16, num_kvcache_blocks=64,
              enable_chunked_prefill=True, max_num_batched_tokens=48, max_num_seqs=4, max_model_len=256,
              fused_rope_store=fused_rope_store)
    runner = llm.engine.model_runner
    assert runner.rope_store is fused_rope_store
    if not fused_rope_store:  # the same RoPE kernel, the store apart: the A/B's one difference
        for m in runner.model.modules():
            if isinstance(m, RotaryEmbedding):
                m.fused = True
    prompts = [[5, 9, 13] * 11, [7, 8] * 30, [5, 9, 13] * 11 + [4, 4]]  # chunks, a prefix hit, decodes
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    return [o.output_token_ids for o in outs]


def test_an_engine_with_it_gives_the_same_tokens_and_its_backends_store_nothing(tiny_llama, monkeypatch):
    apart: list = []
    ref = _tokens(tiny_llama, False, monkeypatch, apart)
    fused: list = []
    got = _tokens(tiny_llama, True, monkeypatch, fused)
    assert got == ref and len(apart) > 0 and fused == []


def test_the_flag_is_off_by_default_checked_and_needs_a_triton_backend(tiny_llama):
    assert Config.from_kwargs(tiny_llama).runner_config.fused_rope_store is False
    with pytest.raises(ValueError, match="fused_rope_store"):
        Config.from_kwargs(tiny_llama, fused_rope_store=1)
    # the torch backend (CPU; on a GPU machine "auto" would pick fa4) has no Triton kernel to fuse into
    llm = LLM(tiny_llama, device="cpu", block_size=16, num_kvcache_blocks=32, fused_rope_store=True)
    assert llm.engine.model_runner.backend == "torch" and llm.engine.model_runner.rope_store is False
