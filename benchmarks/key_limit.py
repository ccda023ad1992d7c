"""Static-cache decode whose mask is a data tensor: the key limit read from the mask at run time
(patterns/key_limit.py) against attending over the whole cache, all in ONE run.

One decode step of Hugging Face's eager attention code (repeat_kv, scores * scale + a 4-d additive
finfo.min mask, fp32 softmax) over a StaticCache [B, Hkv, Lmax, D] whose valid part is `--valid` keys
per sequence. Columns (median ms per call, CUDA-graph replay where capture works):
    limit        torch.compile(backend="fa3"): the rewrite cuts each sequence at its last admissible key
    whole        the same with the key limit off (patterns.key_limit.MIN_KEYS raised): every slot is read
    sdpa_ind     the same step as SDPA code (F.scaled_dot_product_attention, enable_gqa) under Inductor
    valid_only   the fa3 rewrite on a cache cut to exactly the valid keys (the floor: nothing left to skip)
With --layers L, one step is L such layers, each with its own cache, the next layer's query the last's
output, all sharing the mask as a model's layers do (the key limit is then computed once per step).
Goal: limit >= 3x faster than whole at Lmax = 4 x valid. Each column is checked against an
fp32 eager reference first (max abs error printed).

Run on a GPU machine:  python benchmarks/key_limit.py [--batch 8] [--lmax 16384] [--valid 4096] [--layers 1] [--out DIR]
Smoke test on a CPU:   python benchmarks/key_limit.py --device cpu --small
Prints one JSON row and writes key_limit.json to --out (default $OUT or /tmp).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from typing import Callable

import torch
import torch.nn.functional as F

import fa_compile  # noqa: F401  (registers the fa3 backend)
from fa_compile.patterns import key_limit


def hf_eager_attention(q, k, v, mask):
    """q [B, Hq, Nq, D], k / v [B, Hkv, L, D], mask [B, 1, Nq, L] additive (HF's eager_attention_forward)."""
    b, hkv, n, d = k.shape
    g = q.shape[1] // hkv
    k = k[:, :, None].expand(b, hkv, g, n, d).reshape(b, hkv * g, n, d)
    v = v[:, :, None].expand(b, hkv, g, n, d).reshape(b, hkv * g, n, d)
    w = torch.matmul(q, k.transpose(2, 3)) * (1.0 / math.sqrt(d)) + mask
    return torch.matmul(F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype), v)


def sdpa_attention(q, k, v, mask):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def layers_of(attention: Callable) -> Callable:
    """A step of len(ks) layers: each attends its own cache, with the last layer's output as its query."""
    def step(q, ks, vs, mask):
        for k, v in zip(ks, vs):
            q = attention(q, k, v, mask)
        return q
    return step


def inputs(b: int, hq: int, hkv: int, d: int, lmax: int, valid: int, dtype, dev: str) -> tuple:
    g = torch.Generator(device="cpu").manual_seed(0)
    q = torch.randn(b, hq, 1, d, generator=g).to(dev, dtype)
    k = torch.randn(b, hkv, lmax, d, generator=g).to(dev, dtype)
    v = torch.randn(b, hkv, lmax, d, generator=g).to(dev, dtype)
    keep = torch.zeros(b, 1, 1, lmax, dtype=torch.bool)
    for i in range(b):  # left padding of a few slots, then `valid` written slots
        pad = i % 4
        keep[i, ..., pad:valid] = True
    mask = torch.zeros(keep.shape, dtype=dtype).masked_fill(~keep, torch.finfo(dtype).min).to(dev)
    return q, k, v, mask


def bench(fn: Callable[[], object], dev: str) -> tuple[float, str]:
    """(median ms, method)."""
    fn()
    if dev != "cuda":
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times), "wall"
    from triton.testing import do_bench, do_bench_cudagraph

    torch.cuda.synchronize()
    try:
        return do_bench_cudagraph(fn, rep=100, return_mode="median"), "graph"
    except Exception:
        torch.cuda.synchronize()
        return do_bench(fn, warmup=25, rep=100, return_mode="median"), "stream"


def compiled(fn, backend: str, whole: bool) -> tuple[Callable, int]:
    """(torch.compile(fn), the MIN_KEYS to restore once it has compiled): with `whole`, the key limit is
    off until then (the rewrite runs at the first call)."""
    torch._dynamo.reset()
    c = torch.compile(fn, backend=backend, dynamic=False, fullgraph=True)
    saved = key_limit.MIN_KEYS
    if whole:
        key_limit.MIN_KEYS = 1 << 62
    return c, saved


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lmax", type=int, default=16384)
    p.add_argument("--valid", type=int, default=4096)
    p.add_argument("--hq", type=int, default=32)
    p.add_argument("--hkv", type=int, default=8)
    p.add_argument("--d", type=int, default=128)
    p.add_argument("--layers", type=int, default=1, help="layers per step, each with its own cache")
    p.add_argument("--device", default="cuda")
    p.add_argument("--small", action="store_true", help="a CPU-sized shape (B2, 4/2 heads, d16, 4096 / 1024)")
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    a = p.parse_args()
    if a.small:
        a.batch, a.hq, a.hkv, a.d, a.lmax, a.valid = 2, 4, 2, 16, 4096, 1024
    dev = a.device
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    q, k, v, mask = inputs(a.batch, a.hq, a.hkv, a.d, a.lmax, a.valid, dtype, dev)
    ks, vs = [k], [v]
    for _ in range(a.layers - 1):  # further layers' caches: the same valid length, other values
        ks.append(torch.randn_like(k))
        vs.append(torch.randn_like(v))
    hf_step, sdpa_step = layers_of(hf_eager_attention), layers_of(sdpa_attention)
    with torch.no_grad():
        ref = hf_step(q.float(), [t.float() for t in ks], [t.float() for t in vs], mask.float())
        row: dict = dict(batch=a.batch, hq=a.hq, hkv=a.hkv, d=a.d, lmax=a.lmax, valid=a.valid, layers=a.layers,
                         dtype=str(dtype), device=dev)
        cut = [t[:, :, :a.valid].contiguous() for t in ks], [t[:, :, :a.valid].contiguous() for t in vs]
        cases = {
            "limit": (hf_step, "fa3", False, (q, ks, vs, mask)),
            "whole": (hf_step, "fa3", True, (q, ks, vs, mask)),
            "sdpa_ind": (sdpa_step, "inductor", False, (q, ks, vs, mask)),
            "valid_only": (hf_step, "fa3", False, (q, *cut, mask[..., :a.valid].contiguous())),
        }
        for name, (fn, backend, whole, args) in cases.items():
            c, saved = compiled(fn, backend, whole)
            try:
                out = c(*args)  # compiles here, with the limit as set
                row[f"{name}_err"] = (out.float() - ref).abs().max().item()
                ms, how = bench(lambda: c(*args), dev)
                row[f"{name}_ms"], row[f"{name}_timing"] = round(ms, 4), how
            except Exception as e:  # recorded, not fatal
                row[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:200]}"
            finally:
                key_limit.MIN_KEYS = saved
    if "limit_ms" in row and "whole_ms" in row:
        row["whole_over_limit"] = round(row["whole_ms"] / row["limit_ms"], 2)
    if "limit_ms" in row and "sdpa_ind_ms" in row:
        row["sdpa_ind_over_limit"] = round(row["sdpa_ind_ms"] / row["limit_ms"], 2)
    print(json.dumps(row), flush=True)
    os.makedirs(a.out, exist_ok=True)
    name = "key_limit.json" if a.layers == 1 else f"key_limit-{a.layers}layers.json"
    with open(os.path.join(a.out, name), "w") as f:
        json.dump(row, f, indent=1)


if __name__ == "__main__":
    main()
