"""Launch order of the Gluon kernels under a causal mask: grouped (triton_family.launch_groups) against one
(batch, head) after another, forward and backward, with cuDNN's SDPA in the same run.

Under a causal mask a program's work depends on its block (query block in the forward, key block in the
backward); the grouped order starts the long programs of a few heads together, so the short ones fill in
behind them (triton_common.grouped_program_ids). Every time is the median of three alternating rounds of
triton.testing.do_bench_cudagraph (GPU time, no host time: the op's launchers allocate inside the graph).
The two orders must give bit-identical outputs, dK and dV (only dQ's summation order changes).

Run on a Hopper GPU:  python benchmarks/launch_order.py [--out FILE]
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench_cudagraph

from fa_compile import dispatch
from fa_compile.kernels import triton_family as tf

SHAPES = [(1, 32, 16384, 64), (1, 16, 16384, 128), (4, 32, 4096, 64), (4, 16, 4096, 128), (2, 32, 4096, 128),
          (1, 32, 2048, 128), (4, 16, 2048, 64), (8, 16, 1024, 128), (16, 16, 1024, 64)]


class _Order:
    """Swaps triton_family.launch_groups between its rule and one group per (batch, head)."""

    def __init__(self) -> None:
        self.rule = tf.launch_groups
        self.grouped = True
        tf.launch_groups = self

    def __call__(self, n_inner: int, n_outer: int, device: torch.device, uneven: bool) -> int:
        return self.rule(n_inner, n_outer, device, uneven) if self.grouped else max(n_outer, 1)


def _median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def row(order: _Order, b: int, h: int, n: int, d: int) -> str:
    torch.manual_seed(0)
    q, k, v, dout = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2) for _ in range(4))
    args = dispatch.AttentionArgs(q, k, v, d ** -0.5, True, diag_offset=0, needs_backward=True)
    cap = tf._capability(q.device)
    res = {}
    for grouped in (False, True):
        order.grouped = grouped
        out, lse = tf.attention_forward(args)
        delta = (out.float() * dout.float()).sum(-1).contiguous()
        grads = [torch.full_like(x, float("nan")) for x in (q, k, v)]
        if not tf.backward_gluon(args, q, k, v, dout, lse, delta, *grads, cap, 0):
            return f"B{b} H{h} N{n} d{d}: the Gluon backward does not take this shape"
        res[grouped] = (out, lse, delta, *grads)
    same = all(torch.equal(res[False][i], res[True][i]) for i in (0, 1, 4, 5))
    out, lse, delta = res[False][:3]
    grads = [torch.empty_like(x) for x in (q, k, v)]
    qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))

    def cudnn_fwd() -> None:
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION), torch.no_grad():
            F.scaled_dot_product_attention(qg, kg, vg, is_causal=True)

    def cudnn_fwd_bwd() -> None:
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            o = F.scaled_dot_product_attention(qg, kg, vg, is_causal=True)
            torch.autograd.grad(o, (qg, kg, vg), dout)

    t: dict[str, list[float]] = {name: [] for name in ("cf", "cfb", "f0", "f1", "b0", "b1")}
    for _ in range(3):
        t["cf"].append(do_bench_cudagraph(cudnn_fwd))
        t["cfb"].append(do_bench_cudagraph(cudnn_fwd_bwd))
        for grouped in (False, True):
            order.grouped = grouped
            t[f"f{int(grouped)}"].append(do_bench_cudagraph(lambda: tf.attention_forward(args)))
            t[f"b{int(grouped)}"].append(do_bench_cudagraph(
                lambda: tf.backward_gluon(args, q, k, v, dout, lse, delta, *grads, cap, 0)))
    m = {name: _median(xs) for name, xs in t.items()}
    cb = m["cfb"] - m["cf"]
    return (f"B{b} H{h} N{n} d{d} | {m['cf']:.3f} / {m['f0']:.3f} / {m['f1']:.3f} | {m['cf'] / m['f1']:.3f} | "
            f"{cb:.3f} / {m['b0']:.3f} / {m['b1']:.3f} | {cb / m['b1']:.3f} | {m['f0'] / m['f1']:.3f}, "
            f"{m['b0'] / m['b1']:.3f} | {same}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="also write the table to this file")
    a = p.parse_args()
    order = _Order()
    lines = [f"{torch.cuda.get_device_name()}, torch {torch.__version__}, bf16, causal, BSHD; ms",
             "shape | fwd: cuDNN / one head after another / grouped | cuDNN / grouped | "
             "bwd: cuDNN / one head after another / grouped | cuDNN / grouped | grouped's gain fwd, bwd | "
             "out, lse, dK, dV bit-identical"]
    print("\n".join(lines), flush=True)
    for shape in SHAPES:
        lines.append(row(order, *shape))
        print(lines[-1], flush=True)
    if a.out:
        with open(a.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
