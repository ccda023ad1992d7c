"""The entry point: analyze_mask tries the plans a site's terms admit, most structured first."""
from __future__ import annotations

import itertools
import math
from typing import Any, Optional, Union

import torch
import torch.fx as fx

from ..emit import example_value
from ..site import MaskSpec
from .symbolic import Size, _DEBUG, _sym_true
from .values import _Fail, _Keep
from .analyzer import _Analyzer
from .combine import ABSORB_LIMIT, _TermInfo, _combine, _term_info, untouched_add
from .spec import _Emitter, _emit_spec


def analyze_mask(
    gm: fx.GraphModule,
    terms: list,
    *,
    batch: Size,
    q_heads: Size,
    q_len: Size,
    k_len: Size,
    scores_dtype: torch.dtype,
    insert_before: fx.Node,
    sdpa: bool = False,
    bias_rank: int = 4,
) -> Union[MaskSpec, str]:
    """The MaskSpec of a site whose scores receive `terms` in order, or the reason to refuse it. bias_rank:
    the most dims a residual mask (spec.bias) may keep, that of scores the caller flattens to the op's."""
    if not terms:
        return MaskSpec()
    try:
        return _analyze(gm, terms, batch=batch, q_len=q_len, k_len=k_len, scores_dtype=scores_dtype,
                        insert_before=insert_before, sdpa=sdpa, bias_rank=bias_rank)
    except Exception as e:  # an unforeseen graph form refuses the site; it never breaks compilation
        if _DEBUG:
            raise
        return f"mask analysis failed: {type(e).__name__}: {e}"


def _analyze(gm, terms, *, batch, q_len, k_len, scores_dtype, insert_before, sdpa,
             bias_rank: int = 4) -> Union[MaskSpec, str]:
    sdpa = sdpa or any(t.op == "bool" for t in terms)  # a bool keep-mask is SDPA's: empty rows give 0
    an = _Analyzer(gm)
    infos = []
    for t in terms:
        info = _term_info(an, t, scores_dtype, q_len, k_len)
        if isinstance(info, str):
            return info
        infos.append(info)
    for i, t in enumerate(infos):  # in eager's order: infos[i + 1:] are applied after term i
        if t.shift and any(infos[j].finite for j in range(i + 1, len(infos))):
            return ("a constant is added to the scores before a finite fill: the filled entries do not move with "
                    "it, so softmax is not invariant to it")

    def is_mask_add(i: int) -> bool:
        t = infos[i]
        return (t.op == "add" and t.converted and t.keep is not None and (t.keep.structural or bool(t.keep.data))
                and isinstance(terms[i].tensor, fx.Node))

    def untouched_adds(src: list) -> list:
        # additive masks passed as they are: the op then does eager's own arithmetic on them
        return [untouched_add(an, terms[i].tensor, infos[i].applied) if is_mask_add(i) else t
                for i, t in enumerate(src)]

    def destructured(src: list) -> list:
        # no structure at all: each keep-mask is passed as the (smallest) mask node itself
        out = []
        for i, t in enumerate(src):
            if t.op in ("fill", "where", "bool") and t.keep is not None and t.keep.structural:
                t = _TermInfo(t.op, t.c, keep=_Keep(data=((an.smallest(terms[i].tensor), t.op == "fill"),)))
            out.append(t)
        return out

    def additive(src: list) -> Optional[list]:
        # every term as an additive float: masked_fill(T, c) == + where(T, c, 0) when c absorbs every score
        # (fp32 s + c == c for |s| < 1e22 when c <= ABSORB_LIMIT). A fill overwrites what came before it
        # (eager: an earlier -inf or s + bias becomes c), addition does not: so a finite fill must be the
        # very first term; -inf fills may come anywhere (-inf + anything finite or -inf stays -inf).
        out = []
        for i, t in enumerate(src):
            if t.op == "add":
                out.append(t if not is_mask_add(i) else untouched_adds(src)[i])
                continue
            if t.c != -math.inf and (t.c > ABSORB_LIMIT or i > 0):
                return None
            if t.c != -math.inf and not _within_lse_range(t.c, [infos[j].c for j in range(i + 1, len(infos))
                                                                if is_mask_add(j)], scores_dtype):
                refusals.append(f"a fill {t.c:g} with additive masks whose sum on a fully masked row lies beyond "
                                "the op's fp32 log-sum-exp (fp64 scores)")
                return None
            if t.c != -math.inf and not fill_gradient_kept(i):
                if not later_masks_only(i):
                    refusals.append("a finite fill mixed with an additive float bias: on a fully masked row "
                                    "eager's filled scores get no gradient, the op's bias would pass one "
                                    "(training graph)")
                    return None
                filled.append((terms[i].tensor, t.op == "fill"))  # emit removes the op's gradient there
            node = terms[i].tensor
            # masked where node is True for fill, False otherwise; in the scores' dtype (fp64 keeps c exact)
            item = ("where", node, t.c, t.op == "fill", scores_dtype)
            out.append(_TermInfo("add", 0.0, keep=None, extra=(item,), converted=False))
        return out

    def fill_gradient_kept(i: int) -> bool:
        # A fill gives its entries no gradient; as an additive where(T, c, 0) they get softmax's, which
        # differs only on rows where they keep a weight: fully masked rows (uniform). It stays exact when
        # the graph needs no gradient, or when a later 0-or-c' mask masks every filled entry too and
        # c + c' overflows to -inf (weight 0 on both sides: GPT-Neo's causal where() + causal/padding mask).
        if not _needs_grad(insert_before):
            return True
        f = infos[i]
        if f.keep is None or f.keep.inverted:
            return False
        for j in range(i + 1, len(infos)):
            a = infos[j]
            if is_mask_add(j) and not a.keep.inverted and _sum_is_neg_inf(f.c, a.c, scores_dtype) \
                    and _keep_within(a.keep, f.keep):
                return True
        return False

    def later_masks_only(i: int) -> bool:
        # every later term is a 0-or-c' mask (c' <= 0) or a -inf fill: a filled entry is then <= c in the
        # op's bias, so it keeps a weight only on rows whose lse is about c (emit_attention's `filled`)
        return all((is_mask_add(j) and infos[j].c <= 0) or (infos[j].op in ("fill", "where")
                                                            and infos[j].c == -math.inf)
                   for j in range(i + 1, len(infos)))

    refusals: list = []
    filled: list = []  # (mask node, True where it is the filled entries) of the additive attempt
    attempts = [infos]
    if any(is_mask_add(i) for i in range(len(infos))):
        attempts.append(untouched_adds(infos))
    if any(t.keep is not None and t.keep.structural for t in attempts[-1]):
        attempts.append(destructured(attempts[-1]))
    add_only = None
    if any(t.op in ("fill", "where", "bool") for t in infos) and len(infos) > 1:
        add_only = additive(infos)
        if add_only is not None:
            attempts.append(add_only)
    reason = ""
    for attempt in attempts:
        plan = _combine(attempt, an, q_len, k_len, sdpa)
        if isinstance(plan, str):
            reason = reason or plan
            continue
        if attempt is add_only and filled:
            plan["filled"] = filled[0]
        em = _Emitter(gm, insert_before)
        try:
            return _emit_spec(em, plan, batch, q_len, k_len, bias_rank)
        except _Fail as e:
            em.rollback()
            reason = reason or f"mask structure proven but not expressible: {e}"
        except Exception:
            em.rollback()
            raise
    return f"{reason}; {refusals[0]}" if refusals else reason


def _needs_grad(node: Any) -> bool:
    """Whether the site's output (a node's example value, or the first tensor of a tuple) needs a gradient."""
    v = example_value(node)
    if isinstance(v, (tuple, list)):
        v = next((x for x in v if isinstance(x, torch.Tensor)), None)
    return not isinstance(v, torch.Tensor) or v.requires_grad  # unknown: assume it does


def _within_lse_range(c: float, later: list, dtype: torch.dtype) -> bool:
    """c plus any subset of the later additive mask values (in eager's order) is -inf or within fp32's
    range in `dtype`: a row of such values (uniform in eager) has an lse the op's fp32 lse holds, so it
    is not read as an empty row."""
    lim = torch.finfo(torch.float32).max
    for picks in itertools.product((False, True), repeat=len(later)):
        total = torch.tensor(c, dtype=dtype)
        for a, pick in zip(later, picks):
            if pick:
                total = total + torch.tensor(a, dtype=dtype)
        if not (torch.isneginf(total) or total.abs() <= lim):
            return False
    return True


def _sum_is_neg_inf(c1: float, c2: float, dtype: torch.dtype) -> bool:
    return bool(torch.isneginf(torch.tensor(c1, dtype=dtype) + torch.tensor(c2, dtype=dtype)))


def _keep_within(a: "_Keep", f: "_Keep") -> bool:
    """Every entry keep-mask `a` admits is admitted by `f` (a's conjunction implies each factor of f)."""
    if f.lo is not None and not (a.lo is not None and _sym_true(a.lo >= f.lo)):
        return False
    if f.hi is not None and not (a.hi is not None and _sym_true(a.hi <= f.hi)):
        return False
    if f.lens is not None and a.lens != f.lens:
        return False
    if (f.qpos is not None and a.qpos != f.qpos) or (f.seg is not None and a.seg != f.seg):
        return False
    return set(f.data) <= set(a.data)
