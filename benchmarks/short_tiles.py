"""Our Triton pointer kernels (the ones the compile-time lowering launches at short lengths) at an encoder's
training shape, per tile configuration, beside cuDNN and mem-efficient SDPA in the same run: kernel times
from the profiler, forward and backward.

Shape: B32 x H16 x N512 x d64, bf16, BSHD storage, an additive key-padding mask on half the batch, dropout
(default 0.1; BERT-large-like training). Each row pins one (dK/dV, dQ, forward) tile triple through
triton_family.CONFIG_OVERRIDE; the first row is the default table.

    python benchmarks/short_tiles.py [--dropout 0.1]
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.nn.attention
import torch.nn.functional as F

os.environ.setdefault("FA_COMPILE_TRITON_TMA", "0")  # the pointer kernels, as the lowering runs them

import fa_compile  # noqa: E402
from fa_compile.kernels import triton_family as tf  # noqa: E402
from fa_compile.kernels.triton_family import BlockConfig as C  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernel_diff import cuda_kernels  # noqa: E402

B, H, N, D = 32, 16, 512, 64
DKDV = [C(64, 64, 4, 2), C(64, 64, 4, 3), C(32, 64, 4, 2), C(64, 128, 4, 2), C(64, 128, 8, 2), C(128, 64, 8, 2),
        C(32, 128, 4, 2), C(128, 128, 8, 2), C(64, 128, 8, 3), C(32, 64, 2, 2), C(128, 64, 4, 2), C(32, 128, 8, 2)]
DQ = [C(64, 64, 4, 2), C(128, 32, 4, 3), C(128, 64, 8, 2), C(64, 32, 4, 2), C(128, 64, 4, 2), C(64, 128, 4, 2),
      C(128, 128, 8, 2), C(32, 64, 4, 2), C(64, 64, 4, 3), C(128, 32, 8, 2), C(64, 32, 2, 2), C(128, 64, 8, 3)]
FWD = [C(128, 64, 4, 3, qreg=True), C(64, 64, 4, 2), C(128, 128, 8, 2), C(64, 128, 4, 3, qreg=True), C(128, 64, 8, 2),
       C(64, 64, 4, 3), C(128, 32, 4, 2), C(64, 32, 4, 2), C(128, 128, 8, 3), C(64, 128, 4, 2), C(128, 64, 4, 2),
       C(32, 64, 4, 2)]


def kernel_us(fn, iters: int = 10) -> dict[str, float]:
    """{kernel name (60 characters): GPU µs per call of fn}."""
    return {key[:60]: us for key, (us, _) in cuda_kernels(fn, iters).items()}


def attention_kernels(r: dict[str, float]) -> str:
    keep = {n: t for n, t in r.items() if any(w in n for w in ("attn", "fwd", "bwd", "flash", "sdpa", "fmha"))}
    return "  ".join(f"{n[:28]}={t:.1f}" for n, t in sorted(keep.items(), key=lambda x: -x[1]))


def tile(c: C) -> str:
    return f"{c.block_m}x{c.block_n}w{c.num_warps}s{c.num_stages}{'q' if c.qreg else ''}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dropout", type=float, default=0.1)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/short_tiles.py: needs a CUDA GPU and none is visible here")
    g = torch.Generator(device="cpu").manual_seed(0)

    def bshd():
        return torch.randn(B, N, H, D, generator=g).to("cuda", torch.bfloat16).transpose(1, 2).requires_grad_()

    q, k, v = bshd(), bshd(), bshd()
    mask = torch.zeros(B, 1, 1, N, device="cuda", dtype=torch.bfloat16)
    mask[: B // 2, ..., N // 2:] = torch.finfo(torch.bfloat16).min
    do = torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16)
    p = args.dropout
    for name, be in (("cudnn", torch.nn.attention.SDPBackend.CUDNN_ATTENTION),
                     ("efficient", torch.nn.attention.SDPBackend.EFFICIENT_ATTENTION)):
        try:
            with torch.nn.attention.sdpa_kernel(be):
                r = kernel_us(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p).backward(do))
            print(f"{name:10s} total {sum(r.values()):7.1f}us  {attention_kernels(r)}", flush=True)
        except Exception as e:  # a peer that refuses the shape is reported, not fatal
            print(f"{name} failed: {str(e)[:200]}", flush=True)
    for a, b_, c in zip(DKDV, DQ, FWD):
        tf.CONFIG_OVERRIDE.clear()
        tf.CONFIG_OVERRIDE.update({("dkdv", 64): a, ("dq", 64): b_, ("fwd", 64): c, ("fwd_bias", 64): c})
        try:
            r = kernel_us(lambda: fa_compile.attention(q, k, v, bias=mask, dropout_p=p, kernel="triton").backward(do))
            print(f"dkdv {tile(a)} dq {tile(b_)} fwd {tile(c)}: total {sum(r.values()):7.1f}us  {attention_kernels(r)}",
                  flush=True)
        except Exception as e:
            print(f"dkdv {tile(a)} dq {tile(b_)} fwd {tile(c)}: failed: {str(e)[:200]}", flush=True)
    tf.CONFIG_OVERRIDE.clear()


if __name__ == "__main__":
    main()
