"""fa3::key_limit: the per-batch key limit of a decode step's data mask (patterns/key_limit.py) as one op.

    key_limit(bias [Bm, Nk], absorb) -> int32 [Bm]
        1 + the last admissible key of each row (0: none); admissible is a bool bias's True, a float
        bias's value not <= absorb (NaN admissible). A float row with no value >= absorb / 2 keeps
        every key (Nk): eager weighs such a row's keys uniformly over the whole cache.

Written as graph ops, this is two reductions over [Bm, Nk], which Inductor splits into two kernels
over a long cache (Nk 16384: 2.2 + 1.1 us per decode layer on the H200, against ~40 us for the
attention itself). As one op, the lowering (fa_compile/lowering/key_limit.py) runs it on CUDA as one
Triton kernel (fa_compile/kernels/decode_ops.py `fa3_decode::key_limit`) and elsewhere as those graph ops again,
which Inductor fuses; where nothing lowers it (the lowering switched off) the op runs `key_limit_math`.
Reading the row inside the decode kernel instead (each program of a sequence reading it before its first
tile) was measured too and cost more than this kernel's launch (BENCHMARKS.md).
"""
from __future__ import annotations

import math
import struct

import torch
from torch import Tensor

from .ops import _LIB, _TAGS

_LIB.define("key_limit(Tensor bias, float absorb) -> Tensor", tags=_TAGS)


def _rounded(x: float, dtype: torch.dtype) -> float:
    """x as torch stores it in `dtype` (double -> float -> half / bfloat16, each to nearest even), in plain
    Python: kernel bodies call this while they are traced, where a tensor would become a graph constant."""
    if dtype == torch.float64:
        return float(x)
    try:
        f = struct.unpack("<f", struct.pack("<f", x))[0]
    except OverflowError:
        f = math.copysign(math.inf, x)
    if dtype == torch.float16:
        try:
            return float(struct.unpack("<e", struct.pack("<e", f))[0])
        except OverflowError:
            return math.copysign(math.inf, f)
    if dtype == torch.bfloat16 and math.isfinite(f):
        bits = struct.unpack("<I", struct.pack("<f", f))[0]
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
        return float(struct.unpack("<f", struct.pack("<I", bits & 0xFFFFFFFF))[0])
    return float(f)


def thresholds(dtype: torch.dtype, absorb: float) -> tuple[float, float]:
    """(absorb, absorb / 2) as a bias of `dtype` compares them: eager compares a tensor with a Python
    float in the tensor's dtype, so a kernel comparing in fp32 gets the values rounded to it first."""
    return _rounded(absorb, dtype), _rounded(absorb / 2, dtype)


def key_limit_math(bias: Tensor, absorb: float) -> Tensor:
    """The op as torch ops (its eager value, and its decomposition where no kernel takes it)."""
    nk = bias.shape[1]
    j1 = torch.arange(nk, device=bias.device) + 1
    if bias.dtype == torch.bool:
        admissible = bias
    else:
        admissible = torch.logical_not(bias <= absorb)
    limit = torch.where(admissible, j1, 0).amax(-1) if nk > 0 else bias.new_zeros(bias.shape[:1], dtype=torch.int64)
    if bias.dtype != torch.bool:
        limit = torch.where(torch.any(bias >= absorb / 2, -1), limit, nk)
    return limit.to(torch.int32)


def _check(bias: Tensor) -> None:
    if bias.dim() != 2:
        raise ValueError(f"bias: key_limit takes a [B, Nk] mask, got shape {tuple(bias.shape)}")
    if not (bias.dtype == torch.bool or bias.dtype.is_floating_point):
        raise ValueError(f"bias: key_limit takes a bool or float mask, got {bias.dtype}")


def _key_limit(bias: Tensor, absorb: float) -> Tensor:
    _check(bias)
    return key_limit_math(bias, absorb)


def _key_limit_fake(bias: Tensor, absorb: float) -> Tensor:
    _check(bias)
    return bias.new_empty(bias.shape[:1], dtype=torch.int32)


_LIB.impl("key_limit", _key_limit, "CompositeExplicitAutograd")
torch.library.register_fake("fa3::key_limit", _key_limit_fake, lib=_LIB)
KEY_LIMIT = torch.ops.fa3.key_limit.default
