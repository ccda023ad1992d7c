"""Logical views of tensors and the axes of a contraction, proven from the graph's own semantics.

A `View` is `node.permute(perm)`, optionally converted to another floating dtype. Transposes, permutes,
`.contiguous()` and float casts fold into it, so `k.transpose(1, 2).transpose(-2, -1)` and
`k.permute(0, 2, 3, 1)` both become "this node, with these axes": whatever the spelling, the axes are
those the ops define, never assumed from a template (a `permute(0, 2, 3, 1)` is not read as a
transpose of the last two dims unless it is one).

`contraction(node)` reads `@` / matmul / bmm / baddbmm / einsum / F.linear as out = lhs · rhs with
lhs [batch..., M, C], rhs [batch..., C, N], out [batch..., M, N] (then `out_perm`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.fx as fx

from .aliasing import copy_parted
from .canonicalize import arg, kind, tensor_of


def identity(n: int) -> tuple:
    return tuple(range(n))


@dataclass
class View:
    """The logical tensor `node.permute(perm)` (then `.to(dtype)` when `dtype` differs from node's)."""

    node: fx.Node
    perm: tuple
    dtype: torch.dtype  # the dtype the graph computes with (after any casts folded in)
    group: int = 1  # K/V repeated by this factor on the head axis in the graph (GQA), removed here
    bcast_axes: tuple = ()  # logical axes that were expanded from size 1 (expand removed here)

    @property
    def base(self) -> torch.Tensor:
        return tensor_of(self.node)

    @property
    def shape(self) -> tuple:
        s = self.base.shape
        return tuple(s[p] for p in self.perm)

    @property
    def rank(self) -> int:
        return len(self.perm)

    def swap_last(self) -> "View":
        p = list(self.perm)
        p[-1], p[-2] = p[-2], p[-1]
        return View(self.node, tuple(p), self.dtype, self.group, self.bcast_axes)


def _norm_dims(dims: Any, nd: int) -> Optional[list]:
    if isinstance(dims, (list, tuple)) and len(dims) == 1 and isinstance(dims[0], (list, tuple)):
        dims = dims[0]
    if not isinstance(dims, (list, tuple)) or not all(isinstance(d, int) for d in dims):
        return None
    return [d % nd for d in dims]


def _lossless_cast(src: torch.dtype, dst: torch.dtype) -> bool:
    return src == dst or (src.is_floating_point and dst.is_floating_point and torch.promote_types(src, dst) == dst
                          and not {src, dst} == {torch.float16, torch.bfloat16})


def _copies(node: fx.Node, src: fx.Node) -> bool:
    """Whether `node` (a clone, `.contiguous()` or a cast of `src`) may hold memory of its own: then reading `src`
    in its place is exact only while neither is written. `.contiguous()` of a contiguous tensor and a cast to the
    dtype it has return `src` itself, which a write reaches either way."""
    t, s = tensor_of(node), tensor_of(src)
    if kind(node) == "cast":
        return t.dtype != s.dtype or t.device != s.device
    if node.target in ("contiguous", torch.Tensor.contiguous):
        try:
            return not bool(s.is_contiguous())
        except Exception:  # a symbolic stride: it may copy
            return True
    return True  # clone


def _copy_written(node: fx.Node, src: fx.Node) -> bool:
    """`node` copies `src` and a write may make them differ where the site reads (aliasing.copy_parted)."""
    return _copies(node, src) and copy_parted(node, src)


def fold(view: View, *, through_casts: bool = True) -> View:
    """Fold transpose / permute / contiguous / clone (and lossless float upcasts) into the view. A copy that is
    written, or whose source is written after it (`_copy_written`), ends the fold: the site reads the copy."""
    node, perm = view.node, view.perm
    dtype = view.dtype
    for _ in range(64):
        k = kind(node)
        t = tensor_of(node)
        if t is None:
            break
        nd = t.dim()
        src = node.args[0] if node.args else None
        if not isinstance(src, fx.Node) or tensor_of(src) is None:
            break
        if k == "transpose":
            a, b = arg(node, 1, "dim0"), arg(node, 2, "dim1")
            if not (isinstance(a, int) and isinstance(b, int)) or nd < 2:
                break
            sw = list(range(nd))
            sw[a % nd], sw[b % nd] = sw[b % nd], sw[a % nd]
            perm = tuple(sw[p] for p in perm)
        elif k == "permute":
            dims = _norm_dims(node.args[1:] if node.op == "call_method" else arg(node, 1, "dims"), nd)
            if dims is None or sorted(dims) != list(range(nd)):
                break
            perm = tuple(dims[p] for p in perm)
        elif k == "identity":
            if node.kwargs.get("memory_format") not in (None, torch.contiguous_format, torch.preserve_format):
                break
            if _copy_written(node, src):
                break
        elif k == "cast" and through_casts:
            if not _lossless_cast(tensor_of(src).dtype, t.dtype) or _copy_written(node, src):
                break
        else:
            break
        node = src
    return View(node, perm, dtype, view.group, view.bcast_axes)


@dataclass
class Contraction:
    node: fx.Node
    spelling: str  # "matmul", "bmm", "einsum", "baddbmm", "linear"
    lhs: View  # [batch..., M, C]
    rhs: View  # [batch..., C, N]
    out_perm: tuple  # the node's value is canonical [batch..., M, N] permuted by out_perm
    alpha: Any = 1.0  # baddbmm, linear: out = beta * addend + alpha * lhs @ rhs
    beta: Any = 0.0
    addend: Optional[fx.Node] = None
    batch_rank: int = 0


def _view_of(x: Any) -> Optional[View]:
    t = tensor_of(x)
    if t is None or not t.dtype.is_floating_point:
        return None
    return View(x, identity(t.dim()), t.dtype)


def contraction(node: fx.Node) -> Optional[Contraction]:
    """The node as a contraction lhs · rhs, or None when it is not one (or not readable)."""
    k = kind(node)
    out = tensor_of(node)
    if out is None or out.dim() < 2:
        return None
    if k == "matmul":
        a, b = _view_of(node.args[0]), _view_of(node.args[1]) if len(node.args) > 1 else None
        if a is None or b is None or a.rank < 2 or b.rank < 2:
            return None
        spelling = "bmm" if "bmm" in str(getattr(node.target, "__name__", node.target)) else "matmul"
        return Contraction(node, spelling, a, b, identity(out.dim()), batch_rank=out.dim() - 2)
    if k == "baddbmm":
        inp = node.args[0]
        a, b = _view_of(arg(node, 1, "batch1")), _view_of(arg(node, 2, "batch2"))
        if a is None or b is None:
            return None
        beta, alpha = node.kwargs.get("beta", 1), node.kwargs.get("alpha", 1)
        return Contraction(node, "baddbmm", a, b, identity(3), alpha=alpha, beta=beta, addend=inp, batch_rank=1)
    if k == "linear":  # F.linear(x, w, b) = b + x · wᵀ, w 2-D [N, C]
        a, w = _view_of(node.args[0]), _view_of(arg(node, 1, "weight"))
        bias = arg(node, 2, "bias")
        if a is None or w is None or a.rank < 2 or w.rank != 2:
            return None
        if isinstance(tensor_of(w.node), torch.nn.Parameter):
            return None  # a module's weight (nn.Linear): a learned projection such as a classifier, not keys
        b = w.swap_last()
        return Contraction(node, "linear", a, b, identity(out.dim()), beta=0.0 if bias is None else 1.0,
                           addend=bias, batch_rank=out.dim() - 2)
    if k == "einsum":
        return _einsum(node, out)
    return None


def _einsum(node: fx.Node, out: torch.Tensor) -> Optional[Contraction]:
    args = list(node.args)
    if not args or not isinstance(args[0], str):
        return None
    eq = args[0].replace(" ", "")
    ops = args[1:]
    if len(ops) == 1 and isinstance(ops[0], (list, tuple)):
        ops = list(ops[0])
    if len(ops) != 2 or "->" not in eq:
        return None
    a, b = _view_of(ops[0]), _view_of(ops[1])
    if a is None or b is None:
        return None
    lhs_s, z = eq.split("->")
    if lhs_s.count(",") != 1:
        return None
    x, y = lhs_s.split(",")
    if "..." in eq:  # "...": the same leading batch letters on every side
        if not (x.startswith("...") and y.startswith("...") and z.startswith("...")):
            return None
        ex, ey = a.rank - (len(x) - 3), b.rank - (len(y) - 3)
        ez = out.dim() - (len(z) - 3)
        if not (ex == ey == ez) or ex < 0:
            return None
        fill = "".join(chr(ord("A") + i) for i in range(ex))
        x, y, z = fill + x[3:], fill + y[3:], fill + z[3:]
    if len(x) != a.rank or len(y) != b.rank or len(z) != out.dim():
        return None
    if len(set(x)) != len(x) or len(set(y)) != len(y) or len(set(z)) != len(z):
        return None
    sx, sy, sz = set(x), set(y), set(z)
    contracted = (sx & sy) - sz
    batch = sx & sy & sz
    rows, cols = (sx & sz) - sy, (sy & sz) - sx
    if len(contracted) != 1 or len(rows) != 1 or len(cols) != 1:
        return None
    if sx - sz - sy or sy - sz - sx or sz - sx - sy:
        return None  # a letter summed over one operand only, or a new output letter
    (c,), (m,), (n,) = contracted, rows, cols
    if z.index(m) > z.index(n):
        # the product is the same with the operands swapped ('bjhd,bihd->bhij' is 'bihd,bjhd->bhij'): take the
        # order in which the output lists the free letters, so that a site's scores or P·V read as usual
        a, b, x, y, m, n = b, a, y, x, n, m
    zb = [ch for ch in z if ch in batch]
    canon = zb + [m, n]
    lp = tuple(a.perm[x.index(ch)] for ch in zb + [m, c])
    rp = tuple(b.perm[y.index(ch)] for ch in zb + [c, n])
    out_perm = tuple(canon.index(ch) for ch in z)
    return Contraction(node, "einsum", View(a.node, lp, a.dtype), View(b.node, rp, b.dtype), out_perm,
                       batch_rank=len(zb))


def eager_layout(eager: torch.Tensor, ours: torch.Tensor) -> Optional[dict]:
    """clone() arguments that give a replacement `ours` the strides of eager's value, so that `.contiguous()`,
    `.reshape()`, `.flatten()` downstream give a view or a copy as they did in eager (and a write through them lands
    where it did): nothing where the strides already match, contiguous where eager's value was (a product's
    usually is); None for another layout."""
    if eager.is_contiguous():
        return {} if ours.is_contiguous() else dict(memory_format=torch.contiguous_format)
    if tuple(eager.stride()) == tuple(ours.stride()):
        return {}
    return None


def fresh_copy_kwargs(ours: torch.Tensor) -> Optional[dict]:
    """clone() arguments for a copy of `ours` that Inductor keeps: a contiguous one where `ours` has other strides
    (a clone that keeps the strides is a no-op to Inductor's joint-graph passes, which drop it); None where `ours`
    is already contiguous (the caller copies another way)."""
    if ours.is_contiguous():  # (contiguous with other strides on a size-1 dim: the copy by `* 1.0` serves as well)
        return None
    return dict(memory_format=torch.contiguous_format)
