"""Config.mlp_row_split_tokens on a GPU (skipped with a reason elsewhere). Llama-3.1-8B shapes (dummy weights, bf16):
steps of 8,192 tokens run gate/up as two 4,096-row GEMMs, and the greedy tokens and a step's hidden states are
identical to the unsplit engine's (bench.gemm_probe found the halves' products bitwise equal to the whole). Qwen3-0.6B
shapes with a 16-row threshold: building the engine (decode and mixed-step graph capture) never splits, and steps
that replay a graph do not either; only eager steps do."""
import os

import pytest
import torch

import flame_llm.layers.layers as layers
from flame_llm import LLM, SamplingParams
from flame_llm.engine.sequence import Sequence
from flame_llm.models.llama import set_mlp_row_split

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
MODELS = os.path.join(os.path.dirname(__file__), "..", "configs", "models")
SP = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def _spy(monkeypatch) -> list[int]:
    """The row count of every linear_rows call from now on."""
    calls, inner = [], layers.linear_rows

    def linear_rows(x, weight, bias, rows):
        calls.append(x.shape[0])
        return inner(x, weight, bias, rows)

    monkeypatch.setattr(layers, "linear_rows", linear_rows)
    return calls


def _prompts(n: int, length: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(length)
    return [torch.randint(3, vocab, (length,), generator=g).tolist() for _ in range(n)]


def test_llama_8b_shapes_8192_token_steps_identical(monkeypatch):
    calls = _spy(monkeypatch)
    # two 8,256-token prompts, chunked at 8,192: the first two steps hold 8,192 tokens each
    llm = LLM(os.path.join(MODELS, "llama-3.1-8b"), load_format="dummy", enable_chunked_prefill=True,
              max_num_batched_tokens=8192, max_num_seqs=64, max_model_len=16384, enable_prefix_caching=False,
              num_kvcache_blocks=192, mlp_row_split_tokens=4096)
    assert calls == [], "building the engine (graph capture) split a GEMM"
    runner = llm.engine.model_runner
    prompts = _prompts(2, 8256, llm.engine.vocab_size)
    tokens = {}
    for split in (4096, 0, 4096):
        set_mlp_row_split(runner.model, split)
        n = len(calls)
        tokens.setdefault(split, []).append([o.output_token_ids for o in llm.generate(prompts, SP, use_tqdm=False)])
        assert (calls[n:].count(8192) > 0) == (split > 0), (split, calls[n:][:8])
    assert tokens[4096][0] == tokens[0][0] == tokens[4096][1]
    # one 8,192-row step's hidden states, whole and split
    s = Sequence(prompts[0][:8192], SamplingParams(temperature=0, max_tokens=1), runner.block_size)
    s.block_table = list(range(len(s.token_ids) // runner.block_size))
    x = runner.prepare([s], [8192], [0])
    hidden = {}
    with torch.inference_mode():
        for split in (0, 4096):
            set_mlp_row_split(runner.model, split)
            hidden[split] = runner.forward(runner.upload(x)).float()
    diff = (hidden[4096] - hidden[0]).abs().max().item()
    assert torch.equal(hidden[4096], hidden[0]), f"split hidden states differ by up to {diff}"


def test_graph_steps_never_split(monkeypatch):
    calls = _spy(monkeypatch)
    llm = LLM(os.path.join(MODELS, "qwen3-0.6b"), load_format="dummy", enable_chunked_prefill=True,
              max_num_batched_tokens=2048, max_num_seqs=16, max_model_len=4096, num_kvcache_blocks=256,
              mlp_row_split_tokens=16)
    runner = llm.engine.model_runner
    assert calls == [], "building the engine (graph capture) split a GEMM"
    assert runner.use_graphs and runner.mixed is not None and runner.mixed.max_tokens >= 8 * 40
    vocab = llm.engine.vocab_size
    # 40-token prompts: prefill steps of <= 320 tokens replay mixed-step graphs, decodes the decode graphs
    llm.generate(_prompts(8, 40, vocab), SP, use_tqdm=False)
    assert calls == [], "a graph-replayed step split a GEMM"
    # a prompt larger than every mixed-step graph runs eagerly, and splits
    llm.generate(_prompts(1, runner.mixed.max_tokens + 100, vocab), SP, use_tqdm=False)
    assert calls and all(m > 16 for m in calls)
