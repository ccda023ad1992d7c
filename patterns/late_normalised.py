"""Softmax normalised after the P·V product: `(e @ v) / e.sum(-1, keepdim=True)`, read as `(e / e.sum(...)) @ v`.

Code that writes the softmax out by its formula may divide by the row sum after applying the weights (a flash-style
"normalise late" written in eager):

    e = torch.exp(s - s.amax(-1, keepdim=True))
    y = (e @ v) / e.sum(-1, keepdim=True)

Row i of `e @ v` is the sum over keys j of e[i, j] · v[j]; dividing it by the row's sum S[i] is the sum of
(e[i, j] / S[i]) · v[j]: the same terms, so the edit

    p = e / e.sum(-1, keepdim=True)
    y = p @ v

changes at most the rounding (where each division happens). p is then softmax(s) spelled by its formula, which
the site finder reads (canonicalize.exp_sum_of: only with the row max subtracted, where eager's exp cannot
overflow). The edit is made only where e is that exp, e is read by the product and the sum alone, the product and
the sum only by the division, the division broadcasts the sum over the product's last axis, and all of it runs in
one grad mode / autocast state. It is tentative (tentative.py): put back where no rewrite takes it.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.fx as fx

from .canonicalize import stable_exp_sum, tensor_of
from .emit import set_example_value
from .layout import contraction, identity
from .tentative import Edit, LazyRegions, attempt_each, commit


def _late(gm: fx.GraphModule, node: fx.Node, regions: LazyRegions) -> Optional[Edit]:
    if len(node.args) != 2 or node.kwargs:
        return None
    m, s = node.args
    if not (isinstance(m, fx.Node) and isinstance(s, fx.Node)) or len(m.users) != 1 or len(s.users) != 1:
        return None
    c = contraction(m)
    if c is None or c.spelling != "matmul" or len(m.args) != 2 or m.kwargs:
        return None
    e, v = m.args
    if c.lhs.node is not e or c.lhs.perm != identity(c.lhs.rank) or not isinstance(e, fx.Node):
        return None
    if set(e.users) != {m, s} or not stable_exp_sum(e, s):
        return None
    te, tm, ts, tout = tensor_of(e), tensor_of(m), tensor_of(s), tensor_of(node)
    if te is None or tm is None or ts is None or tout is None or tm.dim() != te.dim() or tm.dim() < 2:
        return None
    if len({regions.of(n) for n in (e, m, s, node)}) != 1:
        return None
    graph = gm.graph
    with graph.inserting_before(node):
        p = graph.call_method("div", (e, s))
        product = graph.call_function(torch.matmul, (p, v))
    made = [p, product]
    if not commit(graph, made, node, dead=(m,)):
        return None

    def rebuild(graph: fx.Graph) -> list:  # (e @ v) / s
        mm = graph.call_function(torch.matmul, (e, v))
        set_example_value(mm)
        return [mm, graph.call_method("div", (mm, s))]

    return Edit(made, product, rebuild, inputs=[e, v, s])


def fold_late_normalised(gm: fx.GraphModule) -> list[Edit]:
    """Apply the edit of the module docstring wherever it is exact; the edits made."""
    return attempt_each(gm, "div", _late)
