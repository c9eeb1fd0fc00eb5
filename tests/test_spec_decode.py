"""Speculative decoding (issue 5) is lossless: greedy output is token-identical to the target alone
(drafts that always, sometimes and never agree; prefix caching, preemption, stop tokens and max_tokens
inside an accepted run, auto-off and the draft's catch-up), no block holding an unverified token is
ever published, and sampled output follows the target's distribution (the rejection sampler on given
p/q, and end to end on a 16-token vocabulary)."""
import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from flame_llm import LLM, SamplingParams
from flame_llm.engine.speculative.rejection import greedy_accept, rejection_sample
from flame_llm.layers.sampler import apply_top_k_top_p
from flame_llm.models.tiny import make_tiny_model

MAX_TOKENS = 24
BS = 16


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny CPU forwards run ~10x faster on one thread when the cores are shared."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def make_prompts() -> list[list[int]]:
    rng = random.Random(0)
    shared = [rng.randrange(3, 512) for _ in range(40)]
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (3, 17, 33, 70)]
    return prompts + [shared + [rng.randrange(3, 512) for _ in range(n)] for n in (9, 25)]


def perturbed_copy(src: str, dst: str, scale: float, seed: int = 0) -> str:
    """The same model with Gaussian noise (scale x each tensor's std) on every weight: a draft that
    agrees with the target on part of the tokens."""
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale * p.std())
    model.save_pretrained(dst)
    return dst


@pytest.fixture(scope="module")
def models(tiny_llama, tiny_qwen3, tmp_path_factory):
    mk = tmp_path_factory.mktemp
    return {"llama": tiny_llama, "qwen3": tiny_qwen3,
            "near_llama": perturbed_copy(tiny_llama, str(mk("near-llama")), 0.02),
            "near_qwen3": perturbed_copy(tiny_qwen3, str(mk("near-qwen3")), 0.02),
            "far_llama": make_tiny_model(str(mk("far-llama")), "llama", seed=1)}


@pytest.fixture(scope="module")
def plain(models):
    """The target alone: greedy outputs per architecture."""
    sp = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return {arch: [o.output_token_ids for o in LLM(models[arch], block_size=BS).generate(make_prompts(), sp,
                                                                                          use_tqdm=False)]
            for arch in ("llama", "qwen3")}


def spec_llm(models, arch: str, draft: str, k: int, **kw) -> LLM:
    return LLM(models[arch], block_size=BS, speculative_model=models.get(draft, models[arch]),
               num_speculative_tokens=k, **kw)


def greedy(max_tokens: int = MAX_TOKENS, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def assert_all_blocks_free(llm: LLM) -> None:
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


# acceptance bounds: a draft equal to the target, a perturbed copy, an unrelated model (other arch too)
@pytest.mark.parametrize("arch,draft,k,lo,hi", [
    ("llama", "self", 3, 0.95, 1.0), ("llama", "near_llama", 1, 0.2, 0.95), ("llama", "near_llama", 3, 0.2, 0.95),
    ("llama", "far_llama", 2, 0.0, 0.2), ("qwen3", "near_qwen3", 4, 0.2, 0.95), ("qwen3", "far_llama", 2, 0.0, 0.2),
])
def test_greedy_matches_target_alone_with_prefix_cache(models, plain, arch, draft, k, lo, hi):
    llm = spec_llm(models, arch, draft, k)
    outs = llm.generate(make_prompts(), greedy(), use_tqdm=False)
    assert [o.output_token_ids for o in outs] == plain[arch]
    stats = llm.engine.stats()
    assert stats["spec_steps"] > 0 and lo <= stats["spec_acceptance_rate"] <= hi
    assert stats["spec_mean_accepted_length"] == pytest.approx(1 + k * stats["spec_acceptance_rate"])
    again = llm.generate(make_prompts(), greedy(), use_tqdm=False)  # prefix hits on target and draft KV
    assert [o.output_token_ids for o in again] == plain[arch]
    assert sum(o.num_cached_tokens for o in again) > 0
    assert_all_blocks_free(llm)


def test_padded_batches_match(models, plain):
    """The CUDA-graph path pads the batch to a bucket; padded rows must not touch real KV."""
    llm = spec_llm(models, "llama", "near_llama", 3)
    llm.engine.spec.runner.pad_batches = True
    outs = llm.generate(make_prompts()[:3], greedy(), use_tqdm=False)  # 3 rows padded to 4
    assert [o.output_token_ids for o in outs] == plain["llama"][:3]


def test_preemption(models, plain):
    # 8 blocks x 16 tokens cannot hold all six sequences: preemption, recompute, draft state reset
    llm = spec_llm(models, "llama", "near_llama", 2, num_kvcache_blocks=8, max_num_batched_tokens=256,
                   max_model_len=256)
    outs = llm.generate(make_prompts(), greedy(), use_tqdm=False)
    assert [o.output_token_ids for o in outs] == plain["llama"]
    stats = llm.engine.stats()
    assert stats["num_preemptions"] > 0 and stats["spec_steps"] > 0
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("cache", [True, False])
def test_chunked_prefill_mixed_steps(models, plain, cache):
    # 32-token budget: prompts arrive in chunks next to running decodes; the draft follows each chunk
    llm = spec_llm(models, "llama", "near_llama", 3, enable_chunked_prefill=True, max_num_batched_tokens=32,
                   max_num_seqs=8, max_model_len=256, enable_prefix_caching=cache)
    for _ in range(2):
        outs = llm.generate(make_prompts(), greedy(), use_tqdm=False)
        assert [o.output_token_ids for o in outs] == plain["llama"]
    stats = llm.engine.stats()
    assert stats["num_mixed_steps"] > 0 and stats["spec_steps"] > 0 and stats["spec_acceptance_rate"] > 0.2


def test_stop_token_and_max_tokens_inside_an_accepted_run(models, plain):
    llm = spec_llm(models, "llama", "self", 4)  # every proposal accepted: each step adds 5 tokens
    prompt, ref = make_prompts()[1], plain["llama"][1]
    i = next(i for i in range(2, 5) if ref[i] not in ref[:i])  # inside the first step's run (tokens 1..5)
    out = llm.generate([prompt], greedy(20, stop_token_ids=[ref[i]]), use_tqdm=False)[0]
    assert out.output_token_ids == ref[: i + 1] and out.finish_reason == "stop"
    for m in (3, 8):
        out = llm.generate([prompt], greedy(m), use_tqdm=False)[0]
        assert out.output_token_ids == ref[:m] and out.finish_reason == "length"
    assert llm.engine.stats()["spec_acceptance_rate"] > 0.95
    assert_all_blocks_free(llm)


def test_max_model_len_near_the_end(models):
    # the last steps have no room for K proposals and decode plainly
    ref = LLM(models["llama"], block_size=BS, max_model_len=40).generate(
        [list(range(3, 31))], greedy(100), use_tqdm=False)[0]
    llm = spec_llm(models, "llama", "self", 4, max_model_len=40)
    out = llm.generate([list(range(3, 31))], greedy(100), use_tqdm=False)[0]  # 28 + 1 + 5 + 5, then plain
    assert out.output_token_ids == ref.output_token_ids and len(out.output_token_ids) == 12
    assert llm.engine.stats()["spec_plain_decode_steps"] > 0


def test_auto_off_above_max_batch_then_draft_catches_up(models, plain):
    lengths = [3, 6, 10, 16, 20, 24]  # the batch shrinks from 6 to below the speculation limit of 3
    llm = spec_llm(models, "llama", "self", 2, speculative_max_batch_size=3)
    outs = llm.generate(make_prompts(), [greedy(m) for m in lengths], use_tqdm=False)
    assert [o.output_token_ids for o in outs] == [r[:m] for r, m in zip(plain["llama"], lengths)]
    stats = llm.engine.stats()
    assert stats["spec_plain_decode_steps"] > 0 and stats["spec_steps"] > 0
    assert stats["spec_acceptance_rate"] > 0.95  # the draft caught up on what it missed while off


def test_speculation_off_at_batch_limit_zero(models, plain):
    llm = spec_llm(models, "llama", "near_llama", 2, speculative_max_batch_size=0)
    outs = llm.generate(make_prompts(), greedy(), use_tqdm=False)
    assert [o.output_token_ids for o in outs] == plain["llama"]
    assert llm.engine.stats()["spec_steps"] == 0


def test_no_block_with_unverified_tokens_is_published(models, plain):
    # plain decode steps while 4+ sequences run (the draft falls behind), speculative ones after
    llm = spec_llm(models, "llama", "near_llama", 3, speculative_max_batch_size=3)
    eng = llm.engine
    prompts, lengths = make_prompts(), [14, 16, 18, 22, 24, 24]  # blocks fill during the plain phase
    truth = [p + r for p, r in zip(prompts, plain["llama"])]
    verified = {tuple(t[i * BS:(i + 1) * BS]) for t in truth for i in range(len(t) // BS)}
    seqs = [eng.add_request(p, greedy(m)) for p, m in zip(prompts, lengths)]
    rejected_any = False
    while not eng.is_finished():
        eng.step()
        bm = eng.block_manager
        for block_id in bm.hash_to_block_id.values():
            assert tuple(bm.blocks[block_id].token_ids) in verified
        for seq in eng.scheduler.running:
            assert seq.num_computed_tokens == seq.num_tokens - 1  # only verified positions count
            drafted = eng.spec.draft_state[seq][0]
            assert seq.num_published_blocks * BS <= min(seq.num_computed_tokens, drafted)
        rejected_any |= eng.spec.num_accepted_tokens < eng.spec.num_draft_tokens
    assert rejected_any and eng.spec.num_plain_decode_steps > 0
    assert [s.completion_token_ids for s in seqs] == [r[:m] for r, m in zip(plain["llama"], lengths)]


def test_kv_budget_is_split_between_target_and_draft(models):
    gib = 1 / 64
    target = LLM(models["llama"], block_size=BS, cpu_kvcache_gib=gib).engine.model_runner
    spec = spec_llm(models, "llama", "near_qwen3", 2, cpu_kvcache_gib=gib).engine
    draft = spec.spec.draft
    want = int(gib * (1 << 30)) // (target.block_bytes() + draft.block_bytes())
    assert spec.block_manager.num_blocks == want == draft.runner.kv_cache.shape[2]
    assert want < target.num_blocks


def test_profile_flag(models, monkeypatch):
    llm = spec_llm(models, "llama", "near_llama", 2)
    llm.generate(make_prompts()[:2], greedy(8), use_tqdm=False)
    assert llm.engine.spec.profiler is None and "spec_profile_ms" not in llm.engine.stats()
    monkeypatch.setenv("FLAME_SPEC_PROFILE", "1")
    llm = spec_llm(models, "llama", "near_llama", 2, speculative_max_batch_size=2)
    llm.generate(make_prompts()[:4], [greedy(m) for m in (4, 8, 30, 30)], use_tqdm=False)
    prof = llm.engine.stats()["spec_profile_ms"]
    assert {"draft", "verify", "sample", "commit", "catch_up"} <= set(prof) and all(v > 0 for v in prof.values())


@pytest.mark.parametrize("kwargs,match", [
    (dict(num_speculative_tokens=0), "num_speculative_tokens"),
    (dict(num_speculative_tokens=17), "num_speculative_tokens"),
    (dict(num_speculative_tokens=2, speculative_max_batch_size=-1), "speculative_max_batch_size"),
    (dict(speculative_model=None, num_speculative_tokens=2), "speculative_model"),
])
def test_bad_speculative_config(models, kwargs, match):
    kw = dict(speculative_model=models["near_llama"]) | kwargs
    with pytest.raises(ValueError, match=match):
        LLM(models["llama"], block_size=BS, **kw)


def test_incompatible_draft_models(models, tmp_path):
    small_vocab = make_tiny_model(str(tmp_path / "v256"), vocab_size=256)
    with pytest.raises(ValueError, match="vocab_size 256"):
        LLM(models["llama"], block_size=BS, speculative_model=small_vocab, num_speculative_tokens=2)
    short = make_tiny_model(str(tmp_path / "short"), max_position_embeddings=128)
    with pytest.raises(ValueError, match="supports 128 positions; max_model_len is 256"):
        LLM(models["llama"], block_size=BS, max_model_len=256, speculative_model=short, num_speculative_tokens=2)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLM(models["llama"], block_size=BS, speculative_model=str(tmp_path / "nope"), num_speculative_tokens=2)


# ---- sampling ------------------------------------------------------------------------------------
def tv(a: torch.Tensor, b: torch.Tensor) -> float:
    return 0.5 * (a - b).abs().sum().item()


def freq(tokens: torch.Tensor, v: int) -> torch.Tensor:
    return torch.bincount(tokens, minlength=v).double() / max(1, tokens.numel())


def test_greedy_accept():
    target = torch.tensor([[5, 6, 7, 8], [5, 6, 7, 8], [5, 6, 7, 8]])
    draft = torch.tensor([[5, 6, 7], [5, 9, 7], [1, 6, 7]])
    num, nxt = greedy_accept(target, draft)
    assert num.tolist() == [3, 1, 0] and nxt.tolist() == [8, 6, 5]


def test_rejection_sampler_is_exact():
    """Tolerance: with 200k rows each frequency has sd < 0.0012, so TV noise stays far below 0.01."""
    v, k, n = 5, 3, 200_000
    g = torch.Generator().manual_seed(0)
    p = (torch.randn(k + 1, v, generator=g) * 1.5).softmax(-1).double()
    q = (torch.randn(k, v, generator=g) * 1.5).softmax(-1).double()
    draft_ids = torch.stack([torch.multinomial(q[i], n, replacement=True, generator=g) for i in range(k)], 1)
    uniforms = torch.rand(n, k, generator=g, dtype=torch.float64)
    noise = -torch.rand(n, v, generator=g, dtype=torch.float64).log()
    num, nxt = rejection_sample(p.expand(n, -1, -1), q.expand(n, -1, -1), draft_ids, uniforms, noise)
    out = torch.cat([draft_ids, nxt[:, None]], 1)  # row r emits out[r, :num], then nxt
    for j in range(k + 1):
        rows = num >= j  # rows that emit a token at position j: j proposals accepted before it
        tok = torch.where(num[rows] > j, out[rows, j], nxt[rows])
        assert tv(freq(tok, v), p[j]) < 0.01 + 0.01 * (j == k), f"position {j}"
    assert (num >= 1).double().mean().item() == pytest.approx(torch.minimum(p[0], q[0]).sum().item(), abs=0.01)
    assert tv(freq(draft_ids[:, 0], v), p[0]) > 0.1  # the check can tell the draft's q from p


def test_rejection_sampler_when_p_equals_q():
    p = torch.tensor([[0.5, 0.3, 0.2]] * 3).expand(4000, -1, -1)
    q = p[:, :2]
    ids = torch.zeros(4000, 2, dtype=torch.int64)
    num, _ = rejection_sample(p, q, ids, torch.rand(4000, 2), torch.empty(4000, 3).exponential_())
    assert num.tolist() == [2] * 4000  # p == q: nothing is rejected
    # u = 1 rejects anyway (a rounding artefact); with no residual mass the token comes from p, not NaN
    num, nxt = rejection_sample(p, q, ids, torch.ones(4000, 2), torch.empty(4000, 3).exponential_())
    assert num.tolist() == [0] * 4000
    assert tv(freq(nxt, 3), torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)) < 0.04


@torch.no_grad()
def exact_marginals(path: str, prompt: list[int], v: int, temperature: float, top_k: int) -> list[torch.Tensor]:
    """Marginal distributions of output tokens 1..3 of the model at this temperature/top-k."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()
    tk = torch.tensor([top_k])

    def dist(contexts: list[list[int]]) -> torch.Tensor:
        logits = model(torch.tensor(contexts)).logits[:, -1] / temperature
        return apply_top_k_top_p(logits, tk.expand(len(contexts)), None).softmax(-1)

    p1 = dist([prompt])[0]
    p2 = dist([prompt + [a] for a in range(v)])  # [t1, t2]
    p3 = dist([prompt + [a, b] for a in range(v) for b in range(v)]).view(v, v, v)
    joint2 = p1[:, None] * p2
    return [p1, joint2.sum(0), (joint2[:, :, None] * p3).sum((0, 1))]


def test_sampled_outputs_follow_the_target_distribution(tmp_path):
    """End to end on a 16-token vocabulary: 2000 seeded requests, K=2, so tokens 2 and 3 come from
    accepted proposals, residual draws and bonus tokens. Tolerance 0.08 TV: the sampling noise of 2000
    draws over 16 outcomes is at most ~0.035; the draft's own marginals are >0.2 away."""
    v, n, temperature, top_k = 16, 2000, 1.0, 12
    target = make_tiny_model(str(tmp_path / "t"), vocab_size=v, std=0.25)
    draft = make_tiny_model(str(tmp_path / "d"), vocab_size=v, std=0.25, seed=1)
    prompt = [5, 9, 3, 12, 7]
    llm = LLM(target, block_size=BS, speculative_model=draft, num_speculative_tokens=2, max_num_seqs=n,
              speculative_max_batch_size=n, max_num_batched_tokens=8 * n, max_model_len=64)
    params = [SamplingParams(temperature=temperature, top_k=top_k, max_tokens=3, ignore_eos=True, seed=i)
              for i in range(n)]
    outs = torch.tensor([o.output_token_ids for o in llm.generate([prompt] * n, params, use_tqdm=False)])
    stats = llm.engine.stats()
    assert 0.05 < stats["spec_acceptance_rate"] < 0.95  # both accepted and rejected proposals occurred
    want = exact_marginals(target, prompt, v, temperature, top_k)
    draft_marginals = exact_marginals(draft, prompt, v, temperature, top_k)
    for j in range(3):
        assert tv(freq(outs[:, j], v), want[j]) < 0.08, f"token {j + 1}"
    assert tv(want[1], draft_marginals[1]) > 0.2 and tv(want[2], draft_marginals[2]) > 0.2
    # seeded requests are reproducible, alone or in a batch
    again = llm.generate([prompt] * 8, params[:8], use_tqdm=False)
    assert [o.output_token_ids for o in again] == outs[:8].tolist()
    alone = llm.generate([prompt], params[5:6], use_tqdm=False)[0]
    assert alone.output_token_ids == outs[5].tolist()


# ---- GPU (skipped without CUDA): graphs, padding and Triton attention on the real path -------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("eager", [True, False])
def test_gpu_speculative_matches_target(models, eager):
    kw = dict(dtype="float32", attention_backend="triton", block_size=BS, num_kvcache_blocks=1024)
    prompts = make_prompts()
    ref = LLM(models["llama"], enforce_eager=True, **kw).generate(prompts, greedy(), use_tqdm=False)
    llm = LLM(models["llama"], speculative_model=models["near_llama"], num_speculative_tokens=3,
              enforce_eager=eager, **kw)
    assert llm.engine.spec.runner.use_graphs == (not eager)
    for _ in range(2):  # the second pass hits the prefix cache
        outs = llm.generate(prompts, greedy(), use_tqdm=False)
        assert [o.output_token_ids for o in outs] == [r.output_token_ids for r in ref]
    sp = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, seed=3, ignore_eos=True)
    a = llm.generate(prompts, sp, use_tqdm=False)
    b = llm.generate(prompts, sp, use_tqdm=False)
    assert [o.output_token_ids for o in a] == [o.output_token_ids for o in b]
    assert llm.engine.stats()["spec_steps"] > 0


def test_bench_draft_pair_sets_the_acceptance(models):
    """bench/engine/draft_model.py: the measured acceptance follows the set agreement a (K=2: (a + a^2) / 2)."""
    from bench.engine.draft_model import scale_layers, set_agreement, set_head, shape_pair

    llm = spec_llm(models, "llama", "far_llama", 2)
    eng = llm.engine
    pi = shape_pair(eng.model_runner.model, eng.spec.draft.model, agreement=1.0)
    plain_llm = LLM(models["llama"], block_size=BS)
    scale_layers(plain_llm.engine.model_runner.model)
    set_head(plain_llm.engine.model_runner.model, pi)
    prompts = [[3 + i, 40 + i] for i in range(8)]
    ref = [o.output_token_ids for o in plain_llm.generate(prompts, greedy(40), use_tqdm=False)]
    assert all(r[1:] == pi[r[:-1]].tolist() for r in ref)  # the target walks pi
    for agreement, lo, hi in ((1.0, 1.0, 1.0), (0.7, 0.45, 0.75), (0.0, 0.0, 0.0)):
        set_agreement(eng.spec.draft.model, pi, agreement)
        eng.spec.reset_stats()
        outs = llm.generate(prompts, greedy(40), use_tqdm=False)
        assert [o.output_token_ids for o in outs] == ref
        assert lo <= eng.stats()["spec_acceptance_rate"] <= hi, agreement
