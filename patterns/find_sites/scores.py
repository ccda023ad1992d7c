"""Walking back from a softmax to its Q·Kᵀ: the scale, softcap and mask terms in between (the
"back" step of find_sites)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Optional

import torch
import torch.fx as fx

from ..canonicalize import (
    arg, constant_value, is_finite_number, is_inplace, is_symbolic_scalar, kind, reads_only_metadata, tensor_of,
)
from ..canonicalize import row_max_of as _row_max_of
from ..constants import read_float
from ..layout import Contraction, contraction, identity
from ..mult_mask import match_mult_mask
from ..shapes import known_eq, known_one
from ..site import MaskTerm


class Miss(Exception):
    """The site is left alone; the message is the reason explain() shows."""


@dataclass
class Scores:
    contraction: Contraction
    scale: float = 1.0  # Python-number part of the scale
    factors: list = field(default_factory=list)  # [(node, "mul" | "div", batch dims)]: symbolic / tensor factors
    softcap: float = 0.0
    terms: list = field(default_factory=list)  # MaskTerm, outermost first
    term_batches: list = field(default_factory=list)  # the scores' batch dims where each term is applied
    nodes: list = field(default_factory=list)  # the chain, softmax input first (all single-user)
    clamped: bool = False  # max(s, finfo.min) after the masks: fully masked rows average V, never NaN
    tie_halves: bool = False  # the clamp is torch.max / maximum, whose backward halves a tie (clamp's does not)


def _operand_roles(node: fx.Node, cur_shape) -> tuple[Any, Any]:
    """(chain operand, other operand) of a binary op: the chain is the tensor with the full scores shape."""
    a, b = node.args[0], arg(node, 1, "other")
    ta, tb = tensor_of(a), tensor_of(b)
    full = lambda t: t is not None and t.dim() == len(cur_shape) and all(known_eq(x, y) for x, y in zip(t.shape, cur_shape))  # noqa: E731
    if full(ta) and not full(tb):
        return a, b
    if full(tb) and not full(ta):
        return b, a
    if full(ta) and full(tb):
        return a, b  # both full: the caller decides (add: the one reaching a contraction)
    return None, None


def _reaches_contraction(node: Any, budget: Optional[list] = None) -> bool:
    """A cheap probe (at most 64 nodes): does an affine path (casts, scales, adds, fills) lead to a contraction?"""
    budget = [64] if budget is None else budget
    budget[0] -= 1
    if budget[0] < 0 or not isinstance(node, fx.Node) or tensor_of(node) is None:
        return False
    if contraction(node) is not None:
        return True
    k = kind(node)
    if k in ("cast", "identity", "masked_fill", "tanh"):
        return _reaches_contraction(node.args[0], budget)
    if k in ("mul", "div", "add", "sub", "where"):
        return any(_reaches_contraction(a, budget) for a in node.args[:3] if isinstance(a, fx.Node))
    return False


def _scale_factor(x: Any, scores_shape) -> Optional[tuple[str, Any]]:
    """("num", float) | ("node", node) for a valid scale operand; None if it is not a scale."""
    if is_finite_number(x):
        return "num", float(x)
    if is_symbolic_scalar(x):
        return "node", x
    t = tensor_of(x)
    if t is not None and t.dim() == 0 and not t.dtype.is_floating_point and not t.dtype.is_complex \
            and t.dtype != torch.bool:
        # an integer constant (`* torch.tensor(2)`): the floating scores promote it to their dtype, exactly below
        # 2**24. (One read at run time is left alone: the run-time scale path reads floating tensors.)
        c = constant_value(x)
        return ("num", float(c)) if c is not None and abs(c) < (1 << 24) else None
    if t is None or not t.dtype.is_floating_point:
        return None
    c = constant_value(x)
    if c is not None and math.isfinite(c):
        return "num", c
    if t.dim() > len(scores_shape):
        return None
    if t.dim() == 0 or (t.dim() >= 1 and known_one(t.shape[-1])):
        return "node", x  # constant along the key axis: folds into q
    return None


def _number(x: Any) -> Any:
    """x itself when a finite number, else the value of a float Dynamo made a graph input (read as a constant, checked
    on every call: patterns/constants.py), else None."""
    if is_finite_number(x):
        return x
    v = read_float(x)
    return v if v is not None and math.isfinite(v) else None


def _is_item(x: Any) -> bool:
    return isinstance(x, fx.Node) and x.op == "call_method" and x.target == "item"


def _softcap_at(node: fx.Node) -> Optional[tuple[float, fx.Node, list, float]]:
    """mul(tanh(div(y, d)), c) (either operand order, or y * (1/d) inside) -> (c, y, [tanh, inner], c / d): the op's
    softcap c, with the scale c / d before it where d is not c (c tanh(y / d) = c tanh((y c / d) / c)). c and d may
    be floats Dynamo passes as graph inputs (dynamic shapes: Gemma 2's config value), read as checked constants."""
    if kind(node) != "mul":
        return None
    a, b = node.args[0], arg(node, 1, "other")
    t, c = (a, b) if kind(a) == "tanh" else (b, a)
    if kind(t) != "tanh":
        return None
    inner = t.args[0]
    ki = kind(inner)
    if ki not in ("mul", "div"):
        return None
    x, y = inner.args[0], arg(inner, 1, "other")
    if ki == "mul" and (is_finite_number(x) or _is_item(x)):
        x, y = y, x
    if not isinstance(x, fx.Node) or tensor_of(x) is None:
        return None
    c, y = _number(c), _number(y)
    if c is None or c <= 0 or y is None or y == 0:
        return None
    d = float(y) if ki == "div" else 1.0 / float(y)
    if not d > 0 or not math.isfinite(d):
        return None
    ratio = 1.0 if math.isclose(d, float(c), rel_tol=1e-6) else float(c) / d
    return (float(c), x, [t, inner], ratio) if math.isfinite(ratio) and ratio > 0 else None


def _regroups_batch(node: fx.Node) -> bool:
    """A view/reshape that keeps the last two dims and only regroups the batch dims."""
    src = node.args[0] if node.args else None
    a, b = tensor_of(src), tensor_of(node)
    return a is not None and b is not None and a.dim() >= 2 and b.dim() >= 2 and \
        known_eq(a.shape[-1], b.shape[-1]) and known_eq(a.shape[-2], b.shape[-2])


def _fill_value(value: Any) -> Any:
    """A fill of the scores: a number (a literal, or a 0-d tensor built from one), or a 0-d float tensor of the graph
    that needs no gradient (Reformer's mask-value buffer), whose value the mask analysis reads where the caller checks
    it on every call (patterns/constants.py) and refuses otherwise; None for anything else."""
    c = constant_value(value)
    if c is not None:
        return c
    if _is_item(value):  # a float Dynamo made a graph input (dynamic shapes), read as a checked constant
        return read_float(value)
    t = tensor_of(value)
    if isinstance(value, fx.Node) and t is not None and t.dim() == 0 and t.dtype.is_floating_point and \
            not t.requires_grad:
        return value
    return None


_FULL_FNS = (torch.full_like, torch.full)


def _full_fill(value: Any, scores: torch.Tensor) -> Any:
    """c for `torch.full_like(x, c)` / `torch.full(shape, c)` / `x.new_full(shape, c)` with a constant c, in the
    scores' dtype and needing no gradient: a tensor of one value, which `torch.where` reads as that value."""
    if not isinstance(value, fx.Node) or value.op not in ("call_function", "call_method"):
        return None
    if value.op == "call_function" and value.target in _FULL_FNS:
        c = arg(value, 1, "fill_value")
    elif value.op == "call_method" and value.target == "new_full":
        c = arg(value, 2, "fill_value")
    else:
        return None
    t = tensor_of(value)
    if t is None or t.dtype != scores.dtype or t.requires_grad:
        return None
    if not (is_finite_number(c) or c in (-math.inf, math.inf)):
        return None
    return float(c)


def _outer_scaled(term: MaskTerm, phase: str, scale: float, factors: list, softcap: float, t: torch.Tensor) -> MaskTerm:
    """A mask applied before a Python-number scale c: eager scales it too, so the op gets fill * c
    (computed in the scores' dtype, as eager does) or bias * c; "scaled" terms are multiplied at rewrite.
    The term keeps the dtype of `t`, the node that applies it (MaskTerm.dtype)."""
    if phase == "mask":
        return replace(term, dtype=t.dtype)
    if softcap:
        raise Miss("a mask is applied to the scores before the softcap")
    if factors or scale <= 0:
        raise Miss("a mask is applied to the scores before a tensor or non-positive scale")
    if term.op in ("fill", "where", "fill_zero"):
        if isinstance(term.fill, fx.Node):
            raise Miss(f"a mask fill read from a tensor ({term.fill.name}) is applied before the scale")
        return MaskTerm(term.op, term.tensor, float(torch.tensor(term.fill, dtype=t.dtype) * scale), t.dtype)
    return MaskTerm(term.op + "_scaled", term.tensor, scale, t.dtype)


def _clamp_min_of(node: fx.Node, t: torch.Tensor) -> Optional[tuple[fx.Node, bool]]:
    """(x, whether a tie halves the gradient) when node is torch.max(x, c) / torch.maximum(x, c) (True: each of two
    equal operands gets half) or clamp(x, min=c) / clamp_min(x, c) (False: x >= min passes it whole), with
    c = finfo(dtype).min (a 0-d constant, or a number for clamp)."""
    if node.op not in ("call_function", "call_method"):
        return None
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
    if name in ("clamp", "clamp_min", "clip"):
        return _clamp_call_of(node, t, name)
    if name not in ("max", "maximum") or len(node.args) != 2 or node.kwargs:
        return None
    a, b = node.args
    if node.op == "call_function" and getattr(node.target, "__module__", "") not in ("torch", None) and \
            node.target not in (torch.max, torch.maximum):
        return None
    if not isinstance(b, fx.Node) or tensor_of(b) is None or tensor_of(b).dim() != 0:
        return None  # torch.max(x, int) is a reduction
    if constant_value(b) != float(torch.finfo(t.dtype).min) or tensor_of(a) is None:
        return None
    return a, True


def _clamp_call_of(node: fx.Node, t: torch.Tensor, name: str) -> Optional[tuple[fx.Node, bool]]:
    """clamp(x, min=c) / clamp(x, c) / clip(x, c) without a max, or clamp_min(x, c), as torch functions or methods."""
    if node.op == "call_function" and node.target not in (torch.clamp, torch.clamp_min, torch.clip):
        return None
    args, kw = list(node.args), dict(node.kwargs)
    x = args.pop(0) if args else kw.pop("input", None)
    names = ("min",) if name == "clamp_min" else ("min", "max")
    bound = dict(zip(names, args))
    if len(args) > len(names) or any(n in bound for n in kw) or set(kw) - set(names):
        return None
    bound.update(kw)
    lo = bound.get("min")
    if bound.get("max") is not None or lo is None or not isinstance(x, fx.Node) or tensor_of(x) is None:
        return None
    value = lo if isinstance(lo, (int, float)) and not isinstance(lo, bool) else constant_value(lo) \
        if isinstance(lo, fx.Node) and tensor_of(lo) is not None and tensor_of(lo).dim() == 0 else None
    if value is None or float(value) != float(torch.finfo(t.dtype).min):
        return None
    return x, False


def _shift_refusal(terms: list, softcap: float, shift_barrier: Optional[str]) -> Optional[str]:
    """Why a shift of the scores by a row constant (a number, or the row max) may not be dropped, given what the walk
    found applied after it (`terms`, `softcap`: the walk goes from the softmax inwards) and what else reads the
    scores (`shift_barrier`); None when softmax ignores it."""
    if shift_barrier:
        return f"the scores are shifted before {shift_barrier}"
    if softcap:
        return "the scores are shifted before the softcap (tanh does not commute with the shift)"
    from ..masks.combine import _absorbs

    for t in terms:
        if t.op not in ("fill", "where", "fill_zero"):
            continue
        if isinstance(t.fill, fx.Node):
            return f"the scores are shifted before a fill read from a tensor ({t.fill.name}), not proven to absorb it"
        # a fill that absorbs any plausible score (-inf, finfo.min) gets weight 0 whatever the shift; a higher one
        # keeps a weight that the shift changes (the mask analysis' own rule for a constant added: analyze.py)
        if not _absorbs(t.fill, t.dtype if t.dtype is not None else torch.float32):
            return (f"the scores are shifted before a finite fill ({t.fill:g}): the filled entries do not move with the "
                    "shift, so softmax is not invariant to it")
    return None


def narrows(dtype: torch.dtype, ref: torch.dtype) -> bool:
    """Whether a cast to `dtype` loses precision or range of `ref` values (a quantizing round trip, not a widening)."""
    if not (dtype.is_floating_point and ref.is_floating_point):
        return dtype != ref
    a, b = torch.finfo(dtype), torch.finfo(ref)
    return a.eps > b.eps or a.max < b.max


def _where_fill(value: Any, scores: torch.Tensor) -> Any:
    """A fill of torch.where on the scores: a _fill_value, or a full tensor of one constant (_full_fill)."""
    c = _fill_value(value)
    return c if c is not None else _full_fill(value, scores)


_ELEMENTWISE = ("add", "sub", "mul", "div", "masked_fill", "where")


def _same_scores_shape(scores: fx.Node, consumer: fx.Node) -> None:
    """Miss where a term or factor broadcasts the scores to a larger shape (a mask of batch 2 added to scores of
    batch 1, a per-query mask on one query row): the op's scores have q's and k's shape."""
    a, b = tensor_of(scores), tensor_of(consumer)
    if a is None or b is None:
        return
    if a.dim() != b.dim() or not all(known_eq(p, q) for p, q in zip(a.shape, b.shape)):
        raise Miss(f"a term or factor of the scores broadcasts them from {tuple(a.shape)} to {tuple(b.shape)} "
                   f"({consumer.name}): the op's scores have the shape q and k give them")


def walk_scores(x: fx.Node, gm: Optional[fx.GraphModule] = None, shift_barrier: Optional[str] = None,
                also_read_by: tuple = ()) -> Scores:
    """From the softmax input back to the Q·Kᵀ contraction (gm: the graph, for proofs of mask values).
    shift_barrier: what, besides the softmax, sees a row-constant shift of these scores (a sink column concatenated
    after them, a sink gate's logsumexp), so that such a shift can no longer be dropped. also_read_by: readers of `x`
    besides the softmax that the site accounts for (a sink gate's logsumexp)."""
    scale, factors, softcap, terms, nodes, batches = 1.0, [], 0.0, [], [], []
    row_max_users: set = set()  # max/amax nodes reading a chain node only to subtract its row max
    clamped = False
    tie_halves = False
    phase = "mask"  # outermost first: mask terms -> softcap -> scale
    cur = x
    consumer = None  # the elementwise step the walk came from, whose result must not outgrow its scores operand
    for _ in range(128):
        if consumer is not None:
            _same_scores_shape(cur, consumer)
        c = contraction(cur)
        if c is not None:
            break
        t = tensor_of(cur)
        if t is None:
            raise Miss(f"scores are not a tensor computed in the graph ({cur})")
        nodes.append(cur)
        consumer = cur if kind(cur) in _ELEMENTWISE else None
        if is_inplace(cur) and isinstance(cur.args[0], fx.Node) and len(cur.args[0].users) != 1:
            raise Miss(f"the scores are modified in place and also read elsewhere ({cur.name})")
        k = kind(cur)
        if k in ("cast", "identity"):
            cur = cur.args[0]
            continue
        lo = _clamp_min_of(cur, t)
        if lo is not None:
            # max(s, finfo.min) turns -inf into finfo.min (finite values are all >= it): masks applied
            # before it keep eager's finite-fill semantics (fully masked rows average V)
            if terms or phase != "mask":
                raise Miss("the scores are clamped after a mask or before the scale")
            clamped = True
            tie_halves = tie_halves or lo[1]
            cur = lo[0]
            continue
        if k == "reshape" and _regroups_batch(cur):
            cur = cur.args[0]  # batch dims regrouped ([B*H, N, N] <-> [B, H, N, N]); rows and keys kept
            continue
        if k == "mul":
            cap = _softcap_at(cur)
            if cap is not None:
                if phase == "scale":
                    raise Miss("the softcapped scores are scaled again (not expressible as the op's scale and softcap)")
                softcap, cur = cap[0], cap[1]
                scale *= cap[3]  # 1 where tanh's argument is divided by the softcap itself
                nodes.extend(cap[2])
                phase = "scale"
                continue
        if k in ("mul", "div"):
            chain, other = _operand_roles(cur, t.shape)
            if chain is None or (k == "div" and chain is not cur.args[0]):
                raise Miss(f"scores are divided by, not into, the scale ({cur.name})" if k == "div" and chain is not None
                           else f"scores are multiplied elementwise by a tensor ({cur.name}); not a scale")
            ot = tensor_of(other)
            if ot is not None and ot.dim() == t.dim() and all(known_eq(a, b) for a, b in zip(ot.shape, t.shape)):
                raise Miss(f"scores are multiplied elementwise by a tensor ({cur.name}); not a scale")
            f = _scale_factor(other, t.shape)
            if f is None:
                how = "multiplied" if k == "mul" else "divided"
                if ot is not None and not ot.dtype.is_floating_point:
                    raise Miss(f"scores are {how} by an integer tensor ({str(ot.dtype).replace('torch.', '')}) read at "
                               f"run time ({cur.name}); only floating ones, or integer constants, are taken as a scale")
                raise Miss(f"scores are {how} by a tensor that varies along the key axis ({cur.name})")
            phase = "scale"
            if f[0] == "num":
                if k == "div":
                    if f[1] == 0:
                        raise Miss("scores are divided by zero")
                    scale /= f[1]
                else:
                    scale *= f[1]
            else:
                factors.append((f[1], k, list(t.shape[:-2])))
            cur = chain
            continue
        if k in ("add", "sub"):
            if cur.kwargs.get("alpha", 1) != 1:
                raise Miss(f"scores are added with alpha != 1 ({cur.name})")
            mm = match_mult_mask(cur, t.dtype)
            if mm is not None:  # s * m + (1 - m) * c: masked_fill(m == 0, c) when m is 0 / 1
                if tensor_of(mm.mask).requires_grad:
                    raise Miss(f"the scores are multiplied by a mask that needs a gradient ({mm.mask.name}); "
                               "eager gives it one, a mask of the op does not")
                from ..masks import zero_one

                if gm is None or not zero_one(gm, mm.mask):
                    raise Miss(f"the scores are multiplied by {mm.mask.name} and (1 - {mm.mask.name}) * c added: "
                               f"{mm.mask.name} is not proven to hold only 0 and 1, the values that make it a mask")
                terms.append(_outer_scaled(MaskTerm("fill_zero", mm.mask, mm.fill), phase, scale, factors, softcap, t))
                batches.append(list(t.shape[:-2]))
                nodes.append(mm.product)
                cur = mm.scores
                continue
            a, b = cur.args[0], arg(cur, 1, "other")
            const_sub = k == "sub" and is_finite_number(b) and isinstance(a, fx.Node)
            const_add = k == "add" and (is_finite_number(a) or is_finite_number(b))
            row_max = k == "sub" and _row_max_of(b, a)
            if const_sub or const_add or row_max:
                # a row constant (s - rowmax(s): the usual stabilisation): softmax is invariant to it unless
                # something applied after it does not move with it
                why = _shift_refusal(terms, softcap, shift_barrier)
                if why:
                    raise Miss(why)
                if row_max:
                    row_max_users.add(row_max)
                    src = row_max.args[0]  # `s.detach().amax(...)`: the detach reads s for that max alone
                    if src is not a and set(src.users) == {row_max}:
                        row_max_users.add(src)
                cur = b if const_add and is_finite_number(a) else a
                continue
            if k == "sub":
                if not (isinstance(a, fx.Node) and _reaches_contraction(a)) or tensor_of(b) is None:
                    raise Miss(f"the scores are subtracted from a tensor ({cur.name})")
                terms.append(_outer_scaled(MaskTerm("sub", b), phase, scale, factors, softcap, t))  # "add" of -b
                batches.append(list(t.shape[:-2]))
                cur = a
                continue
            chain, other = _operand_roles(cur, t.shape)
            if chain is None:
                chain, other = (a, b) if _reaches_contraction(a) else (b, a)
            elif tensor_of(other) is not None and tensor_of(other).dim() == t.dim() and all(
                    known_eq(p, q) for p, q in zip(tensor_of(other).shape, t.shape)):
                if not _reaches_contraction(chain) and _reaches_contraction(other):
                    chain, other = other, chain
            terms.append(_outer_scaled(MaskTerm("add", other), phase, scale, factors, softcap, t))
            batches.append(list(t.shape[:-2]))
            cur = chain
            continue
        if k == "masked_fill":
            mask, value = arg(cur, 1, "mask"), arg(cur, 2, "value")
            fill = _fill_value(value)
            if fill is None:
                raise Miss(f"masked_fill with a value that is not a constant ({cur.name})")
            terms.append(_outer_scaled(MaskTerm("fill", mask, fill), phase, scale, factors, softcap, t))
            batches.append(list(t.shape[:-2]))
            cur = cur.args[0]
            continue
        if k == "where" and len(cur.args) == 3:
            cond, a, b = cur.args
            ca, cb = (_where_fill(x, t) for x in (a, b))
            if cb is not None and isinstance(a, fx.Node) and tensor_of(a) is not None and ca is None:
                term, nxt = MaskTerm("where", cond, cb), a
            elif ca is not None and isinstance(b, fx.Node) and tensor_of(b) is not None and cb is None:
                term, nxt = MaskTerm("fill", cond, ca), b
            else:
                raise Miss(f"torch.where on the scores without a constant fill ({cur.name})")
            terms.append(_outer_scaled(term, phase, scale, factors, softcap, t))
            batches.append(list(t.shape[:-2]))
            cur = nxt
            continue
        if cur.kwargs.get("rounding_mode") is not None:
            raise Miss(f"the scores are divided with rounding_mode={cur.kwargs['rounding_mode']!r} ({cur.name}): "
                       "a rounding, not a scale")
        raise Miss(f"scores are not a Q·Kᵀ contraction (reached {_describe(cur)})")
    else:
        raise Miss("scores chain too long")
    if c.spelling == "einsum" and c.out_perm != identity(len(c.out_perm)):
        raise Miss("the einsum's scores are not laid out [batch..., query, key]")
    if c.spelling in ("baddbmm", "linear"):  # out = beta * addend + alpha * lhs · rhs
        if not is_finite_number(c.beta) or not (is_finite_number(c.alpha) or is_symbolic_scalar(c.alpha)):
            raise Miss(f"{c.spelling} with a non-constant alpha or beta")
        outer, outer_factors = scale, len(factors)  # what the walk found applied after the contraction
        if is_finite_number(c.alpha):
            scale *= float(c.alpha)
        else:  # a SymFloat alpha (e.g. d ** -0.5 under dynamic shapes): folded into q
            factors.append((c.alpha, "mul", list(tensor_of(c.node).shape[:-2])))
        if c.beta == 0 and c.addend is not None and getattr(tensor_of(c.addend), "requires_grad", False):
            raise Miss(f"{c.spelling} with beta=0 ignores its added input, which needs a gradient: eager gives it a "
                       "zero gradient, the op none")
        if c.beta != 0:
            if softcap or outer_factors:
                raise Miss(f"{c.spelling}'s added input is softcapped or scaled by a tensor afterwards")
            # beta * addend, times the number scale applied afterwards, is an additive bias of the scores
            w = float(c.beta) * outer
            dt = tensor_of(c.node).dtype
            terms.append(MaskTerm("add", c.addend, dtype=dt) if w == 1 else MaskTerm("add_scaled", c.addend, w, dt))
            batches.append(list(tensor_of(c.node).shape[:-2]))
    for n in nodes + [c.node]:
        bad = [u for u in n.users if is_inplace(u) and u.args and u.args[0] is n and u not in nodes]
        if bad:
            raise Miss(f"the scores are modified in place ({bad[0].name})")
        # `x.type_as(n)`, `torch.ones_like(n)`, `n.size(-1)` read only n's dtype / shape: not a use of its values
        users = [u for u in n.users if not reads_only_metadata(u, n) and u not in row_max_users
                 and not (n is x and u in also_read_by)]
        if len(users) != 1:
            raise Miss(f"the scores ({n.name}) are also used outside the attention")
    ref = tensor_of(c.node).dtype
    for n in nodes:
        if kind(n) == "cast" and narrows(tensor_of(n).dtype, ref):
            raise Miss(f"the scores are cast to {tensor_of(n).dtype} ({n.name}), narrower than the {ref} they are "
                       "computed in: a rounding the op would not make")
    if clamped:
        terms = [MaskTerm(t.op, t.tensor, float(torch.finfo(tensor_of(x).dtype).min), t.dtype)
                 if t.op in ("fill", "where", "fill_zero") and t.fill == -math.inf else t for t in terms]
    return Scores(c, scale, factors, softcap, terms, batches, nodes, clamped, tie_halves)


def _describe(n: Any) -> str:
    if not isinstance(n, fx.Node):
        return repr(n)
    tgt = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", str(n.target))
    return f"{tgt} ({n.name})"
