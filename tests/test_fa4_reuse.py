"""fa4_call_reuse's recorder (flame_llm/kernels/fa4_reuse.py) on CPU, against FakeFa4InterfaceForCpu: a stand-in for
flash_attn.cute.interface, since FA4 needs a Hopper GPU (tests/test_gpu_fa4.py checks the real kernel's outputs and
tokens with reuse on and off). The stand-in has FA4's shape where the recorder relies on it: a forward that works
out its kernel's arguments in Python, takes the compiled kernel from a JIT cache (`_flash_attn_fwd.compile_cache`)
and calls it once with q, k, v, out first; a split-KV call also runs a combine through
`_flash_attn_fwd_combine.compile_cache`."""
import sys
import types

import pytest
import torch

from flame_llm import LLM
from flame_llm.config import Config
from flame_llm.kernels.fa4_reuse import OUTCOMES, reuse_call


class FakeFa4InterfaceForCpu(types.ModuleType):
    def __init__(self, split: bool = False, own_out: bool = False) -> None:
        super().__init__("flash_attn.cute.interface")
        self.python_calls = self.kernel_calls = 0
        fake = self

        def kernel(q, k, v, out, scale, cu):  # the "compiled" kernel: every argument shows in its output
            fake.kernel_calls += 1
            out.copy_(q * scale + k.sum() + 2 * v.sum() + cu.sum())

        def _flash_attn_fwd(q, k, v, out=None, softmax_scale=1.0, cu_seqlens_q=None):
            fake.python_calls += 1
            key = (tuple(q.shape[1:]), q.dtype)
            if key not in _flash_attn_fwd.compile_cache:
                _flash_attn_fwd.compile_cache[key] = kernel
            if out is None or own_out:
                out = torch.empty_like(q)
            _flash_attn_fwd.compile_cache[key](q.detach(), k.detach(), v.detach(), out.detach(), softmax_scale,
                                               cu_seqlens_q)
            if split:  # FA4's pattern: look the combine kernel up, compile it when missing, call it
                combine = _flash_attn_fwd_combine.compile_cache
                if "combine" not in combine:
                    combine["combine"] = lambda *a: None
                combine["combine"](out)
            return out, None

        def _flash_attn_fwd_combine():
            raise AssertionError("not called directly here")

        _flash_attn_fwd.compile_cache = {}
        _flash_attn_fwd_combine.compile_cache = {}
        self._flash_attn_fwd, self._flash_attn_fwd_combine = _flash_attn_fwd, _flash_attn_fwd_combine


@pytest.fixture
def fake_fa4(monkeypatch):
    def install(**kw) -> FakeFa4InterfaceForCpu:
        iface = FakeFa4InterfaceForCpu(**kw)
        cute = types.ModuleType("flash_attn.cute")
        cute.interface = iface
        pkg = types.ModuleType("flash_attn")
        pkg.cute = cute
        for name, mod in (("flash_attn", pkg), ("flash_attn.cute", cute), ("flash_attn.cute.interface", iface)):
            monkeypatch.setitem(sys.modules, name, mod)
        return iface
    return install


def _layers(n: int, t: int = 5, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(t, 4, 8, generator=g), torch.randn(16, 2, 8, generator=g), torch.randn(16, 2, 8, generator=g))
            for _ in range(n)]


def _run(iface, layers, calls, site="paged", cu=None):
    cu = torch.tensor([0, 2, 5], dtype=torch.int32) if cu is None else cu
    outs = []
    for q, k, v in layers:
        out = torch.empty_like(q)
        outs.append(reuse_call(calls, site, q, k, v, out,
                               lambda q=q, k=k, v=v, out=out: iface._flash_attn_fwd(q, k, v, out=out,
                                                                                   softmax_scale=0.5,
                                                                                   cu_seqlens_q=cu)[0]))
    return outs


def test_a_steps_later_layers_call_the_recorded_kernel_with_their_own_tensors(fake_fa4):
    iface = fake_fa4()
    layers = _layers(6)
    ref = _run(iface, layers, None)  # FA4 in full at every layer
    assert iface.python_calls == 6
    iface.python_calls = iface.kernel_calls = 0
    calls: dict = {}
    OUTCOMES.clear()
    got = _run(iface, layers, calls)
    assert iface.python_calls == 1 and iface.kernel_calls == 6  # recorded at the first layer, then the kernel alone
    assert OUTCOMES == {"recorded": 1, "replayed": 5}
    assert all(torch.equal(a, b) for a, b in zip(got, ref))
    assert set(calls) == {"paged"} and len(calls["paged"].rest) == 2  # scale and cu_seqlens_q
    # the JIT cache is FA4's own again after the recording
    assert type(iface._flash_attn_fwd.compile_cache) is dict


def test_other_shapes_sites_and_steps_are_not_served_by_a_recording(fake_fa4):
    iface = fake_fa4()
    calls: dict = {}
    _run(iface, _layers(2), calls)
    _run(iface, _layers(2, t=7, seed=1), calls)  # another q length: FA4 in full, recorded anew
    assert iface.python_calls == 2 and calls["paged"].signature[0][0] == (7, 4, 8)
    _run(iface, _layers(2, seed=2), calls, site="rest")  # another call site of the step: its own recording
    assert iface.python_calls == 3 and set(calls) == {"paged", "rest"}
    fresh: dict = {}  # the next step's dict: nothing recorded in it yet
    _run(iface, _layers(1, seed=3), fresh)
    assert iface.python_calls == 4


@pytest.mark.parametrize("kind", ["split", "own_out"])
def test_nothing_is_recorded_when_the_call_is_not_one_kernel_into_our_output(fake_fa4, kind):
    iface = fake_fa4(**{kind: True})
    layers = _layers(4)
    calls: dict = {}
    OUTCOMES.clear()
    got = _run(iface, layers, calls)
    assert calls == {} and iface.python_calls == 4  # every layer ran FA4 in full
    # and each call says why it was not recorded
    why = {"split": "split-KV combine",
           "own_out": "argument 3 is not ours (other memory, shape (5, 4, 8) vs (5, 4, 8))"}[kind]
    assert OUTCOMES == {why: 4}
    iface2 = fake_fa4()
    ref = _run(iface2, layers, None)
    if kind == "split":
        assert all(torch.equal(a, b) for a, b in zip(got, ref))


def test_the_flag_is_checked_and_needs_the_fa4_backend(tiny_llama):
    assert Config.from_kwargs(tiny_llama).runner_config.fa4_call_reuse is False  # off by default
    with pytest.raises(ValueError, match="fa4_call_reuse"):
        Config.from_kwargs(tiny_llama, fa4_call_reuse="yes")
    llm = LLM(tiny_llama, device="cpu", block_size=16, num_kvcache_blocks=32, fa4_call_reuse=True)
    assert llm.engine.model_runner.backend == "torch" and llm.engine.model_runner.fa4_reuse is False


def test_flag_ab_refuses_fa4_call_reuse_without_the_fa4_backend():
    from bench import flag_ab
    with pytest.raises(SystemExit, match="fa4_call_reuse needs the fa4 attention backend; this engine runs torch"):
        flag_ab.main(["--model", "tiny", "--flag", "fa4_call_reuse", "--prompts", "2", "--prompt-tokens", "40",
                      "--max-num-batched-tokens", "64"])
