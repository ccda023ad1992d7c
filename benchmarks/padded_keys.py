"""A padded encoder (benchmarks/models.py's BERT: 8 layers, hidden 1024, B32 x 512, the last half of the tokens of
half the batch padded), bf16, forward (no grad) or training step, in ONE process: eager attention code under fa3
whose Triton kernels read each sequence's keys only up to its mask's last kept one ("cut", the default), the same
with that limit switched off ("every-key": fa_compile/lowering/key_limit.py `cuts_keys` patched to refuse), "cut"
with the backward's dQ kernel instead of dQ added by the dK/dV kernel ("dq-kernel": FA_COMPILE_FUSED_DQ=0 while it
compiles), "cut" with the backward on the pointer kernels where the Gluon kernel would take it on Hopper
("pointer-bwd": FA_COMPILE_GLUON=0 while it compiles), and the model's SDPA code under Inductor. Rounds interleave the variants (triton.testing.do_bench, median of the rounds);
then the attention kernels of every variant but "every-key", GPU µs per step. Each round also times 10 steps run
back to back (one CUDA event pair around them, as a training loop runs them: the host may enqueue ahead of the
GPU), and `--idle` adds, per variant, the GPU's idle time over 3 profiled steps (the gaps between its kernels:
where it waits for the host).

    python benchmarks/padded_keys.py [--mode train|fwd] [--rounds 5] [--idle]
                                     [--variants cut,every-key,dq-kernel,pointer-bwd,sdpa]
                                     [--out F.json] [--batch B] [--seq N] [--hidden H] [--layers L]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernel_diff import cuda_kernels, model_step  # noqa: E402
from models import FULL, build, inputs  # noqa: E402

ATTENTION = ("attn_", "sdpa", "flash", "fmha", "key_limit")  # kernel names counted as attention in the listing


def make_step(variant: str, mode: str, cuts_keys, spec: dict):
    import fa_compile
    from fa_compile.lowering import key_limit

    model = build("bert", "sdpa" if variant == "sdpa" else "eager", spec["cfg"], "cuda", torch.bfloat16)
    model.train(mode == "train")
    kw = inputs("bert", model, spec, "cuda", torch.bfloat16)[1 if mode == "train" else 0]
    if variant == "sdpa":
        f = torch.compile(model)
    else:
        # the switch acts while the graphs are lowered, i.e. at this variant's first call below
        key_limit.cuts_keys = (lambda *a: False) if variant == "every-key" else cuts_keys
        f = torch.compile(model, backend=fa_compile.backend())

    step = model_step(f, model, kw, mode == "train")
    switch = {"dq-kernel": "FA_COMPILE_FUSED_DQ", "pointer-bwd": "FA_COMPILE_GLUON"}.get(variant)
    with mock.patch.dict(os.environ, {switch: "0"} if switch else {}):  # read while the first calls compile
        for _ in range(3):
            step()
    torch.cuda.synchronize()
    return step


def back_to_back(step, n: int = 10) -> float:
    """ms per step over n steps enqueued without synchronizing (after one synchronized step)."""
    step()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        step()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / n


def gpu_idle_ms(step, n: int = 3) -> tuple[float, float]:
    """(span, idle) in ms per step over n profiled steps: the time between the first kernel's start and the last
    one's end, and the part of it no kernel, copy or fill was running."""
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            step()
        torch.cuda.synchronize()
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA)
    busy, (lo, hi) = 0.0, spans[0]
    for s, e in spans[1:]:
        if s > hi:
            busy += hi - lo
            lo = s
        hi = max(hi, e)
    busy += hi - lo
    span = hi - spans[0][0]
    return span / n / 1e3, (span - busy) / n / 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=("train", "fwd"), default="train")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--variants", default="cut,every-key,sdpa")
    ap.add_argument("--out", default=None, help="a JSON file, or a folder to write padded-keys-MODE.json into")
    ap.add_argument("--idle", action="store_true")
    ap.add_argument("--batch", type=int, default=None, help="batch (default: models.py's 32)")
    ap.add_argument("--seq", type=int, default=None, help="tokens per sequence (default 512)")
    ap.add_argument("--hidden", type=int, default=None, help="hidden size, 64 per head (default 1024)")
    ap.add_argument("--layers", type=int, default=None, help="layers (default 8)")
    args = ap.parse_args()
    spec = dict(FULL["bert"], cfg=dict(FULL["bert"]["cfg"]))
    if args.batch:
        spec["B"] = args.batch
    if args.seq:
        spec["N"] = args.seq
    if args.hidden:
        spec["cfg"].update(hidden_size=args.hidden, num_attention_heads=args.hidden // 64,
                           intermediate_size=4 * args.hidden)
    if args.layers:
        spec["cfg"]["num_hidden_layers"] = args.layers
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config
    from triton.testing import do_bench

    from fa_compile.lowering import graph_pass, key_limit

    cuts_keys = key_limit.cuts_keys  # the rule itself, put back for the "cut" variant
    # every variant lowers its own graphs: a cached graph of another variant would be reused otherwise
    inductor_config.fx_graph_cache = False
    functorch_config.enable_autograd_cache = False
    steps = {}
    for v in args.variants.split(","):
        t0 = time.time()
        n0 = len(graph_pass.records())
        steps[v] = make_step(v, args.mode, cuts_keys, spec)
        print(f"{args.mode} {v}: compiled and warmed in {time.time() - t0:.1f} s", flush=True)
        for r in graph_pass.records()[n0:n0 + 2]:
            print("   ", r.decision)
    times: dict[str, list[float]] = {v: [] for v in steps}
    b2b: dict[str, list[float]] = {v: [] for v in steps}
    for _ in range(args.rounds):
        for v, s in steps.items():
            times[v].append(do_bench(s, warmup=5, rep=60))
            b2b[v].append(back_to_back(s))
    med = {v: sorted(t)[len(t) // 2] for v, t in times.items()}
    med_b2b = {v: sorted(t)[len(t) // 2] for v, t in b2b.items()}
    for v, t in times.items():
        ratio = f"  vs sdpa {med[v] / med['sdpa']:.3f}" if "sdpa" in med else ""
        print(f"{args.mode} {v:9s} median {med[v]:.3f} ms  rounds {[round(x, 3) for x in t]}{ratio}")
    for v, t in b2b.items():
        ratio = f"  vs sdpa {med_b2b[v] / med_b2b['sdpa']:.3f}" if "sdpa" in med_b2b else ""
        print(f"{args.mode} {v:9s} back to back: median {med_b2b[v]:.3f} ms  rounds {[round(x, 3) for x in t]}{ratio}")
    res = dict(mode=args.mode, shape=dict(B=spec["B"], N=spec["N"], **spec["cfg"]), times=times, median=med, back_to_back=b2b, median_back_to_back=med_b2b,
               torch=torch.__version__, gpu=torch.cuda.get_device_name())
    if args.idle:
        for v, s in steps.items():
            span, idle = gpu_idle_ms(s)
            print(f"{args.mode} {v:9s} profiled: {span:.2f} ms per step, GPU idle {idle:.2f} ms of it", flush=True)
            res[f"idle_{v}"] = dict(span_ms=span, idle_ms=idle)
    for v in [v for v in steps if v != "every-key"]:
        k = cuda_kernels(steps[v], 3)
        attn = {n: x for n, x in k.items() if any(a in n for a in ATTENTION)}
        print(f"{args.mode} {v}: GPU us per step {sum(t for t, _ in k.values()):.0f}, attention kernels:")
        for name, (t, c) in sorted(attn.items(), key=lambda kv: -kv[1][0]):
            print(f"  {t:9.1f} us x {c:3d}  {name[:100]}")
        res[f"kernels_{v}"] = k
    if args.out:
        out = Path(args.out)
        out = out / f"padded-keys-{args.mode}.json" if out.is_dir() else out  # (a folder such as $OUT)
        out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
