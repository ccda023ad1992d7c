"""Kernel benchmark: our Triton attention (forward and backward) against its peers, in ONE run.

Peers: SDPA with cuDNN, SDPA with FA2 (torch's flash backend), FlexAttention (compiled), and FA3's
forward (`flash_attn_interface`, from the `tokenspeed-fa3` wheel) when importable.
Grid: the FA3 paper's (16k tokens per batch, hidden 2048, head dims 64/128/256, N 1k..16k, causal
and not), plus GQA and additive-bias shapes. bf16, BSHD storage, medians of triton.testing.do_bench.
FLOPs: forward 4*B*H*N*N*D (halved when causal), backward 2.5x forward.

Run on a GPU machine:  python benchmarks/kernels.py [--quick] [--sweep] [--out DIR]
Prints TFLOP/s and ratios, writes kernels.json and kernels.png to --out (default $OUT or /tmp).
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

from fa_compile.kernels import triton_family as tf


class Args:
    """Duck-typed AttentionArgs for the kernel family."""

    def __init__(self, q, k, v, causal=False, bias=None, **kw):
        self.q, self.k, self.v = q, k, v
        self.scale = q.shape[-1] ** -0.5
        self.causal = causal
        self.diag_offset = 0
        self.window_left = self.window_right = -1
        self.bias = bias
        self.kv_lens = None
        self.softcap = 0.0
        self.dropout_p = 0.0
        self.dropout_seed = None
        self.needs_backward = True
        self.bias_requires_grad = False
        self.__dict__.update(kw)


def bench(fn) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def tflops(flops: float, ms: float) -> float:
    return round(flops / ms / 1e9, 1)


def bshd(b, h, n, d, dtype=torch.bfloat16, requires_grad=False):
    t = torch.randn(b, n, h, d, device="cuda", dtype=dtype).transpose(1, 2)
    return t.requires_grad_(requires_grad)


def kernel_report(name: str) -> dict:
    """Registers, spills and whether the PTX uses wgmma (HGMMA) for the last compiled kernel of that name."""
    hit = tf.LAST_COMPILED.get(name)
    if hit is None:
        return {}
    cfg, h = hit
    rep = {"cfg": [cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages]}
    for attr in ("n_regs", "n_spills"):
        rep[attr] = getattr(h, attr, None)
    try:
        ptx = h.asm.get("ptx", "")
        rep["wgmma"] = "wgmma" in ptx
        rep["mma_sync"] = "mma.sync" in ptx
    except Exception:
        pass
    return rep


def run_ours(q, k, v, causal, bias=None, bwd=True):
    a = Args(q, k, v, causal=causal, bias=bias)
    fwd = lambda: tf.attention_forward(a)  # noqa: E731
    t_f = bench(fwd)
    rep = {"fwd": kernel_report("attn_fwd_kernel")}
    t_b = None
    if bwd:
        out, lse = fwd()
        dout = torch.randn_like(out)
        t_b = bench(lambda: tf.attention_backward(a, dout, out, lse))
        rep["dkdv"] = kernel_report("attn_bwd_dkdv_kernel")
        rep["dq"] = kernel_report("attn_bwd_dq_kernel")
    return t_f, t_b, rep


def correctness(q, k, v, causal) -> float:
    out, _ = tf.attention_forward(Args(q, k, v, causal=causal))
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=causal)
    return float((out.float() - ref).norm() / ref.norm())


FWD_SWEEP = {
    64: [(128, 64, 4, 3), (128, 64, 8, 3), (64, 64, 4, 3)],
    128: [(64, 64, 4, 3), (128, 64, 8, 3), (64, 128, 4, 2), (64, 64, 4, 4)],
    256: [(128, 64, 8, 2), (64, 64, 4, 2)],
}
BWD_SWEEP = {
    64: {"dkdv": [(64, 128, 8, 2), (64, 64, 4, 3), (32, 128, 8, 2)], "dq": [(128, 64, 8, 2), (128, 32, 4, 3), (64, 64, 4, 3)]},
    128: {"dkdv": [(64, 128, 8, 2), (32, 128, 8, 2), (64, 128, 8, 3)], "dq": [(128, 32, 4, 3), (128, 64, 8, 2), (64, 64, 4, 3)]},
    256: {"dkdv": [(32, 64, 8, 2), (64, 64, 8, 2), (16, 64, 4, 2), (32, 64, 4, 1)],
          "dq": [(64, 32, 8, 2), (128, 32, 8, 2), (64, 64, 8, 2), (64, 32, 4, 1)]},
}


def sweep(d: int, n: int = 4096, with_bwd: bool = False) -> dict:
    """Time each candidate config at one shape; pin the best in CONFIG_OVERRIDE for the rest of the run."""
    h = 2048 // d
    b = 16384 // n
    q, k, v = bshd(b, h, n, d), bshd(b, h, n, d), bshd(b, h, n, d)
    fl = 4 * b * h * n * n * d
    res = {"fwd": []}
    best = None
    for c in FWD_SWEEP[d]:
        tf.CONFIG_OVERRIDE[("fwd", d)] = tf.BlockConfig(*c)
        try:
            t = bench(lambda: tf.attention_forward(Args(q, k, v)))
            row = {"cfg": c, "tflops": tflops(fl, t), **kernel_report("attn_fwd_kernel")}
            if best is None or t < best[0]:
                best = (t, c)
        except Exception as e:  # a config that does not compile is a finding, not a crash
            row = {"cfg": c, "err": f"{type(e).__name__}: {str(e)[:100]}"}
        res["fwd"].append(row)
        print("sweep fwd", d, row, flush=True)
    tf.CONFIG_OVERRIDE[("fwd", d)] = tf.BlockConfig(*best[1])
    # The best config again: pointer loads instead of TMA, and TMA with warp specialization.
    for label, env in ((("no_tma", {"FA_COMPILE_TRITON_TMA": "0"}),) if d == 128 else ()):
        old = {k_: os.environ.get(k_) for k_ in env}
        os.environ.update(env)
        try:
            t = bench(lambda: tf.attention_forward(Args(q, k, v)))
            row = {"variant": label, "cfg": best[1], "tflops": tflops(fl, t), **kernel_report("attn_fwd_kernel")}
        except Exception as e:
            row = {"variant": label, "err": f"{type(e).__name__}: {str(e)[:160]}"}
        finally:
            for k_, v_ in old.items():
                if v_ is None:
                    os.environ.pop(k_, None)
                else:
                    os.environ[k_] = v_
        res["fwd"].append(row)
        print("sweep fwd", d, row, flush=True)
    if with_bwd:
        a = Args(q, k, v)
        out, lse = tf.attention_forward(a)
        dout = torch.randn_like(out)
        for kind in ("dkdv", "dq"):
            res[kind] = []
            best = None
            for c in BWD_SWEEP[d][kind]:
                tf.CONFIG_OVERRIDE[(kind, d)] = tf.BlockConfig(*c)
                try:
                    t = bench(lambda: tf.attention_backward(a, dout, out, lse))
                    row = {"cfg": c, "bwd_tflops": tflops(2.5 * fl, t), **kernel_report(f"attn_bwd_{kind}_kernel")}
                    if best is None or t < best[0]:
                        best = (t, c)
                except Exception as e:
                    row = {"cfg": c, "err": f"{type(e).__name__}: {str(e)[:100]}"}
                res[kind].append(row)
                print("sweep", kind, d, row, flush=True)
            tf.CONFIG_OVERRIDE[(kind, d)] = tf.BlockConfig(*best[1])
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="only N=16k and the extra shapes")
    ap.add_argument("--sweep", action="store_true", help="sweep block configs first and pin the best")
    ap.add_argument("--no-flex", action="store_true")
    ap.add_argument("--sweep-dims", default="64,128,256", help="head dims to sweep (with --sweep)")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    opt = ap.parse_args()
    import triton

    env = {"torch": torch.__version__, "triton": triton.__version__, "cudnn": torch.backends.cudnn.version(),
           "gpu": torch.cuda.get_device_name(), "cap": torch.cuda.get_device_capability(),
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    try:
        import flash_attn_interface as fa3
        env["fa3"] = "flash_attn_interface importable"
    except Exception as e:
        fa3 = None
        env["fa3"] = f"missing ({type(e).__name__})"
    print(env, flush=True)
    result = {"env": env, "sweep": {}, "rows": []}
    if opt.sweep:
        for d in (int(x) for x in opt.sweep_dims.split(",")):
            result["sweep"][d] = sweep(d, with_bwd=True)
        print("pinned configs:", {f"{k[0]}/{k[1]}": v for k, v in tf.CONFIG_OVERRIDE.items()}, flush=True)

    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    flex_c = torch.compile(flex_attention, dynamic=False)
    rows = result["rows"]
    ns = (16384,) if opt.quick else (1024, 4096, 16384)
    for d in (64, 128, 256):
        h = 2048 // d
        for n in ns:
            b = 16384 // n
            for causal in (False, True):
                q, k, v = (bshd(b, h, n, d, requires_grad=True) for _ in range(3))
                fl = 4 * b * h * n * n * d * (0.5 if causal else 1.0)
                row = {"shape": f"d{d} n{n} b{b} h{h}" + (" causal" if causal else ""), "D": d, "N": n, "causal": causal}
                qd, kd, vd = q.detach(), k.detach(), v.detach()
                try:
                    row["err"] = round(correctness(qd, kd, vd, causal), 5)
                    t_f, t_b, rep = run_ours(qd, kd, vd, causal)
                    row["ours"], row["ours_bwd"] = tflops(fl, t_f), tflops(2.5 * fl, t_b)
                    row["ours_kernels"] = rep
                except Exception as e:
                    row["ours"] = f"err {type(e).__name__}: {str(e)[:120]}"
                dout = torch.randn_like(q)
                for name, be in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("fa2", SDPBackend.FLASH_ATTENTION)):
                    try:
                        with sdpa_kernel([be]):
                            fn = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)  # noqa: E731
                            row[name] = tflops(fl, bench(fn))
                            o = fn()
                            row[name + "_bwd"] = tflops(2.5 * fl, bench(lambda: torch.autograd.grad(o, (q, k, v), dout, retain_graph=True)))
                    except Exception as e:
                        row[name] = f"err {type(e).__name__}"
                if fa3 is not None:
                    try:
                        qs, ks, vs = (t.detach().transpose(1, 2) for t in (q, k, v))  # BSHD contiguous
                        row["fa3"] = tflops(fl, bench(lambda: fa3.flash_attn_func(qs, ks, vs, causal=causal)))
                    except Exception as e:
                        row["fa3"] = f"err {type(e).__name__}: {str(e)[:80]}"
                if not opt.no_flex and d == 128 and n in (1024, 16384):
                    try:
                        bm = create_block_mask(lambda b_, h_, qi, ki: qi >= ki, None, None, n, n, device="cuda") if causal else None
                        fn = lambda: flex_c(q, k, v, block_mask=bm)  # noqa: E731
                        row["flex"] = tflops(fl, bench(fn))
                        o = fn()
                        row["flex_bwd"] = tflops(2.5 * fl, bench(lambda: torch.autograd.grad(o, (q, k, v), dout, retain_graph=True)))
                    except Exception as e:
                        row["flex"] = f"err {type(e).__name__}: {str(e)[:80]}"
                rows.append(row)
                print({k_: v_ for k_, v_ in row.items() if k_ != "ours_kernels"}, flush=True)
                del q, k, v, dout

    # GQA: 16k tokens, Hq 32 / Hkv 8, d128 (a Llama-style layer).
    for causal in (False, True):
        b, n, hq, hkv, d = 4, 4096, 32, 8, 128
        q, k, v = bshd(b, hq, n, d), bshd(b, hkv, n, d), bshd(b, hkv, n, d)
        fl = 4 * b * hq * n * n * d * (0.5 if causal else 1.0)
        row = {"shape": f"GQA d{d} n{n} b{b} hq{hq} hkv{hkv}" + (" causal" if causal else ""), "D": d, "N": n, "causal": causal}
        t_f, t_b, _ = run_ours(q, k, v, causal)
        row["ours"], row["ours_bwd"] = tflops(fl, t_f), tflops(2.5 * fl, t_b)
        for name, be in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("fa2", SDPBackend.FLASH_ATTENTION)):
            try:
                with sdpa_kernel([be]):
                    row[name] = tflops(fl, bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)))
            except Exception as e:
                row[name] = f"err {type(e).__name__}"
        if fa3 is not None:
            qs, ks, vs = (t.transpose(1, 2) for t in (q, k, v))
            row["fa3"] = tflops(fl, bench(lambda: fa3.flash_attn_func(qs, ks, vs, causal=causal)))
        rows.append(row)
        print(row, flush=True)

    # Additive bias: [1, H, N, N] bf16 (ALiBi-/relative-position-like) and a bool key mask [B, 1, 1, N].
    b, n, h, d = 4, 4096, 16, 128
    q, k, v = bshd(b, h, n, d), bshd(b, h, n, d), bshd(b, h, n, d)
    fl = 4 * b * h * n * n * d
    base_f, base_b, _ = run_ours(q, k, v, False)
    for label, bias in (("float bias [1,H,N,N]", torch.randn(1, h, n, n, device="cuda", dtype=torch.bfloat16)),
                        ("bool mask [B,1,1,N]", torch.rand(b, 1, 1, n, device="cuda") > 0.1)):
        row = {"shape": f"{label} d{d} n{n} b{b} h{h}", "D": d, "N": n, "causal": False}
        t_f, t_b, rep = run_ours(q, k, v, False, bias=bias)
        row["ours"], row["ours_bwd"] = tflops(fl, t_f), tflops(2.5 * fl, t_b)
        row["vs_ours_nobias"] = round(base_f / t_f, 3)
        row["ours_kernels"] = rep
        for name, be in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
            try:
                with sdpa_kernel([be]):
                    row[name] = tflops(fl, bench(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=bias)))
            except Exception as e:
                row[name] = f"err {type(e).__name__}"
        rows.append(row)
        print({k_: v_ for k_, v_ in row.items() if k_ != "ours_kernels"}, flush=True)

    os.makedirs(opt.out, exist_ok=True)
    json.dump(result, open(os.path.join(opt.out, "kernels.json"), "w"), indent=1, default=str)
    chart(rows, os.path.join(opt.out, "kernels.png"))
    table(rows)


def chart(rows, path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:
        print("no chart:", e)
        return
    impls = ["ours", "cudnn", "fa2", "fa3", "flex"]
    fig, axes = plt.subplots(2, 1, figsize=(max(10, len(rows) * 0.9), 9))
    for ax, suffix, title in ((axes[0], "", "forward"), (axes[1], "_bwd", "backward")):
        width = 0.16
        for i, name in enumerate(impls):
            vals = [r.get(name + suffix) if isinstance(r.get(name + suffix), (int, float)) else 0 for r in rows]
            ax.bar([x + i * width for x in range(len(rows))], vals, width, label=name)
        ax.set_xticks([x + 2 * width for x in range(len(rows))])
        ax.set_xticklabels([r["shape"] for r in rows], rotation=60, ha="right", fontsize=7)
        ax.set_ylabel("TFLOP/s")
        ax.set_title(f"attention {title}, bf16, H200")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def table(rows) -> None:
    def f(x):
        return f"{x:.0f}" if isinstance(x, (int, float)) else "-"

    def ratio(a, b):
        return f"{a / b:.2f}" if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else "-"

    print("\nTFLOP/s (bf16). fwd: ours cudnn fa2 fa3 flex | bwd: ours cudnn fa2 flex | ours/cudnn fwd bwd, ours/fa3")
    for r in rows:
        print(f"{r['shape']:<40} {f(r.get('ours'))} {f(r.get('cudnn'))} {f(r.get('fa2'))} {f(r.get('fa3'))} {f(r.get('flex'))}"
              f" | {f(r.get('ours_bwd'))} {f(r.get('cudnn_bwd'))} {f(r.get('fa2_bwd'))} {f(r.get('flex_bwd'))}"
              f" | {ratio(r.get('ours'), r.get('cudnn'))} {ratio(r.get('ours_bwd'), r.get('cudnn_bwd'))} {ratio(r.get('ours'), r.get('fa3'))}"
              + (f" bias/nobias {r['vs_ours_nobias']}" if "vs_ours_nobias" in r else ""))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
