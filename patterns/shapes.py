"""Size comparisons that never add a guard: a symbolic size is only "equal" when provably so."""
from __future__ import annotations

from typing import Any

import torch


def known_eq(a: Any, b: Any) -> bool:
    """True only when a == b for every size the graph admits (no specialization, no new guard)."""
    if isinstance(a, (torch.SymInt, torch.SymFloat)) or isinstance(b, (torch.SymInt, torch.SymFloat)):
        from torch.fx.experimental.symbolic_shapes import statically_known_true

        try:
            return bool(statically_known_true(a == b))
        except Exception:
            return False
    return a == b


def known_one(a: Any) -> bool:
    return known_eq(a, 1)


def prod(xs) -> Any:
    out: Any = 1
    for x in xs:
        out = out * x
    return out
