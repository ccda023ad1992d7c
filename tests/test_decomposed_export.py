"""Programs in the core ATen IR (`torch.export(...).run_decompositions()`) and the "safe" softmax.

A decomposed program spells a 4-d matmul as `bmm` of operands expanded to their own shape and viewed to 3-d
(patterns/identity_views.py), the softmax as `aten._softmax(x, -1, False)` (patterns/aten_spellings.py), a
masked_fill as `where(m, scalar_tensor(c), x)`, and SDPA's math path zeroes the rows whose scores are all -inf
(patterns/find_sites/empty_row_test.py). Every site is compared with eager, outputs and gradients."""
from __future__ import annotations

import math
import warnings

import expecttest
import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F

from conftest import Compiled
from eager_diff import check, rand
from test_patterns_softmax import pinned

from fa_compile.patterns.aten_spellings import spell_aten_ops
from fa_compile.patterns.identity_views import drop_identity_views

aten = torch.ops.aten
B, H, N, D = 2, 2, 8, 4
NEG = float("-inf")


def qkv(grad: bool = True):
    return [rand(B, H, N, D, seed=s).requires_grad_(grad) for s in range(3)]


def decomposed(module: torch.nn.Module, *args) -> torch.nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ep = torch.export.export(module, tuple(a.detach() for a in args))
        return ep.run_decompositions().module()


def row_mask() -> torch.Tensor:
    """[B, 1, N, N] keep-mask with two rows that keep no key."""
    m = rand(B, 1, N, N, seed=7) > -0.3
    m[0, 0, 3] = False
    m[1, 0, 5] = False
    return m


class Masked(torch.nn.Module):
    def forward(self, q, k, v, keep):
        s = q @ k.transpose(-1, -2) / math.sqrt(D)
        return torch.softmax(s.masked_fill(~keep, NEG), -1) @ v


class Sdpa(torch.nn.Module):
    def __init__(self, causal: bool = False):
        super().__init__()
        self.causal = causal

    def forward(self, q, k, v, *mask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[0] if mask else None, is_causal=self.causal)


@pytest.mark.parametrize("inner", ["aot_eager", "inductor"])
def test_decomposed_hand_written_attention_is_rewritten(inner):
    q, k, v = qkv()
    keep = rand(B, 1, 1, N, seed=5) > -0.5
    keep[..., 0] = True
    m = decomposed(Masked(), q, k, v, keep)
    res = check(m, [q, k, v, keep], inner=inner)
    assert [r.rewritten for r in res.reports] == [True], res.reasons


class Einsum(torch.nn.Module):
    def __init__(self, heads_second: bool):
        super().__init__()
        self.heads_second = heads_second

    def forward(self, q, k, v):
        if self.heads_second:  # [B, H, N, D]
            s = torch.einsum("bhid,bhjd->bhij", q, k) * 0.5
            return torch.einsum("bhij,bhjd->bhid", s.softmax(-1), v)
        s = torch.einsum("bqhd,bkhd->bhqk", q, k) * 0.5  # [B, N, H, D]: the heads moved through a size-1 axis
        return torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), v)


@pytest.mark.parametrize("heads_second", [True, False], ids=["bhnd", "bnhd"])
def test_decomposed_einsum_attention_is_rewritten(heads_second):
    shape = (B, H, N, D) if heads_second else (B, N, H, D)
    args = [rand(*shape, seed=s, requires_grad=True) for s in range(3)]
    res = check(decomposed(Einsum(heads_second), *args), args)
    assert [r.rewritten for r in res.reports] == [True], res.reasons


def test_decomposed_upcast_softmax_is_rewritten():
    # `softmax(s, -1, dtype=float32).to(q.dtype)` in fp16: the core IR's casts are aten._to_copy
    class Upcast(torch.nn.Module):
        def forward(self, q, k, v):
            s = q @ k.transpose(-1, -2) * 0.5
            return F.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype) @ v

    args = [rand(B, H, N, D, seed=s, dtype=torch.float16) for s in range(3)]
    res = check(decomposed(Upcast(), *args), args, dtype=torch.float16, grad=False)
    assert [r.rewritten for r in res.reports] == [True], res.reasons


def test_decomposed_program_traced_at_symbolic_sizes():
    # the expands of the decomposed products name symbolic sizes
    q, k, v = qkv()
    n = torch.export.Dim("n", min=2, max=64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ep = torch.export.export(Masked(), (q.detach(), k.detach(), v.detach(), torch.ones(B, 1, 1, N, dtype=torch.bool)),
                                 dynamic_shapes=({2: n}, {2: n}, {2: n}, {3: n}))
        m = ep.run_decompositions().module()
    c = Compiled(m, inner="aot_eager", dynamic=True, fullgraph=False)
    for n in (N, N + 3):
        args = [rand(B, H, n, D, seed=s) for s in range(3)] + [torch.ones(B, 1, 1, n, dtype=torch.bool)]
        torch.testing.assert_close(c(*args), Masked()(*args), atol=1e-5, rtol=1e-5)
    assert c.reports and all(r.rewritten for r in c.reports), [r.reason for r in c.reports]


@pytest.mark.parametrize("inner", ["aot_eager", "inductor"])
def test_decomposed_causal_sdpa_is_rewritten_in_training(inner):
    q, k, v = qkv()
    m = decomposed(Sdpa(causal=True), q, k, v)
    res = check(m, [q, k, v], inner=inner)
    assert [r.rewritten for r in res.reports] == [True], res.reasons
    assert res.reports[0].mask == "causal"


def test_decomposed_sdpa_with_empty_rows_at_inference():
    # rows that keep no key: SDPA's math path gives 0 there, and so does the op
    q, k, v = qkv(grad=False)
    keep = row_mask()
    m = decomposed(Sdpa(), q, k, v, keep)
    res = check(m, [q, k, v, keep], grad=False)
    assert [r.rewritten for r in res.reports] == [True], res.reasons
    assert torch.all(res.out[0, :, 3] == 0) and torch.all(res.out[1, :, 5] == 0)


def test_decomposed_sdpa_with_empty_rows_and_a_gradient_is_left_alone():
    # the decomposition adds its mask: eager's gradient through a zeroed row is NaN for q and every key of the head
    q, k, v = qkv()
    keep = row_mask()
    m = decomposed(Sdpa(), q, k, v, keep)
    res = check(m, [q, k, v, keep])
    assert [r.rewritten for r in res.reports] == [False]
    assert "additive mask and a gradient" in res.reasons[0]


def _test(kind: str, s: torch.Tensor) -> torch.Tensor:
    if kind == "aten":  # as the core ATen IR writes it
        return torch.logical_not(torch.any(torch.logical_not(torch.eq(s, NEG)), -1, True))
    if kind == "any_ne":
        return ~(s != NEG).any(-1, keepdim=True)
    if kind == "all_eq":
        return (s == NEG).all(dim=-1, keepdim=True)
    return torch.isneginf(s).all(-1, keepdim=True)


@pytest.mark.parametrize("test", ["aten", "any_ne", "all_eq", "isneginf"])
@pytest.mark.parametrize("zero", ["where", "where_zeros_like", "masked_fill"])
def test_safe_softmax_spellings_are_rewritten(test, zero):
    def f(q, k, v, keep):
        s = (q @ k.transpose(-1, -2) * 0.5).masked_fill(~keep, NEG)
        p = torch.softmax(s, -1)
        t = _test(test, s)
        if zero == "where":
            p = torch.where(t, 0.0, p)
        elif zero == "where_zeros_like":
            p = torch.where(t, torch.zeros_like(p), p)
        else:
            p = p.masked_fill(t, 0)
        return p @ v

    q, k, v = qkv()
    res = check(f, [q, k, v, row_mask()])
    assert [r.rewritten for r in res.reports] == [True], res.reasons
    assert torch.all(res.out[0, :, 3] == 0)


def test_safe_softmax_under_causal_and_padding_masks():
    def f(q, k, v, keep):
        s = q @ k.transpose(-1, -2) * 0.5
        s = s.masked_fill(torch.ones(N, N, dtype=torch.bool).triu(1), NEG).masked_fill(~keep, NEG)
        p = torch.softmax(s, -1)
        return torch.where(_test("aten", s), torch.full_like(p, 0), p) @ v

    keep = torch.ones(B, 1, 1, N, dtype=torch.bool)
    keep[1, ..., :3] = False  # the first three queries of sequence 1 keep no key
    res = check(f, qkv() + [keep])
    assert [r.rewritten for r in res.reports] == [True], res.reasons


@pytest.mark.parametrize("case, reason", [
    ("any_eq", "also used outside the attention"),            # a row with one -inf score is not empty
    ("not_last_dim", "also used outside the attention"),
    ("test_returned", "also used outside the attention"),
    ("additive_grad", "additive mask and a gradient"),
])
def test_tests_that_are_not_the_empty_row_test_are_left_alone(case, reason):
    def f(q, k, v, keep):
        s = q @ k.transpose(-1, -2) * 0.5
        if case == "additive_grad":
            s = s + torch.zeros(keep.shape).masked_fill(~keep, NEG)
        else:
            s = s.masked_fill(~keep, NEG)
        p = torch.softmax(s, -1)
        if case == "any_eq":
            t = (s == NEG).any(-1, keepdim=True)
        elif case == "not_last_dim":
            t = (s == NEG).all(-2, keepdim=True)
        else:
            t = (s == NEG).all(-1, keepdim=True)
        out = p.masked_fill(t, 0) @ v
        return (out, t) if case == "test_returned" else out

    res = check(f, qkv() + [row_mask()])
    assert [r.rewritten for r in res.reports] == [False]
    assert reason in res.reasons[0], res.reasons


@pytest.mark.parametrize("nan_in", ["none", "q"])
def test_nan_to_num_of_the_probabilities_is_left_alone(nan_in):
    # it zeroes the rows with no admissible key, and also the rows a NaN in q makes NaN, which the op keeps NaN
    def f(q, k, v, keep):
        p = torch.softmax((q @ k.transpose(-1, -2) * 0.5).masked_fill(~keep, NEG), -1)
        return p.nan_to_num() @ v

    q, k, v = qkv()
    if nan_in == "q":
        q = q.detach().clone()
        q[0, 1, 2, 0] = float("nan")
        q.requires_grad_(True)
    res = check(f, [q, k, v, row_mask()])
    assert [r.rewritten for r in res.reports] == [False]
    assert not torch.isnan(res.out).any()


def test_zeroing_after_finite_fills_changes_nothing():
    # no score is -inf and no row of the softmax NaN: eager's rows that keep no key stay uniform, and so do the op's
    def f(q, k, v, keep):
        s = (q @ k.transpose(-1, -2) * 0.5).masked_fill(~keep, -1e9)
        p = torch.softmax(s, -1)
        return p.masked_fill((s == NEG).all(-1, keepdim=True), 0) @ v

    res = check(f, qkv() + [row_mask()])
    assert [r.rewritten for r in res.reports] == [True], res.reasons


def test_a_zero_made_from_a_literal_and_written_is_not_zero():
    # `z = torch.tensor(0.0); z.fill_(0.5)`: eager's empty rows hold 0.5, not the op's 0
    def f(q, k, v, keep):
        s = (q @ k.transpose(-1, -2) * 0.5).masked_fill(~keep, NEG)
        z = torch.tensor(0.0)
        z.fill_(0.5)
        return torch.where(_test("all_eq", s), z, torch.softmax(s, -1)) @ v

    res = check(f, qkv() + [row_mask()])
    assert [r.rewritten for r in res.reports] == [False]


def test_an_identity_expand_of_a_tensor_transposed_in_place_is_kept():
    # `x.transpose_()` after the expand changes x's strides, not the expand's: eager's P·V reads the old layout
    def f(q, k, v):
        x = v * 2
        y = x.expand(B, H, N, N)
        x.transpose_(-1, -2)
        return torch.softmax(q @ k.transpose(-1, -2) * 0.5, -1) @ y, x

    # square values: Dynamo's own trace of a transpose_ after a view needs the two sizes equal
    res = check(f, [rand(B, H, N, N, seed=s) for s in range(3)], grad=False)
    assert [r.rewritten for r in res.reports] == [True], res.reasons


def test_a_returned_identity_expand_is_kept():
    # the caller receives another tensor object than v (a metadata change of it must not reach v)
    def f(q, k, v):
        y = v.expand(B, H, N, D)
        return torch.softmax(q @ k.transpose(-1, -2) * 0.5, -1) @ y, y

    c = Compiled(f)
    c(*qkv())
    assert [r.rewritten for r in c.reports] == [True]
    assert any(n.op == "call_method" and n.target == "expand" for n in c.graphs[0].graph.nodes)


def test_identity_views_are_dropped_and_broadcasts_kept():
    g = fx.Graph()
    x = g.placeholder("x")
    x.meta["example_value"] = torch.empty(2, 1, 3)
    same = g.call_method("expand", (x, 2, 1, 3))
    minus = g.call_method("expand", (x, [-1, -1, 3]))
    wide = g.call_method("expand", (x, 2, 4, 3))
    for n in (same, minus, wide):  # the layouts the calls give
        n.meta["example_value"] = x.meta["example_value"].expand(*n.args[1:])
    g.output((g.call_function(torch.add, (same, minus)), g.call_function(torch.neg, (wide,))))
    gm = fx.GraphModule(torch.nn.Module(), g)
    assert drop_identity_views(gm)
    assert [n.args for n in gm.graph.nodes if n.op == "call_method"] == [(x, 2, 4, 3)]
    a = torch.randn(2, 1, 3)
    got = gm(a)
    torch.testing.assert_close(got[0], 2 * a)
    assert got[1].shape == (2, 4, 3)


def test_internal_softmax_is_read_only_without_half_to_float():
    g = fx.Graph()
    x = g.placeholder("x")
    x.meta["example_value"] = torch.empty(2, 3)
    plain = g.call_function(aten._softmax.default, (x, -1, False))
    wide = g.call_function(aten._softmax.default, (x, -1, True))
    g.output((plain, wide))
    gm = fx.GraphModule(torch.nn.Module(), g)
    assert spell_aten_ops(gm)
    assert plain.target is torch.softmax and plain.args == (x, -1)
    assert wide.target is aten._softmax.default


def test_a_graph_left_as_written_gets_its_overloads_back():
    # the probabilities are returned: no site is rewritten and the pass puts the graph back, aten._softmax with its
    # three arguments included (the canonical edit changed both the call and its arguments)
    class ReturnsWeights(torch.nn.Module):
        def forward(self, q, k, v):
            p = torch.softmax(q @ k.transpose(-1, -2), -1)
            return p @ v, p

    q, k, v = qkv()
    res = check(decomposed(ReturnsWeights(), q, k, v), [q, k, v])
    assert [r.rewritten for r in res.reports] == [False]


@pytest.mark.parametrize("name", ["bert", "llama"])
def test_decomposed_hugging_face_sdpa_models_at_inference(name):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    small = dict(vocab_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
                 attn_implementation="sdpa")
    if name == "bert":
        model = transformers.BertModel(transformers.BertConfig(hidden_size=16, **small))
    else:
        model = transformers.LlamaModel(transformers.LlamaConfig(hidden_size=16, num_key_value_heads=1, **small))
    model.eval()
    ids = torch.randint(0, 64, (2, 8))
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, 5:] = 0

    class Hidden(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, ids, mask):
            return self.model(input_ids=ids, attention_mask=mask).last_hidden_state

    m = decomposed(Hidden(), ids, mask)
    with torch.no_grad():
        want = m(ids, mask)
        c = Compiled(m, inner="aot_eager", fullgraph=False)
        got = c(ids, mask)
    assert [r.rewritten for r in c.reports] == [True, True], [r.reason for r in c.reports]
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


class TestPinnedDecomposed(expecttest.TestCase):
    def test_pinned_decomposed_causal_sdpa(self):
        q, k, v = qkv()
        self.assertExpectedInline(pinned(decomposed(Sdpa(causal=True), q, k, v), q, k, v), """\
mul(l_q_, 0.7071067811865476)
permute(l_k_, [0, 1, 3, 2])
mul(permute, 0.7071067811865476)
view(mul_1, [4, 4, 8])
permute(view_1, (0, 2, 1))
reshape(permute_3, 2, 2, 8, 4)
fa3.attention(mul, reshape, l_v_, 1.0, True, 0, -1, -1, None, None, 0.0, 0.0, None, None)
getitem(attention_default, 0)
reshape(getitem, 4, 8, 4)
view(reshape_1, [2, 2, 8, 4])
permute(view_5, [2, 0, 1, 3])
clone(permute_1)
permute(clone, [1, 2, 0, 3])""")
