"""The kernels of kernels/triton_dropped_rows.py as in-place triton_ops for lowered graphs (launched by Inductor's
code through wrap_triton): fa3_triton::dropped_rows_fill writes eager's dropped uniform weights times V into the
attention's own out on the rows whose lse is -inf, and fa3_triton::dropped_rows_bwd adds their gradients into the
attention backward's own dq, dk, dv (fa_compile/lowering/triton.py). Where no row is fully masked, each program
reads its rows' lse and writes nothing."""
from __future__ import annotations

import torch
from torch import Tensor

from ..dropped_rows import _tiles
from . import triton_dropped_rows as kern
from .triton_ops import NAMESPACE, _launcher


@torch.library.triton_op(f"{NAMESPACE}::dropped_rows_fill", mutates_args={"out"})
def dropped_rows_fill(out: Tensor, v: Tensor, lse: Tensor, seed: Tensor, dropout_p: float) -> None:
    """out [B, Hq, Nq, Dv] on rows whose lse is -inf: fa3::dropped_uniform_rows's value there."""
    if out.numel() == 0 or v.shape[2] == 0:
        return
    kern.launch_fill(_launcher(kern.dropped_rows_fwd_kernel), v, lse.to(torch.float32).contiguous(),
                     seed.reshape(1), out, dropout_p, out.shape[1], True, _tiles(v, v)[0])


@torch.library.triton_op(f"{NAMESPACE}::dropped_rows_bwd", mutates_args={"dq", "dk", "dv"})
def dropped_rows_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, lse: Tensor, seed: Tensor, dq: Tensor, dk: Tensor,
                     dv: Tensor, dropout_p: float, scale: float, softcap: float, qk_grad: float) -> None:
    """Add fa3::dropped_uniform_rows_backward's terms (dout: the gradient of the fix-up's output, read on rows
    whose lse is -inf only) into dq, dk, dv; dq may be fp32 (the Gluon kernel's dQ sums)."""
    if q.numel() == 0 or v.shape[2] == 0:
        return
    tiles, block_d = _tiles(q, v)
    kern.launch_backward(_launcher(kern.dropped_rows_bwd_kernel), dout, q, k, v, lse.to(torch.float32).contiguous(),
                         seed.reshape(1), dq, dk, dv, dropout_p, scale, softcap, qk_grad, True, tiles, block_d)
