"""Forward-mode AD (`torch.autograd.forward_ad`) through rewritten graphs and through the op.

Inductor's generated code computes on the tensors' primal values only: a dual tensor's tangent does not reach
the outputs, and nothing says so (plain `torch.compile` drops it too, for any op). A graph this backend
compiled with Inductor therefore runs, on a call whose inputs carry tangents, as Dynamo traced it, before any
rewrite, uncompiled: eager's values and eager's tangents (`route_dual_calls`). And the op itself, called with
tangents (`fa_compile.attention` in eager code), computes through the reference math, whose torch ops carry
them (ops.py): its kernels would return plain tensors.

The check per call is one read of the module's dual level while no `forward_ad.dual_level()` is open.
"""
from __future__ import annotations

import warnings
from typing import Any, Callable, Iterable

import torch.autograd.forward_ad as _fwad
import torch.fx as fx
from torch import Tensor

PASS_RECORD = "fa_compile_pass_record"  # gm.meta: the pass's GraphRecord of the graph as traced


def has_tangent(values: Iterable[Any]) -> bool:
    """Whether a forward-AD level is open and one of `values` is a tensor with a tangent at it."""
    if _fwad._current_level < 0:
        return False
    return any(isinstance(t, Tensor) and _fwad.unpack_dual(t).tangent is not None for t in values)


def route_dual_calls(compiled: Callable, gm: fx.GraphModule) -> Callable:
    """`compiled`, except that a call with tangents in its inputs runs the graph as traced (or `gm` itself when the
    pass changed nothing), uncompiled, with one warning per graph."""
    state: dict = {}

    def traced() -> Callable:
        if "gm" not in state:
            record = gm.meta.get(PASS_RECORD)
            state["gm"] = gm if record is None else fx.GraphModule(gm, record.original())
            warnings.warn("fa_compile: forward-mode AD tangents reach a compiled graph, whose generated code would "
                          "drop them; it runs uncompiled, as traced, for calls with tangents", RuntimeWarning,
                          stacklevel=3)
        return state["gm"]

    def run(*args):
        if _fwad._current_level < 0 or not has_tangent(args):
            return compiled(*args)
        return traced()(*args)

    run.__dict__.update(getattr(compiled, "__dict__", {}))  # what Dynamo and AOTAutograd attach to it
    return run


def reference_attention(args: tuple, names: tuple) -> tuple[Tensor, Tensor]:
    """fa3::attention's (out, lse) by the reference math, its torch ops carrying the tangents of `args` (the op's
    arguments in its order, named by `names`); out in the op's BSHD storage."""
    from .kernels.reference import attention_reference

    kw = dict(zip(names, args))
    q, k, v = kw.pop("q"), kw.pop("k"), kw.pop("v")
    out, lse = attention_reference(q, k, v, **kw)
    # The op's documented storage, [B, Nq, Hq, Dv] underneath (a differentiable copy: the tangent follows)
    return out.transpose(1, 2).contiguous().transpose(1, 2), lse
