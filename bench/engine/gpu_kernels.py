"""Attention kernels on one GPU: correctness (bf16 vs fp32 torch), the card's ceilings, prefill, decode,
prefix prefill. Llama-3.1-8B attention shapes (32 q / 8 kv heads, head_dim 128, block_size 256).

    python bench/engine/gpu_kernels.py --out $OUT/kernels.json     (< 4 minutes on an H200)"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from contextlib import nullcontext

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # run as a script

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402
from triton.testing import do_bench, do_bench_cudagraph  # noqa: E402

from flame_llm.kernels import triton_attention as ta  # noqa: E402
from flame_llm.kernels.metadata import AttentionMetadata  # noqa: E402
from flame_llm.kernels.torch_attention import paged_attention  # noqa: E402

H, HKV, D, BS = 32, 8, 128, 256
DENSE = ("sdpa", "cudnn", "flash", "efficient", "varlen")
PREFILL_SWEEP = [ta.TileConfig(128, 64, 8, 3), ta.TileConfig(128, 128, 8, 3), ta.TileConfig(128, 64, 4, 3),
                 ta.TileConfig(128, 128, 8, 2), ta.TileConfig(64, 64, 4, 3), ta.TileConfig(256, 64, 8, 2)]
DECODE_SWEEP = [ta.DECODE_CONFIG, ta.TileConfig(16, 128, 4, 3), ta.TileConfig(16, 128, 8, 3),
                ta.TileConfig(16, 32, 4, 4)]
SWEEP_BUDGET_S = 170  # past this, sweeps measure only their first config (each config is a compile)
T0 = time.time()


def log(msg):
    print(f"[{time.time() - T0:6.1f}s] {msg}", flush=True)


def sweep(items, keep=1):
    for i, item in enumerate(items):
        if i >= keep and time.time() - T0 > SWEEP_BUDGET_S:
            log(f"budget spent: skipping {len(items) - i} more variants")
            return
        yield item


def make_batch(seq_lens, q_lens, *, heads=H, kv_heads=HKV, head_dim=D, block_size=BS, pad_rows=0,
               decode=False, max_seqlen_k=None, poison=False, seed=0):
    """bf16 cache holding each sequence's prefix (random order of blocks) and this step's q/k/v."""
    dev, dt = "cuda", torch.bfloat16
    torch.manual_seed(seed)
    nblk = [triton.cdiv(s, block_size) for s in seq_lens]
    num_blocks = sum(nblk) + 1
    perm = torch.randperm(num_blocks, device=dev)
    bt = torch.full((len(seq_lens) + pad_rows, max(nblk)), -1, dtype=torch.int32, device=dev)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache, v_cache = torch.randn(shape, dtype=dt, device=dev), torch.randn(shape, dtype=dt, device=dev)
    keep = torch.zeros(num_blocks * block_size, dtype=torch.bool, device=dev)
    slots, used = [], 0
    for i, (s, n) in enumerate(zip(seq_lens, q_lens)):
        blocks = perm[used:used + nblk[i]]
        used += nblk[i]
        bt[i, :nblk[i]] = blocks.to(torch.int32)
        rows = (blocks[:, None] * block_size + torch.arange(block_size, device=dev)).flatten()[:s]
        keep[rows[:s - n]] = True
        slots.append(rows[s - n:])
    if poison:  # everything but the cached prefixes is NaN: the store must write, masks must hold
        k_cache.view(-1, kv_heads, head_dim)[~keep] = float("nan")
        v_cache.view(-1, kv_heads, head_dim)[~keep] = float("nan")
    slots.append(torch.full((pad_rows,), -1, dtype=torch.int64, device=dev))
    qls = list(q_lens) + [1] * pad_rows
    t = sum(qls)
    q = torch.randn(t, heads, head_dim, dtype=dt, device=dev)
    k = torch.randn(t, kv_heads, head_dim, dtype=dt, device=dev)
    v = torch.randn(t, kv_heads, head_dim, dtype=dt, device=dev)
    lens = torch.tensor(list(seq_lens) + [0] * pad_rows, dtype=torch.int32, device=dev)
    meta = AttentionMetadata(
        cu_seqlens_q=torch.tensor([0] + qls, device=dev).cumsum(0).to(torch.int32), seq_lens=lens,
        block_tables=bt, slot_mapping=torch.cat(slots), max_seqlen_q=max(qls),
        max_seqlen_k=max_seqlen_k or max(seq_lens), is_decode=decode,
        fresh_only=list(seq_lens) == list(q_lens) and pad_rows == 0,
        cu_seqlens_k=torch.cat([lens.new_zeros(1), lens.cumsum(0)]).to(torch.int32))
    return q, k, v, k_cache, v_cache, meta


def causal_flops(seq_lens, q_lens, heads=H, head_dim=D):
    return sum(4 * head_dim * heads * (n * (s - n) + n * (n + 1) / 2) for s, n in zip(seq_lens, q_lens))


def dense_prefill(q, k, v, meta, scale, backend):
    """torch's dense causal attention of fresh-only segments on the fresh k/v (a reference point for our kernel; the
    engine's fresh_prefill_backend that ran it was retired: bench/KERNELS.md, "Tried and retired")."""
    if backend == "varlen":
        from torch.nn.attention.varlen import varlen_attn
        return varlen_attn(q, k, v, meta.cu_seqlens_q, meta.cu_seqlens_q, meta.max_seqlen_q,
                           meta.max_seqlen_q, scale=scale, window_size=(-1, 0), enable_gqa=True)
    backends = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
                "efficient": SDPBackend.EFFICIENT_ATTENTION}
    bounds = meta.cu_seqlens_q.tolist()
    out = torch.empty_like(q)
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end > start:
            qi, ki, vi = (x[start:end].transpose(0, 1).unsqueeze(0) for x in (q, k, v))
            with nullcontext() if backend == "sdpa" else sdpa_kernel([backends[backend]]):
                o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scale, enable_gqa=True)
            out[start:end] = o[0].transpose(0, 1)
    return out


def check(name, seq_lens, q_lens, dense=None, num_splits=None, **kw):
    q, k, v, kc, vc, meta = make_batch(seq_lens, q_lens, poison=True, **kw)
    scale = q.shape[-1] ** -0.5
    kr, vr = kc.clone(), vc.clone()
    keep = meta.slot_mapping >= 0
    kr.view(-1, *kr.shape[2:])[meta.slot_mapping[keep]] = k[keep]
    vr.view(-1, *vr.shape[2:])[meta.slot_mapping[keep]] = v[keep]
    n_real = len(seq_lens)
    n = sum(q_lens)
    ref = paged_attention(q[:n].float(), kr.float(), vr.float(), meta.cu_seqlens_q[:n_real + 1],
                          meta.seq_lens[:n_real], meta.block_tables[:n_real], scale)
    if dense is not None:
        ta.store_kv(k, v, kc, vc, meta.slot_mapping)
        out = dense_prefill(q, k, v, meta, scale, dense)
    elif num_splits is None:
        out = ta.triton_attention_forward(q, k, v, kc, vc, meta, scale)
    else:
        ta.store_kv(k, v, kc, vc, meta.slot_mapping)
        out = ta.paged_attention_triton(q, kc, vc, meta, scale, num_splits=num_splits)
    cache_ok = bool(torch.equal(kc.nan_to_num(7.0), kr.nan_to_num(7.0))
                    and torch.equal(vc.nan_to_num(7.0), vr.nan_to_num(7.0)))
    err = ((out[:n].float() - ref).norm() / ref.norm()).item()
    ok = cache_ok and err <= 1e-2 and bool(torch.isfinite(out[:n]).all())
    return dict(name=name, dense=dense, num_splits=num_splits, rel_err=err,
                cache_ok=cache_ok, ok=ok)


def correctness():
    big = dict(seq_lens=[1000, 517, 33, 1], q_lens=[1000, 517, 33, 1])
    cases = [("fresh_ragged", big), ("prefix_hits", dict(seq_lens=[2048, 700, 300], q_lens=[512, 100, 1])),
             ("decode_pad_graphlike", dict(seq_lens=[4096, 1, 777, 3000], q_lens=[1] * 4, pad_rows=3,
                                           decode=True, max_seqlen_k=32768)),
             ("verify_k4", dict(seq_lens=[3000, 65, 1500], q_lens=[5, 5, 5], max_seqlen_k=32768)),
             ("gqa1_d64_bs16", dict(seq_lens=[600, 90], q_lens=[200, 90], heads=16, kv_heads=16, head_dim=64,
                                    block_size=16)),
             ("gqa8_d64_bs32", dict(seq_lens=[700, 64], q_lens=[300, 1], heads=32, kv_heads=4, head_dim=64,
                                    block_size=32)),
             ("tiny_d16_bs16", dict(seq_lens=[100, 7], q_lens=[40, 7], heads=4, kv_heads=2, head_dim=16,
                                    block_size=16))]
    rows = [check(name, **kw) for name, kw in cases]
    rows += [check("decode_nosplit", **dict(cases[2][1]), num_splits=1),
             check("decode_split16", **dict(cases[2][1]), num_splits=16)]
    for backend in DENSE:
        rows.append(guard(lambda b=backend: check("fresh_dense", **big, dense=b), f"dense {backend}"))
    return rows


def ceilings():
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    ms = do_bench(lambda: a @ b, warmup=50, rep=300, return_mode="median")
    src = torch.empty(1 << 30, dtype=torch.bfloat16, device="cuda")  # 2 GiB
    dst = torch.empty_like(src)
    ms_copy = do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
    return dict(matmul_tflops=2 * 8192 ** 3 / ms / 1e9, copy_bytes_per_s=2 * src.nbytes / ms_copy * 1e3)


def time_prefill(name, seq_lens, q_lens, configs, dense=(), store=False):
    q, k, v, kc, vc, meta = make_batch(seq_lens, q_lens)
    scale = D ** -0.5
    ta.store_kv(k, v, kc, vc, meta.slot_mapping)
    flops = causal_flops(seq_lens, q_lens)
    rep = 200 if flops < 1e13 else 600
    out, rows = torch.empty_like(q), []

    def rec(path, fn, config=None):
        ms = do_bench(fn, warmup=25, rep=rep, return_mode="median")
        rows.append(dict(case=name, path=path, config=config and list(config), ms=ms,
                         tflops=flops / ms / 1e9, tok_per_s=sum(q_lens) / ms * 1e3))

    log(f"prefill {name}")
    for cfg in sweep(configs):
        guard(lambda c=cfg: rec("triton", lambda: ta.paged_attention_triton(q, kc, vc, meta, scale, config=c,
                                                                             out=out), c), f"{name} {cfg}")
    if store:
        rec("store_kv", lambda: ta.store_kv(k, v, kc, vc, meta.slot_mapping))
    for b in dense:
        guard(lambda b=b: rec(f"dense_{b}", lambda: dense_prefill(q, k, v, meta, scale, b)), f"{name} {b}")
    return rows


def time_decode(name, batch, ctx, configs, splits):
    kv_bytes = batch * ctx * HKV * D * 2 * 2
    layers = max(1, math.ceil(512e6 / kv_bytes))  # distinct caches per call so L2 cannot hold the KV
    data = [make_batch([ctx] * batch, [1] * batch, decode=True, max_seqlen_k=32768, seed=i) for i in range(layers)]
    scale, rows = D ** -0.5, []
    log(f"decode {name}")
    for cfg, s in sweep([(c, s) for c in configs for s in splits], keep=len(splits)):
        def fn(cfg=cfg, s=s):
            for q, _, _, kc, vc, meta in data:
                ta.paged_attention_triton(q, kc, vc, meta, scale, config=cfg, num_splits=s)

        def rec(cfg=cfg, s=s, fn=fn):
            ms = do_bench_cudagraph(fn, rep=100, return_mode="median") / layers
            auto = ta.pick_num_splits(batch * HKV, 32768, ta._sm_count(torch.device("cuda")))
            rows.append(dict(case=name, config=list(cfg), num_splits=s or auto, auto=s is None,
                             us_per_layer=ms * 1e3, bytes_per_s=kv_bytes / ms * 1e3))
        guard(rec, f"{name} {cfg} splits={s}")
    q, k, v, kc, vc, meta = data[0]  # the full forward (store + attention) must capture too
    guard(lambda: rows.append(dict(case=name, path="forward_graph", us_per_layer=1e3 * do_bench_cudagraph(
        lambda: ta.triton_attention_forward(q, k, v, kc, vc, meta, scale), rep=50, return_mode="median"))),
          f"{name} forward in a CUDA graph")
    return rows


ERRORS: list[str] = []


def guard(fn, what):
    try:
        return fn()
    except Exception as e:  # one failing variant must not cost the rest of the run
        ERRORS.append(f"{what}: {type(e).__name__}: {e}".splitlines()[0][:300])
        log("FAILED " + ERRORS[-1])
        return dict(name=what, ok=False, error=ERRORS[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    res = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__)
    log("ceilings")
    res["ceilings"] = ceilings()
    log("correctness")
    res["correctness"] = correctness()
    free = lambda: torch.cuda.empty_cache()  # noqa: E731
    s4 = [8192] * 4
    res["prefill"] = time_prefill("4x8192", s4, s4, PREFILL_SWEEP, DENSE, store=True)
    free()
    best = min((r for r in res["prefill"] if r["path"] == "triton"), key=lambda r: r["ms"], default=None)
    best_cfg = ta.TileConfig(*best["config"]) if best else ta.PREFILL_CONFIG
    res["best_prefill_config"] = list(best_cfg)
    res["prefill"] += time_prefill("1x8192", [8192], [8192], [best_cfg], ("cudnn", "sdpa"))
    free()
    res["prefill"] += time_prefill("64x8192", [8192] * 64, [8192] * 64, [best_cfg], ("cudnn", "sdpa", "varlen"))
    free()
    res["prefix"] = time_prefill("8x(7168+1024)", [8192] * 8, [1024] * 8, [ta.PREFILL_CONFIG, best_cfg])
    free()
    res["decode"] = time_decode("decode_64x8192", 64, 8192, DECODE_SWEEP, [None, 1, 2])
    res["decode"] += time_decode("decode_1x8192", 1, 8192, DECODE_SWEEP, [None, 1, 16])
    res["errors"], res["wall_s"] = ERRORS, time.time() - T0
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    report(res)


def report(res):
    c = res["ceilings"]
    print(f"\n{res['device']}  torch {res['torch']}  triton {res['triton']}  wall {res['wall_s']:.0f}s")
    print(f"ceilings: matmul {c['matmul_tflops']:.0f} TFLOP/s, copy {c['copy_bytes_per_s'] / 1e12:.2f} TB/s")
    bad = [r for r in res["correctness"] if not r.get("ok")]
    print(f"correctness: {len(res['correctness']) - len(bad)}/{len(res['correctness'])} ok", *bad, sep="\n  ")
    for r in res["prefill"] + res["prefix"]:
        if "tflops" in r:
            print(f"{r['case']:>14} {r['path']:>16} {str(r['config'] or ''):>20} {r['ms']:8.2f} ms "
                  f"{r['tflops']:6.0f} TFLOP/s ({r['tflops'] / c['matmul_tflops']:4.0%} of matmul)")
    for r in res["decode"]:
        if "bytes_per_s" in r:
            print(f"{r['case']:>14} {str(r['config']):>20} splits {r['num_splits']:>2}{'*' if r['auto'] else ' '}"
                  f" {r['us_per_layer']:7.1f} us/layer {r['bytes_per_s'] / 1e12:5.2f} TB/s "
                  f"({r['bytes_per_s'] / c['copy_bytes_per_s']:4.0%} of copy)")
        elif "us_per_layer" in r:
            print(f"{r['case']:>14} forward (store+attn) in a CUDA graph: {r['us_per_layer']:.1f} us")
    print("errors:", *res["errors"], sep="\n  ")


if __name__ == "__main__":
    main()
