"""GPU time and host time per call of our kernels and their peers across sequence lengths (device run).

16k tokens per batch (B = 16384 / N), hidden 2048 by default. Two clocks per variant:
- gpu: CUDA events around `reps` calls enqueued behind a sleep kernel, so the host is far ahead and the
  figure is the kernels' own time (launch gaps excluded);
- host: CPU time to enqueue one call (GPU work queued behind a sleep, not waited for).
A variant whose host time exceeds its GPU time is launch-bound: do_bench and a model see the host time.

    python benchmarks/seq_lengths.py [--d 128] [--lengths 512,1024,2048,4096,16384]
"""
from __future__ import annotations

import argparse
import os
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from fa_compile import dispatch
from fa_compile.kernels import triton_family as tf

from kernel_peers import Args, bshd  # noqa: E402  (benchmarks/ is on sys.path when run as a script)

SLEEP_CYCLES = int(3e8)  # ~150 ms at H200 clocks: longer than enqueueing `reps` calls on the host


def clocks(fn, reps: int = 20) -> tuple[float, float]:
    """(GPU ms per call, host ms per call) of fn, measured as the module docstring says."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(SLEEP_CYCLES)
    start.record()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    host = (time.perf_counter() - t0) / reps * 1e3
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps, host


def host_profile(name: str, fn, reps: int = 200) -> None:
    """Top functions by own time over `reps` calls (GPU kept busy behind a sleep so nothing blocks)."""
    import cProfile
    import io
    import pstats

    fn()
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES * 2)
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(reps):
        fn()
    pr.disable()
    torch.cuda.synchronize()
    buf = io.StringIO()
    pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(14)
    print(f"--- host profile: {name}, {reps} calls\n" + buf.getvalue().split("\n", 6)[-1], flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--lengths", default="512,1024,2048,4096,16384")
    ap.add_argument("--profile", action="store_true", help="also cProfile the host side of our forward and "
                    "backward at the first length")
    opt = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/seq_lengths.py: needs a CUDA GPU (it times CUDA kernels) and none is visible here")
    try:
        import flash_attn_interface as fa3
    except Exception:
        fa3 = None
    d = opt.d
    h = 2048 // d
    print(f"torch {torch.__version__} {torch.cuda.get_device_name()} d{d} h{h}, 16k tokens; ms per call "
          "(gpu / host) and TFLOP/s from the GPU clock", flush=True)
    for n in (int(x) for x in opt.lengths.split(",")):
        b = max(1, 16384 // n)
        q, k, v = bshd(b, h, n, d), bshd(b, h, n, d), bshd(b, h, n, d)
        for causal in (False, True):
            fl = 4 * b * h * n * n * d * (0.5 if causal else 1.0)
            a = Args(q, k, v, causal=causal)
            out, lse = tf.attention_forward(a)
            dout = torch.randn_like(out)
            # The same forward kernel also through dispatch's candidate adapter (what a rewritten graph calls).
            cand = next(c for c in dispatch.candidates("forward") if c.name == "triton")
            da = dispatch.AttentionArgs(q=q, k=k, v=v, scale=d ** -0.5, causal=causal)

            def ours(gluon: str, fn):
                def f():
                    os.environ["FA_COMPILE_GLUON"] = gluon
                    fn()
                return f

            fwd, bwd = (lambda: tf.attention_forward(a)), (lambda: tf.attention_backward(a, dout, out, lse))
            variants = {"fwd gluon": ours("1", fwd), "fwd tl": ours("0", fwd),
                        "fwd gluon cand": ours("1", lambda: cand.forward(da)),
                        "fwd cudnn": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)}
            if fa3 is not None:
                qs, ks, vs = (t.transpose(1, 2) for t in (q, k, v))
                variants["fwd fa3"] = lambda: fa3.flash_attn_func(qs, ks, vs, causal=causal)
            variants.update({"bwd gluon": ours("1", bwd), "bwd tl": ours("0", bwd)})
            res = {}
            # SDPA restricted to cuDNN for its row; entered once, so its host time is SDPA's alone.
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                for name, fn in variants.items():
                    try:
                        g, hst = clocks(fn)
                        mult = 2.5 if name.startswith("bwd") else 1.0
                        res[name] = f"{g:.3f}/{hst:.3f} {mult * fl / g / 1e9:.0f}"
                    except Exception as e:
                        res[name] = f"ERR {type(e).__name__}: {str(e)[:120]}"
            os.environ.pop("FA_COMPILE_GLUON", None)
            if opt.profile and not causal and n == int(opt.lengths.split(",")[0]):
                for name in ("fwd gluon", "bwd gluon", "fwd gluon cand"):
                    host_profile(name, variants[name])
            print(f"N{n} B{b}{' causal' if causal else ''}: " + "  ".join(f"{k_} {v_}" for k_, v_ in res.items()),
                  flush=True)


if __name__ == "__main__":
    main()
