"""Single-query attention written without a query axis, read with one: scores `[..., Nk]` become `[..., 1, Nk]`.

Decoders that attend from one state per sequence (Luong / Bahdanau-style seq2seq, hand-written decode steps) often
drop the query axis altogether:

    s = torch.bmm(enc, h.unsqueeze(2)).squeeze(2)              # [B, Nk]: enc [B, Nk, D], h [B, D]
    p = torch.softmax(s.masked_fill(~keep, -inf), dim=1)
    y = torch.bmm(p.unsqueeze(1), enc).squeeze(1)              # [B, D]

    s = torch.einsum("bhd,bhkd->bhk", q, k) * scale            # [B, H, Nk]
    y = torch.einsum("bhk,bhkd->bhd", s.softmax(-1), v)

Every step between the two products is elementwise or the softmax over the last axis, and each commutes with
inserting a unit axis before the last one in every operand (broadcasting aligns axes from the right, so an
operand of any rank keeps its place; a 0-d one is left alone). The products gain that axis exactly:
`squeeze(A @ B, -1)` with `A @ B` of shape `[..., Nk, 1]` is `Bᵀ @ Aᵀ` of shape `[..., 1, Nk]` without the unit
axis (the same dot products; only the GEMM's summation order may differ); `squeeze(A @ B, -2)` of shape
`[..., 1, Nk]` is `A @ B` itself; an einsum gains a fresh letter on its query operand (the one without the output's
last letter) and before the output's last letter. At the other end `p.unsqueeze(-2) @ v` reads the new
probabilities, which are that unsqueeze's value, and an einsum over p gains the letter likewise and is squeezed
back. So the graph holds an ordinary `[..., 1, Nk]` attention, each new node placed where its original was.

The edit is made where the softmax is a plain one over the last axis of a tensor of two or more dims, every step
back to the product is elementwise and read by the next one alone, the probabilities reach the P·V product
through dropout, casts or copies and nothing else reads them, and all of it runs in one grad mode / autocast
state. It costs nothing when no site is rewritten (views and the same products), so it stays (the pass puts the
whole graph back when it rewrites nothing).
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.fx as fx
import torch.nn.functional as F

from .canonicalize import PROB_STEPS, is_inplace, kind, plain_softmax_args, tensor_of, \
    two_operand_einsum
from .tentative import LazyRegions, commit, fold_each, rebuild_steps, score_chain

_SQUEEZE = (torch.squeeze, torch.Tensor.squeeze, "squeeze")
_UNSQUEEZE = (torch.unsqueeze, torch.Tensor.unsqueeze, "unsqueeze")
_LETTERS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


def _fresh(*subscripts: str) -> str:
    """A subscript letter none of `subscripts` uses (einsum takes a-z and A-Z only)."""
    return next(c for c in _LETTERS if not any(c in s for s in subscripts))


def _squeezed_axis(node: fx.Node) -> Optional[int]:
    """The axis (normalised to >= 0 in the input) a functional `squeeze(x, dim)` with one int dim removes, if it
    is a unit axis; else None."""
    if node.op not in ("call_function", "call_method") or node.target not in _SQUEEZE or len(node.args) != 2 \
            or node.kwargs or not isinstance(node.args[1], int):
        return None
    t = tensor_of(node.args[0])
    if t is None or t.dim() == 0:
        return None
    d = node.args[1] % t.dim()
    return d if t.shape[d] == 1 else None


def _scores_product(graph: fx.Graph, node: fx.Node, rank: int, new) -> Optional[fx.Node]:
    """The scores product `node` (rank `rank`, keys last, no query axis) with a unit query axis before the keys,
    as new nodes inserted before it; None where it is not such a product."""
    axis = _squeezed_axis(node)
    if axis is not None:
        m = node.args[0]
        if not (isinstance(m, fx.Node) and kind(m) == "matmul" and len(m.args) == 2 and not m.kwargs
                and len(m.users) == 1):
            return None
        a, b = m.args
        ta, tb = tensor_of(a), tensor_of(b)
        if ta is None or tb is None or ta.dim() < 2 or tb.dim() < 2:
            return None
        if axis == rank:  # squeeze(A @ B, -1), A @ B [..., Nk, 1]: (A @ B)ᵀ = Bᵀ @ Aᵀ, where A @ B was taken (its
            # operands as eager read them, in its grad mode and autocast state)
            with graph.inserting_before(m):
                bt = new("call_method", "transpose", b, -2, -1)
                at = new("call_method", "transpose", a, -2, -1)
                return new("call_function", torch.matmul, bt, at)
        if axis == rank - 1:  # squeeze(A @ B, -2), A @ B [..., 1, Nk]: the product itself
            return m
        return None
    parts = two_operand_einsum(node)
    if parts is None or len(node.users) != 1:
        return None
    x, y, z, a, b = parts
    key = z[-1]
    if (key in x) == (key in y):
        return None
    if key in x:  # the query operand is the one without the key letter
        x, y, a, b = y, x, b, a
    if any(c in z and c not in y for c in x):
        return None  # the query operand has an axis of its own in the output: a query axis already
    u = _fresh(x, y, z)
    with graph.inserting_before(node):
        a1 = new("call_method", "unsqueeze", a, -1)
        return new("call_function", torch.einsum, f"{x}{u},{y}->{z[:-1]}{u}{key}", a1, b)


def _fold(gm: fx.GraphModule, sm: fx.Node, regions: LazyRegions) -> bool:
    graph = gm.graph
    plain = plain_softmax_args(sm)
    if plain is None:
        return False
    x, dim, dtype = plain
    t = tensor_of(x)
    if t is None or t.dim() < 2 or dim != t.dim() - 1 or not isinstance(x, fx.Node):
        return False
    rank = t.dim()
    found = score_chain(x, _is_product)
    if found is None:
        return False
    steps, product = found
    if tensor_of(product) is None or tensor_of(product).shape != t.shape:
        return False
    # the probabilities' way to P·V: dropout, casts or copies, each read by the next alone
    after: list = []
    end = sm
    for _ in range(6):
        if len(end.users) != 1:
            return False
        user = next(iter(end.users))
        if kind(user) in PROB_STEPS and not is_inplace(user) and user.args and user.args[0] is end \
                and user.kwargs.get("out") is None:
            after.append(user)
            end = user
            continue
        break
    else:
        return False
    user = next(iter(end.users))
    pv_unsqueeze = (user.op in ("call_function", "call_method") and user.target in _UNSQUEEZE
                    and len(user.args) == 2 and not user.kwargs and user.args[0] is end
                    and isinstance(user.args[1], int) and user.args[1] % (rank + 1) == rank - 1
                    and len(user.users) > 0 and all(kind(m) == "matmul" and len(m.args) == 2 and m.args[0] is user
                                                    and m.args[1] is not user for m in user.users))
    pv_einsum = None
    if not pv_unsqueeze:
        parts = two_operand_einsum(user)
        if parts is None or parts[3] is not end or parts[4] is end:
            return False
        px, vy, z, _, v = parts
        if px[-1] in z or px[-1] not in vy or z[-1] in px or any(c in z and c not in vy for c in px):
            return False  # p's last letter is the key axis, summed against V; the output's last is V's own; no
            # axis of p's own (a query axis) reaches the output
        pv_einsum = (px, vy, z, v)
    inner = [product.args[0]] if _squeezed_axis(product) is not None else []  # the product a squeeze reads
    if len({regions.of(n) for n in [*inner, product, sm, *steps, *after, user]}) != 1:
        return False

    made: list = []

    def new(op: str, target: Any, *args: Any, **kwargs: Any) -> fx.Node:
        n = graph.create_node(op, target, args, kwargs)
        made.append(n)
        return n

    def widened(arg: Any) -> Any:
        ta = tensor_of(arg) if isinstance(arg, fx.Node) else None
        if ta is None or ta.dim() == 0:
            return arg
        return new("call_method", "unsqueeze", arg, -2)

    # Each new node reads its operands where its original did: a write into q, k or a mask between the product and
    # the softmax is seen by the new graph exactly when eager saw it.
    cur = _scores_product(graph, product, rank, new)
    if cur is None:
        for n in reversed(made):
            graph.erase_node(n)
        return False
    cur = rebuild_steps(graph, steps, product, cur, widened, new)
    with graph.inserting_before(sm):
        cur = new("call_function", F.softmax, cur, -1, **({"dtype": dtype} if dtype is not None else {}))
    for step in after:
        with graph.inserting_before(step):
            cur = new(step.op, step.target, cur, *step.args[1:], **dict(step.kwargs))
    if pv_einsum is None:  # p.unsqueeze(-2) is the new probabilities' value
        if not commit(graph, made, user, dead=(*reversed(after), sm, *steps, product)):
            return False
        return True
    px, vy, z, v = pv_einsum
    u = _fresh(px, vy, z)
    with graph.inserting_before(user):
        o = new("call_function", torch.einsum, f"{px[:-1]}{u}{px[-1]},{vy}->{z[:-1]}{u}{z[-1]}", cur, v)
        new("call_method", "squeeze", o, -2)
    return commit(graph, made, user, dead=(*reversed(after), sm, *steps, product))


def _is_product(n: fx.Node) -> bool:
    return _squeezed_axis(n) is not None or kind(n) == "einsum"


def fold_query_axis(gm: fx.GraphModule) -> bool:
    """Apply the edit of the module docstring wherever it is exact; True when any was made."""
    return fold_each(gm, "softmax", _fold)
