"""The gradient of attention sinks as one Triton reduction (fa_compile/kernels/reference.py: sink_grad_reference).

d sink_h = sum_{b,i} P_sink,i * (dlse_i - rowsum(dO_i * O_i)), P_sink,i = exp(sink_h - lse_i) (0 where lse is
-inf). The reference spells it as torch ops on fp32 copies of dO and O (four passes over [B, Hq, Nq, Dv]);
here each program reads its dO and O tiles once, in their own dtype, and writes one fp32 partial sum per
(batch, head, query block), summed on the host side in a fixed order (deterministic, no atomics).
Used for real CUDA tensors in eager backward; traced graphs keep the reference's ops for Inductor to fuse.
H200, bf16, 2026-12-01: 23 us of GPU time at B2 x 32 heads x 4096 x d64 against 267 for the reference's ops;
host time ~100 us per call either way (a torch-op spelling without fp32 copies was no cheaper on the host
and rounded rowsum(dO * O) to 3e-3 relative).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def sink_grad_kernel(
    SINKS, LSE, DO, O, DLSE, PART,
    stride_lb, stride_lh, stride_lm, stride_db, stride_dh, stride_dm, stride_ob, stride_oh, stride_om,
    stride_gb, stride_gh, stride_gm,
    Hq, Nq, DV, n_blocks,
    HAS_DLSE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // Hq
    h = bh % Hq
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_DV)
    rmask = rows < Nq
    tmask = rmask[:, None] & (cols[None, :] < DV)
    do = tl.load(DO + b.to(tl.int64) * stride_db + h.to(tl.int64) * stride_dh
                 + rows[:, None].to(tl.int64) * stride_dm + cols[None, :], mask=tmask, other=0.0).to(tl.float32)
    o = tl.load(O + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh
                + rows[:, None].to(tl.int64) * stride_om + cols[None, :], mask=tmask, other=0.0).to(tl.float32)
    coef = -tl.sum(do * o, 1)
    if HAS_DLSE:
        coef += tl.load(DLSE + b.to(tl.int64) * stride_gb + h.to(tl.int64) * stride_gh + rows * stride_gm,
                        mask=rmask, other=0.0).to(tl.float32)
    lse = tl.load(LSE + b.to(tl.int64) * stride_lb + h.to(tl.int64) * stride_lh + rows * stride_lm,
                  mask=rmask, other=float("-inf")).to(tl.float32)
    sink = tl.load(SINKS + h).to(tl.float32)
    p = tl.where(lse == float("-inf"), 0.0, tl.exp(sink - tl.where(lse == float("-inf"), 0.0, lse)))
    tl.store(PART + bh.to(tl.int64) * n_blocks + pid_m, tl.sum(p * coef, 0))


def sink_grad(sinks: Tensor, lse: Tensor, dout: Tensor, out: Tensor, dlse: Optional[Tensor] = None) -> Tensor:
    """d sinks [Hq] in sinks' dtype, as sink_grad_reference; dout / out [B, Hq, Nq, Dv] with a unit last
    stride (any other is copied), lse / dlse [B, Hq, Nq]."""
    b, hq, nq, dv = out.shape
    if dout.stride(-1) != 1:
        dout = dout.contiguous()
    if out.stride(-1) != 1:
        out = out.contiguous()
    block_dv = triton.next_power_of_2(max(dv, 16))
    block_m = 64 if block_dv <= 128 else 32
    n_blocks = triton.cdiv(nq, block_m)
    part = torch.empty((b * hq, max(n_blocks, 1)), device=out.device, dtype=torch.float32)
    if b * hq * nq == 0:
        return torch.zeros_like(sinks)
    g = dlse if dlse is not None else lse
    from .triton_family import _device_ctx

    with _device_ctx(out):
        sink_grad_kernel[(n_blocks, b * hq)](
            sinks.contiguous(), lse, dout, out, g, part,
            lse.stride(0), lse.stride(1), lse.stride(2), dout.stride(0), dout.stride(1), dout.stride(2),
            out.stride(0), out.stride(1), out.stride(2), g.stride(0), g.stride(1), g.stride(2),
            hq, nq, dv, n_blocks, HAS_DLSE=dlse is not None, BLOCK_M=block_m, BLOCK_DV=block_dv, num_warps=4,
        )
    return part.view(b, hq, n_blocks).sum(dim=(0, 2)).to(sinks.dtype)

