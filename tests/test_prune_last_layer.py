"""Config.prune_last_layer: eager steps run the last decoder layer past its K/V store on the sampled rows only
(issue 19). The outputs must not change: greedy tokens equal the flag off and transformers, the sampled rows'
logits equal the unpruned ones, and every row's K/V is still stored (a mutation that stores only the kept rows
is caught). CPU, fp32, real tiny checkpoints through the real loader."""
import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # the triton backend's kept-row path on CPU; must precede triton imports

import pytest  # noqa: E402
from helpers import MAX_TOKENS, make_prompts  # noqa: E402

from flame_llm import LLM, SamplingParams  # noqa: E402
from flame_llm.config import SCHEDULER_FEATURES_OFF, Config  # noqa: E402
from flame_llm.kernels.metadata import AttentionMetadata, get_context, set_context  # noqa: E402
from flame_llm.layers.attention import Attention  # noqa: E402
from flame_llm.models.llama import DecoderAttention  # noqa: E402

SP = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
# a 32-token budget: the 70- and 49-token prompts prefill over several chunks (middle chunks sample nothing)
# and share steps with other sequences' decodes (mixed steps). FIFO admission (the other scheduler features off):
# the second round's uncached 100-token prompt, sent first, then runs alone in its first steps
CHUNKED = dict(SCHEDULER_FEATURES_OFF, block_size=16, enable_chunked_prefill=True, max_num_batched_tokens=32,
               max_num_seqs=8, max_model_len=256)


class Calls:
    """Records how the runner calls the model: keep_rows absent, empty, or some rows of the step."""

    def __init__(self, llm: LLM) -> None:
        self.plain = self.empty = self.kept = self.pruned_rows = 0
        model = llm.engine.model_runner.model
        inner = model.forward

        def forward(input_ids, positions, *args, **kw):
            keep = kw.get("keep_rows", args[0] if args else None)
            if keep is None:
                self.plain += 1
                assert not args and not kw, "flag off: the model is called as before"
                assert get_context().kept is None
            elif keep.shape[0] == 0:
                self.empty += 1
            else:
                self.kept += 1
                self.pruned_rows += input_ids.shape[0] - keep.shape[0]
            out = inner(input_ids, positions, *args, **kw)
            assert out.shape[0] == (input_ids.shape[0] if keep is None else keep.shape[0])
            return out

        model.forward = forward


def _generate(path: str, prune: bool, **kw) -> tuple[list[list[int]], list[list[int]], Calls]:
    """Greedy outputs of make_prompts(), then of the same again (prefix-cache hits) with a 100-token prompt
    beside them (alone in its first steps: chunks that sample nothing and share their step with no one)."""
    llm = LLM(path, prune_last_layer=prune, **{**CHUNKED, **kw})
    calls = Calls(llm)
    prompts = make_prompts()
    first = [o.output_token_ids for o in llm.generate(prompts, SP, use_tqdm=False)]
    again = llm.generate([list(range(200, 300))] + prompts, SP, use_tqdm=False)
    assert sum(o.num_cached_tokens for o in again) > 0
    return first, [o.output_token_ids for o in again], calls


# qwen3 differs in its q/k norms, which asynchronous scheduling does not touch: llama runs both schedules
@pytest.mark.parametrize("arch,async_scheduling", [("llama", False), ("llama", True), ("qwen3", False)])
def test_greedy_identical_on_off_and_to_transformers(arch, async_scheduling, reference, tiny_llama, tiny_qwen3):
    path = tiny_llama if arch == "llama" else tiny_qwen3
    on, on_again, calls = _generate(path, True, async_scheduling=async_scheduling)
    off, off_again, off_calls = _generate(path, False, async_scheduling=async_scheduling)
    assert on == off == on_again[1:] == off_again[1:] == reference[arch]
    assert on_again[0] == off_again[0]
    assert calls.plain == 0 and calls.kept > 0 and calls.pruned_rows > 0
    assert calls.empty > 0, "a middle chunk of a long prompt samples nothing: the last layer stops at its store"
    assert off_calls.plain > 0 and off_calls.kept == off_calls.empty == 0


def test_sampled_rows_logits_equal_unpruned(tiny_qwen3):
    """The logits of every sampled row, step by step, equal the unpruned forward's (fp32: to rounding)."""
    logits = {}
    for prune in (False, True):
        llm = LLM(tiny_qwen3, prune_last_layer=prune, **CHUNKED)
        runner, seen = llm.engine.model_runner, []
        inner = runner.compute_logits
        runner.compute_logits = lambda h, inner=inner, seen=seen: seen.append(inner(h)) or seen[-1]
        llm.generate(make_prompts(), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
        logits[prune] = seen
    assert len(logits[True]) == len(logits[False]) > 0
    for a, b in zip(logits[True], logits[False]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_step_whose_middle_segment_samples_nothing(tiny_qwen3, backend):
    """One hand-built step: a full prompt, a first chunk that samples nothing, a short prompt, a chunk over 16
    cached keys. The pruned forward's hidden states are the unpruned forward's rows at logits_rows, and the kept
    rows' metadata are their own sequences' (not the step's first S)."""
    from flame_llm.engine.sequence import Sequence

    llm = LLM(tiny_qwen3, block_size=16, num_kvcache_blocks=32, max_model_len=256, attention_backend=backend,
              enforce_eager=True, cuda_graph_mixed_tokens=0)
    runner = llm.engine.model_runner
    sp = SamplingParams(temperature=0, max_tokens=4)
    seqs = [Sequence(list(range(3 + i, 3 + i + n)), sp, 16) for i, n in enumerate((20, 50, 10, 40))]
    for seq, table in zip(seqs, ([0, 1], [2, 3, 4, 5], [6], [7, 8, 9])):
        seq.block_table = table
    x = runner.prepare(seqs, [20, 30, 10, 24], [0, 0, 0, 16])
    assert x.sample_idx == [0, 2, 3]
    with torch.inference_mode():
        full = runner.upload(x)
        assert full.meta.kept is None
        ref = runner.forward(full)[full.logits_rows]
        dev = runner.upload(x, prune=True)
        kept = dev.meta.kept
        assert kept.is_decode and kept.seq_lens.tolist() == [20, 10, 40] and kept.max_seqlen_k == 40
        assert kept.block_tables.tolist() == [[0, 1, 0, 0], [6, 0, 0, 0], [7, 8, 9, 0]]
        out = runner.forward(dev, prune=True)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_storing_only_the_kept_rows_is_caught(tiny_llama, reference, monkeypatch):
    """The mutation the tests above must catch: the last layer storing the K/V of its kept rows alone (later
    tokens then read keys that were never written)."""

    def kept_only_store(self, positions, x, keep_rows):
        q, k, v = self._qkv(positions, x)
        meta = get_context()
        set_context(AttentionMetadata(meta.cu_seqlens_q, meta.seq_lens, meta.block_tables,
                                      meta.slot_mapping[keep_rows], meta.max_seqlen_q, meta.max_seqlen_k,
                                      kept=meta.kept))
        try:
            o = self.attn.forward_kept(q[keep_rows], k[keep_rows], v[keep_rows])
        finally:
            set_context(meta)
        return None if o.shape[0] == 0 else self.o_proj(o.flatten(1, -1))

    monkeypatch.setattr(DecoderAttention, "forward_kept", kept_only_store)
    on, _, _ = _generate(tiny_llama, True)
    assert on != reference["llama"]


def test_speculative_decoding_with_the_flag(tiny_llama, reference):
    """The target's prefill steps prune (each sequence samples at most one row there); the verify and draft
    forwards call the model without keep_rows; tokens equal transformers'."""
    llm = LLM(tiny_llama, speculative_model=tiny_llama, num_speculative_tokens=3, prune_last_layer=True, **CHUNKED)
    calls = Calls(llm)
    outs = llm.generate(make_prompts(), SP, use_tqdm=False)
    assert [o.output_token_ids for o in outs] == reference["llama"]
    assert calls.kept > 0 and calls.plain > 0


def test_triton_backend_kept_rows(tiny_llama):
    """The triton backend's kept rows (our decode kernel; the interpreter on CPU): tokens equal the torch
    backend's, pruned or not."""
    prompts = [list(range(100, 170)), make_prompts()[1]]
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    outs = {}
    for backend, prune in (("triton", True), ("triton", False), ("torch", True)):
        llm = LLM(tiny_llama, attention_backend=backend, prune_last_layer=prune, dtype="float32",
                  num_kvcache_blocks=64, cuda_graph_mixed_tokens=0, enforce_eager=True, **CHUNKED)
        outs[backend, prune] = [o.output_token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    assert outs["triton", True] == outs["triton", False] == outs["torch", True]


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 2), (8, 1)])
def test_forward_kept_triton_equals_torch(num_heads, num_kv_heads):
    """Attention.forward_kept on the triton backend and on the torch one: the same caches after the store (every
    row's K/V) and the same outputs of the kept rows (the last query of each sampling segment)."""
    g = torch.Generator().manual_seed(0)
    hd, bs, nblocks = 16, 16, 12
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    q_lens, starts = [5, 1, 33, 7], [0, 40, 3, 16]  # a fresh chunk, a decode, chunks over cached keys
    tables = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 0], [11, 3, 2, 1]], dtype=torch.int32)
    seq_lens = [s + n for s, n in zip(starts, q_lens)]
    slots = torch.cat([tables[i, torch.arange(s, s + n) // bs].long() * bs + torch.arange(s, s + n) % bs
                       for i, (s, n) in enumerate(zip(starts, q_lens))])
    t = sum(q_lens)
    q = torch.randn(t, num_heads, hd, generator=g)
    k, v = (torch.randn(t, num_kv_heads, hd, generator=g) for _ in range(2))
    cache0 = torch.randn(2, nblocks, bs, num_kv_heads, hd, generator=g)
    sampled = [0, 1, 3]  # the third segment is a middle chunk: no kept row
    cu = torch.tensor([0] + q_lens).cumsum(0)
    keep = (cu[1:] - 1)[sampled]
    i32 = dict(dtype=torch.int32, device=dev)
    kept = AttentionMetadata(torch.arange(len(sampled) + 1, **i32), torch.tensor(seq_lens, **i32)[sampled],
                             tables.to(dev)[sampled], slots[:0].to(dev), 1, max(seq_lens), is_decode=True)
    meta = AttentionMetadata(cu.to(**i32), torch.tensor(seq_lens, **i32), tables.to(dev), slots.to(dev),
                             max(q_lens), max(seq_lens), kept=kept)
    outs, caches = {}, {}
    for backend in ("triton", "torch"):
        layer = Attention(num_heads, num_kv_heads, hd, hd**-0.5)
        layer.set_backend(backend)
        cache = cache0.clone().to(dev)
        layer.k_cache, layer.v_cache = cache[0], cache[1]
        set_context(meta)
        try:
            outs[backend] = layer.forward_kept(q.to(dev)[keep.to(dev)], k.to(dev), v.to(dev)).cpu()
            assert layer.forward_kept(q[:0].to(dev), k.to(dev), v.to(dev)).shape[0] == 0  # stores, attends none
        finally:
            set_context(None)
        caches[backend] = cache.cpu()
    torch.testing.assert_close(caches["triton"], caches["torch"], rtol=0, atol=0)
    expect = cache0.clone()
    expect[0].view(-1, num_kv_heads, hd)[slots], expect[1].view(-1, num_kv_heads, hd)[slots] = k, v
    torch.testing.assert_close(caches["torch"], expect, rtol=0, atol=0)
    torch.testing.assert_close(outs["triton"], outs["torch"], rtol=2e-5, atol=2e-5)
    assert outs["torch"].shape == (len(sampled), num_heads, hd)


def test_flag_default_on_and_bad_values_name_the_field(tiny_llama):
    assert Config.from_kwargs(tiny_llama).runner_config.prune_last_layer is True
    for bad in ("yes", 1, None):
        with pytest.raises(ValueError, match="prune_last_layer"):
            Config.from_kwargs(tiny_llama, prune_last_layer=bad)


def test_flag_ab_bench_runs_on_a_tiny_model(tmp_path):
    """bench.engine.flag_ab (the GPU A/B's offline half) runs on CPU, in this
    process, and finds the same tokens in both modes; a bad --on value is refused."""
    import json

    from bench.engine import flag_ab

    out = tmp_path / "ab.json"
    assert flag_ab.main(["--flag", "prune_last_layer", "--model", "tiny", "--prompts", "3", "--prompt-tokens", "100",
                         "--output-tokens", "4", "--max-num-batched-tokens", "64", "--rounds", "2",
                         "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert (res["flag"], res["on"], res["off"]) == ("prune_last_layer", True, False)
    assert res["order"] == ["off", "prune"] and res["summary"]["prune"]["tokens_equal"]
    assert res["summary"]["off"]["tokens_equal"] and res["rounds"]["prune"][0]["prefill_steps"] > 0
    with pytest.raises(SystemExit):
        flag_ab.main(["--flag", "prune_last_layer", "--on", "maybe"])
