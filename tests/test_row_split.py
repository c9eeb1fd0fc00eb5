"""Config.mlp_row_split_tokens (issue 19): eager steps run the MLP's gate/up GEMM as row blocks written into one
output. Outputs must not change at all: linear_rows equals F.linear bitwise, the engine's greedy tokens and a step's
logits equal the flag off's (Llama and Qwen3, chunked prefill and mixed steps), and with the flag off the split
is never called. CPU, fp32, real tiny checkpoints through the real loader; tests/test_gpu_row_split.py runs the
8,192-token steps on a GPU."""
import pytest
import torch
import torch.nn.functional as F
from helpers import MAX_TOKENS, make_prompts

import flame_llm.layers.layers as layers
from flame_llm import LLM, SamplingParams
from flame_llm.config import Config, EngineConfig
from flame_llm.engine.sequence import Sequence
from flame_llm.models.llama import MLP, set_mlp_row_split

SP = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
# a 64-token budget: the 70-token prompt prefills over two chunks and steps mix prefill chunks with decodes
CHUNKED = dict(block_size=16, enable_chunked_prefill=True, max_num_batched_tokens=64, max_num_seqs=8,
               max_model_len=256, num_kvcache_blocks=256)


class Spy:
    """Counts linear_rows calls and the row blocks each split into (torch.mm / addmm calls)."""

    def __init__(self, monkeypatch) -> None:
        self.calls, self.blocks = [], []
        inner, mm, addmm = layers.linear_rows, torch.mm, torch.addmm

        def linear_rows(x, weight, bias, rows):
            self.calls.append((x.shape[0], rows))
            return inner(x, weight, bias, rows)

        def spy_mm(a, b, *args, **kw):
            self.blocks.append(a.shape[0])
            return mm(a, b, *args, **kw)

        def spy_addmm(c, a, b, *args, **kw):
            self.blocks.append(a.shape[0])
            return addmm(c, a, b, *args, **kw)

        monkeypatch.setattr(layers, "linear_rows", linear_rows)
        monkeypatch.setattr(torch, "mm", spy_mm)
        monkeypatch.setattr(torch, "addmm", spy_addmm)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("m,rows,blocks", [(64, 16, [16] * 4), (65, 16, [13] * 5), (33, 32, [17, 16]),
                                           (4100, 4096, [2050, 2050]), (8192, 4096, [4096, 4096])])
def test_linear_rows_equals_f_linear_bitwise_in_equal_blocks(monkeypatch, m, rows, blocks, bias):
    g = torch.Generator().manual_seed(m)
    x, w = torch.randn(m, 24, generator=g), torch.randn(40, 24, generator=g)
    b = torch.randn(40, generator=g) if bias else None
    ref = F.linear(x, w, b)
    spy = Spy(monkeypatch)
    out = layers.linear_rows(x, w, b, rows)
    assert spy.blocks == blocks and max(blocks) <= rows
    assert torch.equal(out, ref) and out.is_contiguous()


def test_linear_splits_only_above_its_threshold(monkeypatch):
    lin = layers.MergedLinear(8, {"gate": 6, "up": 6})
    lin.weight.data.normal_()
    spy = Spy(monkeypatch)
    x = torch.randn(20, 8)
    assert torch.equal(lin(x), F.linear(x, lin.weight)) and spy.calls == []  # off (0)
    lin.row_split = 20
    lin(x)
    assert spy.calls == []  # 20 rows are not more than 20
    lin.row_split = 19
    assert torch.equal(lin(x), F.linear(x, lin.weight)) and spy.calls == [(20, 19)] and spy.blocks == [10, 10]


def _generate(path: str, split: int, monkeypatch) -> tuple[list[list[int]], Spy, LLM]:
    spy = Spy(monkeypatch)
    llm = LLM(path, mlp_row_split_tokens=split, **CHUNKED)
    built = list(spy.calls)
    prompts = make_prompts()
    outs = [o.output_token_ids for o in llm.generate(prompts + [prompts[3][:50]], SP, use_tqdm=False)]
    assert built == [], "building the engine split a GEMM"
    return outs, spy, llm


def test_tokens_identical_on_and_off_and_off_never_splits(tiny_model, monkeypatch):
    off, spy_off, _ = _generate(tiny_model, 0, monkeypatch)
    assert spy_off.calls == []
    on, spy_on, llm = _generate(tiny_model, 16, monkeypatch)
    assert on == off
    mlps = [m for m in llm.engine.model_runner.model.modules() if isinstance(m, MLP)]
    assert mlps and all(m.gate_up_proj.row_split == 16 for m in mlps)
    assert all(m.down_proj.row_split == 0 for m in mlps)  # the gate/up GEMM alone
    # gate/up inputs above 16 rows split (prune_last_layer's last layer has a step's sampled rows only);
    # chunked prefill fills 64-token steps
    assert spy_on.calls and all(rows == 16 and m > 16 for m, rows in spy_on.calls)
    assert max(m for m, _ in spy_on.calls) == 64


def test_step_logits_bitwise_equal_on_and_off(tiny_model):
    llm = LLM(tiny_model, mlp_row_split_tokens=16, **CHUNKED)
    runner = llm.engine.model_runner
    seqs, nxt = [], 100
    for p in make_prompts()[2:5]:  # 33 + 70 + 49 = 152 rows in one step
        s = Sequence(p, SamplingParams(temperature=0, max_tokens=1), 16)
        s.block_table = list(range(nxt, nxt + (len(p) + 15) // 16))
        nxt += len(s.block_table)
        seqs.append(s)
    x = runner.prepare(seqs, [s.num_tokens for s in seqs], [0] * len(seqs))
    logits = {}
    with torch.inference_mode():
        for split in (0, 16, 100, 0):
            set_mlp_row_split(runner.model, split)
            dev = runner.upload(x)
            logits.setdefault(split, []).append(runner.compute_logits(runner.forward(dev)))
    ref = logits[0][0]
    assert ref.shape[0] == sum(s.num_tokens for s in seqs)
    for split, outs in logits.items():
        for out in outs:
            assert torch.equal(out, ref), split


@pytest.mark.parametrize("bad", [-1, 1.5, "4096", True, None])
def test_bad_values_name_the_field(tiny_llama, bad):
    with pytest.raises(ValueError, match="mlp_row_split_tokens"):
        Config.from_kwargs(tiny_llama, mlp_row_split_tokens=bad)
    with pytest.raises(ValueError, match="mlp_row_split_tokens"):
        EngineConfig.from_kwargs(mlp_row_split_tokens=bad)


def test_default_off_and_round_trips(tiny_llama):
    assert Config.from_kwargs(tiny_llama).runner_config.mlp_row_split_tokens == 0
    cfg = EngineConfig.from_kwargs(mlp_row_split_tokens=4096)
    assert cfg.to_kwargs(changed_only=True) == {"mlp_row_split_tokens": 4096}
    assert cfg.config(tiny_llama).runner_config.mlp_row_split_tokens == 4096


def test_flag_ab_bench_runs_on_a_tiny_model(tmp_path):
    """bench.flag_ab (the GPU A/B's offline half) for the row split runs on CPU and finds the same tokens."""
    import json

    from bench import flag_ab

    out = tmp_path / "ab.json"
    assert flag_ab.main(["--flag", "mlp_row_split_tokens", "--on", "16", "--model", "tiny", "--prompts", "3",
                         "--prompt-tokens", "100", "--output-tokens", "4", "--max-num-batched-tokens", "64",
                         "--rounds", "2", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert (res["flag"], res["on"], res["off"], res["order"]) == ("mlp_row_split_tokens", 16, 0, ["off", "split"])
    assert res["summary"]["split"]["tokens_equal"] and res["summary"]["off"]["tokens_equal"]
    assert res["rounds"]["split"][0]["prefill_steps"] > 0 and res["split_over_off_req_per_s"] > 0
    with pytest.raises(SystemExit):
        flag_ab.main(["--flag", "prune_last_layer", "--on", "maybe"])
