"""Query rows folded into one axis for a batched product, then split back: read as a 4-D product.

Multi-query attention written for `bmm` (GPTBigCode / StarCoder-era code) folds the heads into the query rows,
so that one `[B, D, Nk]` key tensor serves every head, and views the scores back to four dims for the mask:

    s = torch.baddbmm(zeros, q.reshape(B, N·H, D), kᵀ, beta=1, alpha=scale).view(B, N, H, Nk)
    p = torch.where(mask, s, min).softmax(-1)
    o = torch.bmm(p.view(B, N·H, Nk), v)                      # v [B, Nk, Dv]

Row r of a batched product depends on row r of its left operand only, so splitting the rows of the result
is splitting the rows of that operand, and the right operand broadcasts over the new axis:

    bmm(x, y).view(B, a, b, Nk)       ==  matmul(x.reshape(B, a, b, D), y.unsqueeze(1))
    bmm(p.view(B, a·b, Nk), v)        ==  matmul(p, v.unsqueeze(1)).reshape(B, a·b, Dv)

Each element is the same dot product of the same D (or Nk) terms; only the GEMM's blocking may differ, so a
result differs by rounding at most. The 4-D form is the broadcast-matmul spelling the site finder reads (the
key tensor shared by all heads is a broadcast K). The edit is made only where it is exact and useful:
- the product is 3-D by 3-D (`bmm`, `matmul`, or `baddbmm` whose added input is ignored (`beta=0`) or made by
  `zeros` / `zeros_like` / `new_zeros`, so that adding it changes no score), and the view splits its rows
  only (batch and key sizes provably kept, the row count the product of the two new sizes);
- between product and view only scalings by numbers, each read by the next step alone;
- the split scores reach a softmax through single-reader elementwise steps, and the merged probabilities come
  from a softmax through dropout, casts or copies: attention, and nowhere else in a model;
- every node of the edit runs in the same grad mode / autocast state.

The edits are tentative (tentative.py): a 4-D product that no rewrite took is put back as a 3-D product.
`matmul` broadcasts the shared operand by copying it along the new axis, which for the multi-query form is a copy of
K (or V) per query token; only the fused op reads it without that copy.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.fx as fx

from .canonicalize import (PROB_STEPS, SCORE_STEPS, arg, comes_before, is_finite_number, is_inplace, kind,
                           reaches_softmax, tensor_of)
from .emit import set_example_value, size_arg
from .shapes import known_eq
from .tentative import Edit, LazyRegions, attempt, commit

_ZEROS = {torch.zeros, torch.zeros_like}


def _sizes(view: fx.Node) -> Optional[list]:
    """The size arguments of `x.view(*sizes)`, `x.view(sizes)` or `torch.reshape(x, sizes)`."""
    rest = list(view.args[1:]) or [view.kwargs.get("shape", view.kwargs.get("size"))]
    if len(rest) == 1 and isinstance(rest[0], (tuple, list)):
        rest = list(rest[0])
    if any(r is None for r in rest):
        return None
    return rest


def _is_zeros(node: Any) -> bool:
    if not isinstance(node, fx.Node) or node.op not in ("call_function", "call_method") or "out" in node.kwargs:
        return False  # (zeros(..., out=buf) is buf, which other nodes may write)
    return node.target in _ZEROS or node.target == "new_zeros"


def _product(node: fx.Node) -> Optional[tuple[fx.Node, fx.Node, float]]:
    """(x, y, alpha) for a 3-D by 3-D batched product whose value is alpha · (x @ y) exactly, or None."""
    k = kind(node)
    if k == "matmul" and len(node.args) == 2 and not node.kwargs:
        x, y, alpha = node.args[0], node.args[1], 1.0
    elif k == "baddbmm":
        x, y = arg(node, 1, "batch1"), arg(node, 2, "batch2")
        beta, alpha = node.kwargs.get("beta", 1), node.kwargs.get("alpha", 1)
        if not (is_finite_number(beta) and is_finite_number(alpha)) or isinstance(beta, bool) or isinstance(alpha, bool):
            return None
        if beta != 0 and not (_is_zeros(node.args[0]) and len(node.args[0].users) == 1):
            return None  # (a zeros tensor read elsewhere may be written before the product: not provably zeros)
        added = tensor_of(node.args[0])
        if added is None or added.dtype != tensor_of(node).dtype:  # (a wider zeros would promote the result)
            return None
        alpha = float(alpha)
    else:
        return None
    tx, ty, tout = tensor_of(x), tensor_of(y), tensor_of(node)
    if tx is None or ty is None or tout is None or tx.dim() != 3 or ty.dim() != 3 or tout.dim() != 3:
        return None
    if not (tx.dtype.is_floating_point and ty.dtype == tx.dtype and tout.dtype == tx.dtype):
        return None
    return x, y, alpha


def _splits_rows(whole: torch.Tensor, split: torch.Tensor) -> bool:
    """split is whole [B, a·b, C] viewed [B, a, b, C]."""
    return (whole.dim() == 3 and split.dim() == 4 and known_eq(whole.shape[0], split.shape[0])
            and known_eq(whole.shape[1], split.shape[1] * split.shape[2]) and known_eq(whole.shape[2], split.shape[3]))


def _split_scores(gm: fx.GraphModule, view: fx.Node, regions: LazyRegions) -> Optional[Edit]:
    graph = gm.graph
    t_view, sizes = tensor_of(view), _sizes(view)
    if t_view is None or t_view.dim() != 4 or sizes is None or len(sizes) != 4:
        return None
    steps: list = []
    cur = view.args[0]
    for _ in range(4):  # numbers that scale the product before the view
        if not isinstance(cur, fx.Node) or len(cur.users) != 1 or is_inplace(cur):
            return None
        if kind(cur) in ("mul", "div") and len(cur.args) == 2 and not cur.kwargs and cur.args[0] is not cur.args[1]:
            numbers = [a for a in cur.args if is_finite_number(a) and not isinstance(a, bool)]
            chain = [a for a in cur.args if isinstance(a, fx.Node)]
            if len(numbers) != 1 or len(chain) != 1 or (kind(cur) == "div" and cur.args[0] is not chain[0]):
                return None
            steps.append(cur)
            cur = chain[0]
            continue
        break
    found = _product(cur) if isinstance(cur, fx.Node) else None
    if found is None:
        return None
    x, y, alpha = found
    product = cur
    tx, ty, tp = tensor_of(x), tensor_of(y), tensor_of(product)
    if not _splits_rows(tp, t_view) or type(tx.shape[2]) is not int:
        return None
    if not reaches_softmax(view, SCORE_STEPS, forward=True):
        return None
    if len({regions.of(n) for n in [product, view, *steps]}) != 1:
        return None
    # The 4-D product reads x and y where the product did (a write into them before the view must not be seen),
    # so every size it takes from the view must exist by then.
    if any(isinstance(a, fx.Node) and not comes_before(graph, a, product) for a in sizes[:3]):
        return None
    made: list = []
    with graph.inserting_before(product):
        x4 = graph.call_method("reshape", (x, *sizes[:3], tx.shape[2]))
        y4 = graph.call_method("unsqueeze", (y, 1))
        cur = graph.call_function(torch.matmul, (x4, y4))
        made += [x4, y4, cur]
        if alpha != 1.0:
            cur = graph.call_function(torch.mul, (cur, alpha))
            made.append(cur)
        for step in reversed(steps):  # the same scalings, in the same order, on the 4-D product
            args = [cur if isinstance(a, fx.Node) else a for a in step.args]
            cur = graph.create_node(step.op, step.target, tuple(args), {})
            made.append(cur)
    if not commit(graph, made, view, dead=(*steps, product)):
        return None
    x4, y4, product4, scalings = made[0], made[1], made[2], made[3:]

    def rebuild(graph: fx.Graph) -> list:  # matmul(x, y) [* alpha] [scalings], viewed to the split sizes
        new = [graph.call_function(torch.matmul, (x, y))]  # (matmul: the batch may broadcast)
        for step in scalings:
            args = [new[-1] if isinstance(a, fx.Node) and a in made else a for a in step.args]
            new.append(graph.create_node(step.op, step.target, tuple(args), dict(step.kwargs)))
        for n in new:
            set_example_value(n)
        new.append(graph.call_method("view", (new[-1], *x4.args[1:4], size_arg(graph, y, 2))))
        return new

    return Edit(made, product4, rebuild, inputs=[x, y])


def _merge_probs(gm: fx.GraphModule, pv: fx.Node, regions: LazyRegions) -> Optional[Edit]:
    graph = gm.graph
    found = _product(pv) if kind(pv) == "matmul" else None
    if found is None:
        return None
    merged, v, _ = found
    if kind(merged) != "reshape" or is_inplace(merged) or not isinstance(merged.args[0], fx.Node):
        return None
    p4, sizes = merged.args[0], _sizes(merged)
    tp4, tm, tv = tensor_of(p4), tensor_of(merged), tensor_of(v)
    if tp4 is None or sizes is None or len(sizes) != 3 or not _splits_rows(tm, tp4) or type(tv.shape[2]) is not int:
        return None
    if not (known_eq(tv.shape[0], tm.shape[0]) and known_eq(tv.shape[1], tm.shape[2])):
        return None
    if not (kind(p4) == "softmax" or reaches_softmax(p4, PROB_STEPS, forward=False)):
        return None
    if any(is_inplace(u) for u in p4.users):  # the product now reads p4 at its own place, not at the view's
        return None
    if len({regions.of(n) for n in (p4, merged, pv)}) != 1:
        return None
    with graph.inserting_before(pv):
        v4 = graph.call_method("unsqueeze", (v, 1))
        o4 = graph.call_function(torch.matmul, (p4, v4))
        o3 = graph.call_method("reshape", (o4, sizes[0], sizes[1], tv.shape[2]))
    if not commit(graph, [v4, o4, o3], pv):
        return None
    if not merged.users:
        graph.erase_node(merged)

    def rebuild(graph: fx.Graph) -> list:  # matmul(p4.reshape(s0, s1, Nk), v)
        m = graph.call_method("reshape", (p4, o3.args[1], o3.args[2], size_arg(graph, p4, 3)))
        set_example_value(m)
        return [m, graph.call_function(torch.matmul, (m, v))]

    return Edit([v4, o4, o3], o4, rebuild, inputs=[p4, v])


def fold_split_rows(gm: fx.GraphModule) -> list[Edit]:
    """Apply both edits of the module docstring wherever they are exact; the edits made."""
    regions = LazyRegions(gm)
    edits: list[Edit] = []
    for node in list(gm.graph.nodes):
        if getattr(node, "_erased", False):  # removed by an earlier edit
            continue
        k = kind(node)
        edit = None
        if k == "reshape" and not is_inplace(node):
            t = tensor_of(node)
            if t is None or t.dim() != 4:
                continue
            edit = attempt(_split_scores, gm, node, regions)
        elif k == "matmul":
            edit = attempt(_merge_probs, gm, node, regions)
        if edit is not None:
            edits.append(edit)
    return edits
