"""The split-KV decode kernel (decode_triton.py) as a `torch.library.triton_op`, for the compile-time
lowering (fa_compile/lowering/decode.py): Inductor launches its two kernels from the generated code.

`fa3_decode::fwd` computes what fa_compile/kernels/decode.py's `attention_decode` does for `torch.ops.fa3.attention`
(decode-shaped calls: 1..16 queries, a contiguous cache read through k / v's own strides, kv_lens, q_pos,
a causal diagonal, a float or bool bias), with the number of splits and the key tile fixed by the caller
(chosen at compile time from static shapes, as the run-time launcher chooses them). Every kernel
parameter is passed, defaults included: torch 2.11's wrap_triton binds a kernel's arguments by position.
Beside it: `fa3_decode::key_limit` (a mask's key limit) and `fa3_decode::materialize` (a computed index vector
written once into a buffer that several lowered kernels read).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .decode import _pow2, launch_options
from .triton_family import interpreting
from .triton_ops import EMPTY_FILLS, _bias_arg, _empty, _launcher  # EMPTY_FILLS: fwd's `empty_fill` values

NAMESPACE = "fa3_decode"


@torch.library.triton_op(f"{NAMESPACE}::fwd", mutates_args=())
def fwd(
    q: Tensor, k: Tensor, v: Tensor, bias: Optional[Tensor], kv_lens: Optional[Tensor], q_pos: Optional[Tensor],
    scale: float, causal: bool, diag_offset: int, splits: int, block_n: int, empty_fill: int = 0,
) -> tuple[Tensor, Tensor]:
    """(out [B, Hq, Nq, Dv] stored BSHD, lse [B, Hq, Nq] fp32) of the op's arguments (q [B, Hq, Nq, D],
    k / v [B, Hkv, Nk, D]); `splits` >= 1 and `block_n` as fa_compile/kernels/decode.py plans them. `empty_fill`: out
    on rows that admit no key, 0 the op's zeros, 1 NaN, 2 the mean of v over all Nk keys (lse stays -inf)."""
    from .decode_triton import decode_combine_kernel, decode_partial_kernel

    if splits < 1 or block_n < 16:
        raise ValueError(f"splits / block_n: expected >= 1 and >= 16, got {splits} / {block_n}")
    if empty_fill not in EMPTY_FILLS.values():
        raise ValueError(f"empty_fill: expected one of {sorted(EMPTY_FILLS.values())}, got {empty_fill}")
    b, hq, nq, d = q.shape
    hkv, nk, dv = k.shape[1], k.shape[2], v.shape[3]
    g = hq // hkv
    out = _empty((b, hq, nq, dv), (nq * hq * dv, dv, hq * dv, 1), q.dtype, q.device)
    lse = _empty((b, hq, nq), (hq * nq, nq, 1), torch.float32, q.device)
    if b * hq * nq == 0:
        return out, lse
    rows = g * nq
    block_d, block_dv = _pow2(d), _pow2(dv)
    # Unused pointer arguments are None: Triton and wrap_triton take None as a constant, so the launch passes no
    # pointer and the generated code allocates nothing for it. Never an input in their place: Inductor realizes a
    # tensor it computes once per argument that receives it (kv_lens as SEQLENS, LEFTPAD and TABLE cost two extra
    # launches per layer; q in every unused slot was written into eight buffers per layer of a Llama decode step).
    if splits > 1:
        opart = _empty((b * hkv, splits, rows, dv), (splits * rows * dv, rows * dv, dv, 1), torch.float32, q.device)
        lpart = _empty((b * hkv, splits, rows), (splits * rows, rows, 1), torch.float32, q.device)
        spart = _empty((b * hkv, splits, rows), (splits * rows, rows, 1), torch.float32, q.device)
    else:  # stored to only with SPLIT, a constant: the kernel compiled without it has no store to them
        opart = lpart = spart = None
    bt, bias_kind, bstr = _bias_arg(bias, b, hq, nq, nk)
    kind = 0 if bt is None else (1 if bias_kind in (1, 3) else 2)
    if q_pos is not None:
        qp = q_pos.reshape(1, -1) if q_pos.dim() == 1 else q_pos
        qpos = dict(QPOS=qp, stride_pb=0 if qp.shape[0] == 1 else qp.stride(0), stride_pm=qp.stride(1), HAS_QPOS=True)
    else:
        qpos = dict(QPOS=None, stride_pb=0, stride_pm=0, HAS_QPOS=False)
    tune, ctune = launch_options(block_n, block_d, block_dv)
    _launcher(decode_partial_kernel)[(splits, b * hkv, 1)](
        q, k, v, kv_lens, None, None, out, lse, opart, lpart, spart,
        q.stride(0), q.stride(2), q.stride(1), q.stride(3),  # the kernel reads q as [B, Nq, Hq, D]
        k.stride(0), k.stride(2), k.stride(1), k.stride(3),  # and the cache as [B, Nk, Hkv, D]
        v.stride(0), v.stride(2), v.stride(1), v.stride(3),
        0, 0,  # no page table
        out.stride(0), out.stride(2), out.stride(1),
        hkv, g, nq, d, dv, nk, splits, float(scale),
        PAGE=1, PAGED=False, PAGE_TILES=False, HAS_LEFTPAD=False, IS_CAUSAL=False, SPLIT=splits > 1,
        BLOCK_M=_pow2(rows), BLOCK_N=block_n, BLOCK_D=block_d, BLOCK_DV=block_dv,
        **qpos, diag_offset=diag_offset, DIAG_CAUSAL=bool(causal),  # (a SymInt under dynamic shapes)
        BIAS=bt, stride_bb=bstr[0], stride_bh=bstr[1], stride_bm=bstr[2],
        stride_bn=bstr[3], BIAS_KIND=kind, HAS_SEQLENS=kv_lens is not None, EMPTY_FILL=empty_fill, **tune,
    )
    if splits > 1:
        _launcher(decode_combine_kernel)[(b * hkv * rows, 1, 1)](
            opart, lpart, spart, out, lse, out.stride(0), out.stride(2), out.stride(1), hkv, g, nq, dv, splits,
            BLOCK_S=_pow2(splits, 2), BLOCK_DV=block_dv,
            V=v if empty_fill == EMPTY_FILLS["mean_v"] else None,  # read only to fill empty rows with mean(V)
            stride_vb=v.stride(0), stride_vtok=v.stride(2), stride_vh=v.stride(1), stride_vd=v.stride(3),
            capacity=nk, EMPTY_FILL=empty_fill, BLOCK_N=block_n, **ctune,
        )
    return out, lse


# fa3::key_limit's kernel: keys per block (a row of up to this many keys is one load wave) and warps. H200,
# B8 x 16384 bf16 keys, CUDA-graph replay, us: 16384 keys x 8 warps 2.83, x 16 2.86, x 4 4.72; 8192 x 4 2.82
# (two iterations); 4096 x 16 3.06; 2048: 5.07; Inductor's two reductions of the same graph ops 3.29.
KEY_LIMIT_BLOCK = 16384
KEY_LIMIT_WARPS = 8
KEY_LIMIT_DTYPES = (torch.bool, torch.float16, torch.bfloat16, torch.float32)


@torch.library.triton_op(f"{NAMESPACE}::key_limit", mutates_args=())
def key_limit(bias: Tensor, absorb: float) -> Tensor:
    """fa_compile/key_limit_op.py's fa3::key_limit (int32 [Bm] of bias [Bm, Nk]) as one kernel launch;
    bias bool, fp16, bf16 or fp32 (compared in fp32, exact for these: the thresholds are rounded to the
    bias's dtype first, as eager's comparison with a Python float rounds them)."""
    from ..key_limit_op import thresholds  # (here, not at import: fa_compile.ops imports the kernels)

    from .decode_triton import key_limit_kernel

    if bias.dim() != 2 or bias.dtype not in KEY_LIMIT_DTYPES:
        raise ValueError(f"bias: expected a 2-d mask of {KEY_LIMIT_DTYPES}, got {tuple(bias.shape)} {bias.dtype}")
    bm, nk = bias.shape
    out = _empty((bm,), (1,), torch.int32, bias.device)
    if bm == 0:
        return out
    is_bool = bias.dtype == torch.bool
    t_abs, t_good = thresholds(bias.dtype, absorb) if not is_bool else (0.0, 0.0)
    block = min(_pow2(nk), KEY_LIMIT_BLOCK)
    opts = {} if interpreting() else dict(num_warps=KEY_LIMIT_WARPS if block >= 8192 else 4)
    _launcher(key_limit_kernel)[(bm, 1, 1)](
        bias, out, bias.stride(0), bias.stride(1), nk, t_abs, t_good, IS_BOOL=is_bool, BLOCK=block, **opts,
    )
    return out


MATERIALIZE_BLOCK = 128
MATERIALIZE_DTYPES = (torch.int32, torch.int64)


@torch.library.triton_op(f"{NAMESPACE}::materialize", mutates_args=())
def materialize(x: Tensor) -> Tensor:
    """A dense copy of 1-d integer `x` in a buffer of its own, written by one kernel launch.

    For a value computed in the graph and read by several lowered kernels (a decode step's kv_lens, one per
    layer): Inductor gives a user Triton kernel the exact strides it was traced with, and an input it has not
    realized yet is copied for that kernel (ExternKernel.require_exact_strides), so each layer's kernel got its
    own launch recomputing the same lengths. This op's output is a buffer, which every reader takes as it is."""
    from .decode_triton import copy_1d_kernel

    if x.dim() != 1 or x.dtype not in MATERIALIZE_DTYPES:
        raise ValueError(f"x: expected a 1-d tensor of {MATERIALIZE_DTYPES}, got {tuple(x.shape)} {x.dtype}")
    n = x.shape[0]
    out = _empty((n,), (1,), x.dtype, x.device)
    if n == 0:
        return out
    _launcher(copy_1d_kernel)[(-(-n // MATERIALIZE_BLOCK), 1, 1)](x, out, x.stride(0), n, BLOCK=MATERIALIZE_BLOCK)
    return out
