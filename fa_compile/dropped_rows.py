"""Eager's value and gradients on fully masked rows under dropout: fa3::dropped_uniform_rows.

Where a finite mask (finfo.min) absorbs every score of a row, eager's softmax weighs that row's keys alike,
P = 1/Nk, and its dropout then keeps each weight with probability 1 - p, scaled by 1 / (1 - p). fa3::attention
returns 0 with lse = -inf on such a row; without dropout patterns/emit.py puts back the mean of V there, with
dropout this op's value:

    fill_i = sum_j keep_ij v_j / (Nk (1 - p))        on rows whose lse is -inf, 0 elsewhere

with keep_ij from the op's counter hash (kernels/dropout_hash.py) at row (b * Hq + h) * Nq + i and column j under
the site's seed, so that the forward and the backward see the same bits (the op's own bits on such a row weigh
nothing: its P is 0 there). The backward gives
    dv_j += sum_i keep_ij dfill_i / (Nk (1 - p))      (summed over the query heads of a GQA group)
and, where eager's gradient reaches q and k through an additive mask, `qk_grad` (1; 0.5 where a clamp
max(s, finfo.min) ties every score of the row; 0 where a fill cut it) times softmax's gradient at P = 1/Nk,
    ds_ij = (keep_ij dfill_i . v_j / (1 - p) - dfill_i . fill_i) / Nk
through the softcap's tanh' (raw_ij = scale q_i . k_j): dq_i = scale sum_j ds_ij k_j, dk_j = scale sum_i ds_ij q_i.

On a GPU with Triton both are kernels that need no host sync (kernels/triton_dropped_rows.py): each program reads
its rows' lse and writes zeros where none is -inf. Elsewhere (the CPU, fp64, head dims past 256) only rows whose lse
is -inf are computed, with torch ops: the batches and query positions that have one, in blocks, in fp32 (fp64 for
fp64). Finding them reads the lse on the host: a device sync off the CPU, except while a CUDA graph is being
captured, where every batch and position is computed instead (exact either way).
"""
from __future__ import annotations

import itertools
import warnings
from typing import Iterator, Optional

import torch
from torch import Tensor

from .kernels.dropout_hash import keep_at
from .ops import _LIB, _TAGS
from . import row_fixups  # (module, not names: row_fixups may be importing ops, which imports this module)

_LIB.define("dropped_uniform_rows(Tensor q, Tensor k, Tensor v, Tensor lse, Tensor seed, float dropout_p, "
            "float scale, float softcap=0.0, float qk_grad=0.0) -> Tensor", tags=_TAGS)
_LIB.define("dropped_uniform_rows_backward(Tensor dfill, Tensor q, Tensor k, Tensor v, Tensor lse, Tensor seed, "
            "float dropout_p, float scale, float softcap, float qk_grad) -> (Tensor, Tensor, Tensor)", tags=_TAGS)
_OP = torch.ops.fa3.dropped_uniform_rows.default
_BACKWARD = torch.ops.fa3.dropped_uniform_rows_backward.default


def _acc(v: Tensor) -> torch.dtype:
    return torch.promote_types(v.dtype, torch.float32)


def _check(q: Tensor, k: Tensor, v: Tensor, lse: Tensor, dropout_p: float, softcap: float) -> None:
    b, hq, nq, _ = q.shape
    if not 0 < dropout_p < 1:
        raise ValueError(f"dropout_p: dropped_uniform_rows needs 0 < dropout_p < 1, got {dropout_p!r}")
    if not softcap >= 0:
        raise ValueError(f"softcap: dropped_uniform_rows needs softcap >= 0, got {softcap!r}")
    if (k.shape[1] == 0 and hq != 0) or (k.shape[1] != 0 and hq % k.shape[1] != 0):  # no head at all: empty
        raise ValueError(f"k: {k.shape[1]} key heads do not divide the {hq} query heads")
    if tuple(lse.shape) != (b, hq, nq):
        raise ValueError(f"lse: expected shape {(b, hq, nq)}, got {tuple(lse.shape)}")


def _on_triton(q: Tensor, k: Tensor, v: Tensor) -> bool:
    from .kernels import triton_family as tf

    return q.is_cuda and q.dtype != torch.float64 and max(q.shape[3], v.shape[3]) <= 256 and tf.triton_available()


def _tiles(q: Tensor, v: Tensor) -> dict:
    from .kernels import triton_family as tf

    small = 16 if tf.interpreting() else 32
    launch = {} if tf.interpreting() else dict(num_warps=4, num_stages=1)
    return dict(BLOCK_M=small, BLOCK_N=small, BLOCK_DV=max(16, tf._pow2(v.shape[3])), **launch), \
        max(16, tf._pow2(q.shape[3]))


def fill_triton(v: Tensor, lse: Tensor, seed: Tensor, dropout_p: float, q_heads: int,
                out: Optional[Tensor] = None) -> Tensor:
    """dropped_uniform_rows's value by kernels/triton_dropped_rows.py (no host sync), into `out` if given."""
    from .kernels import triton_dropped_rows as k

    b, _, _, dv = v.shape
    fill = torch.empty((b, q_heads, lse.shape[2], dv), dtype=v.dtype, device=v.device) if out is None else out
    k.launch_fill(k.dropped_rows_fwd_kernel, v, lse.contiguous(), seed.reshape(1), fill, dropout_p, q_heads, False,
                  _tiles(v, v)[0])
    return fill


def backward_triton(dfill: Tensor, q: Tensor, k: Tensor, v: Tensor, lse: Tensor, seed: Tensor, dropout_p: float,
                    scale: float, softcap: float, qk_grad: float,
                    grads: Optional[tuple[Tensor, Tensor, Tensor]] = None) -> tuple[Tensor, Tensor, Tensor]:
    """dropped_uniform_rows_backward by kernels/triton_dropped_rows.py (no host sync), into `grads` if given."""
    from .kernels import triton_dropped_rows as kern

    dq, dk, dvv = (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)) if grads is None else grads
    tiles, block_d = _tiles(q, v)
    kern.launch_backward(kern.dropped_rows_bwd_kernel, dfill, q, k, v, lse.contiguous(), seed.reshape(1), dq, dk,
                         dvv, dropout_p, scale, softcap, qk_grad, False, tiles, block_d)
    return dq, dk, dvv


def _blocks(lse: Tensor, nk: int) -> Iterator[tuple[Tensor, Tensor, Tensor]]:
    """(batches [nb], query positions [n], whether each row is empty [nb, Hq, n]) covering every row whose lse
    is -inf, in blocks of at most _ROW_BLOCK_NUMEL score elements."""
    empty = torch.isneginf(lse)
    b, hq, nq = lse.shape
    if lse.is_cuda and torch.cuda.is_current_stream_capturing():
        batches = torch.arange(b, device=lse.device)
        positions = torch.arange(nq, device=lse.device)
    else:
        batches = torch.nonzero(empty.any(dim=2).any(dim=1)).flatten()
        if batches.numel() == 0:
            return
        positions = torch.nonzero(empty.index_select(0, batches).any(dim=1).any(dim=0)).flatten()
    block = max(1, row_fixups._ROW_BLOCK_NUMEL // max(1, batches.numel() * hq * nk))
    for r in positions.split(block):
        yield batches, r, empty.index_select(0, batches).index_select(2, r)


def _weights(seed: Tensor, batches: Tensor, r: Tensor, emp: Tensor, hq: int, nq: int, nk: int, dropout_p: float,
             acc: torch.dtype) -> tuple[Tensor, Tensor]:
    """(keep [nb, Hq, n, Nk] bool, weights keep / (Nk (1 - p)) on the empty rows, 0 on the others)."""
    dev = batches.device
    heads = torch.arange(hq, device=dev, dtype=torch.int64)
    row = ((batches.view(-1, 1, 1) * hq + heads.view(1, -1, 1)) * nq + r.view(1, 1, -1)).unsqueeze(-1)
    keep = keep_at(seed, row, torch.arange(nk, device=dev, dtype=torch.int64), dropout_p)
    w = keep.to(acc) * (emp.to(acc).unsqueeze(-1) / (nk * (1.0 - dropout_p)))
    return keep, w


def _grouped(t: Tensor, hkv: int) -> Tensor:
    """[nb, Hq, n, X] -> [nb, Hkv, G * n, X]: query head h = kv head * G + group index."""
    nb, hq, n, x = t.shape
    return t.reshape(nb, hkv, (hq // hkv) * n, x)


def _ungrouped(t: Tensor, hq: int) -> Tensor:
    nb, hkv, gn, x = t.shape
    return t.reshape(nb, hq, gn // (hq // hkv), x)


def dropped_uniform_rows(q: Tensor, k: Tensor, v: Tensor, lse: Tensor, seed: Tensor, dropout_p: float, scale: float,
                         softcap: float = 0.0, qk_grad: float = 0.0) -> Tensor:
    """[B, Hq, Nq, Dv] in v's dtype: eager's dropped uniform average of V on the rows whose lse is -inf, 0 on the
    others (summed in fp32, or fp64 for fp64, and rounded once)."""
    _check(q, k, v, lse, dropout_p, softcap)
    if q.numel() * v.numel() != 0 and _on_triton(q, k, v) and not _TRITON_FAILED:
        try:
            return fill_triton(v, lse, seed, dropout_p, q.shape[1])
        except Exception as e:
            _triton_failed(e)
    return fill_torch(q, v, lse, seed, dropout_p)


_TRITON_FAILED: list = []  # the first failure of the Triton kernels in this process: the torch path from then on


def _triton_failed(e: Exception) -> None:
    """A Triton kernel that cannot be built or run here (a GPU or Triton version it was not tried on): warn once
    and take the torch path (exact; a host sync per call). Not while a CUDA graph is being captured."""
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise e
    _TRITON_FAILED.append(f"{type(e).__name__}: {e}")
    warnings.warn(f"fa_compile: the dropped-rows Triton kernels failed ({type(e).__name__}: {str(e)[:200]}); "
                  "fa3::dropped_uniform_rows runs as torch ops from now on", RuntimeWarning, stacklevel=3)


def fill_torch(q: Tensor, v: Tensor, lse: Tensor, seed: Tensor, dropout_p: float) -> Tensor:
    """dropped_uniform_rows's value by torch ops on the rows whose lse is -inf (a host sync off the CPU)."""
    b, hq, nq, _ = q.shape
    hkv, nk, dv = v.shape[1], v.shape[2], v.shape[3]
    acc = _acc(v)
    fill = torch.zeros((b, hq, nq, dv), dtype=v.dtype, device=v.device)
    if b * hq * nq * nk * dv == 0:
        return fill
    for batches, r, emp in _blocks(lse, nk):
        _, w = _weights(seed, batches, r, emp, hq, nq, nk, dropout_p, acc)
        vb = v.index_select(0, batches).to(acc)
        out = _ungrouped(torch.matmul(_grouped(w, hkv), vb), hq)  # [nb, Hq, n, Dv]
        fill[batches.view(-1, 1), :, r.view(1, -1)] = out.permute(0, 2, 1, 3).to(v.dtype)
    return fill


def dropped_uniform_rows_backward(dfill: Tensor, q: Tensor, k: Tensor, v: Tensor, lse: Tensor, seed: Tensor,
                                  dropout_p: float, scale: float, softcap: float,
                                  qk_grad: float) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of dropped_uniform_rows (see the module docstring); dq and dk are 0 when qk_grad is 0."""
    _check(q, k, v, lse, dropout_p, softcap)
    if q.numel() * v.numel() != 0 and _on_triton(q, k, v) and not _TRITON_FAILED:
        try:
            return backward_triton(dfill, q, k, v, lse, seed, dropout_p, scale, softcap, qk_grad)
        except Exception as e:
            _triton_failed(e)
    return backward_torch(dfill, q, k, v, lse, seed, dropout_p, scale, softcap, qk_grad)


def backward_torch(dfill: Tensor, q: Tensor, k: Tensor, v: Tensor, lse: Tensor, seed: Tensor, dropout_p: float,
                   scale: float, softcap: float, qk_grad: float) -> tuple[Tensor, Tensor, Tensor]:
    """dropped_uniform_rows_backward by torch ops on the rows whose lse is -inf (a host sync off the CPU)."""
    b, hq, nq, d = q.shape
    hkv, nk, dv = v.shape[1], v.shape[2], v.shape[3]
    acc = _acc(v)
    blocks = _blocks(lse, nk) if b * hq * nq * nk * dv != 0 else iter(())
    first = next(blocks, None)
    if first is None:  # no fully masked row (most batches): zeros in the gradients' own layouts, no fp32 terms
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dk = torch.zeros(k.shape, dtype=acc, device=k.device)
    dvv = torch.zeros(v.shape, dtype=acc, device=v.device)
    for batches, r, emp in itertools.chain((first,), blocks):
        keep, w = _weights(seed, batches, r, emp, hq, nq, nk, dropout_p, acc)
        vb = v.index_select(0, batches).to(acc)
        dfs = _grouped(dfill.index_select(0, batches).index_select(2, r).to(acc), hkv)  # [nb, Hkv, G n, Dv]
        wg = _grouped(w, hkv)
        dvv.index_add_(0, batches, torch.matmul(wg.transpose(-1, -2), dfs))
        if qk_grad == 0:
            continue
        fill = torch.matmul(wg, vb)
        dp = _grouped(keep.to(acc), hkv) * torch.matmul(dfs, vb.transpose(-1, -2)) / (1.0 - dropout_p)
        ds = (dp - (dfs * fill).sum(dim=-1, keepdim=True)) * (_grouped(emp.to(acc).unsqueeze(-1), hkv) / nk)
        kb = k.index_select(0, batches).to(acc)
        qs = _grouped(q.index_select(0, batches).index_select(2, r).to(acc), hkv)
        if softcap > 0:
            t = torch.tanh(torch.matmul(qs, kb.transpose(-1, -2)) * (scale / softcap))
            ds = ds * (1 - t * t)
        ds = ds * (scale * qk_grad)
        dq[batches.view(-1, 1), :, r.view(1, -1)] = _ungrouped(torch.matmul(ds, kb), hq).permute(0, 2, 1, 3)
        dk.index_add_(0, batches, torch.matmul(ds.transpose(-1, -2), qs))
    return row_fixups._laid_out_like(dq, q), row_fixups._laid_out_like(dk, k), row_fixups._laid_out_like(dvv, v)


def _fake(q, k, v, lse, seed, dropout_p, scale, softcap=0.0, qk_grad=0.0):
    return v.new_empty((q.shape[0], q.shape[1], q.shape[2], v.shape[3]))


def _backward_fake(dfill, q, k, v, lse, seed, dropout_p, scale, softcap, qk_grad):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


_LIB.impl("dropped_uniform_rows", dropped_uniform_rows, "CompositeExplicitAutograd")
_LIB.impl("dropped_uniform_rows_backward", dropped_uniform_rows_backward, "CompositeExplicitAutograd")
torch.library.register_fake("fa3::dropped_uniform_rows", _fake, lib=_LIB)
torch.library.register_fake("fa3::dropped_uniform_rows_backward", _backward_fake, lib=_LIB)


class _DroppedUniformRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, lse: Tensor, seed: Tensor, dropout_p: float, scale: float,
                softcap: float, qk_grad: float) -> Tensor:
        with torch._C._AutoDispatchBelowAutograd():
            fill = _OP(q, k, v, lse, seed, dropout_p, scale, softcap, qk_grad)
        ctx.save_for_backward(q, k, v, lse, seed)
        ctx.args = (dropout_p, scale, softcap, qk_grad)
        return fill

    @staticmethod
    def backward(ctx, dfill: Tensor):
        q, k, v, lse, seed = ctx.saved_tensors
        dropout_p, scale, softcap, qk_grad = ctx.args
        dq, dk, dv = _BACKWARD(dfill, q, k, v, lse, seed, dropout_p, scale, softcap, qk_grad)
        need = ctx.needs_input_grad
        return (dq if need[0] and qk_grad else None), (dk if need[1] and qk_grad else None), \
            (dv if need[2] else None), None, None, None, None, None, None


def _autograd(q: Tensor, k: Tensor, v: Tensor, lse: Tensor, seed: Tensor, dropout_p: float, scale: float,
              softcap: float = 0.0, qk_grad: float = 0.0) -> Tensor:
    if torch.is_grad_enabled() and (v.requires_grad or (qk_grad and (q.requires_grad or k.requires_grad))):
        return _DroppedUniformRows.apply(q, k, v, lse, seed, dropout_p, scale, softcap, qk_grad)
    with torch._C._AutoDispatchBelowAutograd():
        return _OP(q, k, v, lse, seed, dropout_p, scale, softcap, qk_grad)


_LIB.impl("dropped_uniform_rows", _autograd, "Autograd")
