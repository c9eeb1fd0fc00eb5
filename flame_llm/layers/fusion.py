"""Config.gemm_epilogues: which memory-bound ops ride in a GEMM's epilogue, and through which GEMM.

The spec is a comma-separated list of OP=IMPL: "swiglu=triton" or "swiglu=quack" (SiLU-mul in the gate/up
projection's epilogue), "residual=cublas", "residual=triton" or "residual=quack" (the residual add in the
o / down projections' epilogue; the RMSNorm after them then has no add). "" (the default) is today's path:
cuBLAS GEMMs and our separate Triton kernels. Off CUDA each fused op runs as its torch composition."""
from __future__ import annotations

from torch import nn

GEMM_EPILOGUE_IMPLS = {"swiglu": ("triton", "quack"), "residual": ("cublas", "triton", "quack")}


def parse_gemm_epilogues(spec: str) -> dict[str, str]:
    """{op: impl} of a spec; ValueError names the field, the bad part and what is allowed."""
    if not isinstance(spec, str):
        raise ValueError(f"config field 'gemm_epilogues' must be a string; got {spec!r}")
    out: dict[str, str] = {}
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        op, _, impl = part.partition("=")
        allowed = GEMM_EPILOGUE_IMPLS.get(op)
        if allowed is None or impl not in allowed or op in out:
            known = "; ".join(f"{o}=" + "|".join(i) for o, i in GEMM_EPILOGUE_IMPLS.items())
            raise ValueError(f"config field 'gemm_epilogues': {part!r} is not one of {known} (each op once)")
        out[op] = impl
    return out


def configure_gemm_epilogues(model: nn.Module, spec: str) -> dict[str, str]:
    """Set the fused epilogues of every decoder layer of `model` (a flame_llm.models.llama model)."""
    from flame_llm.models.llama import MLP, DecoderAttention, DecoderLayer

    ops = parse_gemm_epilogues(spec)
    for m in model.modules():
        if isinstance(m, MLP):
            if ("swiglu" in ops and m.gate_up_proj.bias is not None) or ("residual" in ops and
                                                                         m.down_proj.bias is not None):
                raise ValueError("config field 'gemm_epilogues': fused epilogues do not take projection biases")
            m.swiglu_impl = ops.get("swiglu")
            m.residual_impl = ops.get("residual")
        elif isinstance(m, DecoderAttention):
            if "residual" in ops and m.o_proj.bias is not None:
                raise ValueError("config field 'gemm_epilogues': fused epilogues do not take projection biases")
            m.residual_impl = ops.get("residual")
        elif isinstance(m, DecoderLayer):
            m.residual_impl = ops.get("residual")
    return ops
