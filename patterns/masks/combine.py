"""Mask terms to a plan: each term's masked value and keep-mask, combined into one structure with
eager's semantics on fully masked rows (or a refusal reason)."""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional, Union

import torch
import torch.fx as fx

from ..aliasing import op_name
from ..emit import example_value, op_accepts
from ..site import MaskTerm
from .symbolic import Size, _dtype, _same, _shape, _sym_true
from .values import _Fail, _Keep, _Konst, _QPos, _TRUE, _Two, _and, _not
from .concrete import _scalar
from .analyzer import _Analyzer, _nonunit


ABSORB_LIMIT = -1e30  # fp32 s + c == c for |s| < 1e22 when c <= this: a fill then acts as an additive c


# ----------------------------------------------------------------------------- assembling a MaskSpec

@dataclass
class _TermInfo:
    op: str
    c: float  # masked value (-inf or finite) for converted terms
    keep: Optional[_Keep] = None  # None: untouched float term
    extra: tuple = ()  # float nodes added (untouched terms: the term node itself)
    converted: bool = True
    absorbs: bool = True  # additive 0-or-c: eager's s + c rounds to c, so a fully masked row is uniform
    finite: bool = False  # a fill whose c is not negligible next to admissible scores (see _negligible)
    applied: Optional[torch.dtype] = None  # converted additive terms: the dtype eager adds them in
    shift: bool = False  # a nonzero constant added to every score: dropped, as softmax ignores it (see analyze)


def _absorbs(c: float, dtype: torch.dtype) -> bool:
    """s + c == c in `dtype` for every plausible score s: c <= ABSORB_LIMIT (|s| < 1e22 in fp32/bf16), or
    fp16's finfo.min, which absorbs |s| <= 16 only (eager's own fp16 result is rounding noise beyond)."""
    if c == -math.inf:
        return True
    return c <= ABSORB_LIMIT or (dtype == torch.float16 and c <= float(torch.finfo(torch.float16).min))


def untouched_add(an: _Analyzer, node: fx.Node, applied: torch.dtype) -> _TermInfo:
    """A float mask passed to the op as it is (the op adds it to fp32 scores). Added in fp16 (fp16 scores and
    an fp16 mask), eager's sum rounds a score into fp16's finfo.min (-65504 absorbs |s| <= 16), which fp32 does
    not: such entries are passed as fp32 finfo.min, which the op's fp32 absorbs too ("absorb16", spec.py), so a
    row masked entirely stays uniform instead of weighed by its scores."""
    if applied == torch.float16 and _dtype(node) == torch.float16:
        return _TermInfo("add", 0.0, keep=None, extra=(("absorb16", an.smallest(node)),), converted=False)
    return _TermInfo("add", 0.0, keep=None, extra=(an.smallest(node),), converted=False)


def adds_bias_only(gm: fx.GraphModule, term: MaskTerm, scores_dtype: torch.dtype, q_len: Size, k_len: Size) -> bool:
    """Whether `term` adds to the scores without masking a key: a constant, or a float bias the op is passed as it is
    (not proven to be 0-or-c; an fp16 one that rounds scores into fp16's finfo.min is a mask, see untouched_add)."""
    if term.op != "add":
        return False
    info = _term_info(_Analyzer(gm), term, scores_dtype, q_len, k_len)
    if isinstance(info, str):
        return False
    if info.converted:
        return info.keep is _TRUE
    return not any(isinstance(x, tuple) and x[:1] == ("absorb16",) for x in info.extra)


MODERATE = -1e22  # a float mask above this (and finite) never absorbs a score beside a fill c <= ABSORB_LIMIT
# Products: their values are scores' kin, held to the plausibility every absorbing fill already assumes of the scores
# (|s| < 1e22). baddbmm's first argument is added, not multiplied, and is followed.
_PRODUCTS = frozenset({"matmul", "bmm", "einsum", "linear", "mm", "mv", "conv1d", "conv2d", "baddbmm", "addmm",
                       "__matmul__", "embedding"})
_LIMIT = 400


def _moderate(an: _Analyzer, x) -> bool:
    """Whether a float mask part never comes near an absorbing fill: a 0/1 bool mask added as a float; a compile-time
    constant (an ALiBi bias built from positions) evaluated here; or a bias computed from products and learned
    parameters (relative-position attention, T5's bias embedding), as plausible as the scores themselves. Not a
    tensor from the inputs or a buffer that is not read here (a padding mask of finfo.min or -inf), nor anything
    built with a constant beyond MODERATE (masked_fill(m, finfo.min), (1 - m) * finfo.min), nor anything written in
    place on its way here."""
    if isinstance(x, tuple):
        return x[0] == "to"  # ("to", bool mask, dtype): 0 or 1; ("absorb16", ...) holds fp16's finfo.min
    if not isinstance(x, fx.Node):
        return False
    if an.ev.can_fold(x):
        try:
            val = an.ev.evaluate(x)
        except Exception:  # noqa: BLE001 - not evaluable: judged by how it is built below
            val = None
        if isinstance(val, torch.Tensor):
            return val.dtype == torch.bool or val.numel() == 0 or bool((val.isfinite() & (val > MODERATE)).all())
    seen, todo = {x}, [x]
    while todo:
        n = todo.pop()
        if len(seen) > _LIMIT:
            return False
        if an.ev.written(n):  # a write into it (m[i] = -inf, index_fill_) may put any value there
            return False
        if n.op == "placeholder":
            v = example_value(n)
            learned = "_dynamo_static_input_type" in n.meta.get("tensor_dict", {}) and \
                getattr(v, "requires_grad", False)
            if isinstance(v, torch.Tensor) and v.is_floating_point() and not learned:
                return False
            continue
        if n.op not in ("call_function", "call_method"):
            return False
        scalars: list = []
        fx.node.map_aggregate((n.args, n.kwargs), lambda a: scalars.append(a) if isinstance(a, float) else a)
        if any(not math.isfinite(c) or abs(c) >= -MODERATE for c in scalars):
            return False
        name = op_name(n)
        ins = n.all_input_nodes
        if name in _PRODUCTS:
            ins = [n.args[0]] if name in ("baddbmm", "addmm") and isinstance(n.args[0], fx.Node) else []
        for a in ins:
            if a not in seen:
                seen.add(a)
                todo.append(a)
    return True


# ops that give -inf from finite inputs (log(0), x / 0, 0 ** -1, ...): a float mask built with one may mask a key
_NEG_INF_MAKERS = frozenset({"log", "log2", "log10", "log1p", "log_", "xlogy", "div", "div_", "true_divide",
                             "__truediv__", "__rtruediv__", "reciprocal", "pow", "__pow__", "__rpow__", "rsqrt",
                             "log_softmax", "logsumexp", "logit", "special_xlogy", "floor_divide", "__floordiv__"})


def _may_hold_neg_inf(an: _Analyzer, x) -> bool:
    """Whether a float mask passed to the op as it is may hold -inf at run time (a key it masks whose gradient eager
    passes on): not proven moderate (_moderate), or built with an op that makes -inf of finite values."""
    if not _moderate(an, x):
        return True
    if not isinstance(x, fx.Node) or an.ev.can_fold(x):
        return False  # a 0/1 cast, or a constant _moderate evaluated finite
    seen, todo = {x}, [x]
    while todo:
        n = todo.pop()
        if len(seen) > _LIMIT or op_name(n) in _NEG_INF_MAKERS:
            return True
        ins = n.all_input_nodes if op_name(n) not in _PRODUCTS else []
        for a in ins:
            if a not in seen:
                seen.add(a)
                todo.append(a)
    return False


def _negligible(c: float, dtype: torch.dtype) -> bool:
    """A fill c that gets weight exactly 0 next to any plausible admissible score: -inf, c <= ABSORB_LIMIT
    (e^(c - m) == 0 for every score m > -1e22), or fp16's finfo.min on fp16 scores (eager's fp16 scores
    lie above it; a row whose admissible scores are all within ~100 of it, near fp16 overflow, is the
    known limit). Other finite fills keep their exact share (empty_rows "fill")."""
    return _absorbs(c, dtype)


def _term_info(an: _Analyzer, t: MaskTerm, scores_dtype: torch.dtype, q_len: Size,
               k_len: Size) -> Union[_TermInfo, str]:
    # eager rounds a term in the dtype of the node that applies it: fp16 scores masked with fp16's
    # finfo.min and cast to fp32 for the softmax absorb it there, and an fp32 fill overflows to -inf
    scores_dtype = t.dtype if t.dtype is not None else scores_dtype
    if t.op == "add":
        if not isinstance(t.tensor, fx.Node):
            s = _scalar(t.tensor)
            if s is None or not math.isfinite(s):
                return f"additive mask constant {t.tensor!r} is not a finite number"
            return _TermInfo("add", 0.0, keep=_TRUE, shift=s != 0)  # a constant shift does not change softmax
        dt = _dtype(t.tensor)
        if dt == torch.bool:  # scores + bool adds 1.0 where True (HF GPT-Neo with a bool mask): a 0/1 bias
            item = ("to", an.smallest(t.tensor), torch.promote_types(scores_dtype, torch.float32))
            return _TermInfo("add", 0.0, keep=None, extra=(item,), converted=False)
        if dt is None or not dt.is_floating_point:
            return f"additive mask {t.tensor.name} has dtype {dt}, not a float dtype"
        v = an.value(t.tensor)
        if isinstance(v, _Konst):
            if v.value == 0 or (isinstance(v.value, float) and math.isfinite(v.value)):
                return _TermInfo("add", 0.0, keep=_TRUE, shift=v.value != 0)
            return f"additive mask {t.tensor.name} is the constant {v.value}"
        eager_dt = torch.promote_types(scores_dtype, dt)
        # s + c for a finite c that does not absorb s (fp32 -1e9, -1e4) keeps s: only the untouched bias
        # is exact, whatever the scores (a row whose admissible scores lie below c + s_masked)
        if isinstance(v, _Two):
            v = replace(v, keep=_lens_as_positions(v.keep, t.tensor, q_len))
        # Its float parts (extra) must stay well above c: one that may reach c itself (a padding mask of -inf or
        # finfo.min from the inputs, added to a finfo.min causal mask) weighs keys as no structure does. Then the
        # whole term is the op's bias, eager's own sum.
        if isinstance(v, _Two) and v.on == 0 and _absorbs(v.c, eager_dt) and _band_fits(
                v.keep, t.tensor, q_len, k_len) and all(_moderate(an, x) for x in v.extra):
            return _TermInfo("add", v.c, keep=v.keep, extra=v.extra, absorbs=True, applied=eager_dt)
        return untouched_add(an, t.tensor, eager_dt)
    if t.op not in ("fill", "where", "bool"):
        return f"unknown mask term op {t.op!r}"
    node = t.tensor
    if not isinstance(node, fx.Node) or _dtype(node) != torch.bool:
        return f"{t.op} mask {getattr(node, 'name', node)} is not a bool tensor"
    if t.op == "bool":
        c = -math.inf
    else:
        c = _scalar(t.fill) if not isinstance(t.fill, fx.Node) else None
        if isinstance(t.fill, fx.Node):  # a 0-d tensor fill (torch.full([], finfo.min), GPT-2 legacy)
            fv = an.value(t.fill)
            c = fv.value if isinstance(fv, _Konst) and isinstance(fv.value, float) else None
        if c is None:
            return f"{t.op} mask fill value {t.fill!r} is not a number"
        try:
            c = float(torch.tensor(c, dtype=torch.float64).to(scores_dtype))
        except Exception:
            return f"{t.op} mask fill value {t.fill!r} does not fit {scores_dtype}"
        if math.isnan(c) or c == math.inf:
            return f"{t.op} mask fill value {c} is not a finite number or -inf"
    small = an.smallest(node)
    try:
        k = an.keep(node)
    except _Fail:
        k = _Keep(data=((small, False),))
    if t.op == "fill":
        nk = _not(k)
        k = nk if nk is not None else _Keep(data=((small, True),))
    k = _lens_as_positions(k, node, q_len)
    if not _band_fits(k, node, q_len, k_len):
        k = _Keep(data=((small, t.op == "fill"),))
    return _TermInfo(t.op, c, keep=k, finite=not _negligible(c, scores_dtype))


def _lens_as_positions(k: _Keep, node: fx.Node, q_len: Size) -> _Keep:
    """A key bound j < y + add whose y varies along the mask's query axis (-2, of size Nq) is a bound per
    query: run-time positions j <= y[i] + add - 1 (the op's q_pos)."""
    if k.lens is None or k.inverted or k.qpos is not None or not op_accepts("q_pos"):
        return k
    y, bdim, add = k.lens
    shape = _shape(node)
    if bdim != -2 or shape is None or len(shape) < 2 or not _same(shape[-2], q_len):
        return k
    own = _nonunit(_shape(y))
    return replace(k, lens=None, qpos=_QPos(y, add - 1, qdim=-2, own_q=own[0] - len(_shape(y)) if own else -1))


def _band_fits(k: _Keep, node: fx.Node, q_len: Size, k_len: Size) -> bool:
    """A band is on the scores' own (query, key) axes: the mask's last two dims are exactly Nq, Nk."""
    shape = _shape(node)
    if shape is None or len(shape) > 4 or k.inverted:
        return False
    if k.lo is None and k.hi is None and k.lens is None and k.qpos is None and k.seg is None:
        return True  # (run-time positions and segment ids still need their axes checked below)
    if k.lo is not None or k.hi is not None:
        if len(shape) < 2 or not _same(shape[-2], q_len) or not _same(shape[-1], k_len):
            return False
    if k.lens is not None:
        _, bdim, _ = k.lens
        if not _same(shape[-1], k_len) or (bdim is not None and bdim != -4):
            return False
    if k.qpos is not None and not k.qpos.rows and (k.qpos.qdim != -2 or k.qpos.bdim not in (None, -4)):
        return False  # the positions' axes are not the scores' (query, batch) axes
    if k.seg is not None and ((k.seg[0].axis, k.seg[1].axis) != (-2, -1) or any(
            ids.bdim not in (None, -4) for ids in k.seg)):
        return False  # the ids' axes are not the scores' (query, key, batch) axes
    if k.qpos is not None or k.seg is not None:
        # run-time positions / segment ids index the scores' own (query, key) axes
        if len(shape) < 2 or not _same(shape[-1], k_len) or not _same(shape[-2], q_len):
            return False
    return True


def _never_empty(lo: Optional[Size], hi: Optional[Size], q_len: Size, k_len: Size) -> bool:
    """Every query row 0..Nq-1 admits some key 0..Nk-1 under lo <= j - i <= hi."""
    if hi is not None and not _sym_true(hi >= 0):
        return False
    if lo is not None and not _sym_true(lo <= k_len - q_len):
        return False
    if lo is not None and hi is not None and not _sym_true(lo <= hi):
        return False
    return _sym_true(k_len >= 1)


def _constant_rows_admit(an: _Analyzer, lo: Optional[Size], hi: Optional[Size], data: list, q_len: Size,
                         k_len: Size) -> bool:
    """Every query row admits some key under bool factors that are compile-time constants (index arithmetic of
    static shapes, as Reformer's chunked causal mask: `query_indices >= key_indices` over chunks that look one
    back), evaluated here, and the band lo <= j - i <= hi."""
    if type(q_len) is not int or type(k_len) is not int or not data or \
            any(b is not None and type(b) is not int for b in (lo, hi)):
        return False
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    with unset_fake_temporarily():
        keep = torch.ones(q_len, k_len, dtype=torch.bool)
        d = torch.arange(k_len).view(1, k_len) - torch.arange(q_len).view(q_len, 1)
        if lo is not None:
            keep &= d >= lo
        if hi is not None:
            keep &= d <= hi
        for node, negated in data:
            if not isinstance(node, fx.Node) or not an.ev.can_fold(node):
                return False
            val = an.ev.evaluate(node)
            if not isinstance(val, torch.Tensor) or val.dim() < 2 or val.shape[-2] not in (1, q_len) or \
                    val.shape[-1] not in (1, k_len):
                return False
            m = val != 0
            keep = keep & (~m if negated else m)
        return bool(keep.any(-1).all())


def _combine(infos: list, an: _Analyzer, q_len, k_len, sdpa: bool) -> Union[str, dict]:
    """The structure and empty-row semantics of converted / untouched terms, or a refusal reason."""
    conv = [t for t in infos if t.converted]
    untouched = [t for t in infos if not t.converted]
    lo = hi = lens = qpos = seg = None
    data: list = []
    extras: list = []
    for t in infos:
        extras.extend(t.extra)
    for t in conv:
        k = t.keep
        if k is None:
            continue
        acc = _and(_Keep(lo, hi, lens, qpos=qpos, seg=seg), _Keep(k.lo, k.hi, k.lens, qpos=k.qpos, seg=k.seg))
        if acc is None:
            return ("mask terms combine two key-length bounds, query-position limits or segment ids, or bands "
                    "not comparable for every size")
        lo, hi, lens, qpos, seg = acc.lo, acc.hi, acc.lens, acc.qpos, acc.seg
        data.extend(k.data)
    masking = [t for t in conv if t.keep is not None and (t.keep.structural or t.keep.data)]
    cs = {t.c for t in masking}
    no_empty = lens is None and qpos is None and seg is None and not untouched and not any(
        t.extra for t in infos) and (_never_empty(lo, hi, q_len, k_len) if not data else
                                     _constant_rows_admit(an, lo, hi, data, q_len, k_len))
    # rows_admit lets exp(s - logsumexp(s)) be read as softmax: every row keeps a key, and no fill lies above 0,
    # where the masked scores would set eager's logsumexp and it would round at the fill's magnitude
    rows_admit = no_empty and all(t.c <= 0 for t in masking)
    if any(t.finite for t in masking):
        plan = _finite_plan(infos, masking, lo, hi, lens, data, extras, qpos, seg)
        if isinstance(plan, dict):
            plan["rows_admit"] = rows_admit
        return plan
    # which terms may set a score to -inf on a row: fills (masked_fill / where) cut the gradient of what they mask,
    # additions (converted, or a float mask passed as it is that is not proven moderate) pass it on
    fills = any(t.op in ("fill", "where") for t in masking)
    adds = any(t.op == "add" for t in masking) or any(_may_hold_neg_inf(an, x) for t in untouched for x in t.extra)
    nan_grads = "mixed" if fills and adds else "qkv" if adds else "v"
    if not masking:
        empty = "zero" if sdpa else "nan"
    elif cs == {-math.inf}:
        empty = "zero" if sdpa else "nan"
    elif len(cs) == 1:
        fills_only = all(t.op in ("fill", "where") for t in masking)
        # fills applied after every other term overwrite it: a fully masked row is all c, uniform, and
        # gets no gradient (MPT: s + alibi, then masked_fill(padding & causal, finfo.min))
        first = next(i for i, t in enumerate(infos) if any(t is m for m in masking))
        fills_last = fills_only and all(any(t is m for m in masking) for t in infos[first:])
        if fills_last and all(t.absorbs for t in masking) and (untouched or extras):
            if not all(_moderate(an, x) for x in extras):
                return ("fully masked rows: a float mask added before an absorbing fill may itself absorb every kept "
                        "key of a row (where eager's row is uniform over all keys), which the op cannot reproduce")
            empty = "mean_v"
        elif untouched or not (len(masking) == 1 or fills_only) or not all(t.absorbs for t in masking):
            if no_empty:
                empty = "impossible"
            else:
                return ("fully masked rows: eager mixes a finite fill with other float masks there, "
                        "which the op cannot reproduce")
        elif not fills_only and any(isinstance(x, fx.Node) and getattr(example_value(x), "requires_grad", False)
                                    for x in extras):
            # eager's gradient of that bias on a fully masked row is softmax's at uniform P, which the
            # op (0 there) and emit's fix-up (q and k only) do not give: pass the mask untouched instead
            return ("fully masked rows: an additive mask absorbed a bias that needs a gradient there, "
                    "which the op cannot reproduce with the structure extracted")
        else:
            # an added mask passes the gradient to the absorbed scores, a fill does not (emit keeps both)
            empty = "mean_v" if fills_only else "mean_v_add"
    else:
        if not no_empty:
            return f"fully masked rows: eager mixes the fill values {sorted(cs)} there, which the op cannot reproduce"
        empty = "impossible"
    if no_empty and masking:
        empty = "impossible"
    return dict(lo=lo, hi=hi, lens=lens, data=data, extras=extras, empty=empty, qpos=qpos, seg=seg,
                rows_admit=rows_admit, nan_grads=nan_grads)


def _finite_plan(infos: list, masking: list, lo, hi, lens, data: list, extras: list, qpos=None,
                 seg=None) -> Union[str, dict]:
    """A finite fill c that is not negligible: eager gives each masked key the weight e^c on every row,
    which emit adds exactly (empty_rows "fill") when every masked score is c: one fill value, only
    fills and wheres mask, and they come after every other term (which they then overwrite)."""
    cs = sorted({t.c for t in masking})
    if len(cs) != 1:
        return (f"finite fill mixed with the fill values {cs}: eager weighs those keys differently, which the op "
                "cannot reproduce")
    first = next(i for i, t in enumerate(infos) if any(t is m for m in masking))
    if not all(t.op in ("fill", "where") for t in masking) or not all(
            any(t is m for m in masking) for t in infos[first:]):
        return (f"finite fill {cs[0]} followed by an additive mask or mixed with another masking term: "
                f"masked scores are not all {cs[0]}, which the op cannot reproduce")
    if data and extras:
        return (f"finite fill {cs[0]} with both a data mask and a float bias: the masked keys are not "
                f"known apart from the bias, which the op cannot reproduce")
    return dict(lo=lo, hi=hi, lens=lens, data=data, extras=extras, empty="fill", fill=cs[0], qpos=qpos, seg=seg)
