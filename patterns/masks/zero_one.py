"""Proof that a float mask holds only the values 0 and 1, for every input the graph admits.

`s * m + (1 - m) * c` is a mask (s where m is 1, c where m is 0) only when m is 0 or 1 everywhere; a
data tensor of other values (a soft mask, 0.5) makes it a blend. The values are proven from how the
graph builds m: a cast of a bool tensor (through views and casts, which keep the set of values), or a
node the mask analyzer reads as a 0/1 keep-mask (ones / tril / triu / comparisons / where, module
buffers evaluated concretely).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from ..aliasing import is_inplace, op_name
from ..canonicalize import tensor_of
from .analyzer import _Analyzer
from .values import _Keep, _Konst, _Two

# ops whose result holds a subset of their first input's values (0/1 stay exact in every dtype)
_VALUE_SUBSET = {"to", "float", "half", "bfloat16", "double", "type", "type_as", "view", "reshape", "unsqueeze",
                 "squeeze", "expand", "expand_as", "broadcast_to", "getitem", "transpose", "permute", "contiguous",
                 "clone", "detach", "flatten", "view_as", "reshape_as", "_to_copy"}


def zero_one(gm: fx.GraphModule, node: Any) -> bool:
    """Is every element of `node` (a tensor node of the graph) 0 or 1?"""
    n = node
    for _ in range(32):
        t = tensor_of(n)
        if t is None or is_inplace(n) or any(is_inplace(u) for u in n.users):
            return False  # a value written in place depends on where it is read
        if t.dtype == torch.bool:
            return True
        if op_name(n) in _VALUE_SUBSET and n.args and isinstance(n.args[0], fx.Node):
            n = n.args[0]
            continue
        break
    v = _Analyzer(gm).value(node)
    if isinstance(v, _Keep):
        return v.numeric  # a keep-mask stored as numbers: 0/1 by construction
    if isinstance(v, _Konst):
        return v.value in (0.0, 1.0)
    if isinstance(v, _Two):
        return not v.extra and {float(v.on), float(v.c)} <= {0.0, 1.0}
    return False
