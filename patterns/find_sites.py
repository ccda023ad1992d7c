"""Hand-written attention: from each softmax, walk back to Q·Kᵀ and forward to P·V, then rewrite.

For every softmax node (any spelling, see canonicalize.py):
  back     the softmax input must be  mask-terms( softcap( scale( Q·Kᵀ ) ) )  with casts anywhere:
           scale = Python numbers, SymInt/SymFloat, 0-d tensors or tensors constant along the key
           axis (folded into q); softcap = tanh(s / c) * c; mask terms (+ m, m +, masked_fill,
           where, a 0/1 multiplicative mask s * m + (1 - m) * c, baddbmm's / F.linear's added input)
           go to masks.analyze_mask. Q·Kᵀ is any contraction (layout.contraction) whose axes are
           read from the op itself, so k is whatever view the graph contracts with. A read of only
           the scores' shape or dtype (`torch.ones_like(s)`) is not a use of their values.
  forward  the probabilities reach exactly one P·V contraction through casts and dropout only, and
           nothing else reads them (output_attentions, or a graph break after the softmax, keeps the
           site as it is; the reason says which).
  rewrite  q, k, v as the op's [B, H, N, D] views (transposes folded, repeat_kv / repeat_interleave /
           expand removed for native GQA, lossless upcasts dropped), one fa3.attention call, glue so
           every consumer of the P·V result sees the same shape and dtype; dead nodes go.
  effects  writes into caller tensors are kept (`out=` of the P·V product: the result is copied into
           it) or refused; a site spanning grad-mode regions gets eager's gradient flow (the op's
           inputs that entered before a no_grad node are detached); see effects.py and regions.py.
Everything is decided before the graph is touched; a refusal, or any failure while rewriting,
leaves the graph as it was.
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.fx as fx

from . import emit, sinks
from .canonicalize import (
    arg, constant_value, dropout_args, is_finite_number, is_inplace, is_symbolic_scalar, kind, log_softmax_of,
    reads_only_metadata, softmax_args, tensor_of,
)
from .effects import GradFlow, chain_write, grad_flow, mutated_downstream, out_target, path_to, read_path
from .emit import example_value
from .gqa import unrepeat
from .layout import Contraction, View, contraction, fold, identity
from .mult_mask import match_mult_mask
from .regions import Regions
from .shapes import known_eq, known_one
from .site import MaskSpec, MaskTerm, PassOptions, SiteReport


class Miss(Exception):
    """The site is left alone; the message is the reason explain() shows."""


# --------------------------------------------------------------------------------------------- walk back


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


def _softcap_at(node: fx.Node) -> Optional[tuple[float, fx.Node, list]]:
    """mul(tanh(div(y, c)), c) (either operand order, or y * (1/c) inside) -> (c, y, [tanh, inner])."""
    if kind(node) != "mul":
        return None
    a, b = node.args[0], arg(node, 1, "other")
    t, c = (a, b) if kind(a) == "tanh" else (b, a)
    if kind(t) != "tanh" or not is_finite_number(c) or c <= 0:
        return None
    inner = t.args[0]
    ki = kind(inner)
    if ki not in ("mul", "div"):
        return None
    x, y = inner.args[0], arg(inner, 1, "other")
    if ki == "mul" and is_finite_number(x):
        x, y = y, x
    if not isinstance(x, fx.Node) or not is_finite_number(y) or y == 0:
        return None
    d = float(y) if ki == "div" else 1.0 / float(y)
    if not math.isclose(d, float(c), rel_tol=1e-6):
        return None
    return float(c), x, [t, inner]


def _regroups_batch(node: fx.Node) -> bool:
    """A view/reshape that keeps the last two dims and only regroups the batch dims."""
    src = node.args[0] if node.args else None
    a, b = tensor_of(src), tensor_of(node)
    return a is not None and b is not None and a.dim() >= 2 and b.dim() >= 2 and \
        known_eq(a.shape[-1], b.shape[-1]) and known_eq(a.shape[-2], b.shape[-2])


def _outer_scaled(term: MaskTerm, phase: str, scale: float, factors: list, softcap: float, t: torch.Tensor) -> MaskTerm:
    """A mask applied before a Python-number scale c: eager scales it too, so the op gets fill * c
    (computed in the scores' dtype, as eager does) or bias * c; "scaled" terms are multiplied at rewrite."""
    if phase == "mask":
        return term
    if softcap:
        raise Miss("a mask is applied to the scores before the softcap")
    if factors or scale <= 0:
        raise Miss("a mask is applied to the scores before a tensor or non-positive scale")
    if term.op in ("fill", "where", "fill_zero"):
        return MaskTerm(term.op, term.tensor, float(torch.tensor(term.fill, dtype=t.dtype) * scale))
    return MaskTerm(term.op + "_scaled", term.tensor, scale)


def _clamp_min_of(node: fx.Node, t: torch.Tensor) -> Optional[fx.Node]:
    """x when node is torch.max(x, c) / torch.maximum(x, c) with c = finfo(dtype).min (a 0-d constant)."""
    if node.op not in ("call_function", "call_method"):
        return None
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
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
    return a


def _row_max_of(m: Any, s: Any) -> Optional[fx.Node]:
    """The max/amax node when m is s.amax(-1, keepdim=True) or s.max(-1, keepdim=True)[0] (detached or not)."""
    while isinstance(m, fx.Node) and m.op == "call_method" and m.target == "detach":
        m = m.args[0]
    if not isinstance(m, fx.Node) or tensor_of(s) is None:
        return None
    if m.target is operator.getitem and m.args[1] == 0:
        m = m.args[0]
        names = ("max",)
    else:
        names = ("amax",)
    name = m.target if m.op == "call_method" else getattr(m.target, "__name__", "")
    if name not in names or not m.args or m.args[0] is not s:
        return None
    dim, keep = arg(m, 1, "dim"), arg(m, 2, "keepdim", False)
    nd = tensor_of(s).dim()
    if isinstance(dim, (list, tuple)) and len(dim) == 1:
        dim = dim[0]
    if not isinstance(dim, int) or dim % nd != nd - 1 or keep is not True:
        return None
    return m


def walk_scores(x: fx.Node, gm: Optional[fx.GraphModule] = None) -> Scores:
    """From the softmax input back to the Q·Kᵀ contraction (gm: the graph, for proofs of mask values)."""
    scale, factors, softcap, terms, nodes, batches = 1.0, [], 0.0, [], [], []
    row_max_users: set = set()  # max/amax nodes reading a chain node only to subtract its row max
    clamped = False
    phase = "mask"  # outermost first: mask terms -> softcap -> scale
    shifted = False
    cur = x
    for _ in range(128):
        c = contraction(cur)
        if c is not None:
            break
        t = tensor_of(cur)
        if t is None:
            raise Miss(f"scores are not a tensor computed in the graph ({cur})")
        nodes.append(cur)
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
            cur = lo
            continue
        if k == "reshape" and _regroups_batch(cur):
            cur = cur.args[0]  # batch dims regrouped ([B*H, N, N] <-> [B, H, N, N]); rows and keys kept
            continue
        if k == "mul":
            cap = _softcap_at(cur)
            if cap is not None:
                if phase == "scale":
                    raise Miss("the softcapped scores are scaled again (not expressible as the op's scale and softcap)")
                if shifted:
                    raise Miss("a constant is added to the scores before the softcap")
                softcap, cur = cap[0], cap[1]
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
                raise Miss(f"scores are {'multiplied' if k == 'mul' else 'divided'} by a tensor that varies along the key axis ({cur.name})")
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
                from .masks import zero_one

                if gm is None or not zero_one(gm, mm.mask):
                    raise Miss(f"the scores are multiplied by {mm.mask.name} and (1 - {mm.mask.name}) * c added: "
                               f"{mm.mask.name} is not proven to hold only 0 and 1, the values that make it a mask")
                terms.append(_outer_scaled(MaskTerm("fill_zero", mm.mask, mm.fill), phase, scale, factors, softcap, t))
                batches.append(list(t.shape[:-2]))
                nodes.append(mm.product)
                cur = mm.scores
                continue
            a, b = cur.args[0], arg(cur, 1, "other")
            if k == "sub" and is_finite_number(b) and isinstance(a, fx.Node):
                shifted = True  # a constant shift: softmax is invariant to it
                cur = a
                continue
            if k == "add" and (is_finite_number(a) or is_finite_number(b)):
                shifted = True
                cur = b if is_finite_number(a) else a
                continue
            if k == "sub" and _row_max_of(b, a):
                shifted = True  # s - rowmax(s): the usual stabilisation, softmax is invariant to it
                row_max_users.add(_row_max_of(b, a))
                cur = a
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
            fill = constant_value(value)
            if fill is None:
                raise Miss(f"masked_fill with a value that is not a constant ({cur.name})")
            terms.append(_outer_scaled(MaskTerm("fill", mask, fill), phase, scale, factors, softcap, t))
            batches.append(list(t.shape[:-2]))
            cur = cur.args[0]
            continue
        if k == "where" and len(cur.args) == 3:
            cond, a, b = cur.args
            ca, cb = constant_value(a), constant_value(b)
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
        if c.beta != 0:
            if softcap or outer_factors:
                raise Miss(f"{c.spelling}'s added input is softcapped or scaled by a tensor afterwards")
            # beta * addend, times the number scale applied afterwards, is an additive bias of the scores
            w = float(c.beta) * outer
            terms.append(MaskTerm("add", c.addend) if w == 1 else MaskTerm("add_scaled", c.addend, w))
            batches.append(list(tensor_of(c.node).shape[:-2]))
    for n in nodes + [c.node]:
        bad = [u for u in n.users if is_inplace(u) and u.args and u.args[0] is n and u not in nodes]
        if bad:
            raise Miss(f"the scores are modified in place ({bad[0].name})")
        # `x.type_as(n)`, `torch.ones_like(n)`, `n.size(-1)` read only n's dtype / shape: not a use of its values
        users = [u for u in n.users if not reads_only_metadata(u, n) and u not in row_max_users]
        if len(users) != 1:
            raise Miss(f"the scores ({n.name}) are also used outside the attention")
    if clamped:
        terms = [MaskTerm(t.op, t.tensor, float(torch.finfo(tensor_of(x).dtype).min))
                 if t.op in ("fill", "where", "fill_zero") and t.fill == -math.inf else t for t in terms]
    return Scores(c, scale, factors, softcap, terms, batches, nodes, clamped)


def _describe(n: Any) -> str:
    if not isinstance(n, fx.Node):
        return repr(n)
    tgt = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", str(n.target))
    return f"{tgt} ({n.name})"


# ------------------------------------------------------------------------------------------ walk forward


@dataclass
class Probs:
    end: fx.Node  # the tensor that enters P·V
    pv: Contraction
    dropout_p: float = 0.0
    nodes: list = field(default_factory=list)  # softmax .. end


def _leaves_graph(gm: Optional[fx.GraphModule], node: fx.Node) -> str:
    """Why probabilities that are an output of the graph stay eager's: Dynamo's graph ends at a graph
    break after them (the P·V product that reads them, if any, is in the graph after the break), or the
    caller receives them (HF's output_attentions=True returns every layer's weights)."""
    reason = getattr(gm, "compile_subgraph_reason", None)
    if reason is not None and getattr(reason, "graph_break", False):
        why = str(getattr(reason, "reason", "") or "").strip().splitlines()
        stack = getattr(reason, "user_stack", None) or []
        at = f" at {stack[-1].filename.rsplit('/', 1)[-1]}:{stack[-1].lineno}" if stack else ""
        return (f"the probabilities leave the graph at a graph break ({why[0] if why else 'unknown reason'}{at}): "
                "the P·V product that reads them is traced in another graph, so softmax and P·V cannot be fused "
                "here; removing the graph break between them lets the site be rewritten")
    outs = [a for a in torch.utils._pytree.tree_leaves([u.args for u in node.users if u.op == "output"])]
    idx = next((i for i, a in enumerate(outs) if a is node), None)
    which = f" as output {idx} of the compiled graph" if idx is not None else ""
    if all(u.op == "output" for u in node.users):
        return (f"the probabilities are returned to the caller{which} and no P·V contraction reads them in this "
                "graph: nothing to fuse")
    return ("probabilities are also returned to the caller (output_attentions): the graph returns them"
            f"{which} besides the P·V product, so the attention weights eager computes are needed and the site "
            "is left as written")


def walk_probs(sm: fx.Node, options: PassOptions, gm: Optional[fx.GraphModule] = None,
               through: Optional[fx.Node] = None) -> Probs:
    lsm = log_softmax_of(sm)  # exp(log_softmax(s)): both nodes are the softmax
    if lsm is not None and len(lsm.users) != 1:
        names = ", ".join(u.name for u in lsm.users if u is not sm)
        raise Miss(f"the log-probabilities are also read by {names}; only the exp to the probabilities may read them")
    cur, nodes, dropout_p = sm, ([lsm] if lsm is not None else []) + [sm], 0.0
    for _ in range(32):
        users = list(cur.users)
        if any(u.op == "output" for u in users):
            raise Miss(_leaves_graph(gm, cur))
        if len(users) != 1:
            names = ", ".join(u.name for u in users)
            raise Miss(f"probabilities have {len(users)} users ({names}); only a P·V contraction may read them")
        u = users[0]
        k = kind(u)
        if (k in ("cast", "identity") or (k == "reshape" and _regroups_batch(u))) and u.args[0] is cur:
            cur = u
        elif u is through:  # the sink column dropped (patterns/sinks.py)
            cur = u
        elif k == "dropout" and u.args[0] is cur:
            _, p, training = dropout_args(u)
            if not isinstance(training, bool) or not is_finite_number(p):
                raise Miss("dropout with a non-constant p or training flag")
            if not 0 <= p <= 1:
                raise Miss(f"dropout with p={p} outside [0, 1] (eager raises)")
            if training and p > 0:
                if dropout_p:
                    raise Miss("two dropouts on the probabilities")
                if not options.allow_training_dropout:
                    raise Miss("dropout on the probabilities in training (disabled by the options)")
                if p >= 1:
                    raise Miss("dropout with p >= 1")
                dropout_p = float(p)
            cur = u
        else:
            c = contraction(u)
            if c is None:
                raise Miss(f"probabilities feed {_describe(u)}, not a P·V contraction")
            if c.spelling == "baddbmm":
                raise Miss("probabilities enter a baddbmm")
            if c.spelling == "linear" and c.addend is not None:
                raise Miss("probabilities enter an F.linear that adds a bias")
            if c.lhs.node is not cur or c.rhs.node is cur:
                raise Miss("probabilities are not the left operand of the P·V contraction")
            if c.lhs.perm != identity(c.lhs.rank):
                raise Miss("probabilities enter the P·V contraction transposed")
            nodes.append(u)
            return Probs(cur, c, dropout_p, nodes)
        nodes.append(cur)
    raise Miss("probabilities chain too long")


# --------------------------------------------------------------------------------------- masks bridge


def _analyze_mask(gm: fx.GraphModule, terms: list, bd: list, st: torch.Tensor, insert_before: fx.Node) -> MaskSpec:
    """masks.analyze_mask on the site's terms (given in eager's order), or Miss with its reason."""
    if not terms:
        return MaskSpec()
    try:
        from .masks import analyze_mask
    except ImportError:
        raise Miss("masked attention: mask analysis is not available") from None
    nb = len(bd)
    res = analyze_mask(
        gm, list(reversed(terms)), batch=bd[0] if nb >= 1 else 1, q_heads=bd[-1] if nb >= 2 else 1,
        q_len=st.shape[-2], k_len=st.shape[-1], scores_dtype=st.dtype, insert_before=insert_before,
    )
    if isinstance(res, str):
        raise Miss(res)
    return res


# ------------------------------------------------------------------------------------------- rewrite


class _Out:
    """Insert glue nodes before `anchor`; remember them so a refusal can erase them."""

    def __init__(self, graph: fx.Graph, anchor: fx.Node):
        self.graph, self.anchor = graph, anchor
        self.start = anchor.prev  # everything inserted lands between start and anchor
        self.made: list[fx.Node] = []

    def call(self, target: Any, *args: Any, method: bool = False, **kwargs: Any) -> fx.Node:
        n = self.graph.call_method(target, args, kwargs) if method else self.graph.call_function(target, args, kwargs)
        self.made.append(n)
        emit.set_example_value(n)
        if "example_value" not in n.meta:
            raise Miss("no FakeTensor metadata in the graph (not a Dynamo graph?)")
        return n

    def size(self, node: fx.Node, dim: int) -> Any:
        s = tensor_of(node).shape[dim]
        return s if isinstance(s, int) else self.call("size", node, dim, method=True)

    def rollback(self) -> None:
        # everything between start and the anchor, including what emit inserted
        doomed, n = [], self.start.next
        while n is not self.anchor:
            doomed.append(n)
            n = n.next
        for n in reversed(doomed):
            if not n.users:
                self.graph.erase_node(n)


def _padded_batch(shape: tuple, nb: int) -> list:
    """The batch sizes of a [batch..., X, Y] logical shape, left-padded with 1 to nb dims."""
    b = list(shape[:-2])
    return [1] * (nb - len(b)) + b


@dataclass
class _Layout:
    nb: int
    mode: str  # "none" (nb=0), "bh1" (nb=1: B'=batch, H=1), "mqa1" (nb=1: B'=1, H=batch), "std", "grouped"
    lead: int  # number of leading batch dims merged into B'


def _choose_layout(bd: list, qb: list, kb: list, vb: list) -> _Layout:
    nb = len(bd)
    if nb == 0:
        return _Layout(0, "none", 0)
    if nb == 1:
        if known_one(kb[0]) and known_one(vb[0]) and not known_one(bd[0]):
            return _Layout(1, "mqa1", 0)
        return _Layout(1, "bh1", 1)
    if nb >= 3 and known_one(kb[-1]) and known_one(vb[-1]) and not known_one(qb[-1]):
        return _Layout(nb, "grouped", nb - 2)
    return _Layout(nb, "std", nb - 1)


class _Builder:
    def __init__(self, out: _Out, bd: list, layout: _Layout, ref_nodes: list):
        self.o, self.bd, self.lay = out, bd, layout
        self.ref = ref_nodes  # (node, padded batch) materialized operands to read full sizes from

    def full_size(self, i: int) -> Any:
        s = self.bd[i]
        if isinstance(s, int):
            return s
        for node, b in self.ref:
            if not known_one(b[i]):
                return self.o.size(node, i)
        return s

    def pad(self, node: fx.Node, rank: int) -> fx.Node:
        while tensor_of(node).dim() < rank:
            node = self.o.call(torch.unsqueeze, node, 0)
        return node

    def expand(self, node: fx.Node, dims: list) -> fx.Node:
        t = tensor_of(node)
        need = [i for i in dims if known_one(t.shape[i]) and not known_one(self.bd[i])]
        if not need:
            return node
        sizes = [self.full_size(i) if i in need else -1 for i in range(t.dim())]
        return self.o.call("expand", node, *sizes, method=True)

    def to_op(self, node: fx.Node, kv: bool) -> fx.Node:
        """A padded operand [batch..., N, D] -> [B', H, N, D] (kv: heads stay un-repeated / broadcast)."""
        lay, nb = self.lay, self.lay.nb
        if lay.mode == "none":
            return self.o.call(torch.unsqueeze, self.o.call(torch.unsqueeze, node, 0), 0)
        if lay.mode == "mqa1":
            return self.o.call(torch.unsqueeze, node if kv else self.expand(node, [0]), 0)
        if lay.mode == "bh1":
            return self.o.call(torch.unsqueeze, self.expand(node, [0]), 1)
        node = self.expand(node, list(range(lay.lead)))
        if lay.mode == "grouped":
            if kv:
                node = self.o.call(torch.squeeze, node, nb - 1)
            else:
                node = self.o.call(torch.flatten, self.expand(node, [nb - 2, nb - 1]), nb - 2, nb - 1)
        elif not kv:
            node = self.expand(node, [nb - 1])
        if lay.lead > 1:
            node = self.o.call(torch.flatten, node, 0, lay.lead - 1)
        return node

    def bias_to_op(self, node: fx.Node) -> fx.Node:
        """A tensor broadcasting to the scores [batch..., Nq, Nk] -> broadcasting to [B', H, Nq, Nk]."""
        lay, nb = self.lay, self.lay.nb
        t = tensor_of(node)
        if lay.mode == "none" or (lay.mode == "std" and nb == 2 and t.dim() <= 4):
            return node
        if t.dim() <= 2:
            return node
        node = self.pad(node, nb + 2)
        if lay.mode == "mqa1":
            return self.o.call(torch.unsqueeze, node, 0)
        if lay.mode == "bh1":
            return self.o.call(torch.unsqueeze, node, 1)
        b = tensor_of(node).shape
        groups = [list(range(lay.lead))]
        if lay.mode == "grouped":
            groups.append([nb - 2, nb - 1])
        for dims in groups:
            if len(dims) > 1 and not all(known_one(b[i]) for i in dims):
                node = self.expand(node, dims)
        if lay.mode == "grouped":
            node = self.o.call(torch.flatten, node, nb - 2, nb - 1)
        if lay.lead > 1:
            node = self.o.call(torch.flatten, node, 0, lay.lead - 1)
        return node

    def out_from_op(self, out: fx.Node, q_padded: fx.Node) -> fx.Node:
        """[B', H, Nq, Dv] -> the scores' batch layout [batch..., Nq, Dv]."""
        lay, nb = self.lay, self.lay.nb
        if lay.mode == "none":
            return self.o.call(torch.squeeze, self.o.call(torch.squeeze, out, 0), 0)
        if lay.mode == "mqa1":
            return self.o.call(torch.squeeze, out, 0)
        if lay.mode == "bh1":
            return self.o.call(torch.squeeze, out, 1)
        if lay.mode == "grouped":
            out = self.o.call(torch.unflatten, out, 1, (-1, self.o.size(q_padded, nb - 1)))
        if lay.lead > 1:
            out = self.o.call(torch.unflatten, out, 0, tuple(self.full_size(i) for i in range(lay.lead)))
        return out


def _materialize(o: _Out, v: View, dtype: torch.dtype) -> fx.Node:
    node = v.node
    if v.perm != identity(len(v.perm)):
        node = o.call(torch.permute, node, v.perm)
    if tensor_of(node).dtype != dtype:
        node = o.call("to", node, dtype, method=True)
    return node


_VIEWISH = ("transpose", "permute", "unsqueeze", "getitem", "expand")


def _needs_contiguous(old: fx.Node, new_val: torch.Tensor, depth: int = 3) -> bool:
    """Would a `.view` downstream of `old` fail on `new_val`'s strides (where it worked on eager's), or
    would the caller get a non-contiguous tensor where eager returned a contiguous one?"""
    mode = emit._fake_mode([new_val])
    if mode is None:
        return False
    frontier = [(old, new_val)]
    for _ in range(depth):
        nxt = []
        for node, val in frontier:
            for u in node.users:
                if u.op == "output":
                    # returned to the caller: keep eager's strides (a caller may .view() it)
                    old_val = example_value(node)
                    if isinstance(old_val, torch.Tensor) and old_val.is_contiguous() and not val.is_contiguous():
                        return True
                    continue
                if u.op != "call_method" and u.op != "call_function":
                    continue
                is_view = u.op == "call_method" and u.target == "view"
                if not (is_view or kind(u) in _VIEWISH):
                    continue
                args = fx.node.map_arg(u.args, lambda a: val if a is node else example_value(a))
                kwargs = fx.node.map_arg(u.kwargs, lambda a: val if a is node else example_value(a))
                try:
                    with mode:
                        r = (getattr(args[0], u.target)(*args[1:], **kwargs) if u.op == "call_method"
                             else u.target(*args, **kwargs))
                except Exception:
                    return True
                if isinstance(r, torch.Tensor):
                    nxt.append((u, r))
        frontier = nxt
    return False


def _where(node: fx.Node) -> str:
    from .source_location import location

    return location(node)


def _shape(t: Any) -> Optional[tuple]:
    return tuple(t.shape) if isinstance(t, torch.Tensor) else None


def _reads_values(node: fx.Node) -> bool:
    """False when `node` only views its input (its result aliases the input's memory) and writes
    nothing; True otherwise, and whenever that cannot be told."""
    from .canonicalize import is_inplace

    if node.op in ("placeholder", "get_attr"):
        return False
    if node.op not in ("call_function", "call_method") or is_inplace(node) or out_target(node) is not None:
        return True
    val = example_value(node)
    if not isinstance(val, torch.Tensor) or not node.args or not isinstance(node.args[0], fx.Node):
        return True
    src = example_value(node.args[0])
    srcs = [t for t in src if isinstance(t, torch.Tensor)] if isinstance(src, (tuple, list)) else [src]
    try:
        return not any(isinstance(t, torch.Tensor) and torch._C._is_alias_of(val, t) for t in srcs)
    except Exception:
        return True


def _effects(ctx: "_Ctx", scores: Scores, probs: Probs, q: View, k: View, v: View, own: set) -> GradFlow:
    """The site's writes and grad-mode regions (see effects.py): Miss when they cannot be kept,
    else which of the op's inputs eager's gradient does not reach."""
    qk, pv = scores.contraction, probs.pv
    o_node = pv.node
    regions = ctx.regions
    paths = [path_to(qk.lhs.node, q.node), path_to(qk.rhs.node, k.node), path_to(pv.rhs.node, v.node)]
    if any(p is None for p in paths):
        if regions.markers:
            raise Miss("cannot tell which nodes q, k, v are read through, and the graph changes global state")
        paths = [[], [], []]
    q_path, k_path, v_path = paths
    read = set(q_path) | set(k_path) | set(v_path)
    # Eager reads the inputs' values where a node of these paths computes from them, not where a view
    # of them is taken: a write before that point (a cache filled in place, then viewed) is seen alike
    # by eager and by the op, which reads the same memory later still.
    readers = {n for n in read if _reads_values(n)} | {qk.node}
    first = min((n for n in readers if n in ctx.pos), key=ctx.pos.get, default=qk.node)
    if ctx.mutation_between(first, o_node, own | read):
        raise Miss("a tensor is modified in place between the scores and the P·V product")
    chain = [qk.node] + list(reversed(scores.nodes)) + probs.nodes  # Q·Kᵀ .. P·V, in program order
    why = chain_write(q_path + k_path + v_path + chain, own, keep_out=o_node)
    if why:
        raise Miss(why)
    o_out = out_target(o_node)
    if o_out is not None:
        ov, o_val = tensor_of(o_out), tensor_of(o_node)
        if ov is None or o_val is None or ov.dtype != o_val.dtype or not _same(list(ov.shape), list(o_val.shape)):
            raise Miss("the P·V product writes into an out= tensor of another shape or dtype")
        if any(tensor_of(t.node) is not None and tensor_of(t.node).requires_grad for t in (q, k, v)):
            raise Miss("the P·V product writes into out= while its inputs require grad (eager raises)")
    # no early return without grad-mode markers: a term read through `.detach()` is a cut too
    why = regions.grad_cut(q_path + k_path + v_path + chain)
    if why:
        raise Miss(why)
    entries = [(t.tensor, _entry(t.tensor, chain)) for t in scores.terms]
    entries += [(f, _entry(f, chain)) for f, _, _ in scores.factors]
    try:
        return grad_flow(regions, chain, read_path(q_path, q.node), read_path(k_path, k.node),
                         read_path(v_path, v.node), entries)
    except ValueError as e:
        raise Miss(str(e)) from None


def _entry(t: Any, chain: list) -> fx.Node:
    """The chain node where a mask term or scale factor enters the scores."""
    if not isinstance(t, fx.Node):
        return chain[0]
    for n in chain:
        if t in n.all_input_nodes:
            return n
    raise Miss(f"cannot tell where {t.name} enters the scores")


def _grad_source_below(node: Any, depth: int = 16) -> bool:
    """Is `node` computed, along its chain of one-tensor ops, from a tensor that needs a gradient?"""
    n = node
    for _ in range(depth):
        ins = [a for a in n.all_input_nodes if tensor_of(a) is not None] if isinstance(n, fx.Node) else []
        if len(ins) != 1:
            return False
        n = ins[0]
        if tensor_of(n).requires_grad:
            return True
    return False


def _bias_cut(scores: Scores, flow: GradFlow) -> bool:
    """Whether the op's bias is detached: when eager's gradient reaches none of the mask terms (the
    mask analysis may read a term through its views down to a tensor that needs one, e.g.
    `bias.reshape(B*H, N, N)` made under no_grad read as `bias`). Miss when it reaches some terms and
    is cut before others that lead to a tensor needing one (they are one bias in the op)."""
    tensors = [t.tensor for t in scores.terms if tensor_of(t.tensor) is not None]
    live = [t for t in tensors if tensor_of(t).requires_grad and t not in flow.detach_entries]
    if not live:
        return True
    if any(t in flow.detach_entries and (tensor_of(t).requires_grad or _grad_source_below(t)) for t in tensors):
        raise Miss("mask terms that need a gradient are combined with one whose gradient is cut "
                   "(a grad-mode change or detach) before a tensor that needs one: they are one bias in the op")
    return False


def _detached(o: "_Out", node: Any) -> Any:
    """node.detach() where it carries a gradient: eager computed with it under no_grad."""
    t = tensor_of(node)
    return o.call("detach", node, method=True) if t is not None and t.requires_grad else node


class _Ctx:
    """Per-graph facts computed once: node order, in-place mutations, global-state regions."""

    def __init__(self, gm: fx.GraphModule):
        self.regions = Regions(gm)
        self.pos: dict = {}
        self.mutations: list[int] = []
        for i, n in enumerate(gm.graph.nodes):
            self.pos[n] = i
            if is_inplace(n):
                self.mutations.append(i)

    def mutation_between(self, a: fx.Node, b: fx.Node, own: set) -> bool:
        if not self.mutations:
            return False
        lo, hi = self.pos.get(a, 0), self.pos.get(b, 0)
        own_pos = {self.pos.get(n) for n in own}
        return any(lo < m < hi and m not in own_pos for m in self.mutations)


def _site(gm: fx.GraphModule, sm: fx.Node, ctx: _Ctx, options: PassOptions) -> SiteReport:
    rep = SiteReport(form="softmax", rewritten=False, where=_where(sm))
    x, dim, _ = softmax_args(sm)  # a dtype= argument is a cast before the softmax: nothing to keep
    if not isinstance(x, fx.Node) or tensor_of(x) is None:
        raise Miss("softmax input is not a tensor of the graph")
    st = tensor_of(x)
    if dim is None:
        raise Miss("softmax dim is not a constant")
    if st.dim() < 2:
        raise Miss(f"softmax over a {st.dim()}-d tensor")
    if dim != st.dim() - 1:
        raise Miss(f"softmax is over dim {dim}, not the key axis (the last dim {st.dim() - 1})")
    sink = sinks.peel(sm, x)
    if sink is not None:
        x, st = sink.scores, tensor_of(sink.scores)
    scores = walk_scores(x, gm)
    probs = walk_probs(sm, options, gm, through=sink.drop if sink is not None else None)
    if sink is not None:
        scores.nodes[:0] = sink.nodes
    qk, pv = scores.contraction, probs.pv
    rep.form = f"{qk.spelling}-softmax-{pv.spelling}"
    bd = list(st.shape[:-2])
    nb = len(bd)
    o_node = pv.node
    o_val = tensor_of(o_node)
    inner_bd = list(_canon_out_shape(qk, tensor_of(qk.node))[:-2])  # where the scores are computed
    p_bd = list(tensor_of(probs.end).shape[:-2])  # where the probabilities meet V
    o_bd = list(_canon_out_shape(pv, o_val)[:-2])
    if len(o_bd) != len(p_bd) or not _same(o_bd, p_bd):
        raise Miss("the P·V contraction broadcasts the probabilities to more batch dims")
    qk_regroup, v_regroup = not _same(inner_bd, bd), not _same(p_bd, bd)
    own = set(scores.nodes) | set(probs.nodes) | {qk.node}

    q = fold(qk.lhs)
    k = fold(qk.rhs.swap_last())
    v = fold(pv.rhs)
    scale = scores.scale
    q, scale = _absorb_scale(q, scale)
    k, scale = _absorb_scale(k, scale)
    if (not qk_regroup and (q.rank > nb + 2 or k.rank > nb + 2)) or (not v_regroup and v.rank > nb + 2):
        raise Miss("q/k/v have more batch dims than the scores")
    # GQA: the last batch dim is the head axis when the layout keeps it as H
    group = 1
    if nb >= 2 and k.rank >= 3 and v.rank >= 3 and not qk_regroup and not v_regroup:
        k2 = fold(unrepeat(k, k.rank - 3))
        v2 = fold(unrepeat(v, v.rank - 3))
        if k2.group == v2.group:
            k, v, group = k2, v2, k2.group
        elif k2.group == 1 and v2.group == 1:
            k, v = k2, v2
    qb, kb, vb = (_padded_batch(t.shape, nb) for t in (q, k, v))
    if qk_regroup:
        qb, kb = list(bd), list(bd)  # regrouped from the full (expanded) inner batch
    if v_regroup:
        vb = list(bd)
    layout = _choose_layout(bd, qb, kb, vb)
    if group > 1 and layout.mode != "std":
        raise Miss("repeated K/V heads in a layout where the head axis is not the last batch dim")
    # the un-repeated head axis: Hkv * group must be the scores' head count, or 1 (broadcast)
    for name, b in (("k", kb), ("v", vb)):
        for i in range(nb):
            if not (known_one(b[i]) or known_eq(b[i] * (group if i == nb - 1 else 1), bd[i])):
                raise Miss(f"{name}'s batch dim {i} ({b[i]}) does not match the scores' ({bd[i]})")
    for i in range(nb):
        if not (known_one(qb[i]) or known_eq(qb[i], bd[i])):
            raise Miss(f"q's batch dim {i} does not match the scores'")
    if not math.isfinite(scale):
        raise Miss(f"the scores' scale is not finite ({scale})")
    flow = _effects(ctx, scores, probs, q, k, v, own)

    # dtypes: drop lossless upcasts when all three agree; otherwise compute in their common dtype
    base = [tensor_of(t.node).dtype for t in (q, k, v)]
    logical = [t.dtype for t in (q, k, v)]
    if len(set(base)) == 1:
        dtype = base[0]
    elif len(set(logical)) == 1:
        dtype = logical[0]
    else:
        dtype = torch.promote_types(torch.promote_types(logical[0], logical[1]), logical[2])
    qk_dt = tensor_of(qk.node).dtype
    if qk_dt != qk.lhs.dtype or qk_dt != qk.rhs.dtype or o_val.dtype != pv.lhs.dtype or o_val.dtype != pv.rhs.dtype:
        # autocast: eager's products computed in their output dtype, whatever their operands' dtype
        if qk_dt != o_val.dtype:
            raise Miss(f"the Q·Kᵀ and P·V products compute in different dtypes ({qk_dt}, {o_val.dtype}: autocast)")
        dtype = qk_dt
    o_out = out_target(o_node)

    graph = gm.graph
    o = _Out(graph, o_node)
    try:
        terms = scores.terms
        with graph.inserting_before(o_node):
            terms = [MaskTerm("add", o.call(operator.neg, t.tensor)) if t.op == "sub" else t for t in terms]
            terms = [MaskTerm("fill", o.call(operator.eq, t.tensor, 0), t.fill) if t.op == "fill_zero" else t
                     for t in terms]
            terms = [MaskTerm("add", o.call(operator.mul, t.tensor, t.fill if t.op == "add_scaled" else -t.fill))
                     if t.op in ("add_scaled", "sub_scaled") else t for t in terms]
            terms = [t if _same(tb, bd) else MaskTerm(t.op, _regroup(o, t.tensor, tb, bd), t.fill)
                     for t, tb in zip(terms, scores.term_batches)]
        spec = _analyze_mask(gm, terms, bd, st, o_node)
        if scores.clamped and spec.empty_rows == "nan":
            spec.empty_rows = "mean_v"  # -inf became finfo.min: a fully masked row is uniform
        if spec.empty_rows == "unknown":
            raise Miss("cannot keep eager's value on fully masked rows for this mask")
        if sink is not None and spec.empty_rows == "fill":
            raise Miss(f"attention sinks with a finite mask fill {spec.fill}: eager's fully masked rows share "
                       "their weight between the filled keys and the sink, which the rewrite cannot keep")
        if spec.empty_rows == "fill" and probs.dropout_p:
            raise Miss(f"a finite fill {spec.fill} with dropout: eager drops the masked keys' weights too, "
                       "which the rewrite cannot keep")
        with graph.inserting_before(o_node):
            qn, kn, vn = _materialize(o, q, dtype), _materialize(o, k, dtype), _materialize(o, v, dtype)
            qn = _detached(o, qn) if flow.detach_q else qn
            kn = _detached(o, kn) if flow.detach_k else kn
            vn = _detached(o, vn) if flow.detach_v else vn
            # a regroup may read x for x.reshape(B*H, N, D): not where the gradient is cut at the reshape
            if qk_regroup:
                qn = _regroup(o, qn, inner_bd, bd, full=True, see_through=not flow.detach_q)
                kn = _regroup(o, kn, inner_bd, bd, full=True, see_through=not flow.detach_k)
            if v_regroup:
                vn = _regroup(o, vn, p_bd, bd, full=True, see_through=not flow.detach_v)
            while tensor_of(qn).dim() < nb + 2:
                qn = o.call(torch.unsqueeze, qn, 0)
            while tensor_of(kn).dim() < nb + 2:
                kn = o.call(torch.unsqueeze, kn, 0)
            while tensor_of(vn).dim() < nb + 2:
                vn = o.call(torch.unsqueeze, vn, 0)
            b = _Builder(o, bd, layout, [(qn, qb), (kn, kb), (vn, vb)])
            # a K/V head axis that is 1 while the other has Hkv: broadcast it (the op needs equal heads)
            if nb >= 1:
                hk, hv = tensor_of(kn).shape[nb - 1], tensor_of(vn).shape[nb - 1]
                if known_one(hk) and not known_one(hv):
                    kn = o.call("expand", kn, *[-1] * (nb - 1), hv, -1, -1, method=True)
                elif known_one(hv) and not known_one(hk):
                    vn = o.call("expand", vn, *[-1] * (nb - 1), hk, -1, -1, method=True)
            q_padded = qn
            qo, ko, vo = b.to_op(qn, False), b.to_op(kn, True), b.to_op(vn, True)
            if nb >= 1 and layout.mode in ("std", "grouped", "bh1"):
                # batch (B') must match exactly: broadcast k/v (a view) when they were broadcast
                Bq = tensor_of(qo).shape[0]
                if not known_eq(tensor_of(ko).shape[0], Bq):
                    ko = o.call("expand", ko, o.size(qo, 0), -1, -1, -1, method=True)
                if not known_eq(tensor_of(vo).shape[0], Bq):
                    vo = o.call("expand", vo, o.size(qo, 0), -1, -1, -1, method=True)
            for node, how, fb in scores.factors:
                f = _detached(o, node) if node in flow.detach_entries else node
                ft = tensor_of(f)
                if isinstance(ft, torch.Tensor):
                    if ft.dim() > 0:
                        if not _same(fb, bd):
                            f = _regroup(o, f, fb, bd)
                        f = b.bias_to_op(f)
                    if ft.dtype != dtype:
                        f = o.call("to", f, dtype, method=True)
                qo = o.call(operator.mul if how == "mul" else operator.truediv, qo, f)
            bias = spec.bias
            if bias is not None:
                bias = b.bias_to_op(_detached(o, bias) if _bias_cut(scores, flow) else bias)
            kv_lens = spec.kv_lens
            if kv_lens is not None:
                kl = tensor_of(kv_lens)
                if kl is None or kl.dim() != 1 or layout.mode != "std" or layout.lead != 1:
                    raise Miss("key-padding lengths do not map to the op's batch axis")
                if not known_eq(kl.shape[0], tensor_of(qo).shape[0]):
                    if not known_one(kl.shape[0]):
                        raise Miss("key-padding lengths do not map to the op's batch axis")
                    # one length for every batch row (a static cache's decode position): broadcast it
                    kv_lens = o.call("expand", kv_lens, o.size(qo, 0), method=True)
            runtime = dict(q_pos=spec.q_pos, q_seg=spec.q_seg, k_seg=spec.k_seg)
            for name, t in runtime.items():  # [N] or [B, N] run-time structure: its batch must be the op's
                tv = tensor_of(t) if t is not None else None
                if tv is not None and (layout.mode != "std" or layout.lead != 1 or (
                        tv.dim() == 2 and not known_one(tv.shape[0])
                        and not known_eq(tv.shape[0], tensor_of(qo).shape[0]))):
                    raise Miss(f"{name} does not map to the op's batch axis")
            filled = spec.filled
            if filled is not None and emit.needs_qk_grad(qo, ko):
                if probs.dropout_p > 0 or sink is not None:
                    raise Miss("a fill before an additive mask with dropout or sinks: eager's cut gradient of the "
                               "filled scores on fully masked rows cannot be kept there")
                filled = b.bias_to_op(filled)
            sink_arg = None
            if sink is not None:
                if nb != 2 or layout.mode != "std" or not (known_eq(tensor_of(qo).shape[1], bd[1])):
                    raise Miss("attention sinks: the scores' head axis does not map to the op's")
                sink_arg = sinks.head_logits_for_op(graph, sink)
                o.made.append(sink_arg)
            out, call = emit.emit_attention(
                graph, qo, ko, vo, scale=scale, causal=spec.causal, diag_offset=spec.diag_offset,
                window_left=spec.window_left, window_right=spec.window_right, bias=bias, kv_lens=kv_lens,
                softcap=scores.softcap, dropout_p=probs.dropout_p, kernel=options.kernel, empty_rows=spec.empty_rows,
                fill=spec.fill, sinks=sink_arg, filled=filled, **runtime,
            )
            o.made.append(out)
            res = b.out_from_op(out, q_padded)
            if v_regroup:
                res = _regroup(o, res, bd, p_bd, full=True)
            if pv.out_perm != identity(len(pv.out_perm)):
                res = o.call(torch.permute, res, pv.out_perm)
            if tensor_of(res).dtype != o_val.dtype:
                res = o.call("to", res, o_val.dtype, method=True)
            if o_out is None and mutated_downstream(o_node):
                res = o.call("clone", res, method=True)  # `o += x` must not write into the op's saved output
            if _needs_contiguous(o_node, tensor_of(res)):
                res = o.call("contiguous", res, method=True)
            if o_out is not None:
                res = o.call("copy_", o_out, res, method=True)  # `out=`: the caller's tensor gets the result

        qv, kv_, vv = tensor_of(qo), tensor_of(ko), tensor_of(vo)
        rep.q_shape, rep.k_shape, rep.v_shape = _shape(qv), _shape(kv_), _shape(vv)
        rep.dtype = str(dtype)
        rep.mask = spec.kind if scores.terms else "none"
        hq, hkv = qv.shape[1], kv_.shape[1]
        if not known_eq(hq, hkv):
            how = "repeat removed" if group > 1 else "broadcast"
            rep.gqa = f"Hq={hq}/Hkv={hkv} ({how})"
        rep.softcap = scores.softcap
        rep.dropout_p = probs.dropout_p
        rep.scale = scale if not scores.factors else f"{scale:g} * tensor factors"
    except Miss:
        o.rollback()
        raise
    except Exception as e:  # a fake run rejected the glue, or an unforeseen failure: leave the site alone
        o.rollback()
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise Miss(f"rewrite failed: {type(e).__name__}: {msg}") from e
    # the commit: nothing below raises (_erase_dead skips what it cannot erase)
    o_node.replace_all_uses_with(res)
    _erase_dead(graph, [o_node] + list(reversed(probs.nodes)) + scores.nodes + [qk.node])
    rep.rewritten = True
    rep.call = call
    return rep


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(known_eq(x, y) for x, y in zip(a, b))


def _target_sizes(sizes: list) -> list:
    """Sizes for reshape/expand arguments: ints, with at most one symbolic size given as -1."""
    sym = [i for i, s in enumerate(sizes) if not isinstance(s, int)]
    if len(sym) > 1:
        raise Miss("batch dims regrouped with more than one symbolic size")
    return [-1 if i in sym else s for i, s in enumerate(sizes)]


def _regroup(o: "_Out", node: Any, from_bd: list, to_bd: list, full: bool = False, see_through: bool = True) -> Any:
    """A tensor broadcasting to [*from_bd, X, Y] -> the same values broadcasting to [*to_bd, X, Y]
    (the batch dims regrouped as a view/reshape of the scores does). full: node has from_bd exactly.
    see_through: `x.reshape(B*H, N, D)` may be regrouped by reading x (False where eager's gradient
    stops at the reshape, e.g. one made under no_grad: reading x would give x a gradient)."""
    t = tensor_of(node)
    if t is None:
        return node  # a Python scalar broadcasts anywhere
    if t.dim() <= 2:
        return node
    batch = _padded_batch(t.shape, len(from_bd)) if t.dim() <= len(from_bd) + 2 else None
    if batch is None:
        raise Miss("a mask has more batch dims than the scores")
    if not full and all(known_one(b) for b in batch):
        return o.call(torch.flatten, node, 0, t.dim() - 3)  # [1, .., 1, X, Y] -> [1, X, Y]
    while tensor_of(node).dim() < len(from_bd) + 2:
        node = o.call(torch.unsqueeze, node, 0)
    if not _same(batch, from_bd):
        need = [f if (known_one(b) and not known_one(f)) else -1 for b, f in zip(batch, from_bd)]
        if any(not isinstance(x, int) for x in need):
            raise Miss("a broadcast mask must be expanded along a symbolic batch dim")
        node = o.call("expand", node, *need, -1, -1, method=True)
    want = list(to_bd) + list(tensor_of(node).shape[-2:])
    src = node.args[0] if see_through and kind(node) == "reshape" and node.args else None
    if tensor_of(src) is not None and _same(list(tensor_of(src).shape), want):
        return src  # x.reshape(B*H, N, D) regrouped back to [B, H, N, D] is x itself
    last = [o.size(node, -2), o.size(node, -1)]
    return o.call("reshape", node, *_target_sizes(list(to_bd)), *last, method=True)


def _canon_out_shape(c: Contraction, val: torch.Tensor) -> tuple:
    """The contraction output's shape in canonical [batch..., M, N] order."""
    shape = [None] * val.dim()
    for i, p in enumerate(c.out_perm):
        shape[p] = val.shape[i]
    return tuple(shape)


def _absorb_scale(v: View, scale: float) -> tuple[View, float]:
    """q * c (or k * c, q / c) computed before the contraction: move c into the op's scale."""
    for _ in range(4):
        n = v.node
        k = kind(n)
        if k not in ("mul", "div") or len(n.users) != 1 or is_inplace(n):
            break  # `q *= c` writes into q itself: the op must read the scaled tensor
        a, b = n.args[0], arg(n, 1, "other")
        if k == "mul" and is_finite_number(a) and isinstance(b, fx.Node):
            a, b = b, a
        if not (isinstance(a, fx.Node) and is_finite_number(b)) or b == 0:
            break
        ta = tensor_of(a)
        if ta is None or ta.dim() != tensor_of(n).dim() or ta.dtype != tensor_of(n).dtype:
            break
        scale = scale * float(b) if k == "mul" else scale / float(b)
        v = fold(View(a, v.perm, v.dtype, v.group, v.bcast_axes))
    return v, scale


def _erase_dead(graph: fx.Graph, nodes: list) -> None:
    seen: set = set()
    for n in nodes:
        if n in seen:
            continue
        seen.add(n)
        if not getattr(n, "_erased", False) and not n.users and n.op not in ("placeholder", "output"):
            try:
                graph.erase_node(n)
            except Exception:
                pass


def rewrite_softmax_sites(gm: fx.GraphModule, options: PassOptions) -> list[SiteReport]:
    softmaxes = [n for n in gm.graph.nodes if kind(n) == "softmax"]
    if not softmaxes:
        return []
    ctx = _Ctx(gm)
    reports = []
    for sm in softmaxes:
        try:
            reports.append(_site(gm, sm, ctx, options))
        except Exception as e:  # Miss, or a spelling this code did not foresee: never break the compile
            reason = str(e) if isinstance(e, Miss) else f"not analysed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            reports.append(SiteReport(form="softmax", rewritten=False, reason=reason, where=_where(sm),
                                      dtype=str(tensor_of(sm).dtype) if tensor_of(sm) is not None else None))
    return reports
