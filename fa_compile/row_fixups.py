"""Zero-valued ops whose gradients are eager's on rows where every score was absorbed by a mask.

A rewritten site runs torch.ops.fa3.attention, which is exact on every row that admits a key. On a row
whose every score an additive finfo.min mask absorbed, eager's forward is uniform (patterns/emit.py puts
the mean of V back) but its backward is softmax's at uniform weights passed through the mask's
addition: a gradient the op does not give. Each op here has the value 0 (added to the fix-up, selected
on those rows only) and the missing gradient as its backward:

- fa3::uniform_row_grad(q, k, v, scale, softcap=0.0): softmax's gradient at P = 1/Nk to q and k
  (through the softcap's tanh' when softcap > 0: fa3::uniform_row_grad_backward, dense on the rows
  whose incoming gradient is nonzero; on CPU the same op without a softcap, which returns zeros at
  once when no row's incoming gradient is nonzero, the usual case).
- fa3::filled_scores_grad(q, k, v, bias, filled, scale, softcap=0.0): minus the op's gradient through
  the entries a fill (where / masked_fill) wrote before an additive mask, which eager's fill cuts.

After AOTAutograd the forwards become constant zeros (fa_compile/lowering/graph_pass.py).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .ops import _LIB, _TAGS

# fa3::uniform_row_grad: the gradient that an additive finfo.min mask passes to q and k from a fully
# masked row (empty_rows "mean_v_add", see patterns/emit.py), as an op whose value is 0. Its autograd
# saves only q, k, v (which fa3::attention saves anyway) and builds the fp32 terms in the backward:
# written as graph arithmetic instead, the partitioner kept fp32 copies of q and k alive per layer.
# softcap > 0 (scores s = softcap * tanh(raw / softcap) before the mask): the gradient of each raw score
# is scaled by tanh', which does not factorize over keys; fa3::uniform_row_grad_backward computes it
# densely, on the rows whose incoming gradient is nonzero only.
_LIB.define("uniform_row_grad(Tensor q, Tensor k, Tensor v, float scale, float softcap=0.0) -> Tensor", tags=_TAGS)
_LIB.define("uniform_row_grad_backward(Tensor dg, Tensor q, Tensor k, Tensor v, float scale, float softcap) "
            "-> (Tensor, Tensor)", tags=_TAGS)


def uniform_row_grad(q: Tensor, k: Tensor, v: Tensor, scale: float, softcap: float = 0.0) -> Tensor:
    """Zeros [B, Hq, Nq, Dv] in q's dtype (the value; the point is the gradient)."""
    return q.new_zeros((q.shape[0], q.shape[1], q.shape[2], v.shape[3]))


def _uniform_row_grad_fake(q, k, v, scale, softcap=0.0):
    return q.new_empty((q.shape[0], q.shape[1], q.shape[2], v.shape[3]))


_LIB.impl("uniform_row_grad", uniform_row_grad, "CompositeExplicitAutograd")
torch.library.register_fake("fa3::uniform_row_grad", _uniform_row_grad_fake, lib=_LIB)
_UNIFORM_ROW_GRAD = torch.ops.fa3.uniform_row_grad.default
_UNIFORM_ROW_GRAD_BACKWARD = torch.ops.fa3.uniform_row_grad_backward.default

# fp32 elements of one [B, Hkv, rows, Nk] score block in the fix-ups' dense backwards (64 MiB)
_ROW_BLOCK_NUMEL = 1 << 24


def _live_query_positions(dg: Tensor) -> Tensor:
    """The query positions (axis 2 of dg [B, H, Nq, Dv]) where some row of dg is nonzero: a host sync,
    except while a CUDA graph is being captured, where every position is returned instead."""
    if dg.is_cuda and torch.cuda.is_current_stream_capturing():
        return torch.arange(dg.shape[2], device=dg.device)
    return torch.nonzero(dg.ne(0).any(dim=-1).any(dim=1).any(dim=0)).flatten()


def uniform_row_grad_backward(dg: Tensor, q: Tensor, k: Tensor, v: Tensor, scale: float,
                              softcap: float) -> tuple[Tensor, Tensor]:
    """(dq, dk) of uniform_row_grad: on a row at uniform P = 1/Nk the score gradient is
    ds_ij = dg_i . (v_j - mean(v)) / Nk, and with a softcap the raw score's
    d raw_ij = ds_ij * (1 - tanh(raw_ij / softcap)^2) with raw_ij = scale * q_i . k_j (without one,
    d raw_ij = ds_ij); dq_i = scale * sum_j d raw_ij k_j, dk_j = scale * sum_i d raw_ij q_i (summed over
    the query heads of a group). Only query positions where some dg row is nonzero are computed (a zero
    dg row contributes nothing; none nonzero: zeros at once), in fp32 (fp64 for fp64): with a softcap
    densely, in blocks of positions; without one by the factorized form of `_uniform_grads`."""
    if not softcap >= 0:
        raise ValueError(f"softcap: uniform_row_grad_backward needs softcap >= 0, got {softcap!r}")
    b, hq, nq, d = q.shape
    hkv, nk, dv = k.shape[1], k.shape[2], v.shape[3]
    if hq % max(hkv, 1) != 0:
        raise ValueError(f"k: {hkv} key heads do not divide the {hq} query heads")
    acc = torch.promote_types(q.dtype, torch.float32)
    if b * hq * nq * nk * d == 0:  # no keys: nothing to weigh; no head dim: scores 0
        return torch.zeros_like(q), torch.zeros_like(k)
    if softcap == 0 and not dg.is_cpu:
        # off the CPU a decision on the data is a device sync: the terms, always (a zero dg gives zeros)
        dq, dk = _uniform_grads(dg, q, k, v, scale, _terms_dtype(q), True, True)
        return _laid_out_like(dq, q), _laid_out_like(dk, k)
    # On the CPU one reduction decides (NaN counts as nonzero): most batches have no fully masked row, and
    # this op runs per layer in every backward.
    if softcap == 0 and not bool(dg.any()):
        return torch.zeros_like(q), torch.zeros_like(k)
    if softcap == 0:
        dq, dk = _uniform_grads(dg, q, k, v, scale, acc, True, True)
        return _laid_out_like(dq, q), _laid_out_like(dk, k)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dk = torch.zeros(k.shape, dtype=acc, device=k.device)
    g = hq // hkv
    rows = _live_query_positions(dg)
    if rows.numel() == 0:
        return _laid_out_like(dq, q), _laid_out_like(dk, k)
    kf = k.to(acc)
    vf = v.to(acc)
    vc = vf - vf.mean(dim=2, keepdim=True)  # centred in fp32+ (a difference of close values)
    block = max(1, _ROW_BLOCK_NUMEL // max(1, b * hq * nk))
    for r in rows.split(block):
        n = r.numel()
        qs = q.index_select(2, r).to(acc).reshape(b, hkv, g * n, d)  # query head h = kv head * g + group index
        dgs = dg.index_select(2, r).to(acc).reshape(b, hkv, g * n, dv)
        t = torch.tanh(torch.matmul(qs, kf.transpose(-1, -2)) * (scale / softcap))
        draw = torch.matmul(dgs, vc.transpose(-1, -2)) * ((1 - t * t) * (scale / nk))  # [B, Hkv, gn, Nk], x scale
        dq.index_copy_(2, r, torch.matmul(draw, kf).reshape(b, hq, n, d))
        dk += torch.matmul(draw.transpose(-1, -2), qs)  # the group's queries summed by the contraction
    return _laid_out_like(dq, q), _laid_out_like(dk, k)


def _laid_out_like(t: Tensor, like: Tensor) -> Tensor:
    """t in like's dtype with the strides `torch.empty_like(like)` has. The gradients are added to the
    attention kernel's, which come in q's / k's own layout (BSHD for projections viewed as heads): in
    that layout the sum keeps it, where a contiguous [B, H, N, D] term made every sum a transposing copy.
    t itself where it already is (callers pass tensors they made)."""
    out = torch.empty_like(like)
    return t if t.dtype == out.dtype and t.stride() == out.stride() else out.copy_(t)


def _uniform_row_grad_backward_fake(dg, q, k, v, scale, softcap):
    return torch.empty_like(q), torch.empty_like(k)


_LIB.impl("uniform_row_grad_backward", uniform_row_grad_backward, "CompositeExplicitAutograd")
torch.library.register_fake("fa3::uniform_row_grad_backward", _uniform_row_grad_backward_fake, lib=_LIB)


class _UniformRowGradFunction(torch.autograd.Function):
    """g = scale * q @ C with C = mean_j k_j (v_j - mean(v))^T, v held constant, forward value 0: the
    gradient of q and k from rows of softmax at uniform P = 1/Nk (ds_j = (dO . v_j - dO . mean(v)) / Nk).
    Terms in fp32 (at least) so that nothing overflows for fp16 inputs. With a softcap the backward is
    fa3::uniform_row_grad_backward (one opaque op in the traced backward graph)."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, scale: float, softcap: float = 0.0) -> Tensor:
        with torch._C._AutoDispatchBelowAutograd():
            zero = _UNIFORM_ROW_GRAD(q, k, v, scale, softcap)
        ctx.save_for_backward(q, k, v)
        ctx.scale = scale
        ctx.softcap = softcap
        return zero

    @staticmethod
    def backward(ctx, dg: Tensor):
        q, k, v = ctx.saved_tensors
        # One opaque op in the traced backward on every device: without a softcap dg is 0 except on fully
        # masked rows, which most batches have none of, and a lowered attention backward that reads the lse
        # computes these terms itself only when such a row exists (fa_compile/lowering/empty_rows_backward.py);
        # on CPU the op itself skips them then (their four matmuls cost ~3% of a padded BERT training step in
        # a single-threaded CPU profile). On CUDA, where no such kernel takes it, the lowering puts back the
        # terms as graph arithmetic for Inductor (graph_pass._uniform_terms).
        dq, dk = _UNIFORM_ROW_GRAD_BACKWARD(dg, q, k, v, ctx.scale, ctx.softcap)
        return (dq if ctx.needs_input_grad[0] else None), (dk if ctx.needs_input_grad[1] else None), None, None, None


def _terms_dtype(q: Tensor) -> torch.dtype:
    """The matmuls' dtype for the sync-free terms: bf16 matmuls accumulate in fp32 and cannot overflow, so they
    run in bf16, as eager's own gradient does, instead of fp32 copies of q, k and v per layer; fp16 (range) and
    fp32 / fp64 keep fp32 or wider."""
    return torch.bfloat16 if q.dtype == torch.bfloat16 else torch.promote_types(q.dtype, torch.float32)


def _uniform_grads(dg: Tensor, q: Tensor, k: Tensor, v: Tensor, scale: float, f32: torch.dtype, need_q: bool,
                   need_k: bool) -> tuple[Optional[Tensor], Optional[Tensor]]:
    """(dq, dk) of uniform_row_grad without a softcap, factorized over the keys (no [Nq, Nk] term):
    dq_i = scale * dg_i . C^T with C = sum_j k_j (v_j - mean(v))^T / Nk, and
    dk_j = (v_j - mean(v)) . (scale * sum_i q_i dg_i^T)^T / Nk, summed over the query heads of a group.
    Matmuls in `f32`; the centring in fp32 or wider (a difference of close values)."""
    b, hq, _, d = q.shape
    hkv, nk, dv = k.shape[1], k.shape[2], v.shape[3]
    vf = v.to(torch.promote_types(v.dtype, torch.float32))
    vc = (vf - vf.mean(dim=2, keepdim=True)).to(f32)
    dgf = dg.to(f32)
    dq = dk = None
    if need_q:
        c = torch.matmul(k.to(f32).transpose(-1, -2), vc) / torch.sym_max(nk, 1)  # [B, Hkv, D, Dv]; no keys: 0
        if hq != hkv:
            c = c.repeat_interleave(hq // hkv, dim=1)
        dq = (torch.matmul(dgf, c.transpose(-1, -2)) * scale).to(q.dtype)
    if need_k:
        dc = torch.matmul(q.to(f32).transpose(-1, -2), dgf) * scale  # [B, Hq, D, Dv]
        if hq != hkv:
            dc = dc.reshape(b, hkv, hq // hkv, d, dv).sum(dim=2)
        dk = (torch.matmul(vc, dc.transpose(-1, -2)) / torch.sym_max(nk, 1)).to(k.dtype)
    return dq, dk


def _uniform_row_grad_autograd(q: Tensor, k: Tensor, v: Tensor, scale: float, softcap: float = 0.0) -> Tensor:
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad):
        return _UniformRowGradFunction.apply(q, k, v, scale, softcap)
    with torch._C._AutoDispatchBelowAutograd():
        return _UNIFORM_ROW_GRAD(q, k, v, scale, softcap)


_LIB.impl("uniform_row_grad", _uniform_row_grad_autograd, "Autograd")


# fa3::filled_scores_grad: eager's `where(keep, s, c)` / `masked_fill(m, c)` followed by an additive mask
# is passed to fa3::attention as one additive bias (patterns/masks: the fill as where(m, c, 0)); the op
# then also passes softmax's gradient to the filled scores, which eager's fill cuts. That differs only on
# rows where the filled entries keep a weight (every score absorbed: uniform rows). This op's value is 0;
# its gradient is minus the op's gradient through the filled entries, recomputed densely from the same
# scores and bias on the rows whose incoming gradient is nonzero (emit routes those rows only).
_LIB.define("filled_scores_grad(Tensor q, Tensor k, Tensor v, Tensor bias, Tensor filled, float scale, "
            "float softcap=0.0) -> Tensor", tags=_TAGS)
_LIB.define("filled_scores_grad_backward(Tensor dg, Tensor q, Tensor k, Tensor v, Tensor bias, Tensor filled, "
            "float scale, float softcap) -> (Tensor, Tensor)", tags=_TAGS)


def filled_scores_grad(q: Tensor, k: Tensor, v: Tensor, bias: Tensor, filled: Tensor, scale: float,
                       softcap: float = 0.0) -> Tensor:
    """Zeros [B, Hq, Nq, Dv] in q's dtype (the value; the point is the gradient)."""
    return q.new_zeros((q.shape[0], q.shape[1], q.shape[2], v.shape[3]))


def _filled_scores_grad_fake(q, k, v, bias, filled, scale, softcap=0.0):
    return q.new_empty((q.shape[0], q.shape[1], q.shape[2], v.shape[3]))


_LIB.impl("filled_scores_grad", filled_scores_grad, "CompositeExplicitAutograd")
torch.library.register_fake("fa3::filled_scores_grad", _filled_scores_grad_fake, lib=_LIB)
_FILLED_SCORES_GRAD = torch.ops.fa3.filled_scores_grad.default
_FILLED_SCORES_GRAD_BACKWARD = torch.ops.fa3.filled_scores_grad_backward.default


def filled_scores_grad_backward(dg: Tensor, q: Tensor, k: Tensor, v: Tensor, bias: Tensor, filled: Tensor,
                                scale: float, softcap: float) -> tuple[Tensor, Tensor]:
    """(dq, dk) of filled_scores_grad: with s = softcap(scale * q . k^T) + bias (fp32, as fa3::attention
    adds it) and P = softmax(s), the op's score gradient is ds_ij = P_ij (dg_i . v_j - dg_i . (P v)_i);
    minus its part on the `filled` entries (bool, broadcasting to [B, Hq, Nq, Nk]) goes back through the
    softcap's tanh' to q and k. Rows with no admissible key (all -inf) have P = 0. Only query positions
    where some dg row is nonzero are computed, in blocks, in fp32 (fp64 for fp64)."""
    b, hq, nq, d = q.shape
    hkv, nk, dv = k.shape[1], k.shape[2], v.shape[3]
    if hq % max(hkv, 1) != 0:
        raise ValueError(f"k: {hkv} key heads do not divide the {hq} query heads")
    if filled.dtype != torch.bool:
        raise ValueError(f"filled: expected a bool mask, got {filled.dtype}")
    acc = torch.promote_types(q.dtype, torch.float32)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dk = torch.zeros(k.shape, dtype=acc, device=k.device)
    if b * hq * nq * nk == 0:
        return _laid_out_like(dq, q), _laid_out_like(dk, k)
    rows = _live_query_positions(dg)
    if rows.numel() == 0:
        return _laid_out_like(dq, q), _laid_out_like(dk, k)
    g = hq // hkv
    full = (b, hq, nq, nk)
    bias_f = bias.expand(full) if bias.dtype != torch.bool else torch.where(bias, 0.0, float("-inf")).expand(full)
    filled = filled.expand(full)
    kf, vf = k.to(acc), v.to(acc)
    block = max(1, _ROW_BLOCK_NUMEL // max(1, b * hq * nk))
    for r in rows.split(block):
        n = r.numel()
        qs = q.index_select(2, r).to(acc).reshape(b, hkv, g * n, d)
        dgs = dg.index_select(2, r).to(acc).reshape(b, hkv, g * n, dv)
        raw = torch.matmul(qs, kf.transpose(-1, -2)) * scale
        capped = softcap * torch.tanh(raw / softcap) if softcap > 0 else raw
        z = capped + bias_f.index_select(2, r).to(acc).reshape(b, hkv, g * n, nk)
        m = z.amax(dim=-1, keepdim=True)
        p = torch.exp(z - torch.where(torch.isneginf(m), 0.0, m))  # all -inf: P = 0
        p = p / torch.where(p.sum(dim=-1, keepdim=True) == 0, 1.0, p.sum(dim=-1, keepdim=True))
        dp = torch.matmul(dgs, vf.transpose(-1, -2))
        ds = p * (dp - (p * dp).sum(dim=-1, keepdim=True))
        ds = torch.where(filled.index_select(2, r).reshape(b, hkv, g * n, nk), -ds, 0.0)
        if softcap > 0:
            ds = ds * (1 - (capped / softcap) ** 2)
        ds = ds * scale
        dq.index_copy_(2, r, torch.matmul(ds, kf).reshape(b, hq, n, d))
        dk += torch.matmul(ds.transpose(-1, -2), qs)
    return _laid_out_like(dq, q), _laid_out_like(dk, k)


def _filled_scores_grad_backward_fake(dg, q, k, v, bias, filled, scale, softcap):
    return torch.empty_like(q), torch.empty_like(k)


_LIB.impl("filled_scores_grad_backward", filled_scores_grad_backward, "CompositeExplicitAutograd")
torch.library.register_fake("fa3::filled_scores_grad_backward", _filled_scores_grad_backward_fake, lib=_LIB)


class _FilledScoresGradFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, bias: Tensor, filled: Tensor, scale: float,
                softcap: float = 0.0) -> Tensor:
        with torch._C._AutoDispatchBelowAutograd():
            zero = _FILLED_SCORES_GRAD(q, k, v, bias, filled, scale, softcap)
        ctx.save_for_backward(q, k, v, bias, filled)
        ctx.scale, ctx.softcap = scale, softcap
        return zero

    @staticmethod
    def backward(ctx, dg: Tensor):
        q, k, v, bias, filled = ctx.saved_tensors
        dq, dk = _FILLED_SCORES_GRAD_BACKWARD(dg, q, k, v, bias, filled, ctx.scale, ctx.softcap)
        return (dq if ctx.needs_input_grad[0] else None), (dk if ctx.needs_input_grad[1] else None), \
            None, None, None, None, None


def _filled_scores_grad_autograd(q: Tensor, k: Tensor, v: Tensor, bias: Tensor, filled: Tensor, scale: float,
                                 softcap: float = 0.0) -> Tensor:
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad):
        return _FilledScoresGradFunction.apply(q, k, v, bias, filled, scale, softcap)
    with torch._C._AutoDispatchBelowAutograd():
        return _FILLED_SCORES_GRAD(q, k, v, bias, filled, scale, softcap)


_LIB.impl("filled_scores_grad", _filled_scores_grad_autograd, "Autograd")


# fa3::nan_row_grad: eager's NaN gradients from a row whose every score is -inf (empty_rows "nan"). Eager's softmax row
# is NaN there, so its P @ V backward makes the gradient of every value of that head NaN (also where the loss does
# not read the row: 0 * NaN); an additive -inf mask passes the NaN row on to the scores as well (the row's query, every
# key of the head), where a fill (masked_fill / where) cuts it. The op gives 0 on those rows and no NaN. This op's
# value is 0 (added to emit's NaN fill, selected on those rows only); its backward puts eager's NaNs back from
# `empty` ([B, Hq, Nq, 1], True on the rows that admit no key), whatever the incoming gradient holds.
_LIB.define("nan_row_grad(Tensor q, Tensor k, Tensor v, Tensor empty, bool qk) -> Tensor", tags=_TAGS)


def nan_row_grad(q: Tensor, k: Tensor, v: Tensor, empty: Tensor, qk: bool) -> Tensor:
    """Zeros [B, Hq, Nq, Dv] in v's dtype (the value; the point is the gradient)."""
    return v.new_zeros((q.shape[0], q.shape[1], q.shape[2], v.shape[3]))


def _nan_row_grad_fake(q, k, v, empty, qk):
    return v.new_empty((q.shape[0], q.shape[1], q.shape[2], v.shape[3]))


_LIB.impl("nan_row_grad", nan_row_grad, "CompositeExplicitAutograd")
torch.library.register_fake("fa3::nan_row_grad", _nan_row_grad_fake, lib=_LIB)
_NAN_ROW_GRAD = torch.ops.fa3.nan_row_grad.default


def _heads_with_empty_rows(empty: Tensor, hkv: int) -> Tensor:
    """[B, Hkv, 1, 1] bool: a K/V head some query head of whose group has a row that admits no key."""
    b, hq = empty.shape[0], empty.shape[1]
    rows = empty.reshape(b, hq, -1).any(dim=2)  # [B, Hq]
    return rows.reshape(b, hkv, hq // max(hkv, 1)).any(dim=2).reshape(b, hkv, 1, 1)


class _NanRowGradFunction(torch.autograd.Function):
    """Forward value 0; backward: NaN for every element of v (and with `qk`, of k) of a K/V head whose group has an
    empty row, and with `qk` NaN for the empty rows of q; 0 elsewhere (graph ops AOTAutograd traces)."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, empty: Tensor, qk: bool) -> Tensor:
        with torch._C._AutoDispatchBelowAutograd():
            zero = _NAN_ROW_GRAD(q, k, v, empty, qk)
        ctx.save_for_backward(empty)
        ctx.shapes = (q.shape, k.shape, v.shape)
        ctx.dtypes = (q.dtype, k.dtype, v.dtype)
        ctx.qk = qk
        return zero

    @staticmethod
    def backward(ctx, dg: Tensor):
        (empty,) = ctx.saved_tensors
        (qs, ks, vs), (qt, kt, vt) = ctx.shapes, ctx.dtypes
        heads = _heads_with_empty_rows(empty, vs[1])
        nan = float("nan")
        need_q, need_k, need_v = ctx.needs_input_grad[:3]
        # built from `empty` alone (no factory with a device), so that DTensors stay DTensors (distributed/sharding)
        dv = torch.where(heads, nan, 0.0).to(vt).expand(vs) if need_v else None
        dq = dk = None
        if ctx.qk and need_q:
            dq = torch.where(empty, nan, 0.0).to(qt).expand(qs)
        if ctx.qk and need_k:
            dk = torch.where(heads, nan, 0.0).to(kt).expand(ks)
        return dq, dk, dv, None, None


def _nan_row_grad_autograd(q: Tensor, k: Tensor, v: Tensor, empty: Tensor, qk: bool) -> Tensor:
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return _NanRowGradFunction.apply(q, k, v, empty, qk)
    with torch._C._AutoDispatchBelowAutograd():
        return _NAN_ROW_GRAD(q, k, v, empty, qk)


_LIB.impl("nan_row_grad", _nan_row_grad_autograd, "Autograd")
