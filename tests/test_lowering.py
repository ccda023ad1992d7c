"""Compile-time lowering of fa3 nodes (fa_compile/lowering/) on CPU: pinned graphs, numerics against
eager (outputs, log-sum-exp and gradients), the sites that keep the op and why, compile-time
failures, and the pass's place in Inductor (cache key, FA_COMPILE=1, settings read at compile time)."""
from __future__ import annotations

import math
import warnings

import expecttest
import pytest
import torch
from torch._dynamo.utils import counters

import fa_compile
from fa_compile.lowering import LoweringPass, capture_graphs, records
from fa_compile.lowering import cpu_flash

from conftest import TOL
from eager_diff import check, rand
from test_backend import run_python


@pytest.fixture(autouse=True)
def _no_compile_caches(monkeypatch):
    """The pass runs (and records its decisions) only on a real compile, never on a cache hit. These tests are
    about aten's CPU flash kernel: the decode-step math, which takes CPU sites of up to 16 queries in inference by
    default (tests/test_lowering_decode_math.py), is off here, as FA_COMPILE_DECODE_MATH=0 turns it off."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    monkeypatch.setenv("FA_COMPILE_DECODE_MATH", "0")
    with inductor_config.patch(fx_graph_cache=False), functorch_config.patch(enable_autograd_cache=False):
        yield


def _inputs(b=2, hq=4, hkv=4, nq=16, nk=16, d=8, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, nq, d, generator=g).to(dtype)
    k = torch.randn(b, hkv, nk, d, generator=g).to(dtype)
    v = torch.randn(b, hkv, nk, d, generator=g).to(dtype)
    return q, k, v


def _bool_padding(b, nk):
    keep = torch.ones(b, 1, 1, nk, dtype=torch.bool)
    keep[0, ..., nk - 5:] = False
    keep[1] = False  # every key of batch 1 masked: empty rows
    return keep


def _float_bias(b, nq, nk):
    bias = torch.randn(b, 1, nq, nk, generator=torch.Generator().manual_seed(7))
    bias[:, :, 3] = float("-inf")  # one empty row per batch
    return bias


# name -> (input shape kwargs, attention kwargs builder)
LOWERED = {
    "plain": ({}, lambda s: {}),
    "causal": ({}, lambda s: dict(causal=True)),
    "causal_fewer_queries": (dict(nq=5), lambda s: dict(causal=True)),  # top-left, as the CPU kernel
    "bool_key_padding": ({}, lambda s: dict(bias=_bool_padding(s["b"], s["nk"]))),
    "float_bias_empty_rows": ({}, lambda s: dict(bias=_float_bias(s["b"], s["nq"], s["nk"]))),
    "kv_lens_with_an_empty_batch": ({}, lambda s: dict(kv_lens=torch.tensor([5, 0]))),
    "causal_kv_lens": ({}, lambda s: dict(causal=True, kv_lens=torch.tensor([3, 16]))),
    "causal_bool_bias": ({}, lambda s: dict(causal=True, bias=_bool_padding(s["b"], s["nk"]))),
    "gqa": (dict(hkv=2), lambda s: dict(causal=True)),
    "fp16": (dict(dtype=torch.float16), lambda s: dict(causal=True)),
}


def _shape(kw):
    s = dict(b=2, hq=4, hkv=4, nq=16, nk=16, d=8, dtype=torch.float32)
    s.update(kw)
    return s


def _run(fn, q, k, v, w):
    """out, lse and the gradients of q, k, v for the loss (out * w).sum()."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out, lse = fn(q, k, v)
    (out.float() * w).sum().backward()
    return out, lse, q.grad, k.grad, v.grad


def _compare(got, want, dtype):
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(a, b, **TOL[dtype], msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("case", list(LOWERED))
def test_lowered_to_cpu_flash_matches_eager(case):
    shape_kw, build = LOWERED[case]
    s = _shape(shape_kw)
    q, k, v = _inputs(**s)
    kw = build(s)

    def fn(q, k, v):
        return fa_compile.attention(q, k, v, return_lse=True, **kw)

    w = torch.randn(s["b"], s["hq"], s["nq"], s["d"])
    torch._dynamo.reset()
    n_before = len(records())
    got = _run(torch.compile(fn, backend="fa3", fullgraph=True), q, k, v, w)
    want = _run(fn, q, k, v, w)
    _compare(got, want, s["dtype"])
    decisions = [r.decision for r in records()[n_before:]]
    # (the lse's own gradient, zero here, may add a second backward call: every call is lowered)
    # a float bias's backward is the reference math as graph ops (aten's CPU flash backward is wrong on rows
    # of finfo.min)
    bwd = (("backward", "reference_math", "graph ops (the reference math backward, fused by Inductor)")
           if case == "float_bias_empty_rows" else
           ("backward", "reference", "aten._scaled_dot_product_flash_attention_for_cpu_backward"))
    assert {(d.direction, d.kernel, d.target) for d in decisions} == {
        ("forward", "reference", "aten._scaled_dot_product_flash_attention_for_cpu"), bwd,
    }, [str(d) for d in decisions]
    assert torch.isneginf(got[1]).any() == torch.isneginf(want[1]).any()


def _transposed_key(q, kt, v):
    """K given as [B, H, D, N] (a cache kept transposed): the site reads it with a head-dim stride of N."""
    return (q @ kt * 0.35).softmax(-1) @ v


def _expanded_value(q, k, v):
    """V built by expanding one channel over D inside the graph: a head-dim stride of 0."""
    return (q @ k.transpose(-1, -2) * 0.35).softmax(-1) @ v[..., :1].expand(-1, -1, -1, v.shape[-1])


@pytest.mark.parametrize("n", [8, 20], ids=["graph_ops", "one_op"])  # either side of GRAPH_OPS_MAX_QUERIES
@pytest.mark.parametrize("fn", [_transposed_key, _expanded_value], ids=lambda f: f.__name__[1:])
def test_inputs_without_a_unit_head_dim_stride_reach_the_cpu_kernel_dense(fn, n):
    """aten's CPU flash kernels read each head-dim row as contiguous: other strides are made dense first."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 2, n, 8, generator=g) for _ in range(3))
    if fn is _transposed_key:
        k = k.transpose(-1, -2).contiguous()
    w = torch.randn(2, 2, n, 8, generator=g)
    got_args, want_args = ([t.clone().requires_grad_() for t in (q, k, v)] for _ in range(2))
    torch._dynamo.reset()
    n_before = len(records())
    got = torch.compile(fn, backend="fa3", fullgraph=True)(*got_args)
    want = fn(*want_args)
    (got * w).sum().backward()
    (want * w).sum().backward()
    assert any(r.decision.kernel == "reference" for r in records()[n_before:])
    torch.testing.assert_close(got, want, **TOL[torch.float32])
    for a, b in zip(got_args, want_args):
        torch.testing.assert_close(a.grad, b.grad, **TOL[torch.float32])


REFUSED = {
    "softcap": (dict(softcap=5.0), "has no softcap"),
    "window": (dict(window=(4, 0)), "has no sliding window"),
    "bottom_right": (dict(causal="bottom_right"), "aligned top-left"),
    "value_head_dim": (dict(dv=4), "V head dim equal"),
    "window_gqa_kv_lens": (dict(window=(3, 1), hkv=2, kv_lens=torch.tensor([8, 5])), "has no sliding window"),
}


@pytest.mark.parametrize("case", list(REFUSED))
@pytest.mark.parametrize("math_on", [True, False], ids=["reference_math", "switched_off"])
def test_sites_the_cpu_kernel_cannot_take_get_the_reference_math(case, math_on, monkeypatch):
    # What aten's CPU flash kernel refuses becomes the reference math as graph ops, forward and backward, with
    # eager's outputs, lse and gradients; with FA_COMPILE_REFERENCE_MATH=0 the op keeps the site.
    if not math_on:
        monkeypatch.setenv("FA_COMPILE_REFERENCE_MATH", "0")
    kw, reason = REFUSED[case]
    kw = dict(kw)
    hkv, dv = kw.pop("hkv", 4), kw.pop("dv", 8)
    q, k, v = _inputs(nq=8, hkv=hkv)
    v = v[..., :dv]

    def fn(q, k, v):
        return fa_compile.attention(q, k, v, return_lse=True, **kw)

    w = torch.randn(2, 4, 8, dv)
    torch._dynamo.reset()
    n_before = len(records())
    with capture_graphs() as graphs:
        got = _run(torch.compile(fn, backend="fa3"), q, k, v, w)
    _compare(got, _run(fn, q, k, v, w), torch.float32)
    decisions = [r.decision for r in records()[n_before:]]
    assert sorted({d.direction for d in decisions}) == ["backward", "forward"], [str(d) for d in decisions]
    if math_on:
        assert all(d.lowered and d.kernel == "reference_math" for d in decisions), [str(d) for d in decisions]
        assert all(reason in d.instead_of for d in decisions), [str(d) for d in decisions]
        assert not any("torch.ops.fa3.attention" in g for g in graphs)
    else:
        assert not any(d.lowered for d in decisions)
        assert all(reason in d.reason and "FA_COMPILE_REFERENCE_MATH=0" not in d.reason for d in decisions)
        assert all("torch.ops.fa3.attention" in g for g in graphs)


def test_forced_reference_keeps_the_op_on_cpu():
    # kernel="reference" asks for the op's own reference: neither aten's kernel nor the graph-op math replaces it.
    q, k, v = _inputs(nq=8)
    torch._dynamo.reset()
    n_before = len(records())
    with capture_graphs() as graphs:
        torch.compile(lambda q, k, v: fa_compile.attention(q, k, v, window=(4, 0), kernel="reference"),
                      backend="fa3")(q, k, v)
    decisions = [r.decision for r in records()[n_before:]]
    assert decisions and not any(d.lowered for d in decisions) and "forced" in decisions[0].reason
    assert all("torch.ops.fa3.attention" in g for g in graphs)


def _causal_attn(q, k, v):
    n = q.shape[2]
    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return torch.softmax(s, dim=-1) @ v


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", ["q_inf", "q_neg_inf", "q_inf_first_row", "k_inf_every_key", "k_nan_one_key"])
def test_non_finite_inputs_give_eagers_nan_rows_through_the_cpu_kernel(case, dtype):
    """aten's CPU flash kernel takes a row's max over finite scores only: a row whose admitted scores are
    all non-finite (an infinite query element, or a key component infinite in every key) came out as an
    empty row (out 0), where eager's softmax gives NaN. Every element is compared with eager, NaN positions
    included, causal (the first row has one key) and not. (The op's reference keeps its own contract
    there: a row whose every score is -inf is an empty row, whatever made it so.)"""
    q, k, v = _inputs(b=1, hq=2, hkv=2, nq=6, nk=6, d=8, dtype=dtype, seed=3)
    if case == "q_inf":
        q[0, 0, 2, 3] = float("inf")
    elif case == "q_neg_inf":
        q[0, 1, 4, 0] = float("-inf")
    elif case == "q_inf_first_row":
        q[0, :, 0, 5] = float("inf")
    elif case == "k_inf_every_key":
        k[0, 0, :, 3] = float("inf")  # rows with q[..., 3] < 0 score -inf on every key
    else:
        k[0, 1, 2, 1] = float("nan")
    for causal in (False, True):
        def fn(q, k, v):
            return fa_compile.attention(q, k, v, causal=causal)

        torch._dynamo.reset()
        n_before = len(records())
        with torch.no_grad():
            got = torch.compile(fn, backend="fa3", fullgraph=True)(q, k, v)
            eager = (_causal_attn if causal else lambda q, k, v: torch.softmax(
                q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), dim=-1) @ v)(q.float(), k.float(), v.float())
        assert [r.decision.target for r in records()[n_before:]] == [
            "aten._scaled_dot_product_flash_attention_for_cpu"], records()[n_before:]
        assert eager.isnan().any(), "the case must produce NaN rows in eager"
        assert torch.equal(got.isnan(), eager.isnan()), (causal, got.isnan().any(-1), eager.isnan().any(-1))
        torch.testing.assert_close(got.float(), eager, **TOL[dtype], equal_nan=True)


@pytest.mark.parametrize("n", [8, 20], ids=["graph_ops", "one_op"])  # either side of GRAPH_OPS_MAX_QUERIES
def test_a_zero_row_beside_a_nan_key_it_excludes_stays_zero(n):
    """A row whose result is exactly 0 with lse exactly 0 (an all-zero first token: q0 = k0 = v0 = 0, causal
    row 0 sees key 0 alone) is not a row without finite scores, even in a head whose keys hold a NaN the
    row excludes. Found by hand-written adversarial programs, not the fuzzer."""
    q, k, v = _inputs(b=1, hq=1, hkv=1, nq=n, nk=n, d=8, dtype=torch.float32, seed=0)
    q[:, :, 0], k[:, :, 0], v[:, :, 0] = 0, 0, 0
    k[0, 0, n // 2, 3] = float("nan")
    torch._dynamo.reset()
    with torch.no_grad():
        got = torch.compile(_causal_attn, backend="fa3", fullgraph=True)(q, k, v)
        want = _causal_attn(q, k, v)
    assert want[0, 0, 0].eq(0).all() and want[0, 0, n // 2:].isnan().all() and not want[0, 0, :n // 2].isnan().any()
    assert torch.equal(got.isnan(), want.isnan())
    torch.testing.assert_close(got, want, **TOL[torch.float32], equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("mask", ["bool_bias", "kv_lens", "bool_bias_gqa", "bool_bias_causal"])
def test_a_nan_key_the_mask_excludes_reaches_no_row_through_the_cpu_kernel(mask, dtype):
    """The CPU kernel adds its mask: a bool bias or kv_lens reach it as -inf, and the NaN score of a key
    they exclude gave NaN + (-inf) = NaN in every row of the head, where the op, like eager's
    masked_fill / where, gives that key weight 0. Rows that exclude the key must match the op (the
    reference) on every element, rows that admit it be NaN as there. Found by the adversarial fuzzer."""
    hkv = 1 if mask == "bool_bias_gqa" else 2
    q, k, v = _inputs(b=2, hq=2, hkv=hkv, nq=6, nk=7, d=8, dtype=dtype, seed=5)
    k[:, 0, 4, 2] = float("nan")  # key 4 of head 0 (kv_lens: batch 0 excludes it, batch 1 admits it)
    keep = torch.rand(2, 1, 6, 7, generator=torch.Generator().manual_seed(6)) > 0.3
    keep[0, 0, :3, 4] = False  # rows 0..2 exclude the key, the others may admit it
    keep[..., 0] = True  # no row without keys
    kw = dict(kv_lens=torch.tensor([4, 7])) if mask == "kv_lens" else dict(bias=keep)
    if mask == "bool_bias_causal":  # rows 0..3 exclude key 4 by the diagonal too, whatever the bias says
        kw["causal"] = True

    def fn(q, k, v):
        return fa_compile.attention(q, k, v, **kw)

    torch._dynamo.reset()
    n_before = len(records())
    with torch.no_grad():
        got = torch.compile(fn, backend="fa3", fullgraph=True)(q, k, v)
        want = fn(q, k, v)  # the op's reference
    assert [r.decision.target for r in records()[n_before:]] == [
        "aten._scaled_dot_product_flash_attention_for_cpu"], records()[n_before:]
    rows = want.isnan().any(-1)
    assert rows.any() and not rows.all(), "the case must have rows that admit the key and rows that do not"
    assert torch.equal(got.isnan(), want.isnan()), (got.isnan().any(-1), rows)
    torch.testing.assert_close(got, want, **TOL[dtype], equal_nan=True)


def test_lowered_training_graphs_are_pinned():
    # 32 queries: more than a decode step, so the forward is the one op (cpu_flash.GRAPH_OPS_MAX_QUERIES)
    q, k, v = (t.requires_grad_() for t in _inputs(nq=32, nk=32))
    torch._dynamo.reset()
    with capture_graphs() as graphs:
        out = torch.compile(_causal_attn, backend="fa3")(q, k, v)
        out.sum().backward()
    assert len(graphs) == 2
    expecttest.assert_expected_inline(graphs[0].strip(), """\
def forward(self, primals_1, primals_2, primals_3):
    cpu_flash_forward = torch.ops.fa3.cpu_flash_forward.default(primals_1, primals_2, primals_3, None, None, 0.35355339059327373, True, 1, 'zero')
    getitem_2 = cpu_flash_forward[0]
    getitem_3 = cpu_flash_forward[1];  cpu_flash_forward = None
    copy_strided = torch.ops.prims.copy_strided.default(getitem_2, [1024, 8, 32, 1]);  getitem_2 = None
    clone = torch.ops.aten.clone.default(copy_strided, memory_format = torch.contiguous_format)
    return (clone, primals_1, primals_2, primals_3, copy_strided, getitem_3)""")
    expecttest.assert_expected_inline(graphs[1].strip(), """\
def forward(self, primals_1, primals_2, primals_3, getitem, getitem_1, tangents_1):
    _scaled_dot_product_flash_attention_for_cpu_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default(tangents_1, primals_1, primals_2, primals_3, getitem, getitem_1, 0.0, True, scale = 0.35355339059327373);  tangents_1 = primals_1 = primals_2 = primals_3 = getitem = getitem_1 = None
    getitem_5 = _scaled_dot_product_flash_attention_for_cpu_backward[0]
    getitem_6 = _scaled_dot_product_flash_attention_for_cpu_backward[1]
    getitem_7 = _scaled_dot_product_flash_attention_for_cpu_backward[2];  _scaled_dot_product_flash_attention_for_cpu_backward = None
    copy_strided = torch.ops.prims.copy_strided.default(getitem_5, [1024, 256, 8, 1]);  getitem_5 = None
    copy_strided_1 = torch.ops.prims.copy_strided.default(getitem_6, [1024, 256, 8, 1]);  getitem_6 = None
    copy_strided_2 = torch.ops.prims.copy_strided.default(getitem_7, [1024, 256, 8, 1]);  getitem_7 = None
    return (copy_strided, copy_strided_1, copy_strided_2)""")


def test_inference_graph_with_key_padding_is_pinned():
    q, k, v = _inputs()
    keep = _bool_padding(2, 16)
    torch._dynamo.reset()
    with capture_graphs() as graphs:
        out = torch.compile(lambda q, k, v, m: fa_compile.attention(q, k, v, bias=m), backend="fa3")(q, k, v, keep)
    torch.testing.assert_close(out, fa_compile.attention(q, k, v, bias=keep), **TOL[torch.float32])
    expecttest.assert_expected_inline(graphs[0].strip(), """\
def forward(self, arg0_1, arg1_1, arg2_1, arg3_1):
    full = torch.ops.aten.full.default([2, 1, 1, 16], 0, dtype = torch.float32, layout = torch.strided, device = device(type='cpu'), pin_memory = False)
    bitwise_not = torch.ops.aten.bitwise_not.default(arg3_1);  arg3_1 = None
    scalar_tensor = torch.ops.aten.scalar_tensor.default(-inf, dtype = torch.float32, layout = torch.strided, device = device(type='cpu'))
    where = torch.ops.aten.where.self(bitwise_not, scalar_tensor, full);  bitwise_not = scalar_tensor = full = None
    ne = torch.ops.aten.ne.Tensor(arg1_1, arg1_1)
    any_1 = torch.ops.aten.any.dim(ne, -1)
    scalar_tensor_1 = torch.ops.aten.scalar_tensor.default(0.0, dtype = torch.float32, layout = torch.strided, device = device(type='cpu'))
    where_1 = torch.ops.aten.where.self(ne, scalar_tensor_1, arg1_1);  ne = scalar_tensor_1 = None
    unsqueeze = torch.ops.aten.unsqueeze.default(any_1, 2);  any_1 = None
    eq = torch.ops.aten.eq.Scalar(where, -inf)
    bitwise_not_1 = torch.ops.aten.bitwise_not.default(eq);  eq = None
    bitwise_and = torch.ops.aten.bitwise_and.Tensor(unsqueeze, bitwise_not_1);  unsqueeze = bitwise_not_1 = None
    any_2 = torch.ops.aten.any.dim(bitwise_and, -1);  bitwise_and = None
    expand = torch.ops.aten.expand.default(any_2, [2, 4, 16]);  any_2 = None
    _scaled_dot_product_flash_attention_for_cpu = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default(arg0_1, where_1, arg2_1, attn_mask = where, scale = 0.35355339059327373);  where_1 = arg2_1 = None
    getitem_2 = _scaled_dot_product_flash_attention_for_cpu[0];  _scaled_dot_product_flash_attention_for_cpu = None
    eq_1 = torch.ops.aten.eq.Scalar(where, -inf)
    bitwise_not_2 = torch.ops.aten.bitwise_not.default(eq_1);  eq_1 = None
    any_3 = torch.ops.aten.any.dim(bitwise_not_2, -1);  bitwise_not_2 = None
    bitwise_not_3 = torch.ops.aten.bitwise_not.default(any_3);  any_3 = None
    expand_1 = torch.ops.aten.expand.default(bitwise_not_3, [2, 4, 16]);  bitwise_not_3 = None
    sub = torch.ops.aten.sub.Tensor(arg0_1, arg0_1);  arg0_1 = None
    sub_1 = torch.ops.aten.sub.Tensor(arg1_1, arg1_1);  arg1_1 = None
    ne_1 = torch.ops.aten.ne.Tensor(sub, sub);  sub = None
    any_4 = torch.ops.aten.any.dim(ne_1, -1);  ne_1 = None
    eq_2 = torch.ops.aten.eq.Tensor(sub_1, sub_1);  sub_1 = None
    logical_not = torch.ops.aten.logical_not.default(eq_2);  eq_2 = None
    any_5 = torch.ops.aten.any.dim(logical_not, -1);  logical_not = None
    logical_not_1 = torch.ops.aten.logical_not.default(any_5);  any_5 = None
    unsqueeze_1 = torch.ops.aten.unsqueeze.default(logical_not_1, 2);  logical_not_1 = None
    eq_3 = torch.ops.aten.eq.Scalar(where, -inf);  where = None
    bitwise_not_4 = torch.ops.aten.bitwise_not.default(eq_3);  eq_3 = None
    bitwise_and_1 = torch.ops.aten.bitwise_and.Tensor(unsqueeze_1, bitwise_not_4);  unsqueeze_1 = bitwise_not_4 = None
    any_6 = torch.ops.aten.any.dim(bitwise_and_1, -1);  bitwise_and_1 = None
    bitwise_not_5 = torch.ops.aten.bitwise_not.default(any_6);  any_6 = None
    bitwise_or = torch.ops.aten.bitwise_or.Tensor(any_4, bitwise_not_5);  any_4 = bitwise_not_5 = None
    bitwise_or_1 = torch.ops.aten.bitwise_or.Tensor(bitwise_or, expand);  bitwise_or = expand = None
    bitwise_not_6 = torch.ops.aten.bitwise_not.default(expand_1)
    bitwise_and_2 = torch.ops.aten.bitwise_and.Tensor(bitwise_or_1, bitwise_not_6);  bitwise_or_1 = bitwise_not_6 = None
    unsqueeze_2 = torch.ops.aten.unsqueeze.default(bitwise_and_2, -1);  bitwise_and_2 = None
    scalar_tensor_2 = torch.ops.aten.scalar_tensor.default(nan, dtype = torch.float32, layout = torch.strided, device = device(type='cpu'))
    where_2 = torch.ops.aten.where.self(unsqueeze_2, scalar_tensor_2, getitem_2);  unsqueeze_2 = scalar_tensor_2 = getitem_2 = None
    unsqueeze_3 = torch.ops.aten.unsqueeze.default(expand_1, -1);  expand_1 = None
    scalar_tensor_5 = torch.ops.aten.scalar_tensor.default(0.0, dtype = torch.float32, layout = torch.strided, device = device(type='cpu'))
    where_5 = torch.ops.aten.where.self(unsqueeze_3, scalar_tensor_5, where_2);  unsqueeze_3 = scalar_tensor_5 = where_2 = None
    copy_strided = torch.ops.prims.copy_strided.default(where_5, [512, 8, 32, 1]);  where_5 = None
    return (copy_strided,)""")


def test_dynamic_shapes_one_lowered_graph_serves_other_lengths():
    torch._dynamo.reset()
    counters.clear()
    f = torch.compile(_causal_attn, backend="fa3", dynamic=True)
    for n in (12, 11, 17):
        q, k, v = _inputs(nq=n, nk=n, seed=n)
        torch.testing.assert_close(f(q, k, v), _causal_attn(q, k, v), **TOL[torch.float32])
    assert counters["stats"]["unique_graphs"] == 1
    assert counters["fa_compile"]["lowered"] == 1


def test_a_lowering_that_fails_at_compile_time_keeps_the_op_with_one_warning(monkeypatch):
    def broken(self, args):
        raise RuntimeError("injected")

    monkeypatch.setattr(cpu_flash.CpuFlash, "forward_fn", broken)
    monkeypatch.setattr("fa_compile.lowering.graph_pass._WARNED", set())
    q, k, v = _inputs()
    outs = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for seed in (0, 1):  # two compiles, one warning
            torch._dynamo.reset()
            q, k, v = _inputs(seed=seed)
            outs.append((torch.compile(_causal_attn, backend="fa3")(q, k, v), _causal_attn(q, k, v)))
    for got, want in outs:
        torch.testing.assert_close(got, want, **TOL[torch.float32])
    ours = [w for w in caught if "fa_compile: lowering" in str(w.message)]
    assert len(ours) == 1 and "injected" in str(ours[0].message)
    assert not records()[-1].decision.lowered and "injected" in records()[-1].decision.reason


def test_settings_act_at_compile_time():
    q, k, v = _inputs()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch._dynamo.reset()
    with sdpa_kernel([SDPBackend.MATH]):
        out = torch.compile(_causal_attn, backend="fa3")(q, k, v)
    torch.testing.assert_close(out, _causal_attn(q, k, v), **TOL[torch.float32])
    d = records()[-1].decision  # not aten's flash kernel: the reference math as graph ops
    assert d.kernel == "reference_math" and d.lowered and "sdpa_kernel" in d.instead_of, str(d)
    torch._dynamo.reset()
    out = torch.compile(_causal_attn, backend=fa_compile.backend(kernel="reference"))(q, k, v)
    torch.testing.assert_close(out, _causal_attn(q, k, v), **TOL[torch.float32])
    assert not records()[-1].decision.lowered and "forced" in records()[-1].decision.reason


def test_pass_uuid_keys_the_graph_cache_on_settings_and_chained_passes(monkeypatch):
    monkeypatch.setenv("FA_COMPILE_DECODE_MATH", "1")  # (the module's fixture turns it off)
    a, b = LoweringPass().uuid(), LoweringPass().uuid()
    assert isinstance(a, str) and a == b
    torch.use_deterministic_algorithms(True)
    try:
        assert LoweringPass().uuid() != a
    finally:
        torch.use_deterministic_algorithms(False)
    assert LoweringPass(chained=lambda g: None).uuid() is None  # a user's pass without uuid(): no caching
    for switch in ("FA_COMPILE_REFERENCE_MATH", "FA_COMPILE_DECODE_MATH"):  # read by the choice: part of the key
        with monkeypatch.context() as m:
            m.setenv(switch, "0")
            assert LoweringPass().uuid() != a, switch


def test_tune_is_per_backend_and_mode_is_never_dropped():
    from fa_compile import tuning

    before = tuning.enabled()
    fa_compile.backend(tune=True)
    assert tuning.enabled() == before
    q, k, v = _inputs()
    torch._dynamo.reset()
    with pytest.raises(Exception, match="mode, options"):
        torch.compile(_causal_attn, backend=fa_compile.backend("aot_eager"), mode="max-autotune")(q, k, v)


def test_explain_says_what_each_site_is_lowered_to():
    q, k, v = (t.requires_grad_() for t in _inputs())
    text = str(fa_compile.explain(_causal_attn, q, k, v))
    assert "forward reference -> aten._scaled_dot_product_flash_attention_for_cpu" in text
    assert "backward reference -> aten._scaled_dot_product_flash_attention_for_cpu_backward" in text


OPT_IN = """
    import math, torch, warnings
    warnings.simplefilter("always")
    from torch._dynamo.utils import counters
    def attn(q, k, v):
        return torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), dim=-1) @ v
    q, k, v = (torch.randn(2, 4, 16, 8) for _ in range(3))
    out = torch.compile(attn)(q, k, v)
    torch.testing.assert_close(out, attn(q, k, v))
    print("rewritten", counters["fa_compile"]["sites_rewritten"], "lowered", counters["fa_compile"]["lowered"])
"""


def test_env_opt_in_lowers_without_the_uuid_warning():
    r = run_python(OPT_IN, FA_COMPILE="1")
    assert r.returncode == 0, r.stderr
    assert "rewritten 1 lowered 1" in r.stdout
    assert "uuid" not in r.stderr


def test_env_opt_in_keeps_the_graph_cache_working(tmp_path):
    """Both passes have a uuid(): a second process hits Inductor's caches (no rewrite to count) and
    computes the same."""
    script = OPT_IN + """
    print("hits", counters["inductor"]["fxgraph_cache_hit"] + counters["aot_autograd"]["autograd_cache_hit"])
"""
    env = dict(FA_COMPILE="1", TORCHINDUCTOR_CACHE_DIR=str(tmp_path), TORCHINDUCTOR_FX_GRAPH_CACHE="1",
               TORCHINDUCTOR_AUTOGRAD_CACHE="1")
    first, second = run_python(script, **env), run_python(script, **env)
    assert first.returncode == 0 and second.returncode == 0, first.stderr + second.stderr
    assert "rewritten 1 lowered 1" in first.stdout and "hits 0" in first.stdout
    assert "rewritten 0 lowered 0" in second.stdout and "hits 0" not in second.stdout
    assert "uuid" not in first.stderr + second.stderr


def test_unrecognised_fa_compile_value_warns_with_the_valid_ones():
    r = run_python(OPT_IN, FA_COMPILE="2")
    assert r.returncode == 0, r.stderr
    assert "rewritten 0 lowered 0" in r.stdout
    assert r.stderr.count("FA_COMPILE='2' is not recognised") == 1 and "use 1 (also true" in r.stderr


@pytest.mark.parametrize("name", ["FA_COMPILE_TUNE", "FA_COMPILE_FP8", "FA_COMPILE_LOG"])
def test_unrecognised_switch_values_warn_once_and_read_as_off(monkeypatch, name):
    import warnings

    from fa_compile import config

    monkeypatch.setenv(name, "maybe")
    monkeypatch.setattr(config, "_WARNED_VALUES", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert not config.flag_on(name) and not config.flag_on(name)
    assert [str(w.message) for w in caught] == [f"{name}='maybe' is not recognised and is read as off: use 1 (also "
                                                "true, yes, on) to turn it on, or 0 (also false, no, off)"]
    monkeypatch.setenv(name, "off")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not config.flag_on(name)


def test_a_lowered_graph_inductor_cannot_compile_is_compiled_again_with_the_op(monkeypatch):
    """Inductor failing on the lowered graph (injected in its graph lowering) costs one warning and
    a second compile with the op kept, never the compile."""
    import fa_compile.compiler as compiler
    from torch._inductor.graph import GraphLowering

    real = GraphLowering.run

    def run(self, *args):
        lowered = (torch.ops.fa3.cpu_flash_forward.default, torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default)
        if any(n.target in lowered for n in self.graph.nodes):  # the lowered forward
            raise RuntimeError("injected codegen failure")
        return real(self, *args)

    monkeypatch.setattr(GraphLowering, "run", run)
    monkeypatch.setattr(compiler, "_FALLBACK_WARNED", set())
    q, k, v = _inputs()
    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = torch.compile(_causal_attn, backend="fa3")(q, k, v)
    torch.testing.assert_close(out, _causal_attn(q, k, v), **TOL[torch.float32])
    ours = [w for w in caught if "compiled again with torch.ops.fa3 kept" in str(w.message)]
    assert len(ours) == 1 and "injected codegen failure" in str(ours[0].message)


def _finfo_min_padded_attn(q, k, v, keep):
    # Hugging Face's eager spelling: an additive finfo.min key mask (a fully masked row averages V).
    s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    s = s + torch.where(keep, 0.0, torch.finfo(s.dtype).min)
    return torch.softmax(s, dim=-1) @ v


def test_uniform_row_grad_becomes_zeros_and_keeps_eagers_gradient():
    # The finite fill's q/k gradient on fully masked rows comes through fa3::uniform_row_grad, whose value
    # is 0: after AOTAutograd the forward graph makes the zeros itself (no run-time op call), and the
    # gradients still equal eager's, batch 1 (every key masked) included.
    q, k, v = _inputs()
    keep = _bool_padding(2, 16)
    w = torch.randn(2, 4, 16, 8, generator=torch.Generator().manual_seed(3))
    want = _run(lambda q, k, v: (_finfo_min_padded_attn(q, k, v, keep), q), q, k, v, w)
    torch._dynamo.reset()
    n = len(records())
    with capture_graphs() as graphs, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = _run(lambda q, k, v: (torch.compile(_finfo_min_padded_attn, backend="fa3")(q, k, v, keep), q),
                   q, k, v, w)
    assert "uniform_row_grad" not in graphs[0] and "aten.full.default" in graphs[0], graphs[0]
    # Inductor compiled the lowered graph itself (no fall back to the kept op)
    assert not [str(c.message) for c in caught if "fa_compile" in str(c.message)], [str(c.message) for c in caught]
    assert records()[n:] and all(r.decision.lowered for r in records()[n:]), [str(r.decision) for r in records()[n:]]
    for name, a, b in zip(("out", "dq", "dk", "dv"), (got[0], *got[2:]), (want[0], *want[2:])):
        torch.testing.assert_close(a, b, **TOL[torch.float32], msg=lambda m: f"{name}: {m}")
    assert k.grad is None  # the inputs themselves were cloned by _run


def _padded_attn_fill(fill: str, groups: int):
    """Eager attention with a key-padding mask spelled as Hugging Face does (an additive finfo.min mask:
    a row with no kept key averages V) or as masked_fill(-inf) (such a row is NaN), GQA by repeat_kv."""
    def attn(q, k, v, keep):
        if groups > 1:
            b, h, n, d = k.shape
            k = k[:, :, None].expand(b, h, groups, n, d).reshape(b, h * groups, n, d)
            v = v[:, :, None].expand(b, h, groups, n, v.shape[-1]).reshape(b, h * groups, n, v.shape[-1])
        s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
        if fill == "finfo_min":
            s = s + torch.where(keep, 0.0, torch.finfo(s.dtype).min)
        else:
            s = s.masked_fill(~keep, float("-inf"))
        return torch.softmax(s, dim=-1) @ v
    return attn


@pytest.mark.parametrize("n", [9, 20])
@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("fill", ["finfo_min", "neg_inf"])
def test_inference_empty_row_fixup_is_written_by_the_cpu_op(fill, groups, n):
    """In inference the rewrite's fix-up of rows with no kept key (the mean of V, or NaN) is folded into
    the lowered forward: past a decode step's 16 queries into fa3::cpu_flash_forward, which writes it only
    on such rows (no mean over V nor `where` per call is left in the graph); up to 16 into the lowering's
    own graph ops. Every element (NaN positions included) equals eager's."""
    b, hkv, d = 3, 2, 8
    gen = torch.Generator().manual_seed(21 + groups)
    q = torch.randn(b, hkv * groups, n, d, generator=gen)
    k, v = torch.randn(b, hkv, n, d, generator=gen), torch.randn(b, hkv, n, d, generator=gen) + 1.0
    keep = torch.ones(b, 1, 1, n, dtype=torch.bool)
    keep[0, ..., 6:] = False
    keep[2] = False  # batch 2 keeps no key: the fix-up's rows
    attn = _padded_attn_fill(fill, groups)
    torch._dynamo.reset()
    n_before = len(records())
    with torch.no_grad(), capture_graphs() as graphs:
        got = torch.compile(attn, backend="fa3")(q, k, v, keep)
        want = attn(q, k, v, keep)
    decisions = [r.decision for r in records()[n_before:]]
    assert [d.target for d in decisions] == ["aten._scaled_dot_product_flash_attention_for_cpu"], decisions
    what = "mean of V" if fill == "finfo_min" else "NaN"
    assert decisions[0].folded == f"empty rows: {what} written by the kernel", decisions[0].folded
    code = graphs[0]
    if n > cpu_flash.GRAPH_OPS_MAX_QUERIES:
        assert "'mean_v'" in code if fill == "finfo_min" else "'nan'" in code, code
        assert "aten.mean" not in code and "aten.where" not in code, code
    else:
        assert "cpu_flash_forward" not in code and "_scaled_dot_product_flash_attention_for_cpu" in code, code
    assert want[2].isnan().all() == (fill == "neg_inf") and not want[:2].isnan().any()
    assert torch.equal(got.isnan(), want.isnan())
    torch.testing.assert_close(got, want, **TOL[torch.float32], equal_nan=True)


@pytest.mark.parametrize("empty", [True, False])
@pytest.mark.parametrize("grads", ["qkv", "v"])
@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("fill", ["finfo_min", "neg_inf"])
def test_training_empty_row_fixup_backward_is_computed_by_the_cpu_op(fill, groups, grads, empty):
    """In training the backward of the rewrite's empty-row fix-up (the `where`s on dO, the mean of V's
    gradient, eager's uniform-row gradient of q and k) becomes part of one op, fa3::cpu_flash_backward,
    which computes it only when some row admits no key: nothing of it is left as graph ops. Output and
    every gradient equal eager's, with and without such rows."""
    b, hkv, d, n = 3, 2, 8, 20
    gen = torch.Generator().manual_seed(40 + groups)
    q = torch.randn(b, hkv * groups, n, d, generator=gen)
    k, v = torch.randn(b, hkv, n, d, generator=gen), torch.randn(b, hkv, n, d, generator=gen) + 1.0
    keep = torch.ones(b, 1, 1, n, dtype=torch.bool)
    keep[0, ..., 6:] = False
    if empty:
        keep[2] = False  # batch 2 keeps no key: the fix-up's rows
    w = torch.randn(b, hkv * groups, n, d, generator=gen)
    attn = _padded_attn_fill(fill, groups)

    def run(fn):
        leaves = [t.clone().requires_grad_(name in grads) for name, t in zip("qkv", (q, k, v))]
        out = fn(*leaves, keep)
        (torch.where(out.isnan(), 0.0, out) * w).sum().backward()
        return [out] + [t.grad for t in leaves if t.requires_grad]

    torch._dynamo.reset()
    n_before = len(records())
    with capture_graphs() as graphs:
        got = run(torch.compile(attn, backend="fa3"))
    want = run(attn)
    for name, a, e in zip(["out"] + [f"d{c}" for c in grads], got, want):
        assert torch.equal(a.isnan(), e.isnan()), name  # eager's NaN row makes its head's dV NaN: here too
        torch.testing.assert_close(a, e, **TOL[torch.float32], equal_nan=True, msg=lambda m: f"{name}: {m}")
    bwd = [r.decision for r in records()[n_before:] if r.decision.direction == "backward"]
    kind = {"neg_inf": "their dout zeroed", "finfo_min": "their dout zeroed, the mean of V's gradient"}[fill]
    if fill == "finfo_min" and grads == "qkv":
        kind += " and eager's uniform-row q / k gradients"
    assert [d.folded for d in bwd] == [f"empty rows: {kind} by the kernel"], [str(d) for d in bwd]
    code = graphs[-1]
    # explain() says the same before compiling
    leaves = [t.clone().requires_grad_(name in grads) for name, t in zip("qkv", (q, k, v))]
    text = str(fa_compile.explain(attn, *leaves, keep))
    assert f"(empty rows: {kind} by the kernel)" in text, text
    if fill == "finfo_min":
        assert "forward reference -> aten._scaled_dot_product_flash_attention_for_cpu (empty rows: mean of V " \
               "written by the kernel)" in text, text
    # the op reads the incoming gradient itself; no where / sum / add of the fix-up is left around it, but for the
    # NaN that eager's NaN rows give V's gradient under -inf (fa3.nan_row_grad's backward: a test of the lse, an add)
    assert "cpu_flash_backward.default(tangents_1," in code, code
    assert not any(op in code for op in ("uniform_row_grad", "aten.sum")), code
    if fill == "finfo_min":
        assert not any(op in code for op in ("aten.add", "aten.eq")), code
    else:
        assert "aten.eq.Scalar(getitem_1, -inf)" in code and "nan" in code, code


class _PaddedSelfAttention(torch.nn.Module):
    """Projections, heads by view / transpose, a finfo.min key-padding mask, `.transpose(1, 2).contiguous()`
    back and an output projection: a Hugging Face encoder layer's attention, spelled eagerly."""

    def __init__(self, heads: int = 2, d: int = 8):
        super().__init__()
        self.heads, self.d = heads, d
        self.qkv = torch.nn.Linear(heads * d, 3 * heads * d)
        self.proj = torch.nn.Linear(heads * d, heads * d)

    def forward(self, x, keep):
        b, n, _ = x.shape
        q, k, v = (t.view(b, n, self.heads, self.d).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        s = q @ k.transpose(-1, -2) * self.d ** -0.5 + torch.where(keep, 0.0, torch.finfo(x.dtype).min)
        o = torch.softmax(s, dim=-1) @ v
        return self.proj(o.transpose(1, 2).contiguous().view(b, n, -1))


@pytest.mark.parametrize("train", [False, True])
def test_folded_fixups_leave_no_head_transposing_copies(train):
    """The folded empty-row fix-up takes the kernel's own [B, N, H, D] strides where its only use is the head
    transpose before a projection (and, in training, its backward's): AOTAutograd traced that transpose as a
    copy of the fix-up's [B, H, N, D]-contiguous output, which the lowering drops (splice.droppable_clones).
    Output and every gradient equal eager's, with a fully padded sequence and without."""
    torch.manual_seed(3)
    model = _PaddedSelfAttention()
    x = torch.randn(3, 20, 16)
    keep = torch.ones(3, 1, 1, 20, dtype=torch.bool)
    keep[0, ..., 7:] = False
    keep[2] = False  # no key: the fix-up's rows

    def run(m, xx):
        xx = xx.clone().requires_grad_(train)
        with torch.set_grad_enabled(train):
            out = m(xx, keep)
            if train:
                out.square().sum().backward()
        return [out] + ([xx.grad] + [p.grad.clone() for p in m.parameters()] if train else [])

    torch._dynamo.reset()
    n_before = len(records())
    with capture_graphs() as graphs:
        got = run(torch.compile(model, backend="fa3"), x)
    model.zero_grad()
    want = run(model, x)
    for i, (a, e) in enumerate(zip(got, want)):
        torch.testing.assert_close(a, e, **TOL[torch.float32], msg=lambda m, i=i: f"value {i}: {m}")
    decisions = [r.decision for r in records()[n_before:]]
    assert [d.folded for d in decisions if d.direction == "forward"] == ["empty rows: mean of V written by the kernel"]
    assert len(graphs) == (2 if train else 1)
    for code in graphs:
        assert "aten.clone" not in code and "copy_strided" not in code, code


def test_training_fixups_fold_under_dynamic_sizes():
    """One compile across lengths (dynamic=True): both directions stay lowered, with no warning, and output
    and every gradient equal eager's at each length, with a fully padded sequence and without."""
    torch.manual_seed(4)
    model = _PaddedSelfAttention()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fa3", dynamic=True)
    n_before = len(records())
    for n, empty in [(20, True), (33, False), (41, True)]:
        x = torch.randn(3, n, 16)
        keep = torch.ones(3, 1, 1, n, dtype=torch.bool)
        keep[0, ..., 7:] = False
        if empty:
            keep[2] = False
        got, want = [], []
        for fn, res in ((compiled, got), (model, want)):
            model.zero_grad()
            xx = x.clone().requires_grad_()
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # a failed lowering warns
                out = fn(xx, keep)
                out.square().sum().backward()
            res += [out, xx.grad] + [p.grad.clone() for p in model.parameters()]
        for i, (a, e) in enumerate(zip(got, want)):
            torch.testing.assert_close(a, e, **TOL[torch.float32], msg=lambda m, i=i: f"n={n}, value {i}: {m}")
    decisions = [r.decision for r in records()[n_before:]]
    assert decisions and all(d.lowered for d in decisions), [str(d) for d in decisions]
    assert {d.direction for d in decisions} == {"forward", "backward"}


@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("fill", ["finfo_min", "neg_inf", "none"])
def test_explain_reads_the_empty_row_fixup_before_aot(fill, grad):
    """choice.emitted_fix finds emit's fix-up after the op call in the rewritten (pre-AOTAutograd) graph,
    which explain() describes; the lowering finds the same fix-up after AOTAutograd (empty_rows.find_fixup)."""
    from fa_compile.compiler import run_pass
    from fa_compile.lowering.choice import emitted_fix, emitted_grad_fix

    q, k, v = _inputs(b=2, hq=2, hkv=2, nq=9, nk=9)
    keep = torch.ones(2, 1, 1, 9, dtype=torch.bool)
    keep[1] = False
    attn = _padded_attn_fill(fill, 1) if fill != "none" else (lambda q, k, v, keep: torch.softmax(
        q @ k.transpose(-1, -2), dim=-1) @ v)
    reports = []

    def backend(gm, example_inputs):
        reports.extend(run_pass(gm, None, record=False))
        return gm

    torch._dynamo.reset()
    with torch.set_grad_enabled(grad):
        torch.compile(attn, backend=backend)(*(t.requires_grad_(grad) for t in (q, k, v)), keep)
    assert len(reports) == 1 and reports[0].rewritten, reports
    want = {"finfo_min": "mean_v", "neg_inf": "nan", "none": None}[fill]
    assert emitted_fix(reports[0].call) == want
    # the fix-up's backward as the lowering folds it (empty_rows_backward.py)
    want_grad = {"finfo_min": "uniform" if grad else "mean_v", "neg_inf": "none", "none": None}[fill]
    assert emitted_grad_fix(reports[0].call) == want_grad


@pytest.mark.parametrize("causal", [False, True])
def test_lowered_op_call_never_reads_past_kv_lens(causal):
    """A compiled call of the op with kv_lens (lowered to the CPU kernel) reads no key or value past each length,
    as the op does: NaN and inf there give the bits zeros there give, forward and backward."""
    q, k, v = _inputs(b=3, hq=4, hkv=2, nq=6, nk=9, d=8, dtype=torch.float32, seed=7)
    lens = torch.tensor([9, 4, 0])

    def fn(q, k, v):
        return fa_compile.attention(q, k, v, kv_lens=lens, causal="bottom_right" if causal else False)

    from fa_compile.kernels.triton_testing import past_lens_filled

    compiled = torch.compile(fn, backend="fa3", fullgraph=True)
    results = []
    for poison in (False, True):
        kk, vv = past_lens_filled(k, v, lens, poison)
        torch._dynamo.reset()
        qg, kg, vg = (t.clone().requires_grad_() for t in (q, kk, vv))
        out = compiled(qg, kg, vg)
        results.append((out, *torch.autograd.grad(out.sum(), (qg, kg, vg))))
        want = fn(q, kk, vv)
        torch.testing.assert_close(out.detach(), want, **TOL[torch.float32])
    for name, clean, poisoned in zip(("out", "dq", "dk", "dv"), *results):
        assert torch.isfinite(poisoned).all(), name
        torch.testing.assert_close(poisoned, clean, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("empty_fill", ["zero", "nan", "mean_v"])
@pytest.mark.parametrize("case", ["padding", "kv_lens_gqa", "float_bias", "causal"])
def test_cpu_flash_op_matches_the_reference_and_its_fake(case, empty_fill):
    """fa3::cpu_flash_forward against the op's reference plus the fill on rows with no admissible key,
    every element; its fake gives the real strides (opcheck); a bad fill names the argument."""
    gen = torch.Generator().manual_seed(5)
    hq, hkv = (4, 2) if case == "kv_lens_gqa" else (2, 2)
    x = torch.randn(2, 7, hq * 8, generator=gen)
    q = x.view(2, 7, hq, 8).transpose(1, 2)  # BSHD, as projections give it
    k, v = torch.randn(2, hkv, 7, 8, generator=gen), torch.randn(2, hkv, 7, 8, generator=gen)
    bias = kv_lens = None
    causal = case == "causal"
    if case == "padding":
        bias = torch.ones(2, 1, 1, 7, dtype=torch.bool)
        bias[1] = False
    elif case == "kv_lens_gqa":
        kv_lens = torch.tensor([0, 5])
    elif case == "float_bias":
        bias = torch.randn(2, 1, 7, 7, generator=gen)
        bias[:, :, 3] = float("-inf")
    args = (q, k, v, bias, kv_lens, 0.3, causal, hq // hkv, empty_fill)
    out, lse = torch.ops.fa3.cpu_flash_forward(*args)
    ref_out, ref_lse = fa_compile.attention(q, k, v, scale=0.3, causal=causal, bias=bias, kv_lens=kv_lens,
                                            return_lse=True)
    empty = torch.isneginf(ref_lse)
    assert empty.any() != causal, "the case must have rows with no admissible key (causal: none)"
    if empty_fill == "nan":
        ref_out = ref_out.masked_fill(empty[..., None], float("nan"))
    elif empty_fill == "mean_v":
        mean = v.mean(dim=2, keepdim=True).repeat_interleave(hq // hkv, dim=1)
        ref_out = torch.where(empty[..., None], mean, ref_out)
    assert out.stride() == q.stride() and lse.is_contiguous() and lse.dtype == torch.float32
    torch.testing.assert_close(out, ref_out, **TOL[torch.float32], equal_nan=True)
    torch.testing.assert_close(lse, ref_lse, **TOL[torch.float32])
    torch.library.opcheck(torch.ops.fa3.cpu_flash_forward.default, args, test_utils=("test_schema", "test_faketensor"))
    with pytest.raises(ValueError, match="empty_fill"):
        torch.ops.fa3.cpu_flash_forward(*args[:-1], "mean")


@pytest.mark.parametrize("empty_grad", ["none", "mean_v", "uniform"])
@pytest.mark.parametrize("groups", [1, 2])
def test_cpu_flash_backward_op_matches_eagers_fixup_gradient_and_its_fake(empty_grad, groups):
    """fa3::cpu_flash_backward against autograd through the op's reference and emit's fix-up spelled as
    graph ops (where on the lse's empty rows, the mean of V, uniform_row_grad), every element; its fake gives
    the real strides (opcheck); a bad empty_grad names the argument."""
    from fa_compile.row_fixups import _uniform_row_grad_autograd

    gen = torch.Generator().manual_seed(9)
    hkv, d = 2, 8
    q = torch.randn(2, 7, hkv * groups, d, generator=gen).transpose(1, 2)  # BSHD, as projections give it
    k = torch.randn(2, 7, hkv, d, generator=gen).transpose(1, 2)
    v = torch.randn(2, 7, hkv, d, generator=gen).transpose(1, 2) + 1.0
    keep = torch.ones(2, 1, 1, 7, dtype=torch.bool)
    keep[1] = False  # batch 1 admits no key
    dout = torch.randn(2, hkv * groups, 7, d, generator=gen)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out, lse = fa_compile.attention(*leaves, bias=keep, scale=0.3, return_lse=True)
    empty = torch.isneginf(lse)[..., None]
    fill = torch.zeros_like(out)
    if empty_grad != "none":
        fill = leaves[2].mean(dim=2, keepdim=True).repeat_interleave(groups, dim=1) + fill
    if empty_grad == "uniform":
        fill = fill + _uniform_row_grad_autograd(leaves[0], leaves[1], leaves[2], 0.3)
    res = torch.where(empty, fill, out)
    want = torch.autograd.grad(res, leaves, dout, allow_unused=True)
    mask = torch.zeros(2, 1, 1, 7).masked_fill(~keep, float("-inf"))
    args = (dout, q, k, v, out.detach(), lse.detach(), mask, 0.3, False, groups, empty_grad)
    got = torch.ops.fa3.cpu_flash_backward(*args)
    for name, a, e, like in zip(("dq", "dk", "dv"), got, want, (q, k, v)):
        torch.testing.assert_close(a, e, **TOL[torch.float32], msg=lambda m, n=name: f"{n}: {m}")
        assert a.stride() == torch.empty_like(like).stride(), name
    torch.library.opcheck(torch.ops.fa3.cpu_flash_backward.default, args, test_utils=("test_schema", "test_faketensor"))
    with pytest.raises(ValueError, match="empty_grad"):
        torch.ops.fa3.cpu_flash_backward(*args[:-1], "mean")


def test_a_finite_input_whose_sum_overflows_takes_the_exact_path(monkeypatch):
    """The op decides "no NaN or infinite element" by one fp32 sum per input; finite elements whose sum
    overflows answer no, which must only cost the exact path's checks, never a changed number."""
    gen = torch.Generator().manual_seed(8)
    q = torch.randn(2, 2, 6, 8, generator=gen) * 1e-37
    k = torch.randn(2, 2, 6, 8, generator=gen).abs() * 3e37 + 3e37  # all positive: their sum overflows
    v = torch.randn(2, 2, 6, 8, generator=gen)
    keep = torch.rand(2, 1, 6, 6, generator=gen) > 0.3
    keep[..., 0] = True
    from fa_compile import cpu_flash_op

    assert torch.isfinite(k).all() and not cpu_flash_op._all_finite(k)
    calls = []
    real = cpu_flash_op._nan_rows
    monkeypatch.setattr(cpu_flash_op, "_nan_rows", lambda *a: calls.append(1) or real(*a))
    out, lse = torch.ops.fa3.cpu_flash_forward(q, k, v, keep, None, 0.3, False, 1, "zero")
    assert calls, "the exact path must have run"
    ref_out, ref_lse = fa_compile.attention(q, k, v, scale=0.3, bias=keep, return_lse=True)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref_out, **TOL[torch.float32])
    torch.testing.assert_close(lse, ref_lse, **TOL[torch.float32])


@pytest.mark.parametrize("native", [True, False])
def test_gqa_through_the_cpu_kernel_with_and_without_its_own_head_groups(native, monkeypatch):
    """aten's CPU flash kernel reads each kv head for its group itself where the running torch's does
    (`cpu_flash_op.native_gqa`, asked of the kernel): then K and V are not repeated per query head and the
    backward has no sum over groups; otherwise they are. Either way out, lse and every gradient equal the
    op's reference, with a key-padding mask and an empty batch row."""
    from fa_compile import cpu_flash_op
    from fa_compile.lowering import cpu_flash as lowering_cpu_flash

    if native and not cpu_flash_op.native_gqa():
        pytest.skip("this torch's CPU flash kernel repeats K and V itself")
    monkeypatch.setattr(cpu_flash_op, "native_gqa", lambda: native)
    monkeypatch.setattr(lowering_cpu_flash, "native_gqa", lambda: native)
    q, k, v = _inputs(hq=6, hkv=2, seed=4)
    keep = _bool_padding(2, 16)

    def fn(q, k, v):
        return fa_compile.attention(q, k, v, bias=keep, return_lse=True)

    w = torch.randn(2, 6, 16, 8)
    torch._dynamo.reset()
    n_before = len(records())
    with capture_graphs() as graphs:
        got = _run(torch.compile(fn, backend="fa3", fullgraph=True), q, k, v, w)
    _compare(got, _run(fn, q, k, v, w), torch.float32)
    assert all(r.decision.lowered for r in records()[n_before:]) and len(records()) > n_before
    backward = next(g for g in graphs if "flash_attention_for_cpu_backward" in g)
    assert ("aten.expand" in backward) != native and ("aten.sum" in backward) != native, backward


@pytest.mark.parametrize("read", [(0, 1), (0,), (1,)])
def test_uniform_row_grad_backward_on_cuda_becomes_graph_arithmetic(read):
    """On CUDA (FakeTensors: no GPU needed) fa3::uniform_row_grad_backward left over where no lowered backward
    took it is written back as the sync-free terms in graph ops, for Inductor to fuse, computing only the
    gradients that are read; on CPU the op stays (it skips the terms when no row needs them)."""
    import operator

    import torch.fx as fx
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    from fa_compile.lowering import graph_pass

    op = torch.ops.fa3.uniform_row_grad_backward.default

    def fn(dg, q, k, v):
        dq, dk = op(dg, q, k, v, 0.25, 0.0)
        return tuple(x for i, x in enumerate((dq, dk)) if i in read)

    for device, kept in (("cuda", False), ("cpu", True)):
        with FakeTensorMode():
            q = torch.empty(2, 5, 4, 8, device=device, dtype=torch.bfloat16).transpose(1, 2)  # BSHD
            k = torch.empty(2, 2, 5, 8, device=device, dtype=torch.bfloat16)
            v = torch.empty(2, 2, 5, 8, device=device, dtype=torch.bfloat16)
            dg = torch.empty(2, 4, 5, 8, device=device, dtype=torch.bfloat16)
            gm = make_fx(fn, tracing_mode="fake")(dg, q, k, v)
        graph_pass.lower_graph(gm.graph)
        targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
        assert (op in targets) == kept, gm.code
        if not kept:
            outs = next(n for n in gm.graph.nodes if n.op == "output").args[0]
            want = {0: q, 1: k}
            for o, i in zip(outs, read):
                assert o.meta["val"].stride() == torch.empty_like(want[i]).stride(), gm.code
            mms = sum(t in (torch.ops.aten.bmm.default, torch.ops.aten.mm.default) for t in targets)
            assert mms == 2 * len(read), gm.code  # two products per gradient read


def _lengths_under_an_additive_fill(q, k, v, lens, keep):
    m = (torch.arange(k.shape[2])[None, :] < lens[:, None])[:, None, None, :] & keep
    s = q @ k.transpose(-1, -2) * k.shape[-1] ** -0.5 + (1.0 - m.float()) * torch.finfo(torch.float32).min
    return torch.softmax(s, -1) @ v


@pytest.mark.parametrize("lens,hole", [([0, 8], False), ([4, 6], True)], ids=["a_length_of_0", "lengths_and_a_hole"])
def test_uniform_rows_beside_key_lengths_weigh_every_key_in_the_cpu_backward(lens, hole):
    # On a row the additive finfo.min mask absorbs entirely, eager's gradient is softmax's at uniform weights over
    # every key, those past the lengths too; the CPU lowering's backward zeroes the keys past the lengths for its
    # kernel, and must not for that gradient.
    b, h, n, d = 2, 2, 8, 8
    q, k, v = (rand(b, h, n, d, seed=s, requires_grad=True) for s in (1, 2, 3))
    keep = torch.ones(b, 1, n, n, dtype=torch.bool)
    if hole:
        keep[0, 0, 2, :4] = False
        keep[1, 0, 5, :] = False
    res = check(_lengths_under_an_additive_fill, [q, k, v, torch.tensor(lens), keep], inner="inductor", rewritten=1)
    assert "key-padding" in res.reports[0].mask, res.reports[0]
