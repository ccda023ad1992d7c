"""Abstract values of mask-subgraph nodes: index arithmetic, keep-masks, 0-or-c float masks."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Optional, Union


from .symbolic import Size, _sym_true


# ----------------------------------------------------------------------------- abstract values

@dataclass(frozen=True)
class _Lin:
    """Integer tensor whose element is const + sum(coef * index along dim); dims counted from the right."""

    coef: tuple  # ((dim, c), ...) sorted, dims negative, c != 0
    const: Size = 0

    def get(self, dim: int) -> int:
        return dict(self.coef).get(dim, 0)


@dataclass(frozen=True)
class _AbsLin:
    """|lin| of an integer index expression (local attention: (i - j).abs() <= w)."""

    lin: _Lin


@dataclass(frozen=True)
class _Keep:
    """Keep-mask (True or 1 = admissible): lo <= j - i <= hi, j < lens[b] + lens_add, j <= qpos[b, i],
    qseg[b, i] == kseg[b, j], and bool factors.

    numeric: stored as 0/1 numbers rather than bool. lens = (node, batch dim from the right, add).
    qpos: run-time query positions (a _QPos). seg: (query-side ids, key-side ids) as _Ids.
    data: ((bool node, negated), ...) opaque factors, each broadcasting to this tensor unchanged.
    """

    lo: Optional[Size] = None
    hi: Optional[Size] = None
    lens: Optional[tuple] = None
    data: tuple = ()
    numeric: bool = False
    inverted: bool = False  # the value is NOT(the conjunction): a complement that is no conjunction itself
    qpos: Optional["_QPos"] = None
    seg: Optional[tuple] = None
    rel: tuple = ()  # ((data entry, P, lo, hi), ...): a data factor equal to lo <= j - i <= hi within a run of P

    @property
    def structural(self) -> bool:
        return (self.lo is not None or self.hi is not None or self.lens is not None or self.qpos is not None
                or self.seg is not None)


@dataclass(frozen=True)
class _QPos:
    """Run-time query positions: key j is admitted for query i when j <= P[b, i] + add.

    node: an integer graph node P. rows=False: P broadcasts to the keep tensor with qdim its query
    axis and bdim (or None) its batch axis (dims counted from the right, remapped by shape ops like
    lens' batch dim); own_q / own_b: the same axes among P's own dims. rows=True: P is a 1-d [Nq] row
    index (a lower-triangular buffer indexed by it), read modulo `wrap` (the buffer's rows, as indexing
    wraps negative values)."""

    node: Any
    add: int = 0
    rows: bool = False
    wrap: Optional[int] = None
    qdim: int = -2
    bdim: Optional[int] = None
    own_q: int = -1
    own_b: Optional[int] = None


@dataclass(frozen=True)
class _Ids:
    """Segment ids of one side: an integer node broadcasting to the keep tensor, varying along `axis`
    (-2 queries, -1 keys) and bdim (the batch, or None), dims counted from the right and remapped by
    shape ops; own_axis / own_b: the same axes among the node's own dims. runs_of: the positions P (a
    node) when the ids are proven unit-step runs of P (see _Runs), else None."""

    node: Any
    axis: int
    runs_of: Any = None
    bdim: Optional[int] = None
    own_axis: int = -1
    own_b: Optional[int] = None


@dataclass(frozen=True)
class _Runs:
    """Integer ids S [B, N] = cumsum(diff(P) != 1) along the last axis (HF's find_packed_sequence_indices):
    nondecreasing, and S[b, s] == S[b, t] only when every step of P between s and t is 1, so that then
    P[b, t] - P[b, s] == t - s."""

    positions: Any  # the node P
    node: Any


@dataclass(frozen=True)
class _Gather:
    """src[b, t] broadcast to a mask, t the index along `axis` (-2 queries, -1 keys), b along -4: an
    integer tensor gathered with exact aranges (HF's `position_ids[batch_idx, q_idx]`)."""

    src: Any  # the source node, seen through expand / contiguous
    axis: int
    node: Any


@dataclass(frozen=True)
class _Two:
    """Float tensor: sum(extra) + (on where keep holds else c). extra: opaque float nodes.

    A mask is on == 0; on != 0 only appears midway, e.g. `m.float().masked_fill(m == 0, -inf)` (1 or -inf)
    before `.masked_fill(m == 1, 0.0)` makes it a mask.
    """

    keep: _Keep
    c: float
    extra: tuple = ()
    on: float = 0.0


@dataclass(frozen=True)
class _Konst:
    """A tensor (or Python number) holding one value everywhere."""

    value: Any


@dataclass(frozen=True)
class _Opaque:
    node: Any


AbsVal = Union[_Lin, _AbsLin, _Keep, _Two, _Konst, _Opaque, "_Gather", "_Runs"]

_TRUE = _Keep()


def _and(a: _Keep, b: _Keep) -> Optional[_Keep]:
    if a.inverted or b.inverted or (a.lens is not None and b.lens is not None and not _same_lens(a.lens, b.lens)):
        return None
    if a.qpos is not None and b.qpos is not None and a.qpos != b.qpos:
        return None  # two run-time position limits: the op takes one
    if a.seg is not None and b.seg is not None and a.seg != b.seg:
        return None
    try:
        lo = _tighter(a.lo, b.lo, "max")
        hi = _tighter(a.hi, b.hi, "min")
    except _Fail:
        return None
    k = _Keep(lo, hi, a.lens or b.lens, a.data + b.data, a.numeric and b.numeric,
              qpos=a.qpos or b.qpos, seg=a.seg or b.seg, rel=a.rel + b.rel)
    return _within_runs(k)


def _within_runs(k: _Keep) -> _Keep:
    """A comparison of positions P[b, j] OP P[b, i] ANDed with segment ids that are unit-step runs of the
    same P: within a run P[b, j] - P[b, i] == j - i, so the comparison is the band j - i OP 0 there
    (HF's causal mask remapped to packed position ids)."""
    if k.seg is None or not k.rel or k.inverted:
        return k
    runs = {ids.runs_of for ids in k.seg}
    if len(runs) != 1 or None in runs:
        return k
    (p,) = runs
    data, rel, lo, hi = list(k.data), [], k.lo, k.hi
    for entry in k.rel:
        d, src, rlo, rhi = entry
        if src is not p or d not in data:
            rel.append(entry)
            continue
        try:
            lo = _tighter(lo, rlo, "max")
            hi = _tighter(hi, rhi, "min")
        except _Fail:
            rel.append(entry)
            continue
        data.remove(d)
    return replace(k, lo=lo, hi=hi, data=tuple(data), rel=tuple(rel))


def _tighter(x, y, pick):
    if x is None:
        return y
    if y is None:
        return x
    if _sym_true(x <= y):
        return y if pick == "max" else x
    if _sym_true(y <= x):
        return x if pick == "max" else y
    raise _Fail("band bounds that are not comparable for every size")


def _not(a: _Keep) -> Optional[_Keep]:
    if a.inverted:
        return replace(a, inverted=False)
    parts = [a.lo is not None, a.hi is not None, a.lens is not None, len(a.data), a.qpos is not None,
             a.seg is not None]
    if sum(parts) != 1:
        if not sum(parts):
            return _Keep(lo=1, hi=0, numeric=a.numeric)  # not-True: never (lo > hi)
        return replace(a, inverted=True)
    if a.lo is not None:
        return _Keep(hi=a.lo - 1, numeric=a.numeric)
    if a.hi is not None:
        return _Keep(lo=a.hi + 1, numeric=a.numeric)
    if a.data:
        node, neg = a.data[0]
        return _Keep(data=((node, not neg),), numeric=a.numeric)
    return replace(a, inverted=True)  # not (j < lens[b]), not (j <= P[b, i]), not (same segment)


def _same_lens(x: tuple, y: tuple) -> bool:
    """Two key bounds (node, batch dim, add) read from the same values: the same node, or the same view
    (`lens[:, None]`) of one node spelled twice."""
    if x[1:] != y[1:]:
        return False
    a, b = x[0], y[0]
    if a is b:
        return True
    return (getattr(a, "op", None) == "call_function" and getattr(b, "op", None) == "call_function"
            and a.target is b.target and a.args == b.args and a.kwargs == b.kwargs
            and getattr(a.target, "__name__", "") in ("getitem", "unsqueeze", "view", "reshape"))


class _Fail(Exception):
    pass
