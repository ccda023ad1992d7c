"""P·V written with the operands swapped: `v_t @ pᵀ` for V kept as `[..., Dv, Nk]`, read as `(p @ v_tᵀ)ᵀ`.

Code that stores keys and values transposed (channels first, `[B, H, D, N]`, as convolutional or 1-D-sequence
models do) may apply the probabilities from the right:

    y = torch.matmul(v, p.transpose(-1, -2))                   # [B, H, Dv, Nq]

Element (d, i) of that product is the sum over keys j of v[d, j] · p[i, j], which is element (i, d) of
`p @ vᵀ`: the same dot product of the same terms, so the edit

    y = torch.matmul(p, v.transpose(-1, -2)).transpose(-1, -2).contiguous()

(contiguous: the layout the written product had, which a later `.view` may need) changes at most the rounding
(the GEMM's summation order). An einsum whose output puts V's own axis before the queries'
(`einsum("bts,bcs->bct", p, v)`, channels-first diffusion U-Nets) is the same product transposed: it becomes
`einsum("bts,bcs->btc", p, v).transpose(-1, -2).contiguous()`. The probabilities are then the left operand of a P·V
product, as the site finder reads them. The edit is made only where p comes from a softmax (through dropout,
casts or copies), the transpose swaps the last two axes and is read by the product alone, and all of it runs in
one grad mode / autocast state. It is tentative (tentative.py): put back where no rewrite takes it.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.fx as fx

from .canonicalize import PROB_STEPS, kind, reaches_softmax, tensor_of, two_operand_einsum
from .emit import set_example_value
from .tentative import Edit, LazyRegions, attempt_each, commit, swaps_last_two


def _swapped(gm: fx.GraphModule, node: fx.Node, regions: LazyRegions) -> Optional[Edit]:
    if len(node.args) != 2 or node.kwargs:
        return None
    v, pt = node.args
    if not (isinstance(v, fx.Node) and isinstance(pt, fx.Node)) or len(pt.users) != 1 or not swaps_last_two(pt):
        return None
    p = pt.args[0]
    tv, tp, tout = tensor_of(v), tensor_of(p), tensor_of(node)
    if tv is None or tp is None or tout is None or tv.dim() < 2 or tp.dim() < 2 or tv.dim() > tp.dim():
        return None
    if not _is_probs(p):
        return None
    if len({regions.of(n) for n in (p, pt, node)}) != 1:
        return None
    graph = gm.graph
    with graph.inserting_before(node):
        vt = graph.call_method("transpose", (v, -2, -1))
        product = graph.call_function(torch.matmul, (p, vt))
        t = graph.call_method("transpose", (product, -2, -1))
        out = graph.call_method("contiguous", (t,))  # the layout the written product had (a later .view needs it)
    made = [vt, product, t, out]
    if not commit(graph, made, node, dead=(pt,)):
        return None

    def rebuild(graph: fx.Graph) -> list:  # matmul(v, p.transpose(-2, -1))
        t = graph.call_method("transpose", (p, -2, -1))
        set_example_value(t)
        return [t, graph.call_function(torch.matmul, (v, t))]

    return Edit(made, product, rebuild, inputs=[v, p])


def _einsum_swapped(gm: fx.GraphModule, node: fx.Node, regions: LazyRegions) -> Optional[Edit]:
    parsed = two_operand_einsum(node)
    if parsed is None or len(parsed[2]) < 2:
        return None
    x, y, z, a, b = parsed
    eq = f"{x},{y}->{z}"
    p, v, sp, sv = (a, b, x, y) if _is_probs(a) else (b, a, y, x) if _is_probs(b) else (None,) * 4
    if p is None or len(p.users) != 1 or p is v:
        return None
    t, c = z[-1], z[-2]  # the written output: V's own axis c, then the queries' t
    if not (t in sp and t not in sv and c in sv and c not in sp):
        return None
    if len({regions.of(n) for n in (p, node)}) != 1:
        return None
    graph = gm.graph
    with graph.inserting_before(node):
        product = graph.call_function(torch.einsum, (f"{x},{y}->{z[:-2]}{t}{c}", a, b))
        tr = graph.call_method("transpose", (product, -2, -1))
        out = graph.call_method("contiguous", (tr,))
    made = [product, tr, out]
    if not commit(graph, made, node):
        return None

    def rebuild(graph: fx.Graph) -> list:  # the einsum as written (its letters without spaces)
        return [graph.call_function(torch.einsum, (eq, a, b))]

    return Edit(made, product, rebuild, inputs=[a, b])


def _is_probs(n: fx.Node) -> bool:  # a softmax, or one through dropout, casts or copies
    return reaches_softmax(n, PROB_STEPS, forward=False)


def fold_transposed_pv(gm: fx.GraphModule) -> list[Edit]:
    """Apply the edits of the module docstring wherever they are exact; the edits made."""
    return attempt_each(gm, ("matmul", "einsum"), _edit)


def _edit(gm: fx.GraphModule, node: fx.Node, regions: LazyRegions) -> Optional[Edit]:
    return (_swapped if kind(node) == "matmul" else _einsum_swapped)(gm, node, regions)
