"""FP8 attention forward benchmark: ours (fa_compile/kernels/fp8) against our bf16 forward and the peers, in ONE run.

Rows: the FA3 paper's grid (16k tokens per batch, B = 16k / N, hidden 2048, so H = 2048 / d), head dims
64 / 128 / 256, N 4k and 16k, causal and not; bf16 inputs in BSHD storage. Columns (TFLOP/s, forward
FLOPs 4*B*H*N*N*d, halved when causal): ours FP8 with the quantization (`fp8`), the kernel alone on
inputs quantized beforehand (`fp8_kernel`), with int8 Q.Kᵀ (`fp8_int8qk`), the quantization alone in
microseconds (`quant_us`; `quant_nohadamard_us` without the rotation), our bf16
forward (`ours_bf16`, triton_family.attention_forward), cuDNN bf16 (SDPA), FA3 bf16 and FA3 FP8 (plain
cast, unit descales; `flash_attn_interface`, when importable). Each timing is the median of
triton.testing.do_bench.

  python benchmarks/fp8_kernels.py [--quick] [--sweep] [--out DIR]

--quick: d128 and d256 at N 16k only. --sweep: also time tile / pipeline variants of the FP8 kernel
(block_m, block_n, num_warps, num_stages), then with the best: TMA off, warp specialization on, one-level
accumulation and int8 Q.Kᵀ, at d128 / d256, N 16k, and report the best tile.
Prints a table; writes fp8_kernels.json to --out (default $OUT or /tmp).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from fa_compile.kernels import fp8 as fp8k
from fa_compile.kernels import triton_family as tf
from fa_compile.kernels.fp8 import launch as fp8_launch


def _kernel_bench():
    """benchmarks/kernel_peers.py (its Args, timing and input helpers), loaded by path."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kernel_peers.py")
    spec = importlib.util.spec_from_file_location("bench_kernels", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


_kb = _kernel_bench()
Args, bench, bshd, tflops = _kb.Args, _kb.bench, _kb.bshd, _kb.tflops


def fa3_module():
    try:
        import flash_attn_interface as fa3

        return fa3
    except Exception:
        return None


def _first(o):
    return o[0] if isinstance(o, tuple) else o


def fp8_fns(q, k, v, causal):
    """(full forward, kernel alone, quantization alone) of ours on bf16 inputs."""
    scale = q.shape[-1] ** -0.5
    bm, bn, _, _ = fp8_launch.pick_config(q.shape[-1], q.device)
    quant = lambda: fp8k.quantize_inputs(q, k, v, block_m=bm, block_n=bn, hadamard=fp8k.HADAMARD_DEFAULT,  # noqa: E731
                                         smooth_q=fp8k.SMOOTH_Q_DEFAULT)
    qz = quant()
    full = lambda: fp8k.fp8_forward(q, k, v, scale, causal=causal)  # noqa: E731
    kern = lambda: fp8k.fp8_forward(q, k, v, scale, causal=causal, quantized=qz)  # noqa: E731
    return full, kern, quant


def safe(fn, fl: float):
    try:
        fn()
        return tflops(fl, bench(fn))
    except Exception as e:  # a peer missing or failing is a finding, not a crash
        return f"err {type(e).__name__}: {str(e)[:100]}"


def row(d: int, n: int, causal: bool, fa3) -> dict:
    h, b = 2048 // d, 16384 // n
    torch.manual_seed(0)
    q, k, v = bshd(b, h, n, d), bshd(b, h, n, d), bshd(b, h, n, d)
    fl = 4 * b * h * n * n * d * (0.5 if causal else 1.0)
    r: dict = {"d": d, "N": n, "B": b, "H": h, "causal": causal}
    full, kern, quant = fp8_fns(q, k, v, causal)
    r["fp8"] = safe(full, fl)
    r["fp8_kernel"] = safe(kern, fl)
    r["fp8_cfg"] = fp8_launch.LAST_CONFIG.get("fwd")
    r["fp8_int8qk"] = safe(lambda: fp8k.fp8_forward(q, k, v, d ** -0.5, causal=causal, qk_int8=True), fl)
    bm, bn, _, _ = fp8_launch.pick_config(d, q.device)
    plain_quant = lambda: fp8k.quantize_inputs(q, k, v, block_m=bm, block_n=bn, hadamard=False)  # noqa: E731
    for col, fn in (("quant_us", quant), ("quant_nohadamard_us", plain_quant)):
        try:
            fn()
            r[col] = round(bench(fn) * 1e3, 1)
        except Exception as e:
            r[col] = f"err {type(e).__name__}: {str(e)[:100]}"
    a = Args(q, k, v, causal=causal)
    r["ours_bf16"] = safe(lambda: tf.attention_forward(a), fl)
    qt, kt, vt = q, k, v  # [B, H, N, D] views of BSHD storage

    def cudnn():
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)

    r["cudnn_bf16"] = safe(cudnn, fl)
    if fa3 is not None:
        qs, ks, vs = (t.transpose(1, 2) for t in (q, k, v))  # [B, N, H, D] contiguous
        r["fa3_bf16"] = safe(lambda: _first(fa3.flash_attn_func(qs, ks, vs, causal=causal)), fl)
        q8, k8, v8 = (t.to(torch.float8_e4m3fn) for t in (qs, ks, vs))
        ds = torch.ones(b, h, device="cuda", dtype=torch.float32)
        r["fa3_fp8"] = safe(lambda: _first(fa3.flash_attn_func(q8, k8, v8, causal=causal, q_descale=ds,
                                                               k_descale=ds, v_descale=ds)), fl)
    for peer in ("ours_bf16", "fa3_fp8"):
        if isinstance(r.get("fp8"), float) and isinstance(r.get(peer), float):
            r[f"fp8_vs_{peer}"] = round(r["fp8"] / r[peer], 3)
    hit = fp8_kernel_report()
    if hit:
        r["kernel"] = hit
    return r


def fp8_kernel_report() -> dict:
    """Registers and spills of the last compiled FP8 kernel (Triton's cache of the jit function)."""
    from fa_compile.kernels.fp8.kernel import attn_fwd_fp8_kernel

    try:
        cache = attn_fwd_fp8_kernel.device_caches[torch.cuda.current_device()][0]
        h = list(cache.values())[-1]
        return {"n_regs": getattr(h, "n_regs", None), "n_spills": getattr(h, "n_spills", None)}
    except Exception:
        return {}


SWEEP = {
    128: [(128, 128, 8, 3), (128, 128, 8, 2), (128, 64, 4, 3), (128, 128, 4, 3), (64, 128, 4, 3), (128, 64, 8, 4)],
    256: [(128, 64, 8, 2), (128, 128, 8, 2), (64, 64, 4, 2), (128, 64, 8, 3)],
}


def sweep(n: int = 16384) -> list[dict]:
    res = []
    for d, cfgs in SWEEP.items():
        h, b = 2048 // d, 16384 // n
        q, k, v = bshd(b, h, n, d), bshd(b, h, n, d), bshd(b, h, n, d)
        for causal in (False, True):
            fl = 4 * b * h * n * n * d * (0.5 if causal else 1.0)
            best = None
            variants = [(c, {}) for c in cfgs]
            variants += [(None, {"FA_COMPILE_FP8_TMA": "0"}), (None, {"FA_COMPILE_FP8_WS": "1"}),
                         (None, {"two_level": False}), (None, {"qk_int8": True})]
            for cfg, extra in variants:
                if cfg is None:
                    if best is None:
                        continue
                    cfg = best[1]
                fp8_launch.CONFIG_OVERRIDE[d] = cfg
                env = {x: y for x, y in extra.items() if x.startswith("FA_")}
                kw = {x: y for x, y in extra.items() if not x.startswith("FA_")}
                old = {x: os.environ.get(x) for x in env}
                os.environ.update(env)
                try:
                    bm, bn = cfg[0], cfg[1]
                    qz = fp8k.quantize_inputs(q, k, v, block_m=bm, block_n=bn, qk_int8=kw.pop("qk_int8", False))
                    fn = lambda: fp8k.fp8_forward(q, k, v, d ** -0.5, causal=causal, quantized=qz, **kw)  # noqa: E731
                    fn()
                    t = bench(fn)
                    r = {"d": d, "causal": causal, "cfg": cfg, **extra, "fp8_kernel": tflops(fl, t),
                         **fp8_kernel_report()}
                    if not extra and (best is None or t < best[0]):
                        best = (t, cfg)
                except Exception as e:
                    r = {"d": d, "causal": causal, "cfg": cfg, **extra, "err": f"{type(e).__name__}: {str(e)[:160]}"}
                finally:
                    for x, y in old.items():
                        if y is None:
                            os.environ.pop(x, None)
                        else:
                            os.environ[x] = y
                    fp8_launch.CONFIG_OVERRIDE.pop(d, None)
                print("sweep", r, flush=True)
                res.append(r)
            if best is not None:
                res.append({"d": d, "causal": causal, "best": best[1], "best_tflops": tflops(fl, best[0])})
                print("sweep best", res[-1], flush=True)
    return res


COLS = ("fp8", "fp8_kernel", "fp8_int8qk", "quant_us", "quant_nohadamard_us", "ours_bf16", "cudnn_bf16",
        "fa3_bf16", "fa3_fp8", "fp8_vs_ours_bf16", "fp8_vs_fa3_fp8")


def print_table(rows: list[dict]) -> None:
    head = ["d", "N", "causal", *COLS]
    print(" | ".join(f"{c:>10}" for c in head))
    for r in rows:
        cells = [r["d"], r["N"], "yes" if r["causal"] else "no"] + [r.get(c, "-") for c in COLS]
        print(" | ".join(f"{(c if not isinstance(c, str) or len(c) < 11 else 'err'):>10}" for c in cells))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    t0 = time.time()
    fa3 = fa3_module()
    grid = [(d, n, c) for d in (64, 128, 256) for n in (4096, 16384) for c in (False, True)]
    if a.quick:
        grid = [(d, 16384, c) for d in (128, 256) for c in (False, True)]
    res: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "fa3": fa3 is not None,
                 "rows": []}
    import triton

    res["triton"] = triton.__version__
    for d, n, c in grid:
        r = row(d, n, c, fa3)
        print(r, flush=True)
        res["rows"].append(r)
        torch.cuda.empty_cache()
    if a.sweep:
        res["sweep"] = sweep()
    res["seconds"] = round(time.time() - t0, 1)
    print_table(res["rows"])
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "fp8_kernels.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(f"wrote {os.path.join(a.out, 'fp8_kernels.json')} in {res['seconds']} s")


if __name__ == "__main__":
    main()
