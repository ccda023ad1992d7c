"""Every CUDA kernel of a model's forward (no grad) and training step, eager attention code under fa3 against
the same model's SDPA code under Inductor, in ONE run: GPU µs per step and calls per step, so the kernels one
variant adds (layout glue, empty-row fix-ups) stand beside the attention kernels themselves. GEMMs (the same
in both) are left out of the listing but counted in the totals.

    python benchmarks/kernel_diff.py [--model bert] [--steps 3]     # models of benchmarks/models.py (FULL)
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from models import FULL, backend_for, build, inputs  # noqa: E402


def kernels_per_step(name: str, attn: str, backend: str, train: bool, steps: int) -> dict[str, tuple[float, int]]:
    torch._dynamo.reset()
    spec = FULL[name]
    model = build(name, attn, spec["cfg"], "cuda", torch.bfloat16)
    model.train(train)
    f = torch.compile(model, backend=backend_for(backend, "inductor"))
    kw = inputs(name, model, spec, "cuda", torch.bfloat16)[1 if train else 0]
    return cuda_kernels(model_step(f, model, kw, train), steps)


def model_step(f, model, kw: dict, train: bool):
    """One call of the compiled model `f`: a training step (loss backward, gradients dropped) or a no-grad forward."""
    def step():
        if train:
            f(**kw).loss.backward()
            for p in model.parameters():
                p.grad = None
        else:
            with torch.no_grad():
                f(**kw)

    return step


def cuda_kernels(fn, calls: int, warmup: int = 3) -> dict[str, tuple[float, int]]:
    """{kernel name: (GPU µs per call of fn, launches per call)} over `calls` profiled calls after `warmup`."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return {e.key: (e.self_device_time_total / calls, e.count // calls) for e in prof.key_averages()
            if e.device_type == torch.autograd.DeviceType.CUDA and e.self_device_time_total > 0}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="bert")
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/kernel_diff.py: needs a CUDA GPU (it lists CUDA kernels) and none is visible here")
    for train in (False, True):
        tabs = {label: kernels_per_step(args.model, attn, backend, train, args.steps)
                for label, attn, backend in (("fa3", "eager", "fa3"), ("sdpa", "sdpa", "inductor"))}
        what = "train step" if train else "forward"
        totals = ", ".join(f"{label} {sum(t for t, _ in tab.values()):.0f} us" for label, tab in tabs.items())
        print(f"\n===== {args.model} {what}: GPU time per step: {totals}")
        for label, tab in tabs.items():
            print(f"--- {label} (GEMMs omitted)")
            for key, (t, calls) in sorted(tab.items(), key=lambda x: -x[1][0]):
                if "nvjet" in key or "gemm" in key:
                    continue
                print(f"   {t:9.1f} us  x{calls:4d}  {key[:110]}")


if __name__ == "__main__":
    main()
