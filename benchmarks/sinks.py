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


VARIANTS = ("plain", "sinks", "sinks_frozen")  # frozen: sinks without a gradient (no d sinks reduction)


def run(b: int, hq: int, hkv: int, n: int, d: int, causal: bool, rounds: int = 3, profile: bool = False) -> dict:
    """Median ms over `rounds` rounds, each timing every variant in turn (drift touches all alike)."""
    import statistics

    from fa_compile.kernels import triton_family as tf

    dev, dt = "cuda", torch.bfloat16
    q = torch.randn(b, hq, n, d, device=dev, dtype=dt, requires_grad=True)
    k = torch.randn(b, hkv, n, d, device=dev, dtype=dt, requires_grad=True)
    v = torch.randn(b, hkv, n, d, device=dev, dtype=dt, requires_grad=True)
    sinks = torch.randn(hq, device=dev, dtype=torch.float32, requires_grad=True)
    frozen = sinks.detach()
    do = torch.randn(b, hq, n, d, device=dev, dtype=dt)
    row: dict = dict(batch=b, hq=hq, hkv=hkv, n=n, d=d, causal=causal)
    fns = {}
    for name, s in (("plain", None), ("sinks", sinks), ("sinks_frozen", frozen)):
        def fwd(s=s):
            return fa_compile.attention(q, k, v, causal=causal, sinks=s, kernel="triton")

        def step(fwd=fwd):
            q.grad = k.grad = v.grad = sinks.grad = None
            fwd().backward(do)

        fns[name] = (fwd, step)
        if name == "sinks_frozen":
            continue
        tf.LAST_COMPILED.clear()
        out = fwd()
        row[f"{name}_kernel"] = ",".join(sorted(k_ for k_ in tf.LAST_COMPILED if k_.startswith("attn_fwd")))
        ref, _ = attention_reference(q.detach().float(), k.detach().float(), v.detach().float(),
                                     scale=d ** -0.5, causal=causal, sinks=None if s is None else s.detach())
        row[f"{name}_err"] = (out.float() - ref).abs().max().item()
    times: dict = {f"{n_}_{w}": [] for n_ in VARIANTS for w in ("fwd", "step")}
    for _ in range(rounds):
        for name in VARIANTS:
            fwd, step = fns[name]
            with torch.no_grad():
                times[f"{name}_fwd"].append(bench(fwd))
            times[f"{name}_step"].append(bench(step))
    for key, vals in times.items():
        row[f"{key}_ms"] = statistics.median(vals)
    row["fwd_ratio"] = row["plain_fwd_ms"] / row["sinks_fwd_ms"]
    row["step_ratio"] = row["plain_step_ms"] / row["sinks_step_ms"]
    row["step_ratio_frozen"] = row["plain_step_ms"] / row["sinks_frozen_step_ms"]
    if profile:
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as prof

        for name in ("plain", "sinks"):
            fns[name][1]()
            torch.cuda.synchronize()
            with prof(activities=[ProfilerActivity.CUDA]) as p:
                fns[name][1]()
                torch.cuda.synchronize()
            print(f"-- {name}: B{b} {hq}/{hkv} N{n} d{d}{' causal' if causal else ''}, one step, CUDA kernels")
            print(p.key_averages().table(sort_by="cuda_time_total", row_limit=8, max_name_column_width=60))
    return row


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--profile", action="store_true", help="print each step's CUDA kernels (torch.profiler)")
    a = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    rows = [run(*s, rounds=a.rounds, profile=a.profile) for s in SHAPES]
    print(f"{torch.cuda.get_device_name()}, bf16, torch {torch.__version__}; median ms of {a.rounds} interleaved "
          "rounds; ratio = without / with sinks; step+f: sinks without a gradient")
    print(f"{'shape':<28}{'fwd':>9}{'fwd+s':>9}{'ratio':>7}{'step':>9}{'step+s':>9}{'ratio':>7}{'step+f':>9}"
          f"{'ratio':>7}  max err (plain, sinks)  forward kernel (plain / sinks)")
    for r in rows:
        name = f"B{r['batch']} {r['hq']}/{r['hkv']} N{r['n']} d{r['d']}{' causal' if r['causal'] else ''}"
        print(f"{name:<28}{r['plain_fwd_ms']:>9.3f}{r['sinks_fwd_ms']:>9.3f}{r['fwd_ratio']:>7.2f}"
              f"{r['plain_step_ms']:>9.3f}{r['sinks_step_ms']:>9.3f}{r['step_ratio']:>7.2f}"
              f"{r['sinks_frozen_step_ms']:>9.3f}{r['step_ratio_frozen']:>7.2f}"
              f"  {r['plain_err']:.1e}, {r['sinks_err']:.1e}  {r['plain_kernel']} / {r['sinks_kernel']}")
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "sinks.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
