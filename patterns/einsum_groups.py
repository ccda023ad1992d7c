"""An einsum whose left operand has head letters the right one lacks, read with those letters broadcast.

Multi-query and grouped-query code written with einsum leaves the shared keys and values without the query's extra
head letters:

    s = torch.einsum("bhid,bjd->bhij", q, k)                  # one K for every head h
    s = torch.einsum("bqhgd,bkhd->bhgqk", q, k)               # K per kv head h, shared by the group g
    o = torch.einsum("bhgqk,bkhd->bqhgd", p, v)

The site finder reads a contraction with one row letter; h (g) is a second. torch.einsum broadcasts a letter of
size 1, so the edit

    s = torch.einsum("bhid,bhjd->bhij", q, k.unsqueeze(1))

gives the same dot products of the same terms (at most the GEMM's summation order changes), with h now a batch
letter whose size-1 operand is a broadcast, as `k[:, None]` is in matmul code. The row letter kept is the query's:
the output's second-to-last letter for the scores, the probabilities' second-to-last for P·V (whose left operand
comes from a softmax). It is tentative (tentative.py): put back where no rewrite takes it.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.fx as fx

from .canonicalize import PROB_STEPS, SCORE_STEPS, reaches_softmax, two_operand_einsum
from .tentative import Edit, LazyRegions, attempt_each, commit


def _broadcast(gm: fx.GraphModule, node: fx.Node, regions: LazyRegions) -> Optional[Edit]:
    parsed = two_operand_einsum(node)
    if parsed is None:
        return None
    x, y, z, a, b = parsed
    rows = [ch for ch in z if ch in x and ch not in y]
    if len(rows) < 2 or len(x) < 2:
        return None
    if reaches_softmax(a, PROB_STEPS, forward=False):  # P·V: the probabilities' rows
        keep = x[-2]
    elif reaches_softmax(node, SCORE_STEPS, forward=True):  # the scores: their rows
        keep = z[-2]
    else:  # no attention here: no edit to make and undo
        return None
    if keep not in rows:
        return None
    graph = gm.graph
    made, rhs, yy = [], b, y
    with graph.inserting_before(node):
        for ch in (c for c in z if c in rows and c != keep):
            # after the letters of y that come before ch in z (k[:, None] for "bhid,bjd->bhij")
            before = [i for i, c in enumerate(yy) if c in z and z.index(c) < z.index(ch)]
            pos = max(before) + 1 if before else 0
            rhs = graph.call_method("unsqueeze", (rhs, pos))
            made.append(rhs)
            yy = yy[:pos] + ch + yy[pos:]
        product = graph.call_function(torch.einsum, (f"{x},{yy}->{z}", a, rhs))
    made.append(product)
    if not commit(graph, made, node):
        return None
    eq = node.args[0]

    def rebuild(graph: fx.Graph) -> list:  # the einsum as written
        return [graph.call_function(torch.einsum, (eq, a, b))]

    return Edit(made, product, rebuild, inputs=[a, b])


def fold_einsum_groups(gm: fx.GraphModule) -> list[Edit]:
    """Apply the edit of the module docstring wherever its letters allow; the edits made."""
    return attempt_each(gm, "einsum", _broadcast)
