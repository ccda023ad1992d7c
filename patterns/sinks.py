"""Attention sinks spelled as a column of the scores: GPT-OSS's learned per-head sink logit.

    combined = cat([scores, sink.reshape(1, H, 1, 1).expand(B, H, Nq, 1)], dim=-1)
    combined = combined - combined.max(-1, keepdim=True).values      # optional: softmax is shift-invariant
    probs = softmax(combined, -1)[..., :-1]                           # the sink column dropped
    out = probs @ v

is softmax over the keys with exp(sink_h) added to each row's denominator, which is the op's `sinks`
argument. The row-max shift changes nothing (softmax(x - c) = softmax(x) for any c per row, and its
gradient through c is 0); with the sink column in the row the max is finite, so no row is NaN.

A sink column is recognized only when it provably holds one value per head: a tensor of H elements
reshaped (order-preserving views only) to [1, H, 1, 1] (or [H, 1, 1]) and expanded along batch and
queries, or a column made of zeros (softmax1, "quiet" attention: a logit of 0 for every head), concatenated
after (or before) the keys of 4-d scores [B, H, Nq, Nk], and only that column dropped.
StreamingLLM-style sink *tokens* are keys and values concatenated before the others: ordinary
attention, nothing to do here.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.fx as fx

from .aliasing import op_name, written_in_place
from .emit import example_value
from .shapes import known_eq, known_one

_VIEW_METHODS = ("reshape", "view", "unsqueeze")
_VIEW_FUNCTIONS = (torch.reshape, torch.unsqueeze)
_CAST_METHODS = ("float", "to", "half", "bfloat16", "type_as")


@dataclass
class SinkColumn:
    scores: fx.Node  # the [B, H, Nq, Nk] scores before the cat
    head_logits: fx.Node  # the tensor of H elements, in head order once flattened; or the zero column itself
    drop: fx.Node  # probs[..., :-1]
    nodes: list = field(default_factory=list)  # cat, shift and column nodes the rewrite makes dead
    casts: tuple = ()  # dtypes the expanded column was cast to, innermost first: applied to the logits instead
    zero: bool = False  # a column of zeros [B, H, Nq, 1] ("softmax1"): the logits are its [0, :, 0, 0]


_ZERO_METHODS = ("new_zeros", "new_full")
_ZERO_FUNCTIONS = (torch.zeros, torch.zeros_like, torch.full, torch.full_like)


def _zero_column(col: Any) -> bool:
    """`col` is a tensor made to hold 0 everywhere (`x.new_zeros(...)`, `torch.zeros(...)`, `torch.full(..., 0)`):
    a sink logit of 0 for every head (softmax1, "quiet" attention: 1 added to each row's denominator)."""
    from .canonicalize import arg, constant_value  # noqa: PLC0415

    if not isinstance(col, fx.Node) or not col.args or written_in_place(col):  # `z[1] = 5.0` holds no longer 0
        return False
    if col.op == "call_method" and col.target in _ZERO_METHODS:
        return col.target == "new_zeros" or constant_value(arg(col, 2, "fill_value")) == 0
    if col.op == "call_function" and col.target in _ZERO_FUNCTIONS:
        if col.target in (torch.zeros, torch.zeros_like):
            return True
        return constant_value(arg(col, 1, "fill_value")) == 0
    return False


def _tensor(n: Any) -> Optional[torch.Tensor]:
    v = example_value(n) if isinstance(n, fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


def _is_cat(n: Any) -> bool:
    return isinstance(n, fx.Node) and n.op == "call_function" and n.target in (torch.cat, torch.concat,
                                                                              torch.concatenate)


def _cat_parts(n: fx.Node) -> Optional[tuple[Any, Any]]:
    parts = n.args[0] if n.args else n.kwargs.get("tensors")
    dim = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim", n.kwargs.get("axis", 0))
    t = _tensor(n)
    if t is None or not isinstance(parts, (list, tuple)) or len(parts) != 2 or not isinstance(dim, int):
        return None
    if dim % t.dim() != t.dim() - 1:
        return None
    return parts[0], parts[1]


def _is_cast(n: Any) -> bool:
    """A floating-point dtype (or device) conversion that keeps the shape: elementwise, so it commutes
    with views and expands."""
    if not (isinstance(n, fx.Node) and n.op == "call_method" and n.target in _CAST_METHODS and n.args):
        return False
    t, src = _tensor(n), _tensor(n.args[0])
    return t is not None and src is not None and t.is_floating_point() and src.is_floating_point() \
        and tuple(t.shape) == tuple(src.shape)


def _head_logits(col: Any, shape: tuple) -> Optional[tuple[fx.Node, list, tuple]]:
    """(the H-element tensor, the column's nodes, the casts to apply to it) when `col` is it viewed as
    [1, H, 1, 1] and expanded to [B, H, Nq, 1]; None otherwise. A cast below the views is the logits
    themselves (eager rounds them there); casts of the expanded column move to the logits."""
    t = _tensor(col)
    b, h, nq = shape[0], shape[1], shape[2]
    if t is None or t.dim() != 4 or not (known_eq(t.shape[0], b) and known_eq(t.shape[1], h)
                                         and known_eq(t.shape[2], nq) and known_one(t.shape[3])):
        return None
    nodes, cur, casts = [], col, []
    if _zero_column(col) and t.is_floating_point():
        return col, [], ()
    while _is_cast(cur):
        casts.insert(0, _tensor(cur).dtype)  # each rounds: all are kept, in order
        nodes.append(cur)
        cur = cur.args[0]
    if isinstance(cur, fx.Node) and cur.op == "call_method" and cur.target == "expand":
        nodes.append(cur)
        cur = cur.args[0]
    pre = _tensor(cur)
    if pre is None:
        return None
    padded = (1,) * (4 - pre.dim()) + tuple(pre.shape) if pre.dim() <= 4 else None
    if padded is None or not (known_one(padded[0]) and known_eq(padded[1], h) and known_one(padded[2])
                              and known_one(padded[3])):
        return None  # not one value per head, constant along batch and queries
    if not known_eq(pre.numel(), h):
        return None
    # Order-preserving views only, down to the logits themselves (a cast is where they stop).
    while isinstance(cur, fx.Node) and cur.op in ("call_method", "call_function") and (
            (cur.op == "call_method" and cur.target in _VIEW_METHODS)
            or (cur.op == "call_function" and cur.target in _VIEW_FUNCTIONS)):
        src = cur.args[0]
        st = _tensor(src)
        if st is None or not known_eq(st.numel(), h) or not st.is_floating_point():
            break
        nodes.append(cur)
        cur = src
    ct = _tensor(cur)
    if ct is None or not ct.is_floating_point():
        return None
    return cur, nodes, tuple(casts)


_ATEN_SLICE = torch.ops.aten.slice.Tensor


def _last_dim_slice(n: fx.Node, probs: torch.Tensor) -> Optional[slice]:
    """The slice `n` takes of `probs` along its last dim when it takes all of every other dim: probs[..., a:b]
    (or with explicit leading full slices), or `aten.slice(probs, -1, a, b)` as torch.export writes it."""
    if n.op != "call_function" or not n.args or n.args[0] is None:
        return None
    if n.target is _ATEN_SLICE:
        if n.kwargs or len(n.args) < 2:
            return None
        dim, start, stop, step = (tuple(n.args[1:]) + (None, None, 1))[:4]
        if not isinstance(dim, int) or dim % probs.dim() != probs.dim() - 1:
            return None
        to_end = stop is None or (isinstance(stop, int) and stop >= 2 ** 62)  # aten's "to the end"
        return slice(None if start == 0 else start, None if to_end else stop, step)
    if n.target is not operator.getitem or len(n.args) != 2:
        return None
    idx = n.args[1] if isinstance(n.args[1], tuple) else (n.args[1],)
    if idx and idx[0] is Ellipsis:
        lead, last = idx[1:-1], idx[-1] if len(idx) > 1 else None
    else:
        lead, last = idx[:-1], idx[-1] if idx else None
        if len(idx) != probs.dim():
            return None
    full = slice(None, None, None)
    if any(x != full for x in lead) or not isinstance(last, slice):
        return None
    return last


def _drops_sink_column(n: fx.Node, probs: torch.Tensor, first: bool) -> bool:
    """n is probs[..., :-1] (or [..., :Nk]); with `first`, probs[..., 1:] (_last_dim_slice's spellings)."""
    last = _last_dim_slice(n, probs)
    if last is None or last.step not in (None, 1):
        return False
    nk1 = probs.shape[-1]
    if first:
        return last.start == 1 and (last.stop is None or (isinstance(last.stop, int) and known_eq(last.stop, nk1)))
    if last.start not in (None, 0):
        return False
    stop = last.stop
    return isinstance(stop, int) and (stop == -1 or known_eq(stop, nk1 - 1))


def _shift_of(x: fx.Node) -> Optional[tuple[fx.Node, list]]:
    """(c, nodes) when x = c - rowmax(c)."""
    from .find_sites import _row_max_of  # noqa: PLC0415  (find_sites imports this module)

    if x.op not in ("call_function", "call_method") or x.target not in (operator.sub, torch.sub, "sub"):
        return None
    if len(x.args) != 2 or not isinstance(x.args[0], fx.Node):
        return None
    m = _row_max_of(x.args[1], x.args[0])
    if m is None:
        return None
    nodes = [x, x.args[1]] + ([m] if m is not x.args[1] else [])
    return x.args[0], nodes


def peel(sm: fx.Node, x: fx.Node) -> Optional[SinkColumn]:
    """The sink column of the softmax `sm` over `x`, or None when `x` is not such a concatenation."""
    nodes: list = []
    cur = x
    shifted = _shift_of(cur)
    if shifted is not None:
        cur, shift_nodes = shifted
        nodes += shift_nodes
    if not _is_cat(cur):
        return None
    parts = _cat_parts(cur)
    if parts is None:
        return None
    ct = _tensor(cur)
    for first in (False, True):  # the sink column after the scores (GPT-OSS) or before them
        col, scores = parts if first else parts[::-1]
        st = _tensor(scores)
        if st is None or ct is None or st.dim() != 4 or not isinstance(scores, fx.Node):
            continue
        found = _head_logits(col, tuple(st.shape))
        if found is not None:
            break
    else:
        return None
    head_logits, col_nodes, col_casts = found
    zero = head_logits is col and _zero_column(col)
    # The cat (and the shift) must feed only the softmax (and the shift's own max).
    inner = set(nodes) | {cur}
    for n in inner:
        if any(u not in inner and u is not sm for u in n.users):
            return None
    users = list(sm.users)
    if len(users) != 1 or not _drops_sink_column(users[0], ct, first):
        return None
    return SinkColumn(scores, head_logits, users[0], nodes + [cur] + col_nodes, col_casts, zero)


def head_logits_for_op(graph: fx.Graph, sink: SinkColumn) -> fx.Node:
    """The op's `sinks` argument: the logits flattened to [H] (a view)."""
    from .emit import call  # noqa: PLC0415

    if sink.zero:
        return call(graph, operator.getitem, sink.head_logits, (0, slice(None), 0, 0))
    flat = call(graph, torch.reshape, sink.head_logits, (-1,))
    for dtype in sink.casts:
        flat = call(graph, "to", flat, dtype, method=True)
    return flat


# ----------------------------------------------------------------------------- sinks as an output gate

@dataclass
class SinkGate:
    """GraniteSWA's spelling of the same sinks, applied after the product:

        out = (softmax(S) @ V) * sigmoid(logsumexp(S, -1) - sink.view(1, H, 1))[..., None]

    softmax(S)_j * sigmoid(lse(S) - sink) = e^S_j / (sum_k e^S_k + e^sink): the op's `sinks` (casts of the gate
    allowed where they do not narrow below the output's dtype)."""
    lse: fx.Node  # logsumexp(S, -1), S being the softmax input
    head_logits: fx.Node  # the tensor of H elements, in head order once flattened
    mul: fx.Node  # (P·V) * gate: the site's result
    nodes: list = field(default_factory=list)  # the gate's chain, outermost first, lse last


def _last_dim(d: Any, rank: int) -> bool:
    if isinstance(d, (list, tuple)) and len(d) == 1:
        d = d[0]
    return isinstance(d, int) and not isinstance(d, bool) and d % rank == rank - 1


def _is_row_lse(n: fx.Node, x: fx.Node, rank: int) -> bool:
    """logsumexp(x, -1) with keepdim False, x its first argument."""
    if op_name(n) != "logsumexp" or not n.args or n.args[0] is not x:
        return False
    dim = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim")
    keep = n.args[2] if len(n.args) > 2 else n.kwargs.get("keepdim", False)
    return _last_dim(dim, rank) and keep is False and len(n.args) <= 3


def _gate_cast(n: fx.Node, out_dtype: torch.dtype) -> bool:
    from .find_sites.scores import narrows  # noqa: PLC0415  (find_sites imports this module)

    t = _tensor(n)
    return op_name(n) in _CAST_METHODS and t is not None and t.dtype.is_floating_point and \
        not narrows(t.dtype, out_dtype)


def _head_vector(n: Any, heads: Any) -> Optional[fx.Node]:
    """The 1-D tensor of `heads` elements that `n` views as [1, H, 1] / [H, 1] (order-preserving views only)."""
    t = _tensor(n)
    if t is None or t.dim() not in (2, 3) or not known_one(t.shape[-1]) or not known_eq(t.shape[-2], heads) or \
            not all(known_one(s) for s in t.shape[:-2]):
        return None
    cur = n
    for _ in range(8):
        ct = _tensor(cur)
        if ct is not None and ct.dim() == 1 and known_eq(ct.shape[0], heads):
            return cur
        if not isinstance(cur, fx.Node) or not cur.args or not (
                (cur.op == "call_method" and cur.target in _VIEW_METHODS)
                or (cur.op == "call_function" and cur.target in _VIEW_FUNCTIONS)):
            return None
        cur = cur.args[0]
    return None


def _appends_axis(u: fx.Node, cur: fx.Node) -> bool:
    """`u` is `cur` with a trailing axis of size 1: unsqueeze(-1), `[..., None]` / `[:, :, :, None]`, or a view or
    reshape to cur's shape + (1,)."""
    name = op_name(u)
    if name == "unsqueeze":
        return len(u.args) == 2 and u.args[1] in (-1, 3)
    a, b = _tensor(cur), _tensor(u)
    if a is None or b is None or b.dim() != a.dim() + 1 or not known_one(b.shape[-1]) or \
            not all(known_eq(x, y) for x, y in zip(a.shape, b.shape)):
        return False
    if name == "getitem":
        idx = u.args[1] if len(u.args) == 2 else None
        if not isinstance(idx, tuple) or not idx or idx[-1] is not None:
            return False
        full = slice(None, None, None)
        head = idx[:-1]
        return head == (Ellipsis,) or (len(head) == a.dim() and all(i == full for i in head))
    return name in ("view", "reshape")


def peel_gate(sm: fx.Node, x: fx.Node) -> Optional[SinkGate]:
    """The sink gate of the softmax `sm` over the 4-d scores `x`, or None. The P·V product the gate multiplies is
    checked by the caller (it is found after this)."""
    t = _tensor(x)
    if t is None or t.dim() != 4:
        return None
    others = [u for u in x.users if u is not sm]
    if len(others) != 1 or not _is_row_lse(others[0], x, 4):
        return None
    lse = others[0]
    chain, cur, head_logits, seen = [lse], lse, None, set()
    for _ in range(12):
        users = list(cur.users)
        if len(users) != 1:
            return None
        u = users[0]
        name = op_name(u)
        if not u.args or (u.args[0] is not cur and name not in ("mul", "__mul__")):
            return None
        if name in ("sub", "__sub__") and head_logits is None and len(u.args) == 2 and not u.kwargs:
            head_logits = _head_vector(u.args[1], t.shape[1])  # lse - sink.view(1, H, 1)
            if head_logits is None:
                return None
            seen.add("sub")
        elif name in ("sigmoid", "expit") and "sub" in seen and "sigmoid" not in seen and len(u.args) == 1:
            seen.add("sigmoid")
        elif "sigmoid" in seen and "unsqueeze" not in seen and _appends_axis(u, cur):
            seen.add("unsqueeze")
        elif name in ("mul", "__mul__") and "unsqueeze" in seen and len(u.args) == 2 and not u.kwargs \
                and cur in u.args:
            return SinkGate(lse, head_logits, u, list(reversed(chain)))
        elif _gate_cast(u, t.dtype):
            pass
        else:
            return None
        chain.append(u)
        cur = u
    return None


def gate_logits_for_op(graph: fx.Graph, gate: SinkGate) -> fx.Node:
    """The op's `sinks` argument for a gate: its logits flattened to [H] (a view)."""
    from .emit import call  # noqa: PLC0415

    return call(graph, torch.reshape, gate.head_logits, (-1,))
