"""patterns/aliasing.py: the op names, views and writes that every pass reads, on small hand-built graphs."""
from __future__ import annotations

import operator

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F

import fa_compile  # noqa: F401
from fa_compile.patterns.aliasing import (
    is_inplace, may_alias, op_name, same_value, writes, writes_into, written_args, written_in_place,
)
from fa_compile.patterns.canonicalize import is_inplace as canonical_is_inplace


def _graph() -> tuple[fx.Graph, fx.Node, fx.Node]:
    g = fx.Graph()
    return g, g.placeholder("x"), g.placeholder("y")


def _views(g: fx.Graph, x: fx.Node, n: int) -> fx.Node:
    for i in range(n):
        x = g.call_method("unsqueeze" if i % 2 == 0 else "squeeze", (x, 0))
    return x


def test_op_name_reads_every_spelling():
    g, x, y = _graph()
    assert op_name(g.call_method("add_", (x, 1))) == "add_"
    assert op_name(g.call_function(torch.add, (x, y))) == "add"
    assert op_name(g.call_function(torch.ops.aten.add_.Tensor, (x, y))) == "add_"
    assert op_name(g.call_function(torch.ops.aten.add_, (x, y))) == "add_"
    assert op_name(g.call_function(torch.ops.aten.view.default, (x, [4]))) == "view"
    assert op_name(x) == "placeholder"


def test_aten_overload_is_in_place():
    g, x, y = _graph()
    assert is_inplace(g.call_function(torch.ops.aten.add_.Tensor, (x, y)))
    assert canonical_is_inplace(g.call_function(torch.ops.aten.mul_.Tensor, (x, y)))  # the passes' import
    assert not is_inplace(g.call_function(torch.ops.aten.add.Tensor, (x, y)))
    assert not is_inplace(g.call_function(operator.and_, (x, y)))  # functional despite the underscore


def test_may_alias_is_the_union_of_views_and_identity_casts():
    g, x, _ = _graph()
    for name in ("view", "transpose", "getitem", "contiguous", "long", "int", "float", "detach", "mT"):
        assert may_alias(g.call_method(name, (x,))), name
    assert may_alias(g.call_function(torch.ops.aten.view.default, (x, [4])))
    assert may_alias(g.call_function(operator.getitem, (x, 0)))
    assert not may_alias(g.call_method("add", (x, 1)))
    assert not may_alias(g.call_function(torch.matmul, (x, x)))


@pytest.mark.parametrize("make", [
    lambda g, x, y: g.call_method("mul_", (x, 2)),
    lambda g, x, y: g.call_function(operator.setitem, (x, 0, 1.0)),
    lambda g, x, y: g.call_function(operator.iadd, (x, y)),
    lambda g, x, y: g.call_function(torch._foreach_add_, ([y, x], 1.0)),
    lambda g, x, y: g.call_function(F.relu, (x,), {"inplace": True}),
    lambda g, x, y: g.call_function(F.relu, (x, True)),
    lambda g, x, y: g.call_function(torch.ops.aten.add_.Tensor, (x, y)),
    lambda g, x, y: g.call_function(torch.ops.aten.copy_, (x, y)),
    lambda g, x, y: g.call_function(torch.mul, (y, 2.0), {"out": x}),
], ids=["method", "setitem", "iadd", "foreach", "inplace_kw", "inplace_pos", "aten_overload", "aten_packet", "out"])
def test_writes_into(make):
    g, x, y = _graph()
    w = make(g, x, y)
    assert writes_into(w, x)
    assert not writes_into(g.call_function(torch.add, (x, y)), x)
    assert not writes_into(g.call_method("add_", (y, x)), x)  # x is read, y written


def test_written_in_place_follows_every_view_from_the_base():
    g, x, y = _graph()
    read = g.call_method("transpose", (x, 0, 1))  # what a rewrite would read
    deep = _views(g, x, 20)
    g.call_method("add_", (deep, 1))
    assert written_in_place(read)  # the write is 20 views below x, read is a sibling view


def test_written_in_place_after_an_in_place_result():
    g, x, y = _graph()
    r = g.call_function(torch.ops.aten.mul_.Tensor, (x, y))  # r is x
    g.call_method("zero_", (g.call_method("view", (x, -1)),))
    assert written_in_place(r)


def test_written_in_place_is_conservative_past_its_budget():
    g, x, y = _graph()
    read = _views(g, x, 12)
    g.call_function(torch.add, (read, y))
    assert not written_in_place(read)
    assert written_in_place(read, limit=4)  # too many views to walk: taken as written


def test_a_copy_is_not_a_view():
    g, x, y = _graph()
    c = g.call_method("clone", (x,))
    g.call_method("add_", (x, 1))
    assert not written_in_place(c)
    assert written_in_place(g.call_method("view", (x, -1)))


def test_written_args_name_what_is_written():
    g, x, y = _graph()
    z = g.placeholder("z")
    assert set(written_args(g.call_function(torch.ops.aten.add.out, (x, y), {"out": z}))) == {z}
    assert written_args(g.call_function(torch._foreach_mul_, ([x, y], 2.0))) == [x, y]
    assert written_args(g.call_function(F.dropout, (x, 0.0, True, True))) == [x]
    assert written_args(g.call_function(torch.add, (x, y))) == []
    assert writes(g.call_method("zero_", (x,))) and not writes(g.call_method("view", (x, -1)))


def test_a_write_through_out_reaches_the_buffer_views():
    g, x, y = _graph()
    r = g.call_function(torch.matmul, (y, y), {"out": x})  # r is x
    read = g.call_method("view", (x, -1))
    assert written_in_place(read)
    assert written_in_place(g.call_method("transpose", (r, 0, 1)))


@pytest.mark.parametrize("write_between", [False, True])
def test_same_value_of_one_op_read_twice_unless_its_input_is_written_between(write_between):
    # `~m` twice holds one value, unless `m.fill_(1)` stands between the two reads
    g, m, _ = _graph()
    a = g.call_function(operator.invert, (m,))
    if write_between:
        g.call_method("fill_", (m, 1))
    b = g.call_function(operator.invert, (m,))
    after = g.call_function(operator.invert, (m,))
    g.output((a, b, after))
    assert same_value(a, b) is (not write_between)
    assert same_value(b, a) is (not write_between)
    assert same_value(b, after)  # nothing between those two
