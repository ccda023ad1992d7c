"""The op's output conventions as graph ops (traced into the replacement, fused by Inductor)."""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
from torch._prims_common import compute_elementwise_output_strides, make_contiguous_strides_for
from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing
from torch.fx.experimental.symbolic_shapes import statically_known_true

NEG_INF = float("-inf")


def _equal_strides(shape, a, b) -> bool:
    if all(isinstance(v, int) for v in (*shape, *a, *b)):  # real tensors (the ops' own calls)
        return all(size <= 1 or x == y for size, x, y in zip(shape, a, b))
    # (untraced: a size expression read from another node's value has no proxy in the trace of a replacement)
    with disable_proxy_modes_tracing():
        return all(statically_known_true(size <= 1) or statically_known_true(x == y) for size, x, y in zip(shape, a, b))


def _hint(s) -> int:
    return int(s.node.hint) if isinstance(s, torch.SymInt) and s.node.hint is not None else int(s)


def _traced_strides(t: Tensor, stride: tuple) -> tuple:
    """`stride` as expressions of t's own (traced) sizes, when it is dense in some dimension order and the
    shape environment proves them equal; else `stride` as given. Under symbolic sizes a stride such as
    4*s0*s1 read from another node's value is not a value make_fx can trace (it only knows the traced
    inputs' sizes), while the same product of t's sizes is."""
    if not any(isinstance(s, torch.SymInt) for s in stride):
        return stride
    try:
        order = sorted(range(len(stride)), key=lambda i: _hint(stride[i]))  # innermost first
    except Exception:  # a size without a hint
        return stride
    rebuilt, acc = [None] * len(stride), 1
    for i in order:
        rebuilt[i] = acc
        acc = acc * t.shape[i]
    return tuple(rebuilt) if _equal_strides(t.shape, rebuilt, stride) else stride


def with_strides(t: Tensor, stride: tuple) -> Tensor:
    """`t` stored with `stride` (a copy only where it is not already: decided at trace time)."""
    if _equal_strides(t.shape, t.stride(), stride):
        return t
    return torch.ops.prims.copy_strided.default(t, list(_traced_strides(t, stride)))


def bshd_strides(b, h, n, d) -> tuple:
    return (n * h * d, d, h * d, 1)


def as_bshd(out: Tensor) -> Tensor:
    """out [B, H, N, D] stored as a `.transpose(1, 2)` of a contiguous [B, N, H, D]."""
    b, h, n, d = out.shape
    return with_strides(out, bshd_strides(b, h, n, d))


def dense_like(t: Tensor, like: Tensor) -> Tensor:
    """`t` with the strides `torch.empty_like(like)` has (like's dimension order, dense)."""
    return with_strides(t, tuple(compute_elementwise_output_strides(like)))


def additive_mask(q: Tensor, k: Tensor, bias: Optional[Tensor], kv_lens: Optional[Tensor]) -> Optional[Tensor]:
    """bias (bool: True = attend, or float) and kv_lens as one additive mask in q's dtype that
    broadcasts to [B, Hq, Nq, Nk] (its own broadcast shape kept: nothing is expanded)."""
    mask = None
    if bias is not None:
        mask = bias if bias.dtype != torch.bool else torch.zeros_like(bias, dtype=q.dtype).masked_fill(~bias, NEG_INF)
    if kv_lens is not None:
        b, nk = q.shape[0], k.shape[2]
        j = torch.arange(nk, device=q.device)
        pad = torch.zeros((b, 1, 1, nk), dtype=q.dtype, device=q.device)
        pad = pad.masked_fill(j.view(1, 1, 1, nk) >= kv_lens.view(b, 1, 1, 1), NEG_INF)
        mask = pad if mask is None else mask + pad
    if mask is not None:
        while mask.dim() < 4:
            mask = mask.unsqueeze(0)
    return mask


def empty_rows(q: Tensor, k: Tensor, mask: Optional[Tensor], kv_lens: Optional[Tensor], causal: bool,
               bias: Optional[Tensor]) -> Optional[Tensor]:
    """[B, Hq, Nq] bool: rows with no admissible key, or None where there can be none.

    Only masks empty rows (causal here is top-left, where key 0 is always admissible): from kv_lens
    alone a row is empty iff its batch has no key; otherwise a reduction over the mask's own
    broadcast shape (causal bounds added by index comparison, never materialised)."""
    b, hq, nq = q.shape[0], q.shape[1], q.shape[2]
    if mask is None:
        return None
    if bias is None:
        return (kv_lens <= 0).view(b, 1, 1).expand(b, hq, nq)
    return (~admitted(q, k, mask, causal).any(dim=-1)).expand(b, hq, nq)


def admitted(q: Tensor, k: Tensor, mask: Tensor, causal: bool) -> Tensor:
    """Bool, broadcasting to [B, Hq, Nq, Nk]: the keys an additive mask and a top-left causal bound admit
    (the mask's own broadcast shape, the causal bound by index comparison, nothing materialised)."""
    keep = ~torch.isneginf(mask)
    if causal:
        nq, nk = q.shape[2], k.shape[2]
        i = torch.arange(nq, device=q.device).view(nq, 1)
        j = torch.arange(nk, device=q.device).view(1, nk)
        keep = keep & (j <= i)
    return keep


def without_nan_keys(q: Tensor, k: Tensor, mask: Tensor, causal: bool, groups: int) -> tuple[Tensor, Tensor]:
    """(k, rows) for a mask the op applies by exclusion (a bool bias, kv_lens) that a kernel receives added:
    a key holding a NaN would give NaN + (-inf) = NaN on the rows that exclude it and poison them, where the
    op (and eager's masked_fill / where) gives that key weight 0. So NaN elements are zeroed (the mask still
    excludes their keys where it did), and `rows` [B, Hq, Nq] are the rows that admit such a key, which the
    caller makes NaN (a NaN element makes that row's score NaN whatever the query). An infinite element is
    left to the kernel: its score is +-inf or NaN depending on the query, so zeroing it would change rows
    that admit it (a -inf score weighs 0 there)."""
    nan = k != k
    kbad = nan.any(-1)  # [B, Hkv, Nk]
    k = k.masked_fill(nan, 0)  # (the backward zeroes them alike: nan_keys_for_backward)
    bad = (kbad.repeat_interleave(groups, dim=1) if groups > 1 else kbad).unsqueeze(2)  # [B, Hq, 1, Nk]
    rows = (bad & admitted(q, k, mask, causal)).any(-1)  # the mask's own broadcast shape over Nq
    return k, rows.expand(q.shape[0], q.shape[1], q.shape[2])


def nan_keys_for_backward(k: Tensor) -> tuple[Tensor, Tensor]:
    """(k with its NaN elements zeroed, the NaN columns [B, Hkv, 1, D]) for the backward of a forward that ran on
    `without_nan_keys`' k. The kernel recomputes the scores, and a NaN key would make P NaN (NaN + -inf) on the rows
    that exclude it, and so its dK and dV, where eager's are 0: the kernel gets the zeroed k. Eager's dQ = dS·K
    does carry the NaN to every row of the key's head (0 · NaN), in the columns where it sits: `with_nan_columns`
    puts that back. Rows that admit the key have a NaN lse from the forward, and their gradients stay NaN."""
    nan = k != k
    return k.masked_fill(nan, 0), nan.any(dim=2, keepdim=True)


def with_nan_columns(dq: Tensor, columns: Tensor) -> Tensor:
    """dq [B, Hq, Nq, D], NaN in the columns `nan_keys_for_backward` found for each query head's kv head."""
    b, hq, nq, d = dq.shape
    hkv = columns.shape[1]
    nan = torch.full((), float("nan"), dtype=dq.dtype, device=dq.device)
    if hkv == hq:
        return torch.where(columns, nan, dq)
    # query head h reads kv head h // G: split the heads (a view of any layout), broadcast over the group
    return torch.where(columns.unsqueeze(2), nan, dq.unflatten(1, (hkv, hq // hkv))).flatten(1, 2)


def finish(out: Tensor, lse: Tensor, empty: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    """fp32 lse, -inf and out 0 on empty rows, out BSHD-strided, lse contiguous."""
    lse = lse.to(torch.float32)
    if empty is not None:
        lse = lse.masked_fill(empty, NEG_INF)
        out = out.masked_fill(empty.unsqueeze(-1), 0)
    return as_bshd(out), with_strides(lse, tuple(make_contiguous_strides_for(lse.shape)))
