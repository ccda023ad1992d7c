"""fa_compile/kernels/replay.py on CPU, with a stand-in for Triton's compiled kernel: where a replayed launch puts
each tensor, what it keeps between launches, and the addresses and launches it refuses. The Gluon backward's use of
it runs on a Hopper GPU (tests/test_gluon_replay_gpu.py)."""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from fa_compile.kernels import replay


@dataclass
class Desc:  # the fields a host tensor descriptor has (Gluon's TensorDescriptor)
    base: object
    shape: list
    strides: list
    block_shape: list
    layout: str
    padding: str = "zero"


class SlotDesc:
    __slots__ = ("base", "shape", "strides")

    def __init__(self, base, shape, strides):
        self.base, self.shape, self.strides = base, shape, strides


class Kernel:
    arg_names = ["a_desc", "X", "n", "Y", "scale", "BLOCK"]


class Handle:
    """Records launches as CompiledKernel[grid](*args, stream=...) makes them."""

    function = object()

    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        def run(*args, stream=None):
            self.launches.append((grid, args, stream))
        return run


@pytest.fixture(autouse=True)
def _stream(monkeypatch):
    monkeypatch.setattr(replay, "_raw_stream", lambda device: 1000 + device)


def aligned(n=8):
    t = torch.empty(n)
    assert t.data_ptr() % 16 == 0
    return t


def unaligned(n=8):
    t = torch.empty(n + 4)[1:n + 1]  # 4 bytes past a 16-byte boundary
    assert t.data_ptr() % 16 == 4
    return t


def record(x, a_base=None, **kw):
    h = Handle()
    d = Desc(aligned() if a_base is None else a_base, [2, 4], [4, 1], [1, 4], "nvmma")
    args = (d, x, 5)
    kwargs = dict(Y=aligned(), scale=0.5, BLOCK=64, num_warps=8)
    kwargs.update(kw)
    return h, d, replay.Replay.record(Kernel, h, (3,), args, kwargs, ("a_desc", "X", "Y"))


def test_launch_puts_the_tensors_in_their_places():
    h, d, r = record(aligned())
    t, x, y = aligned(), aligned(), aligned()
    assert r.launch((t, x, y), 2)
    (grid, args, stream), = h.launches
    assert grid == (3, 1, 1) and stream == 1002
    a, xx, n, yy, scale, block = args
    assert xx is x and yy is y and (n, scale, block) == (5, 0.5, 64)
    assert type(a) is Desc and a.base is t and a is not d
    assert (a.shape, a.strides, a.block_shape, a.layout, a.padding) == ([2, 4], [4, 1], [1, 4], "nvmma", "zero")
    assert r.launch((aligned(), x, y), 0) and h.launches[1][1][0].base is not t


def test_nothing_of_the_recorded_call_is_kept():
    x = aligned()
    h, d, r = record(x)
    kept = r._values
    assert not any(isinstance(v, torch.Tensor) for v in kept)
    assert kept[0].base is None and d.base is not None  # the caller's descriptor is untouched
    assert r.launch((aligned(), aligned(), aligned()), 0)
    assert kept[0].base is None and kept[1] is None  # nor does a launch leave its tensors behind


def test_descriptor_classes_with_slots_are_copied():
    t = aligned()
    d = SlotDesc(t, [8], [1])
    h = Handle()
    r = replay.Replay.record(Kernel, h, (1, 2), (d, aligned(), 5, aligned(), 0.5, 64), {}, ("a_desc", "X", "Y"))
    new = aligned()
    assert r.launch((new, aligned(), aligned()), 0)
    a = h.launches[0][1][0]
    assert type(a) is SlotDesc and a.base is new and d.base is t and a.shape == [8]
    assert h.launches[0][0] == (1, 2, 1)


def test_addresses_that_break_the_specialization_are_refused():
    # Triton specialized the recorded launch on X's 16-byte alignment: an unaligned X needs another kernel.
    h, _, r = record(aligned())
    assert not r.launch((aligned(), unaligned(), aligned()), 0)
    assert not r.launch((unaligned(), aligned(), aligned()), 0)  # TMA takes no unaligned base, ever
    assert h.launches == []
    # recorded unaligned: its kernel assumed nothing, so either address runs it
    h, _, r = record(unaligned())
    assert r.launch((aligned(), aligned(), aligned()), 0) and r.launch((aligned(), unaligned(), aligned()), 0)
    assert len(h.launches) == 2


def test_launches_that_cannot_be_replayed():
    x = aligned()
    d = Desc(aligned(), [8], [1], [8], "l")
    rec = replay.Replay.record
    ok = dict(Y=aligned(), scale=0.5, BLOCK=64)
    assert rec(Kernel, Handle(), (3,), (d, x, 5), ok, ("a_desc", "X", "Y")) is not None
    # an argument left to its default: the list of values is not the kernel's
    assert rec(Kernel, Handle(), (3,), (d, x, 5), dict(Y=aligned(), scale=0.5), ("a_desc", "X", "Y")) is None
    # a tensor not named dynamic would be the recorded call's on every launch
    assert rec(Kernel, Handle(), (3,), (d, x, 5), ok, ("a_desc", "X")) is None
    assert rec(Kernel, Handle(), (3,), (d, x, 5), ok, ("a_desc", "X", "Y", "Z")) is None  # not an argument
    assert rec(Kernel, Handle(), (3, 1.0), (d, x, 5), ok, ("a_desc", "X", "Y")) is None  # not an int grid
    assert rec(Kernel, Handle(), (3, 1, 1, 1), (d, x, 5), ok, ("a_desc", "X", "Y")) is None
    assert rec(Kernel, object(), (3,), (d, x, 5), ok, ("a_desc", "X", "Y")) is None  # not a compiled kernel
    assert rec(Kernel, Handle(), (3,), (d, 7, 5), ok, ("a_desc", "X", "Y")) is None  # a dynamic place not a tensor
