"""The flash-attn-4 backend's plumbing on CPU, where FA4 cannot run: FakeFa4VarlenFunc stands in for
flash_attn.cute.flash_attn_varlen_func (emulated with the torch reference, named fake because it is
one), so these tests check what is passed (segments, seqused_k, page table, causal), the backend
choice and its errors, the warmup's shape grid and the compile counter. The kernel itself is tested
on a GPU (test_gpu_fa4.py)."""
import dataclasses
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # store_kv is a Triton kernel; run it in the interpreter

from helpers import CASES_ATTENTION, make_case, reference  # noqa: E402

from flame_llm.engine.selector import resolve_backend  # noqa: E402
from flame_llm.kernels import fa4_backend  # noqa: E402
from flame_llm.kernels.torch_attention import paged_attention  # noqa: E402


class FakeFa4VarlenFunc:
    """FA4's varlen call signature, computed by the torch reference; records each call's arguments."""

    def __init__(self) -> None:
        self.calls: list[dict] = []
        self.compile_cache: dict = {}

    def __call__(self, q, k, v, cu_seqlens_q=None, max_seqlen_q=None, max_seqlen_k=None, seqused_k=None,
                 page_table=None, softmax_scale=None, causal=False, **kw):
        assert causal and page_table.dtype == torch.int32 and seqused_k.dtype == torch.int32
        assert (page_table >= 0).all(), "page tables are padded with a real block, never -1"
        self.calls.append(dict(max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, batch=len(seqused_k)))
        self.compile_cache[(len(seqused_k) > 1, max_seqlen_q > 32)] = True  # a stand-in shape class
        out = paged_attention(q, k, v, cu_seqlens_q, seqused_k, page_table, softmax_scale)
        return out, None


@pytest.fixture
def fake_fa4(monkeypatch):
    fake = FakeFa4VarlenFunc()
    monkeypatch.setattr(fa4_backend, "_varlen_fn", lambda: fake)
    monkeypatch.setattr(fa4_backend, "_compile_cache_size", lambda: len(fake.compile_cache))
    monkeypatch.setattr(fa4_backend, "_compiles_at_warmup", None)
    return fake


@pytest.mark.parametrize("name", ["fresh_ragged_gqa4_d64_bs16", "prefix_chunks_gqa1_d128_bs32",
                                  "verify_k4_gqa4_d64_bs16", "decode_gqa8_d64_bs32"])
def test_fa4_forward_plumbing(fake_fa4, name):
    case = CASES_ATTENTION[name] | dict(device="cpu", pad_rows=0)
    (q, k, v, k_cache, v_cache), meta = make_case(**case)
    meta.block_tables = meta.block_tables.clamp(min=0)
    scale = case["head_dim"] ** -0.5
    k_ref, v_ref, ref = reference(q, k, v, k_cache, v_cache, meta, len(case["seq_lens"]), scale)
    out = fa4_backend.fa4_attention_forward(q, k, v, k_cache, v_cache, meta, scale)
    torch.testing.assert_close(k_cache, k_ref, rtol=0, atol=0, equal_nan=True)  # stored like the reference
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    if meta.is_decode:
        assert fake_fa4.calls == [], "decode-only steps stay on the Triton kernel (CUDA graphs)"
    else:
        assert fake_fa4.calls == [dict(max_seqlen_q=meta.max_seqlen_q, max_seqlen_k=meta.max_seqlen_k,
                                       batch=len(case["seq_lens"]))]


def test_mixed_step_sends_leading_decode_rows_to_triton_and_the_rest_to_fa4(fake_fa4):
    """decode-first mixed step: 3 single-token rows, then a prefix-hit chunk and a fresh prompt."""
    case = dict(seq_lens=[200, 77, 130, 90, 40], q_lens=[1, 1, 1, 33, 40], num_heads=8, num_kv_heads=2,
                head_dim=64, block_size=16, device="cpu")
    (q, k, v, k_cache, v_cache), meta = make_case(**case)
    meta.block_tables = meta.block_tables.clamp(min=0)
    scale = 0.125
    k_ref, v_ref, ref = reference(q, k, v, k_cache, v_cache, meta, 5, scale)
    d = 3
    decode = dataclasses.replace(meta, cu_seqlens_q=meta.cu_seqlens_q[: d + 1], seq_lens=meta.seq_lens[:d],
                                 block_tables=meta.block_tables[:d], max_seqlen_q=1, max_seqlen_k=200,
                                 is_decode=True, fresh_only=False)
    rest = dataclasses.replace(meta, cu_seqlens_q=meta.cu_seqlens_q[d:] - d, seq_lens=meta.seq_lens[d:],
                               block_tables=meta.block_tables[d:], max_seqlen_q=40, max_seqlen_k=90)
    meta.decode_split = (d, decode, rest)
    out = fa4_backend.fa4_attention_forward(q, k, v, k_cache, v_cache, meta, scale)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    assert fake_fa4.calls == [dict(max_seqlen_q=40, max_seqlen_k=90, batch=2)]  # FA4 saw the prefill rows only


def test_upload_builds_the_decode_split_of_a_mixed_step():
    from flame_llm.engine.sequence import Sequence
    from flame_llm.engine.step_inputs import Staging, build_step_inputs, upload
    from flame_llm.sampling_params import SamplingParams

    seqs = [Sequence(list(range(3, 3 + n)), SamplingParams(max_tokens=4), 16) for n in (20, 33, 50)]
    for s, table, done in zip(seqs, ([4, 9], [1, 2, 3], [5, 6, 7, 8]), (19, 0, 16)):
        s.block_table, s.num_computed_tokens = table, done
    x = build_step_inputs(seqs, [1, 33, 34], 16)  # a decode, a fresh prompt, a chunk over 16 cached tokens
    meta = upload(Staging(torch.device("cpu")), x, split_decodes=True).meta
    d, decode, rest = meta.decode_split
    assert d == 1 and decode.is_decode and decode.seq_lens.tolist() == [20]
    assert decode.block_tables.tolist() == [[4, 9, 0, 0]]
    assert rest.cu_seqlens_q.tolist() == [0, 33, 67] and rest.seq_lens.tolist() == [33, 50]
    assert (rest.max_seqlen_q, rest.max_seqlen_k) == (34, 50)
    assert upload(Staging(torch.device("cpu")), x, split_decodes=False).meta.decode_split is None
    prefill_first = build_step_inputs(seqs[1:], [33, 34], 16)
    assert upload(Staging(torch.device("cpu")), prefill_first, split_decodes=True).meta.decode_split is None


def test_warmup_shape_grid_stays_within_the_engine_limits():
    seqs, budget, max_len, bs = 64, 8192, 32768, 256
    cases = fa4_backend.warmup_shapes(seqs, budget, max_len, bs)
    for q_lens, k_lens in cases:
        assert 1 <= len(q_lens) <= seqs and sum(q_lens) <= budget
        assert all(1 <= q <= k <= max_len for q, k in zip(q_lens, k_lens))
    batches = {len(q) for q, _ in cases}
    assert {1, seqs} <= batches
    assert any(max(q) == 1 for q, _ in cases) and any(max(q) == budget for q, _ in cases)
    assert any(min(k) - max(q) >= max_len // 2 for q, k in cases)  # long cached prefixes
    assert any(len(set(q)) > 1 for q, _ in cases)  # mixed decode + chunk steps


def test_warmup_runs_the_grid_and_the_counter_counts_from_there(fake_fa4):
    cache = torch.zeros(64, 16, 2, 16)
    n = fa4_backend.warmup(cache, cache, 4, 0.25, max_num_seqs=4, max_num_batched_tokens=128, max_model_len=512)
    assert n == len(fake_fa4.compile_cache) and n >= 1
    assert len(fake_fa4.calls) == len(fa4_backend.warmup_shapes(4, 128, 512, 16))
    assert fa4_backend.jit_compiles() == 0
    fake_fa4.compile_cache["new variant"] = True
    assert fa4_backend.jit_compiles() == 1


def test_backend_choice_and_errors():
    cpu = torch.device("cpu")
    assert resolve_backend("auto", cpu, 16, torch.float32, 64) == "torch"
    with pytest.raises(ValueError, match="attention_backend 'fa4' cannot run here: device is cpu"):
        resolve_backend("fa4", cpu, 16, torch.bfloat16, 128)
    with pytest.raises(ValueError, match="block_size % 256"):
        resolve_backend("flash_attn", cpu, 16, torch.bfloat16, 128)
    assert "dtype" in fa4_backend.fa4_unavailable_reason(torch.device("cuda"), torch.float32, 128) \
        if torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0) else True


def test_engine_reports_backend_and_jit_compiles(tiny_llama):
    from flame_llm import LLM
    st = LLM(tiny_llama, block_size=16, num_kvcache_blocks=16).engine.stats()
    assert st["attention_backend"] == ("torch" if not torch.cuda.is_available() else st["attention_backend"])
    assert st["attention_jit_compiles"] == 0
