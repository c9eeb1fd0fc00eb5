"""On a GPU: after warmup_all_variants, steps of any shape within the limits compile no new Triton variant
(issue 18 item 3: multi-second JIT pauses under load). Metadata come as slices of one buffer at odd
offsets, as the runner's staging hands them out."""
import random

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled Triton needs CUDA")


def _variants(kernel) -> int:
    caches = getattr(kernel, "device_caches", {})
    return sum(len(c[0]) for c in caches.values())


def test_no_compile_after_warmup_for_any_step_shape():
    from flame_llm.kernels import triton_attention as ta
    from flame_llm.kernels.metadata import AttentionMetadata
    from flame_llm.kernels.triton_kernels import combine_splits_kernel, paged_attention_kernel

    dev, heads, kv_heads, d, bs = "cuda", 32, 8, 128, 128
    cache = torch.randn(300, bs, kv_heads, d, device=dev, dtype=torch.bfloat16)
    ta.warmup_all_variants(cache, cache, heads, d ** -0.5)
    before = _variants(paged_attention_kernel), _variants(combine_splits_kernel)
    rng = random.Random(0)
    for _ in range(60):
        b = rng.randint(1, 16)
        q_lens = [1] * b if rng.random() < 0.5 else [rng.randint(1, 300) for _ in range(b)]
        k_lens = [q + rng.randint(0, 2000) for q in q_lens]
        width = max(-(-k // bs) for k in k_lens)
        off = rng.randint(0, 7)  # staging slices: any offset, so any pointer alignment
        buf = torch.zeros(off + b + 1 + b + b * width, dtype=torch.int32, device=dev)
        cu = buf[off: off + b + 1]
        cu.copy_(torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()]))
        lens = buf[off + b + 1: off + 2 * b + 1]
        lens.copy_(torch.tensor(k_lens))
        tables = buf[off + 2 * b + 1:].view(b, width)
        tables.copy_(torch.randint(0, 300, (b, width)))
        meta = AttentionMetadata(cu, lens, tables, torch.empty(0, dtype=torch.int64, device=dev), max(q_lens),
                                 max(k_lens), is_decode=max(q_lens) == 1)
        q = torch.randn(sum(q_lens), heads, d, device=dev, dtype=torch.bfloat16)
        ta.paged_attention_triton(q, cache, cache, meta, d ** -0.5)
    torch.cuda.synchronize()
    assert (_variants(paged_attention_kernel), _variants(combine_splits_kernel)) == before
