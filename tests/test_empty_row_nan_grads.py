"""Rows with no admissible key under -inf masks: NaN in eager and in the rewritten site, and the same NaN gradients.

Eager's NaN softmax row makes the gradient of every value of its head NaN through P @ V, also where the loss does not
read the row; an additive -inf mask passes the NaN row on to the scores (the row's query, every key of the head),
where a fill (masked_fill / where) cuts it. The rewrite puts these back (fa3::nan_row_grad, patterns/emit.py); a site
that mixes both kinds of -inf mask is left alone while q or k need a gradient.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fa_compile

TOL = dict(atol=2e-5, rtol=2e-5)
BACKENDS = {"inductor": "inductor", "aot_eager": "aot_eager"}


def _fill_bottom_right(q, k, v):  # Nq > Nk: the first Nq - Nk rows admit no key
    nq, nk = q.shape[-2], k.shape[-2]
    s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    s = s.masked_fill(torch.ones(nq, nk, dtype=torch.bool, device=q.device).triu(nk - nq + 1), float("-inf"))
    return s.softmax(-1) @ v


def _fill_padding(q, k, v, keep):  # keep [B, Nk] bool; a sequence with no kept key has only empty rows
    s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    return s.masked_fill(~keep[:, None, None, :], float("-inf")).softmax(-1) @ v


def _fill_padding_gqa(q, k, v, keep):
    rep = q.shape[1] // k.shape[1]
    return _fill_padding(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), keep)


def _additive_input(q, k, v, mask):  # mask [B, 1, 1, Nk] float, 0 or -inf, from the caller
    return F.softmax(q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5 + mask, dim=-1) @ v


def _additive_built(q, k, v, keep):
    mask = torch.zeros(keep.shape, dtype=q.dtype, device=q.device).masked_fill(~keep, float("-inf"))
    return F.softmax(q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5 + mask[:, None, None, :], dim=-1) @ v


def _additive_log(q, k, v, keep):  # log(1) = 0, log(0) = -inf: an additive -inf mask spelled as a log
    return F.softmax(q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5 + keep[:, None, None, :].float().log(), dim=-1) @ v


def _additive_written(q, k, v):  # a zeros mask whose sequence 0 is padded by an in-place write: additive -inf
    mask = torch.zeros(q.shape[0], 1, 1, k.shape[-2], device=q.device)
    mask[0] = float("-inf")
    return F.softmax(q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5 + mask, dim=-1) @ v


def _mixed(q, k, v, mask):  # a causal fill and an additive padding mask: both may set a score to -inf
    n = q.shape[-2]
    s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5 + mask
    s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return F.softmax(s, dim=-1) @ v


def _keep(b=2, n=6):
    keep = torch.ones(b, n, dtype=torch.bool)
    keep[0] = False  # sequence 0: every key padded
    keep[1, -2:] = False
    return keep


def _inputs(fn, gen):
    if fn is _fill_bottom_right:
        return [torch.randn(2, 2, n, 8, generator=gen) for n in (5, 3, 3)], []
    if fn is _additive_written:
        return [torch.randn(2, 2, 6, 8, generator=gen) for _ in range(3)], []
    if fn is _fill_padding_gqa:
        return [torch.randn(2, h, 6, 8, generator=gen) for h in (4, 2, 2)], [_keep()]
    qkv = [torch.randn(2, 2, 6, 8, generator=gen) for _ in range(3)]
    keep = _keep()
    if fn in (_additive_input, _mixed):
        return qkv, [torch.zeros(2, 1, 1, 6).masked_fill(~keep[:, None, None, :], float("-inf"))]
    return qkv, [keep]


def _run(fn, qkv, extra, grads, w):
    leaves = [t.clone().requires_grad_(name in grads) for name, t in zip("qkv", qkv)]
    out = fn(*leaves, *extra)
    # the loss reads no NaN row: eager's NaN gradients come from the rows' P alone (0 * NaN)
    (torch.where(out.isnan(), 0.0, out) * w).sum().backward()
    return out.detach(), [t.grad for t in leaves if t.requires_grad]


def _assert_same(got, want, what):
    assert torch.equal(got.isnan(), want.isnan()), f"{what}: NaN at {got.isnan().sum()} elements, eager {want.isnan().sum()}"
    torch.testing.assert_close(got, want, equal_nan=True, **TOL, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("inner", BACKENDS)
@pytest.mark.parametrize("grads", ["qkv", "v", "qk"])
@pytest.mark.parametrize("fn", [_fill_bottom_right, _fill_padding, _fill_padding_gqa, _additive_input, _additive_built,
                                _additive_log, _additive_written],
                         ids=lambda f: f.__name__.strip("_"))
def test_nan_rows_give_eagers_gradients(fn, grads, inner):
    gen = torch.Generator().manual_seed(0)
    qkv, extra = _inputs(fn, gen)
    want_out = fn(*qkv, *extra)
    assert want_out.isnan().any()  # the case has empty rows
    w = torch.randn(want_out.shape, generator=gen)
    torch._dynamo.reset()
    before = torch._dynamo.utils.counters["fa_compile"]["sites_rewritten"]
    got = _run(torch.compile(fn, backend=fa_compile.backend(BACKENDS[inner]), dynamic=False), qkv, extra, grads, w)
    assert torch._dynamo.utils.counters["fa_compile"]["sites_rewritten"] == before + 1
    want = _run(fn, qkv, extra, grads, w)
    _assert_same(got[0], want[0], "out")
    assert len(got[1]) == len(want[1]) == len(grads)
    for name, g, e in zip(grads, got[1], want[1]):
        _assert_same(g, e, f"d{name}")
        if "v" == name:
            assert e.isnan().any()  # the case exercises the NaN gradient of V


def test_multihead_attention_with_weights_passes_the_nan_on_to_its_projections():
    # need_weights=True: the functional adds the key padding mask as a float -inf mask (baddbmm), bool or not
    torch.manual_seed(0)
    m = nn.MultiheadAttention(8, 2, batch_first=True)
    x = torch.randn(2, 4, 8)
    kpm = torch.zeros(2, 4, dtype=torch.bool)
    kpm[0] = True

    def attend(a):
        return m(a, a, a, key_padding_mask=kpm)[0]  # the weights unused (returned, they would keep the site)

    def run(fn):
        xi = x.clone().requires_grad_()
        out = fn(xi)
        out[1].sum().backward()
        return [out.detach(), xi.grad, *(p.grad for p in m.parameters())]

    torch._dynamo.reset()
    compiled = torch.compile(attend, backend="fa3")
    before = torch._dynamo.utils.counters["fa_compile"]["sites_rewritten"]
    got = run(compiled)
    assert torch._dynamo.utils.counters["fa_compile"]["sites_rewritten"] == before + 1
    for p in m.parameters():
        p.grad = None
    want = run(attend)
    assert want[1].isnan().any() and want[2].isnan().all()  # eager: the in-projection's gradient is all NaN
    for i, (g, e) in enumerate(zip(got, want)):
        _assert_same(g, e, f"tensor {i}")


def test_mixed_fill_and_additive_inf_masks_keep_eagers_nan_gradient_of_v():
    # which scores a fill cut is not known to the op: V's NaN gradient is kept, q's and k's are the README's
    # known difference (finite where eager's are NaN), equal to eager's elsewhere
    gen = torch.Generator().manual_seed(0)
    qkv, extra = _inputs(_mixed, gen)
    w = torch.randn(2, 2, 6, 8, generator=gen)
    torch._dynamo.reset()
    got = _run(torch.compile(_mixed, backend="fa3", dynamic=False), qkv, extra, "qkv", w)
    want = _run(_mixed, qkv, extra, "qkv", w)
    _assert_same(got[0], want[0], "out")
    _assert_same(got[1][2], want[1][2], "dv")
    for g, e in zip(got[1][:2], want[1][:2]):
        keep = e.isfinite()
        assert g.isfinite().all() and not keep.all()
        torch.testing.assert_close(g[keep], e[keep], **TOL)


@pytest.mark.parametrize("where", ["after_fill", "before_fill", "additive", "only_the_bias"])
def test_a_learned_bias_beside_empty_rows(where):
    # eager's NaN row reaches a bias added after every -inf fill and is cut where a fill comes later: the op's one bias
    # does not keep the order, so the bias's gradient on those rows is the op's (finite; README, the known difference);
    # q's, k's and v's are eager's, and the bias's is eager's wherever eager's is finite
    gen = torch.Generator().manual_seed(0)
    (q, k, v), (keep,) = _inputs(_fill_padding, gen)
    rel = torch.randn(2, 6, 6, generator=gen)  # [H, Nq, Nk], broadcast over the batch
    pad = ~keep[:, None, None, :]
    mask = torch.zeros(pad.shape).masked_fill(pad, float("-inf"))

    def fn(q, k, v, rel):
        s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
        if where == "after_fill":
            s = s.masked_fill(pad, float("-inf")) + rel
        elif where == "before_fill":
            s = (s + rel).masked_fill(pad, float("-inf"))
        else:
            s = s + rel + mask
        return F.softmax(s, dim=-1) @ v

    w = torch.randn(2, 2, 6, 8, generator=gen)
    grads = (False, False, False, True) if where == "only_the_bias" else (True,) * 4

    def run(f):
        leaves = [t.clone().requires_grad_(g) for t, g in zip((q, k, v, rel), grads)]
        out = f(*leaves)
        (torch.where(out.isnan(), 0.0, out) * w).sum().backward()
        return [out.detach()] + [t.grad for t in leaves if t.requires_grad]

    torch._dynamo.reset()
    before = torch._dynamo.utils.counters["fa_compile"]["sites_rewritten"]
    got = run(torch.compile(fn, backend="fa3", dynamic=False))
    assert torch._dynamo.utils.counters["fa_compile"]["sites_rewritten"] == before + 1
    want = run(fn)
    for i, (g, e) in enumerate(zip(got[:-1], want[:-1])):
        _assert_same(g, e, f"tensor {i}")
    g, e = got[-1], want[-1]
    keep_e = e.isfinite()
    assert g.isfinite().all()
    torch.testing.assert_close(g[keep_e], e[keep_e], **TOL)


def test_the_zero_valued_op_is_gone_from_the_compiled_forward():
    # after AOTAutograd the op's value is a constant 0 (its backward is graph arithmetic): no run-time call
    from fa_compile.lowering import capture_graphs

    gen = torch.Generator().manual_seed(0)
    qkv, extra = _inputs(_fill_padding, gen)
    leaves = [t.clone().requires_grad_() for t in qkv]
    torch._dynamo.reset()
    with torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False), capture_graphs() as graphs:
        torch.compile(_fill_padding, backend="fa3", dynamic=False)(*leaves, *extra).nansum().backward()
    assert graphs and not any("nan_row_grad" in code for code in graphs), graphs
    assert "fa3.nan_row_grad" in str(fa_compile.explain(_fill_padding, *leaves, *extra))  # the site carries it
