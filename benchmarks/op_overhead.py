"""Host cost of one `torch.ops.fa3.attention` call against its parts and peers (device run).

For each shape: microseconds per call to enqueue (CPU clock, GPU work queued, not waited for),
for the op, the chosen kernel's adapter called directly, and SDPA; then where the op's host time
goes (cProfile, top functions). Decode shapes are all host: their GPU work is a few microseconds.

    python benchmarks/op_overhead.py              # both parts
    python benchmarks/op_overhead.py --compiled   # only host time inside Inductor's generated code
    python benchmarks/op_overhead.py --fa3-parts  # where FA3's host time per call goes

--fa3-parts: at the compiled prefill shape, enqueue time per call of SDPA's aten ops (flash, cuDNN) against
FA3's C++ forward called directly with the template the lowering fills, with fixed splits / GQA packing, and
through `fa3_lowered::forward` (the lowering's op: one Python frame more);
plus the kernels each launches per call (profiler).

--compiled: a compiled one-layer model (attention alone, the layout glue of a model around it) per
kernel family, prefill and decode shapes: microseconds per call of the compiled function (enqueue),
for eager code under backend="fa3" with the kernel forced (lowered at compile time, and with
lower=False: the op and its run-time dispatch), next to F.scaled_dot_product_attention under
Inductor in the same run.
"""
from __future__ import annotations

import cProfile
import io
import pstats
import statistics
import time

import torch
import torch.nn.functional as F

import fa_compile.ops  # noqa: F401  (registers torch.ops.fa3)
from fa_compile import dispatch

SHAPES = {
    # name: (B, Hq, Hkv, Nq, Nk, D, causal, kv_lens)
    "gpt2 fwd B4 N2048 d64 causal": (4, 16, 16, 2048, 2048, 64, True, False),
    "llama decode B2 Nk320 d128 kv_lens": (2, 16, 8, 1, 320, 128, False, True),
    "llama decode B2 Nk320 d128": (2, 16, 8, 1, 320, 128, False, False),
}


def per_call_us(fn, n: int = 200, batches: int = 5) -> float:
    """Median over `batches` batches of the mean enqueue time of n / batches calls: the lent machine's
    host is shared, and one slow batch should not move the figure."""
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    per = max(n // batches, 1)
    means = []
    for _ in range(batches):
        t0 = time.perf_counter()
        for _ in range(per):
            fn()
        means.append((time.perf_counter() - t0) / per * 1e6)
        torch.cuda.synchronize()
    return statistics.median(means)


def gpu_us(fn) -> float:
    from triton.testing import do_bench_cudagraph

    return do_bench_cudagraph(fn, rep=50) * 1e3


COMPILED_SHAPES = {
    # name: (B, Hq, Hkv, Nq, Nk, D, causal)
    "prefill B2 N256 H16 d64 causal": (2, 16, 16, 256, 256, 64, True),
    "decode B2 Nq1 Nk320 H16/8 d128": (2, 16, 8, 1, 320, 128, False),
}


ROUNDS = 7  # interleaved timing rounds of compiled_rows


def _own_code(fn, tag: str):
    """fn with a code object of its own: Dynamo keeps its compiled entries per code object, so variants that
    share one would pile up behind each other's guards (and past the recompile limit) while all stay alive."""
    import types

    code = fn.__code__.replace(co_name=f"{fn.__code__.co_name}_{tag}")
    return types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)


def compiled_rows() -> None:
    import fa_compile
    from fa_compile.lowering import records

    print(f"\n== host time per call of a compiled one-layer attention (torch {torch.__version__}, "
          f"{torch.cuda.get_device_name()})")
    for name, (b, hq, hkv, nq, nk, d, causal) in COMPILED_SHAPES.items():
        x = torch.randn(b, nq, hq * d, device="cuda", dtype=torch.bfloat16)
        kv = torch.randn(b, nk, 2 * hkv * d, device="cuda", dtype=torch.bfloat16)

        def split(x, kv):
            q = x.view(b, nq, hq, d).transpose(1, 2)
            k, v = (t.view(b, nk, hkv, d).transpose(1, 2) for t in kv.split(hkv * d, dim=-1))
            return q, k, v

        def ours(kernel):
            def layer(x, kv):
                q, k, v = split(x, kv)
                o = fa_compile.attention(q, k, v, causal=causal, kernel=kernel)
                return o.transpose(1, 2).reshape(b, nq, hq * d)
            return layer

        def sdpa_layer(x, kv):
            q, k, v = split(x, kv)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=hq != hkv)
            return o.transpose(1, 2).reshape(b, nq, hq * d)

        torch._dynamo.reset()
        rows = {"SDPA under inductor": torch.compile(_own_code(sdpa_layer, "sdpa"))}
        for kernel in ("cudnn", "flash", "efficient", "fa3", "triton"):
            rows[f"fa3 {kernel} lowered"] = (kernel, True)
            rows[f"fa3 {kernel} op (lower=False)"] = (kernel, False)
        print(f"\n   {name}")
        ready: dict = {}  # label -> (compiled fn, decisions, GPU us)
        for label, what in rows.items():
            try:
                if isinstance(what, tuple):
                    kernel, lower = what
                    n = len(records())
                    fn = torch.compile(_own_code(ours(kernel), f"{kernel}_{lower}"),
                                       backend=fa_compile.backend(lower=lower))
                    fn(x, kv)
                    got = [str(r.decision) for r in records()[n:]]
                else:
                    fn, got = what, []
                    fn(x, kv)
                ready[label] = (fn, got, gpu_us(lambda: fn(x, kv)))
            except Exception as e:
                print(f"   {label:34s} failed: {type(e).__name__}: {str(e)[:160]}")
        # Host time drifts on a shared machine: every variant is timed in each round, in turn, and the
        # figures are medians over rounds (the ratio also paired by round, against SDPA's time that round).
        times: dict = {label: [] for label in ready}
        for _ in range(ROUNDS):
            for label, (fn, _, _) in ready.items():
                times[label].append(per_call_us(lambda: fn(x, kv), n=100, batches=2))
        base = times.get("SDPA under inductor")
        for label, (fn, got, gpu) in ready.items():
            host = statistics.median(times[label])
            ratio = "" if base is None else \
                f"  x{statistics.median(t / b for t, b in zip(times[label], base)):.2f} SDPA (paired)"
            note = f"   [{'; '.join(got)}]" if got else ""
            print(f"   {label:34s} host {host:8.1f} us   GPU {gpu:8.1f} us{ratio}{note}")


def fa3_parts() -> None:
    from fa_compile.candidates import fa3 as fa3_cand
    from fa_compile.lowering import fa3 as fa3_low  # noqa: F401  (registers fa3_lowered::forward)

    b, h, n, d = 2, 16, 256, 64
    scale = d ** -0.5
    print(f"\n== FA3's host time per call, B{b} N{n} H{h} d{d} causal bf16 (torch {torch.__version__}, "
          f"{torch.cuda.get_device_name()})")
    direct = fa3_cand._direct_forward()
    if direct is None:
        print("   FA3's C++ forward is not importable or its schema is not usable here")
        return
    op, template, index = direct
    qb, kb, vb = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    q, k, v = (t.transpose(1, 2) for t in (qb, kb, vb))  # [B, H, N, D] views of BSHD storage

    def fa3_args(**kw):
        args = list(template)
        args[index["q"]], args[index["k"]], args[index["v"]] = qb, kb, vb
        kw = {"softmax_scale": scale, "causal": True, **kw}
        for name, value in kw.items():
            args[index[name]] = value
        return args

    plain, fixed = fa3_args(), fa3_args(num_splits=1)
    if "pack_gqa" in index:
        fixed[index["pack_gqa"]] = False
    rows = {
        "aten flash (SDPA's flash op)":
            lambda: torch.ops.aten._scaled_dot_product_flash_attention.default(q, k, v, 0.0, True, False, scale=scale),
        "aten cuDNN (SDPA's cuDNN op)":
            lambda: torch.ops.aten._scaled_dot_product_cudnn_attention.default(q, k, v, None, True, 0.0, True,
                                                                               False, scale=scale),
        "F.scaled_dot_product_attention": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
        "FA3 C++ forward, the lowering's arguments": lambda: op(*plain),
        "FA3 C++ forward, 1 split, no GQA packing": lambda: op(*fixed),
        "fa3_lowered::forward (the lowered node)":
            lambda: torch.ops.fa3_lowered.forward.default(qb, kb, vb, None, scale, True, -1, 0, 0.0, 1),
        "torch.empty_like x2 (allocation floor)": lambda: (torch.empty_like(qb), torch.empty_like(qb)),
    }
    for label, fn in rows.items():
        try:
            host = per_call_us(fn, n=1000, batches=10)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                fn()
                torch.cuda.synchronize()
            kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
            short = "; ".join(sorted({name[:48] for name in kernels}))
            print(f"   {label:46s} host {host:7.1f} us   {len(kernels)} launches: {short}")
        except Exception as e:
            print(f"   {label:46s} failed: {type(e).__name__}: {str(e)[:160]}")


def main() -> None:
    import sys

    if "--fa3-parts" in sys.argv:
        fa3_parts()
        return
    if "--compiled" in sys.argv:
        compiled_rows()
        return
    from fa_compile.candidates import fa3

    print("FA3 forward through", "the C++ op directly" if fa3._direct_forward() else "the wrapper (schema not usable)")
    for name, (b, hq, hkv, nq, nk, d, causal, lens) in SHAPES.items():
        q = torch.randn(b, nq, hq, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        k = torch.randn(b, nk, hkv, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        v = torch.randn(b, nk, hkv, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
        kv = torch.full((b,), nk - 3, device="cuda", dtype=torch.int64) if lens else None
        off = nk - nq if causal else 0
        op = torch.ops.fa3.attention.default

        def call(kernel=None):
            return op(q, k, v, d ** -0.5, causal, off, -1, -1, None, kv, 0.0, 0.0, None, kernel)

        args = dispatch.AttentionArgs(q, k, v, d ** -0.5, causal, off, -1, -1, None, kv)
        chosen = dispatch.select_forward(args)
        kq, kk, kvv = q, k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1)
        rows = {
            f"fa3.attention (dispatch -> {chosen.name})": call,
            f"{chosen.name} adapter directly": lambda: chosen.cand.forward(args),
            "dispatch.select_forward only": lambda: dispatch.select_forward(args),
            "F.scaled_dot_product_attention (K/V repeated)": lambda: F.scaled_dot_product_attention(kq, kk, kvv, is_causal=causal),
        }
        for cand in dispatch.candidates("forward"):
            if cand.name != "reference" and not dispatch._reasons(cand, args, forced=True):
                rows[f"fa3.attention forced {cand.name}"] = (lambda n: lambda: call(n))(cand.name)
        print(f"\n== {name}   (host: enqueue time per call; GPU: CUDA-graph replay time per call)")
        for label, fn in rows.items():
            try:
                host = per_call_us(fn)
                gpu = gpu_us(fn) if "select_forward" not in label else float("nan")
                print(f"   {label:48s} host {host:8.1f} us   GPU {gpu:8.1f} us")
            except Exception as e:
                print(f"   {label:48s} failed: {type(e).__name__}: {str(e)[:160]}")
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(200):
            call()
        pr.disable()
        torch.cuda.synchronize()
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(8)
        print("\n".join(line for line in s.getvalue().splitlines() if line.strip())[:3000])
    compiled_rows()


if __name__ == "__main__":
    main()
