"""Walking forward from a softmax to its P·V: casts and dropout only, nothing else reading the
probabilities (the "forward" step of find_sites)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.fx as fx

from ..aliasing import same_value
from ..canonicalize import (
    arg, constant_value, dropout_args, exp_lse_of, exp_sum_of, first_input, is_finite_number, is_inplace, kind,
    log_softmax_of, reads_only_metadata, tensor_of,
)
from ..constants import read_float
from ..layout import Contraction, contraction, identity
from ..shapes import known_eq
from ..site import MaskSpec, PassOptions
from .empty_row_test import row_test_nodes
from .scores import Miss, Scores, _describe, _regroups_batch


@dataclass
class ZeroFill:
    """The probabilities set to 0 where `mask` is `where` (masked_fill(p, m, 0), where(m, 0, p), where(m, p, 0))."""
    node: fx.Node
    mask: fx.Node
    where: bool
    shape: tuple  # the probabilities' shape there, which the mask broadcasts to
    # where the mask is "every score of the row is -inf" (empty_row_test.py): the nodes computing it, readers first
    row_test: list = field(default_factory=list)
    zeros: Optional[fx.Node] = None  # a zeros-like tensor of the probabilities that gives the 0 (read by node only)


_ZEROS_LIKE = (torch.zeros_like, torch.full_like)


def _zero(x: Any, cur: fx.Node) -> tuple[bool, Optional[fx.Node]]:
    """(x is 0 wherever it meets the probabilities `cur`, the node that makes it when it is a tensor like `cur`):
    a constant 0, or `torch.zeros_like(cur)` / `torch.full_like(cur, 0)` in cur's dtype (the core ATen IR's 0),
    read by nothing else."""
    if constant_value(x) == 0:
        return True, None
    if not (isinstance(x, fx.Node) and x.op == "call_function" and x.target in _ZEROS_LIKE and x.args
            and x.args[0] is cur and len(x.users) == 1):
        return False, None
    positional = 1 if x.target is torch.zeros_like else 2
    fill = 0 if x.target is torch.zeros_like else arg(x, 1, "fill_value")
    if len(x.args) > positional or constant_value(fill) != 0 or set(x.kwargs) - {"dtype", "pin_memory",
                                                                                "memory_format", "fill_value"}:
        return False, None
    if x.kwargs.get("dtype") not in (None, getattr(tensor_of(cur), "dtype", None)):
        return False, None
    return True, x


@dataclass
class Probs:
    end: fx.Node  # the tensor that enters P·V
    pv: Contraction
    dropout_p: float = 0.0
    nodes: list = field(default_factory=list)  # softmax .. end
    zeroed: Optional[ZeroFill] = None
    shadows: list = field(default_factory=list)  # copies of the chain read only for their dtype / shape


def _zero_fill(u: fx.Node, cur: fx.Node, scores_in: Optional[fx.Node] = None) -> Optional[ZeroFill]:
    """u as a ZeroFill of the probabilities `cur`, or None. Only an exact 0 over a bool mask that keeps the
    probabilities' shape (a broadcast to more dims would be another tensor). With `scores_in`, the softmax's input,
    a mask that tests whether every score of the row is -inf is named as such (empty_row_test.py)."""
    k = kind(u)
    zeros = None
    if k == "masked_fill" and u.args and u.args[0] is cur and constant_value(arg(u, 2, "value")) == 0:
        mask, where = arg(u, 1, "mask"), True
    elif k == "where" and len(u.args) == 3 and cur in u.args[1:] and u.args[1] is not u.args[2]:
        is_zero, zeros = _zero(u.args[2] if u.args[1] is cur else u.args[1], cur)
        if not is_zero:
            return None
        mask, where = u.args[0], u.args[2] is cur
    else:
        return None
    t, mt, ct = tensor_of(u), tensor_of(mask), tensor_of(cur)
    if mt is None or mt.dtype != torch.bool or t is None or ct is None or t.dim() != ct.dim() or not all(
            known_eq(a, b) for a, b in zip(t.shape, ct.shape)):
        return None
    test = row_test_nodes(mask, scores_in) if scores_in is not None and where else None
    if test is not None and set(mask.users) != {u}:
        test = None
    return ZeroFill(u, mask, where, tuple(ct.shape), row_test=test or [], zeros=zeros)


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


def _metadata_copy(u: fx.Node, cur: fx.Node) -> bool:
    """u is a cast or copy of `cur` whose every reader takes only its dtype / shape."""
    return (kind(u) in ("cast", "identity") and first_input(u) is cur and not is_inplace(u) and bool(u.users)
            and all(reads_only_metadata(r, u) for r in u.users))


def walk_probs(sm: fx.Node, options: PassOptions, gm: Optional[fx.GraphModule] = None,
               through: Optional[fx.Node] = None, scores_in: Optional[fx.Node] = None) -> Probs:
    lsm = log_softmax_of(sm)  # exp(log_softmax(s)): both nodes are the softmax
    if lsm is not None and len(lsm.users) != 1:
        names = ", ".join(u.name for u in lsm.users if u is not sm)
        raise Miss(f"the log-probabilities are also read by {names}; only the exp to the probabilities may read them")
    es = exp_sum_of(sm)  # exp(y) / Σ exp(y), y = s - rowmax(s): the exp, its sum and the division are the softmax
    if es is not None:
        e, den = es
        if set(e.users) != {den, sm} or set(den.users) != {sm}:
            names = ", ".join(u.name for n in (e, den) for u in n.users if u not in (den, sm))
            raise Miss(f"the exponentiated scores or their row sums are also read by {names}; only the softmax's own "
                       "division may read them")
    el = exp_lse_of(sm)  # exp(s - logsumexp(s)): the subtraction and the logsumexp are the softmax
    if el is not None:
        d, lse = el
        if set(d.users) != {sm} or set(lse.users) != {d}:
            names = ", ".join(u.name for n in (d, lse) for u in n.users if u not in (d, sm))
            raise Miss(f"the scores' logsumexp or the log-probabilities are also read by {names}; only the exp to the "
                       "probabilities may read them")
    pre = [lsm] if lsm is not None else (list(es) if es is not None else (list(reversed(el)) if el else []))
    cur, nodes, dropout_p, zeroed = sm, pre + [sm], 0.0, None
    shadows: list = []
    for _ in range(32):
        users = list(cur.users)
        if any(u.op == "output" for u in users):
            raise Miss(_leaves_graph(gm, cur))
        # a copy of the probabilities read only for its dtype or shape (fair-esm: `w = p.type_as(s)`, then
        # `dropout(p.type_as(w))`) uses no value: it goes with the site's nodes (erased once its readers are)
        shade = [u for u in users if len(users) > 1 and _metadata_copy(u, cur)]
        # the zeros a zero fill reads besides the probabilities (`where(test, zeros_like(p), p)`)
        shade += [u for u in users if len(users) > 1 and u not in shade and any(
            (zf := _zero_fill(r, cur, scores_in)) is not None and zf.zeros is u for r in users)]
        users = [u for u in users if u not in shade]
        shadows += shade
        if not users and isinstance(cur.kwargs.get("out"), fx.Node):
            raise Miss(f"the probabilities are written into a caller's tensor (out={cur.kwargs['out'].name}), "
                       "which the P·V product reads")
        if len(users) != 1:
            names = ", ".join(u.name for u in users)
            raise Miss(f"probabilities have {len(users)} users ({names}); only a P·V contraction may read them")
        u = users[0]
        k = kind(u)
        if (k in ("cast", "identity") or (k == "reshape" and _regroups_batch(u))) and first_input(u) is cur:
            cur = u
        elif u is through:  # the sink column dropped (patterns/sinks.py)
            cur = u
        elif (zf := _zero_fill(u, cur, scores_in)) is not None:  # checked against the scores' mask by zeroed_rows
            if zeroed is not None:
                raise Miss("the probabilities are set to 0 twice after the softmax")
            zeroed, cur = zf, u
        elif k == "dropout" and first_input(u) is cur:
            _, p, training = dropout_args(u)
            if training is False:  # the identity whatever p is (a module's p is a run-time value under dynamic=True)
                cur = u
                nodes.append(cur)
                continue
            if not isinstance(training, bool):
                raise Miss("dropout with a non-constant training flag")
            if not is_finite_number(p):
                # dynamic=True makes a module's float attribute a graph input: read as a constant the backend checks
                # on every call, as the scale is (constants.read_float)
                value = read_float(p)
                if value is None or not math.isfinite(value):
                    raise Miss("dropout in training with a run-time p (dynamic=True makes a module's float attribute "
                               "a graph input); the op's p is a constant")
                p = value
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
            return Probs(cur, c, dropout_p, nodes, zeroed, shadows)
        nodes.append(cur)
    raise Miss("probabilities chain too long")


def zeroed_rows(zf: ZeroFill, scores: Scores, spec: MaskSpec, gm: fx.GraphModule, st: torch.Tensor,
                terms: list) -> str:
    """The empty_rows of a site whose probabilities `zf` sets to 0 after the softmax (DeBERTa's XSoftmax), or Miss.
    Setting to 0 the very scores a fill before the softmax absorbed changes no row that keeps a key (their weight
    is already 0, and so is the gradient through them). A row with no admissible key it zeroes entirely when that
    fill is the last mask term and the others mask no key: eager's output there is 0 and nothing gets a gradient
    from it, which is the op's own value for an empty row ("zero")."""
    from ..masks import adds_bias_only
    from ..masks.combine import _absorbs

    if zf.row_test:
        return _zeroed_empty_rows(scores, spec, st)
    name = f"{zf.mask.name} is {zf.where}"
    hits = [i for i, t in enumerate(scores.terms) if t.op in ("fill", "where") and same_value(t.tensor, zf.mask)
            and (t.op == "fill") == zf.where and _same_shape(tuple(scores.term_batches[i]) + tuple(st.shape[-2:]),
                                                            zf.shape)]
    if not hits:
        raise Miss(f"the probabilities are set to 0 where {name} ({zf.node.name}), which is not proven to be where "
                   "a fill before the softmax masked the scores (the same mask at the same positions): eager changes "
                   "rows there that the op would compute in full")
    i = hits[0]
    term = scores.terms[i]
    if isinstance(term.fill, fx.Node):
        raise Miss(f"the probabilities are set to 0 where {name} after a fill read from a tensor ({term.fill.name}), "
                   "which is not proven to absorb the scores")
    if not _absorbs(term.fill, term.dtype if term.dtype is not None else st.dtype):
        raise Miss(f"the scores are filled with {term.fill:g} where {name} and the probabilities set to 0 there after "
                   "the softmax: that fill does not absorb the scores (the filled keys keep a weight), so the zeroing "
                   "changes every row, which the op cannot do")
    if scores.clamped:
        raise Miss("probabilities set to 0 after a softmax of scores clamped by max(s, finfo.min): not analysed")
    if spec.empty_rows == "impossible":
        return "impossible"  # every row keeps a key: the zeroing changes nothing
    # `terms`: scores.terms as the mask analysis reads them (a bias added before the scale is its scaled product)
    others = [t for j, t in enumerate(terms) if j != i]
    if i != 0 or not all(adds_bias_only(gm, t, st.dtype, st.shape[-2], st.shape[-1]) for t in others):
        raise Miss(f"the probabilities are set to 0 where {name} after the softmax, and other mask terms of the "
                   "scores (applied after that fill, or masking keys themselves) may leave a row with no admissible "
                   "key that the zeroing does not cover: eager keeps weights there, the op gives 0")
    if spec.empty_rows not in ("nan", "mean_v"):
        raise Miss(f"probabilities set to 0 after the softmax where eager's empty rows are {spec.empty_rows!r}: "
                   "not analysed")
    return "zero"


def _zeroed_empty_rows(scores: Scores, spec: MaskSpec, st: torch.Tensor) -> str:
    """The empty_rows of a site whose probabilities are set to 0 where every score of the row is -inf (a safe
    softmax, empty_row_test.py). With finite q and k only the mask's -inf fills make a score -inf, so those are the
    rows with no admissible key: where eager's softmax gives NaN there ("nan"), the zeroing makes them the op's own
    0; where every row keeps a key it changes nothing. (`nan_to_num(p)` is not such a zeroing: it also zeroes the
    rows a NaN in q or k makes NaN, which the op keeps NaN, so it is left alone.)"""
    if scores.clamped:
        raise Miss("probabilities set to 0 where a row of scores is all -inf, after the scores were clamped by "
                   "max(s, finfo.min): not analysed")
    if spec.empty_rows in ("impossible", "zero"):
        return spec.empty_rows
    if spec.empty_rows != "nan" and all(t.op in ("fill", "where") and is_finite_number(t.fill)
                                        for t in scores.terms):
        return spec.empty_rows  # finite fills only: no score is -inf and no softmax row NaN, the zeroing changes nothing
    if spec.empty_rows != "nan":
        raise Miss(f"probabilities set to 0 where a row of scores is all -inf, where eager's rows with no admissible "
                   f"key are {spec.empty_rows!r} (a finite fill): not analysed")
    added = [t for t in scores.terms if t.op not in ("fill", "where")]
    if st.requires_grad and added:
        # the softmax's backward is NaN on such a row (its output there is NaN before the zeroing); a masked_fill or
        # where puts 0 in its place at every masked score, an added mask passes it on to Q·Kᵀ
        raise Miss("probabilities set to 0 where a row of scores is all -inf, with an additive mask and a gradient: "
                   "eager's gradient of such a row is NaN and reaches q and every key of the head, the op's is 0")
    return "zero"


def _same_shape(a: tuple, b: tuple) -> bool:
    return len(a) == len(b) and all(known_eq(x, y) for x, y in zip(a, b))
