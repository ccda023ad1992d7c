"""Attention sinks on the GPU: our Triton kernel with a per-head sink logit against the same kernel
without one, forward and forward + backward, in ONE run; each result is first checked against the
fp32 reference (max abs error printed). The sink adds one term to each row's denominator, so the
ratio should stay near 1.

Run on a GPU machine:  python benchmarks/sinks.py [--out DIR]   (under a minute)
Prints the table and writes sinks.json to --out (default $OUT or /tmp).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

import fa_compile
from fa_compile.kernels.reference import attention_reference

SHAPES = [  # (batch, heads q, heads kv, length, head dim, causal)
    (2, 32, 8, 4096, 64, True),
    (2, 32, 8, 4096, 128, True),
    (2, 16, 16, 4096, 128, False),
    (8, 32, 8, 1024, 128, True),
]


def bench(fn) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=10, rep=50)


def run(b: int, hq: int, hkv: int, n: int, d: int, causal: bool) -> dict:
    dev, dt = "cuda", torch.bfloat16
    q = torch.randn(b, hq, n, d, device=dev, dtype=dt, requires_grad=True)
    k = torch.randn(b, hkv, n, d, device=dev, dtype=dt, requires_grad=True)
    v = torch.randn(b, hkv, n, d, device=dev, dtype=dt, requires_grad=True)
    sinks = torch.randn(hq, device=dev, dtype=torch.float32, requires_grad=True)
    do = torch.randn(b, hq, n, d, device=dev, dtype=dt)
    row: dict = dict(batch=b, hq=hq, hkv=hkv, n=n, d=d, causal=causal)
    for name, s in (("plain", None), ("sinks", sinks)):
        def fwd():
            return fa_compile.attention(q, k, v, causal=causal, sinks=s, kernel="triton")

        out = fwd()
        ref, _ = attention_reference(q.detach().float(), k.detach().float(), v.detach().float(),
                                     scale=d ** -0.5, causal=causal, sinks=None if s is None else s.detach())
        row[f"{name}_err"] = (out.float() - ref).abs().max().item()
        with torch.no_grad():
            row[f"{name}_fwd_ms"] = bench(fwd)

        def step():
            q.grad = k.grad = v.grad = sinks.grad = None
            fwd().backward(do)

        row[f"{name}_step_ms"] = bench(step)
    row["fwd_ratio"] = row["plain_fwd_ms"] / row["sinks_fwd_ms"]
    row["step_ratio"] = row["plain_step_ms"] / row["sinks_step_ms"]
    return row


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    a = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    rows = [run(*s) for s in SHAPES]
    print(f"{torch.cuda.get_device_name()}, bf16, torch {torch.__version__}; ms; ratio = without / with sinks")
    print(f"{'shape':<28}{'fwd':>9}{'fwd+s':>9}{'ratio':>7}{'step':>9}{'step+s':>9}{'ratio':>7}  max err (plain, sinks)")
    for r in rows:
        name = f"B{r['batch']} {r['hq']}/{r['hkv']} N{r['n']} d{r['d']}{' causal' if r['causal'] else ''}"
        print(f"{name:<28}{r['plain_fwd_ms']:>9.3f}{r['sinks_fwd_ms']:>9.3f}{r['fwd_ratio']:>7.2f}"
              f"{r['plain_step_ms']:>9.3f}{r['sinks_step_ms']:>9.3f}{r['step_ratio']:>7.2f}"
              f"  {r['plain_err']:.1e}, {r['sinks_err']:.1e}")
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "sinks.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
