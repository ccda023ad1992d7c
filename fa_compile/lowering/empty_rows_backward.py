"""The backward of emit's empty-row fix-up, recognized after AOTAutograd, for a lowered backward that
computes it itself (fa_compile/cpu_flash_op.py: `fa3::cpu_flash_backward`; fa_compile/kernels/triton_ops.py:
`fa3_triton::bwd` with `empty_grad`, whose last kernel is fa_compile/kernels/triton_empty_rows_bwd.py).

Forward, emit wrote `res = where(isneginf(lse)[..., None], fill, out)` (empty_rows.py). Its backward, as
AOTAutograd and Inductor's decompositions give it on the torch versions the project supports, with D the
incoming gradient of `res` and `cond` = unsqueeze(eq(lse, -inf), -1) on the op's saved lse:

    W1 = where(cond, 0, D)                      -> fa3.attention_backward's dout
    W2 = where(cond, D, 0)                      (only when the fill needs a gradient: the mean of V)
    S  = sum(W2, [2], keepdim)                  the mean's gradient, GQA: -> view [B, Hkv, G, 1, Dv]
         [-> sum([2], keepdim) -> squeeze(2)]   -> sum over the group
         -> expand(v's shape) -> div(Nk)        -> add with the attention backward's dv
    U  = fa3.uniform_row_grad_backward(W2, q, k, v, scale, 0.0)   (eager's q / k gradient on those rows)
         U[0] -> add with dq, U[1] -> add with dk

Every one of these is zero, or the identity on D, unless some row admits no key, which most batches
never have; as graph ops they cost passes over dO, dQ, dK and dV per layer (two `where`s, the op's
check and zero fills, three adds). A backward that reads the lse itself decides once (one reduction
over [B, Hq, Nq]: on the CPU on the host, on a GPU inside a kernel, with no sync) and computes them only then. `find_backward_fixup` returns what it may fold:
  - "none":    W1 only (dout is D; the op zeroes the empty rows' dout itself);
  - "mean_v":  W1 and the mean's gradient to dv (S and its add);
  - "uniform": W1, S and U with their adds.
W1 is folded only when it is the one `where` above on the backward node's own lse; W2's consumers are
folded only when they are exactly the chains above, each add's other operand the backward's own output
and sole user of it. Anything else stays graph ops (W1 alone is still folded): exact either way.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ..row_fixups import _UNIFORM_ROW_GRAD_BACKWARD as _UNIFORM_BACKWARD
from ..dropped_rows import _BACKWARD as _DROPPED_BACKWARD
from . import site_args, splice
from .empty_rows import _VIEWS, _is_neginf_test, _sole_user, _val

aten = torch.ops.aten


@dataclass
class BackwardFixup:
    kind: str  # "none" / "mean_v" / "uniform" / "dropped"
    dout: fx.Node  # D, the gradient the folded W1 read
    adds: dict = field(default_factory=dict)  # output index (0 dq, 1 dk, 2 dv) -> the add it replaces
    qk_grad: float = 0.0  # "dropped": fa3::dropped_uniform_rows_backward's qk_grad


def _is_zero(a) -> bool:
    """A scalar 0 as the decomposed where spells it: a Python number or aten.full([], 0)."""
    if isinstance(a, (int, float)) and not isinstance(a, bool):
        return a == 0
    if isinstance(a, fx.Node) and a.op == "call_function" and a.target is aten.full.default:
        return list(a.args[0]) == [] and a.args[1] == 0
    return False


def _is_cond(n, lse: fx.Node) -> bool:
    """n = unsqueeze(eq(lse, -inf) / isneginf(lse), -1)."""
    if not isinstance(n, fx.Node) or n.op != "call_function" or n.target is not aten.unsqueeze.default:
        return False
    return n.args[1] in (-1, 3) and isinstance(n.args[0], fx.Node) and _is_neginf_test(n.args[0], lse)


def _where(n: fx.Node, lse: fx.Node, zero_first: bool) -> Optional[fx.Node]:
    """D of `where(cond, 0, D)` (zero_first) or `where(cond, D, 0)`, cond on `lse`; None otherwise."""
    if n.op != "call_function" or n.target is not aten.where.self or not _is_cond(n.args[0], lse):
        return None
    zero, d = (n.args[1], n.args[2]) if zero_first else (n.args[2], n.args[1])
    return d if _is_zero(zero) and isinstance(d, fx.Node) else None


def _call(n, target) -> bool:
    return isinstance(n, fx.Node) and n.op == "call_function" and n.target is target


def _sum_keep2(n, src: fx.Node) -> bool:
    if not _call(n, aten.sum.dim_IntList) or n.args[0] is not src:
        return False
    keep = n.args[2] if len(n.args) > 2 else n.kwargs.get("keepdim", False)
    return bool(keep) and list(n.args[1]) in ([2], [-2]) and "dtype" not in n.kwargs


def _same_shape(a, b) -> bool:
    return a is not None and b is not None and a.dim() == b.dim() and all(
        statically_known_true(x == y) for x, y in zip(a.shape, b.shape))


def _mean_grad_add(w2: fx.Node, s: fx.Node, v: fx.Node, groups: int) -> Optional[fx.Node]:
    """The add that S (a user of W2) ends in: sum -> [group sum] -> expand(v's shape) -> div(Nk)."""
    vv = _val(v)
    if vv is None or not _sum_keep2(s, w2):
        return None
    n = _sole_user(s)
    if groups > 1:  # view [B, Hkv, G, 1, Dv] -> sum([2], keepdim) -> squeeze(2)
        nv = _val(n)
        if n is None or n.op != "call_function" or n.target not in _VIEWS or nv is None or nv.dim() != 5 \
                or not statically_known_true(nv.shape[2] == groups):
            return None
        g = _sole_user(n)
        if g is None or not _sum_keep2(g, n):
            return None
        sq = _sole_user(g)
        if not _call(sq, aten.squeeze.dim) or sq.args[1] not in (2, -3):
            return None
        n = _sole_user(sq)
    if not _call(n, aten.expand.default) or not _same_shape(_val(n), vv):
        return None
    div = _sole_user(n)
    if not _call(div, aten.div.Scalar) or not statically_known_true(div.args[1] == vv.shape[2]):
        return None
    return _sole_user(div) if _call(_sole_user(div), aten.add.Tensor) else None


def _other(add: fx.Node, mine: fx.Node):
    a, b = add.args[0], add.args[1]
    return b if a is mine else a if b is mine else None


def find_backward_fixup(node: fx.Node, bound: dict, groups: int) -> Optional[BackwardFixup]:
    """What of the fix-up's backward around the fa3.attention_backward `node` may be folded (see above);
    None when its dout is not W1 on its own lse."""
    lse, dout = bound["lse"], bound["dout"]
    if not isinstance(dout, fx.Node) or not isinstance(lse, fx.Node):
        return None
    d = _where(dout, lse, zero_first=True)
    d_val, w_val = _val(d), _val(dout)
    if d is None or d_val is None or w_val is None or d_val.dtype != w_val.dtype or not _same_shape(d_val, w_val):
        return None  # the where promoted or broadcast D: the kernel reads what it gave
    found = BackwardFixup("none", d)
    outs = {u.args[1]: u for u in node.users if _call(u, operator.getitem)}
    w2s = [u for u in d.users if u is not dout and _where(u, lse, zero_first=False) is d]
    if len(w2s) != 1:
        return found
    w2 = w2s[0]
    dropped = _dropped_fixup(node, bound, w2, outs, d)
    if dropped is not None:
        return dropped
    sums = [u for u in w2.users if _call(u, aten.sum.dim_IntList)]
    unis = [u for u in w2.users if _call(u, _UNIFORM_BACKWARD)]
    if len(sums) != 1 or len(unis) > 1 or len(w2.users) != len(sums) + len(unis):
        return found
    dv_add = _mean_grad_add(w2, sums[0], bound["v"], groups)
    if dv_add is None or 2 not in outs or _sole_user(outs[2]) is not dv_add:
        return found
    adds = {2: dv_add}
    if not unis:
        return BackwardFixup("mean_v", d, adds)
    u = unis[0]
    if list(u.args[1:4]) != [bound["q"], bound["k"], bound["v"]] or u.args[4] != bound["scale"] \
            or (u.args[5] if len(u.args) > 5 else 0.0) != 0.0:
        return found
    parts = {x.args[1]: x for x in u.users if _call(x, operator.getitem)}
    if len(parts) != len(u.users) or not set(parts) <= {0, 1}:
        return found
    for i in (0, 1):  # U[i] + the backward's output i, each the other's only use
        if i not in parts:
            if i in outs and outs[i].users:
                return found  # the op's own gradient used alone: the fold would add U's term to it
            continue
        add = _add_into(parts[i], outs, i)
        if add is None:
            return found
        adds[i] = add
    return BackwardFixup("uniform", d, adds)


def _add_into(part: fx.Node, outs: dict, i: int) -> Optional[fx.Node]:
    """The add of a fix-up term `part` and the backward's output i, when each is the other's only use."""
    add = _sole_user(part)
    if not _call(add, aten.add.Tensor) or i not in outs or _sole_user(outs[i]) is not add \
            or _other(add, outs[i]) is not part:
        return None
    return add


def _dropped_fixup(node: fx.Node, bound: dict, w2: fx.Node, outs: dict, d: fx.Node) -> Optional[BackwardFixup]:
    """BackwardFixup("dropped") when W2's one user is fa3::dropped_uniform_rows_backward on the backward node's own
    q, k, v, lse, dropout seed, dropout_p, scale and softcap, and each of its gradients that is used is added to the
    node's output of the same index, that add being the output's sole user (an output used alone while the term is
    unused, with q and k getting a term, is not folded: the kernel would add into it)."""
    if len(w2.users) != 1:
        return None
    u = next(iter(w2.users))
    if not _call(u, _DROPPED_BACKWARD) or u.args[0] is not w2:
        return None
    a = site_args.bound(u)
    if any(a[n] is not bound[m] for n, m in (("q", "q"), ("k", "k"), ("v", "v"), ("lse", "lse"),
                                             ("seed", "dropout_seed"))):
        return None
    if a["dropout_p"] != bound["dropout_p"] or a["scale"] != bound["scale"] or a["softcap"] != bound["softcap"]:
        return None
    qk_grad = float(a["qk_grad"])
    parts = {x.args[1]: x for x in u.users if _call(x, operator.getitem)}
    if len(parts) != len(u.users):
        return None
    adds = {}
    for i in (0, 1, 2):
        used = i in parts and bool(parts[i].users)
        if not used:
            if i in outs and outs[i].users and (i == 2 or qk_grad != 0):
                return None
            continue
        add = _add_into(parts[i], outs, i)
        if add is None:
            return None
        adds[i] = add
    return BackwardFixup("dropped", d, adds, qk_grad)


def folded_text(kind: str) -> str:
    """Decision.folded for a backward that computes the fix-up's backward itself."""
    what = {"none": "their dout zeroed", "mean_v": "their dout zeroed, the mean of V's gradient",
            "uniform": "their dout zeroed, the mean of V's gradient and eager's uniform-row q / k gradients",
            "dropped": "their dout zeroed, the dropped uniform weights' gradients added"}[kind]
    return f"empty rows: {what} by the kernel"



def output_plan(fix: BackwardFixup, outs: list) -> Optional[tuple[list, tuple, list]]:
    """(want, strides, drops) for a backward replacement with the fold: `outs` the node's own output values
    (the kernel's layout). Each output an add stands for takes that add's strides, or keeps the kernel's
    where that only makes copies no-ops (splice.droppable_clones: `drops`); `strides` [dq, dk, dv] are those
    to copy to, None where the kernel's. None when a copy would need symbolic strides, which a replacement
    cannot trace: the fix-up's backward then stays graph ops."""
    want, drops = list(outs), []
    for i, add in fix.adds.items():
        clones = splice.droppable_clones(add, want[i])
        if clones is None:
            want[i] = add.meta["val"]
        else:
            drops += clones
    strides = tuple(None if splice.strides_match(n, w) else tuple(w.stride()) for w, n in zip(want[:3], outs))
    if any(s is not None and not all(isinstance(x, int) for x in s) for s in strides):
        return None
    return want, strides, drops
