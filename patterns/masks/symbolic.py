"""Symbolic sizes: conditions proven for every size the guards admit, and example-value shapes."""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.fx as fx

from ..emit import example_value


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
