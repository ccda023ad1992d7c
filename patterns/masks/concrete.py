"""Node helpers and concrete evaluation: static-shape constant subgraphs evaluated with real tensors
and their values classified as bands, 0-or-c masks or index arithmetic."""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Optional

import torch
import torch.fx as fx

from .. import constants
from ..aliasing import is_inplace, op_name, written_in_place
from ..emit import example_value
from .symbolic import _shape, _static, _static_value, _sym_true
from .values import AbsVal, _Keep, _Konst, _Lin, _Opaque, _TRUE, _Two


CONCRETE_MAX_NUMEL = 1 << 24  # concrete evaluation is skipped for larger mask subgraphs


# ----------------------------------------------------------------------------- node helpers

_RANDOM_WORDS = ("rand", "empty", "dropout", "bernoulli", "normal", "uniform", "exponential", "multinomial",
                 "seed", "poisson", "cauchy", "geometric", "log_normal", "rrelu", "gumbel")


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
    """The real tensor of a placeholder that Dynamo lifted from a module buffer (not a parameter), where
    the pass may read it as a constant (patterns/constants.py, which records the read)."""
    if node.op != "placeholder" or "_dynamo_static_input_type" not in node.meta.get("tensor_dict", {}):
        return None
    if not constants.allowed():
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
                if isinstance(real, torch.nn.Parameter) or real.requires_grad:
                    return None
                return real if constants.note(constants.source_name(node), real,
                                              constants.placeholder_index(node)) else None
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
        self._written: dict = {}

    def can_fold(self, node: Any) -> bool:
        if not isinstance(node, fx.Node):
            return _static_value(node)
        if node in self.foldable:
            return self.foldable[node]
        self.foldable[node] = False  # cycles cannot happen; this also bounds recursion on failure
        # a value written anywhere (through a view of it, a tensor it views, or out=) is not its definition's
        ok = _static(node) and not self.written(node)
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
                ok = isinstance(val, torch.Tensor) and not isinstance(val, torch.nn.Parameter) and not val.requires_grad \
                    and constants.note(node.name, val, None)
            elif node.op in ("call_function", "call_method"):
                name = op_name(node).lower()
                ok = not is_inplace(node) and not any(w in name for w in _RANDOM_WORDS)
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

    def written(self, node: fx.Node) -> bool:
        """aliasing.written_in_place, once per node (the analyzer and can_fold both ask)."""
        if node not in self._written:
            self._written[node] = written_in_place(node)
        return self._written[node]

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
            val = self.value(node)
            # Analysed on the host: the readers compare it with index tensors they build there, and a mask
            # must be recognised alike whatever device the model runs on.
            return val.cpu() if isinstance(val, torch.Tensor) else val


def _band_of(m: torch.Tensor) -> Optional[_Keep]:
    """The band lo <= j - i <= hi equal to the 2-D bool matrix m, or None."""
    nq, nk = m.shape
    if bool(m.all()):
        return _TRUE
    if not bool(m.any()) or nq == 1 or nk == 1:
        # a band relates query and key positions: over a size-1 axis it would be relative to row (or key) 0 only,
        # and the mask broadcast along that axis is no band (`j <= 3` over [1, Nk] is not j - i <= 3)
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
