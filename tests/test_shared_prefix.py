"""Shared-prefix decode attention (RunnerConfig.shared_prefix_decode, kernels/shared_prefix.py): the segment plan,
the kernel against the usual decode kernel and torch's reference on fresh random caches (CPU: TRITON_INTERPRET=1),
and the engine's greedy tokens with the flag on and off."""
import os

import numpy as np
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the first triton import

import pytest  # noqa: E402

from flame_llm.kernels import shared_prefix as sp  # noqa: E402
from flame_llm.kernels import triton_attention as ta  # noqa: E402
from flame_llm.kernels.metadata import AttentionMetadata  # noqa: E402
from flame_llm.kernels.torch_attention import paged_decode_attention  # noqa: E402

POISON = float("nan")


def _layout(rng, block_size, docs, rows_per_doc, alone, num_blocks=400):
    """Block tables and key counts: rows_per_doc[d] rows over doc d's prefix (its blocks shared, then each row's
    own blocks), plus `alone` rows with blocks of their own. Block ids are a random permutation (no order)."""
    ids = iter(rng.permutation(num_blocks).tolist())
    tables, lens = [], []
    for doc_blocks, n in zip(docs, rows_per_doc):
        prefix = [next(ids) for _ in range(doc_blocks)]
        for _ in range(n):
            own = int(rng.integers(1, 3 * block_size))
            tables.append(prefix + [next(ids) for _ in range(-(-own // block_size))])
            lens.append(doc_blocks * block_size + own)
    for _ in range(alone):
        n = int(rng.integers(1, 12 * block_size))
        tables.append([next(ids) for _ in range(-(-n // block_size))])
        lens.append(n)
    width = max(len(t) for t in tables)
    bt = np.zeros((len(tables), width), dtype=np.int32)
    for i, t in enumerate(tables):
        bt[i, : len(t)] = t
    order = rng.permutation(len(lens))  # the members of a group are not adjacent rows
    return bt[order], np.asarray(lens, dtype=np.int32)[order]


def _attend_both(bt, lens, block_size, num_heads=8, num_kv_heads=2, head_dim=32, num_splits=None, capacity=None,
                 dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    num_blocks = int(bt.max()) + 1
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    q = torch.randn(len(lens), num_heads, head_dim, generator=g).to(dtype)
    scale = head_dim ** -0.5
    tables, seq_lens = torch.from_numpy(bt), torch.from_numpy(lens)
    meta = AttentionMetadata(torch.arange(len(lens) + 1, dtype=torch.int32), seq_lens, tables,
                             torch.empty(0, dtype=torch.int64), 1, int(lens.max()), is_decode=True)
    usual = ta.paged_attention_triton(q, k_cache, v_cache, meta, scale)
    segs, num_shared, longest = sp.plan_segments(bt, lens, block_size, capacity=capacity)
    meta.shared = sp.SharedPrefix(torch.from_numpy(segs), num_shared, longest, num_splits)
    out = torch.full_like(q, POISON)
    ta.paged_attention_triton(q, k_cache, v_cache, meta, scale, out=out)
    ref = paged_decode_attention(q.float(), k_cache.float(), v_cache.float(), seq_lens, tables, scale)
    return out, usual, ref, num_shared


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_the_plan_groups_rows_by_their_common_full_blocks(monkeypatch):
    monkeypatch.setattr(sp, "MIN_SHARED_TOKENS", 32)
    bs = 16
    bt = np.array([[7, 8, 9, 1], [7, 8, 9, 2], [7, 8, 5, 0], [3, 4, 0, 0], [7, 8, 9, 6]], dtype=np.int32)
    lens = np.array([60, 50, 40, 20, 49], dtype=np.int32)
    segs, num_shared, longest = sp.plan_segments(bt, lens, bs)
    assert num_shared == 1 and segs.shape == (6, sp.SEG_WIDTH)
    shared = segs[0]
    # rows 0, 1, 2 and 4 start with blocks 7, 8; row 2 diverges at its third block, and row 4's key 48 is its
    # query's own (49 keys: 3 full blocks before it), so the common full blocks are 7, 8: 32 keys
    assert shared[:4].tolist() == [0, 0, 32, sp.SHARED] and sorted(shared[4:8].tolist()) == [0, 1, 2, 4]
    assert (shared[8:] == -1).all()
    own = segs[1:]
    assert own[:, 0].tolist() == own[:, 4].tolist() == [0, 1, 2, 3, 4]
    assert own[:, 1].tolist() == [32, 32, 32, 0, 32] and own[:, 2].tolist() == lens.tolist()
    assert own[:, 3].tolist() == [sp.OWN, sp.OWN, sp.OWN, sp.OWN_ALONE, sp.OWN] and (own[:, 5:] == -1).all()
    assert longest == 32
    padded, _, _ = sp.plan_segments(bt, lens, bs, capacity=sp.graph_capacity(5))
    assert padded.shape == (7, sp.SEG_WIDTH) and (padded[6, 4:] == -1).all() and (padded[:6] == segs).all()
    with pytest.raises(AssertionError, match="exceed the capacity"):
        sp.plan_segments(bt, lens, bs, capacity=5)


def test_large_groups_are_cut_in_near_equal_parts_and_short_prefixes_are_not_shared(monkeypatch):
    rng = np.random.default_rng(1)
    bt, lens = _layout(rng, 16, docs=[20, 20], rows_per_doc=[sp.MAX_MEMBERS + 1, 3], alone=2)
    segs, num_shared, _ = sp.plan_segments(bt, lens, 16)  # MIN_SHARED_TOKENS 256: 16 blocks
    sizes = sorted(int((s[4:] >= 0).sum()) for s in segs[:num_shared])
    assert sizes == [3, 4, 5] and all(s[2] == 20 * 16 for s in segs[:num_shared])
    bt, lens = _layout(rng, 16, docs=[15], rows_per_doc=[4], alone=0)  # 240 tokens: under the default
    assert sp.plan_segments(bt, lens, 16)[1] == 0


# each split count (None: sized per step; 1, 2, 4: a graph's fixed grid) and each block size at least once, the
# largest of both together: under the Triton interpreter the full 4 x 3 grid took ~105 s of CI for no other path
@pytest.mark.parametrize("num_splits,block_size", [(None, 64), (None, 16), (1, 32), (2, 16), (4, 64)])
def test_the_kernel_matches_the_usual_decode_kernel_and_torch(monkeypatch, block_size, num_splits):
    monkeypatch.setattr(sp, "MIN_SHARED_TOKENS", 2 * block_size)
    rng = np.random.default_rng(block_size + (num_splits or 0))
    bt, lens = _layout(rng, block_size, docs=[6, 3, 9, 2], rows_per_doc=[4, 2, sp.MAX_MEMBERS + 2, 1], alone=3)
    out, usual, ref, num_shared = _attend_both(bt, lens, block_size, num_splits=num_splits,
                                               capacity=sp.graph_capacity(len(lens)) if num_splits else None)
    assert num_shared == 4  # docs of 4, 2 and 10 rows (two parts); a one-row doc has nothing to share
    assert torch.isfinite(out).all(), "every row written"
    assert _rel(out, ref) < 2e-5 and _rel(usual, ref) < 2e-5


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(4, 4, 16), (8, 1, 64), (12, 4, 48)])
def test_other_head_layouts_and_half_precision(monkeypatch, num_heads, num_kv_heads, head_dim):
    monkeypatch.setattr(sp, "MIN_SHARED_TOKENS", 32)
    rng = np.random.default_rng(head_dim)
    bt, lens = _layout(rng, 16, docs=[4, 5], rows_per_doc=[3, 2], alone=2)
    for dtype, tol in ((torch.float32, 2e-5), (torch.float16, 2e-3)):
        out, usual, ref, num_shared = _attend_both(bt, lens, 16, num_heads, num_kv_heads, head_dim, dtype=dtype)
        assert num_shared == 2 and _rel(out, ref) < tol and _rel(usual, ref) < tol


def test_no_groups_is_the_usual_kernel_split_in_two_slots():
    rng = np.random.default_rng(3)
    bt, lens = _layout(rng, 16, docs=[], rows_per_doc=[], alone=5)
    out, usual, ref, num_shared = _attend_both(bt, lens, 16)
    assert num_shared == 0 and _rel(out, ref) < 2e-5


def _poison_empty(monkeypatch) -> None:
    """torch.empty's float tensors start as NaN: memory a kernel leaves unwritten shows, whatever the allocator
    held there before (a combine reading partials no program wrote passed on fresh, zeroed pages)."""
    empty = torch.empty

    def poisoned(*args, **kwargs):
        t = empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", poisoned)


def test_the_engine_gives_the_same_greedy_tokens_with_the_flag(tiny_llama, monkeypatch):
    """Prompts with a common prefix (prefix caching shares its blocks): decode steps and the pruned last layer's
    rows go through the shared segments, and the tokens equal the flag-off run's and the torch backend's."""
    from flame_llm import LLM, SamplingParams

    monkeypatch.setattr(sp, "MIN_SHARED_TOKENS", 32)
    calls = []
    real = sp.shared_decode_attention

    def counting(q, k_cache, v_cache, block_tables, shared, *args, **kwargs):
        calls.append(shared.num_shared)
        return real(q, k_cache, v_cache, block_tables, shared, *args, **kwargs)

    monkeypatch.setattr(sp, "shared_decode_attention", counting)
    _poison_empty(monkeypatch)
    prefix = list(range(3, 70))
    prompts = [prefix + [100 + i, 200 + i] for i in range(5)] + [list(range(300, 340))]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    outs = {}
    for on in (False, True):
        llm = LLM(tiny_llama, attention_backend="triton", shared_prefix_decode=on, block_size=16,
                  num_kvcache_blocks=96, max_model_len=256, max_num_batched_tokens=512)
        llm.generate([prefix + [99]], params, use_tqdm=False)  # the prefix is cached before the batch
        outs[on] = [o.output_token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    ref = LLM(tiny_llama, block_size=16, max_model_len=256).generate(prompts, params, use_tqdm=False)
    assert outs[True] == outs[False] == [o.output_token_ids for o in ref]
    assert calls and max(calls) >= 1, "some decode step shared the prefix"


def test_the_flag_is_checked_and_off_by_default():
    from flame_llm.config import RunnerConfig

    assert RunnerConfig().shared_prefix_decode is False
    with pytest.raises(ValueError, match="shared_prefix_decode"):
        RunnerConfig(shared_prefix_decode="yes")


def test_the_probe_runs_its_code_path_on_cpu(tmp_path):
    import json

    from bench import shared_prefix_probe

    out = tmp_path / "probe.json"
    assert shared_prefix_probe.main(["--device", "cpu", "--docs", "2", "--questions", "2,1", "--doc-blocks", "16",
                                     "--block-size", "16", "--reps", "1", "--rounds", "1", "--rotate", "1",
                                     "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["rows"], r["num_shared"]) for r in rows] == [(4, 2), (4, 0)]
    assert all(r["max_rel_diff"] < 1e-5 for r in rows)


def test_the_sharing_count_covers_every_decode_row_of_the_reuse_trace(tmp_path):
    """bench.decode_sharing on the seed's reuse trace (tiny model, CPU): every question's 15 decode rows are counted
    once, on some path, and the segments never read more keys than the usual kernel."""
    from bench import decode_sharing

    res = decode_sharing.run("reuse", 128, 512)
    paths = res["paths"]
    decode = sum(v["rows"] for k, v in paths.items() if not k.startswith("pruned"))
    assert decode == 256 * 15
    assert all(v["keys_shared"] <= v["keys"] for v in paths.values())
    assert sum(v["keys_shared"] for v in paths.values()) < sum(v["keys"] for v in paths.values())


def test_warmup_launches_every_split_count():
    k_cache = torch.randn(4, 16, 2, 32)
    assert ta.warmup_shared_variants(k_cache, torch.randn_like(k_cache), 8, 32 ** -0.5) == 4  # 1, 2, 4, 8 splits


def test_mixed_step_graphs_give_the_same_tokens_with_the_flag(tiny_llama, monkeypatch):
    """Mixed-step graphs (run eagerly on CPU, padded to their buckets with the fixed grid): the leading decode rows
    by their segments, every other row after by the same grid, tokens equal to the flag-off run's."""
    from flame_llm import LLM, SamplingParams
    from flame_llm.kernels import triton_attention

    monkeypatch.setattr(sp, "MIN_SHARED_TOKENS", 32)
    seen = []
    real = sp.shared_decode_attention
    monkeypatch.setattr(sp, "shared_decode_attention",
                        lambda *a, **k: seen.append((a[0].shape[0], a[4].rest is not None)) or real(*a, **k))
    prefix = list(range(3, 70))
    # one long prompt keeps prefill chunks in the steps while the short ones decode beside them
    prompts = [prefix + [100 + i] for i in range(4)] + [list(range(200, 330))]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = {}
    for on in (False, True):
        if on:  # (flag off, the fixed launch's split combine also runs over padded rows, which nothing wrote)
            _poison_empty(monkeypatch)
        llm = LLM(tiny_llama, attention_backend="triton", dtype="float32", shared_prefix_decode=on, block_size=16,
                  num_kvcache_blocks=96, max_model_len=256, enable_chunked_prefill=True, max_num_batched_tokens=48,
                  max_num_seqs=8, cuda_graph_mixed_tokens=64)
        llm.generate([prefix + [99]], params, use_tqdm=False)
        outs[on] = [o.output_token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert llm.engine.model_runner.mixed.replays > 0
    assert outs[True] == outs[False]
    assert any(rest for _, rest in seen), "a mixed step's decode rows went by their segments"
    assert triton_attention.fixed_launch_attention  # the path under test
