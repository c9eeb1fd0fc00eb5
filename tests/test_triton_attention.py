"""Triton paged attention vs the torch reference on fresh random inputs (CPU: TRITON_INTERPRET=1)."""
import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the first triton import

import pytest  # noqa: E402
import triton  # noqa: E402
from helpers import CASES_ATTENTION, POISON, make_case, reference  # noqa: E402

from flame_llm.kernels import triton_attention as ta  # noqa: E402
from flame_llm.kernels.torch_attention import paged_attention, store_kvcache  # noqa: E402

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 GPU variant needs CUDA")


def run_and_check(case_kwargs, *, config=None, num_splits=None, tol=2e-4):
    (q, k, v, k_cache, v_cache), meta = make_case(**case_kwargs)
    num_real = len(case_kwargs["seq_lens"])
    scale = case_kwargs["head_dim"] ** -0.5
    k_ref, v_ref, ref = reference(q, k, v, k_cache, v_cache, meta, num_real, scale)
    n = ref.shape[0]
    if config is None and num_splits is None:
        out = ta.triton_attention_forward(q, k, v, k_cache, v_cache, meta, scale)
    else:
        ta.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.full_like(q, POISON)
        ta.paged_attention_triton(q, k_cache, v_cache, meta, scale, config=config, num_splits=num_splits,
                                  out=out)
    torch.testing.assert_close(k_cache, k_ref, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(v_cache, v_ref, rtol=0, atol=0, equal_nan=True)
    err = ((out[:n].float() - ref).norm() / ref.norm()).item()
    assert err <= tol, f"relative error {err:.2e} > {tol:.0e}"
    if n < q.shape[0]:
        assert torch.isfinite(out[n:]).all(), "padded decode rows (seq_len 0) must not produce NaN"
    return out


CASES = CASES_ATTENTION


@pytest.mark.parametrize("name", list(CASES))
def test_forward_matches_torch(name):
    run_and_check(CASES[name])


def test_auto_split_kv_is_used_for_small_decode_batches():
    case = CASES["decode_pad_split_gqa4_d128_bs16"]
    cfg = ta.pick_config(make_case(**case)[1], group=4)
    assert (cfg.block_m, cfg.block_n) == (16, ta.DECODE_CONFIG.block_n)
    assert ta.pick_num_splits(6 * 2, 1024, 132) == 4  # capped by max_seqlen_k // MIN_SPLIT_KEYS
    assert ta.pick_num_splits(64 * 8, 32768, 132) == 1  # enough programs: no split


def test_decode_split_waves_off_is_pick_num_splits_and_on_splits_padded_buckets(tiny_llama):
    from flame_llm.config import Config
    from flame_llm.validate import FieldError

    try:
        ta.set_decode_split_waves(0)  # off: exactly the rule before the flag
        for programs in (1, 8, 12, 64, 128, 131, 132, 192, 256, 512):
            for max_k in (256, 1024, 8192, 32768):
                assert ta.decode_num_splits(programs, max_k, 132) == ta.pick_num_splits(programs, max_k, 132)
        assert ta.decode_num_splits(32 * 8, 32768, 132) == 1  # bucket 32: 256 programs, no split before
        ta.set_decode_split_waves(4)  # the H200's best or near-best at 8-64 rows (bench.engine.decode_splits)
        assert ta.decode_num_splits(32 * 8, 32768, 132) == 2  # bucket 32: 528 programs wanted, 2 splits a row
        assert ta.decode_num_splits(16 * 8, 32768, 132) == 4
        assert ta.decode_num_splits(8 * 8, 32768, 132) == 8
        assert ta.decode_num_splits(48 * 8, 32768, 132) == 1  # half of 4 x the SMs filled: no split
        assert ta.decode_num_splits(64 * 8, 32768, 132) == 1
        assert ta.decode_num_splits(16 * 8, 512, 132) == 2  # still at least MIN_SPLIT_KEYS keys a split
        for b in (1, 2, 4):  # buckets 1-4: the rule before (32 / 16 / 8 splits), not N = 4's doubling
            assert ta.decode_num_splits(b * 8, 32768, 132) == ta.pick_num_splits(b * 8, 32768, 132) >= 8
        # the kernel follows it: a decode step on the interpreter picks the waves' split, same output
        run_and_check(CASES["decode_pad_split_gqa4_d128_bs16"], config=ta.TileConfig(16, 32, 4, 1))
    finally:
        ta.set_decode_split_waves(0)
    assert Config.from_kwargs(tiny_llama, decode_split_waves=8).runner_config.decode_split_waves == 8
    assert Config.from_kwargs(tiny_llama).runner_config.decode_split_waves == 4  # the default since session 20
    for bad in (-1, 65, 2.5, True):
        with pytest.raises(FieldError, match="decode_split_waves"):
            Config.from_kwargs(tiny_llama, decode_split_waves=bad)


@pytest.mark.parametrize("num_splits", [1, 3, 8])
def test_decode_split_counts(num_splits):
    run_and_check(CASES["decode_pad_split_gqa4_d128_bs16"], num_splits=num_splits,
                  config=ta.TileConfig(16, 32, 4, 1))


@pytest.mark.parametrize("config", [ta.TileConfig(32, 64, 4, 1), ta.TileConfig(64, 16, 4, 1)])
def test_tiles_spanning_several_blocks_and_small_tiles(config):
    # block_n 64 > block_size 16: a tile gathers four whole blocks; block_n 16 == block_size
    run_and_check(CASES["prefix_chunks_gqa1_d128_bs32"] | dict(block_size=16), config=config)


def test_verify_segments_with_split_kv():
    run_and_check(CASES["verify_k4_gqa4_d64_bs16"], num_splits=4, config=ta.TileConfig(32, 16, 4, 1))


@pytest.mark.parametrize("name", ["prefix_chunks_gqa1_d128_bs32", "decode_pad_split_gqa4_d128_bs16"])
def test_half_precision(name):
    # fp16 here; the interpreter's bf16 dot is wrong (Triton 3.9), bf16 runs in the gpu variant
    run_and_check(CASES[name] | dict(dtype=torch.float16), tol=1e-2)


def test_user_errors_name_the_field():
    (q, k, v, k_cache, v_cache), meta = make_case(**CASES["tiny_d16_bs128"])
    with pytest.raises(ValueError, match="num_heads"):
        ta.paged_attention_triton(q[:, :3], k_cache, v_cache, meta, 0.25)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("name", list(CASES))
def test_gpu_bf16_matches_torch(name):
    run_and_check(CASES[name] | dict(dtype=torch.bfloat16, device="cuda"), tol=1e-2)


def _fake_flash_attn():
    """flash_attn's two entry points emulated with the torch reference (the real one needs CUDA)."""
    import types

    def varlen(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=None, causal=False, block_table=None):
        assert causal and max_q >= 1 and max_k >= 1
        if block_table is None:  # contiguous k/v: view every token as its own cache block
            lens = (cu_k[1:] - cu_k[:-1]).to(torch.int32)
            block_table = torch.full((len(lens), int(lens.max())), -1, dtype=torch.int32, device=q.device)
            for i, (s, e) in enumerate(zip(cu_k[:-1].tolist(), cu_k[1:].tolist())):
                block_table[i, :e - s] = torch.arange(s, e)
            k, v = k[:, None], v[:, None]
        return paged_attention(q, k, v, cu_q, cu_k[1:] - cu_k[:-1], block_table, softmax_scale)

    def with_kvcache(q, k_cache, v_cache, cache_seqlens, block_table, softmax_scale=None, causal=False):
        cu = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)
        return paged_attention(q[:, 0], k_cache, v_cache, cu, cache_seqlens, block_table, softmax_scale)[:, None]

    return types.SimpleNamespace(flash_attn_varlen_func=varlen, flash_attn_with_kvcache=with_kvcache)


@pytest.fixture
def fake_flash(monkeypatch):
    import importlib
    import sys

    from flame_llm.kernels import flash_backend
    monkeypatch.setitem(sys.modules, "flash_attn", _fake_flash_attn())
    yield importlib.reload(flash_backend)
    monkeypatch.delitem(sys.modules, "flash_attn")
    importlib.reload(flash_backend)


@pytest.mark.parametrize("name", ["fresh_ragged_gqa4_d64_bs16", "prefix_gqa8_d64_bs64", "decode_gqa8_d64_bs32"])
def test_flash_backend_plumbing(fake_flash, name):
    case = CASES[name] | dict(block_size=256)
    (q, k, v, k_cache, v_cache), meta = make_case(**case)
    num_real = len(case["seq_lens"])
    k_ref, v_ref, ref = reference(q, k, v, k_cache, v_cache, meta, num_real, 0.125)
    assert fake_flash.FLASH_ATTN_AVAILABLE
    out = fake_flash.flash_attention_forward(q, k, v, k_cache, v_cache, meta, 0.125)
    torch.testing.assert_close(k_cache, k_ref, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="block_size"):
        fake_flash.flash_attention_forward(q, k, v, k_cache[:, :128], v_cache[:, :128], meta, 0.125)


def test_flash_backend_imports_without_flash_attn():
    from flame_llm.kernels import flash_backend
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        assert not flash_backend.FLASH_ATTN_AVAILABLE
        with pytest.raises(RuntimeError, match="flash_attn"):
            flash_backend.flash_attention_forward(*[None] * 5, None, 1.0)


@pytest.mark.parametrize("gather_bytes", [64 << 20, 100 * 2 * 32 * 4])  # small: the batch splits into groups
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2), (8, 1)])
def test_batched_torch_decode_equals_per_sequence_reference(monkeypatch, gather_bytes, num_heads, num_kv_heads):
    """The torch path's padded decode (one masked SDPA per group) equals the per-sequence loop; padding
    rows and unused table entries point at NaN-poisoned blocks."""
    from flame_llm.kernels import torch_attention as tat

    monkeypatch.setattr(tat, "DECODE_GATHER_BYTES", gather_bytes)
    seq_lens = [1, 17, 40, 5, 33, 64, 2]
    (q, k, v, k_cache, v_cache), meta = make_case(seq_lens, [1] * len(seq_lens), num_heads, num_kv_heads, 32, 16,
                                                  decode=True, device="cpu")
    meta.block_tables[meta.block_tables < 0] = 0  # as the engine pads tables: a real, poisoned-or-not block
    store_kvcache(k, v, k_cache, v_cache, meta.slot_mapping)
    ref = paged_attention(q, k_cache, v_cache, meta.cu_seqlens_q, meta.seq_lens, meta.block_tables, 0.17)
    with torch.inference_mode():  # as the engine runs it; the buffers it leaves must not break plain calls
        in_mode = tat.paged_decode_attention(q, k_cache, v_cache, meta.seq_lens, meta.block_tables, 0.17)
    got = tat.paged_decode_attention(q, k_cache, v_cache, meta.seq_lens, meta.block_tables, 0.17)
    assert torch.equal(in_mode, got)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    again = tat.paged_decode_attention(q, k_cache, v_cache, meta.seq_lens, meta.block_tables, 0.17)
    assert torch.equal(again, got)  # the reused gather buffers carry nothing over


def test_batched_torch_decode_buffers_are_per_thread():
    """Two engines stepping on two threads (the service, tests) must not share the gather buffers."""
    import threading

    from flame_llm.kernels import torch_attention as tat

    cases = []
    for seed in (1, 2):
        lens = [30 + 7 * seed, 50, 9 * seed]
        (q, k, v, kc, vc), meta = make_case(lens, [1] * 3, 4, 2, 32, 16, decode=True, device="cpu", seed=seed)
        meta.block_tables[meta.block_tables < 0] = 0
        store_kvcache(k, v, kc, vc, meta.slot_mapping)
        ref = paged_attention(q, kc, vc, meta.cu_seqlens_q, meta.seq_lens, meta.block_tables, 0.2)
        cases.append((q, kc, vc, meta, ref))
    bad = []

    def work(case):
        q, kc, vc, meta, ref = case
        for _ in range(200):
            got = tat.paged_decode_attention(q, kc, vc, meta.seq_lens, meta.block_tables, 0.2)
            if not torch.allclose(got, ref, rtol=1e-5, atol=1e-5):
                bad.append(1)

    threads = [threading.Thread(target=work, args=(c,)) for c in cases]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not bad


def test_split_counts_and_tile_configs_form_a_closed_set():
    """Every step shape within the engine's limits picks a (tile config, split count) that
    warmup_all_variants compiles: before, split counts took any value 1..64 (a JIT compile each)."""
    import random

    rng = random.Random(0)
    for group in (1, 4, 8):
        configs = set(ta.reachable_configs(group))
        assert set(ta.reachable_configs(group, decode_only=True)) <= configs
        splits = set(ta.split_choices())
        assert splits == {1, 2, 4, 8, 16, 32, 64}
        seen = set()
        for _ in range(3000):
            b = rng.randint(1, 64)
            q = 1 if rng.random() < 0.5 else rng.randint(1, 8192 // b)
            k = rng.randint(q, 32768)
            meta = ta.AttentionMetadata(None, None, None, None, q, k, is_decode=q == 1)
            cfg = ta.pick_config(meta, group)
            q_tiles = 1 if meta.is_decode else -(-q // (cfg.block_m // triton.next_power_of_2(group)))
            n = ta.pick_num_splits(q_tiles * b * 8, k, 132)
            seen.add((cfg, n))
            assert cfg in configs and n in splits
        assert len(seen) <= len(configs) * len(splits)


def test_step_varying_arguments_are_not_specialised():
    """Triton keys a compile on == 1 / % 16 of ints and the 16-byte alignment of pointers; the metadata
    pointers (slices of one staging buffer) and the block-table stride change per step. Checked on the
    compiled kernels' JITFunctions (the interpreter has no specialisation), in a fresh process."""
    import subprocess
    import sys
    code = ("from flame_llm.kernels.triton_kernels import paged_attention_kernel as p, store_kv_kernel as s, "
            "combine_splits_kernel as c\nfrom flame_llm.kernels.fused import _rope_qk_kernel as r\n"
            "for k in (p, s, c, r):\n"
            "    print(sorted(x.name for x in k.params if x.do_not_specialize))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.split("\n")[:4] == [
        "['bt_ptr', 'cu_q_ptr', 'seq_lens_ptr', 'stride_bt', 'stride_psplit']", "['slot_ptr']",
        "['stride_psplit']", "['pos_ptr']"]


def test_warmup_all_variants_runs_every_config_and_split(monkeypatch):
    """decode_only, GQA group 4: one launch per (decode tile config, split count), each pair once. On a GPU they
    run; on CPU they are recorded and not run (the interpreter ran 254 programs here, ~27 s): the test below runs
    every config under the interpreter, the decode tiles among them."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    cache = torch.randn(4, 16, 2, 16, device=dev)
    real, launched = ta.paged_attention_triton, []

    def record(q, k_cache, v_cache, meta, scale, config=None, num_splits=None, out=None):
        launched.append((config, num_splits))
        assert q.shape[1:] == (8, 16) and meta.seq_lens.tolist() == [q.shape[0]]
        return real(q, k_cache, v_cache, meta, scale, config=config, num_splits=num_splits) if dev == "cuda" else q
    monkeypatch.setattr(ta, "paged_attention_triton", record)
    n = ta.warmup_all_variants(cache, cache, 8, 0.25, decode_only=True)
    fp32 = dict(block_n=32, num_stages=1)  # as paged_attention_triton adjusts a picked config for fp32
    want = [(c._replace(**fp32), s) for c in ta.reachable_configs(4, decode_only=True) for s in ta.split_choices()]
    assert sorted(launched) == sorted(want) and n == len(want)


def test_warmup_all_variants_covers_prefill_tiles_wider_than_a_block(monkeypatch):
    """Prefill tiles hold up to 128 keys: with 16-token blocks the warmup's block table must span them (a
    one-column table was read past its end: a segfault under the interpreter, a bad read on a GPU). Every tile
    config runs; on CPU with split counts 1 and 4 only (the table's width does not depend on the split, and all
    seven counts cost the interpreter ~127 programs per config: the test above checks each is launched)."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if dev == "cpu":
        monkeypatch.setattr(ta, "split_choices", lambda: [1, 4])
    cache = torch.randn(8, 16, 1, 16, device=dev)  # one head: the interpreter runs a grid 8x smaller
    n = ta.warmup_all_variants(cache, cache, 1, 0.25)
    assert n == len(ta.reachable_configs(1)) * len(ta.split_choices())
