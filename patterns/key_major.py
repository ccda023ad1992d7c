"""Key-major scores: `sT = k @ qᵀ` normalised over the key axis with `softmax(dim=-2)`, read query-major.

Code that lays the scores out keys by queries (`[..., Nk, Nq]`) normalises each column:

    sT = torch.matmul(k, q.transpose(-1, -2)) * scale           # [B, H, Nk, Nq]
    pT = torch.softmax(sT.masked_fill(maskT, -inf), dim=-2)
    y = torch.matmul(pT.transpose(-1, -2), v)

Everything here is elementwise but the two products and the softmax, and each commutes with swapping the last
two axes: (A · B)ᵀ = Bᵀ · Aᵀ holds element by element (the same dot products; only the GEMM's summation order may
differ), an elementwise op of transposed operands is the transpose of the op, and softmax over dim -2 of x is
the transpose of softmax over dim -1 of xᵀ. So the graph becomes

    s = torch.matmul(q, k.transpose(-1, -2)) * scale             # = sTᵀ, [B, H, Nq, Nk]
    p = torch.softmax(s.masked_fill(maskT.transpose(-1, -2), -inf), dim=-1)
    y = torch.matmul(p, v)                                        # pTᵀ · v with pTᵀ = p: the transposes cancel

with every tensor operand of the elementwise steps transposed alike (a 1-D operand, which broadcasts along the
last axis, becomes a column), each new node placed where its original was (so it reads its operands when eager
did). The edit is made where the softmax is a plain one over dim -2 of a tensor of two or more dims, every step
back to a two-operand product is elementwise and read by the next one alone, the probabilities reach a P·V
product (`pTᵀ @ v`, or `v_t @ pT`, which transposed_pv.py reads) through casts or copies and nothing else reads
them, and all of it runs in one grad mode / autocast state. It
costs nothing when no site is rewritten (views and a softmax over contiguous rows), so it stays (the pass puts
the whole graph back when it rewrites nothing).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F

from .canonicalize import is_inplace, kind, plain_softmax_args, tensor_of
from .emit import set_example_value
from .tentative import LazyRegions, commit, fold_each, rebuild_steps, score_chain, swaps_last_two



def _fold(gm: fx.GraphModule, sm: fx.Node, regions: LazyRegions) -> bool:
    graph = gm.graph
    plain = plain_softmax_args(sm)
    if plain is None:
        return False
    x, dim, dtype = plain
    t = tensor_of(x)
    if t is None or t.dim() < 2 or dim != t.dim() - 2 or not isinstance(x, fx.Node):
        return False
    found = score_chain(x, lambda n: kind(n) == "matmul" and len(n.args) == 2 and not n.kwargs)
    if found is None:
        return False
    steps, product = found
    a, b = product.args
    ta, tb = tensor_of(a), tensor_of(b)
    if ta is None or tb is None or ta.dim() < 2 or tb.dim() < 2 or tensor_of(product).shape != t.shape:
        return False
    if len({regions.of(n) for n in [product, sm, *steps]}) != 1:
        return False
    if not sm.users or not all(_feeds_p_v(u, sm) for u in sm.users):
        return False  # not attention, or the probabilities are read (or written) elsewhere: left as written

    made: list = []

    def new(op: str, target: Any, *args: Any, **kwargs: Any) -> fx.Node:
        n = graph.create_node(op, target, args, kwargs)
        made.append(n)
        return n

    def transposed(arg: Any) -> Any:
        ta = tensor_of(arg) if isinstance(arg, fx.Node) else None
        if ta is None or ta.dim() == 0:
            return arg
        if ta.dim() == 1:
            return new("call_method", "unsqueeze", arg, -1)
        return new("call_method", "transpose", arg, -2, -1)

    # Each new node reads its operands where its original did: a write into q, k or a mask between the product and
    # the softmax is seen by the new graph exactly when eager saw it.
    with graph.inserting_before(product):
        cur = new("call_function", torch.matmul, transposed(b), transposed(a))
    cur = rebuild_steps(graph, steps, product, cur, transposed, new)
    with graph.inserting_before(sm):
        soft = new("call_function", F.softmax, cur, -1, **({"dtype": dtype} if dtype is not None else {}))
        out = new("call_method", "transpose", soft, -2, -1)
    if not commit(graph, made, sm, dead=(*steps, product)):
        return False
    _cancel_transposes(graph, out, soft)
    return True


def _feeds_p_v(user: fx.Node, sm: fx.Node) -> bool:
    """user of the key-major probabilities pT leads, through casts or copies, to `pTᵀ @ v` or to `v_t @ pT`."""
    prev, cur = sm, user
    for _ in range(4):
        if kind(cur) == "matmul" and len(cur.args) == 2 and cur.args[1] is prev:
            return True  # v_t @ pT
        if swaps_last_two(cur) and cur.args[0] is prev and len(cur.users) == 1:
            prev, nxt = cur, next(iter(cur.users))
            for _ in range(3):  # pTᵀ, then casts or copies (`.contiguous()`), then the product
                if kind(nxt) == "matmul" and len(nxt.args) == 2:
                    return nxt.args[0] is prev
                if kind(nxt) not in ("cast", "identity") or len(nxt.users) != 1 or nxt.args[0] is not prev:
                    return False
                prev, nxt = nxt, next(iter(nxt.users))
            return False
        if kind(cur) not in ("cast", "identity") or len(cur.users) != 1 or cur.args[0] is not prev:
            return False
        prev, cur = cur, next(iter(cur.users))
    return False


def _cancel_transposes(graph: fx.Graph, out: fx.Node, soft: fx.Node) -> None:
    """pTᵀ: where `out` (softᵀ) reaches a transpose of its last two axes through casts or copies alone, that
    transpose reads the same steps taken on soft."""
    for user in list(out.users):
        steps, cur = [], user
        while kind(cur) in ("cast", "identity") and len(cur.users) == 1 and not cur.kwargs \
                and not is_inplace(cur) and cur.args[0] is (steps[-1] if steps else out):
            steps.append(cur)
            cur = next(iter(cur.users))
        if not (swaps_last_two(cur) and cur.args[0] is (steps[-1] if steps else out)):
            continue
        with graph.inserting_before(cur), torch.set_grad_enabled(bool(tensor_of(cur).requires_grad)):
            new = soft
            for step in steps:
                new = graph.create_node(step.op, step.target, (new, *step.args[1:]), dict(step.kwargs))
                set_example_value(new)
        cur.replace_all_uses_with(new)
        for n in [cur, *reversed(steps)]:
            graph.erase_node(n)
    if not out.users:
        graph.erase_node(out)


def fold_key_major_scores(gm: fx.GraphModule) -> bool:
    """Apply the edit of the module docstring wherever it is exact; True when any was made."""
    return fold_each(gm, "softmax", _fold)
