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
from typing import Iterator, Optional

import torch


@dataclass(frozen=True)
class ConstantRead:
    """One tensor the pass read as a constant: a placeholder's real input (`index` among the graph's
    placeholders) or a tensor held by the graph module (`index` None); `version` its version counter
    at compile time."""

    tensor: torch.Tensor
    version: int
    index: Optional[int]
    name: str


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
