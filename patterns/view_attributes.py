"""Transposes spelled as attributes (`x.mT`, `x.T`, `x.mH`, `x.H`) or `x.t()`, read as `x.transpose(a, b)`.

Dynamo records an attribute read as `getattr(x, "mT")`, which `canonicalize.kind` cannot name: a walker that
follows views (layout.fold, the effect and alias analyses, the paged-cache reader) would stop there, so
`k.repeat_interleave(g, 1).mT` kept its repeat and a gathered cache lost its in-place read. Each such node is
replaced by the transpose it is, so every walker reads one spelling:
- `x.mT`, and `x.mH` of a real tensor (the conjugate of a real tensor is itself), for x of two dims or more:
  `x.transpose(-2, -1)`;
- `x.T`, `x.H` (real) and `x.t()` of a matrix: `x.transpose(0, 1)`. Other ranks are left alone (`.T` of more
  dims is deprecated and reverses every dim; of fewer it returns x).
Both spellings return the same view (shape, strides, storage), so values, gradients and aliasing are unchanged.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.fx as fx

from .canonicalize import tensor_of

_LAST_TWO = ("mT", "mH")
_MATRIX = ("T", "H")


def _dims(node: fx.Node) -> Optional[tuple[fx.Node, int, int]]:
    """(x, dim0, dim1) of the transpose `node` spells, or None."""
    if node.op == "call_function" and node.target is getattr and len(node.args) == 2 and not node.kwargs:
        x, name = node.args
    elif node.op == "call_method" and node.target == "t" and len(node.args) == 1 and not node.kwargs:
        x, name = node.args[0], "t"
    elif node.op == "call_function" and node.target is torch.t and len(node.args) == 1 and not node.kwargs:
        x, name = node.args[0], "t"
    else:
        return None
    t = tensor_of(x) if isinstance(x, fx.Node) else None
    if t is None or not isinstance(name, str):
        return None
    if name in ("mH", "H") and t.is_complex():
        return None  # a conjugate view, not a transpose
    if name in _LAST_TWO and t.dim() >= 2:
        return x, -2, -1
    if (name in _MATRIX or name == "t") and t.dim() == 2:
        return x, 0, 1
    return None


def spell_view_attributes(gm: fx.GraphModule) -> bool:
    """Replace every attribute-spelled transpose by `x.transpose(a, b)`; True when the graph changed."""
    changed = False
    for node in list(gm.graph.nodes):
        found = _dims(node)
        if found is None:
            continue
        x, a, b = found
        with gm.graph.inserting_before(node):
            twin = gm.graph.call_method("transpose", (x, a, b))
        twin.meta.update(node.meta)  # the same view: its example value and provenance hold
        node.replace_all_uses_with(twin)
        gm.graph.erase_node(node)
        changed = True
    if changed:
        gm.recompile()
    return changed
