"""Graph-building helpers of the rewrite: glue nodes that can be erased on a refusal, the op's
layout choice, views and regrouping of batch dimensions, dead-node removal."""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.fx as fx

from .. import emit
from ..canonicalize import arg, is_finite_number, is_inplace, kind, tensor_of
from ..emit import example_value
from ..layout import Contraction, View, fold, identity
from ..shapes import known_eq, known_one
from .scores import Miss, narrows


class _Out:
    """Insert glue nodes before `anchor`; remember them so a refusal can erase them."""

    def __init__(self, graph: fx.Graph, anchor: fx.Node):
        self.graph, self.anchor = graph, anchor
        self.start = anchor.prev  # everything inserted lands between start and anchor
        self.made: list[fx.Node] = []

    def call(self, target: Any, *args: Any, method: bool = False, **kwargs: Any) -> fx.Node:
        n = self.graph.call_method(target, args, kwargs) if method else self.graph.call_function(target, args, kwargs)
        self.made.append(n)
        emit.set_example_value(n)
        if "example_value" not in n.meta:
            raise Miss("no FakeTensor metadata in the graph (not a Dynamo graph?)")
        return n

    def size(self, node: fx.Node, dim: int) -> Any:
        s = tensor_of(node).shape[dim]
        return s if isinstance(s, int) else self.call("size", node, dim, method=True)

    def rollback(self) -> None:
        # everything between start and the anchor, including what emit inserted
        doomed, n = [], self.start.next
        while n is not self.anchor:
            doomed.append(n)
            n = n.next
        for n in reversed(doomed):
            if not n.users:
                self.graph.erase_node(n)


def _padded_batch(shape: tuple, nb: int) -> list:
    """The batch sizes of a [batch..., X, Y] logical shape, left-padded with 1 to nb dims."""
    b = list(shape[:-2])
    return [1] * (nb - len(b)) + b


@dataclass
class _Layout:
    nb: int
    mode: str  # "none" (nb=0), "bh1" (nb=1: B'=batch, H=1), "mqa1" (nb=1: B'=1, H=batch), "std", "grouped"
    lead: int  # number of leading batch dims merged into B'


def _choose_layout(bd: list, qb: list, kb: list, vb: list) -> _Layout:
    nb = len(bd)
    if nb == 0:
        return _Layout(0, "none", 0)
    if nb == 1:
        if known_one(kb[0]) and known_one(vb[0]) and not known_one(bd[0]):
            return _Layout(1, "mqa1", 0)
        return _Layout(1, "bh1", 1)
    if nb >= 3 and known_one(kb[-1]) and known_one(vb[-1]) and not known_one(qb[-1]):
        return _Layout(nb, "grouped", nb - 2)
    return _Layout(nb, "std", nb - 1)


class _Builder:
    def __init__(self, out: _Out, bd: list, layout: _Layout, ref_nodes: list):
        self.o, self.bd, self.lay = out, bd, layout
        self.ref = ref_nodes  # (node, padded batch) materialized operands to read full sizes from

    def full_size(self, i: int) -> Any:
        s = self.bd[i]
        if isinstance(s, int):
            return s
        for node, b in self.ref:
            if not known_one(b[i]):
                return self.o.size(node, i)
        return s

    def pad(self, node: fx.Node, rank: int) -> fx.Node:
        while tensor_of(node).dim() < rank:
            node = self.o.call(torch.unsqueeze, node, 0)
        return node

    def expand(self, node: fx.Node, dims: list) -> fx.Node:
        t = tensor_of(node)
        need = [i for i in dims if known_one(t.shape[i]) and not known_one(self.bd[i])]
        if not need:
            return node
        sizes = [self.full_size(i) if i in need else -1 for i in range(t.dim())]
        return self.o.call("expand", node, *sizes, method=True)

    def to_op(self, node: fx.Node, kv: bool) -> fx.Node:
        """A padded operand [batch..., N, D] -> [B', H, N, D] (kv: heads stay un-repeated / broadcast)."""
        lay, nb = self.lay, self.lay.nb
        if lay.mode == "none":
            return self.o.call(torch.unsqueeze, self.o.call(torch.unsqueeze, node, 0), 0)
        if lay.mode == "mqa1":
            return self.o.call(torch.unsqueeze, node if kv else self.expand(node, [0]), 0)
        if lay.mode == "bh1":
            return self.o.call(torch.unsqueeze, self.expand(node, [0]), 1)
        node = self.expand(node, list(range(lay.lead)))
        if lay.mode == "grouped":
            if kv:
                node = self.o.call(torch.squeeze, node, nb - 1)
            else:
                node = self.o.call(torch.flatten, self.expand(node, [nb - 2, nb - 1]), nb - 2, nb - 1)
        elif not kv:
            node = self.expand(node, [nb - 1])
        if lay.lead > 1:
            node = self.o.call(torch.flatten, node, 0, lay.lead - 1)
        return node

    def bias_to_op(self, node: fx.Node) -> fx.Node:
        """A tensor broadcasting to the scores [batch..., Nq, Nk] -> broadcasting to [B', H, Nq, Nk]."""
        lay, nb = self.lay, self.lay.nb
        t = tensor_of(node)
        if lay.mode == "none" or (lay.mode == "std" and nb == 2 and t.dim() <= 4):
            return node
        if t.dim() <= 2:
            return node
        node = self.pad(node, nb + 2)
        if lay.mode == "mqa1":
            return self.o.call(torch.unsqueeze, node, 0)
        if lay.mode == "bh1":
            return self.o.call(torch.unsqueeze, node, 1)
        b = tensor_of(node).shape
        groups = [list(range(lay.lead))]
        if lay.mode == "grouped":
            groups.append([nb - 2, nb - 1])
        for dims in groups:
            if len(dims) > 1 and not all(known_one(b[i]) for i in dims):
                node = self.expand(node, dims)
        if lay.mode == "grouped":
            node = self.o.call(torch.flatten, node, nb - 2, nb - 1)
        if lay.lead > 1:
            node = self.o.call(torch.flatten, node, 0, lay.lead - 1)
        return node

    def out_from_op(self, out: fx.Node, q_padded: fx.Node) -> fx.Node:
        """[B', H, Nq, Dv] -> the scores' batch layout [batch..., Nq, Dv]."""
        lay, nb = self.lay, self.lay.nb
        if lay.mode == "none":
            return self.o.call(torch.squeeze, self.o.call(torch.squeeze, out, 0), 0)
        if lay.mode == "mqa1":
            return self.o.call(torch.squeeze, out, 0)
        if lay.mode == "bh1":
            return self.o.call(torch.squeeze, out, 1)
        if lay.mode == "grouped":
            out = self.o.call(torch.unflatten, out, 1, (-1, self.o.size(q_padded, nb - 1)))
        if lay.lead > 1:
            out = self.o.call(torch.unflatten, out, 0, tuple(self.full_size(i) for i in range(lay.lead)))
        return out


def _materialize(o: _Out, v: View, dtype: torch.dtype) -> fx.Node:
    node = v.node
    if v.perm != identity(len(v.perm)):
        node = o.call(torch.permute, node, v.perm)
    if tensor_of(node).dtype != dtype:
        node = o.call("to", node, dtype, method=True)
    return node


_VIEWISH = ("transpose", "permute", "unsqueeze", "getitem", "expand")
_OPERATORS = frozenset((operator.mul, operator.add, operator.sub, operator.truediv, operator.neg, operator.getitem,
                        operator.imul, operator.iadd, operator.isub, operator.itruediv, operator.matmul))


def _tensor_op(u: fx.Node) -> bool:
    """A call of a torch function or Tensor method (nothing else is run on the fake values)."""
    if u.op == "call_method":
        return isinstance(u.target, str) and hasattr(torch.Tensor, u.target)
    mod = getattr(u.target, "__module__", "") or ""
    return u.target in _OPERATORS or (mod.startswith("torch") and not mod.startswith("torch._dynamo"))


def needs_contiguous(old: fx.Node, new_val: torch.Tensor, depth: int = 3) -> bool:
    """Would a `.view` downstream of `old` fail on `new_val`'s strides (where it worked on eager's), or
    would the caller get a non-contiguous tensor where eager returned a contiguous one?"""
    mode = emit._fake_mode([new_val])
    if mode is None:
        return False
    frontier = [(old, new_val)]
    for _ in range(depth):
        nxt = []
        for node, val in frontier:
            for u in node.users:
                if u.op == "output":
                    # returned to the caller: keep eager's strides (a caller may .view() it)
                    old_val = example_value(node)
                    if isinstance(old_val, torch.Tensor) and old_val.is_contiguous() and not val.is_contiguous():
                        return True
                    continue
                if u.op != "call_method" and u.op != "call_function":
                    continue
                is_view = u.op == "call_method" and u.target == "view"
                if not (is_view or kind(u) in _VIEWISH):
                    # another op: its result may keep the op's strides (elementwise ops follow their input's
                    # layout: `o * 2` then `.view`), so it is followed too, on the fake values. An in-place op into
                    # another tensor, or a call that is not a tensor op, ends the walk there.
                    if (is_inplace(u) and u.args and u.args[0] is not node) or not _tensor_op(u):
                        continue
                args = fx.node.map_arg(u.args, lambda a: val if a is node else example_value(a))
                kwargs = fx.node.map_arg(u.kwargs, lambda a: val if a is node else example_value(a))
                try:
                    with mode:
                        r = (getattr(args[0], u.target)(*args[1:], **kwargs) if u.op == "call_method"
                             else u.target(*args, **kwargs))
                except Exception:
                    return True
                if isinstance(r, torch.Tensor):
                    nxt.append((u, r))
        frontier = nxt
    return False


def _where(node: fx.Node) -> str:
    from ..source_location import location

    return location(node)


def _shape(t: Any) -> Optional[tuple]:
    return tuple(t.shape) if isinstance(t, torch.Tensor) else None


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(known_eq(x, y) for x, y in zip(a, b))


def _target_sizes(sizes: list) -> list:
    """Sizes for reshape/expand arguments: ints, with at most one symbolic size given as -1."""
    sym = [i for i, s in enumerate(sizes) if not isinstance(s, int)]
    if len(sym) > 1:
        raise Miss("batch dims regrouped with more than one symbolic size")
    return [-1 if i in sym else s for i, s in enumerate(sizes)]


def _regroup(o: "_Out", node: Any, from_bd: list, to_bd: list, full: bool = False, see_through: bool = True) -> Any:
    """A tensor broadcasting to [*from_bd, X, Y] -> the same values broadcasting to [*to_bd, X, Y]
    (the batch dims regrouped as a view/reshape of the scores does). full: node has from_bd exactly.
    see_through: `x.reshape(B*H, N, D)` may be regrouped by reading x (False where eager's gradient
    stops at the reshape, e.g. one made under no_grad: reading x would give x a gradient)."""
    t = tensor_of(node)
    if t is None:
        return node  # a Python scalar broadcasts anywhere
    if t.dim() <= 2:
        return node
    batch = _padded_batch(t.shape, len(from_bd)) if t.dim() <= len(from_bd) + 2 else None
    if batch is None:
        raise Miss("a mask has more batch dims than the scores")
    if not full and all(known_one(b) for b in batch):
        return o.call(torch.flatten, node, 0, t.dim() - 3)  # [1, .., 1, X, Y] -> [1, X, Y]
    while tensor_of(node).dim() < len(from_bd) + 2:
        node = o.call(torch.unsqueeze, node, 0)
    if not _same(batch, from_bd):
        need = [f if (known_one(b) and not known_one(f)) else -1 for b, f in zip(batch, from_bd)]
        if any(not isinstance(x, int) for x in need):
            raise Miss("a broadcast mask must be expanded along a symbolic batch dim")
        node = o.call("expand", node, *need, -1, -1, method=True)
    want = list(to_bd) + list(tensor_of(node).shape[-2:])
    src = node.args[0] if see_through and kind(node) == "reshape" and node.args else None
    if tensor_of(src) is not None and _same(list(tensor_of(src).shape), want):
        return src  # x.reshape(B*H, N, D) regrouped back to [B, H, N, D] is x itself
    last = [o.size(node, -2), o.size(node, -1)]
    return o.call("reshape", node, *_target_sizes(list(to_bd)), *last, method=True)


def _canon_out_shape(c: Contraction, val: torch.Tensor) -> tuple:
    """The contraction output's shape in canonical [batch..., M, N] order."""
    shape = [None] * val.dim()
    for i, p in enumerate(c.out_perm):
        shape[p] = val.shape[i]
    return tuple(shape)


def _absorb_scale(v: View, scale: float, compute: torch.dtype) -> tuple[View, float]:
    """q * c (or k * c, q / c) computed before the contraction (which computes in `compute`), in a dtype no wider than
    the contraction's: move c into the op's scale."""
    for _ in range(4):
        n = v.node
        k = kind(n)
        if k not in ("mul", "div") or len(n.users) != 1 or is_inplace(n):
            break  # `q *= c` writes into q itself: the op must read the scaled tensor
        a, b = n.args[0], arg(n, 1, "other")
        if k == "mul" and is_finite_number(a) and isinstance(b, fx.Node):
            a, b = b, a
        if not (isinstance(a, fx.Node) and is_finite_number(b)) or b == 0:
            break
        ta = tensor_of(a)
        if ta is None or ta.dim() != tensor_of(n).dim() or ta.dtype != tensor_of(n).dtype:
            break
        if any(narrows(d, tensor_of(n).dtype) for d in (v.dtype, compute)):
            # the scaled tensor is narrowed before the product (a cast, or an autocast region's contraction): moved
            # into the op's scale, c would apply after that narrowing, where the unscaled tensor may leave its range
            break
        scale = scale * float(b) if k == "mul" else scale / float(b)
        v = fold(View(a, v.perm, v.dtype, v.group, v.bcast_axes))
    return v, scale


def _erase_dead(graph: fx.Graph, nodes: list) -> None:
    seen: set = set()
    for n in nodes:
        if n in seen:
            continue
        seen.add(n)
        if not getattr(n, "_erased", False) and not n.users and n.op not in ("placeholder", "output"):
            try:
                graph.erase_node(n)
            except Exception:
                pass
