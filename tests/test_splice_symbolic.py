"""Replacements traced under symbolic sizes (fa_compile/lowering/splice.py, conventions.py): what make_fx writes
for size expressions must be a graph Inductor can run again, and strides read from another node's value must
be traceable."""
from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext, statically_known_true

from fa_compile.lowering import conventions, splice


def test_nary_size_products_become_binary_calls():
    # make_fx writes 4*Max(1, s0)*Max(1, s1) as operator.mul(4, a, b); Inductor's fake-tensor update calls it
    g = fx.Graph()
    a, b = g.placeholder("a"), g.placeholder("b")
    g.output(g.call_function(operator.add, (g.call_function(operator.mul, (4, a, b)), a, 1)))
    splice._binary_sym_ops(g)
    assert all(len(n.args) == 2 for n in g.nodes if n.op == "call_function")
    assert fx.GraphModule({}, g)(3, 5) == 4 * 3 * 5 + 3 + 1


def test_strides_of_another_value_traced_under_symbolic_sizes():
    # Batch and heads share a symbol, as do the query length and head dim (Dynamo's duck sizing): the BSHD
    # strides of another node's value are products (s0 * s1 ** 2) that no traced input has as a size.
    mode = FakeTensorMode(shape_env=ShapeEnv())
    ctx = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.DUCK] * 4)
    t = mode.from_tensor(torch.randn(2, 2, 16, 16), symbolic_context=ctx)
    with mode:
        like = torch.empty(t.shape[0], t.shape[2], t.shape[1], t.shape[3]).permute(0, 2, 1, 3)
        stride = like.stride()
        assert any(isinstance(s, torch.SymInt) for s in stride)
        sub = make_fx(lambda x: conventions.with_strides(x * 2, stride), tracing_mode="real")(t)
    got = next(n for n in sub.graph.nodes if n.op == "output").args[0].meta["val"]
    assert all(statically_known_true(a == b) for a, b in zip(got.stride(), stride)), (got.stride(), stride)
    assert tuple(got.shape) == tuple(t.shape)
    real = torch.randn(2, 2, 16, 16)
    out = sub(real)
    assert out.stride() == (512, 16, 32, 1) and torch.equal(out, real * 2)
