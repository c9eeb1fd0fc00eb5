"""Greedy outputs are token-identical to transformers' generate, across cache settings."""

import pytest
from helpers import MAX_TOKENS, make_prompts

from flame_llm import LLM, SamplingParams

CASES = [
    dict(block_size=16, enable_prefix_caching=True),
    dict(block_size=16, enable_prefix_caching=False),
    dict(block_size=256, enable_prefix_caching=True),
    # 10 blocks x 16 tokens cannot hold all six sequences at once: forces preemption and recompute
    dict(block_size=16, enable_prefix_caching=True, num_kvcache_blocks=10, max_num_batched_tokens=256,
         max_model_len=256),
]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("case", CASES, ids=["bs16-cache", "bs16-nocache", "bs256-cache", "preempt"])
def test_greedy_matches_transformers(arch, case, reference, tiny_llama, tiny_qwen3):
    path = tiny_llama if arch == "llama" else tiny_qwen3
    llm = LLM(path, **case)
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    prompts = make_prompts()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    assert [o.output_token_ids for o in outs] == reference[arch]
    assert all(o.finish_reason == "length" for o in outs)
    assert len(set(reference[arch][3])) > MAX_TOKENS // 2  # the model does not just repeat a token
    stats = llm.engine.stats()
    if "num_kvcache_blocks" in case:
        assert stats["num_preemptions"] > 0
    # a second pass over the same prompts hits the prefix cache and still matches
    again = llm.generate(prompts, sp, use_tqdm=False)
    assert [o.output_token_ids for o in again] == reference[arch]
    cached = sum(o.num_cached_tokens for o in again)
    if case["enable_prefix_caching"] and case["block_size"] == 16 and "num_kvcache_blocks" not in case:
        assert cached > 0
        assert again[3].num_cached_tokens == 64  # 70 tokens: four full blocks of 16
    if not case["enable_prefix_caching"]:
        assert cached == 0


def test_fully_cached_block_aligned_prompt_still_computes_last_token(tiny_llama, reference):
    llm = LLM(tiny_llama, block_size=16)
    prompt = make_prompts()[4][:48]  # exactly three blocks
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    first = llm.generate([prompt], sp, use_tqdm=False)[0]
    second = llm.generate([prompt], sp, use_tqdm=False)[0]
    assert second.output_token_ids == first.output_token_ids
    assert second.num_cached_tokens == 32  # the block holding the last token is recomputed


def test_stop_tokens_and_max_tokens(tiny_llama, reference):
    llm = LLM(tiny_llama, block_size=16)
    prompt = make_prompts()[1]
    ref = reference["llama"][1]
    stop = ref[5]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop]),
                       use_tqdm=False)[0]
    assert out.output_token_ids == ref[: ref.index(stop) + 1] and out.finish_reason == "stop"
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)[0]
    assert out.output_token_ids == ref[:3] and out.finish_reason == "length"


def test_max_model_len_caps_output(tiny_llama):
    llm = LLM(tiny_llama, block_size=16, max_model_len=40)
    out = llm.generate([list(range(3, 33))], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True),
                       use_tqdm=False)[0]
    assert len(out.output_token_ids) == 10 and out.finish_reason == "length"


def test_seeded_sampling_is_reproducible_and_batch_independent(tiny_llama):
    llm = LLM(tiny_llama, block_size=16)
    prompts = make_prompts()
    sp = SamplingParams(temperature=1.0, top_k=50, max_tokens=12, seed=1234, ignore_eos=True)
    alone = llm.generate([prompts[2]], sp, use_tqdm=False)[0].output_token_ids
    batched = llm.generate(prompts, sp, use_tqdm=False)[2].output_token_ids
    assert alone == batched
    other = llm.generate([prompts[2]], SamplingParams(temperature=1.0, top_k=50, max_tokens=12, seed=99,
                                                      ignore_eos=True), use_tqdm=False)[0].output_token_ids
    assert other != alone


@pytest.mark.parametrize("prompt,kwargs,match", [
    ([], {}, "empty"),
    ([1, 2, 512], {}, "vocab_size=512"),
    ([-1, 2], {}, "vocab_size"),
    ([1.5, 2], {}, "integers"),
    (list(range(3, 300)), {}, "max_model_len"),
])
def test_bad_requests_raise_and_accept_nothing(tiny_llama, prompt, kwargs, match):
    llm = LLM(tiny_llama, block_size=16, max_model_len=256)
    with pytest.raises(ValueError, match=match):
        llm.generate([[5, 6, 7], prompt], SamplingParams(max_tokens=2), use_tqdm=False)
    assert llm.engine.is_finished()  # the good prompt before it was not admitted either


def test_request_larger_than_kv_pool_is_rejected(tiny_llama):
    llm = LLM(tiny_llama, block_size=16, num_kvcache_blocks=4, max_num_batched_tokens=512, max_model_len=512)
    with pytest.raises(ValueError, match="KV blocks"):
        llm.generate([list(range(3, 60))], SamplingParams(max_tokens=16), use_tqdm=False)


def test_text_prompt_without_tokenizer_is_a_clear_error(tiny_llama):
    llm = LLM(tiny_llama, block_size=16)
    with pytest.raises(ValueError, match="tokenizer"):
        llm.generate(["hello"], SamplingParams(max_tokens=2), use_tqdm=False)


def _add_word_tokenizer(model_dir: str) -> None:
    """A real (if tiny) fast tokenizer saved beside the checkpoint: word "w<i>" is token i."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(512)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0").save_pretrained(model_dir)


def test_text_prompts_with_a_tokenizer(tiny_llama, tmp_path):
    import shutil

    d = str(tmp_path / "with-tokenizer")
    shutil.copytree(tiny_llama, d)
    _add_word_tokenizer(d)
    llm = LLM(d, block_size=16)
    sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    by_text = llm.generate(["w5 w6 w7 w8 w9"], sp, use_tqdm=False)[0]
    by_ids = llm.generate([[5, 6, 7, 8, 9]], sp, use_tqdm=False)[0]
    assert by_text.prompt_token_ids == [5, 6, 7, 8, 9]
    assert by_text.output_token_ids == by_ids.output_token_ids
    assert by_text.text.split() == [f"w{t}" for t in by_text.output_token_ids]
