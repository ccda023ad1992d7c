"""A multiplicative mask: `s * m + (1 - m) * c` (or `s * m - (1 - m) * c`), read as a masked_fill.

Where m is 1 the sum is s + 0 * c = s; where m is 0 it is 0 * s + c = c (in the scores' dtype, as
eager rounds `1 * c`): masked_fill(m == 0, c), values and gradient (eager's d/ds is m, 0 on the masked
entries, as masked_fill's). That holds only when m is 0 or 1 everywhere (masks.zero_one proves it, or
the site is refused), m gets no gradient (eager would give m one), every node computes in the scores'
dtype, c is a finite number (0 * inf is NaN: with c = -inf the sum is NaN everywhere) and s is finite
where m is 0 (an inf score there makes eager's 0 * inf a NaN).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.fx as fx

from .aliasing import same_value
from .canonicalize import arg, constant_value, kind, tensor_of
from .shapes import known_eq


@dataclass
class MultMask:
    scores: fx.Node  # s
    mask: fx.Node  # m
    fill: float  # the value of the masked entries, as eager computes it in the scores' dtype
    product: fx.Node  # s * m, a node of the scores chain


def _operands(node: fx.Node) -> tuple[Any, Any]:
    return node.args[0], arg(node, 1, "other")


def _one_minus(node: Any) -> Optional[fx.Node]:
    """m when node is 1 - m."""
    if kind(node) != "sub" or node.kwargs.get("alpha", 1) != 1:
        return None
    a, b = _operands(node)
    return b if constant_value(a) == 1.0 and isinstance(b, fx.Node) else None


def _penalty(node: Any) -> Optional[tuple[fx.Node, float]]:
    """(m, c) when node is (1 - m) * c or c * (1 - m), c a number."""
    if kind(node) != "mul":
        return None
    a, b = _operands(node)
    for inv, c in ((a, b), (b, a)):
        m, cv = _one_minus(inv), constant_value(c)
        if m is not None and cv is not None and math.isfinite(cv):  # 0 * inf is NaN: no mask
            return m, cv
    return None


def match_mult_mask(node: fx.Node, scores_dtype: torch.dtype) -> Optional[MultMask]:
    """The multiplicative mask `node` applies, or None when it is not that spelling."""
    k = kind(node)
    if k not in ("add", "sub") or node.kwargs.get("alpha", 1) != 1:
        return None
    a, b = _operands(node)
    for prod, pen, sign in ((a, b, 1.0), (b, a, 1.0)) if k == "add" else ((a, b, -1.0),):
        if kind(prod) != "mul" or not isinstance(pen, fx.Node):
            continue
        found = _penalty(pen)
        if found is None:
            continue
        m, c = found
        x, y = _operands(prod)
        # the mask may be spelled twice (`s * m[:, None] + (1 - m[:, None]) * c`): two views of one value
        s = x if same_value(y, m) else y if same_value(x, m) else None
        if not isinstance(s, fx.Node):
            continue
        nodes = [node, prod, pen, pen.args[0] if _one_minus(pen.args[0]) is m else arg(pen, 1, "other"), m, s]
        if any(tensor_of(n) is None or tensor_of(n).dtype != scores_dtype for n in nodes):
            return None
        ss, os_ = tensor_of(s).shape, tensor_of(node).shape
        if len(ss) != len(os_) or not all(known_eq(a, b) for a, b in zip(ss, os_)):
            return None  # m broadcasts the scores to more entries: not a mask of them
        if len(prod.users) != 1 or len(pen.users) != 1:
            return None
        fill = sign * float(torch.ones((), dtype=scores_dtype) * c)  # (1 - 0) * c, rounded as eager does
        return MultMask(s, y if s is x else x, fill, prod)  # the mask as the product reads it
    return None
