"""Tensors the pass reads at compile time as constants, and what it takes to keep that sound.

The mask analysis evaluates a static-shape subgraph with real tensors when it depends on no graph
input but module buffers (a lower-triangular `bias` buffer, a positions buffer) or tensors held by the
graph module (get_attr): patterns/masks/concrete.py. Dynamo does not guard a tensor's contents, so a
model that writes into such a buffer after compiling would run the graph rewritten for the old values.
A rewrite that rests on such a read is therefore only made where the caller can check, on every call,
that each tensor read is still the same object with the same version counter (an in-place write bumps
it): `fa_compile.backend()` wraps the compiled graph with that check (fa_compile/constant_guard.py) and
runs the graph as traced when it fails. Where no such check can be installed (Inductor's pre-grad pass
under FA_COMPILE=1 edits the graph but never sees the compiled function), `reading()` is not entered:
buffers are then graph data like any input, and their masks reach the op as a bool or float bias.
"""
from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch
import torch.fx as fx


@dataclass(frozen=True)
class ConstantRead:
    """One tensor the pass read as a constant: a placeholder's real input (`index` among the graph's
    placeholders) or a tensor held by the graph module (`index` None); `version` its version counter
    at compile time."""

    tensor: torch.Tensor
    version: int
    index: Optional[int]
    name: str
    # A Python float that Dynamo passes as a graph input (dynamic shapes): checked by value, not by object (each call
    # wraps the float in a new 0-d tensor).
    value: Optional[float] = None


_READS: contextvars.ContextVar[Optional[dict]] = contextvars.ContextVar("fa_compile_constant_reads", default=None)


@contextlib.contextmanager
def reading() -> Iterator[dict]:
    """Within: the pass may read buffers and module tensors as constants; the dict it yields collects
    each read (node name -> ConstantRead)."""
    reads: dict = {}
    token = _READS.set(reads)
    try:
        yield reads
    finally:
        _READS.reset(token)


def allowed() -> bool:
    return _READS.get() is not None


def note(name: str, tensor: torch.Tensor, index: Optional[int]) -> bool:
    """Record a constant read; False (the read must not happen) outside `reading()` or for a tensor
    without a version counter (an inference-mode tensor), whose writes no check could see."""
    reads = _READS.get()
    if reads is None:
        return False
    try:
        version = int(tensor._version)
    except RuntimeError:
        return False
    reads.setdefault(name, ConstantRead(tensor, version, index, name))
    return True


def read_float(node: Any) -> Optional[float]:
    """The value of a Python float that Dynamo made a graph input (`x.item()` of the 0-d tensor it wraps a global,
    a module attribute or a config value in, as it does under dynamic shapes), read as a constant: the backend's
    check compares it on every call (fa_compile/constant_guard.py). None for anything else, and outside
    `reading()` (FA_COMPILE=1's pre-grad pass cannot check it: the site keeps it as data)."""
    reads = _READS.get()
    if reads is None or not isinstance(node, fx.Node) or node.op != "call_method" or node.target != "item" \
            or len(node.args) != 1 or node.kwargs:
        return None
    ph = node.args[0]
    if not isinstance(ph, fx.Node) or ph.op != "placeholder":
        return None
    ga = ph.meta.get("grapharg")
    ex = getattr(ga, "example_strong_ref", None)
    if not getattr(ga, "pass_arg_as_tensor", False) or not isinstance(ex, torch.Tensor) or ex.dim() != 0 \
            or not ex.dtype.is_floating_point:
        return None
    value = float(ex)
    if ph.name not in reads:  # (every layer's site reads the same input)
        reads[ph.name] = ConstantRead(ex, 0, placeholder_index(ph), source_name(ph), value)
    return value


def placeholder_index(ph: fx.Node) -> int:
    """`ph`'s position among the graph's placeholders (which come first in the graph)."""
    index = 0
    for n in ph.graph.nodes:
        if n is ph:
            break
        index += n.op == "placeholder"
    return index


def source_name(node: fx.Node) -> str:
    """Where Dynamo took a placeholder's value from (`L['self']._buffers['bias']`), else its name."""
    try:
        name = node.meta["grapharg"].source.name
        name = name() if callable(name) else name  # a method before torch 2.13, a property since
        return name if isinstance(name, str) and name else node.name
    except (KeyError, AttributeError):
        return node.name
