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
    """Keep-mask (True or 1 = admissible): lo <= j - i <= hi, j < lens[b] + lens_add, and bool factors.

    numeric: stored as 0/1 numbers rather than bool. lens = (node, batch dim from the right, add).
    data: ((bool node, negated), ...) opaque factors, each broadcasting to this tensor unchanged.
    """

    lo: Optional[Size] = None
    hi: Optional[Size] = None
    lens: Optional[tuple] = None
    data: tuple = ()
    numeric: bool = False
    inverted: bool = False  # the value is NOT(the conjunction): a complement that is no conjunction itself

    @property
    def structural(self) -> bool:
        return self.lo is not None or self.hi is not None or self.lens is not None


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


AbsVal = Union[_Lin, _AbsLin, _Keep, _Two, _Konst, _Opaque]

_TRUE = _Keep()


def _and(a: _Keep, b: _Keep) -> Optional[_Keep]:
    def tighter(x, y, pick):
        if x is None:
            return y
        if y is None:
            return x
        if _sym_true(x <= y):
            return y if pick == "max" else x
        if _sym_true(y <= x):
            return x if pick == "max" else y
        raise _Fail("band bounds that are not comparable for every size")

    if a.inverted or b.inverted or (a.lens is not None and b.lens is not None):
        return None
    try:
        lo = tighter(a.lo, b.lo, "max")
        hi = tighter(a.hi, b.hi, "min")
    except _Fail:
        return None
    return _Keep(lo, hi, a.lens or b.lens, a.data + b.data, a.numeric and b.numeric)


def _not(a: _Keep) -> Optional[_Keep]:
    if a.inverted:
        return replace(a, inverted=False)
    parts = [a.lo is not None, a.hi is not None, a.lens is not None, len(a.data)]
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
    return replace(a, inverted=True)  # not (j < lens[b])


class _Fail(Exception):
    pass
