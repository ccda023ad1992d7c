"""fa3::key_limit (fa_compile/key_limit_op.py) after AOTAutograd: on CUDA one Triton kernel launched by
Inductor (`fa3_decode::key_limit`, fa_compile/kernels/decode_ops.py), elsewhere its graph ops, which Inductor fuses.

Written as graph ops, the limit over a 16384-key cache was two reduction kernels per decode layer
(Inductor splits a reduction of that length when it has few rows), 3.3 us of the step's 43 on the H200;
the kernel reads each row in one block of up to 16384 keys. Where the kernel cannot take the mask
(fp64, Triton unusable) or its splice fails, the graph ops run instead; if those fail too, the op stays
(its eager body is exact, one run-time call).

The layers of a step share one limit (share.py keeps one node per distinct mask and threshold).
"""
from __future__ import annotations

import os
import warnings
from typing import Optional

import torch
import torch.fx as fx

from ..key_limit_op import KEY_LIMIT, key_limit_math
from . import splice

DEVICES = ("cuda",)  # where the Triton kernel runs (tests add "cpu" under the interpreter)
_WARNED: set = set()


def _kernel_reasons(bias: torch.Tensor) -> list[str]:
    from ..kernels import decode_ops
    from ..kernels.triton_family import device_reasons, triton_available

    if bias.device.type not in DEVICES:
        return [f"device {bias.device.type}"]
    if not triton_available():
        return ["triton not installed"]
    if os.environ.get("FA_COMPILE_TRITON_LOWER", "auto") == "0":
        return ["Triton kernels are not lowered (FA_COMPILE_TRITON_LOWER=0)"]
    r = device_reasons(bias.device)
    if bias.dtype not in decode_ops.KEY_LIMIT_DTYPES:
        r.append(f"dtype {bias.dtype}")
    return r


def lower(graph: fx.Graph, node: fx.Node) -> Optional[str]:
    """Replace one fa3::key_limit node; returns what it became ("kernel", "graph ops") or None (kept)."""
    bias, absorb = node.args[0], float(node.args[1])
    val = bias.meta.get("val") if isinstance(bias, fx.Node) else None
    if not isinstance(val, torch.Tensor):
        return None
    tries = []
    if not _kernel_reasons(val):
        from torch._subclasses.functional_tensor import dispatch_functionalize

        from ..kernels import decode_ops

        # traced functionalized, the triton_op becomes its kernel's HOP, which Inductor launches itself
        # (traced plainly it stayed an extern call of the op, which a process that has not imported the
        # kernels cannot resolve when it runs Inductor's cached code)
        tries.append(("kernel", dispatch_functionalize(lambda b: decode_ops.key_limit(b, absorb))))
    tries.append(("graph ops", lambda b: key_limit_math(b, absorb)))
    for what, fn in tries:
        try:
            splice.replace_value(graph, node, fn, [bias])
            return what
        except Exception as e:
            if (what, type(e).__name__) not in _WARNED:
                _WARNED.add((what, type(e).__name__))
                warnings.warn(f"fa_compile: lowering the key limit {node.name} to its {what} failed "
                              f"({type(e).__name__}: {str(e)[:200]}); trying the next way", RuntimeWarning, stacklevel=2)
    return None


def is_key_limit(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is KEY_LIMIT
