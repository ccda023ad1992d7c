"""Fused attention calls already in the Dynamo graph -> fa3.attention, compared with eager.

F.scaled_dot_product_attention (every argument), nn.MultiheadAttention (multi_head_attention_forward),
torch._native_multi_head_attention and nn.TransformerEncoderLayer's fast path
(_transformer_encoder_layer_fwd); every refusal reason; the rewritten graphs pinned with expecttest.
"""
from __future__ import annotations

import expecttest
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fused_helpers import Capture, assert_same, graph_summary, tolerances
from fa_compile.patterns.site import PassOptions

DTYPES = [torch.float32, torch.float16]


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def run(fn, *args, inner="eager", options=None):
    cap = Capture(inner, options)
    out = torch.compile(fn, backend=cap, fullgraph=True)(*args)
    return out, cap


def only_report(cap):
    assert len(cap.reports) == 1, cap.reports
    return cap.reports[0]


# --------------------------------------------------------------------------------------------- SDPA


def rnd(*shape, dtype=torch.float32, seed=0, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    t = torch.randn(*shape, generator=g).to(dtype)
    return t.requires_grad_(requires_grad)


SDPA_CASES = {
    "plain": (dict(), (2, 3, 7, 8), (2, 3, 9, 8)),
    "causal": (dict(is_causal=True), (2, 3, 7, 8), (2, 3, 7, 8)),
    "causal_nq_gt_nk": (dict(is_causal=True), (1, 2, 9, 8), (1, 2, 5, 8)),
    "scale": (dict(scale=0.37), (2, 3, 7, 8), (2, 3, 9, 8)),
    "gqa": (dict(enable_gqa=True), (2, 6, 7, 8), (2, 2, 9, 8)),
    "mqa_broadcast": (dict(), (2, 4, 7, 8), (2, 1, 9, 8)),
    "batch_broadcast": (dict(), (3, 2, 7, 8), (1, 2, 9, 8)),
    "three_d": (dict(), (4, 7, 8), (4, 9, 8)),
    "five_d": (dict(), (2, 2, 3, 7, 8), (2, 2, 3, 9, 8)),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(SDPA_CASES))
def test_sdpa_forms_match_eager(case, dtype):
    kw, qs, ks = SDPA_CASES[case]
    torch.manual_seed(0)
    q, k, v = rnd(*qs, dtype=dtype, seed=1), rnd(*ks, dtype=dtype, seed=2), rnd(*ks[:-1], 5, dtype=dtype, seed=3)
    fn = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, **kw)
    out, cap = run(fn, q, k, v)
    rep = only_report(cap)
    assert rep.rewritten, rep.reason
    assert cap.n_attention == 1
    assert_same(out, fn(q, k, v), **tolerances(dtype))


def _masks(kind, nq, nk, dtype):
    g = torch.Generator().manual_seed(7)
    if kind == "bool":
        m = torch.rand(nq, nk, generator=g) > 0.4
        m[:, 0] = True
        return m
    if kind == "bool_empty_rows":  # rows with no admissible key: SDPA returns 0 there
        m = torch.rand(2, 1, nq, nk, generator=g) > 0.4
        m[0, 0, 1] = False
        m[1, 0, 3] = False
        return m
    if kind == "float":
        return torch.randn(1, 3, nq, nk, generator=g).to(dtype)
    if kind == "float_neginf_rows":
        m = torch.randn(nq, nk, generator=g).to(dtype)
        m[2] = float("-inf")
        m[4, ::2] = float("-inf")
        return m
    if kind == "float_min_rows":  # finfo.min fills: eager averages V uniformly on such rows
        m = torch.zeros(nq, nk).to(dtype)
        m[1] = torch.finfo(dtype).min
        return m
    raise AssertionError(kind)


@pytest.mark.parametrize("dtype,kind", [
    (dtype, kind) for dtype in DTYPES for kind in ["bool", "bool_empty_rows", "float", "float_neginf_rows"]
] + [(torch.float32, "float_min_rows"), (torch.float16, "float_min_rows")])
def test_sdpa_attn_mask(kind, dtype):
    q, k, v = rnd(2, 3, 6, 8, dtype=dtype, seed=1), rnd(2, 3, 5, 8, dtype=dtype, seed=2), rnd(2, 3, 5, 8, dtype=dtype, seed=3)
    mask = _masks(kind, 6, 5, dtype)
    fn = lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m)
    out, cap = run(fn, q, k, v, mask)
    rep = only_report(cap)
    assert rep.rewritten, rep.reason
    assert rep.mask == ("bool-mask" if kind.startswith("bool") else "bias")
    ref = fn(q, k, v, mask)
    assert_same(out, ref, **tolerances(dtype))
    if kind == "bool_empty_rows":
        assert (out[0, :, 1] == 0).all() and (ref[0, :, 1] == 0).all()


def test_sdpa_mask_built_in_the_graph_becomes_structure():
    """A causal keep-mask built from ones().tril() is proven causal by mask analysis: no N x N bias."""
    q, k, v = rnd(2, 3, 6, 8, seed=1), rnd(2, 3, 6, 8, seed=2), rnd(2, 3, 6, 8, seed=3)

    def fn(q, k, v):
        m = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).tril()
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m)

    out, cap = run(fn, q, k, v)
    rep = only_report(cap)
    assert rep.rewritten and rep.mask == "causal", (rep.mask, rep.reason)
    assert rep.call.args[4] is True and rep.call.args[8] is None  # causal flag, no bias tensor
    assert_same(out, fn(q, k, v), **tolerances(torch.float32))


def test_sdpa_mask_with_three_d_inputs_broadcasts_like_eager():
    q, k, v = rnd(4, 6, 8, seed=1), rnd(4, 5, 8, seed=2), rnd(4, 5, 8, seed=3)
    mask = torch.randn(4, 6, 5)
    fn = lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m)
    out, cap = run(fn, q, k, v, mask)
    assert only_report(cap).rewritten
    assert_same(out, fn(q, k, v, mask), **tolerances(torch.float32))


def test_sdpa_gradients_match_eager():
    q, k, v = (rnd(2, 4, 7, 8, seed=s, requires_grad=True) for s in (1, 2, 3))
    k2, v2 = (rnd(2, 2, 7, 8, seed=s, requires_grad=True) for s in (4, 5))
    bias = rnd(1, 4, 7, 7, seed=6, requires_grad=True)
    fn = lambda q, k, v, b: (F.scaled_dot_product_attention(q, k, v, attn_mask=b)
                             + F.scaled_dot_product_attention(q, k2, v2, is_causal=True, enable_gqa=True))
    out, cap = run(fn, q, k, v, bias, inner="aot_eager")
    assert cap.n_attention == 2
    w = rnd(*out.shape, seed=9)
    grads = torch.autograd.grad((out * w).sum(), (q, k, v, bias, k2, v2))
    ref = fn(q, k, v, bias)
    ref_grads = torch.autograd.grad((ref * w).sum(), (q, k, v, bias, k2, v2))
    assert_same(out, ref, **tolerances(torch.float32))
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-5)


def test_sdpa_dropout_is_applied_whatever_the_training_flag():
    """SDPA drops with dropout_p even under eval (the caller passes 0 there): the rewrite keeps
    dropout_p; the mask differs from eager's RNG, so compare statistics."""
    torch.manual_seed(0)
    q = rnd(4, 4, 64, 16, seed=1)
    v = torch.ones(4, 4, 64, 16)
    fn = lambda q, v: F.scaled_dot_product_attention(q, q, v, dropout_p=0.25)
    out, cap = run(fn, q, v)
    rep = only_report(cap)
    assert rep.rewritten and rep.dropout_p == 0.25
    call = rep.call
    assert call.args[11] == 0.25
    # With V = 1 every output is (kept probability mass) / 0.75: mean 1 and a nonzero spread.
    assert abs(out.mean().item() - 1.0) < 0.02
    assert out.std().item() > 0.05
    eager = fn(q, v)
    assert abs(out.std().item() - eager.std().item()) < 0.25 * eager.std().item()


def test_sdpa_with_repeated_kv_gqa_is_rewritten():
    """Llama's repeat_kv before SDPA: the op reads the un-repeated K/V (native GQA)."""
    q, k, v = rnd(2, 8, 5, 8, seed=1), rnd(2, 2, 5, 8, seed=2), rnd(2, 2, 5, 8, seed=3)

    def fn(q, k, v):
        def rep(x):
            b, h, n, d = x.shape
            return x[:, :, None].expand(b, h, 4, n, d).reshape(b, h * 4, n, d)
        return F.scaled_dot_product_attention(q, rep(k), rep(v), is_causal=True)

    out, cap = run(fn, q, k, v)
    rep = only_report(cap)
    assert rep.rewritten and rep.gqa == "Hq=8/Hkv=2 (repeat_kv removed)", rep.gqa
    assert rep.call.args[1].meta["example_value"].shape[1] == 2  # K as given, not repeated
    assert_same(out, fn(q, k, v), **tolerances(torch.float32))
    assert not any(n.op == "call_method" and n.target in ("expand", "reshape") for n in cap.graphs[0].graph.nodes)


@pytest.mark.parametrize("mask", [None, (4, 5, 5), (1, 5, 5), (5, 5)], ids=["causal", "per-head", "shared", "2d"])
def test_sdpa_enable_gqa_on_3d_inputs_groups_their_leading_dim(mask):
    """3-D inputs [H, N, E] under enable_gqa: SDPA groups dim -3, the heads (4 query heads on 2 key / value heads),
    where without it the leading dim would be a batch; a 3-D mask is per head. Outputs and every gradient."""
    q, k, v = (rnd(h, 5, 8, seed=s).requires_grad_() for h, s in ((4, 1), (2, 2), (2, 3)))
    m = None if mask is None else rnd(*mask, seed=4)
    fn = lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=m is None,
                                                           enable_gqa=True)
    out, cap = run(fn, q, k, v, m, inner="aot_eager")
    rep = only_report(cap)
    assert rep.rewritten and rep.gqa == "Hq=4/Hkv=2 (enable_gqa)", (rep.reason, rep.gqa)
    ref = fn(q, k, v, m)
    assert_same(out, ref, **tolerances(torch.float32))
    w = rnd(*ref.shape, seed=9)
    got = torch.autograd.grad((out * w).sum(), (q, k, v))
    want = torch.autograd.grad((ref * w).sum(), (q, k, v))
    for g, r in zip(got, want):
        torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("shapes", [((1, 4), (2, 1)), ((2, 1), (2, 4)), ((2, 2), (2, 1))],
                         ids=["k-batch-v-heads", "k-heads", "gqa-v-one-head"])
def test_sdpa_with_one_of_k_v_broadcast_over_heads(shapes):
    """K or V with one head beside the other's several: SDPA broadcasts it, the rewrite expands it (a view)."""
    (bk, hk), (bv, hv) = shapes
    q = rnd(2, 4, 5, 8, seed=1).requires_grad_()
    k, v = rnd(bk, hk, 6, 8, seed=2).requires_grad_(), rnd(bv, hv, 6, 8, seed=3).requires_grad_()
    fn = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, enable_gqa=hk == 2)
    out, cap = run(fn, q, k, v, inner="aot_eager")
    rep = only_report(cap)
    assert rep.rewritten, rep.reason
    ref = fn(q, k, v)
    assert_same(out, ref, **tolerances(torch.float32))
    w = rnd(*ref.shape, seed=9)
    for g, r in zip(torch.autograd.grad((out * w).sum(), (q, k, v)), torch.autograd.grad((ref * w).sum(), (q, k, v))):
        torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-5)


def test_sdpa_output_viewed_directly_gets_a_contiguous_copy():
    q = rnd(2, 3, 5, 8, seed=1)
    fn = lambda q: F.scaled_dot_product_attention(q, q, q).view(6, 5, 8)
    out, cap = run(fn, q)
    assert only_report(cap).rewritten
    assert_same(out, fn(q), **tolerances(torch.float32))


@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("n", [8, 200])
def test_sdpa_output_returned_keeps_eagers_strides(grad, n):
    """The caller gets SDPA's contiguous result (the op stores its out BSHD): a `.view` of it after the call, or in
    the next graph after a graph break, works as in eager."""
    q, k, v = (rnd(2, 2, n, 16, seed=s).requires_grad_(grad) for s in (1, 2, 3))
    fn = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)
    with torch.set_grad_enabled(grad):
        out = torch.compile(fn, backend="fa3", fullgraph=True)(q, k, v)
        want = fn(q, k, v)
    assert out.stride() == want.stride()
    assert_same(out.view(2, -1), want.view(2, -1), **tolerances(torch.float32))


def test_sdpa_rewritten_graph_pinned():
    q, k, v = rnd(2, 6, 5, 8, seed=1), rnd(2, 2, 5, 8, seed=2), rnd(2, 2, 5, 8, seed=3)
    m = torch.ones(5, 5, dtype=torch.bool)
    _, cap = run(lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=True, scale=0.25),
                 q, k, v, m)
    expecttest.assert_expected_inline(graph_summary(cap.graphs[0]), """\
fa3.attention(%, %, %, 0.25, False, 0, -1, -1, %, None, 0, 0, None, None)
getitem(%, 0)
.contiguous(%)""")
    _, cap = run(lambda q: F.scaled_dot_product_attention(q, q, q, is_causal=True), rnd(3, 5, 8))
    expecttest.assert_expected_inline(graph_summary(cap.graphs[0]), """\
.unsqueeze(%, 1)
.unsqueeze(%, 1)
.unsqueeze(%, 1)
fa3.attention(%, %, %, 0.353553, True, 0, -1, -1, None, None, 0, 0, None, None)
getitem(%, 0)
.squeeze(%, 1)""")


# SDPA refusals: each reason, and the graph left as it was.


def test_sdpa_refuses_mask_with_is_causal():
    q = rnd(1, 2, 5, 8)
    m = torch.ones(5, 5, dtype=torch.bool).tril()
    fn = lambda q, m: F.scaled_dot_product_attention(q, q, q, attn_mask=m, is_causal=True)
    out, cap = run(fn, q, m)
    rep = only_report(cap)
    assert not rep.rewritten and "depends on the backend" in rep.reason
    assert cap.n_attention == 0
    assert_same(out, fn(q, m))


def test_sdpa_refuses_training_dropout_when_told():
    q = rnd(1, 2, 5, 8)
    fn = lambda q: F.scaled_dot_product_attention(q, q, q, dropout_p=0.1)
    _, cap = run(fn, q, options=PassOptions(allow_training_dropout=False))
    rep = only_report(cap)
    assert not rep.rewritten and "not to rewrite training dropout" in rep.reason
    assert cap.n_attention == 0
    assert any(n.target is F.scaled_dot_product_attention or getattr(n.target, "__name__", "") == "scaled_dot_product_attention"
               for n in cap.graphs[0].graph.nodes)


def test_sdpa_folds_leading_dims_that_no_view_folds_with_a_copy():
    # NesT / Hiera: a fused QKV projection permuted to [3, B, H, T, N, d] and unbound; the 5-D q, k, v fold into
    # a batch axis only by a copy, which `flatten` makes (the gradient goes back through it)
    x = rnd(3, 7, 2, 2, 8, requires_grad=True)

    def fn(x):
        q = x.permute(2, 0, 3, 1, 4)  # [2, 3, 2, 7, 8]: leading dims not mergeable without a copy
        return F.scaled_dot_product_attention(q, q * 0.5, q.flip(-1))

    out, cap = run(fn, x)
    rep = only_report(cap)
    assert rep.rewritten, rep.reason
    want = fn(x)
    assert_same(out, want)
    g = rnd(*out.shape, seed=1)
    assert_same(torch.autograd.grad(out, x, g)[0], torch.autograd.grad(want, x, g)[0])


def test_sdpa_refuses_high_rank_mask_with_high_rank_inputs():
    q = rnd(2, 2, 3, 5, 8)
    m = torch.randn(2, 2, 3, 5, 5)
    fn = lambda q, m: F.scaled_dot_product_attention(q, q, q, attn_mask=m)
    out, cap = run(fn, q, m)
    rep = only_report(cap)
    assert not rep.rewritten and "5-D attn_mask with 5-D inputs" in rep.reason
    assert_same(out, fn(q, m))


def test_sdpa_dynamic_head_dim_gets_a_run_time_scale():
    fn = lambda q: F.scaled_dot_product_attention(q, q, q)
    cap = Capture()
    compiled = torch.compile(fn, backend=cap, fullgraph=True)
    for d in (8, 12):
        x = rnd(1, 2, 5, d, seed=d)
        torch._dynamo.mark_dynamic(x, 3)
        assert_same(compiled(x), fn(x), **tolerances(torch.float32))
    rep = only_report(cap)
    assert rep.rewritten and rep.scale.endswith("(run time)"), rep.scale
    assert cap.compiles == 1


# --------------------------------------------------------------------------- nn.MultiheadAttention


def mha_inputs(batch_first, unbatched=False, lq=5, lk=6, e=16, kdim=None, vdim=None, dtype=torch.float32):
    def shape(n, d):
        if unbatched:
            return (n, d)
        return (2, n, d) if batch_first else (n, 2, d)
    return (rnd(*shape(lq, e), seed=1, dtype=dtype), rnd(*shape(lk, kdim or e), seed=2, dtype=dtype),
            rnd(*shape(lk, vdim or e), seed=3, dtype=dtype))


MHA_CASES = {
    "self_need_weights_false": dict(module=dict(), call=dict(need_weights=False), self_attn=True),
    "self_weights_unused": dict(module=dict(), call=dict(), self_attn=True),
    "cross": dict(module=dict(), call=dict(need_weights=False)),
    "kdim_vdim": dict(module=dict(kdim=12, vdim=10), call=dict(need_weights=False)),
    "bias_kv_zero_attn": dict(module=dict(add_bias_kv=True, add_zero_attn=True), call=dict(need_weights=False)),
    "no_bias": dict(module=dict(bias=False), call=dict()),
    "seq_first": dict(module=dict(batch_first=False), call=dict(need_weights=False)),
    "unbatched": dict(module=dict(), call=dict(need_weights=False), unbatched=True),
    "kpm_bool": dict(module=dict(), call=dict(need_weights=False), kpm="bool"),
    "kpm_and_mask_weights_path": dict(module=dict(), call=dict(), kpm="bool", mask="bool"),
    "float_mask_3d": dict(module=dict(), call=dict(need_weights=False), mask="float3d"),
    "causal": dict(module=dict(), call=dict(need_weights=False, is_causal=True), mask="causal", self_attn=True),
    "causal_with_kpm": dict(module=dict(), call=dict(need_weights=False, is_causal=True), mask="causal_bool",
                            kpm="bool", self_attn=True),
    "causal_weights_path": dict(module=dict(), call=dict(is_causal=True), mask="causal", self_attn=True),
    "bias_kv_masks": dict(module=dict(add_bias_kv=True), call=dict(), kpm="float", mask="float"),
}


def build_mha_case(name, dtype=torch.float32):
    c = MHA_CASES[name]
    mod_kw = dict(c["module"])
    batch_first = mod_kw.pop("batch_first", True)
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(16, 4, batch_first=batch_first, dropout=0.0, **mod_kw).to(dtype)
    unbatched = c.get("unbatched", False)
    q, k, v = mha_inputs(batch_first, unbatched, kdim=mod_kw.get("kdim"), vdim=mod_kw.get("vdim"), dtype=dtype)
    if c.get("self_attn"):
        k = v = q
    lq, lk = 5, (5 if c.get("self_attn") else 6)
    kw = dict(c["call"])
    if c.get("kpm") == "bool":
        kpm = torch.zeros(2, lk, dtype=torch.bool)
        kpm[1, -2:] = True
        kw["key_padding_mask"] = kpm
    elif c.get("kpm") == "float":
        kpm = torch.zeros(2, lk, dtype=dtype)
        kpm[1, -2:] = float("-inf")
        kw["key_padding_mask"] = kpm
    if c.get("mask") == "bool":
        m = torch.rand(lq, lk, generator=torch.Generator().manual_seed(3)) > 0.7
        kw["attn_mask"] = m
    elif c.get("mask") == "float":
        kw["attn_mask"] = rnd(lq, lk, seed=4, dtype=dtype)
    elif c.get("mask") == "float3d":
        kw["attn_mask"] = rnd(2 * 4, lq, lk, seed=4, dtype=dtype)
    elif c.get("mask") == "causal":
        kw["attn_mask"] = nn.Transformer.generate_square_subsequent_mask(lq, dtype=dtype)
    elif c.get("mask") == "causal_bool":
        kw["attn_mask"] = torch.ones(lq, lk, dtype=torch.bool).triu(1)
    def fn(q, k, v):
        return mha(q, k, v, **kw)[0]  # need_weights=True (the default) here: the weights are dropped

    return mha, fn, (q, k, v)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(MHA_CASES))
def test_mha_matches_eager(case, dtype):
    mha, fn, args = build_mha_case(case, dtype)
    mha.eval()
    out, cap = run(fn, *args)
    rep = only_report(cap)
    assert rep.form == "mha" and rep.rewritten, rep.reason
    assert cap.n_attention == 1
    assert_same(out, fn(*args), **tolerances(dtype))


@pytest.mark.parametrize("case", ["self_weights_unused", "kdim_vdim", "bias_kv_zero_attn", "kpm_and_mask_weights_path",
                                  "causal", "float_mask_3d"])
def test_mha_training_gradients_match_eager(case):
    mha, fn, args = build_mha_case(case)
    mha.train()  # dropout=0.0: the comparison is exact
    args = tuple(dict.fromkeys(a.detach().requires_grad_() for a in dict.fromkeys(args)))
    if MHA_CASES[case].get("self_attn"):
        args = (args[0],) * 3
    out, cap = run(fn, *args, inner="aot_eager")
    assert cap.n_attention == 1, cap.reports
    w = rnd(*out.shape, seed=11)
    params = [p for p in mha.parameters()]
    inputs = list(dict.fromkeys(args))
    grads = torch.autograd.grad((out * w).sum(), inputs + params)
    ref = fn(*args)
    ref_grads = torch.autograd.grad((ref * w).sum(), inputs + params)
    assert_same(out, ref, **tolerances(torch.float32))
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("need_weights", [False, True])
def test_mha_causal_mask_built_in_the_graph_becomes_structure(need_weights):
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(16, 4, batch_first=True).eval()
    x = rnd(2, 6, 16, seed=1)

    def fn(x):
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1])  # float 0 / -inf, built in the graph
        return mha(x, x, x, attn_mask=mask, need_weights=need_weights)[0]

    out, cap = run(fn, x)
    rep = only_report(cap)
    assert rep.rewritten and rep.mask == "causal", (rep.mask, rep.reason)
    assert rep.call.args[4] is True and rep.call.args[8] is None
    assert_same(out, fn(x), **tolerances(torch.float32))


def test_mha_fully_masked_rows_keep_eager_values():
    """need_weights=True: softmax of an all -inf row is NaN; need_weights=False (SDPA): 0."""
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(16, 4, batch_first=True).eval()
    x = rnd(2, 5, 16, seed=1)
    kpm = torch.zeros(2, 5, dtype=torch.bool)
    kpm[1] = True  # batch 1 has no key at all
    for need_weights in (True, False):
        torch._dynamo.reset()
        fn = lambda x, kpm: mha(x, x, x, key_padding_mask=kpm, need_weights=need_weights)[0]
        out, cap = run(fn, x, kpm)
        assert only_report(cap).rewritten
        ref = fn(x, kpm)
        assert ref[1].isnan().all() == need_weights
        assert_same(out, ref, **tolerances(torch.float32))


@pytest.mark.parametrize("need_weights", [False, True])
def test_mha_key_padding_mask_reaches_the_op_as_a_data_mask(need_weights):
    """nn.MultiheadAttention turns its bool key_padding_mask into a 0 / -inf float (F._canonical_mask) before the
    functional, which views it [B, 1, 1, S]: that float is proven 0-or-(-inf) and reaches the op as a keep-mask
    (bool-mask), not a float bias. Outputs and gradients as eager's, one sequence with no key at all."""
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(16, 4, batch_first=True).train()  # dropout 0: exact
    x = rnd(3, 6, 16, seed=1, requires_grad=True)
    kpm = torch.zeros(3, 6, dtype=torch.bool)
    kpm[0, 4:] = True
    kpm[2] = need_weights  # need_weights=True: NaN rows (eager's); SDPA's path: 0 rows (gradients differ there)
    fn = lambda x, kpm: mha(x, x, x, key_padding_mask=kpm, need_weights=need_weights)[0]
    out, cap = run(fn, x, kpm, inner="aot_eager")
    rep = only_report(cap)
    assert rep.rewritten and rep.mask == "bool-mask", (rep.mask, rep.reason)
    ref = fn(x, kpm)
    assert_same(out, ref, **tolerances(torch.float32))
    if not need_weights:
        w = rnd(*out.shape, seed=11)
        params = list(mha.parameters())
        grads = torch.autograd.grad((out * w).sum(), [x] + params)
        ref_grads = torch.autograd.grad((ref * w).sum(), [x] + params)
        for g, r in zip(grads, ref_grads):
            torch.testing.assert_close(g, r, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("fill", [float("-inf"), "finfo_min", -1e4])
def test_float_key_mask_viewed_after_it_is_built(fill):
    """A 0-or-c float key mask built from a bool and only then viewed [B, 1, 1, Nk]: a keep-mask where c absorbs
    every score (-inf, finfo.min); a finite c stays the float bias (eager's arithmetic, README)."""
    q, k, v = (rnd(2, 2, 5, 8, seed=s) for s in (1, 2, 3))
    pad = torch.zeros(2, 5, dtype=torch.bool)
    pad[1, 3:] = True
    c = torch.finfo(torch.float32).min if fill == "finfo_min" else fill

    def fn(q, k, v, pad):
        m = torch.zeros_like(pad, dtype=torch.float32).masked_fill_(pad, c)
        s = q @ k.transpose(-1, -2) * 0.3 + m.unsqueeze(1).unsqueeze(1)
        return s.softmax(-1) @ v

    out, cap = run(fn, q, k, v, pad)
    rep = only_report(cap)
    assert rep.rewritten and rep.mask == ("bias" if fill == -1e4 else "bool-mask"), (rep.mask, rep.reason)
    assert_same(out, fn(q, k, v, pad), **tolerances(torch.float32))


def test_mha_training_dropout_statistics():
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(32, 4, batch_first=True, dropout=0.3).train()
    x = rnd(8, 32, 32, seed=1)
    fn = lambda x: mha(x, x, x, need_weights=False)[0]
    out, cap = run(fn, x)
    rep = only_report(cap)
    assert rep.rewritten and rep.dropout_p == pytest.approx(0.3)
    mha.eval()
    no_drop = fn(x)
    mha.train()
    # Inverted dropout keeps the expectation: the mean over many elements matches the no-dropout output.
    refs = torch.stack([fn(x) for _ in range(4)])
    assert abs(out.mean().item() - no_drop.mean().item()) < 0.05
    assert abs(out.std().item() - refs.std(dim=(1, 2, 3)).mean().item()) < 0.15 * refs.std().item()


def test_mha_rewritten_graph_pinned():
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(16, 4, batch_first=True).eval()
    x = rnd(2, 5, 16)
    kpm = torch.zeros(2, 5, dtype=torch.bool)
    _, cap = run(lambda x, kpm: mha(x, x, x, key_padding_mask=kpm, need_weights=False)[0], x, kpm)
    expecttest.assert_expected_inline(graph_summary(cap.graphs[0]), """\
zeros_like(%, dtype=float32)
.masked_fill(%, %, -inf)
.transpose(%, 1, 0)
linear(%, %, %)
narrow(%, -1, 0, 16)
narrow(%, -1, 16, 16)
narrow(%, -1, 32, 16)
.unsqueeze(%, 1)
.unsqueeze(%, 1)
.unflatten(%, -1, (4, 4))
.permute(%, 1, 2, 0, 3)
.unflatten(%, -1, (4, 4))
.permute(%, 1, 2, 0, 3)
.unflatten(%, -1, (4, 4))
.permute(%, 1, 2, 0, 3)
eq(%, 0)
fa3.attention(%, %, %, 0.5, False, 0, -1, -1, %, None, 0, 0, None, None)
getitem(%, 0)
.permute(%, 2, 0, 1, 3)
.flatten(%, 2)
linear(%, %, %)
.transpose(%, 1, 0)""")


# MultiheadAttention refusals.


def test_mha_refuses_when_weights_are_used():
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(16, 4, batch_first=True).eval()
    x = rnd(2, 5, 16)
    fn = lambda x: mha(x, x, x)
    (out, weights), cap = run(fn, x)
    rep = only_report(cap)
    assert not rep.rewritten and "need_weights=True and the returned attention weights are used" in rep.reason
    assert cap.n_attention == 0
    ref_out, ref_w = fn(x)
    assert_same(out, ref_out)
    assert_same(weights, ref_w)


def test_mha_refuses_static_kv():
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(16, 4)
    x = rnd(5, 2, 16)
    static = rnd(8, 6, 4, seed=2)

    def fn(x, s):
        return F.multi_head_attention_forward(
            x, x, x, 16, 4, mha.in_proj_weight, mha.in_proj_bias, None, None, False, 0.0, mha.out_proj.weight,
            mha.out_proj.bias, training=False, need_weights=False, static_k=s, static_v=s)[0]

    out, cap = run(fn, x, static)
    rep = only_report(cap)
    assert not rep.rewritten and "static_k is given" in rep.reason
    assert_same(out, fn(x, static))


# --------------------------------------------------------------- native MHA and the encoder layer


def test_native_mha_matches_eager():
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(16, 4, batch_first=True).eval()
    x = rnd(2, 5, 16, seed=1)
    kpm = torch.zeros(2, 5, dtype=torch.bool)
    kpm[0, 3:] = True

    def fn(x, kpm):
        return torch._native_multi_head_attention(
            x, x, x, 16, 4, mha.in_proj_weight, mha.in_proj_bias, mha.out_proj.weight, mha.out_proj.bias,
            kpm, False, True, 1)[0]

    with torch.no_grad():
        out, cap = run(fn, x, kpm)
        rep = only_report(cap)
        assert rep.form == "native-mha" and rep.rewritten, rep.reason
        assert_same(out, fn(x, kpm), **tolerances(torch.float32))


ENCODER_CASES = {
    "post_norm_relu": dict(norm_first=False, activation="relu"),
    "pre_norm_gelu": dict(norm_first=True, activation="gelu"),
}


def encoder_masks(kind, n=6):
    g = torch.Generator().manual_seed(5)
    kw = {}
    if kind in ("kpm", "both"):
        kpm = torch.zeros(2, n, dtype=torch.bool)
        kpm[1, -3:] = True
        kw["src_key_padding_mask"] = kpm
    if kind in ("mask", "both"):
        m = torch.rand(n, n, generator=g) > 0.7
        m.fill_diagonal_(False)
        kw["src_mask"] = m
    if kind == "causal":
        kw["src_mask"] = nn.Transformer.generate_square_subsequent_mask(n)
        kw["is_causal"] = True
    if kind == "empty_rows":
        m = torch.zeros(n, n, dtype=torch.bool)
        m[2] = True  # query 2 sees no key: the fast path gives NaN there
        kw["src_mask"] = m
    return kw


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("masks", ["none", "kpm", "mask", "both", "causal", "empty_rows"])
@pytest.mark.parametrize("case", list(ENCODER_CASES))
def test_encoder_layer_fast_path_matches_eager(case, masks, dtype):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 4, 32, batch_first=True, **ENCODER_CASES[case]).to(dtype).eval()
    x = rnd(2, 6, 16, seed=1, dtype=dtype)
    kw = encoder_masks(masks)
    fn = lambda x: layer(x, **kw)
    with torch.no_grad():
        out, cap = run(fn, x)
        rep = only_report(cap)
        assert rep.form == "encoder-layer" and rep.rewritten, rep.reason
        assert cap.n_attention == 1
        ref = fn(x)
    if masks == "empty_rows":
        assert ref[:, 2].isnan().all()
    assert_same(out, ref, **tolerances(dtype))


def test_encoder_layer_causal_mask_built_in_the_graph_becomes_structure():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 4, 32, batch_first=True).eval()
    x = rnd(2, 6, 16, seed=1)
    fn = lambda x: layer(x, src_mask=nn.Transformer.generate_square_subsequent_mask(x.shape[1]), is_causal=True)
    with torch.no_grad():
        out, cap = run(fn, x)
        rep = only_report(cap)
        assert rep.rewritten and rep.mask == "causal", (rep.mask, rep.reason)
        assert rep.call.args[4] is True and rep.call.args[8] is None
        assert_same(out, fn(x), **tolerances(torch.float32))


def test_encoder_layer_fast_path_float_mask_is_read_as_bool_like_eager():
    """The fast path converts a float mask to bool (nonzero = masked), unlike the training path."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 4, 32, batch_first=True).eval()
    x = rnd(2, 6, 16, seed=1)
    m = torch.zeros(6, 6)
    m[:, 3] = -2.5  # a finite additive bias, masked out entirely by the fast path
    fn = lambda x: layer(x, src_mask=m)
    with torch.no_grad():
        out, cap = run(fn, x)
        assert only_report(cap).rewritten
        assert_same(out, fn(x), **tolerances(torch.float32))


@pytest.mark.parametrize("norm_first", [False, True])
def test_encoder_layer_training_goes_through_mha_with_gradients(norm_first):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 4, 32, batch_first=True, dropout=0.0, norm_first=norm_first).train()
    x = rnd(2, 6, 16, seed=1, requires_grad=True)
    kpm = torch.zeros(2, 6, dtype=torch.bool)
    kpm[0, -2:] = True
    fn = lambda x: layer(x, src_key_padding_mask=kpm)
    out, cap = run(fn, x, inner="aot_eager")
    rep = only_report(cap)
    assert rep.form == "mha" and rep.rewritten, rep.reason
    params = list(layer.parameters())
    w = rnd(*out.shape, seed=3)
    grads = torch.autograd.grad((out * w).sum(), [x] + params)
    ref = fn(x)
    ref_grads = torch.autograd.grad((ref * w).sum(), [x] + params)
    assert_same(out, ref, **tolerances(torch.float32))
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, atol=3e-5, rtol=3e-5)


def test_transformer_encoder_stack_in_eval():
    torch.manual_seed(0)
    enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 4, 32, batch_first=True), 2,
                                enable_nested_tensor=False).eval()
    x = rnd(2, 6, 16, seed=1)
    with torch.no_grad():
        out, cap = run(enc, x)
        assert [r.rewritten for r in cap.reports] == [True, True]
        assert_same(out, enc(x), **tolerances(torch.float32))


def test_transformer_encoder_nested_tensor_path_with_padding():
    """Eager (no_grad) converts the padded batch to a nested tensor and returns 0 at padded positions;
    Dynamo's graph (with or without our pass) runs the dense fast path with the padding mask instead.
    The rewrite matches the dense semantics everywhere and eager's at every real position."""
    torch.manual_seed(0)
    enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 4, 32, batch_first=True), 2).eval()
    dense = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 4, 32, batch_first=True), 2,
                                  enable_nested_tensor=False).eval()
    dense.load_state_dict(enc.state_dict())
    x = rnd(2, 6, 16, seed=1)
    kpm = torch.zeros(2, 6, dtype=torch.bool)
    kpm[1, 4:] = True
    with torch.no_grad():
        out, cap = run(lambda x, m: enc(x, src_key_padding_mask=m), x, kpm)
        assert [r.rewritten for r in cap.reports] == [True, True]
        assert_same(out, dense(x, src_key_padding_mask=kpm), **tolerances(torch.float32))
        ref = enc(x, src_key_padding_mask=kpm)
    real = ~kpm
    assert_same(out[real], ref[real], **tolerances(torch.float32))


def test_encoder_layer_rewritten_graph_pinned():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 4, 32, batch_first=True, activation="gelu").eval()
    x = rnd(2, 6, 16, seed=1)
    with torch.no_grad():
        _, cap = run(lambda x: layer(x), x)
    expecttest.assert_expected_inline(graph_summary(cap.graphs[0]), """\
linear(%, %, %)
narrow(%, -1, 0, 16)
narrow(%, -1, 16, 16)
narrow(%, -1, 32, 16)
.unflatten(%, -1, (4, 4))
.permute(%, 0, 2, 1, 3)
.unflatten(%, -1, (4, 4))
.permute(%, 0, 2, 1, 3)
.unflatten(%, -1, (4, 4))
.permute(%, 0, 2, 1, 3)
fa3.attention(%, %, %, 0.5, False, 0, -1, -1, None, None, 0, 0, None, None)
getitem(%, 0)
.transpose(%, 1, 2)
.flatten(%, 2)
linear(%, %, %)
add(%, %)
layer_norm(%, (16,), %, %, 1e-05)
.flatten(%, 0, 1)
.t(%)
_addmm_activation(%, %, %, use_gelu=True)
.t(%)
addmm(%, %, %)
.view_as(%, %)
add(%, %)
layer_norm(%, (16,), %, %, 1e-05)""")


def test_encoder_layer_refuses_empty_input():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 4, 32, batch_first=True).eval()
    x = torch.randn(2, 0, 16)
    with torch.no_grad():
        fn = lambda x: layer(x)
        out, cap = run(fn, x)
        reasons = [r.reason for r in cap.reports]
        assert reasons == ["src is empty (the fused op returns a copy of it)"]
        assert out.shape == (2, 0, 16)


def test_decompositions_compile_with_inductor():
    """The glue (narrow, unflatten, _addmm_activation, ...) and the op go through Inductor on CPU."""
    import fa_compile
    from torch._dynamo.utils import counters

    be = fa_compile.backend(inner="inductor")
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 4, 32, batch_first=True, activation="gelu", norm_first=True).eval()
    x = rnd(2, 6, 16, seed=1)
    kpm = torch.zeros(2, 6, dtype=torch.bool)
    kpm[1, 4:] = True
    counters.clear()
    with torch.no_grad():
        out = torch.compile(layer, backend=be)(x, src_key_padding_mask=kpm)
        assert_same(out, layer(x, src_key_padding_mask=kpm), **tolerances(torch.float32))
    mha = nn.MultiheadAttention(16, 4, batch_first=True, add_bias_kv=True).train()
    xg = x.clone().requires_grad_()
    fn = lambda x: mha(x, x, x, key_padding_mask=kpm)[0]
    out = torch.compile(fn, backend=be)(xg)
    (g,) = torch.autograd.grad(out.sum(), xg)
    ref = fn(xg)
    (rg,) = torch.autograd.grad(ref.sum(), xg)
    assert_same(out, ref, **tolerances(torch.float32))
    torch.testing.assert_close(g, rg, atol=2e-5, rtol=2e-5)
    assert counters["fa_compile"]["sites_rewritten"] == 2 and counters["fa_compile"]["sites_missed"] == 0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_sdpa_with_a_finfo_min_mask_built_in_the_graph(dtype):
    # A key-padding mask built in the graph with the dtype's finfo.min, one sequence fully padded: SDPA adds it to
    # fp32 scores, where fp16's -65504 absorbs nothing (such a row is softmax(s) @ v) and bf16's does (uniform).
    keep = torch.ones(2, 1, 1, 5, dtype=torch.bool)
    keep[1] = False
    keep[0, ..., 3:] = False
    q, k, v = rnd(2, 3, 6, 8, dtype=dtype, seed=1), rnd(2, 3, 5, 8, dtype=dtype, seed=2), rnd(2, 3, 5, 8, dtype=dtype, seed=3)

    def fn(q, k, v, keep):
        m = torch.where(keep, 0.0, torch.finfo(q.dtype).min).to(q.dtype)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m)

    out, cap = run(fn, q, k, v, keep)
    assert only_report(cap).rewritten
    assert_same(out, fn(q, k, v, keep), **tolerances(dtype))
