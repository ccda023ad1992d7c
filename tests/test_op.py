"""torch.ops.fa3.attention: numerics against plain eager math, gradients, fake tensors, argument errors."""
from __future__ import annotations

import math
import zlib

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

import fa_compile
import fa_compile.ops  # noqa: F401  (registers torch.ops.fa3)
from fa_compile.kernels.dropout_hash import dropout_keep_mask

TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.float16: dict(atol=2e-3, rtol=2e-3),
       torch.float64: dict(atol=1e-10, rtol=1e-10)}


def eager_attention(q, k, v, scale, *, causal=False, offset=0, window=(-1, -1), bias=None, kv_lens=None,
                    softcap=0.0, dropout_p=0.0, seed=None):
    """Independent eager spelling (repeat_kv, masked_fill, F.softmax) computed in fp64."""
    b, hq, nq, _ = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    qd, kd, vd = (t.double() for t in (q, k, v))
    kd = kd.repeat_interleave(hq // hkv, dim=1)
    vd = vd.repeat_interleave(hq // hkv, dim=1)
    s = qd @ kd.transpose(-2, -1) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if bias is not None:
        s = s.masked_fill(~bias, -math.inf) if bias.dtype == torch.bool else s + bias.double()
    i = torch.arange(nq)[:, None]
    j = torch.arange(nk)[None, :]
    d = j - i - offset
    if causal:
        s = s.masked_fill(d > 0, -math.inf)
    if window[0] >= 0:
        s = s.masked_fill(d < -window[0], -math.inf)
    if window[1] >= 0:
        s = s.masked_fill(d > window[1], -math.inf)
    if kv_lens is not None:
        s = s.masked_fill(j.view(1, 1, 1, nk) >= kv_lens.view(b, 1, 1, 1), -math.inf)
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # the op's convention: an empty row gives 0
    if dropout_p:
        p = p * dropout_keep_mask(seed, b, hq, nq, nk, dropout_p, q.device) / (1 - dropout_p)
    return p @ vd


def rand(*shape, dtype=torch.float32, gen=None):
    return torch.randn(*shape, dtype=dtype, generator=gen)


CASES = [
    # (name, B, Hq, Hkv, Nq, Nk, D, kwargs)
    ("plain", 2, 4, 4, 7, 7, 16, {}),
    ("gqa", 2, 6, 2, 5, 9, 8, {}),
    ("mqa", 1, 4, 1, 6, 6, 8, {}),
    ("causal_top_left", 2, 2, 2, 9, 13, 8, dict(causal=True)),
    ("causal_bottom_right", 2, 2, 2, 5, 13, 8, dict(causal=True, offset=8)),
    ("causal_bottom_right_nq_gt_nk", 1, 2, 2, 11, 6, 8, dict(causal=True, offset=-5)),
    ("window", 1, 2, 1, 12, 12, 8, dict(window=(3, 1))),
    ("causal_window", 1, 2, 2, 12, 12, 8, dict(causal=True, window=(4, -1))),
    ("bias_float_broadcast", 2, 4, 2, 5, 7, 8, dict(bias=(1, 4, 5, 7))),
    ("bias_bool_keys", 2, 2, 2, 5, 7, 8, dict(bool_bias=(2, 1, 1, 7))),
    ("kv_lens", 3, 2, 2, 4, 9, 8, dict(kv_lens=True)),
    ("softcap", 2, 2, 2, 6, 6, 8, dict(softcap=1.5)),
    ("odd_head_dim", 1, 3, 3, 5, 11, 13, {}),
    ("dropout", 2, 2, 1, 6, 10, 8, dict(dropout_p=0.3)),
]


def build(case, dtype, gen):
    name, b, hq, hkv, nq, nk, d, kw = case
    q, k, v = rand(b, hq, nq, d, dtype=dtype, gen=gen), rand(b, hkv, nk, d, dtype=dtype, gen=gen), rand(b, hkv, nk, d, dtype=dtype, gen=gen)
    kw = dict(kw)
    if "bias" in kw:
        kw["bias"] = rand(*kw["bias"], dtype=dtype, gen=gen)
    if "bool_bias" in kw:
        m = torch.rand(*kw.pop("bool_bias"), generator=gen) > 0.3
        m[..., 0] = True
        kw["bias"] = m
    if kw.get("kv_lens"):
        kw["kv_lens"] = torch.randint(1, nk + 1, (b,), generator=gen)
    if kw.get("dropout_p"):
        kw["seed"] = torch.randint(0, 2**31 - 1, (), generator=gen)
    return q, k, v, kw


def call_op(q, k, v, scale, kw):
    return torch.ops.fa3.attention(
        q, k, v, scale, kw.get("causal", False), kw.get("offset", 0), kw.get("window", (-1, -1))[0],
        kw.get("window", (-1, -1))[1], kw.get("bias"), kw.get("kv_lens"), kw.get("softcap", 0.0),
        kw.get("dropout_p", 0.0), kw.get("seed"), None,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_forward_matches_eager(case, dtype):
    gen = torch.Generator().manual_seed(zlib.crc32(case[0].encode()))
    q, k, v, kw = build(case, dtype, gen)
    scale = 1.0 / math.sqrt(q.shape[-1])
    out, lse = call_op(q, k, v, scale, kw)
    ref = eager_attention(q, k, v, scale, **kw)
    assert out.shape == ref.shape and out.dtype == dtype
    torch.testing.assert_close(out.double(), ref, **TOL[dtype])
    assert lse.dtype == torch.float32 and lse.shape == q.shape[:3]
    # BSHD storage: the [B, Nq, Hq, Dv] buffer is contiguous.
    assert out.transpose(1, 2).is_contiguous()


def test_lse_is_logsumexp_and_empty_rows_are_zero():
    q, k, v = rand(1, 2, 6, 8), rand(1, 2, 3, 8), rand(1, 2, 3, 8)
    # bottom-right causal with Nq > Nk: the first Nq - Nk rows see no key.
    out, lse = torch.ops.fa3.attention(q, k, v, 0.5, True, -3)
    s = (q.double() @ k.double().transpose(-2, -1)) * 0.5
    keep = (torch.arange(3)[None, :] - torch.arange(6)[:, None]) <= -3
    ref_lse = torch.logsumexp(s.masked_fill(~keep, -math.inf), -1)
    # lse is fp32 (its documented dtype): compared at fp32's tolerance, since the order of its fp32 sums
    # may follow the machine's thread count
    torch.testing.assert_close(lse, ref_lse.float())
    assert torch.isneginf(lse[..., :3]).all() and (out[:, :, :3] == 0).all()


@pytest.mark.parametrize("dv", [0, 4])
def test_lse_gradient_with_and_without_value_dims(dv):
    # d lse / d s = P whether or not V has columns (with none, out is empty but lse is not)
    gen = torch.Generator().manual_seed(1)
    q, k = (rand(1, 2, n, 8, gen=gen).requires_grad_() for n in (3, 5))
    v = rand(1, 2, 5, dv, gen=gen)
    out, lse = torch.ops.fa3.attention(q, k, v, 0.5, True, 2)
    keep = (torch.arange(5)[None, :] - torch.arange(3)[:, None]) <= 2
    ref = torch.logsumexp((q.double() @ k.double().transpose(-2, -1) * 0.5).masked_fill(~keep, -math.inf), -1)
    w = torch.randn(lse.shape, generator=gen)
    got = torch.autograd.grad((lse * w).sum(), (q, k))
    want = torch.autograd.grad((ref * w.double()).sum(), (q, k))
    for a, b in zip(got, want):
        assert b.abs().max() > 0.1
        torch.testing.assert_close(a, b.float(), atol=1e-5, rtol=1e-5)


def test_bshd_views_are_taken_without_copies():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (rand(2, 9, 4, 16, gen=gen) for _ in range(3))  # [B, N, H, D]
    out = fa_compile.attention(q, k, v, layout="bshd", causal=True)
    ref = eager_attention(*(t.transpose(1, 2) for t in (q, k, v)), 0.25, causal=True).transpose(1, 2)
    assert out.shape == q.shape
    torch.testing.assert_close(out.double(), ref, **TOL[torch.float32])


def test_dropout_follows_manual_seed_and_is_unbiased():
    q, k, v = rand(2, 2, 16, 8), rand(2, 2, 16, 8), rand(2, 2, 16, 8)
    torch.manual_seed(3)
    a = fa_compile.attention(q, k, v, dropout_p=0.5)
    torch.manual_seed(3)
    b = fa_compile.attention(q, k, v, dropout_p=0.5)
    c = fa_compile.attention(q, k, v, dropout_p=0.5)
    assert torch.equal(a, b) and not torch.equal(b, c)
    # Keep rate and rescaling: E[mask / (1 - p)] == 1 over many draws.
    keep = dropout_keep_mask(torch.tensor(12345), 4, 8, 64, 64, 0.25, torch.device("cpu"))
    assert abs(keep.float().mean().item() - 0.75) < 0.01


GRAD_CASES = [
    dict(),
    dict(causal=True, offset=2),
    dict(window=(2, 1)),
    dict(bias=True),
    dict(kv_lens=True),
    dict(softcap=2.0),
    dict(dropout_p=0.25),
    dict(causal=True, bias=True, softcap=1.0),
]


@pytest.mark.parametrize("kw", GRAD_CASES, ids=lambda kw: "-".join(kw) or "plain")
def test_gradcheck_fp64(kw):
    gen = torch.Generator().manual_seed(7)
    b, hq, hkv, nq, nk, d = 2, 4, 2, 4, 6, 5
    q = rand(b, hq, nq, d, dtype=torch.float64, gen=gen).requires_grad_()
    k = rand(b, hkv, nk, d, dtype=torch.float64, gen=gen).requires_grad_()
    v = rand(b, hkv, nk, 3, dtype=torch.float64, gen=gen).requires_grad_()
    kw = dict(kw)
    inputs = [q, k, v]
    if kw.pop("bias", False):
        kw["bias"] = rand(1, hq, nq, nk, dtype=torch.float64, gen=gen).requires_grad_()
        inputs.append(kw["bias"])
    if kw.get("kv_lens"):
        kw["kv_lens"] = torch.tensor([3, 6])
    if kw.get("dropout_p"):
        kw["seed"] = torch.tensor(99)

    def f(*ins):
        kk = dict(kw)
        if "bias" in kk:
            kk["bias"] = ins[3]
        return call_op(ins[0], ins[1], ins[2], 0.7, kk)[0]

    assert torch.autograd.gradcheck(f, tuple(inputs))


def test_gradients_match_eager_autograd():
    gen = torch.Generator().manual_seed(1)
    q, k, v = rand(2, 4, 6, 8, gen=gen), rand(2, 2, 9, 8, gen=gen), rand(2, 2, 9, 8, gen=gen)
    bias = rand(1, 1, 6, 9, gen=gen)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, bias)]
    out = fa_compile.attention(*leaves[:3], bias=leaves[3], causal="bottom_right")
    out.backward(torch.ones_like(out))
    ref_leaves = [t.double().clone().requires_grad_() for t in (q, k, v, bias)]
    ref = eager_attention(*ref_leaves[:3], 8 ** -0.5, causal=True, offset=3, bias=ref_leaves[3])
    ref.backward(torch.ones_like(ref))
    for a, r in zip(leaves, ref_leaves):
        torch.testing.assert_close(a.grad.double(), r.grad, atol=1e-5, rtol=1e-5)


def test_opcheck():
    q, k, v = rand(2, 4, 5, 8).requires_grad_(), rand(2, 2, 7, 8).requires_grad_(), rand(2, 2, 7, 8).requires_grad_()
    bias = rand(1, 4, 5, 7).requires_grad_()
    torch.library.opcheck(torch.ops.fa3.attention.default, (q, k, v, 0.3, True, 2, -1, -1, bias, None, 0.0, 0.0, None, None))
    torch.library.opcheck(torch.ops.fa3.attention.default, (q, k, v, 0.3, False, 0, 2, 2, None, torch.tensor([3, 7]), 1.0, 0.0, None, None))


def test_double_backward_is_a_clear_error_not_a_wrong_number():
    q = rand(1, 2, 4, 8, dtype=torch.float64).requires_grad_()
    out, _ = torch.ops.fa3.attention(q, q, q, 0.3)
    (g,) = torch.autograd.grad(out.sum(), q, create_graph=True)
    ref_out = F.scaled_dot_product_attention(q, q, q, scale=0.3)
    (ref_g,) = torch.autograd.grad(ref_out.sum(), q, create_graph=True)
    torch.testing.assert_close(g, ref_g)  # the first gradient is still right under create_graph
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(g.sum(), q)


def test_fake_tensor_shapes_match_real():
    q, k, v = rand(2, 4, 5, 8), rand(2, 2, 7, 8), rand(2, 2, 7, 6)
    real_out, real_lse = torch.ops.fa3.attention(q, k, v, 0.3)
    with FakeTensorMode() as mode:
        fq, fk, fv = (mode.from_tensor(t) for t in (q, k, v))
        out, lse = torch.ops.fa3.attention(fq, fk, fv, 0.3)
    assert out.shape == real_out.shape and out.stride() == real_out.stride() and out.dtype == real_out.dtype
    assert lse.shape == real_lse.shape and lse.dtype == real_lse.dtype


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda a: a.update(q=rand(2, 4, 5)), "q: expected 4 dims"),
        (lambda a: a.update(k=rand(3, 2, 7, 8)), "k, v: batch sizes"),
        (lambda a: a.update(k=rand(2, 3, 7, 8), v=rand(2, 3, 7, 8)), "k: q's 4 heads are not a multiple of k's 3"),
        (lambda a: a.update(v=rand(2, 2, 6, 8)), "v: sequence length 6"),
        (lambda a: a.update(k=rand(2, 2, 7, 4)), "k: head dim 4"),
        (lambda a: a.update(k=rand(2, 2, 7, 8, dtype=torch.float16)), "k, v: dtypes must match q"),
        (lambda a: a.update(q=torch.ones(2, 4, 5, 8, dtype=torch.int32)), "q: dtype torch.int32"),
        (lambda a: a.update(k=rand(2, 2, 7, 8).to("meta")), "k, v: must be on q's device"),
        (lambda a: a.update(bias=rand(2, 3, 5, 7)), "bias: shape (2, 3, 5, 7) does not broadcast"),
        (lambda a: a.update(bias=torch.ones(5, 7, dtype=torch.int64)), "bias: dtype torch.int64"),
        (lambda a: a.update(kv_lens=torch.tensor([1, 2, 3])), "kv_lens: expected shape [batch]"),
        (lambda a: a.update(kv_lens=torch.tensor([1.0, 2.0])), "kv_lens: dtype must be int"),
        (lambda a: a.update(dropout_p=1.0), "dropout_p: must be in [0, 1)"),
        (lambda a: a.update(dropout_p=0.1), "dropout_seed: required"),
        (lambda a: a.update(softcap=-1.0), "softcap: must be >= 0"),
        (lambda a: a.update(scale=float("nan")), "scale: must be finite"),
        (lambda a: a.update(window_left=-2), "window_left, window_right"),
        (lambda a: a.update(causal=True, diag_offset=-2**63), "diag_offset: must lie in [-2**62, 2**62]"),
        (lambda a: a.update(causal=True, diag_offset=2**63 - 1), "diag_offset: must lie in [-2**62, 2**62]"),
        (lambda a: a.update(window_left=2**63 - 1), "window_left: must lie in [-2**62, 2**62]"),
        (lambda a: a.update(window_right=2**62 + 1), "window_right: must lie in [-2**62, 2**62]"),
    ],
)
def test_invalid_arguments_name_the_argument(mutate, message):
    a = dict(q=rand(2, 4, 5, 8), k=rand(2, 2, 7, 8), v=rand(2, 2, 7, 8), scale=0.3, causal=False, diag_offset=0,
             window_left=-1, window_right=-1, bias=None, kv_lens=None, softcap=0.0, dropout_p=0.0,
             dropout_seed=None, force_kernel=None)
    # A valid call first: the checks are memoised with the kernel choice, and a memo hit must
    # never let a bad argument through.
    torch.ops.fa3.attention(**a)
    with torch.no_grad():
        torch.ops.fa3.attention(**a)
    mutate(a)
    with pytest.raises((ValueError, TypeError), match=__import__("re").escape(message)):
        torch.ops.fa3.attention(**a)


def test_public_api_errors_name_the_argument():
    q = rand(1, 2, 3, 4)
    with pytest.raises(ValueError, match="layout"):
        fa_compile.attention(q, q, q, layout="sbhd")
    with pytest.raises(ValueError, match="causal"):
        fa_compile.attention(q, q, q, causal="diagonal")
    with pytest.raises(ValueError, match="^kernel: unknown kernel 'nope'"):
        fa_compile.attention(q, q, q, kernel="nope")


def test_sdpa_agrees_on_plain_inputs():
    gen = torch.Generator().manual_seed(5)
    q, k, v = rand(2, 4, 8, 16, gen=gen), rand(2, 4, 8, 16, gen=gen), rand(2, 4, 8, 16, gen=gen)
    torch.testing.assert_close(fa_compile.attention(q, k, v, causal=True),
                               F.scaled_dot_product_attention(q, k, v, is_causal=True), atol=1e-5, rtol=1e-5)


def test_export_keeps_the_op_and_matches():
    """torch.export of a module using the public API: one fa3.attention node, equal outputs."""

    class M(torch.nn.Module):
        def forward(self, q, k, v):
            return fa_compile.attention(q, k, v, causal=True)

    q, k, v = rand(2, 8, 4, 16), rand(2, 8, 2, 16), rand(2, 8, 2, 16)
    ep = torch.export.export(M(), (q, k, v))
    targets = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.fa3.attention.default) == 1, targets
    torch.testing.assert_close(ep.module()(q, k, v), M()(q, k, v))
