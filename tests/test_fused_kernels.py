"""Fused Triton kernels against the torch layers (CPU under TRITON_INTERPRET=1, or a GPU)."""
import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from flame_llm.kernels.fused import add_rmsnorm, rope_qk_inplace, silu_mul  # noqa: E402
from flame_llm.layers.layers import RMSNorm, RotaryEmbedding, SiluAndMul  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("n", [64, 96, 4096])
@pytest.mark.parametrize("with_res", [False, True])
def test_add_rmsnorm_matches_torch(n, with_res):
    norm = RMSNorm(n, 1e-5).to(DEV)
    norm.weight.data.uniform_(0.5, 1.5)
    x = torch.randn(7, n, device=DEV)
    res = torch.randn(7, n, device=DEV) if with_res else None
    ref = norm(x, res) if with_res else norm(x)
    got = add_rmsnorm(x, norm.weight, 1e-5, res)
    if with_res:
        assert rel(got[0], ref[0]) < 1e-5 and rel(got[1], ref[1]) < 1e-6
    else:
        assert rel(got, ref) < 1e-5


@pytest.mark.parametrize("heads,kv_heads,hd", [(4, 2, 16), (32, 8, 128)])
def test_rope_matches_torch(heads, kv_heads, hd):
    params = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 256}
    rope = RotaryEmbedding(hd, 4096, params).to(DEV)
    pos = torch.randint(0, 4096, (9,), device=DEV)
    q = torch.randn(9, heads, hd, device=DEV)
    k = torch.randn(9, kv_heads, hd, device=DEV)
    rq, rk = rope(pos, q, k)
    qq = torch.randn(9, heads * hd + 2 * kv_heads * hd, device=DEV)  # a strided view, as split from qkv
    qv = qq[:, : heads * hd].view(9, heads, hd)
    qv.copy_(q)
    rope_qk_inplace(qv, k, pos, rope.cos_sin_cache)
    assert rel(qv, rq) < 1e-5 and rel(k, rk) < 1e-5


def test_silu_mul_matches_torch():
    x = torch.randn(5, 2 * 1500, device=DEV)
    assert rel(silu_mul(x), SiluAndMul()(x)) < 1e-5
