"""Chains of views that give back their input's layout, read as that input.

The core ATen IR (`torch.export`'s `run_decompositions()`) writes a `matmul` of 4-d tensors as
`bmm(a.expand(shape).view(B*H, N, K), ...)`, each operand expanded to the broadcast shape first, and an einsum as
`bmm` between views and permutes that move a size-1 axis around (`bmm(...).view(B, N, 1, N).permute(0, 1, 3, 2)
.view(B, N, N)`). Where the operands already have that shape, as attention's scores, probabilities and values do,
such a chain returns a view of its input with the input's shape, strides and offset: the same elements at the same
addresses. Every walker that follows the scores or the probabilities to their products stops at an `expand` (a real
broadcast is another computation) or at a view it cannot read, so such graphs had no site.

Each view (expand, view, permute, transpose, unsqueeze, squeeze) whose result has the layout of a tensor it was
made from through views only is replaced by that tensor: the same values and the same gradient (a view's backward
is the inverse view), where every view of the chain and its source run under one grad mode (a view made under
`no_grad` stops the gradient the source would pass). The two are different tensor objects over one memory, so the
chain is kept where that shows:
an in-place op on the tensor or on any view of it (a write, or `t_()` / `transpose_()`, which change one object's
strides only), or the view returned to the caller. Sizes are compared as ints or as the same symbolic expression.
A chain of two views or more from a dense row-major tensor to a dense row-major result over the same elements is
one `.view` of it (static sizes): the einsum's detour through a size-1 axis becomes the batch regrouping the site
finder reads.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.fx as fx

from .aliasing import escapes, written_in_place
from .canonicalize import tensor_of
from .regions import Regions

_VIEW_METHODS = ("expand", "view", "permute", "transpose", "swapaxes", "swapdims", "unsqueeze", "squeeze")
_VIEW_FUNCTIONS = (torch.Tensor.expand, torch.Tensor.view, torch.permute, torch.transpose, torch.swapaxes,
                   torch.swapdims, torch.unsqueeze, torch.squeeze)


def _is_view(node: Any) -> bool:
    """`node` is one of the view ops above, of a tensor of the graph (no `implicit=` expand, no dtype view)."""
    if not isinstance(node, fx.Node) or not node.args or not isinstance(node.args[0], fx.Node):
        return False
    if node.op == "call_method":
        ok = node.target in _VIEW_METHODS
    else:
        ok = node.op == "call_function" and node.target in _VIEW_FUNCTIONS
    if not ok or node.kwargs.get("implicit"):
        return False
    t, src = tensor_of(node), tensor_of(node.args[0])
    return t is not None and src is not None and t.dtype == src.dtype


def _same(a: Any, b: Any) -> bool:
    if type(a) is int and type(b) is int:
        return a == b
    if isinstance(a, torch.SymInt) and isinstance(b, torch.SymInt):
        return a.node.expr == b.node.expr
    return False


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dim() == b.dim() and all(_same(x, y) for x, y in zip(a.shape, b.shape))
            and all(_same(x, y) for x, y in zip(a.stride(), b.stride()))
            and _same(a.storage_offset(), b.storage_offset()))


def _dense(t: torch.Tensor) -> bool:
    """Row-major and dense, by static sizes (a size-1 dim may have any stride)."""
    if not all(type(x) is int for x in (*t.shape, *t.stride())):
        return False
    want = 1
    for size, stride in reversed(list(zip(t.shape, t.stride()))):
        if size != 1 and stride != want:
            return False
        want *= size
    return True


def identity_source(node: fx.Node, state: Optional[Callable[[fx.Node], Any]] = None
                    ) -> Optional[tuple[fx.Node, bool]]:
    """(the tensor `node` is a view of through views only, whether `node` is a plain `.view` of it rather than the
    tensor itself), or None. The tensor itself where one of the chain has node's layout (the nearest); else the
    farthest one of at least two views back where both are dense row-major over the same elements, which is what
    the einsum's detours through a size-1 axis make. `state(n)`: the global state node n runs under (grad mode,
    inference mode: regions.Regions.of), the same for every node of the chain and its source."""
    if not _is_view(node):
        return None
    t = tensor_of(node)
    cur, found, chain = node.args[0], None, [node]
    for depth in range(16):
        src = tensor_of(cur)
        if src is None:
            break
        chain.append(cur)
        if state is not None and len({state(n) for n in chain}) > 1:
            break  # a view made under no_grad (or another global state): its gradient stops there, the source's not
        if _same_layout(t, src):  # (the walk over node's users last: it costs the most)
            return None if written_in_place(cur) or escapes(node) else (cur, False)
        if depth >= 1 and _dense(t) and _dense(src) and src.numel() == t.numel() \
                and _same(src.storage_offset(), t.storage_offset()):
            found = cur
        if not _is_view(cur):
            break
        cur = cur.args[0]
    if found is None or written_in_place(found) or escapes(node):
        return None
    return found, True


def drop_identity_views(gm: fx.GraphModule) -> bool:
    """Read every view chain that gives back its input's layout as that input, and one that is a plain `.view` of a
    dense tensor as that view; True when the graph changed."""
    from .emit import call  # noqa: PLC0415

    regions = Regions(gm)
    state = regions.of if regions.markers else None
    changed = False
    for node in list(gm.graph.nodes):
        found = identity_source(node, state)
        if found is None:
            continue
        src, as_view = found
        if as_view:
            with gm.graph.inserting_before(node):
                src = call(gm.graph, "view", src, tuple(tensor_of(node).shape), method=True)
            src.meta.update({k: v for k, v in node.meta.items() if k != "example_value"})
        node.replace_all_uses_with(src)
        gm.graph.erase_node(node)
        changed = True
    if changed:
        gm.recompile()
    return changed
