"""A softmax whose rows of scores that are all -inf are set to 0: the "safe" softmax.

PyTorch's `_safe_softmax` (what `F.scaled_dot_product_attention`'s math path uses, and what its decomposition in
`torch.export`'s core ATen IR writes out) and hand-written code alike compute

    p = torch.where(~(s != -inf).any(-1, keepdim=True), 0, torch.softmax(s, -1))    # or
    p = torch.softmax(s, -1).masked_fill((s == -inf).all(-1, keepdim=True), 0)

so that a row with no admissible key gives 0 instead of NaN. The test reads the scores `s` that enter the softmax;
nothing else may. This module names such a test: `row_test_nodes(cond, s)` is the list of nodes that compute
"every score of the row is -inf" from `s` (with keepdim), or None. The site finder takes that zeroing as the op's
own value for a row with no admissible key (`zeroed_rows`).
"""
from __future__ import annotations

import math
import operator
from typing import Any, Optional

import torch
import torch.fx as fx

from ..canonicalize import arg, tensor_of

_EQ = (torch.eq, operator.eq, torch.Tensor.eq)
_NE = (torch.ne, operator.ne, torch.Tensor.ne, torch.not_equal)
_NOT = (torch.logical_not, torch.bitwise_not, operator.invert, torch.Tensor.logical_not, torch.Tensor.bitwise_not)
_ISNEGINF = (torch.isneginf, torch.Tensor.isneginf)
_ANY = (torch.any, torch.Tensor.any)
_ALL = (torch.all, torch.Tensor.all)


def _is(node: Any, fns: tuple, methods: tuple) -> bool:
    if not isinstance(node, fx.Node):
        return False
    if node.op == "call_method":
        return node.target in methods
    return node.op == "call_function" and node.target in fns


def _neg_inf(x: Any) -> bool:
    return isinstance(x, float) and x == -math.inf


def _is_not(node: Any) -> bool:
    return _is(node, _NOT, ("logical_not", "bitwise_not", "__invert__")) and len(node.args) == 1 and not node.kwargs


def _negated(inner: Optional[bool], node: fx.Node, nodes: list) -> Optional[bool]:
    """The test of a negation `node` whose argument's test is `inner` (None: not a test)."""
    if inner is None:
        return None
    nodes.append(node)
    return not inner


def _elementwise(node: Any, s: fx.Node, nodes: list) -> Optional[bool]:
    """True when `node` is `s == -inf` elementwise, False when it is `s != -inf`, None otherwise; its nodes are
    appended to `nodes`."""
    if _is_not(node):
        return _negated(_elementwise(node.args[0], s, nodes), node, nodes)
    if _is(node, _ISNEGINF, ("isneginf",)) and node.args == (s,) and not node.kwargs:
        nodes.append(node)
        return True
    for fns, methods, value in ((_EQ, ("eq", "__eq__"), True), (_NE, ("ne", "__ne__", "not_equal"), False)):
        if _is(node, fns, methods) and len(node.args) == 2 and not node.kwargs:
            a, b = node.args
            if (a is s and _neg_inf(b)) or (b is s and _neg_inf(a)):
                nodes.append(node)
                return value
    return None


def _row(node: Any, s: fx.Node, nodes: list) -> Optional[bool]:
    """True when `node` is "every score of the row is -inf" (keepdim), False when it is "some score of the row is
    not -inf", None otherwise."""
    if _is_not(node):
        return _negated(_row(node.args[0], s, nodes), node, nodes)
    for fns, methods, every in ((_ALL, ("all",), True), (_ANY, ("any",), False)):
        if not _is(node, fns, methods) or not node.args or len(node.args) > 3:
            continue
        st = tensor_of(s)
        dim, keep = arg(node, 1, "dim"), arg(node, 2, "keepdim", False)
        if isinstance(dim, (list, tuple)) and len(dim) == 1:
            dim = dim[0]
        if st is None or not isinstance(dim, int) or dim % st.dim() != st.dim() - 1 or keep is not True \
                or set(node.kwargs) - {"dim", "keepdim"}:
            return None
        elem = _elementwise(node.args[0], s, nodes)
        # all(s == -inf): every score is -inf; any(s != -inf): some score is not
        if elem is None or elem != every:
            return None
        nodes.append(node)
        return every
    return None


def row_test_nodes(cond: Any, s: fx.Node) -> Optional[list]:
    """The nodes (readers first) that compute `cond` = "every score of the row of `s` is -inf" from `s`, each read
    by the next one only; None when `cond` is not that test."""
    nodes: list = []
    if _row(cond, s, nodes) is not True:
        return None
    for a, b in zip(nodes, nodes[1:]):
        if set(a.users) != {b}:
            return None
    return list(reversed(nodes))


def score_readers(s: fx.Node) -> tuple:
    """The readers of `s` that may start a row test (an eq / ne / isneginf of s against -inf)."""
    return tuple(u for u in s.users if _elementwise(u, s, []) is not None)
