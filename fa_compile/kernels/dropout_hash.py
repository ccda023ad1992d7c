"""The dropout mask of `fa3.attention`: a counter-based hash of (seed, row, column).

Why not Philox through `tl.rand`: the mask must be bit-identical in the fused Triton kernels, in
the reference on CPU and between forward and backward, so that dropout is tested element by
element rather than statistically. A 32-bit integer hash (Wellons' "lowbias32", full avalanche)
is cheap in both torch and Triton. The seed itself is drawn from torch's generator of q's device,
so `torch.manual_seed` makes runs repeatable.

    row  = (b * H + h) * Nq + i          col = j
    x    = hash32(hash32(seed ^ hash32(row)) ^ col)
    keep = x >= dropout_p * 2**32
"""
from __future__ import annotations

import torch
from torch import Tensor

M32 = 0xFFFFFFFF
MUL1 = 0x7FEB352D
MUL2 = 0x846CA68B


def hash32(x: Tensor) -> Tensor:
    """lowbias32 on int64 tensors holding values in [0, 2**32)."""
    x = x & M32
    x = x ^ (x >> 16)
    x = (x * MUL1) & M32
    x = x ^ (x >> 15)
    x = (x * MUL2) & M32
    x = x ^ (x >> 16)
    return x


def keep_threshold(dropout_p: float) -> int:
    return min(int(dropout_p * 4294967296.0), M32)


def keep_at(seed: Tensor, row: Tensor, col: Tensor, dropout_p: float) -> Tensor:
    """Whether the probability at (row, col) is kept: int64 row and col indices that broadcast together, as the
    module docstring numbers them."""
    s = seed.to(device=row.device, dtype=torch.int64).reshape(()) & M32
    return hash32(hash32(s ^ hash32(row)) ^ col) >= keep_threshold(dropout_p)


def dropout_keep_mask(seed: Tensor, b: int, h: int, nq: int, nk: int, dropout_p: float, device: torch.device) -> Tensor:
    """[B, H, Nq, Nk] bool, True where the probability is kept."""
    row = torch.arange(b * h * nq, device=device, dtype=torch.int64).view(b, h, nq, 1)
    col = torch.arange(nk, device=device, dtype=torch.int64).view(1, 1, 1, nk)
    return keep_at(seed, row, col, dropout_p)
