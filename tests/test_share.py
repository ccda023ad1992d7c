"""lowering/share.py: a value every layer recomputes the same way (kv_lens from positions, a key limit of
one mask) is computed once; values that differ, seeded random values and graph outputs keep their own
nodes; results are unchanged."""
from __future__ import annotations

import expecttest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from fa_compile import ops  # noqa: F401  (registers torch.ops.fa3)
from fa_compile.lowering import share

B, H, N, NK, D = 2, 2, 1, 24, 8
ATT = torch.ops.fa3.attention.default


def _inputs():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, N, D, generator=g)
    k = torch.randn(B, H, NK, D, generator=g)
    v = torch.randn(B, H, NK, D, generator=g)
    pos = torch.tensor([5, 17])
    return q, k, v, pos


def _lens_args(g: torch.fx.GraphModule) -> list:
    return [n.args[9] for n in g.graph.nodes if n.target is ATT]


def test_equal_kv_lens_of_layers_are_computed_once():
    def step(q, k, v, pos):
        o1, _ = ATT(q, k, v, 0.3, kv_lens=(pos + 1).to(torch.int32))
        o2, _ = ATT(o1, k, v, 0.3, kv_lens=(pos + 1).to(torch.int32))  # the same value, its own ops
        o3, _ = ATT(o2, k, v, 0.3, kv_lens=(pos + 2).to(torch.int32))  # another value
        o4, _ = ATT(o3, k, v, 0.3, kv_lens=(pos[:] + 1).to(torch.int32))  # the same through a full slice
        return o4

    args = _inputs()
    g = make_fx(step)(*args)
    want = g(*args)
    lens = _lens_args(g)
    assert len(set(lens)) == 4
    assert share.share(g.graph) == 2
    g.graph.lint()
    g.recompile()
    lens = _lens_args(g)
    assert lens[0] is lens[1] is lens[3] and lens[2] is not lens[0]
    assert torch.equal(g(*args), want)
    assert torch.equal(g(*args), step(*args))


def test_pinned_graph_two_layers_one_kv_lens():
    # the second layer reads the first layer's kv_lens; its own copy is left dead for Inductor to drop
    def step(q, k, v, pos):
        o1, _ = ATT(q, k, v, 0.3, kv_lens=(pos + 1).to(torch.int32))
        o2, _ = ATT(o1, k, v, 0.3, kv_lens=(pos + 1).to(torch.int32))
        return o2

    g = make_fx(step)(*_inputs())
    assert share.share(g.graph) == 1
    g.recompile()
    expecttest.assert_expected_inline(g.code.strip(), """\
def forward(self, q_1, k_1, v_1, pos_1):
    add = torch.ops.aten.add.Tensor(pos_1, 1)
    _to_copy = torch.ops.aten._to_copy.default(add, dtype = torch.int32);  add = None
    attention = torch.ops.fa3.attention.default(q_1, k_1, v_1, 0.3, False, 0, -1, -1, None, _to_copy);  q_1 = None
    getitem = attention[0]
    getitem_1 = attention[1];  attention = getitem_1 = None
    add_1 = torch.ops.aten.add.Tensor(pos_1, 1);  pos_1 = add_1 = None
    attention_1 = torch.ops.fa3.attention.default(getitem, k_1, v_1, 0.3, False, 0, -1, -1, None, _to_copy);  getitem = k_1 = v_1 = _to_copy = None
    getitem_2 = attention_1[0]
    getitem_3 = attention_1[1];  attention_1 = getitem_3 = None
    return getitem_2""")


def test_random_values_and_graph_outputs_are_not_merged():
    def step(q, k, v, pos):
        r1 = torch.randint(1, NK, (B,), dtype=torch.int32)
        r2 = torch.randint(1, NK, (B,), dtype=torch.int32)
        o1, _ = ATT(q, k, v, 0.3, kv_lens=r1)
        o2, _ = ATT(o1, k, v, 0.3, kv_lens=r2)  # two draws: equal ops, not equal values
        l3, l4 = (pos + 1).to(torch.int32), (pos + 1).to(torch.int32)
        o3, _ = ATT(o2, k, v, 0.3, kv_lens=l3)
        o4, _ = ATT(o3, k, v, 0.3, kv_lens=l4)  # equal to l3 but returned: a caller may write either
        return o4, l3, l4

    g = make_fx(step)(*_inputs())
    assert share.share(g.graph) == 0
    lens = _lens_args(g)
    assert len(set(lens)) == 4


def test_a_later_copy_never_replaces_an_earlier_one():
    # the kept node is always the first in the graph: it precedes every use of the ones it replaces
    def step(q, k, v, pos):
        early = (pos + 1).to(torch.int32)
        late_user = early * 2  # uses `early` before any attention
        o1, _ = ATT(q, k, v, 0.3, kv_lens=(pos + 1).to(torch.int32))
        o2, _ = ATT(o1, k, v, 0.3, kv_lens=early)
        return o2, late_user.sum()

    args = _inputs()
    g = make_fx(step)(*args)
    want = g(*args)
    assert share.share(g.graph) == 1
    g.graph.lint()
    g.recompile()
    lens = _lens_args(g)
    assert lens[0] is lens[1]
    got = g(*args)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
