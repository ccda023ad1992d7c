"""GQA / MQA: see through K/V repeated on the head axis, so the op reads the un-repeated K/V.

The op's GQA semantics are "query head h reads kv head h // (Hq // Hkv)", which is exactly what
`repeat_kv` (x[:, :, None].expand(B, Hkv, G, N, D).reshape(B, Hkv * G, N, D)) and
`repeat_interleave(G, dim=head)` build. `x.repeat(1, G, 1, 1)` tiles instead (h % Hkv) and is only the
same when Hkv == 1. A plain `expand` of a size-1 axis is a broadcast (MQA) and is removed too.
"""
from __future__ import annotations

from typing import Optional

import torch.fx as fx

from .aliasing import copy_parted
from .canonicalize import arg, kind, tensor_of
from .layout import View
from .shapes import known_eq


def _unsqueezed_at(node: fx.Node) -> Optional[tuple[fx.Node, int]]:
    """(x, axis) when node is x.unsqueeze(axis) or x[:, :, None] (a None index, full slices and at most one
    Ellipsis after the None only)."""
    k = kind(node)
    src = node.args[0] if node.args else None
    if not isinstance(src, fx.Node) or tensor_of(src) is None:
        return None
    nd = tensor_of(node).dim()
    if k == "unsqueeze":
        d = arg(node, 1, "dim")
        return (src, d % nd) if isinstance(d, int) else None
    if k == "reshape":  # x.view(B, Hkv, 1, N, D): an inserted size-1 axis
        s, t = tensor_of(src).shape, tensor_of(node).shape
        if len(t) == len(s) + 1:
            for ax in range(len(t)):
                if known_eq(t[ax], 1) and all(known_eq(a, b) for a, b in zip(list(t[:ax]) + list(t[ax + 1:]), s)):
                    return src, ax
        return None
    if k == "getitem":
        idx = node.args[1]
        if not isinstance(idx, tuple) or sum(i is None for i in idx) != 1:
            return None
        full = slice(None, None, None)
        ax = idx.index(None)
        head, tail = idx[:ax], idx[ax + 1:]
        # every other entry keeps its axis whole (an index after the None, a permutation say, would be lost)
        if not all(isinstance(i, slice) and i == full for i in head) or \
                not all(i is Ellipsis or (isinstance(i, slice) and i == full) for i in tail) or \
                sum(i is Ellipsis for i in tail) > 1:
            return None
        return src, ax
    return None


def unrepeat(view: View, head_axis: int) -> View:
    """Remove a head-axis repeat (or size-1 expand) under `view`; the logical head axis is `head_axis`."""
    node = view.node
    axis = view.perm[head_axis]
    t = tensor_of(node)
    k = kind(node)
    if k in ("repeat_interleave", "reshape") and isinstance(node.args[0], fx.Node) and \
            copy_parted(node, node.args[0]):
        return view  # a repeated copy written in place, or its source written after it: the copy is what is read
    if k == "repeat_interleave":
        reps, dim = arg(node, 1, "repeats"), arg(node, 2, "dim")
        src = node.args[0]
        if isinstance(reps, int) and reps > 1 and isinstance(dim, int) and dim % t.dim() == axis and \
                isinstance(src, fx.Node) and tensor_of(src) is not None and tensor_of(src).dim() == t.dim():
            return View(src, view.perm, view.dtype, view.group * reps, view.bcast_axes)
        return view
    if k == "reshape":
        # repeat_kv: reshape(expand(unsqueeze(x, axis + 1)), ..., Hkv * G, ...)
        src = node.args[0]
        if kind(src) != "expand":
            return view
        u = _unsqueezed_at(src.args[0]) if isinstance(src.args[0], fx.Node) else None
        if u is None:
            return view
        base, ins = u
        bs, es, rs = tensor_of(base).shape, tensor_of(src).shape, t.shape
        if ins != axis + 1 or len(bs) != len(rs) or len(es) != len(rs) + 1:
            return view
        # expand only the inserted axis; reshape merges (Hkv, G) into the head axis, nothing else
        if not all(known_eq(es[i], bs[i]) for i in range(ins)) or \
                not all(known_eq(es[i + 1], bs[i]) for i in range(ins, len(bs))):
            return view
        g = es[ins]
        if not isinstance(g, int) or g < 1:
            return view
        want = list(bs)
        want[axis] = bs[axis] * g
        if not all(known_eq(a, b) for a, b in zip(rs, want)):
            return view
        return View(base, view.perm, view.dtype, view.group * g, view.bcast_axes)
    if k == "expand":
        src = node.args[0]
        s = tensor_of(src)
        if s is None or s.dim() != t.dim():
            return view
        if known_eq(s.shape[axis], 1) and not known_eq(t.shape[axis], 1):
            others = [i for i in range(t.dim()) if i != axis]
            if all(known_eq(s.shape[i], t.shape[i]) for i in others):
                return View(src, view.perm, view.dtype, view.group, view.bcast_axes + (head_axis,))
    return view


__all__ = ["unrepeat"]
