"""The check that keeps rewrites resting on tensors read at compile time sound (patterns/constants.py).

`fa_compile.backend()` wraps a compiled graph whose rewrite read module buffers or module tensors as
constants: each call first checks that every such tensor is still the object compiled against, over
the same memory (`.data = other` moves it), with the version counter it had (an in-place write,
`copy_` included, bumps it). A few attribute reads per tensor, no device work. When a check fails, the values
it was compiled for are gone, and Dynamo would not recompile for them (it does not guard tensor contents):
the graph as Dynamo traced it is compiled again, once, with those tensors read as data (a serving loop's
slot-occupancy or position buffer becomes the run-time mask it is), and that compiled graph runs from then
on. Where that cannot be done (symbolic shapes, whose compile needs Dynamo's own context; a compile that
fails), the traced graph runs uncompiled, with one warning. Writes that autograd's version counter does not
see either (through `.data`, or a NumPy view of the memory) are not seen here: reading the contents on every
call would cost a pass over each buffer (and a device sync on a GPU).
"""
from __future__ import annotations

import warnings
from typing import Any, Callable, Optional, Sequence

import torch
import torch.fx as fx

CONSTANT_READS = "fa_compile_constant_reads"  # gm.meta: node name -> patterns.constants.ConstantRead
PRISTINE = "fa_compile_pristine_graph"  # gm.meta: the graph as traced, for the fallback


def guard_constants(compiled: Callable, gm: fx.GraphModule, example_inputs: Sequence[Any],
                    recompile: Optional[Callable[[fx.GraphModule, list], Callable]] = None) -> Callable:
    """`compiled`, checked before each call against the constants its rewrite read (nothing to check:
    `compiled` itself). `recompile(traced graph, inputs)`: that graph compiled with nothing read as a constant,
    called with the same arguments as `compiled`."""
    reads = gm.meta.get(CONSTANT_READS)
    pristine = gm.meta.get(PRISTINE)
    if not reads or pristine is None:
        return compiled
    # (index among the inputs or None, the tensor, its version, its memory); None: compiled against another object
    # than the one read, never assumed to be it. The tensor is held, not weakly referenced: torch.utils.swap_tensors
    # refuses a tensor with a weakref (module.to() under swap_module_params_on_conversion), and an id compared
    # instead could be a later tensor's over reused memory. A swap changes the memory or version the check reads.
    checks: Optional[list] = [(r.index, r.tensor, r.version, r.tensor.data_ptr()) for r in reads.values()
                              if r.value is None]
    # floats Dynamo passes as inputs (a new 0-d tensor each call): (index, value), compared by value
    values = [(r.index, r.value) for r in reads.values() if r.value is not None]
    if any(r.index is not None and (r.index >= len(example_inputs) or example_inputs[r.index] is not r.tensor)
           for r in reads.values() if r.value is None) or \
            any(i is None or i >= len(example_inputs) or not _same_float(example_inputs[i], v) for i, v in values):
        checks = None
    names = sorted(reads)
    state: dict = {}  # "gm": the traced graph, once a check failed

    def unchanged(args: tuple) -> bool:
        for index, t, version, ptr in checks:
            if (index is not None and args[index] is not t) or t._version != version or t.data_ptr() != ptr:
                return False
        return all(_same_float(args[i], v) for i, v in values)

    def run(*args):
        if "gm" not in state and checks is not None and unchanged(args):
            return compiled(*args)
        if "gm" not in state:
            state["gm"] = _data_reading(gm, pristine, list(args), recompile)  # called as `compiled` is
            if state["gm"] is None:
                state["gm"] = fx.GraphModule(gm, pristine)
                warnings.warn(
                    f"fa_compile: {', '.join(names)}, read as constant{'s' if len(names) > 1 else ''} when the "
                    "attention was rewritten, changed since (an in-place write or another tensor); this graph now "
                    "runs as traced, uncompiled. torch._dynamo.reset() and a new compile take the new values.",
                    RuntimeWarning, stacklevel=2)
        return state["gm"](*args)

    run.__dict__.update(getattr(compiled, "__dict__", {}))  # what Dynamo and AOTAutograd attach to it
    return run


def _data_reading(gm: fx.GraphModule, pristine: fx.Graph, inputs: list,
                  recompile: Optional[Callable[[fx.GraphModule, list], Callable]]) -> Optional[Callable]:
    """The traced graph compiled again with nothing read as a constant, or None: no `recompile`, an input that is
    not a tensor of static shape (Dynamo's symbols, whose compile needs its own context), or a compile that
    failed (its error is the warning's)."""
    if recompile is None or not all(isinstance(x, torch.Tensor) for x in inputs):
        return None
    for n in pristine.nodes:
        val = n.meta.get("example_value") if n.op == "placeholder" else None
        if isinstance(val, torch.Tensor) and not all(type(d) is int for d in tuple(val.shape) + tuple(val.stride())):
            return None
    copy = fx.Graph()
    out = copy.graph_copy(pristine, {})
    copy.output(out)
    try:
        return recompile(fx.GraphModule(gm, copy), inputs)
    except Exception as e:  # noqa: BLE001 - the traced graph then runs uncompiled, with the warning
        warnings.warn(f"fa_compile: compiling the graph again with its buffers read as data failed "
                      f"({type(e).__name__}: {str(e)[:200]})", RuntimeWarning, stacklevel=3)
        return None


def _same_float(x: Any, value: float) -> bool:
    """Whether the input `x` (a 0-d tensor Dynamo wrapped a Python float in, or the float) holds `value`."""
    try:
        v = x.item() if hasattr(x, "item") else float(x)
    except (TypeError, ValueError, RuntimeError):
        return False
    return v == value or (v != v and value != value)


def record(gm: fx.GraphModule, reads: dict, original: Optional[fx.Graph]) -> None:
    """Keep what `guard_constants` needs on `gm` (reads made by a rewrite that changed the graph)."""
    if reads and original is not None:
        for n in original.nodes:  # Dynamo deletes these from its own nodes after compiling (OutputGraph.cleanup):
            n.meta.pop("grapharg", None)  # their weakref to the real input makes torch.utils.swap_tensors refuse it
        gm.meta[CONSTANT_READS] = dict(reads)
        gm.meta[PRISTINE] = original
