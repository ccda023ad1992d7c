"""The empty-row fix-ups of patterns/emit.py, recognized after AOTAutograd, for a lowered kernel that writes
eager's value on those rows itself.

The op returns 0 (lse -inf) on a row that admits no key; where eager computes something else, emit adds
`where(isneginf(lse)[..., None], fill, out)` after the op, with `fill` a NaN tensor (softmax over -inf
fills) or the mean of V over all keys, repeated over the query heads of each KV head (softmax over equal
finite fills). In a decode step those are launches of their own (a reduction over the cache and a
`where`) around a kernel of a few microseconds; in an encoder's forward, a read of V and a pass over the
output per layer. The decode kernel, our Triton forward and the CPU flash op can write either value
themselves (`empty_fill` of fa_compile/kernels/decode_ops.py, fa_compile/kernels/triton_ops.py, fa_compile/cpu_flash_op.py), and
the choice may prefer such a kernel for the site (choice._filling_kernel), so the lowering looks for the
fix-up here, in the post-grad (decomposed ATen) form it has on the torch versions the project supports,
and takes it only when:
  - the op's out and lse feed nothing but the fix-up (nothing else reads the op's own zeros), or, for a
    lowering whose backward reads such an out (`find_fixup(saved=True)`), also the graph's outputs: the
    values a training graph saves for the backward, which weighs a finite fill 0;
  - the mean is over dim 2 of the op's own v, keepdim, and the repeat over heads is the
    unsqueeze(2) / expand / clone / view chain of `repeat_interleave(dim=1)` (kv head h // G for query
    head h), which is the kernel's own head order;
  - the mean may carry `+ fa3::uniform_row_grad` (value 0: in training, its gradient is the backward's);
  - the `where` has the op's out's dtype and shape; the lowered out takes the `where`'s strides (a copy
    in the replacement where they differ: only with more than one query token), so its users see the
    tensor they were traced with, except where the `where` only fed the head transpose before a
    projection, traced as permute -> clone: the kernel's own [B, N, H, D] out then makes the clone a
    no-op, which the lowering drops (splice.droppable_clones).
Anything else keeps the fix-up as graph ops: exact either way.
"""
from __future__ import annotations

import math
import operator
from typing import Optional

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

aten, prims = torch.ops.aten, torch.ops.prims

_VIEWS = (aten.view.default, aten.reshape.default, aten._unsafe_view.default)
_CONVERT = (prims.convert_element_type.default, aten._to_copy.default)


def _val(n) -> Optional[torch.Tensor]:
    v = n.meta.get("val") if isinstance(n, fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


def _same(a, b) -> bool:
    return statically_known_true(a == b)


def _sole_user(n: fx.Node) -> Optional[fx.Node]:
    users = list(n.users)
    return users[0] if len(users) == 1 else None


def _getitems(node: fx.Node) -> Optional[tuple[fx.Node, fx.Node]]:
    got: dict = {}
    for u in node.users:
        if u.op != "call_function" or u.target is not operator.getitem or u.args[1] in got:
            return None
        got[u.args[1]] = u
    if set(got) != {0, 1}:
        return None
    return got[0], got[1]


def _is_neginf_test(n: fx.Node, lse: fx.Node) -> bool:
    if n.op != "call_function" or n.args[0] is not lse:
        return False
    if n.target is aten.isneginf.default:
        return True
    return n.target is aten.eq.Scalar and n.args[1] == float("-inf")


# Ops that move or copy the elements of a tensor without changing their values (full_like of a BSHD out
# traces to full -> permute -> clone).
_LAYOUT = _VIEWS + _CONVERT + (aten.permute.default, aten.clone.default, aten.expand.default,
                               aten.unsqueeze.default, aten.squeeze.dim)


def _is_nan_full(n: fx.Node) -> bool:
    """`n` holds NaN in every element: aten.full(NaN), through layout ops only."""
    while n.op == "call_function" and n.target in _LAYOUT and isinstance(n.args[0], fx.Node):
        n = n.args[0]
    if n.op != "call_function" or n.target is not aten.full.default:
        return False
    value = n.args[1]
    return isinstance(value, float) and math.isnan(value)


def _strip_converts(n: fx.Node) -> fx.Node:
    while isinstance(n, fx.Node) and n.op == "call_function" and n.target in _CONVERT:
        n = n.args[0]
    return n


def _is_zero_valued(n) -> bool:
    """fa3::uniform_row_grad (value 0) or the aten.full(0) the lowering makes of it (graph_pass._zeros_for)."""
    if not isinstance(n, fx.Node) or n.op != "call_function":
        return False
    if n.target is torch.ops.fa3.uniform_row_grad.default:
        return True
    return n.target is aten.full.default and n.args[1] == 0 and not isinstance(n.args[1], bool)


def _is_mean_v(fill: fx.Node, v: fx.Node) -> bool:
    """`fill` is mean(v, dim=2, keepdim) (casts allowed), repeated over the query heads of each KV head
    as repeat_interleave(dim=1) decomposes: unsqueeze(2) -> expand [B, Hkv, G, 1, Dv] -> clone -> view."""
    vv, fv = _val(v), _val(fill)
    if vv is None or fv is None or vv.dim() != 4 or fv.dim() != 4:
        return False
    n = _strip_converts(fill)
    if n.op == "call_function" and n.target is aten.add.Tensor and len(n.args) == 2 and not n.kwargs:
        # training: + fa3::uniform_row_grad (value 0, the gradient is the point: the backward's business)
        zero = [a for a in n.args if _is_zero_valued(a)]
        if len(zero) != 1:
            return False
        n = _strip_converts(n.args[1] if n.args[0] is zero[0] else n.args[0])
    if n.op == "call_function" and n.target in _VIEWS:
        clone = _strip_converts(n.args[0])
        if clone.op != "call_function" or clone.target is not aten.clone.default:
            return False
        exp = clone.args[0]
        if exp.op != "call_function" or exp.target is not aten.expand.default:
            return False
        uns = exp.args[0]
        if uns.op != "call_function" or uns.target is not aten.unsqueeze.default or uns.args[1] not in (2, -3):
            return False
        ev, uv = _val(exp), _val(uns)
        if ev is None or uv is None or uv.dim() != 5 or ev.dim() != 5:
            return False
        # [B, Hkv, 1, 1, Dv] -> [B, Hkv, G, 1, Dv]: only dim 2 grows; the view merges (Hkv, G) into Hq
        if not all(_same(ev.shape[i], uv.shape[i]) for i in (0, 1, 3, 4)) or not _same(uv.shape[2], 1):
            return False
        if not _same(ev.shape[1] * ev.shape[2], fv.shape[1]):
            return False
        n = _strip_converts(uns.args[0])
    if n.op != "call_function" or n.target is not aten.mean.dim:
        return False
    dims = n.args[1]
    keep = n.args[2] if len(n.args) > 2 else n.kwargs.get("keepdim", False)
    if n.args[0] is not v or not keep or list(dims) not in ([2], [-2]):
        return False
    mv = _val(n)
    return mv is not None and mv.dim() == 4 and all(_same(mv.shape[i], vv.shape[i]) for i in (0, 1, 3))


def _is_dropped(n: fx.Node, v: fx.Node, lse: fx.Node, seed: Optional[fx.Node], dropout_p: float) -> bool:
    """n = fa3::dropped_uniform_rows(..., v, lse, seed, dropout_p, ...) on the op's own v, lse and seed."""
    from ..dropped_rows import _OP
    from .site_args import bound

    if n.op != "call_function" or n.target is not _OP or seed is None:
        return False
    a = bound(n)
    return a["v"] is v and a["lse"] is lse and a["seed"] is seed and a["dropout_p"] == dropout_p


def _user_besides_outputs(n: fx.Node, saved: bool) -> Optional[fx.Node]:
    """n's one user, not counting the graph's output where `saved`."""
    users = [u for u in n.users if not (saved and u.op == "output")]
    return users[0] if len(users) == 1 else None


def find_fixup(node: fx.Node, v: fx.Node, saved: bool = False, seed: Optional[fx.Node] = None,
               dropout_p: float = 0.0) -> Optional[tuple[str, fx.Node]]:
    """(kind "nan" / "mean_v" / "dropped", the `where` node) when the fa3.attention `node`'s outputs feed only emit's
    empty-row fix-up in the form above (v: the op's v argument); None otherwise. "dropped": the fill is
    fa3::dropped_uniform_rows (casts allowed) on the op's own v, lse, dropout seed (`seed`) and `dropout_p`, read
    by nothing else; it is the lse's one other user.

    saved: the graph may also return the op's out and lse: a training graph's forward saves them for the
    op's backward, whose `where` on dO (emit's fix-up's backward) zeroes the gradient of every empty row, so
    the out it reads there weighs nothing if finite: the mean of V only, not NaN (a lowering declares
    `fills_saved_empty_rows` when its backward takes such an out). The raw out is never the user's: emit
    returns the fix-up's output in its place."""
    pair = _getitems(node)
    if pair is None:
        return None
    out, lse = pair
    users = [u for u in lse.users if not (saved and u.op == "output")]
    tests = [u for u in users if _is_neginf_test(u, lse)]
    others = [u for u in users if u not in tests]
    if len(tests) != 1 or len(others) > 1:
        return None
    test = tests[0]
    drop = others[0] if others else None
    if drop is not None and not _is_dropped(drop, v, lse, seed, dropout_p):
        return None
    cond = _sole_user(test)
    if cond is None or cond.op != "call_function" or cond.target is not aten.unsqueeze.default \
            or cond.args[1] not in (-1, 3):
        return None
    where = _sole_user(cond)
    if where is None or where.op != "call_function" or where.target is not aten.where.self:
        return None
    if where.args[0] is not cond or where.args[2] is not out or _user_besides_outputs(out, saved) is not where:
        return None
    fill = where.args[1]
    if not isinstance(fill, fx.Node):
        return None
    if drop is not None:
        if _strip_converts(fill) is not drop:
            return None
        n = fill
        while n is not drop:  # drop and the casts below `fill` read by nothing else
            n = n.args[0]
            if len(n.users) != 1:
                return None
        kind = "dropped"
    elif _is_nan_full(fill):
        kind = "nan"
    elif _is_mean_v(fill, v):
        kind = "mean_v"
    else:
        return None
    if saved and kind == "nan":
        return None  # the backward's rowsum(dO * out) would read 0 * NaN on those rows
    ov, wv = _val(out), _val(where)
    if ov is None or wv is None or ov.dtype != wv.dtype or ov.dim() != wv.dim():
        return None
    if not all(_same(a, b) for a, b in zip(ov.shape, wv.shape)):
        return None
    return kind, where
