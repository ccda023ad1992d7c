"""The NaN / inf / overflow promise (README, "Numerics: NaN, inf and overflow"), that of SDPA's fused
kernels: rows whose admissible keys and values are finite are exact; a NaN or inf in an admissible
key or value reaches exactly the rows that attend to it (as in eager); a NaN in a key that a row's
mask excludes does not reach that row (eager's `NaN + (-inf)` poisons every row); a NaN in an
excluded value leaves each row either NaN or exact; scores are accumulated in fp32, so fp16
products that overflow in eager's fp16 arithmetic give finite, accurate results here."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import fa_compile.ops  # noqa: F401  (registers torch.ops.fa3)
from conftest import TOL, Compiled
from fa_compile.kernels import reference as ref

B, H, N, D = 2, 2, 8, 16
J = 5  # the poisoned key / value position
NAN, INF = float("nan"), float("inf")


def qkv(dtype=torch.float32, seed=0, n=N, d=D, scale_by=1.0):
    g = torch.Generator().manual_seed(seed)
    return tuple((torch.randn(B, H, n, d, generator=g) * scale_by).to(dtype) for _ in range(3))


def poisoned(t, value=NAN, pos=J):
    t = t.clone()
    t[:, :, pos] = value
    return t


def nan_rows(out):
    """[B, H, N] bool: rows with a NaN (a poisoned row must be NaN in every column)."""
    rows = out.isnan().any(-1)
    assert torch.equal(rows, out.isnan().all(-1)), "a row is partly NaN"
    return rows


# Structures, each with the rows that admit key J ([N] bool, all batches and heads alike).
_i = torch.arange(N)
STRUCTURES = {
    "causal": (dict(causal=True), _i >= J),
    "window": (dict(window_left=1, window_right=1), (J - _i).abs() <= 1),
    "bool_bias": (dict(bias=(_i.view(N, 1) % 3 != 0) | (torch.arange(N).view(1, N) != J)), _i % 3 != 0),
    "none": ({}, torch.ones(N, dtype=torch.bool)),
}


def op(q, k, v, scale=0.25, **kw):
    return torch.ops.fa3.attention(q, k, v, scale, **kw)[0]


@pytest.mark.parametrize("structure", list(STRUCTURES))
def test_nan_key_reaches_exactly_the_rows_that_attend_to_it(structure):
    kw, attends = STRUCTURES[structure]
    q, k, v = qkv()
    out = op(q, poisoned(k), v, **kw)
    assert torch.equal(nan_rows(out), attends.expand(B, H, N))
    clean = op(q, poisoned(k, 0.0), v, **kw)  # the key's value does not matter to rows that exclude it
    torch.testing.assert_close(out[..., ~attends, :], clean[..., ~attends, :], atol=0, rtol=0)


def test_nan_key_beyond_kv_lens_reaches_no_row():
    q, k, v = qkv()
    lens = torch.tensor([J, N])  # batch 0 excludes key J, batch 1 admits it
    out = op(q, poisoned(k), v, kv_lens=lens)
    assert not nan_rows(out)[0].any() and nan_rows(out)[1].all()
    torch.testing.assert_close(out[0], op(q, k, v, kv_lens=lens)[0], atol=0, rtol=0)


@pytest.mark.parametrize("value", [NAN, INF, -INF], ids=["nan", "inf", "-inf"])
def test_nan_or_inf_in_a_query_poisons_that_row_as_in_eager(value):
    q, k, v = qkv()
    qp = poisoned(q, value, pos=2)
    out = op(qp, k, v, causal=True)
    # Eager's softmax, SDPA's math backend: its CPU flash kernel takes a row's max over finite scores only
    # with some vector instruction sets (AVX512: that row comes out 0), so it is not the oracle here.
    with sdpa_kernel(SDPBackend.MATH):
        exp = F.scaled_dot_product_attention(qp, k, v, is_causal=True, scale=0.25)
    rows = nan_rows(out)
    assert rows[:, :, 2].all() and rows.sum() == B * H
    torch.testing.assert_close(out, exp, equal_nan=True, **TOL[torch.float32])


@pytest.mark.parametrize("value", [NAN, INF], ids=["nan", "inf"])
def test_value_admissible_poisons_the_attending_rows_excluded_leaves_rows_nan_or_exact(value):
    q, k, v = qkv()
    out = op(q, k, poisoned(v, value), causal=True)
    rows = nan_rows(out) | out.isinf().any(-1)
    assert rows[..., J:].all()  # every row that attends to v_J
    clean = op(q, k, poisoned(v, 0.0), causal=True)
    before = out[..., :J, :]
    exact = (before == clean[..., :J, :]).all(-1)
    assert (exact | before.isnan().all(-1)).all()  # a masked value: NaN (as eager) or exact


def test_gradients_nan_on_attending_rows_and_elsewhere_nan_or_exact():
    q, k, v = qkv(torch.float64)
    q.requires_grad_()
    kp = poisoned(k).requires_grad_()
    out = op(q, kp, v, causal=True)
    dout = torch.randn_like(out)
    (dq,) = torch.autograd.grad(out, q, dout)
    assert dq[..., J:, :].isnan().all()
    q2 = q.detach().requires_grad_()
    (dq_clean,) = torch.autograd.grad(op(q2, poisoned(k, 0.0), v, causal=True), q2, dout)
    earlier = dq[..., :J, :]
    close = torch.isclose(earlier, dq_clean[..., :J, :], atol=1e-12, rtol=1e-10).all(-1)
    assert (close | earlier.isnan().all(-1)).all()


# ------------------------------------------------------------------------------------- compiled sites

def additive_causal(q, k, v):
    n = q.shape[-2]
    mask = torch.full((n, n), float("-inf"), dtype=q.dtype, device=q.device).triu(1)
    return torch.softmax(q @ k.transpose(-2, -1) * 0.25 + mask, dim=-1) @ v


def finfo_min_causal(q, k, v):
    n = q.shape[-2]
    mask = torch.full((n, n), torch.finfo(q.dtype).min, dtype=q.dtype, device=q.device).triu(1)
    return torch.softmax(q @ k.transpose(-2, -1) * 0.25 + mask, dim=-1) @ v


def filled_causal(q, k, v):
    n = q.shape[-2]
    keep = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    return torch.softmax((q @ k.transpose(-2, -1) * 0.25).masked_fill(~keep, float("-inf")), dim=-1) @ v


def sdpa_causal(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.25)


@pytest.mark.parametrize("fn", [additive_causal, finfo_min_causal, filled_causal, sdpa_causal],
                         ids=lambda f: f.__name__)
def test_compiled_nan_in_a_future_key_reaches_only_the_rows_that_see_it(fn):
    """Eager's additive masks compute NaN + (-inf) = NaN and poison every row; the rewrite keeps the
    mask structural, so rows before the NaN key are exactly eager's values on a finite key."""
    q, k, v = qkv()
    c = Compiled(fn, inner="aot_eager")
    out = c(q, poisoned(k), v)
    assert len(c.rewritten) == 1, [r.reason for r in c.missed]
    rows = nan_rows(out)
    assert rows[..., J:].all() and not rows[..., :J].any()
    exp = fn(q, poisoned(k, 0.0), v)
    torch.testing.assert_close(out[..., :J, :], exp[..., :J, :], **TOL[torch.float32])
    if fn in (filled_causal, sdpa_causal):  # eager's -inf fill replaces the NaN score: the same rows
        torch.testing.assert_close(out, fn(q, poisoned(k), v), equal_nan=True, **TOL[torch.float32])


def _padded_fill(fill: float):
    def fn(q, k, v, pad):
        s = q @ k.transpose(-2, -1) * 0.25
        return torch.softmax(s.masked_fill(pad[:, None, None, :], fill), dim=-1) @ v

    return fn


@pytest.mark.parametrize("fill", [-INF, torch.finfo(torch.float32).min], ids=["neg_inf", "finfo_min"])
def test_compiled_nan_in_a_padded_key_gradients_equal_eagers(fill):
    """A NaN in a key that a data key-padding mask excludes: eager's dK and dV there are 0 and its dQ carries the NaN
    (dS · K with dS = 0); the CPU kernel's backward, which adds the mask, recomputed NaN + (-inf) = NaN for them.
    finfo_min also empties a whole sequence (eager's uniform rows), which runs the op with the empty-row fix-up."""
    import fa_compile

    fn = _padded_fill(fill)
    q, k, v = qkv()
    k = poisoned(k)
    pad = torch.zeros(B, N, dtype=torch.bool)
    pad[0, J:] = True  # key J of sequence 0 is padding
    if fill != -INF:
        pad[1] = True  # every key of sequence 1: rows without an admissible key
    args = [t.clone().requires_grad_() for t in (q, k, v)]
    want = fn(*args, pad)
    g = torch.randn(want.shape, generator=torch.Generator().manual_seed(3))
    want_grads = torch.autograd.grad(want, args, g)
    torch._dynamo.reset()
    args2 = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    got = torch.compile(fn, backend="fa3")(*args2, pad)
    assert len(fa_compile.explain(fn, *args2, pad).rewritten) == 1
    got_grads = torch.autograd.grad(got, args2, g)
    for name, a, b in zip(("out", "dq", "dk", "dv"), (got, *got_grads), (want, *want_grads)):
        assert torch.equal(a.isnan(), b.isnan()), f"{name}: NaN at {a.isnan().sum()} places, eager {b.isnan().sum()}"
        torch.testing.assert_close(a, b, equal_nan=True, **TOL[torch.float32], msg=lambda m, n=name: f"{n}: {m}")


def test_sdpa_row_an_absorbing_float_mask_covers_gets_the_math_backends_gradient():
    """SDPA with a 0 / finfo.min float mask (causal and left padding, HF's) leaving rows with no admissible key: the
    compiled gradients equal SDPA's math backend and the fp64 program. Eager fp32 on CPU runs aten's flash kernel,
    whose backward weighs those rows' keys 1 instead of 1/Nk (its lse rounds log Nk away): Nk times the math."""
    import fa_compile

    def fn(q, k, v, am):
        keep = torch.ones(N, N, dtype=torch.bool).tril()[None, None] & am.bool()[:, None, None, :]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=torch.where(keep, q.new_zeros(()), torch.finfo(q.dtype).min))

    q, k, v = qkv()
    am = torch.ones(B, N, dtype=torch.long)
    am[1, :3] = 0  # left padding: queries 0-2 of sequence 1 admit no key
    g = torch.randn(B, H, N, D, generator=torch.Generator().manual_seed(3))

    def run(f, dtype, backend=None):
        args = [t.to(dtype).requires_grad_() for t in (q, k, v)]
        if backend is None:
            out = f(*args, am)
        else:
            with sdpa_kernel(backend):
                out = f(*args, am)
        return (out, *torch.autograd.grad(out, args, g.to(dtype)))

    math, exact = run(fn, torch.float32, SDPBackend.MATH), run(fn, torch.float64, SDPBackend.MATH)
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="fa3")
    got = run(compiled, torch.float32)
    assert len(fa_compile.explain(fn, q, k, v, am).rewritten) == 1
    for name, a, b, c in zip(("out", "dq", "dk", "dv"), got, math, exact):
        torch.testing.assert_close(a, b, **TOL[torch.float32], msg=lambda m, n=name: f"{n} vs math: {m}")
        torch.testing.assert_close(a.double(), c, **TOL[torch.float32], msg=lambda m, n=name: f"{n} vs fp64: {m}")
    # the difference this pins: eager's flash kernel on CPU scales those rows' gradient by Nk
    flash = run(fn, torch.float32, SDPBackend.FLASH_ATTENTION)
    torch.testing.assert_close(flash[1][1, :, :3], N * math[1][1, :, :3], **TOL[torch.float32])


def plain_unscaled_product(q, k, v):
    return torch.softmax(q @ k.transpose(-2, -1) * 0.002, dim=-1) @ v


@pytest.mark.parametrize("fn", [plain_unscaled_product, lambda q, k, v: F.scaled_dot_product_attention(
    q, k, v, scale=0.002)], ids=["matmul", "sdpa"])
def test_fp16_products_that_overflow_give_finite_accurate_results(fn):
    """fp16 q . k beyond 65504 (inf in eager's fp16 product, then NaN): the op accumulates the
    scaled scores in fp32, so outputs and gradients are finite and match fp64 math."""
    q, k, v = qkv(torch.float16, d=64, scale_by=60.0)
    assert (q.double() @ k.double().transpose(-2, -1)).abs().max() > torch.finfo(torch.float16).max
    q.requires_grad_()
    c = Compiled(fn, inner="aot_eager")
    out = c(q, k, v)
    assert len(c.rewritten) == 1, [r.reason for r in c.missed]
    assert torch.isfinite(out).all()
    qd = q.detach().double().requires_grad_()
    exp, _ = ref.attention_reference(qd, k.double(), v.double(), scale=0.002)
    torch.testing.assert_close(out.double(), exp, **TOL[torch.float16])
    # dO from its own generator: drawn from the global RNG it depended on the tests run before this one,
    # and some draws make the largest exact gradient (the tolerance's scale) small against fp16 rounding
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(0)).to(out.dtype)
    (dq,) = torch.autograd.grad(out, q, dout)
    (dq_exp,) = torch.autograd.grad(exp, qd, dout.double())
    assert torch.isfinite(dq).all()
    scale = dq_exp.abs().max().item()
    torch.testing.assert_close(dq.double(), dq_exp, atol=5e-3 * scale, rtol=5e-3)


def test_fp16_overflow_through_the_op_itself():
    q, k, v = qkv(torch.float16, d=64, scale_by=60.0)
    out, lse = torch.ops.fa3.attention(q, k, v, 0.002, True)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    exp, exp_lse = ref.attention_reference(q.double(), k.double(), v.double(), scale=0.002, causal=True)
    torch.testing.assert_close(out.double(), exp, **TOL[torch.float16])
    torch.testing.assert_close(lse.double(), exp_lse, atol=1e-4, rtol=1e-5)
    assert math.isfinite(float(lse.max()))
