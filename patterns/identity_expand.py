"""Expands to a tensor's own shape, read as the tensor.

`torch.matmul` of two 4-d tensors decomposes (`torch.export`'s `run_decompositions()`, the core ATen IR) into
`bmm(a.expand(shape).view(B*H, N, K), ...)` with each operand expanded to the broadcast shape first. Where the
operands already have that shape, as attention's probabilities and values do, the expand changes nothing: it
returns a view of x with x's shape and strides. Every walker that follows the probabilities or the scores to their
product stops at an `expand` (a real broadcast is another computation), so such a graph had no P·V contraction.
Each expand whose every size is x's own static size or -1 is replaced by x: the same values at the same addresses
and the same gradient (expand's backward sums over no broadcast dimension). The two are different tensor objects
over one memory, so an expand is kept where that shows: an in-place op on x or on any view of it (a write, or
`t_()` / `transpose_()`, which change one object's strides only), or the expand returned to the caller. Sizes that
are symbolic or graph values are left alone.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from .aliasing import escapes, written_in_place
from .canonicalize import tensor_of

_EXPAND_FNS = (torch.Tensor.expand,)


def _sizes(node: fx.Node) -> Any:
    """The sizes an expand node asks for (`x.expand(a, b)` or `x.expand((a, b))`), or None when not an expand."""
    if node.op == "call_method" and node.target == "expand":
        pass
    elif not (node.op == "call_function" and node.target in _EXPAND_FNS):
        return None
    if len(node.args) < 2 or set(node.kwargs) - {"implicit"} or node.kwargs.get("implicit"):
        return None
    sizes = node.args[1:]
    if len(sizes) == 1 and isinstance(sizes[0], (list, tuple, torch.Size)):
        sizes = tuple(sizes[0])
    return tuple(sizes)


def is_identity_expand(node: fx.Node) -> bool:
    sizes = _sizes(node)
    if sizes is None or not isinstance(node.args[0], fx.Node):
        return False
    # x and the expand are two tensor objects over one memory: an in-place op on either (a write, or `t_()` /
    # `transpose_()` changing its strides) or the caller receiving the expand would tell them apart
    if written_in_place(node.args[0]) or escapes(node):
        return False
    t = tensor_of(node.args[0])
    if t is None or len(sizes) != t.dim():
        return False
    for want, have in zip(sizes, t.shape):
        if type(want) is not int or type(have) is not int or want not in (-1, have):
            return False
    return True


def drop_identity_expands(gm: fx.GraphModule) -> bool:
    """Replace every expand to its input's own shape by its input; True when the graph changed."""
    changed = False
    for node in list(gm.graph.nodes):
        if is_identity_expand(node):
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
            changed = True
    if changed:
        gm.recompile()
    return changed
