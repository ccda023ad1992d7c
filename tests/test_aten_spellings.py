"""ATen overloads called by name, as a `torch.export`-ed program's module (`ep.module()`) or code calling
`torch.ops.aten` holds them: read as the torch functions they are (patterns/aten_spellings.py), so the attention
they spell is found and rewritten, outputs and gradients as eager's."""
from __future__ import annotations

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

aten = torch.ops.aten
B, H, N, D = 2, 2, 8, 4


def qkv(grad: bool = True):
    return [rand(B, H, N, D, seed=s).requires_grad_(grad) for s in range(3)]


class HandWritten(torch.nn.Module):
    def forward(self, q, k, v):
        s = q @ k.transpose(-2, -1) * 0.5
        causal = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).tril()
        s = s.masked_fill(~causal, float("-inf"))
        return torch.softmax(s.float(), dim=-1).to(q.dtype) @ v


class Sdpa(torch.nn.Module):
    def forward(self, q, k, v, keep):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None, None, :])


def exported(module: torch.nn.Module, *args) -> torch.nn.Module:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.export.export(module, tuple(a.detach() for a in args)).module()


def aten_calls(fn, *args) -> set:
    """The aten overloads in the graph Dynamo traces from fn (before the pass)."""
    seen = set()

    def backend(gm, example_inputs):
        seen.update(str(n.target) for n in gm.graph.nodes
                    if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=backend)(*args)
    return seen


@pytest.mark.parametrize("inner", ["aot_eager", "inductor"])
def test_exported_hand_written_attention_is_rewritten(inner):
    q, k, v = qkv()
    m = exported(HandWritten(), q, k, v)
    assert {"aten.matmul.default", "aten.softmax.int", "aten.masked_fill.Scalar"} <= aten_calls(m, q, k, v)
    res = check(m, [q, k, v], inner=inner)
    assert [r.rewritten for r in res.reports] == [True], [r.reason for r in res.reports]
    assert res.reports[0].mask == "causal"


@pytest.mark.parametrize("inner", ["aot_eager", "inductor"])
def test_exported_sdpa_with_a_key_padding_mask_is_rewritten(inner):
    q, k, v = qkv()
    keep = torch.ones(B, N, dtype=torch.bool)
    keep[1, 5:] = False
    m = exported(Sdpa(), q, k, v, keep)
    assert "aten.scaled_dot_product_attention.default" in aten_calls(m, q, k, v, keep)
    res = check(m, [q, k, v, keep], inner=inner)
    assert [r.rewritten for r in res.reports] == [True], [r.reason for r in res.reports]


class ManualSoftmax(torch.nn.Module):  # aten.amax.default, aten.exp.default, aten.sum.dim_IntList
    def forward(self, q, k, v):
        s = q @ k.transpose(-1, -2) * 0.5
        e = torch.exp(s - s.amax(-1, keepdim=True))
        return (e / e.sum(-1, keepdim=True)) @ v


class RowMaxByMax(torch.nn.Module):  # aten.max.dim, read by getitem
    def forward(self, q, k, v):
        s = q @ k.transpose(-1, -2) * 0.5
        e = torch.exp(s - s.max(-1, keepdim=True)[0])
        return (e / e.sum(-1, keepdim=True)) @ v


class TypeAs(torch.nn.Module):  # aten.type_as.default
    def forward(self, q, k, v):
        return F.softmax((q @ k.transpose(-1, -2) * 0.5).float(), dim=-1).type_as(q) @ v


class Einsum(torch.nn.Module):  # aten.einsum.default(equation, [a, b])
    def forward(self, q, k, v):
        s = torch.einsum("bhqd,bhkd->bhqk", q, k) * 0.5
        return torch.einsum("bhqk,bhkd->bhqd", s.softmax(-1), v)


class InPlace(torch.nn.Module):  # aten.div_.Tensor, aten.masked_fill_.Scalar, aten.add_.Tensor kept by the export
    def forward(self, q, k, v, bias):
        s = q @ k.transpose(-1, -2)
        s /= torch.full((), D ** 0.5)
        s.masked_fill_(torch.ones(N, N, dtype=torch.bool).triu(1), float("-inf"))
        s += bias
        return torch.softmax(s, -1) @ v


class ConstantsMadeAfterTheScores(torch.nn.Module):  # torch.export: lift_fresh_copy + detach_ of each constant
    def forward(self, q, k, v):
        s = (q @ k.transpose(-1, -2)) / torch.tensor(2.0)
        s = s.masked_fill(torch.ones(N, N, dtype=torch.bool).triu(1), torch.tensor(float("-inf")))
        return torch.softmax(s, -1) @ v


@pytest.mark.parametrize("module", [ManualSoftmax, RowMaxByMax, TypeAs, Einsum, InPlace, ConstantsMadeAfterTheScores],
                         ids=lambda m: m.__name__)
def test_exported_spellings_of_the_softmax_products_and_updates(module):
    args = qkv(grad=False) + ([rand(H, N, N, seed=7)] if module is InPlace else [])
    m = exported(module(), *args)
    res = check(m, args, grad=False)
    assert [r.rewritten for r in res.reports] == [True], [r.reason for r in res.reports]


def test_exported_xlm_reads_the_scores_shape_through_expand_as():
    # XLM (and Flaubert): mask.expand_as(scores), scores.masked_fill_(mask, min), softmax(scores.float()).type_as(scores)
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.XLMConfig(emb_dim=16, n_heads=2, n_layers=1, vocab_size=64, max_position_embeddings=32,
                                 dropout=0.0, attention_dropout=0.0, pad_index=0)
    model = transformers.XLMModel(cfg).eval()
    ids = torch.randint(3, 64, (2, 8))
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[0, 5:] = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m = torch.export.export(model, (), dict(input_ids=ids, attention_mask=mask)).module()
    want = m(input_ids=ids, attention_mask=mask)[0]
    c = Compiled(m, inner="aot_eager", fullgraph=False)
    got = c(input_ids=ids, attention_mask=mask)[0]
    assert [r.rewritten for r in c.reports] == [True], [r.reason for r in c.reports]
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_aten_overloads_called_in_user_code():
    def f(q, k, v):
        s = aten.mul.Tensor(aten.matmul.default(q, aten.transpose.int(k, -2, -1)), 0.5)
        return aten.matmul.default(aten.softmax.int(s, -1), v)

    res = check(f, qkv())
    assert [r.rewritten for r in res.reports] == [True]


def test_internal_softmax_without_half_to_float_is_read_as_softmax():
    # aten._softmax(x, dim, False) is what torch.softmax(x, dim) calls (the core ATen IR keeps it); with True
    # (a half input, fp32 out) it is left alone (test_decomposed_export.py)
    def f(q, k, v):
        return aten._softmax.default(q @ k.transpose(-2, -1), -1, False) @ v

    res = check(f, qkv())
    assert [r.rewritten for r in res.reports] == [True], res.reasons


def test_metadata_checks_that_hold_are_dropped_and_others_kept():
    # torch.export puts aten._assert_tensor_metadata before each .to(): one that holds on the example value (whose
    # dtype, device and layout Dynamo's guards fix) is dropped; one that would fail stays, and with it the graph's
    # failure at run time
    def make(dtype):
        g = fx.Graph()
        x = g.placeholder("x")
        x.meta["example_value"] = torch.empty(2, 3)
        g.call_function(aten._assert_tensor_metadata.default, (x,), {"dtype": dtype, "device": torch.device("cpu")})
        g.output(x)
        return fx.GraphModule(torch.nn.Module(), g)

    holds, fails = make(torch.float32), make(torch.float16)
    assert spell_aten_ops(holds) and spell_aten_ops(fails) is False
    assert "_assert_tensor_metadata" not in holds.code and "_assert_tensor_metadata" in fails.code


def test_detach_in_place_is_dropped_only_where_nothing_needs_a_gradient():
    g = fx.Graph()
    x, w = g.placeholder("x"), g.placeholder("w")
    x.meta["example_value"] = torch.empty(2, 3)
    w.meta["example_value"] = torch.empty(2, 3, requires_grad=True)
    idle = g.call_function(aten.detach_.default, (x,))
    kept = g.call_function(aten.detach_.default, (w,))
    g.output((g.call_function(torch.add, (idle, 1.0)), kept))
    gm = fx.GraphModule(torch.nn.Module(), g)
    assert spell_aten_ops(gm)
    assert [n.args for n in gm.graph.nodes if n.target is aten.detach_.default] == [(w,)]


def test_overloads_whose_function_reads_positions_otherwise_are_left_alone():
    # aten.sub.Scalar(x, c, alpha) takes alpha by position; torch.sub(x, c, alpha) is a deprecated signature of
    # another meaning, and Tensor.to takes memory_format by keyword only: those nodes keep their overload
    g = fx.Graph()
    x = g.placeholder("x")
    x.meta["example_value"] = torch.empty(2, 3)
    two = g.call_function(aten.sub.Scalar, (x, 1.0))
    three = g.call_function(aten.sub.Scalar, (x, 1.0, 3))
    cast = g.call_function(aten.to.dtype, (x, torch.float16, False, False, torch.preserve_format))
    g.output((two, three, cast))
    gm = fx.GraphModule(torch.nn.Module(), g)
    assert spell_aten_ops(gm)
    assert two.target is torch.sub and three.target is aten.sub.Scalar and cast.target is aten.to.dtype
    a = torch.randn(2, 3)
    got = gm(a)
    torch.testing.assert_close(got[0], a - 1.0)
    torch.testing.assert_close(got[1], a - 3.0)  # x - alpha * c
    assert got[2].dtype == torch.float16


@pytest.mark.parametrize("name", ["bert", "llama", "gpt2"])
def test_exported_hugging_face_models(name):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    small = dict(vocab_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
                 attn_implementation="eager")
    if name == "bert":
        model = transformers.BertModel(transformers.BertConfig(hidden_size=16, **small))
        want_mask = "bool-mask"
    elif name == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(hidden_size=16, num_key_value_heads=1, **small))
        want_mask = "causal+bool-mask"
    else:
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=16, n_layer=2, n_head=2, vocab_size=64,
                                                                     attn_implementation="eager"))
        want_mask = "causal+bool-mask"
    model.eval()
    ids = torch.randint(0, 64, (2, 8))
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, 5:] = 0
    kw = dict(input_ids=ids, attention_mask=mask)
    if name != "bert":
        kw["use_cache"] = False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        m = torch.export.export(model, (), kw).module()
    want = m(**kw)
    c = Compiled(m, inner="aot_eager", fullgraph=False)
    got = c(**kw)
    assert [r.rewritten for r in c.reports] == [True, True], [r.reason for r in c.reports]
    assert {r.mask for r in c.reports} == {want_mask}
    w = want[0] if isinstance(want, (tuple, list)) else want.logits if hasattr(want, "logits") else want
    g = got[0] if isinstance(got, (tuple, list)) else got.logits if hasattr(got, "logits") else got
    torch.testing.assert_close(g, w, atol=2e-5, rtol=2e-5)


class TestPinnedExported(expecttest.TestCase):
    def test_pinned_exported_causal(self):
        q, k, v = qkv()
        self.assertExpectedInline(pinned(exported(HandWritten(), q, k, v), q, k, v), """\
fa3.attention(l_q_, l_k_, l_v_, 0.5, True, 0, -1, -1, None, None, 0.0, 0.0, None, None)
getitem(attention_default, 0)
clone(getitem)""")
