"""`fa3_gluon::bwd`: the Gluon backward (gluon_bwd.py) as a custom op that Inductor's generated code calls.

`wrap_triton` cannot launch Gluon kernels (triton_ops.py says why), so where the lowering would give a
site's backward to the pointer kernels of `fa3_triton::bwd` and the Gluon kernel takes it (Hopper, strides
TMA accepts, structural masks, key lengths, a boolean key-padding mask, dropout: `gluon_backward` in
fa_compile/lowering/triton.py), it calls this op instead. Inductor keeps the op as an extern call: one
Python call per site and step, for a kernel that does one pass over the score tiles where the pointer pair
does two (a padded BERT's B32 x 512, d64, dropout 0.1: 0.40 ms against 0.50 on the H200,
benchmarks/results/gluon-bwd-dropout-h200-2026-12-04.txt). That call costs ~320-390 us of host time on the
H200's host (benchmarks/gluon_op_host.py), about what its kernels take on the GPU at that shape; its launches
go straight to the kernels (set_wrap_triton_enabled(False)): through wrap_triton's higher-order op the
empty-row kernel's launch took ~240 us of host time against ~70 directly, and a padded BERT training step ran
at 1.07x of SDPA's wall time with 0.92x of its GPU time; with direct launches, 0.955x (BENCHMARKS.md).

The body runs δ (the family's preprocess kernel), the Gluon kernel, dQ's cast, and, where the site folds
the empty-row fix-up's backward (`empty_grad`, triton_ops.EMPTY_GRADS), that fix-up's last kernel. On an
empty row P is 0, so its dout weighs nothing in the Gluon kernel's products as long as it is finite (the
pointer kernels zero it outright; a non-finite dout there turns into NaN in dV here, where eager's fix-up
puts it into the mean of V's gradient). Whatever the Gluon kernel cannot take at run time (strides TMA
refuses, a failed build, which warns once: triton_family.backward_gluon, as the op's run-time dispatch) runs
`fa3_triton::bwd`'s kernels with the given tiles.

This module imports no Triton until the op is traced or runs: the lowering's cache key (graph_pass.uuid) imports
it, so that the op exists before Inductor's cached code calls it in a fresh process."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor


def _outputs(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """dq, dk, dv allocated as fa3_triton::bwd allocates them (its `_empty`, which tests poison)."""
    from .triton_ops import _dense_strides, _empty

    return tuple(_empty(t.shape, _dense_strides(t), t.dtype, t.device) for t in (q, k, v))


@torch.library.custom_op("fa3_gluon::bwd", mutates_args=())
def bwd(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, bias: Optional[Tensor],
    kv_lens: Optional[Tensor], dropout_seed: Optional[Tensor], scale: float, causal: bool, diag_offset: int,
    window_left: int, window_right: int, dropout_p: float, empty_grad: int, dkdv_config: list[int],
    dq_config: list[int],
) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv), dense in q / k / v's dimension order; arguments as fa3_triton::bwd takes them (no softcap,
    no dS; bias: None or a boolean key-padding mask, triton_family.is_key_mask). dkdv_config / dq_config:
    the pointer kernels' tiles, for the fallback."""
    from torch._library.triton import set_wrap_triton_enabled

    # The body sees real tensors only: `wrap_triton` launches (the empty-row kernel, the fallback's) go straight
    # to the kernels instead of through the higher-order op's dispatch (~240 against ~70 us of host time).
    with set_wrap_triton_enabled(False):
        return _bwd(dout, q, k, v, out, lse, bias, kv_lens, dropout_seed, scale, causal, diag_offset, window_left,
                    window_right, dropout_p, empty_grad, dkdv_config, dq_config)


def _bwd(dout, q, k, v, out, lse, bias, kv_lens, dropout_seed, scale, causal, diag_offset, window_left,
         window_right, dropout_p, empty_grad, dkdv_config, dq_config):
    from .. import dispatch
    from . import triton_family as tf
    from . import triton_ops

    args = dispatch.AttentionArgs(q, k, v, scale, causal, diag_offset=diag_offset, window_left=window_left,
                                  window_right=window_right, bias=bias, kv_lens=kv_lens, dropout_p=dropout_p,
                                  dropout_seed=dropout_seed, needs_backward=True)
    cap = tf._capability(q.device)
    b, hq, nq = q.shape[:3]
    hkv, nk = k.shape[1], k.shape[2]
    if cap[0] == 9 and b * hq * nq > 0 and b * hkv * nk > 0:
        qq, kk, vv, dd, oo = (tf._unit_last(t) for t in (q, k, v, dout, out))
        lse32 = lse.to(torch.float32).contiguous()
        dq, dk, dvv = _outputs(q, k, v)
        delta = torch.empty((b, hq, nq), device=q.device, dtype=torch.float32)
        with tf._device_ctx(q):
            tf.bwd_delta(oo, dd, delta, cap)
            if tf.backward_gluon(args, qq, kk, vv, dd, lse32, delta, dq, dk, dvv, cap,
                                 tf._bias4(bias, b, hq, nq, nk)[1]):
                if empty_grad in (triton_ops.EMPTY_GRADS["mean_v"], triton_ops.EMPTY_GRADS["uniform"]):
                    triton_ops._empty_rows_grads(dd, qq, kk, vv, lse32, dq, dk, dvv, scale,
                                                 empty_grad == triton_ops.EMPTY_GRADS["uniform"])
                return dq, dk, dvv
    dq, dk, dvv, _ = triton_ops.bwd(dout, q, k, v, out, lse, bias, kv_lens, dropout_seed, scale, causal, diag_offset,
                                    window_left, window_right, 0.0, dropout_p, False, dkdv_config, dq_config,
                                    empty_grad, False)
    return dq, dk, dvv


@bwd.register_fake
def _(dout, q, k, v, out, lse, bias, kv_lens, dropout_seed, scale, causal, diag_offset, window_left, window_right,
      dropout_p, empty_grad, dkdv_config, dq_config):
    return _outputs(q, k, v)
