"""FP8 checkpoints (issue 40) through the real loader: the tiny Llama's safetensors rewritten as llm-compressor's
compressed-tensors layout (per-channel and per-tensor `weight_scale`, with the static `input_scale` it may carry)
and as HF's "fp8" layout (`weight_scale_inv` per [b0, b1] block), config.json carrying each one's
quantization_config as the published models write it. The loaded e4m3 weights and scales equal what was written
(block scales: within one e4m3 step, after their conversion to per-channel), and every refused layout names its
field."""
import json
import os
import shutil

import pytest
import torch
from helpers import make_prompts
from safetensors.torch import load_file, save_file

from flame_llm import LLM, SamplingParams
from flame_llm.kernels.fp8 import FP8_DTYPE, FP8_MAX, quantize_weight
from flame_llm.layers.layers import Linear

PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ENGINE = dict(block_size=16, num_kvcache_blocks=256, max_model_len=256)


def ct_config(strategy: str = "channel", dynamic_acts: bool = True) -> dict:
    """quantization_config as llm-compressor writes it (RedHatAI/Meta-Llama-3.1-8B-Instruct-FP8-dynamic)."""
    acts = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": dynamic_acts,
            "strategy": "token" if dynamic_acts else "tensor", "group_size": None, "observer": None}
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "strategy": strategy,
               "group_size": None, "observer": "minmax", "actorder": None, "block_structure": None}
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "global_compression_ratio": 1.24, "ignore": ["lm_head"], "kv_cache_scheme": None,
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": acts,
                                          "output_activations": None}}}


def hf_fp8_config(block: list[int] | None) -> dict:
    """As Qwen's -FP8 models write it."""
    return {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": block}


def _is_proj(name: str) -> bool:
    return name.endswith(".weight") and name.split(".")[-2] in PROJ


def write_fp8(src: str, dst: str, qc: dict, layout: str, block: tuple[int, int] | None = None) -> dict:
    """src's checkpoint as FP8 in dst; returns what was written per projection: {name: (e4m3, scale)}."""
    shutil.copytree(src, dst)
    for f in os.listdir(dst):
        if f.endswith(".safetensors") or f.endswith(".index.json"):
            os.remove(os.path.join(dst, f))
    tensors = {}
    for f in sorted(os.listdir(src)):
        if f.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(src, f)))
    out, written = {}, {}
    for name, t in tensors.items():
        if not _is_proj(name):
            out[name] = t.to(torch.bfloat16)
            continue
        base = name[: -len(".weight")]
        if layout == "block":
            q, s = _quantize_blocks(t, block)
            out[f"{base}.weight_scale_inv"] = s
        elif layout == "tensor":
            s = (t.abs().amax() / FP8_MAX).reshape(1)
            q = (t / s).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
            out[f"{base}.weight_scale"] = s
            out[f"{base}.input_scale"] = torch.tensor([0.02])  # static activation scale: not read
        else:
            q, s = quantize_weight(t)
            s = s.to(torch.bfloat16).float()  # llm-compressor keeps scales in the model dtype
            q = (t / s[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
            out[f"{base}.weight_scale"] = s.to(torch.bfloat16).unsqueeze(1)  # [N, 1]
        out[name] = q
        written[name] = (q, s)
    save_file(out, os.path.join(dst, "model.safetensors"))
    with open(os.path.join(dst, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = qc
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    return written


def _quantize_blocks(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    n, k = w.shape
    b0, b1 = block
    blocks = w.reshape(n // b0, b0, k // b1, b1)
    s = blocks.abs().amax(dim=(1, 3)) / FP8_MAX  # [n/b0, k/b1]
    q = (blocks / s[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).reshape(n, k)
    return q, s


def _loaded(llm: LLM) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Each checkpoint projection's (e4m3 weight, per-channel scale) as the engine holds them (shards split out)."""
    model, out = llm.engine.model_runner.model, {}
    for mname, m in model.named_modules():
        if not isinstance(m, Linear):
            continue
        shards = getattr(m, "shard_offsets", None) or {None: (0, m.weight.shape[0])}
        for shard, (off, size) in shards.items():
            hf = {"qkv_proj": {"q": "q_proj", "k": "k_proj", "v": "v_proj"},
                  "gate_up_proj": {"gate": "gate_proj", "up": "up_proj"}}.get(mname.rsplit(".", 1)[1], {})
            name = mname.rsplit(".", 1)[0] + "." + hf[shard] if shard else mname
            out[name + ".weight"] = (m.weight[off:off + size], m.weight_scale[off:off + size])
    return out


@pytest.mark.parametrize("strategy", ["channel", "tensor"])
def test_compressed_tensors_loads_as_written(tiny_llama, tmp_path, strategy):
    written = write_fp8(tiny_llama, str(tmp_path / "ct"), ct_config(strategy, dynamic_acts=strategy == "channel"),
                        strategy)
    llm = LLM(str(tmp_path / "ct"), quantization="fp8", **ENGINE)
    loaded = _loaded(llm)
    assert sorted(loaded) == sorted(written) and len(written) == 2 * len(PROJ)
    for name, (q, s) in written.items():
        lq, ls = loaded[name]
        assert lq.dtype == FP8_DTYPE and torch.equal(lq.view(torch.uint8), q.view(torch.uint8)), name
        assert torch.equal(ls, s.float().reshape(-1).expand(lq.shape[0])), name
    out = llm.generate(make_prompts()[:2], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                       use_tqdm=False)
    assert all(len(o.output_token_ids) == 8 for o in out)


def test_checkpoint_quantized_as_we_do_gives_the_same_tokens_as_quantizing_at_load(tiny_llama, tmp_path):
    """A per-channel checkpoint whose scales are ours (float32) holds exactly what quantizing the float32
    checkpoint at load makes (bf16 non-projection tensors aside, so compare against the same bf16-rounded file)."""
    src = tmp_path / "bf16"
    shutil.copytree(tiny_llama, src)
    t = {}
    for f in sorted(os.listdir(src)):
        if f.endswith(".safetensors"):
            t.update(load_file(os.path.join(src, f)))
    save_file({k: (v if _is_proj(k) else v.to(torch.bfloat16).float()) for k, v in t.items()},
              os.path.join(src, "model.safetensors"))
    ckpt = str(tmp_path / "ct")
    shutil.copytree(src, ckpt)
    out = {}
    for k, v in t.items():
        if _is_proj(k):
            q, s = quantize_weight(v)
            out[k], out[k[: -len(".weight")] + ".weight_scale"] = q, s.unsqueeze(1)
        else:
            out[k] = v.to(torch.bfloat16).float()
    save_file(out, os.path.join(ckpt, "model.safetensors"))
    with open(os.path.join(ckpt, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = ct_config()
    with open(os.path.join(ckpt, "config.json"), "w") as f:
        json.dump(cfg, f)
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    prompts = make_prompts()[:4]
    a = [o.output_token_ids for o in LLM(str(src), quantization="fp8", **ENGINE).generate(prompts, sp, use_tqdm=False)]
    b = [o.output_token_ids for o in LLM(ckpt, quantization="fp8", **ENGINE).generate(prompts, sp, use_tqdm=False)]
    assert a == b


def test_hf_fp8_block_scales_become_per_channel(tiny_llama, tmp_path):
    block = (16, 32)  # the tiny model's k/v shards are 32 rows: whole 16-row blocks; K 64 and 128: whole 32-col
    written = write_fp8(tiny_llama, str(tmp_path / "hf"), hf_fp8_config(list(block)), "block", block)
    loaded = _loaded(LLM(str(tmp_path / "hf"), quantization="fp8", **ENGINE))
    for name, (q, s) in written.items():
        lq, ls = loaded[name]
        assert lq.dtype == FP8_DTYPE and ls.shape == (lq.shape[0],)
        want = q.float() * s.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
        got = lq.float() * ls[:, None]
        # requantized per row: each value moves by at most half an e4m3 step of the row's scale or of itself
        bound = torch.maximum(want.abs() * 2.0 ** -4, ls[:, None] * 2.0 ** -10) * 1.001
        assert ((got - want).abs() <= bound).all(), name
        assert torch.allclose(ls, want.abs().amax(1) / FP8_MAX), name


def test_hf_fp8_without_block_reads_weight_scale(tiny_llama, tmp_path):
    written = write_fp8(tiny_llama, str(tmp_path / "hf"), hf_fp8_config(None), "channel")
    loaded = _loaded(LLM(str(tmp_path / "hf"), quantization="fp8", **ENGINE))
    name = next(iter(written))
    assert torch.equal(loaded[name][0].view(torch.uint8), written[name][0].view(torch.uint8))


def test_fp8_checkpoint_without_the_flag_names_quantization(tiny_llama, tmp_path):
    write_fp8(tiny_llama, str(tmp_path / "ct"), ct_config(), "channel")
    with pytest.raises(ValueError, match="engine field 'quantization'.*FP8 checkpoint.*set quantization: fp8"):
        LLM(str(tmp_path / "ct"), **ENGINE)


@pytest.mark.parametrize("edit,field", [
    (lambda qc: qc.update(quant_method="awq"), "quant_method"),
    (lambda qc: qc.update(format="pack-quantized"), "format"),
    (lambda qc: qc["config_groups"]["group_0"]["weights"].update(type="int"), "weights.type/num_bits"),
    (lambda qc: qc["config_groups"]["group_0"]["weights"].update(strategy="group"), "weights.strategy"),
    (lambda qc: qc["config_groups"]["group_0"]["input_activations"].update(num_bits=4), "input_activations"),
    (lambda qc: qc["config_groups"].update(group_1={}), "config_groups"),
])
def test_unsupported_compressed_tensors_names_the_field(tiny_llama, tmp_path, edit, field):
    qc = ct_config()
    edit(qc)
    write_fp8(tiny_llama, str(tmp_path / "ct"), qc, "channel")
    with pytest.raises(ValueError, match=f"quantization_config.*{field}"):
        LLM(str(tmp_path / "ct"), quantization="fp8", **ENGINE)


@pytest.mark.parametrize("block,match", [([128, 128], "weight_block_size \\[128, 128\\].*not whole blocks"),
                                         ([16], "weight_block_size must be")])
def test_bad_block_size_names_the_field(tiny_llama, tmp_path, block, match):
    write_fp8(tiny_llama, str(tmp_path / "hf"), hf_fp8_config(block), "channel")
    with pytest.raises(ValueError, match=match):
        LLM(str(tmp_path / "hf"), quantization="fp8", **ENGINE)


def test_partly_unquantized_checkpoint_is_refused(tiny_llama, tmp_path):
    ckpt = str(tmp_path / "ct")
    write_fp8(tiny_llama, ckpt, ct_config(), "channel")
    t = load_file(os.path.join(ckpt, "model.safetensors"))
    name = "model.layers.0.mlp.down_proj.weight"
    t[name] = t[name].float() * t["model.layers.0.mlp.down_proj.weight_scale"].float()  # bf16 left in its place
    save_file(t, os.path.join(ckpt, "model.safetensors"))
    with pytest.raises(ValueError, match="down_proj.weight.*not float8_e4m3fn"):
        LLM(ckpt, quantization="fp8", **ENGINE)
