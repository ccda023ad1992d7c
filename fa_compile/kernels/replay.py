"""A Triton launch repeated on other tensors of the same layout, without Triton's per-call work.

`kernel[grid](...)` binds and specializes every argument on each call, and a Gluon TensorDescriptor validates its
block shape and layout each time one is built. For the Gluon backward's 35 arguments and five descriptors that,
with the checks around it, is most of the op's host time (an H100's host: 432 µs per call through Triton, 139
replayed; benchmarks/results/gluon-op-host-replay-h100-2026-12-06.txt). An op that Inductor's generated code calls
once per site and step passes arguments that differ from one step to the next only in their tensors' addresses.
So the op's first launch goes through Triton and is recorded here, and later launches reuse its compiled kernel
and argument list: the new tensors are put in their places, and each descriptor is copied with the new base.

What a replay may reuse is what the caller's key fixes: shapes, strides, dtypes, devices and scalars, so that
every integer and float argument, every constexpr and the choice of kernel are those of the recorded launch.
Triton's specialization also reads one property of a tensor's value, the 16-byte alignment of its address: a
launch whose pointer is unaligned where the recorded one was aligned is refused (the caller takes Triton's path),
as is a descriptor base that TMA cannot take. Nothing from the recorded call is kept but its compiled kernel and
its non-tensor arguments: the argument list holds no tensor between launches.
"""
from __future__ import annotations

import copy
from typing import Any, Optional, Sequence

import torch
from torch import Tensor


def _raw_stream(device: int) -> int:
    """The current stream's handle, as Triton's launches and Inductor's generated code read it."""
    return torch._C._cuda_getCurrentRawStream(device)


def _rebase(desc: Any, base: Optional[Tensor]) -> Any:
    """`desc` (a host tensor descriptor) with `base` as its tensor: same shape, strides, block and layout."""
    try:
        new = object.__new__(type(desc))
        new.__dict__.update(desc.__dict__)
        new.__dict__["base"] = base
    except (AttributeError, TypeError):  # a descriptor class with __slots__
        new = copy.copy(desc)
        object.__setattr__(new, "base", base)
    return new


class Replay:
    """The compiled kernel, grid and argument list of one launch; `launch(tensors)` runs it again with `tensors`
    in the recorded launch's `dynamic` places (tensors, or descriptors rebased on them)."""

    __slots__ = ("_handle", "_grid", "_values", "_slots", "_is_desc", "_aligned")

    def __init__(self, handle: Any, grid: tuple, values: list, slots: list[int], is_desc: list[bool],
                 aligned: list[bool]) -> None:
        self._handle, self._grid, self._values = handle, grid, values
        self._slots, self._is_desc, self._aligned = slots, is_desc, aligned

    @classmethod
    def record(cls, kernel: Any, handle: Any, grid: Sequence[int], args: Sequence, kwargs: dict,
               dynamic: Sequence[str]) -> Optional["Replay"]:
        """A replay of the launch `kernel[grid](*args, **kwargs)` that returned the compiled kernel `handle`, with
        the arguments named in `dynamic` supplied per launch; None where it cannot be replayed (an argument left
        to its default, a name that is not the kernel's, a grid not of plain ints, a handle that is not a compiled
        kernel)."""
        names = list(getattr(kernel, "arg_names", ()))
        if not names or len(args) > len(names) or not hasattr(type(handle), "__getitem__"):
            return None
        if not hasattr(handle, "function") or not all(type(g) is int for g in grid) or not 1 <= len(grid) <= 3:
            return None
        try:
            values = list(args) + [kwargs[n] for n in names[len(args):]]
            slots = [names.index(n) for n in dynamic]
        except (KeyError, ValueError):
            return None
        is_desc, aligned = [], []
        for i in slots:
            v = values[i]
            desc = not isinstance(v, Tensor)
            t = getattr(v, "base", None) if desc else v
            if not isinstance(t, Tensor):
                return None
            is_desc.append(desc)
            aligned.append(t.data_ptr() % 16 == 0)
            values[i] = _rebase(v, None) if desc else None  # no tensor outlives the recorded call
        if any(isinstance(v, Tensor) for v in values):
            return None  # a tensor argument not named dynamic would be this call's forever
        full = tuple(grid) + (1,) * (3 - len(grid))
        return cls(handle, full, values, slots, is_desc, aligned)

    def launch(self, tensors: Sequence[Tensor], device: int) -> bool:
        """Launch with `tensors` in the dynamic places on the current stream of `device`, which must be the
        current device and the one the kernel was recorded on (the caller's key): True, or False without
        launching where an address breaks the recorded specialization or TMA's alignment."""
        values = self._values.copy()
        for i, desc, aligned, t in zip(self._slots, self._is_desc, self._aligned, tensors):
            if t.data_ptr() % 16 and (aligned or desc):
                return False
            values[i] = _rebase(values[i], t) if desc else t
        self._handle[self._grid](*values, stream=_raw_stream(device))
        return True
