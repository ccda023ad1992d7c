"""In-place updates of tensors nothing else aliases, read as their functional op.

`scores.masked_fill_(mask, -inf)` (or `scores[mask] = -inf` with a bool mask of the scores' shape) as
a statement leaves the Dynamo graph with the scores node read by
the in-place op and, after it, by the softmax, which sees the written values. When the updated tensor
`x` is provably not shared, `x.op_(*a)` is `x2 = x.op(*a)` with every later read of `x` (and every
read of the in-place op's result) reading `x2` instead: that is what functionalization does, here
only where it is proven exact:
- `x` is a fresh tensor: the result of an op that always allocates its output (a factory such as
  `torch.zeros`, a contraction, an einsum of two or more operands, elementwise arithmetic, masked_fill /
  where, softmax, clone), never a graph input, a view or an op that may return its input
  (`.contiguous()`, `.to()`); or a chain of such views of a fresh tensor in which each tensor is read by
  the next view only (`(q @ kᵀ).view(B, H, N, N)`);
- no read of `x` before the update makes a view of it (a view would see the write); reads that
  compute fresh tensors or only read the shape are kept as they are (they ran before the write);
- the functional op gives `x`'s shape, strides, dtype, device and requires_grad (`x_fp16.add_(y_fp32)`
  stays fp16 where `add` would promote: left alone); other strides only when every later reader computes
  its values element by element (arithmetic, where, softmax), which strides do not change;
- the update runs under the same grad mode / autocast / inference state as `x` was made in (an
  update under no_grad of a tensor that needs a gradient is not the functional op's gradient).
Anything else is left in place, and the site finder then refuses the site it touches.
"""
from __future__ import annotations

import operator
from typing import Any, Optional

import torch
import torch.fx as fx

from .canonicalize import is_inplace, kind, reads_only_metadata, tensor_of
from .emit import set_example_value
from .layout import contraction
from .regions import Regions
from .shapes import known_eq

_METHOD_TWINS = {"masked_fill_": "masked_fill", "add_": "add", "sub_": "sub", "mul_": "mul", "div_": "div",
                 # a causal mask made in place: torch.ones(i, j, dtype=torch.bool).triu_(j - i + 1)
                 "triu_": "triu", "tril_": "tril"}
_OPERATOR_TWINS = {operator.iadd: operator.add, operator.isub: operator.sub, operator.imul: operator.mul,
                   operator.itruediv: operator.truediv}
# elementwise ops, and products (F.linear with a module's weight included, which `contraction` leaves out)
_FRESH_KINDS = ("mul", "div", "add", "sub", "masked_fill", "where", "tanh", "softmax", "linear", "matmul", "baddbmm")
# the triangle of a matrix: a new tensor (the functional twins of triu_ / tril_)
_TRIANGLES = frozenset(("triu", "tril", torch.triu, torch.tril, torch.Tensor.triu, torch.Tensor.tril))
# ops that allocate a new tensor from sizes (and a fill value) alone
_FACTORIES = frozenset((torch.zeros, torch.ones, torch.empty, torch.full, torch.arange, torch.zeros_like,
                        torch.ones_like, torch.empty_like, torch.full_like, torch.eye, torch.linspace, torch.tensor,
                        torch.rand, torch.randn, torch.randint))
_FACTORY_METHODS = ("new_zeros", "new_ones", "new_empty", "new_full", "new_tensor")


def _twin(node: fx.Node) -> Optional[tuple[str, Any]]:
    """("call_method" | "call_function", target) of the functional op of an in-place node, or None."""
    if node.op == "call_method" and node.target in _METHOD_TWINS:
        return "call_method", _METHOD_TWINS[node.target]
    if node.op != "call_function":
        return None
    if node.target in _OPERATOR_TWINS:
        return "call_function", _OPERATOR_TWINS[node.target]
    if node.target is operator.setitem and len(node.args) == 3 and not node.kwargs:
        # x[mask] = c with a bool mask of x's own shape is x.masked_fill_(mask, c)
        x, idx, val = node.args
        tx, ti = tensor_of(x), tensor_of(idx)
        # (indexing takes a host mask for a CUDA tensor, masked_fill_ does not)
        if tx is not None and ti is not None and ti.dtype == torch.bool and ti.dim() == tx.dim() and \
                ti.device == tx.device and all(known_eq(a, b) for a, b in zip(ti.shape, tx.shape)) and \
                isinstance(val, (int, float)) and not isinstance(val, bool):
            return "call_method", "masked_fill"
        return None
    name = getattr(node.target, "__name__", "")
    if name in _METHOD_TWINS and getattr(torch.Tensor, name, None) is node.target:
        return "call_method", _METHOD_TWINS[name]  # torch.Tensor.masked_fill_(s, m, v)
    return None


def is_fresh(node: Any) -> bool:
    """`node` is a tensor that an op allocated for its result (no graph input, view or possible alias)."""
    if not isinstance(node, fx.Node) or node.op not in ("call_function", "call_method"):
        return False
    if tensor_of(node) is None or is_inplace(node) or "out" in node.kwargs:
        return False
    try:
        if node.target in (_FACTORIES if node.op == "call_function" else _FACTORY_METHODS) or \
                node.target in _TRIANGLES:
            return True
    except TypeError:  # an unhashable target
        pass
    if kind(node) == "identity":
        return node.target in ("clone", torch.clone, torch.Tensor.clone)
    if kind(node) == "einsum":  # a one-operand einsum may return a view; a product of two or more never does
        operands = node.args[1:]
        if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
            operands = operands[0]
        return not node.kwargs and isinstance(node.args[0], str) and \
            sum(tensor_of(a) is not None for a in operands) >= 2
    return kind(node) in _FRESH_KINDS or contraction(node) is not None


_VIEW_KINDS = ("transpose", "permute", "reshape", "unsqueeze", "getitem", "identity", "cast")


def owns_storage(node: Any, depth: int = 8) -> bool:
    """`node` is fresh, or a view of a tensor that owns its storage and that nothing but `node` reads
    (`(q @ kᵀ).view(B, H, N, N)`): every read of that memory then goes through `node`."""
    if is_fresh(node):
        return True
    if depth == 0 or kind(node) not in _VIEW_KINDS or tensor_of(node) is None or is_inplace(node):
        return False
    src = node.args[0] if node.args else None
    return isinstance(src, fx.Node) and len(src.users) == 1 and owns_storage(src, depth - 1)


def _keeps_alias_free(user: fx.Node, x: fx.Node) -> bool:
    """A read of x before its update that makes no alias of x: a fresh tensor, a shape-only read or a
    value that holds no tensor (a tuple may hold views: `x.split(2)`)."""
    if reads_only_metadata(user, x) or is_fresh(user):
        return True
    if "example_value" not in user.meta:
        return False
    return not isinstance(user.meta["example_value"], (torch.Tensor, tuple, list, dict))


def _same_meta(a: torch.Tensor, b: torch.Tensor, strides: bool = True) -> bool:
    """Same shape and strides (provably, adding no guard; strides only when asked), dtype, device and
    requires_grad."""
    if a.dim() != b.dim() or a.dtype != b.dtype or a.device != b.device or a.requires_grad != b.requires_grad:
        return False
    dims = list(zip(a.shape, b.shape)) + (list(zip(a.stride(), b.stride())) if strides else [])
    return all(known_eq(x, y) for x, y in dims)


# Readers whose values do not depend on their input's strides: they allocate their result and compute it
# element by element (or row by row), so x2 with other strides than x gives them the same values.
_STRIDE_BLIND_KINDS = ("mul", "div", "add", "sub", "masked_fill", "where", "tanh", "softmax")


def _stride_blind(user: fx.Node) -> bool:
    return not is_inplace(user) and "out" not in user.kwargs and kind(user) in _STRIDE_BLIND_KINDS


def functionalize_inplace(gm: fx.GraphModule) -> bool:
    """Replace every provable in-place update (see the module docstring); True when any was replaced."""
    graph = gm.graph
    pos = {n: float(i) for i, n in enumerate(graph.nodes)}
    regions: Optional[Regions] = None
    changed = False
    for m in list(graph.nodes):
        twin = _twin(m)
        if twin is None or not m.args or not owns_storage(m.args[0]):
            continue
        x = m.args[0]
        if any(pos[u] < pos[m] and u is not m and not _keeps_alias_free(u, x) for u in x.users):
            continue
        regions = regions or Regions(gm)
        if regions.of(m) != regions.of(x):
            continue
        with graph.inserting_before(m):
            f = graph.create_node(twin[0], twin[1], m.args, m.kwargs)
        try:
            set_example_value(f)
        except Exception:
            f.meta.pop("example_value", None)
        old, new = tensor_of(x), tensor_of(f)
        later = [u for u in x.users if u is not f and u is not m and pos[u] > pos[m]] + list(m.users)
        # `x` a strided view (Funnel's `positional_attn *= cls_mask` on a slice): x2 is laid out anew, which
        # only readers that ignore strides may see
        if new is None or old is None or not (_same_meta(old, new) or (
                _same_meta(old, new, strides=False) and all(_stride_blind(u) for u in later))):
            graph.erase_node(f)
            continue
        pos[f] = pos[m] - 0.5
        for u in list(x.users):
            if u is not f and u is not m and pos[u] > pos[m]:
                u.replace_input_with(x, f)
        m.replace_all_uses_with(f)
        graph.erase_node(m)
        changed = True
    return changed
