"""The abstract interpreter: the abstract value of each node of a mask subgraph (symbolic rules over
arange / comparisons / tril / triu / where / masked_fill / logic / shape-only ops, concrete evaluation
where it proves more)."""
from __future__ import annotations

import math
from dataclasses import replace
from typing import Any, Optional

import torch
import torch.fx as fx

from ..aliasing import is_inplace, op_name, written_after, written_in_place
from ..emit import example_value, op_accepts
from .symbolic import Size, _DEBUG, _as_int, _dtype, _is_one, _same, _shape, _sym_true
from .values import (AbsVal, _AbsLin, _Fail, _Gather, _Ids, _Keep, _Konst, _Lin, _Opaque, _QPos, _Runs, _TRUE, _Two,
                     _and, _not)
from .concrete import _Evaluator, _arg, _classify, _exact_positions, _scalar


# ----------------------------------------------------------------------------- dim mapping of shape ops

def _getitem_map(in_shape: tuple, index: Any) -> Optional[tuple[dict, dict]]:
    """For x[index] with only slices / None / Ellipsis: ({in dim: out dim}, {in dim: slice}) (dims >= 0)."""
    if not isinstance(index, tuple):
        index = (index,)
    if any(not (isinstance(i, slice) or i is None or i is Ellipsis) for i in index):
        return None
    if sum(i is Ellipsis for i in index) > 1:
        return None
    n_real = sum(isinstance(i, slice) for i in index)
    if n_real > len(in_shape):
        return None
    if Ellipsis in index:
        k = index.index(Ellipsis)
        index = index[:k] + (slice(None),) * (len(in_shape) - n_real) + index[k + 1:]
    else:
        index = index + (slice(None),) * (len(in_shape) - n_real)
    dmap, slices = {}, {}
    d_in = d_out = 0
    for i in index:
        if i is None:
            d_out += 1
            continue
        dmap[d_in] = d_out
        if i != slice(None):
            slices[d_in] = i
        d_in += 1
        d_out += 1
    return dmap, slices


def _noop_slice(sl: slice, size: Size, out_size: Size) -> bool:
    """x[start:stop] that keeps the whole dim (T5's position_bias[:, :, -n:, :] with n the dim's size)."""
    if sl.step not in (None, 1):
        return False
    start = example_value(sl.start) if sl.start is not None else 0
    if not isinstance(start, (int, torch.SymInt)):
        return False
    return (_sym_true(start == 0) or _sym_true(start == -size)) and _same(out_size, size)


def _nonunit(shape: tuple) -> list:
    return [d for d, s in enumerate(shape) if not _is_one(s)]


def _order_map(in_shape: tuple, out_shape: tuple) -> Optional[dict]:
    """Map for ops that only insert / remove unit dims (view, reshape, unsqueeze, squeeze): {in: out}, neg dims."""
    a, b = _nonunit(in_shape), _nonunit(out_shape)
    if len(a) != len(b) or any(not _same(in_shape[x], out_shape[y]) for x, y in zip(a, b)):
        return None
    return {x - len(in_shape): y - len(out_shape) for x, y in zip(a, b)}


_SAME_VALUES = ("expand", "contiguous", "clone", "detach")


def _canonical(node: Any) -> Optional[fx.Node]:
    """The node whose values `node` reads unchanged (through expand / contiguous), or None when any of
    them is written in place (its value would depend on where it is read)."""
    for _ in range(8):
        if not isinstance(node, fx.Node) or written_in_place(node):
            return None
        if node.op in ("call_function", "call_method") and op_name(node) in _SAME_VALUES:
            if _copy_parted(node):
                return None
            node = node.args[0]
            continue
        return node
    return None


_COPIES = ("clone", "contiguous", "reshape", "reshape_as", "flatten")  # ops whose result may be memory of its own


def _copy_parted(node: fx.Node) -> bool:
    """A copy (clone, or contiguous / reshape that may copy) whose source is written after it: the two hold other
    values from then on, so the copy is not its source (`m2 = m.clone(); m.zero_()`, then m2 masks the scores)."""
    src = node.args[0] if node.args else None
    return op_name(node) in _COPIES and isinstance(src, fx.Node) and written_after(src, node)


# ----------------------------------------------------------------------------- index arithmetic's range

# The symbolic rules read arange arithmetic as integers. Eager computes it in the tensor's dtype, where it wraps
# (`arange(8, dtype=uint8)[:, None] - arange(8)`, an int32 position times 2**29) or rounds (float positions past
# 2**24 in fp32): a node's linear form stands for its values only where every one of them is an integer its dtype
# holds exactly. A size without a finite bound (a dynamic length) is taken below 2**31: the dims of these nodes
# are an attention's lengths or broadcast to them, and no kernel here takes 2**31 keys.
_UNBOUNDED_SIZE = (1 << 31) - 1
_UNBOUNDED_CONST = 1 << 40
_FLOAT_EXACT = {torch.float64: 1 << 53, torch.float32: 1 << 24, torch.float16: 1 << 11, torch.bfloat16: 1 << 8}


def _bounds(v: Any, unbounded: int) -> Optional[tuple[int, int]]:
    """(lowest, highest) values of an int or SymInt; a symbolic side without a finite bound is +-`unbounded`."""
    if isinstance(v, bool) or not isinstance(v, (int, torch.SymInt)):
        return None
    if isinstance(v, int):
        return v, v
    known = v.node.maybe_as_int()
    if known is not None:
        return known, known
    try:
        r = v.node.shape_env.bound_sympy(v.node.expr)
    except Exception:
        return None
    return _finite(r.lower, -unbounded), _finite(r.upper, unbounded)


def _finite(x: Any, otherwise: int) -> int:
    """A bound as an int, or `otherwise` for an infinite one (sympy's oo, torch's int_oo, which says is_finite)."""
    try:
        v = int(x)
    except Exception:  # sympy raises AttributeError on its infinities
        return otherwise
    return v if abs(v) < (1 << 62) else otherwise


def _lin_exact(n: fx.Node, x: Any) -> bool:
    """Whether every value of `x` (a _Lin or an _AbsLin) at `n` is an integer that n's dtype holds exactly."""
    dt, shape = _dtype(n), _shape(n)
    lin = x.lin if isinstance(x, _AbsLin) else x
    if dt is None or shape is None or dt == torch.bool:
        return False
    c = _bounds(lin.const, _UNBOUNDED_CONST)
    if c is None:
        return False
    lo, hi = c
    for d, k in lin.coef:
        if not isinstance(k, int) or not -len(shape) <= d < 0:
            return False
        size = _bounds(shape[d], _UNBOUNDED_SIZE)
        if size is None:
            return False
        span = k * (max(size[1], 1) - 1)
        lo, hi = lo + min(span, 0), hi + max(span, 0)
    if isinstance(x, _AbsLin):
        lo, hi = (0 if lo <= 0 <= hi else min(abs(lo), abs(hi))), max(abs(lo), abs(hi))
    if dt.is_floating_point:
        top = _FLOAT_EXACT.get(dt)
        return top is not None and -top <= lo and hi <= top
    if dt.is_complex:
        return False
    info = torch.iinfo(dt)
    return info.min <= lo and hi <= info.max


# ----------------------------------------------------------------------------- the abstract interpreter

_SHAPE_OPS = {"view", "reshape", "unsqueeze", "squeeze", "expand", "expand_as", "broadcast_to", "contiguous",
              "clone", "detach", "getitem", "_unsafe_view", "view_as", "reshape_as"}
_CMP = {"lt": "lt", "le": "le", "gt": "gt", "ge": "ge", "eq": "eq", "ne": "ne", "less": "lt",
        "less_equal": "le", "greater": "gt", "greater_equal": "ge", "__lt__": "lt", "__le__": "le",
        "__gt__": "gt", "__ge__": "ge", "__eq__": "eq", "__ne__": "ne", "not_equal": "ne"}
_FLIP = {"lt": "gt", "le": "ge", "gt": "lt", "ge": "le", "eq": "eq", "ne": "ne"}


def _rebased(n: fx.Node, x: AbsVal) -> Optional[AbsVal]:
    """x (a keep-mask, or a 0-or-c float mask, of data factors only) as a factor held by `n` itself, a shape op's
    result whose values are x's: a keep-mask is kept where n is nonzero (True); a 0-or-c mask (c != 0) masks
    where n is nonzero. None for anything with structure (bands, lengths, positions, segments) or extra terms."""
    k = x.keep if isinstance(x, _Two) else x
    if not isinstance(k, _Keep) or k.structural or k.rel or k.inverted or not k.data:
        return None
    if isinstance(x, _Keep):
        return _Keep(data=((n, False),), numeric=k.numeric)
    if x.extra or x.on != 0.0 or x.c == 0.0 or x.c != x.c:
        return None
    return replace(x, keep=_Keep(data=((n, True),)))


class _Analyzer:
    def __init__(self, gm: fx.GraphModule):
        self.gm = gm
        self.ev = _Evaluator(gm)
        self.memo: dict = {}

    # --- entry
    def value(self, x: Any) -> AbsVal:
        if not isinstance(x, fx.Node):
            s = _scalar(x)
            if s is not None:
                return _Konst(s)
            return _Opaque(x)
        if x in self.memo:
            return self.memo[x]
        try:
            v = self._value(x)
        except _Fail:
            v = _Opaque(x)
        except Exception:  # an unexpected graph form never breaks the pass: the node stays opaque
            if _DEBUG:
                raise
            v = _Opaque(x)
        self.memo[x] = v
        return v

    def keep(self, x: Any) -> _Keep:
        """x seen as a keep-mask (bool, or 0/1 numeric when the value is proven 0/1)."""
        v = self.value(x)
        if isinstance(v, _Keep):
            return v
        if isinstance(v, _Konst) and v.value in (0.0, 1.0):
            return _TRUE if v.value == 1.0 else _Keep(lo=1, hi=0)
        if isinstance(x, fx.Node) and _dtype(x) == torch.bool:
            return _Keep(data=((self.smallest(x), False),))
        raise _Fail("not a keep-mask")

    def smallest(self, x: fx.Node) -> fx.Node:
        """The node of the same values before broadcasting-only ops (expand, contiguous, leading unsqueeze)."""
        v = self.value(x)
        if isinstance(v, _Opaque) and isinstance(v.node, fx.Node) and _dtype(v.node) == _dtype(x):
            return v.node
        return x

    def _value(self, n: fx.Node) -> AbsVal:
        r = self._value_of(n)
        if isinstance(r, (_Lin, _AbsLin)) and isinstance(example_value(n), torch.Tensor) and not _lin_exact(n, r):
            return _Opaque(n)  # index arithmetic that wraps or rounds in n's dtype: not the integers read here
        return r

    def _value_of(self, n: fx.Node) -> AbsVal:
        if is_inplace(n) or self.ev.written(n):
            return _Opaque(n)  # its value depends on where it is read (a write through any alias): not reasoned about
        if self.ev.can_fold(n) and isinstance(example_value(n), torch.Tensor):
            try:
                r = _classify(n, self.ev.evaluate(n))
                if not isinstance(r, _Opaque):
                    return r
            except Exception:
                pass
        v = example_value(n)
        if isinstance(v, (int, torch.SymInt)) and not isinstance(v, bool):
            return _Lin((), v)  # a size or size arithmetic (T // 2, Nk - Nq): its value is known symbolically
        if n.op != "call_function" and n.op != "call_method":
            return _Opaque(n)
        name = op_name(n)
        handler = getattr(self, "_op_" + name.strip("_"), None)
        if name in _CMP:
            return self._cmp(n, _CMP[name])
        if name in _SHAPE_OPS:
            return self._shape_op(n, name)
        if name in ("transpose", "t", "swapaxes", "swapdims"):
            return self._transpose(n)
        if handler is not None:
            r = handler(n)
            if r is not None:
                return r
        return _Opaque(n)

    # --- creation
    def _op_arange(self, n: fx.Node) -> Optional[AbsVal]:
        pos = [a for a in n.args]
        if "end" in n.kwargs:
            pos = [n.kwargs.get("start", 0), n.kwargs["end"]] + ([n.kwargs["step"]] if "step" in n.kwargs else [])
        start, step = (0, 1) if len(pos) == 1 else (pos[0], pos[2] if len(pos) > 2 else n.kwargs.get("step", 1))
        start, step = example_value(start), example_value(step)
        dt = _dtype(n)
        if dt is None or dt.is_floating_point or not isinstance(step, int) or dt == torch.bool:
            return None
        if not isinstance(start, (int, torch.SymInt)):
            return None
        shape = _shape(n)
        if _is_one(shape[0]):
            return _Lin((), start)
        return _Lin(((-1, step),), start)

    def _fill_value(self, n: fx.Node, v: Any) -> Optional[AbsVal]:
        s = _scalar(example_value(v))
        if s is None:
            return None
        if _dtype(n) == torch.bool:
            return _TRUE if s else _Keep(lo=1, hi=0)
        if s == 1.0:
            return _Keep(numeric=True)
        return _Konst(s)

    def _op_ones(self, n):
        return self._fill_value(n, 1)

    _op_ones_like = _op_new_ones = _op_ones

    def _op_zeros(self, n):
        return self._fill_value(n, 0)

    _op_zeros_like = _op_new_zeros = _op_zeros

    def _op_full(self, n):
        return self._fill_value(n, _arg(n, 1, "fill_value"))

    _op_full_like = _op_full

    def _op_new_full(self, n):
        return self._fill_value(n, _arg(n, 2, "fill_value"))

    def _op_tensor(self, n):
        v = n.args[0] if n.args else None
        return self._fill_value(n, v) if _scalar(v) is not None else None

    def _op_scalar_tensor(self, n):
        return self._op_tensor(n)

    # --- tril / triu
    def _tri(self, n: fx.Node, upper: bool) -> Optional[AbsVal]:
        x = self.value(n.args[0])
        d = example_value(_arg(n, 1, "diagonal", 0))
        if not isinstance(d, (int, torch.SymInt)):
            return None
        band = _Keep(lo=d) if upper else _Keep(hi=d)  # triu keeps j - i >= d; tril keeps j - i <= d
        if isinstance(x, _Keep):
            r = _and(x, replace(band, numeric=x.numeric))
            return r
        if isinstance(x, _Konst):
            if x.value == 0:
                return x
            other = _not(band)
            return _Two(other, x.value) if other is not None else None
        return None

    def _op_tril(self, n):
        return self._tri(n, upper=False)

    def _op_triu(self, n):
        return self._tri(n, upper=True)

    # --- dtype conversion
    def _convert(self, n: fx.Node, x: AbsVal, src: Optional[torch.dtype], dst: Optional[torch.dtype]) -> AbsVal:
        if dst is None or src is None or src == dst:
            return x if not isinstance(x, _Opaque) else _Opaque(n)
        if isinstance(x, _Keep):
            if dst == torch.bool:
                return replace(x, numeric=False)
            return replace(x, numeric=True)  # 0/1 survive every dtype
        if isinstance(x, _Konst):
            return _Konst(float(torch.tensor(x.value, dtype=torch.float64).to(dst))) if dst != torch.bool else (
                _TRUE if x.value else _Keep(lo=1, hi=0))
        if isinstance(x, _Two) and dst.is_floating_point and not x.extra:
            cast = lambda val: float(torch.tensor(val, dtype=torch.float64).to(dst))  # noqa: E731
            return _Two(x.keep, cast(x.c), on=cast(x.on))
        if isinstance(x, _Lin) and not dst.is_floating_point and dst != torch.bool and dst.itemsize >= 4:
            return x
        if isinstance(x, _Lin) and dst in (torch.float32, torch.float64) and _exact_positions(n):
            return x  # positions below 2**24 are exact in fp32, so comparisons keep their meaning
        return _Opaque(n)

    def _op_to(self, n):
        src, dst = _dtype(n.args[0]), _dtype(n)
        x = self.value(n.args[0])
        if isinstance(x, _Opaque) and src == torch.bool and dst is not None and dst != torch.bool:
            x = self.keep(n.args[0])  # a bool input as 0/1 numbers: (1.0 - keep.to(dt)) * c is a 0-or-c mask
        return self._convert(n, x, src, dst)

    _op_type = _op_type_as = _op_float = _op_half = _op_bfloat16 = _op_double = _op_bool = _op_long = _op_to
    _op_int = _op_to

    def _op_to_copy(self, n):
        return self._op_to(n)

    # --- logic
    def _logic_and(self, n: fx.Node) -> Optional[AbsVal]:
        a, b = n.args[0], n.args[1]
        try:
            ka, kb = self.keep(a), self.keep(b)
        except _Fail:
            return None
        r = _and(ka, kb)
        if r is None:
            # key lengths / run-time positions ANDed with what has no op form beside them (a window
            # relative to run-time positions j > P[i] - w): keep the structure, the other side as data
            for x, y, ynode in ((ka, kb, b), (kb, ka, a)):
                if (x.lens is not None or x.qpos is not None) and not x.inverted and isinstance(ynode, fx.Node) \
                        and _dtype(ynode) == torch.bool:
                    r = _and(x, _Keep(data=((self.smallest(ynode), False),)))
                    if r is not None:
                        break
        if r is not None and _dtype(n) != torch.bool:
            r = replace(r, numeric=True)
        return r

    _op_and = _op_logical_and = _op_bitwise_and = _logic_and

    def _logic_not(self, n: fx.Node) -> Optional[AbsVal]:
        try:
            return _not(self.keep(n.args[0]))
        except _Fail:
            return None

    _op_invert = _op_logical_not = _op_bitwise_not = _logic_not

    # --- arithmetic
    def _op_add(self, n):
        a, b = self.value(n.args[0]), self.value(_arg(n, 1, "other"))
        alpha = n.kwargs.get("alpha", 1)
        if alpha != 1:
            return None
        if isinstance(a, _Lin) or isinstance(b, _Lin):
            return self._lin_add(a, b, 1)
        for x, y, ynode in ((a, b, _arg(n, 1, "other")), (b, a, n.args[0])):
            if isinstance(x, _Konst) and x.value == 0:
                return y if not isinstance(y, _Opaque) else None
            if isinstance(x, _Two) and x.on == 0 and isinstance(y, _Opaque) and isinstance(ynode, fx.Node):
                dt = _dtype(ynode)
                if dt is not None and dt.is_floating_point:
                    return _Two(x.keep, x.c, x.extra + (ynode,))
            if isinstance(x, _Two) and isinstance(y, _Two) and x.c == y.c == -math.inf and x.on == y.on == 0:
                k = _and(x.keep, y.keep)
                return _Two(k, -math.inf, x.extra + y.extra) if k is not None else None
        return None

    def _op_sub(self, n):
        a, b = self.value(n.args[0]), self.value(_arg(n, 1, "other"))
        if isinstance(a, _Lin) or isinstance(b, _Lin):
            return self._lin_add(a, b, -1)
        if isinstance(a, _Konst) and a.value == 1.0 and isinstance(b, _Keep) and b.numeric:
            r = _not(b)
            return replace(r, numeric=True) if r is not None else None
        if isinstance(b, _Konst) and b.value == 0:
            return a if not isinstance(a, _Opaque) else None
        return None

    def _op_rsub(self, n):
        a, b = self.value(n.args[0]), self.value(_arg(n, 1, "other"))
        if isinstance(b, _Konst) and b.value == 1.0 and isinstance(a, _Keep) and a.numeric:
            r = _not(a)
            return replace(r, numeric=True) if r is not None else None
        return None

    def _lin_add(self, a: AbsVal, b: AbsVal, sign: int) -> Optional[AbsVal]:
        def as_lin(x):
            if isinstance(x, _Lin):
                return x
            if isinstance(x, _Konst) and isinstance(x.value, (int, torch.SymInt)):
                return _Lin((), x.value)
            if isinstance(x, _Konst) and float(x.value).is_integer():
                return _Lin((), int(x.value))
            return None

        la, lb = as_lin(a), as_lin(b)
        if la is None or lb is None:
            return None
        coef = dict(la.coef)
        for d, c in lb.coef:
            coef[d] = coef.get(d, 0) + sign * c
        return _Lin(tuple(sorted((d, c) for d, c in coef.items() if c != 0)), la.const + sign * lb.const)

    def _op_neg(self, n):
        a = self.value(n.args[0])
        if isinstance(a, _Lin):
            return _Lin(tuple((d, -c) for d, c in a.coef), -a.const)
        return None

    def _op_abs(self, n):
        a = self.value(n.args[0])
        return _AbsLin(a) if isinstance(a, _Lin) else None

    def _op_mul(self, n):
        a, b = self.value(n.args[0]), self.value(_arg(n, 1, "other"))
        for x, y in ((a, b), (b, a)):
            if isinstance(x, _Keep) and x.numeric and isinstance(y, _Konst):
                c = y.value
                if isinstance(c, (int, float)) and c != 0 and not math.isinf(c) and not math.isnan(c):
                    nk = _not(x)  # x * c: c where x holds, 0 elsewhere
                    dst = _dtype(n)
                    if dst is not None and dst.is_floating_point:  # eager's product rounds c (fp16: -1e9 is -inf)
                        c = float(torch.tensor(float(c), dtype=torch.float64).to(dst))
                    return _Two(nk, float(c)) if nk is not None else None
            if isinstance(x, _Keep) and isinstance(y, _Keep) and x.numeric and y.numeric:
                return _and(x, y)
            if isinstance(x, _Lin) and isinstance(y, _Konst) and isinstance(y.value, int):
                return _Lin(tuple((d, c * y.value) for d, c in x.coef if c * y.value != 0), x.const * y.value)
        return None

    # --- where / masked_fill
    def _op_where(self, n):
        if len(n.args) + len(n.kwargs) < 3:
            return None
        cond, a, b = n.args[0], _arg(n, 1, "input"), _arg(n, 2, "other")
        try:
            k = self.keep(cond)
        except _Fail:
            return None
        va, vb = self.value(a), self.value(b)
        dst = _dtype(n)
        if isinstance(va, _Konst) and va.value == 0 and isinstance(vb, _Konst):
            c = vb.value
        elif isinstance(vb, _Konst) and vb.value == 0 and isinstance(va, _Konst):
            c, k = va.value, _not(k)
            if k is None:
                return None
        else:
            return None
        if dst is not None and dst.is_floating_point:
            c = float(torch.tensor(float(c), dtype=torch.float64).to(dst))
        return _Two(k, float(c))

    def _op_masked_fill(self, n):
        x, m, c = self.value(n.args[0]), _arg(n, 1, "mask"), _scalar(example_value(_arg(n, 2, "value")))
        if c is None:
            return None
        try:
            k = _not(self.keep(m))
        except _Fail:
            return None
        if k is None:
            return None
        dst = _dtype(n)
        if dst is not None and dst.is_floating_point:
            c = float(torch.tensor(c, dtype=torch.float64).to(dst))
        if isinstance(x, _Konst) and x.value == 0:
            return _Two(k, c)
        if isinstance(x, _Two) and x.c == c and not x.extra and x.on == 0:
            kk = _and(x.keep, k)
            return _Two(kk, c) if kk is not None else None
        if isinstance(x, _Keep) and dst == torch.bool and c == 0.0:
            return _and(x, k)
        # a 0/1 (or on/c) tensor whose 1-part or 0-part is overwritten by a fill (masked where k fails)
        xk, on, off = (x.keep, x.on, x.c) if isinstance(x, _Two) and not x.extra else (
            (replace(x, numeric=False), 1.0, 0.0) if isinstance(x, _Keep) and x.numeric else (None, 0, 0))
        if xk is not None:
            plain = replace(k, numeric=False)
            if plain == xk:  # the fill covers exactly where x is `off`
                return _Two(xk, c, on=on)
            notk = _not(xk)
            if notk is not None and plain == replace(notk, numeric=False):  # covers where x is `on`
                return _Two(xk, off, on=c)
        return None

    # --- comparisons
    def _cmp(self, n: fx.Node, op: str) -> AbsVal:
        an, bn = n.args[0], _arg(n, 1, "other")
        a, b = self.value(an), self.value(bn)
        if isinstance(a, _Konst) and isinstance(b, _Konst) and _dtype(n) == torch.bool:
            x, y = _scalar(a.value), _scalar(b.value)  # e.g. HF's packed-sequence ids, all 0: id[i] == id[j]
            if x is not None and y is not None:
                holds = {"eq": x == y, "ne": x != y, "gt": x > y, "ge": x >= y, "lt": x < y, "le": x <= y}[op]
                if holds:
                    return _TRUE  # (a never-true result stays opaque: the op has no "mask every key" form)
        # keep-mask == 0 / == 1 / != 0 / > 0 (0/1 values only)
        for x, y, o in ((a, b, op), (b, a, _FLIP[op])):
            if isinstance(x, _Keep) and isinstance(y, _Konst) and _scalar(y.value) is not None:
                v = float(y.value)
                # x takes the values 0 and 1: which of them satisfy `x o v`?
                holds = {"eq": lambda z: z == v, "ne": lambda z: z != v, "gt": lambda z: z > v,
                         "ge": lambda z: z >= v, "lt": lambda z: z < v, "le": lambda z: z <= v}[o]
                at0, at1 = holds(0.0), holds(1.0)
                if at1 and not at0:
                    return replace(x, numeric=False)
                if at0 and not at1:
                    r = _not(x)
                    if r is not None:
                        return replace(r, numeric=False)
                return _Opaque(n)
        for x, y, o in ((a, b, op), (b, a, _FLIP[op])):  # |D| <= t with D = s (j - i) + c
            if isinstance(x, _AbsLin) and o in ("le", "lt"):
                ly = y if isinstance(y, _Lin) else self._lin_add(y, _Konst(0), 1)
                d = x.lin
                sj = d.get(-1)
                if ly is None or ly.coef or set(dd for dd, _ in d.coef) - {-1, -2} or abs(sj) != 1 or d.get(-2) != -sj:
                    return _Opaque(n)
                t = ly.const if o == "le" else ly.const - 1
                c = d.const
                return _Keep(lo=-t - c, hi=t - c) if sj == 1 else _Keep(lo=c - t, hi=c + t)
        if op == "eq" and isinstance(a, (_Opaque, _Gather)) and isinstance(b, (_Opaque, _Gather)):
            r = self._segments(n, an, bn)
            if r is not None:
                return r
        if op in ("le", "lt", "ge", "gt") and isinstance(a, _Gather) and isinstance(b, _Gather) and (
                a.src is b.src and {a.axis, b.axis} == {-2, -1}) and _dtype(n) == torch.bool:
            o = op if a.axis == -1 else _FLIP[op]  # P[b, j] o P[b, i]: within a run of P, j - i o 0
            lo, hi = {"le": (None, 0), "lt": (None, -1), "ge": (0, None), "gt": (1, None)}[o]
            return _Keep(data=((n, False),), rel=(((n, False), a.src, lo, hi),))
        if isinstance(a, _Lin) or isinstance(b, _Lin):
            r = self._lin_cmp(n, a, b, an, bn, op)
            if r is not None:
                return r
        return _Opaque(n)

    def _segments(self, n: fx.Node, an: Any, bn: Any) -> Optional[AbsVal]:
        """ids_q[b, i] == ids_k[b, j]: two integer tensors, one varying along the comparison's -2 axis and
        not -1, the other along -1 and not -2, each at most along one more (the same) axis, the batch
        (`seg[:, :, None] == seg[:, None, :]`); any values. Shape ops then move the axes; where the mask
        meets the scores they must be the queries, the keys and the batch (combine._band_fits)."""
        if not op_accepts("q_seg") or not isinstance(an, fx.Node) or not isinstance(bn, fx.Node):
            return None
        out = _shape(n)
        sides, batch = {}, set()
        for node in (an, bn):
            shape = _shape(node)
            if shape is None or out is None or len(shape) > len(out):
                return None
            dt = _dtype(node)
            if dt is None or dt.is_floating_point or dt == torch.bool or dt.is_complex:
                return None
            nu = {d - len(shape) for d in _nonunit(shape)}
            axes = nu & {-2, -1}
            if len(axes) != 1 or len(nu) > 2:
                return None
            (axis,) = axes
            if axis in sides:
                return None
            sides[axis] = node
            batch |= nu - axes
        if len(batch) > 1:
            return None
        bdim = next(iter(batch), None)
        runs = set()
        for node in sides.values():  # ids gathered from unit-step runs of positions P (HF packed sequences)
            v = self.value(node)
            src = self.value(v.src) if isinstance(v, _Gather) else None
            runs.add(src.positions if isinstance(src, _Runs) else None)
        p = runs.pop() if len(runs) == 1 else None

        def ids(axis: int) -> _Ids:
            shape = _shape(sides[axis])
            own_b = bdim if bdim is not None and len(shape) >= -bdim and not _is_one(shape[bdim]) else None
            return _Ids(sides[axis], axis, p, bdim, axis, own_b)

        return _Keep(seg=(ids(-2), ids(-1)))

    def _lin_cmp(self, n, a, b, an, bn, op) -> Optional[AbsVal]:
        # key padding: arange(Nk) OP lens[..., None]
        for x, y, ynode, o in ((a, b, bn, op), (b, a, an, _FLIP[op])):
            if isinstance(x, _Lin) and isinstance(y, _Opaque) and isinstance(ynode, fx.Node):
                qp = self._query_positions(n, x, ynode, o)
                if qp is not None:
                    return qp
                c = _as_int(x.const)
                if x.coef != ((-1, 1),) or c is None or o in ("eq", "ne"):
                    return None
                dt, ys = _dtype(ynode), _shape(ynode)
                if dt is None or dt.is_floating_point or dt == torch.bool or not ys:
                    return None
                nu = _nonunit(ys)
                if len(nu) > 1:
                    return None
                out = _shape(n)
                if not ys or len(ys) > len(out) or (nu and nu[0] - len(ys) == -1):
                    return None
                bdim = (nu[0] - len(ys)) if nu else None
                # j + c <= y  <=>  j < y + 1 - c;  j + c < y  <=>  j < y - c;  > and >= are the complements
                # (masked where true). A y varying along the query axis (bdim -2 in the end) is read as
                # run-time query positions where the mask meets the scores (combine._term_info).
                add = (1 if o in ("le", "gt") else 0) - c
                return _Keep(lens=(ynode, bdim, add), inverted=o in ("gt", "ge"))
        la = a if isinstance(a, _Lin) else self._lin_add(a, _Konst(0), 1)
        lb = b if isinstance(b, _Lin) else self._lin_add(b, _Konst(0), 1)
        if la is None or lb is None:
            return None
        diff = self._lin_add(la, lb, -1)  # a - b OP 0
        ci, cj = diff.get(-2), diff.get(-1)
        if set(d for d, _ in diff.coef) - {-1, -2} or not (ci == -cj and abs(cj) == 1):
            return None
        c = diff.const
        if cj == -1:  # i - j + c OP 0  <=>  j - i - c FLIP(OP) 0
            op, c = _FLIP[op], -c
        # now: j - i + c OP 0  <=>  j - i OP -c
        t = -c
        if op == "le":
            return _Keep(hi=t)
        if op == "lt":
            return _Keep(hi=t - 1)
        if op == "ge":
            return _Keep(lo=t)
        if op == "gt":
            return _Keep(lo=t + 1)
        if op == "eq":
            return _Keep(lo=t, hi=t)
        return None

    def _query_positions(self, n: fx.Node, x: _Lin, ynode: fx.Node, o: str) -> Optional[AbsVal]:
        """j + c <= P (or <): key positions against an integer tensor P broadcast along the key axis and
        varying along the comparison's -2 axis and one other (per-row cache positions [B, Nq, 1]):
        keys j <= P[b, i] - c (- 1); `>` / `>=` are the complement (masked where true). Shape ops then
        move both axes; where the mask meets the scores -2 must be the queries and the other the batch
        (combine._band_fits). A P varying along one axis only is a key length (lens) here, and becomes
        query positions if that axis turns out to be the scores' queries (combine._term_info): HF's
        kv_arange <= q_arange + cache offset, cache_position[:, None]."""
        if x.coef != ((-1, 1),) or _as_int(x.const) is None or o in ("eq", "ne") or not op_accepts("q_pos"):
            return None
        dt, ys, out = _dtype(ynode), _shape(ynode), _shape(n)
        if dt is None or dt.is_floating_point or dt == torch.bool or dt.is_complex or ys is None or out is None:
            return None
        nu = [d - len(ys) for d in _nonunit(ys)]
        if len(ys) > len(out) or len(nu) != 2 or -2 not in nu or -1 in nu:
            return None  # one varying axis: a key length until it meets the scores
        b = next(d for d in nu if d != -2)
        c = _as_int(x.const)
        add, inverted = (-c, o == "gt") if o in ("le", "gt") else (-c - 1, o == "ge")
        return _Keep(qpos=_QPos(ynode, add, qdim=-2, bdim=b, own_q=-2, own_b=b), inverted=inverted)

    def _gather(self, n: fx.Node, ins: tuple, outs: tuple) -> Optional[AbsVal]:
        """src[batch_idx, t_idx] with batch_idx = arange(B) along -4 and t_idx = arange(N) along the query
        (-2) or key (-1) axis of a 4-d result: the value src[b, t] (HF's position_ids[batch_idx, q_idx])."""
        index = n.args[1]
        if not isinstance(index, tuple) or len(index) != 2 or len(ins) != 2 or len(outs) != 4:
            return None
        bi, ti = (self.value(i) if isinstance(i, fx.Node) else None for i in index)
        if not (isinstance(bi, _Lin) and bi.coef == ((-4, 1),) and _as_int(bi.const) == 0):
            return None
        if not (isinstance(ti, _Lin) and len(ti.coef) == 1 and ti.coef[0][0] in (-2, -1) and ti.coef[0][1] == 1
                and _as_int(ti.const) == 0):
            return None
        src = _canonical(n.args[0])
        if src is None:
            return None
        return _Gather(src, ti.coef[0][0], n)

    def _op_cumsum(self, n: fx.Node) -> Optional[AbsVal]:
        """cumsum(diff(P, dim=-1) != 1, -1) of an integer [B, N] P: unit-step runs of P (_Runs)."""
        x, dim = n.args[0], _arg(n, 1, "dim")
        shape = _shape(n)
        if not isinstance(x, fx.Node) or shape is None or len(shape) != 2 or dim not in (-1, 1):
            return None
        if op_name(x) not in _CMP or _CMP[op_name(x)] != "ne" or len(x.args) != 2:
            return None
        d, one = (x.args[0], x.args[1]) if isinstance(x.args[0], fx.Node) else (x.args[1], x.args[0])
        if _scalar(one) != 1.0 or not isinstance(d, fx.Node) or op_name(d) != "diff":
            return None
        if _arg(d, 1, "n", 1) != 1 or _arg(d, 2, "dim", -1) not in (-1, 1) or _arg(d, 4, "append") is not None:
            return None
        p = _canonical(d.args[0])
        pv = example_value(p)
        if p is None or pv.dim() != 2 or pv.dtype not in (torch.int32, torch.int64):
            return None  # integer positions: diff == 1 is exact
        if not all(_same(a, b) for a, b in zip(pv.shape, shape)):
            return None  # one prepended column: S[t] counts the breaks up to the step into P[t]
        return _Runs(p, n)

    def _row_index(self, n: fx.Node, x: AbsVal, ins: tuple) -> Optional[AbsVal]:
        """tril_buffer[None, None, pos] (gpt-fast): the rows of a constant lower-triangular keep-mask picked
        by a 1-d integer tensor; row r keeps j - r <= hi, so the result keeps j <= pos[i] + hi, reading pos
        modulo the buffer's rows (indexing wraps negative positions)."""
        index = n.args[1] if isinstance(n.args[1], tuple) else (n.args[1],)
        at = [p for p, e in enumerate(index) if isinstance(e, fx.Node)]
        if len(at) != 1 or not isinstance(x, _Keep) or len(ins) < 2 or not op_accepts("q_pos"):
            return None
        p = at[0]
        if any(not (e is None or e == slice(None)) for e in index if not isinstance(e, fx.Node)):
            return None
        if sum(e is not None for e in index) > len(ins) or any(e is None for e in index[p + 1:]):
            return None
        if sum(e is not None for e in index[:p]) != len(ins) - 2:
            return None  # the index must pick the rows (the query axis), the key axis kept whole
        idx = index[p]
        iv = example_value(idx)
        if not isinstance(iv, torch.Tensor) or iv.dim() != 1 or iv.dtype not in (torch.int32, torch.int64):
            return None
        if x.inverted or x.lens is not None or x.data or x.qpos is not None or x.seg is not None or x.lo is not None:
            return None
        if x.hi is None:
            return x  # every row keeps every key
        hi, rows = _as_int(x.hi), _as_int(ins[-2])
        if hi is None or rows is None:
            return None
        return _Keep(qpos=_QPos(idx, hi, rows=True, wrap=rows), numeric=x.numeric)

    # --- shape-only ops
    def _shape_op(self, n: fx.Node, name: str) -> AbsVal:
        src = n.args[0]
        if _copy_parted(n):
            return _Opaque(n)  # the copy's own values (see _copy_parted), read where the site reads it
        x = self.value(src)
        ins, outs = _shape(src), _shape(n)
        if ins is None or outs is None:
            return _Opaque(n)
        slices: dict = {}
        if name == "getitem":
            gm_ = _getitem_map(ins, n.args[1])
            if gm_ is None:
                r = self._row_index(n, x, ins)
                if r is None:
                    r = self._gather(n, ins, outs)
                return r if r is not None else _Opaque(n)
            pmap, pslices = gm_
            dmap = {d - len(ins): o - len(outs) for d, o in pmap.items() if not _is_one(ins[d])}
            slices = {d - len(ins): s for d, s in pslices.items()
                      if not _noop_slice(s, ins[d], outs[pmap[d]])}
        elif name in ("expand", "expand_as", "broadcast_to", "contiguous", "clone", "detach"):
            dmap = {d - len(ins): d - len(ins) for d in _nonunit(ins)}
            if any(not _same(ins[d], outs[d - len(ins) + len(outs)]) for d in _nonunit(ins)):
                return _Opaque(n)
        else:
            dmap = _order_map(ins, outs)
            if dmap is None:
                return _Opaque(n)
        return self._remap(n, x, dmap, slices, ins)

    def _remap(self, n: fx.Node, x: AbsVal, dmap: dict, slices: dict, ins: tuple) -> AbsVal:
        def shift(sl: slice, dim: int):
            if sl.step not in (None, 1):
                raise _Fail("strided slice")
            start = example_value(sl.start) if sl.start is not None else 0
            if not isinstance(start, (int, torch.SymInt)):
                raise _Fail("slice start")
            if _sym_true(start < 0):
                start = ins[dim] + start
            elif not _sym_true(start >= 0):
                raise _Fail("slice start of unknown sign")
            return start

        identity = all(k == v for k, v in dmap.items())
        try:
            if isinstance(x, _Lin):
                coef, const = [], x.const
                for d, c in x.coef:
                    if d not in dmap:
                        raise _Fail("dim dropped")
                    if d in slices:
                        const = const + c * shift(slices[d], d)
                    coef.append((dmap[d], c))
                return _Lin(tuple(sorted(coef)), const)
            if isinstance(x, _Keep) or isinstance(x, _Two):
                k = x.keep if isinstance(x, _Two) else x
                if isinstance(x, _Two) and x.extra and not (identity and not slices):
                    return _Opaque(n)
                if k.data and not (identity and not slices):
                    # node-held factors broadcast to this tensor only unchanged; a mask of data factors alone
                    # is this node's own values: [B, Nk] padding viewed as [B, 1, 1, Nk] stays a data mask
                    return _rebased(n, x) or _Opaque(n)
                if k.qpos is not None and k.qpos.rows and not (identity and not slices):
                    return _Opaque(n)
                seg = k.seg
                if seg is not None:
                    axes = {d for ids in seg for d in (ids.axis, ids.bdim) if d is not None}
                    if any(d in slices or d not in dmap for d in axes):
                        return _Opaque(n)
                    seg = tuple(replace(ids, axis=dmap[ids.axis], bdim=None if ids.bdim is None else dmap[ids.bdim])
                                for ids in seg)
                qpos = k.qpos
                if qpos is not None and not qpos.rows:
                    axes = [d for d in (qpos.qdim, qpos.bdim, -1) if d is not None]
                    if any(d in slices for d in axes) or any(d not in dmap for d in axes) or dmap[-1] != -1:
                        return _Opaque(n)
                    qpos = replace(qpos, qdim=dmap[qpos.qdim], bdim=None if qpos.bdim is None else dmap[qpos.bdim])
                lo, hi = k.lo, k.hi
                if lo is not None or hi is not None:
                    for d in (-2, -1):
                        if d in dmap and dmap[d] != d:
                            return _Opaque(n)
                    a = shift(slices[-2], -2) if -2 in slices else 0
                    b = shift(slices[-1], -1) if -1 in slices else 0
                    # new (i', j') = (i - a, j - b): j - i = j' - i' + b - a
                    lo = None if lo is None else lo + a - b
                    hi = None if hi is None else hi + a - b
                lens = k.lens
                if lens is not None:
                    node, bdim, add = lens
                    if -1 in slices and shift(slices[-1], -1) != 0:
                        return _Opaque(n)
                    if -1 in dmap and dmap[-1] != -1:
                        return _Opaque(n)
                    if bdim is not None:
                        if bdim not in dmap or bdim in slices:
                            return _Opaque(n)
                        bdim = dmap[bdim]
                    lens = (node, bdim, add)
                nk = replace(k, lo=lo, hi=hi, lens=lens, qpos=qpos, seg=seg)
                return replace(x, keep=nk) if isinstance(x, _Two) else nk
            if isinstance(x, _Konst):
                return x
            if isinstance(x, _Opaque) and identity and not slices and isinstance(x.node, fx.Node):
                return x  # broadcasting-preserving: the smaller node stands for this one
        except _Fail:
            return _Opaque(n)
        return _Opaque(n)

    def _transpose(self, n: fx.Node) -> AbsVal:
        """x.transpose(-2, -1) (or .t() of a matrix): i and j swap, so lo <= j - i <= hi becomes -hi..-lo."""
        shape = _shape(n.args[0])
        if shape is None or len(shape) < 2:
            return _Opaque(n)
        dims = (0, 1) if op_name(n) == "t" else (_arg(n, 1, "dim0"), _arg(n, 2, "dim1"))
        if not all(isinstance(d, int) for d in dims):
            return _Opaque(n)
        if sorted(d % len(shape) for d in dims) != [len(shape) - 2, len(shape) - 1]:
            return _Opaque(n)
        x = self.value(n.args[0])
        k = x.keep if isinstance(x, _Two) and not x.extra else x
        if isinstance(k, _Keep) and not k.data and k.lens is None and k.qpos is None and k.seg is None:
            mirrored = replace(k, lo=None if k.hi is None else -k.hi, hi=None if k.lo is None else -k.lo)
            return replace(x, keep=mirrored) if isinstance(x, _Two) else mirrored
        if isinstance(x, _Konst):
            return x
        if isinstance(x, _Lin):
            swap = {-1: -2, -2: -1}
            return _Lin(tuple(sorted((swap.get(d, d), c) for d, c in x.coef)), x.const)
        return _Opaque(n)
