"""Config.cuda_graph_mixed_tokens: steps with prefill tokens padded to a token bucket and run with a fixed attention
launch (engine/mixed_graphs.py). On CPU the padded forward runs eagerly (our Triton kernel under the interpreter), so
the padding, the empty segments and the fixed grid are checked token for token against unpadded steps; on a GPU the
same checks replay the captured graphs."""
import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
from helpers import make_prompts  # noqa: E402

from flame_llm import LLM, SamplingParams  # noqa: E402
from flame_llm.config import SCHEDULER_FEATURES_OFF, Config  # noqa: E402
from flame_llm.engine.mixed_graphs import token_buckets  # noqa: E402
from flame_llm.kernels.triton_attention import mixed_launch, reachable_configs, split_choices  # noqa: E402

SP = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def _engine(model: str, mixed: int, **kw) -> LLM:
    # fp32 + our Triton kernel on both sides, so only the step path differs; a small token budget makes the
    # prompts' chunks share steps with decodes (mixed steps), some above the graphs' bucket, some below. FIFO
    # admission (the other scheduler features off): the steps _prompts() was laid out for
    base = dict(SCHEDULER_FEATURES_OFF, block_size=16, num_kvcache_blocks=128, dtype="float32",
                attention_backend="triton", enable_chunked_prefill=True, max_num_batched_tokens=96, max_num_seqs=8,
                max_model_len=256)
    return LLM(model, cuda_graph_mixed_tokens=mixed, **{**base, **kw})


def _prompts() -> list[list[int]]:
    shared = list(range(3, 35))  # two full blocks shared: the second round's prefill starts from cached keys
    # the first prompt's 96-token chunk spans several query tiles of the 96-token graph (a grid too small for
    # its bucket leaves rows unattended); the others share steps with its decodes and its last chunk
    return [list(range(100, 200))] + make_prompts()[:3] + [shared + [7, 8, 9], shared + [11, 12]]


def test_padded_mixed_steps_give_the_same_tokens(tiny_llama):
    """Greedy tokens with mixed steps padded into 16..64-token buckets equal the unpadded engine's, prefix hits and
    asynchronous scheduling's pending rows included; the padded path ran. One unpadded reference (synchronous:
    asynchronous scheduling does not change greedy tokens) for both schedules of the padded engine."""
    prompts = _prompts()
    ref = _engine(tiny_llama, 0, async_scheduling=False)
    assert ref.engine.model_runner.mixed is None  # off: the runner's step path is the one it had before
    want = [o.output_token_ids for o in ref.generate(prompts, SP, use_tqdm=False)]
    again = [o.output_token_ids for o in ref.generate(prompts, SP, use_tqdm=False)]  # now with cached prefixes
    for async_scheduling in (False, True):
        llm = _engine(tiny_llama, 64, async_scheduling=async_scheduling)
        assert llm.engine.async_scheduling is async_scheduling
        mixed = llm.engine.model_runner.mixed
        assert mixed is not None and mixed.buckets == [16, 32, 64]
        got = [o.output_token_ids for o in llm.generate(prompts, SP, use_tqdm=False)]
        got_again = [o.output_token_ids for o in llm.generate(prompts, SP, use_tqdm=False)]
        assert got == want and got_again == again, f"async_scheduling={async_scheduling}"
        assert mixed.replays > 0


def test_qwen3_padded_mixed_steps(tiny_qwen3):
    prompts = _prompts()
    want = [o.output_token_ids for o in _engine(tiny_qwen3, 0).generate(prompts, SP, use_tqdm=False)]
    llm = _engine(tiny_qwen3, 128)
    assert [o.output_token_ids for o in llm.generate(prompts, SP, use_tqdm=False)] == want
    assert llm.engine.model_runner.mixed.replays > 0


def test_buckets_are_capped_by_the_token_budget(tiny_llama):
    llm = _engine(tiny_llama, 4096, max_num_seqs=24)  # above max_num_batched_tokens (96)
    mixed = llm.engine.model_runner.mixed
    assert mixed.max_tokens == 96 and mixed.buckets == [16, 32, 64, 96]
    assert mixed.seats == {16: 16, 32: 24, 64: 24, 96: 24}  # no more segments than tokens or max_num_seqs


def test_token_buckets_and_launches():
    assert token_buckets(512) == [16, 32, 64, 128, 256, 512]
    assert token_buckets(300) == [16, 32, 64, 128, 256, 300]
    assert token_buckets(8) == [8]
    # past 512 every 256 tokens (a compute-bound step padded to a power of two could run twice its length)
    assert token_buckets(2048) == [16, 32, 64, 128, 256, 512, 768, 1024, 1280, 1536, 1792, 2048]
    assert token_buckets(1000) == [16, 32, 64, 128, 256, 512, 768, 1000]
    assert len(token_buckets(8192)) == 6 + 29 + 1
    for t in token_buckets(8192):
        cfg, splits = mixed_launch(t, 4)
        # a variant the startup warmup compiles (no JIT under load), splits a power of two
        assert cfg in reachable_configs(4) and splits in split_choices()
    assert mixed_launch(16, 4)[1] == 8 and mixed_launch(512, 4)[1] == 2 and mixed_launch(4096, 4)[1] == 1


def test_the_default_is_on_only_where_decode_steps_replay_graphs(tiny_llama):
    """None (the default): MIXED_GRAPH_TOKENS with CUDA graphs; off where steps run eagerly (CPU), so CPU engines on
    the Triton kernel keep their step path."""
    from flame_llm.config import MIXED_GRAPH_TOKENS
    llm = LLM(tiny_llama, block_size=16, num_kvcache_blocks=128, dtype="float32", attention_backend="triton",
              max_num_batched_tokens=1024, max_model_len=1024)
    runner = llm.engine.model_runner
    assert runner.config.runner_config.cuda_graph_mixed_tokens is None
    if runner.use_graphs:
        assert runner.mixed.max_tokens == MIXED_GRAPH_TOKENS
    else:
        assert runner.mixed is None


def test_the_torch_backend_and_enforce_eager_leave_it_off(tiny_llama):
    llm = LLM(tiny_llama, block_size=16, num_kvcache_blocks=16, device="cpu", cuda_graph_mixed_tokens=64)
    assert llm.engine.model_runner.backend == "torch" and llm.engine.model_runner.mixed is None
    llm = _engine(tiny_llama, 64, enforce_eager=True)
    assert llm.engine.model_runner.mixed is None


@pytest.mark.parametrize("bad", [-1, 1.5, True, "64"])
def test_a_bad_value_is_refused_naming_the_field(tiny_llama, bad):
    with pytest.raises(ValueError, match="cuda_graph_mixed_tokens"):
        Config.from_kwargs(tiny_llama, cuda_graph_mixed_tokens=bad)
