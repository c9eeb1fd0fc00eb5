"""RunnerConfig.shared_prefix_decode on a GPU (skipped with a reason elsewhere): decode steps replayed from CUDA
graphs, mixed-step graphs' leading decode rows, the fa4 backend's decode rows of eager mixed steps and the pruned
last layer's rows read a prefix several rows share once, with the greedy tokens of the flag-off engine (fp32:
identical), and bf16 decode attention within rounding of the usual kernel at Llama-3.1-8B's head layout; no kernel
compiles after warmup."""
import numpy as np
import pytest
import torch

from flame_llm import LLM, SamplingParams
from flame_llm.kernels import shared_prefix as sp
from flame_llm.kernels import triton_attention as ta
from flame_llm.kernels.metadata import AttentionMetadata

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _prompts(docs=4, questions=4, doc_len=600):
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(docs):
        doc = torch.randint(3, 512, (doc_len,), generator=g).tolist()
        out += [doc + torch.randint(3, 512, (20,), generator=g).tolist() for _ in range(questions)]
    return out


@pytest.mark.parametrize("backend", ["triton", "auto"])
def test_fp32_tokens_identical_on_and_off_with_graphs(tiny_llama, backend, monkeypatch):
    calls = []
    real = sp.shared_decode_attention
    monkeypatch.setattr(sp, "shared_decode_attention",
                        lambda *a, **k: calls.append(a[4].num_shared) or real(*a, **k))
    outs = {}
    for on in (False, True):
        llm = LLM(tiny_llama, dtype="float32", attention_backend=backend, block_size=16, num_kvcache_blocks=2048,
                  max_model_len=2048, max_num_batched_tokens=2048, shared_prefix_decode=on)
        params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
        outs[on] = [o.output_token_ids for o in llm.generate(_prompts(), params, use_tqdm=False)]
        if on:
            assert llm.engine.stats()["attention_jit_compiles"] == 0
        del llm
        torch.cuda.empty_cache()
    assert outs[True] == outs[False] and calls  # (a captured graph's calls are counted at capture only)


def test_bf16_llama8b_heads_match_the_usual_kernel():
    rng = np.random.default_rng(0)
    block_size, docs, questions, doc_blocks = 128, 16, 4, 64
    tables, lens, next_id = [], [], 0
    for _ in range(docs):
        prefix = list(range(next_id, next_id + doc_blocks))
        next_id += doc_blocks
        for _ in range(questions):
            tables.append(prefix + [next_id])
            next_id += 1
            lens.append(doc_blocks * block_size + int(rng.integers(65, 81)))
    order = rng.permutation(len(lens))
    bt = torch.tensor(np.asarray(tables)[order], dtype=torch.int32, device="cuda")
    seq_lens = torch.tensor(np.asarray(lens)[order], dtype=torch.int32, device="cuda")
    k_cache = torch.randn(next_id, block_size, 8, 128, dtype=torch.bfloat16, device="cuda")
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(len(lens), 32, 128, dtype=torch.bfloat16, device="cuda")
    meta = AttentionMetadata(torch.arange(len(lens) + 1, dtype=torch.int32, device="cuda"), seq_lens, bt,
                             torch.empty(0, dtype=torch.int64, device="cuda"), 1, int(max(lens)), is_decode=True)
    usual = ta.paged_attention_triton(q, k_cache, v_cache, meta, 128 ** -0.5)
    segs, num_shared, longest = sp.plan_segments(bt.cpu().numpy(), seq_lens.cpu().numpy(), block_size)
    assert num_shared == docs
    meta.shared = sp.SharedPrefix(torch.from_numpy(segs).cuda(), num_shared, longest)
    out = ta.paged_attention_triton(q, k_cache, v_cache, meta, 128 ** -0.5)
    err = ((out.float() - usual.float()).norm() / usual.float().norm()).item()
    assert err < 1e-2, err
