"""Mask structure analysis: prove what a site's mask is from how the graph builds it.

    analyze_mask(gm: fx.GraphModule, terms: list[MaskTerm], *, batch, q_heads, q_len, k_len,
                 scores_dtype: torch.dtype, insert_before: fx.Node, sdpa: bool = False) -> MaskSpec | str

`terms` are the ways a mask enters the scores, in the order eager applies them (see MaskTerm); a
"fill"/"where" fill may be a Python number or a node of a 0-d constant (torch.full([], finfo.min)).
batch / q_heads / q_len / k_len are the site's sizes (ints or SymInts from the example values);
new nodes (kv_lens reshape, residual bias, symbolic diag offset) are inserted before `insert_before`
with `emit.call`, so they carry example values. `sdpa=True` says the softmax is SDPA's (rows whose
every score is -inf give 0 there); a "bool" term implies it. A returned string is the reason the site
must be left alone. The returned MaskSpec's fields map one to one onto emit_attention's arguments.

How a proof works. Each node of the mask subgraph gets an abstract value (`_Lin`: integer index
arithmetic a*i + b*j + c on the query/key axes; `_Keep`: a keep-mask that is a conjunction of a band
lo <= j - i <= hi, a key-length bound j < lens[b] and opaque bool factors; `_Two`: a float mask equal
to 0 where a `_Keep` holds and c elsewhere; `_Konst`: a tensor filled with one number; `_Opaque`:
anything else). SiteReport kinds produced: "causal" (diag_offset 0), "causal-bottom-right"
(Nk - Nq), "causal-offset" (any other), "window", "key-padding" (kv_lens), "bool-mask" / "bias"
(residual), joined by '+'. Two techniques produce them:
  (a) symbolic rules over arange / comparisons / tril / triu / where / masked_fill / logical ops and
      shape-only ops; these hold for every size, so they serve dynamic shapes;
  (b) concrete evaluation: a node that depends on no graph input except module buffers and whose
      shapes are all static ints is evaluated with real tensors and its value classified (band, 0/c).
      Static-shape guards make that a proof for every call the graph admits. Never used when any
      shape in the subgraph is symbolic. Module buffers (not parameters) are read at compile time and
      treated as constants: Dynamo does not guard their contents, so a model that writes into its
      mask buffer after compiling must recompile (nanoGPT / GPT-2 never do).
Whatever depends on data stays a residual bias, as the smallest node that the graph already has
(e.g. the [B, 1, 1, Nk] padding mask, never its expansion to N x N). Conditions on symbolic sizes are
decided by statically_known_true or by being one of Dynamo's own guards (a slice start Nk - Nq of a
bottom-right causal buffer is guarded >= 0), never by adding a guard.

Masked values. The op masks with -inf. A finite fill c (masked_fill / where / a 0-or-c additive mask)
is replaced by -inf only when c <= FILL_LIMIT (-1e4): on a row with at least one admissible key, eager
gives a masked key the weight exp(c - rowmax), which is 0 in fp32 as soon as c - rowmax < -104;
we rely on every row's largest admissible (scaled, biased) score exceeding c + 104 (for finfo.min
fills that holds for any finite score). Larger fills (e.g. -100) are refused, or passed untouched
when they come in an additive mask. On a row where every key is masked eager computes:
  -inf fills: NaN (SDPA: 0)                              -> empty_rows "nan" ("zero")
  one finite fill c: masked_fill / where set every entry to c    -> empty_rows "mean_v"
  an additive 0-or-c mask: s + c, uniform only where it rounds to c (c <= ABSORB_LIMIT, e.g. fp32 or
  bf16 finfo.min; fp16 finfo.min for |s| <= 16)                -> empty_rows "mean_v_add" (the
  addition passes the gradient to the absorbed scores: eager's backward is softmax's at uniform P); other c
  (fp32 -1e9, -1e4) keep s in s + c, so such masks are passed untouched (exact) unless the structure
  proves that no row is empty.
Finite fills of one value c applied after every other term (s + bias, then masked_fill) overwrite
it: a fully masked row is all c -> empty_rows "mean_v", the bias passed as the op's.
Mixes whose fully masked rows eager computes differently (finite fills of different values, a
finite fill and a separate additive float mask added after it) are refused unless proven to have no empty row, or
unless every fill is -inf, or <= ABSORB_LIMIT (fp32/bf16 finfo.min) and the very first term:
then every term is passed as one additive float bias (fill -> where(T, c, 0)), which is eager's
arithmetic (legacy GPT-2: where(causal, s, finfo.min) + (1 - m) * finfo.min), at the cost of an
N x N bias.
An additive float mask that is not proven to be 0-or-c is passed untouched as the op's float bias;
the op adds it in fp32, which is eager's own arithmetic (exact for fp32 scores). Known limit: with
fp16 scores and such an untouched fp16 mask of huge negative values (e.g. BERT's
`(1 - m) * finfo(fp16).min` on data m), a row where every key carries that value is uniform in eager
(s + c rounds to c for |s| <= 16) but softmax(s) in the op, which adds in fp32; every other row matches.
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass, replace
from typing import Any, Optional, Union

import torch
import torch.fx as fx

from .emit import call, example_value
from .site import MaskSpec, MaskTerm

FILL_LIMIT = -1e4  # finite fills at or below this are equivalent to -inf on rows with an admissible key
ABSORB_LIMIT = -1e30  # fp32 s + c == c for |s| < 1e22 when c <= this: a fill then acts as an additive c
CONCRETE_MAX_NUMEL = 1 << 24  # concrete evaluation is skipped for larger mask subgraphs

Size = Any  # int or SymInt
_DEBUG = False


# ----------------------------------------------------------------------------- symbolic sizes

def _sym_true(cond: Any) -> bool:
    """True only when `cond` (bool or SymBool) holds for every size the guards admit."""
    if isinstance(cond, bool):
        return cond
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    try:
        if statically_known_true(cond):
            return True
    except Exception:
        return False
    return _guarded(cond)


def _guarded(cond: Any) -> bool:
    """True when `cond` is literally one of the guards Dynamo already checks before running this graph
    (e.g. `Nk - Nq >= 0` from slicing `bias[..., Nk - Nq : Nk, :]`); statically_known_true misses
    conjunctions of guards."""
    import sympy

    try:
        node = cond.node
        env = node.shape_env
        target = env.simplify(node.expr)
        for g in list(env.get_axioms()):
            for atom in sympy.And.make_args(g):
                if env.simplify(atom) == target:
                    return True
    except Exception:
        return False
    return False


def _same(a: Size, b: Size) -> bool:
    return _sym_true(a == b)


def _is_one(a: Size) -> bool:
    return _sym_true(a == 1)


def _as_int(v: Size) -> Optional[int]:
    if isinstance(v, int):
        return v
    if isinstance(v, torch.SymInt):
        expr = v.node.expr
        if getattr(expr, "is_number", False):
            return int(expr)
    return None


def _shape(node: Any) -> Optional[tuple]:
    v = example_value(node)
    return tuple(v.shape) if isinstance(v, torch.Tensor) else None


def _dtype(node: Any) -> Optional[torch.dtype]:
    v = example_value(node)
    return v.dtype if isinstance(v, torch.Tensor) else None


def _static(node: fx.Node) -> bool:
    v = example_value(node)
    if isinstance(v, torch.Tensor):
        return all(isinstance(s, int) for s in v.shape)
    if isinstance(v, (tuple, list)):
        return all(_static_value(x) for x in v)
    return _static_value(v)


def _static_value(v: Any) -> bool:
    if isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return False
    if isinstance(v, torch.Tensor):
        return all(isinstance(s, int) for s in v.shape)
    return True


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


# ----------------------------------------------------------------------------- node helpers

_INPLACE_FUNCS = {operator.setitem, operator.iadd, operator.isub, operator.imul, operator.itruediv,
                  operator.iand, operator.ior}
_RANDOM_WORDS = ("rand", "empty", "dropout", "bernoulli", "normal", "uniform", "exponential", "multinomial",
                 "seed", "poisson", "cauchy", "geometric", "log_normal", "rrelu", "gumbel")


def _opname(node: fx.Node) -> str:
    if node.op == "call_method":
        return str(node.target)
    if node.op != "call_function":
        return node.op
    t = node.target
    if isinstance(t, torch._ops.OpOverload):
        return t._schema.name.split("::")[-1]
    if isinstance(t, torch._ops.OpOverloadPacket):
        return t._qualified_op_name.split("::")[-1]
    return getattr(t, "__name__", str(t))


def _is_inplace(node: fx.Node) -> bool:
    if node.op == "call_function" and node.target in _INPLACE_FUNCS:
        return True
    if node.op == "call_function" and getattr(node.target, "__module__", "") in ("_operator", "operator"):
        return False  # operator.and_ / or_ / not_ are pure
    name = _opname(node)
    return node.op in ("call_method", "call_function") and name.endswith("_") and not name.endswith("__")


def _arg(node: fx.Node, i: int, name: str, default: Any = None) -> Any:
    if len(node.args) > i:
        return node.args[i]
    return node.kwargs.get(name, default)


def _scalar(v: Any) -> Optional[float]:
    if isinstance(v, bool):
        return float(v)
    if isinstance(v, (int, float)):
        return float(v)
    return None


# ----------------------------------------------------------------------------- concrete evaluation

def _real_buffer(node: fx.Node) -> Optional[torch.Tensor]:
    """The real tensor of a placeholder that Dynamo lifted from a module buffer (not a parameter)."""
    if node.op != "placeholder" or "_dynamo_static_input_type" not in node.meta.get("tensor_dict", {}):
        return None
    fake = example_value(node)
    if not isinstance(fake, torch.Tensor) or fake.requires_grad or not _static(node):
        return None
    try:  # FakeTensorConverter keeps (weakly) the real tensor each fake was made from
        conv = fake.fake_mode.fake_tensor_converter
        memo, desc = conv.tensor_memo, conv.meta_converter.describer
        for real, tid in list(desc.lookup_tensor.items()):
            if memo.get(tid) is fake and not isinstance(real, torch._subclasses.FakeTensor):
                # parameters (even frozen ones) are weights that training or the user may change
                return None if isinstance(real, torch.nn.Parameter) or real.requires_grad else real
    except Exception:
        return None
    return None


def _exact_positions(n: fx.Node) -> bool:
    """Every dim of n is statically below 2**24 - 2**20 (index arithmetic stays exact in fp32)."""
    shape = _shape(n)
    return shape is not None and all(_sym_true(s < (1 << 24) - (1 << 20)) for s in shape)


class _Evaluator:
    """Evaluates constant-foldable static-shape nodes with real tensors."""

    def __init__(self, gm: fx.GraphModule):
        self.gm = gm
        self.foldable: dict = {}
        self.values: dict = {}

    def can_fold(self, node: Any) -> bool:
        if not isinstance(node, fx.Node):
            return _static_value(node)
        if node in self.foldable:
            return self.foldable[node]
        self.foldable[node] = False  # cycles cannot happen; this also bounds recursion on failure
        ok = _static(node) and not any(_is_inplace(u) for u in node.users)
        if ok:
            if node.op == "placeholder":
                ok = _real_buffer(node) is not None
            elif node.op == "get_attr":
                try:
                    val = self.gm
                    for part in str(node.target).split("."):
                        val = getattr(val, part)
                except AttributeError:
                    val = None
                ok = isinstance(val, torch.Tensor) and not isinstance(val, torch.nn.Parameter) and not val.requires_grad
            elif node.op in ("call_function", "call_method"):
                name = _opname(node).lower()
                ok = not _is_inplace(node) and not any(w in name for w in _RANDOM_WORDS)
                if ok:
                    deps = []
                    fx.node.map_arg((node.args, node.kwargs), deps.append)
                    ok = all(self.can_fold(d) for d in deps)
            else:
                ok = False
        if ok:
            v = example_value(node)
            ok = not isinstance(v, torch.Tensor) or v.numel() <= CONCRETE_MAX_NUMEL
        self.foldable[node] = ok
        return ok

    def value(self, node: fx.Node) -> Any:
        if node in self.values:
            return self.values[node]
        if node.op == "placeholder":
            val = _real_buffer(node).detach().clone()
        elif node.op == "get_attr":
            val = self.gm
            for part in str(node.target).split("."):
                val = getattr(val, part)
            if isinstance(val, torch.Tensor):
                val = val.detach().clone()
        else:
            args = fx.node.map_arg(node.args, self.value)
            kwargs = fx.node.map_arg(node.kwargs, self.value)
            if node.op == "call_method":
                val = getattr(args[0], node.target)(*args[1:], **kwargs)
            else:
                val = node.target(*args, **kwargs)
        self.values[node] = val
        return val

    def evaluate(self, node: fx.Node) -> Any:
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        with unset_fake_temporarily(), torch.no_grad():
            return self.value(node)


def _band_of(m: torch.Tensor) -> Optional[_Keep]:
    """The band lo <= j - i <= hi equal to the 2-D bool matrix m, or None."""
    nq, nk = m.shape
    if bool(m.all()):
        return _TRUE
    if not bool(m.any()):
        return None
    d = torch.arange(nk).view(1, nk) - torch.arange(nq).view(nq, 1)
    lo, hi = int(d[m].min()), int(d[m].max())
    if not torch.equal(m, (d >= lo) & (d <= hi)):
        return None
    return _Keep(lo=None if lo <= -(nq - 1) else lo, hi=None if hi >= nk - 1 else hi)


def _affine_of(val: torch.Tensor) -> Optional[_Lin]:
    """The _Lin equal to an integer tensor whose value is c + sum(coef_d * index_d), or None.

    Small index tensors (HF's `position_ids[batch_idx, q_idx]`, [B, 1, Nq, 1]) fold concretely while the
    [B, 1, Nq, Nk] comparison built from them may be too large to evaluate; as _Lin the comparison is
    proven symbolically at any size."""
    if val.dtype == torch.bool or val.is_floating_point() or val.is_complex() or val.dim() == 0:
        return None
    v = val.to(torch.int64)
    const = int(v.reshape(-1)[0])
    expect = torch.full((1,) * v.dim(), const, dtype=torch.int64)
    coef = []
    for d, size in enumerate(v.shape):
        if size < 2:
            continue
        idx = [0] * v.dim()
        idx[d] = 1
        c = int(v[tuple(idx)]) - const
        if c == 0:
            continue
        coef.append((d - v.dim(), c))
        shape = [1] * v.dim()
        shape[d] = size
        expect = expect + c * torch.arange(size, dtype=torch.int64).view(shape)
    if not coef or not torch.equal(v, expect.expand(v.shape)):
        return None
    return _Lin(tuple(sorted(coef)), const)


def _classify(node: fx.Node, val: Any) -> AbsVal:
    """Abstract value of a concretely evaluated node."""
    if not isinstance(val, torch.Tensor):
        s = _scalar(val)
        return _Konst(s) if s is not None else _Opaque(node)
    if val.numel() == 0:
        return _Opaque(node)
    flat = val.reshape(-1)
    if bool((flat == flat[0]).all()) and val.dtype != torch.bool:
        return _Konst(float(flat[0]))
    r = _classify_mask(node, val)
    if isinstance(r, _Opaque):  # only what no mask form describes: results above never change
        lin = _affine_of(val)
        if lin is not None:
            return lin
    return r


def _classify_mask(node: fx.Node, val: torch.Tensor) -> AbsVal:
    if val.dim() < 2:
        return _Opaque(node)
    m3 = val.reshape(-1, val.shape[-2], val.shape[-1])
    if not bool((m3 == m3[0:1]).all()):
        return _Opaque(node)
    m = m3[0]
    if val.dtype == torch.bool:
        band = _band_of(m)
        return band if band is not None else _Opaque(node)
    if val.is_floating_point() or not val.dtype.is_complex:
        vals = torch.unique(m.double())
        if vals.numel() == 2 and float(vals[0]) == 0 and float(vals[1]) == 1:
            band = _band_of(m != 0)
            if band is not None:
                return replace(band, numeric=True)
        if val.is_floating_point() and vals.numel() == 2 and 0.0 in vals.tolist():
            c = float(vals[0]) if float(vals[1]) == 0 else float(vals[1])
            band = _band_of(m == 0)
            if band is not None:
                return _Two(band, c)
    return _Opaque(node)


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


# ----------------------------------------------------------------------------- the abstract interpreter

_SHAPE_OPS = {"view", "reshape", "unsqueeze", "squeeze", "expand", "expand_as", "broadcast_to", "contiguous",
              "clone", "detach", "getitem", "_unsafe_view", "view_as", "reshape_as"}
_CMP = {"lt": "lt", "le": "le", "gt": "gt", "ge": "ge", "eq": "eq", "ne": "ne", "less": "lt",
        "less_equal": "le", "greater": "gt", "greater_equal": "ge", "__lt__": "lt", "__le__": "le",
        "__gt__": "gt", "__ge__": "ge", "__eq__": "eq", "__ne__": "ne", "not_equal": "ne"}
_FLIP = {"lt": "gt", "le": "ge", "gt": "lt", "ge": "le", "eq": "eq", "ne": "ne"}


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
        if any(_is_inplace(u) for u in n.users) or _is_inplace(n):
            return _Opaque(n)  # its value depends on where it is read; never reason about it
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
        name = _opname(n)
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
        x = self.value(n.args[0])
        return self._convert(n, x, _dtype(n.args[0]), _dtype(n))

    _op_type = _op_type_as = _op_float = _op_half = _op_bfloat16 = _op_double = _op_bool = _op_long = _op_to
    _op_int = _op_to

    def _op_to_copy(self, n):
        return self._op_to(n)

    # --- logic
    def _logic_and(self, n: fx.Node) -> Optional[AbsVal]:
        a, b = n.args[0], n.args[1]
        try:
            r = _and(self.keep(a), self.keep(b))
        except _Fail:
            return None
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
        if isinstance(a, _Lin) or isinstance(b, _Lin):
            r = self._lin_cmp(n, a, b, an, bn, op)
            if r is not None:
                return r
        return _Opaque(n)

    def _lin_cmp(self, n, a, b, an, bn, op) -> Optional[AbsVal]:
        # key padding: arange(Nk) OP lens[..., None]
        for x, y, ynode, o in ((a, b, bn, op), (b, a, an, _FLIP[op])):
            if isinstance(x, _Lin) and isinstance(y, _Opaque) and isinstance(ynode, fx.Node):
                if x.coef != ((-1, 1),) or _as_int(x.const) != 0 or o not in ("lt", "le"):
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
                return _Keep(lens=(ynode, bdim, 1 if o == "le" else 0))
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

    # --- shape-only ops
    def _shape_op(self, n: fx.Node, name: str) -> AbsVal:
        src = n.args[0]
        x = self.value(src)
        ins, outs = _shape(src), _shape(n)
        if ins is None or outs is None:
            return _Opaque(n)
        slices: dict = {}
        if name == "getitem":
            gm_ = _getitem_map(ins, n.args[1])
            if gm_ is None:
                return _Opaque(n)
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
                    return _Opaque(n)
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
                nk = replace(k, lo=lo, hi=hi, lens=lens)
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
        dims = (0, 1) if _opname(n) == "t" else (_arg(n, 1, "dim0"), _arg(n, 2, "dim1"))
        if not all(isinstance(d, int) for d in dims):
            return _Opaque(n)
        if sorted(d % len(shape) for d in dims) != [len(shape) - 2, len(shape) - 1]:
            return _Opaque(n)
        x = self.value(n.args[0])
        k = x.keep if isinstance(x, _Two) and not x.extra else x
        if isinstance(k, _Keep) and not k.data and k.lens is None:
            mirrored = replace(k, lo=None if k.hi is None else -k.hi, hi=None if k.lo is None else -k.lo)
            return replace(x, keep=mirrored) if isinstance(x, _Two) else mirrored
        if isinstance(x, _Konst):
            return x
        if isinstance(x, _Lin):
            swap = {-1: -2, -2: -1}
            return _Lin(tuple(sorted((swap.get(d, d), c) for d, c in x.coef)), x.const)
        return _Opaque(n)


# ----------------------------------------------------------------------------- assembling a MaskSpec

@dataclass
class _TermInfo:
    op: str
    c: float  # masked value (-inf or finite) for converted terms
    keep: Optional[_Keep] = None  # None: untouched float term
    extra: tuple = ()  # float nodes added (untouched terms: the term node itself)
    converted: bool = True
    absorbs: bool = True  # additive 0-or-c: eager's s + c rounds to c, so a fully masked row is uniform


def _absorbs(c: float, dtype: torch.dtype) -> bool:
    """s + c == c in `dtype` for every plausible score s: c <= ABSORB_LIMIT (|s| < 1e22 in fp32/bf16), or
    fp16's finfo.min, which absorbs |s| <= 16 only (eager's own fp16 result is rounding noise beyond)."""
    if c == -math.inf:
        return True
    return c <= ABSORB_LIMIT or (dtype == torch.float16 and c <= float(torch.finfo(torch.float16).min))


def _term_info(an: _Analyzer, t: MaskTerm, scores_dtype: torch.dtype, q_len: Size,
               k_len: Size) -> Union[_TermInfo, str]:
    if t.op == "add":
        if not isinstance(t.tensor, fx.Node):
            s = _scalar(t.tensor)
            if s is None or not math.isfinite(s):
                return f"additive mask constant {t.tensor!r} is not a finite number"
            return _TermInfo("add", 0.0, keep=_TRUE)  # a constant shift does not change softmax
        dt = _dtype(t.tensor)
        if dt == torch.bool:  # scores + bool adds 1.0 where True (HF GPT-Neo with a bool mask): a 0/1 bias
            item = ("to", an.smallest(t.tensor), torch.promote_types(scores_dtype, torch.float32))
            return _TermInfo("add", 0.0, keep=None, extra=(item,), converted=False)
        if dt is None or not dt.is_floating_point:
            return f"additive mask {t.tensor.name} has dtype {dt}, not a float dtype"
        v = an.value(t.tensor)
        if isinstance(v, _Konst):
            if v.value == 0 or (isinstance(v.value, float) and math.isfinite(v.value)):
                return _TermInfo("add", 0.0, keep=_TRUE)
            return f"additive mask {t.tensor.name} is the constant {v.value}"
        if isinstance(v, _Two) and v.on == 0 and (v.c == -math.inf or v.c <= FILL_LIMIT) and _band_fits(
                v.keep, t.tensor, q_len, k_len):
            eager_dt = torch.promote_types(scores_dtype, dt)
            return _TermInfo("add", v.c, keep=v.keep, extra=v.extra, absorbs=_absorbs(v.c, eager_dt))
        return _TermInfo("add", 0.0, keep=None, extra=(an.smallest(t.tensor),), converted=False)
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
        if not (c == -math.inf or c <= FILL_LIMIT):
            return (f"{t.op} mask fill value {c} is not negligible: masked keys keep weight exp({c} - rowmax) "
                    f"(fills at or below {FILL_LIMIT:g} or -inf are supported)")
    small = an.smallest(node)
    try:
        k = an.keep(node)
    except _Fail:
        k = _Keep(data=((small, False),))
    if t.op == "fill":
        nk = _not(k)
        k = nk if nk is not None else _Keep(data=((small, True),))
    if not _band_fits(k, node, q_len, k_len):
        k = _Keep(data=((small, t.op == "fill"),))
    return _TermInfo(t.op, c, keep=k)


def _band_fits(k: _Keep, node: fx.Node, q_len: Size, k_len: Size) -> bool:
    """A band is on the scores' own (query, key) axes: the mask's last two dims are exactly Nq, Nk."""
    shape = _shape(node)
    if shape is None or len(shape) > 4 or k.inverted:
        return False
    if k.lo is None and k.hi is None and k.lens is None:
        return True
    if k.lo is not None or k.hi is not None:
        if len(shape) < 2 or not _same(shape[-2], q_len) or not _same(shape[-1], k_len):
            return False
    if k.lens is not None:
        _, bdim, _ = k.lens
        if not _same(shape[-1], k_len) or (bdim is not None and bdim != -4):
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


class _Emitter:
    def __init__(self, gm: fx.GraphModule, insert_before: fx.Node):
        self.gm, self.at = gm, insert_before
        self.order = {n: i for i, n in enumerate(gm.graph.nodes)}
        self.made: list = []

    def call(self, target, *args, **kwargs) -> fx.Node:
        with self.gm.graph.inserting_before(self.at):
            n = call(self.gm.graph, target, *args, **kwargs)
        self.made.append(n)
        return n

    def rollback(self) -> None:
        for n in reversed(self.made):
            if not n.users:
                self.gm.graph.erase_node(n)
        self.made.clear()

    def before(self, n: fx.Node) -> bool:
        return self.order.get(n, 1 << 60) < self.order.get(self.at, -1)

    def sym(self, v: Size) -> Union[int, fx.Node]:
        """An int, or a node computing the SymInt v from nodes already in the graph."""
        iv = _as_int(v)
        if iv is not None:
            return iv
        expr = v.node.expr
        by_expr = {}
        for n in self.gm.graph.nodes:
            ev = example_value(n)
            if isinstance(ev, torch.SymInt) and self.before(n):
                by_expr.setdefault(ev.node.expr, n)
        if expr in by_expr:
            return by_expr[expr]
        import sympy

        out: Any = None
        for term, coef in expr.as_coefficients_dict().items():
            if term == 1:
                piece: Any = int(coef)
            else:
                if term not in by_expr or not float(coef).is_integer():
                    raise _Fail(f"no node computes {term}")
                piece = by_expr[term] if coef == 1 else self.call(operator.mul, by_expr[term], int(coef))
            out = piece if out is None else self.call(operator.add, out, piece)
        if out is None or isinstance(sympy.sympify(expr), sympy.Integer):
            raise _Fail(f"cannot build {expr}")
        return out


def _combine(infos: list, an: _Analyzer, q_len, k_len, sdpa: bool) -> Union[str, dict]:
    """The structure and empty-row semantics of converted / untouched terms, or a refusal reason."""
    conv = [t for t in infos if t.converted]
    untouched = [t for t in infos if not t.converted]
    lo = hi = lens = None
    data: list = []
    extras: list = []
    for t in infos:
        extras.extend(t.extra)
    for t in conv:
        k = t.keep
        if k is None:
            continue
        acc = _and(_Keep(lo, hi, lens), _Keep(k.lo, k.hi, k.lens))
        if acc is None:
            return "mask terms combine two key-length bounds or bands not comparable for every size"
        lo, hi, lens = acc.lo, acc.hi, acc.lens
        data.extend(k.data)
    masking = [t for t in conv if t.keep is not None and (t.keep.structural or t.keep.data)]
    cs = {t.c for t in masking}
    no_empty = not data and lens is None and not untouched and not any(
        t.extra for t in infos) and _never_empty(lo, hi, q_len, k_len)
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
    return dict(lo=lo, hi=hi, lens=lens, data=data, extras=extras, empty=empty)


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
) -> Union[MaskSpec, str]:
    """The MaskSpec of a site whose scores receive `terms` in order, or the reason to refuse it."""
    if not terms:
        return MaskSpec()
    try:
        return _analyze(gm, terms, batch=batch, q_len=q_len, k_len=k_len, scores_dtype=scores_dtype,
                        insert_before=insert_before, sdpa=sdpa)
    except Exception as e:  # an unforeseen graph form refuses the site; it never breaks compilation
        if _DEBUG:
            raise
        return f"mask analysis failed: {type(e).__name__}: {e}"


def _analyze(gm, terms, *, batch, q_len, k_len, scores_dtype, insert_before, sdpa) -> Union[MaskSpec, str]:
    sdpa = sdpa or any(t.op == "bool" for t in terms)  # a bool keep-mask is SDPA's: empty rows give 0
    an = _Analyzer(gm)
    infos = []
    for t in terms:
        info = _term_info(an, t, scores_dtype, q_len, k_len)
        if isinstance(info, str):
            return info
        infos.append(info)

    def is_mask_add(i: int) -> bool:
        t = infos[i]
        return (t.op == "add" and t.converted and t.keep is not None and (t.keep.structural or bool(t.keep.data))
                and isinstance(terms[i].tensor, fx.Node))

    def untouched_adds(src: list) -> list:
        # additive masks passed as they are: the op then does eager's own arithmetic on them
        return [_TermInfo("add", 0.0, keep=None, extra=(an.smallest(terms[i].tensor),), converted=False)
                if is_mask_add(i) else t for i, t in enumerate(src)]

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
            if t.c != -math.inf and not fill_gradient_kept(i):
                refusals.append("a finite fill mixed with an additive mask: on a fully masked row eager's "
                                "filled scores get no gradient, the op's bias would pass one (training graph)")
                return None
            node = terms[i].tensor
            item = ("where", node, t.c, t.op == "fill")  # masked where node is True for fill, False otherwise
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

    refusals: list = []
    attempts = [infos]
    if any(is_mask_add(i) for i in range(len(infos))):
        attempts.append(untouched_adds(infos))
    if any(t.keep is not None and t.keep.structural for t in attempts[-1]):
        attempts.append(destructured(attempts[-1]))
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
        em = _Emitter(gm, insert_before)
        try:
            return _emit_spec(em, plan, batch, q_len, k_len)
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
    return set(f.data) <= set(a.data)


def _emit_spec(em: "_Emitter", plan: dict, batch, q_len, k_len) -> MaskSpec:
    lo, hi, lens = plan["lo"], plan["hi"], plan["lens"]
    kinds = []
    spec = MaskSpec(empty_rows=plan["empty"])
    # band lo <= j - i <= hi  ->  op: d = j - i - diag_offset; causal d <= 0; window_left: d >= -wl
    if hi is not None:
        spec.causal = True
        if lo is not None:
            width = _as_int(hi - lo)
            if width is None:
                raise _Fail("window width is symbolic")
            if width < 0:
                raise _Fail("band admits no key")
            spec.window_left = width
        spec.diag_offset = em.sym(hi)
        if lo is not None:
            kinds.append("window")
        elif _as_int(hi) == 0:
            kinds.append("causal")
        elif _same(hi, k_len - q_len):
            kinds.append("causal-bottom-right")
        else:
            kinds.append("causal-offset")
    elif lo is not None:
        spec.diag_offset = em.sym(lo)
        spec.window_left = 0
        kinds.append("window")
    if lens is not None:
        node, _, add = lens
        if not em.before(node):
            raise _Fail("key lengths are computed after the site")
        kv = em.call(torch.reshape, node, (-1,))
        if add:
            kv = em.call(operator.add, kv, add)
        if _dtype(kv) != torch.int32:
            # int32 is what FA3 (seqused_k) takes; converting here lets Inductor fuse it into the
            # lengths' own arithmetic instead of a kernel launch per call (decode is host-bound).
            # Clamped first so that no length wraps: every value keeps its meaning (<= 0: no keys,
            # >= Nk: every key).
            kv = em.call("clamp", kv, 0, 2**31 - 1, method=True)
            kv = em.call("to", kv, torch.int32, method=True)
        spec.kv_lens = kv
        kinds.append("key-padding")
    bool_bias = None
    for node, neg in dict.fromkeys(plan["data"]):
        if not em.before(node):
            raise _Fail(f"mask {node.name} is computed after the site")
        f = em.call(torch.logical_not, node) if neg else node
        bool_bias = f if bool_bias is None else em.call(torch.logical_and, bool_bias, f)
    float_bias = None
    for node in plan["extras"]:
        if isinstance(node, tuple) and node[0] == "to":  # ("to", bool node, dtype): a bool added as 0/1
            _, m, dt = node
            if not em.before(m):
                raise _Fail(f"mask {m.name} is computed after the site")
            node = em.call("to", m, dt, method=True)
        elif isinstance(node, tuple):  # ("where", bool node, c, masked_when_true): a fill as an additive float
            _, m, c, masked_when_true = node
            if not em.before(m):
                raise _Fail(f"mask {m.name} is computed after the site")
            node = em.call(torch.where, m, c, 0.0) if masked_when_true else em.call(torch.where, m, 0.0, c)
        elif not em.before(node):
            raise _Fail(f"mask {node.name} is computed after the site")
        float_bias = node if float_bias is None else em.call(operator.add, float_bias, node)
    if bool_bias is not None and float_bias is not None:
        spec.bias = em.call(torch.where, bool_bias, float_bias, float("-inf"))
        kinds += ["bool-mask", "bias"]
    elif bool_bias is not None:
        spec.bias = bool_bias
        kinds.append("bool-mask")
    elif float_bias is not None:
        spec.bias = float_bias
        kinds.append("bias")
    if spec.bias is not None and len(_shape(spec.bias) or ()) > 4:
        raise _Fail("residual mask has more than 4 dims")
    spec.kind = "+".join(kinds) if kinds else "none"
    if spec.kind == "none":
        spec.empty_rows = "impossible"
    return spec
