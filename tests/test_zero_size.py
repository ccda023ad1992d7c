"""Zero-size dimensions (batch, heads, queries, keys, head dim of q/k, head dim of v): the op, the
public API, the fake implementation, explain() and compiled models all give eager's values and
gradients (no keys: out 0, lse -inf; head dim 0: uniform weights, the mean of V; otherwise empty)."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

import fa_compile
import fa_compile.ops  # noqa: F401  (registers torch.ops.fa3)
from conftest import TOL, Compiled
from fa_compile import dispatch

# (name, q shape, k shape, v shape): one dimension 0 each, the others small and unequal
ZERO_DIMS = {
    "batch": ((0, 2, 4, 8), (0, 2, 5, 8), (0, 2, 5, 8)),
    "heads": ((2, 0, 4, 8), (2, 0, 5, 8), (2, 0, 5, 8)),
    "queries": ((2, 2, 0, 8), (2, 2, 5, 8), (2, 2, 5, 8)),
    "keys": ((2, 2, 4, 8), (2, 2, 0, 8), (2, 2, 0, 8)),
    "head_dim": ((2, 2, 4, 0), (2, 2, 5, 0), (2, 2, 5, 6)),
    "v_head_dim": ((2, 2, 4, 8), (2, 2, 5, 8), (2, 2, 5, 0)),
    "gqa_keys": ((1, 4, 3, 8), (1, 2, 0, 8), (1, 2, 0, 8)),
}


def inputs(name, dtype=torch.float32, seed=0, requires_grad=True):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(s, generator=g).to(dtype).requires_grad_(requires_grad) for s in ZERO_DIMS[name])


def eager(q, k, v, scale, causal=False):
    """SDPA's math in fp64: eager's meaning of every zero-size case (GQA by repeated K/V)."""
    rep = q.shape[1] // k.shape[1] if k.shape[1] else 1
    kd, vd = (t.double().repeat_interleave(rep, dim=1) for t in (k, v))
    return F.scaled_dot_product_attention(q.double(), kd, vd, scale=scale, is_causal=causal)


def grads(out, tensors, seed=1):
    g = torch.Generator().manual_seed(seed)
    dout = torch.randn(out.shape, generator=g, dtype=torch.float64).to(out.dtype)
    return torch.autograd.grad(out, tensors, dout, allow_unused=True)


def assert_matches_eager(out, tensors, scale, causal, dtype=torch.float32):
    exp = eager(*tensors, scale, causal)
    assert out.shape == exp.shape and out.dtype == tensors[0].dtype
    torch.testing.assert_close(out.double(), exp, **TOL[dtype])
    for got, want, t in zip(grads(out, tensors), grads(exp, tensors), tensors):
        got = torch.zeros_like(t) if got is None else got
        want = torch.zeros_like(t) if want is None else want
        assert got.shape == t.shape
        torch.testing.assert_close(got.double(), want.double(), **TOL[dtype])


@pytest.mark.parametrize("causal", [False, True], ids=["plain", "causal"])
@pytest.mark.parametrize("name", list(ZERO_DIMS))
def test_op_forward_and_backward_match_eager(name, causal):
    q, k, v = inputs(name)
    out, lse = torch.ops.fa3.attention(q, k, v, 0.3, causal)
    assert lse.shape == q.shape[:3] and lse.dtype == torch.float32
    if name in ("keys", "gqa_keys"):
        assert torch.isneginf(lse).all() and (out == 0).all()
    if name == "head_dim" and not causal:  # every score 0: lse = log(Nk), out = mean of V
        torch.testing.assert_close(lse, torch.full_like(lse, math.log(k.shape[2])))
        torch.testing.assert_close(out, v.mean(2, keepdim=True).expand_as(out).detach())
    assert_matches_eager(out, (q, k, v), 0.3, causal)


@pytest.mark.parametrize("name", ["keys", "head_dim", "queries"])
def test_op_with_masks_and_fp16(name):
    """bool bias, kv_lens, a window and fp16: the same trivial path, still eager's numbers."""
    q, k, v = inputs(name, torch.float16)
    b, nq, nk = q.shape[0], q.shape[2], k.shape[2]
    keep = torch.ones(b, 1, nq, nk, dtype=torch.bool)
    out, _ = torch.ops.fa3.attention(q, k, v, 0.3, False, 0, -1, -1, keep, torch.full((b,), nk))
    assert_matches_eager(out, (q, k, v), 0.3, False, torch.float16)
    out, _ = torch.ops.fa3.attention(q, k, v, 0.3, False, nk - nq, 100, 100)
    assert_matches_eager(out, (q, k, v), 0.3, False, torch.float16)


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("name", list(ZERO_DIMS))
def test_public_api_matches_eager(name, layout):
    q, k, v = inputs(name)
    args = (q, k, v) if layout == "bhsd" else tuple(t.transpose(1, 2) for t in (q, k, v))
    out = fa_compile.attention(*args, scale=0.3, causal=True, layout=layout)
    if layout == "bshd":
        out = out.transpose(1, 2)
    assert_matches_eager(out, (q, k, v), 0.3, True)


def test_public_api_head_dim_zero_needs_an_explicit_scale():
    q, k, v = inputs("head_dim")
    with pytest.raises(ValueError, match=r"^scale: q has head dim 0"):
        fa_compile.attention(q, k, v)
    assert_matches_eager(fa_compile.attention(q, k, v, scale=2.0), (q, k, v), 2.0, False)


@pytest.mark.parametrize("name", list(ZERO_DIMS))
def test_fake_implementation_matches_real(name):
    q, k, v = inputs(name, requires_grad=False)
    real_out, real_lse = torch.ops.fa3.attention(q, k, v, 0.3, True)
    with FakeTensorMode() as mode:
        out, lse = torch.ops.fa3.attention(*(mode.from_tensor(t) for t in (q, k, v)), 0.3, True)
    assert (out.shape, out.stride(), out.dtype) == (real_out.shape, real_out.stride(), real_out.dtype)
    assert (lse.shape, lse.dtype) == (real_lse.shape, real_lse.dtype)


@pytest.mark.parametrize("name", list(ZERO_DIMS))
def test_dispatch_takes_the_trivial_path_before_any_kernel(name, monkeypatch):
    """Whatever is forced (argument or FA_COMPILE_KERNEL), zero-size inputs run the reference; a
    misspelt kernel name is still an error; explain_choice says why."""
    q, k, v = inputs(name, requires_grad=False)
    args = dispatch.AttentionArgs(q=q, k=k, v=v, scale=0.3)
    assert dispatch.zero_size(args) is not None
    assert dispatch.select_forward(args, "triton").name == "reference"
    assert dispatch.select_backward(dispatch.AttentionArgs(q=q, k=k, v=v, scale=0.3, needs_backward=True),
                                    "cudnn").name == "reference"
    chosen, refused = dispatch.explain_choice(args)
    assert chosen == "reference" and "= 0" in refused[0][1][0]
    with pytest.raises(ValueError, match="force_kernel: unknown"):
        torch.ops.fa3.attention(q, k, v, 0.3, force_kernel="nope")
    monkeypatch.setenv("FA_COMPILE_KERNEL", "flash")
    out, _ = torch.ops.fa3.attention(q, k, v, 0.3)
    torch.testing.assert_close(out.double(), eager(q, k, v, 0.3))


# ------------------------------------------------------------------------------------- compiled models

def hand_plain(q, k, v):
    return torch.softmax(q @ k.transpose(-2, -1) * 0.3, dim=-1) @ v


def hand_causal_fill(q, k, v):
    nq, nk = q.shape[-2], k.shape[-2]
    keep = torch.ones(nq, nk, dtype=torch.bool, device=q.device).tril()
    return torch.softmax((q @ k.transpose(-2, -1) * 0.3).masked_fill(~keep, float("-inf")), dim=-1) @ v


def hand_causal_finfo_min(q, k, v):
    nq, nk = q.shape[-2], k.shape[-2]
    bias = torch.full((nq, nk), torch.finfo(q.dtype).min, dtype=q.dtype, device=q.device).triu(1)
    return F.softmax(torch.matmul(q, k.transpose(-1, -2)) * 0.3 + bias, dim=-1) @ v


def hand_causal_finite_fill(q, k, v):
    nq, nk = q.shape[-2], k.shape[-2]
    keep = torch.ones(nq, nk, dtype=torch.bool, device=q.device).tril()
    return torch.softmax((q @ k.transpose(-2, -1) * 0.3).masked_fill(~keep, -1e4), dim=-1) @ v


def sdpa_bool_mask(q, k, v):
    keep = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
    return F.scaled_dot_product_attention(q, k, v, attn_mask=keep, scale=0.3)


def sdpa_scaled(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, scale=0.3)


def sdpa_causal(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3)


def sdpa_default_scale(q, k, v):
    return F.scaled_dot_product_attention(q, k, v)


FORMS = [hand_plain, hand_causal_fill, hand_causal_finfo_min, hand_causal_finite_fill, sdpa_scaled, sdpa_causal,
         sdpa_bool_mask, sdpa_default_scale]
SAME_HEADS = [n for n in ZERO_DIMS if n != "gqa_keys"]  # the hand-written forms do not repeat K/V


def check_compiled(fn, name, make):
    q, k, v = inputs(name)
    out = make(fn)(q, k, v)
    exp = fn(*(t.detach().double().requires_grad_() for t in (q, k, v)))
    torch.testing.assert_close(out.double(), exp.detach(), **TOL[torch.float32])
    dq = grads(out, (q, k, v))
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    de = grads(fn(qd, kd, vd), (qd, kd, vd))
    for got, want, t in zip(dq, de, (q, k, v)):
        got = torch.zeros_like(t) if got is None else got
        want = torch.zeros_like(t, dtype=torch.float64) if want is None else want
        assert got.shape == t.shape
        torch.testing.assert_close(got.double(), want, **TOL[torch.float32])


@pytest.mark.parametrize("name", SAME_HEADS)
@pytest.mark.parametrize("fn", FORMS, ids=lambda f: f.__name__)
def test_compiled_forms_match_eager_and_are_rewritten(fn, name):
    """Each form with each zero-size dimension: rewritten to one op call, outputs and gradients as
    eager's (aot_eager inner compiler: the backward graph runs the op's backward)."""
    holder = {}

    def make(f):
        holder["c"] = Compiled(f, inner="aot_eager")
        return holder["c"]

    check_compiled(fn, name, make)
    c = holder["c"]
    assert len(c.rewritten) == 1 and not c.missed, [r.reason for r in c.missed]


@pytest.mark.parametrize("name", ["keys", "head_dim", "batch", "queries", "heads", "v_head_dim"])
@pytest.mark.parametrize("fn", [hand_causal_fill, sdpa_default_scale], ids=lambda f: f.__name__)
def test_backend_fa3_with_inductor(fn, name):
    # With the compile-time lowering, and no fallback warning: each lowering refuses the zero sizes its
    # kernel cannot take (aten's CPU flash kernel stops the process on zero queries), so the op's exact
    # trivial path runs there.
    import warnings

    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_compiled(fn, name, lambda f: torch.compile(f, backend="fa3", fullgraph=True))
    assert not [str(w.message) for w in caught if "fa_compile:" in str(w.message)]


@pytest.mark.parametrize("fn", [hand_causal_fill, hand_causal_finfo_min, sdpa_causal, sdpa_default_scale],
                         ids=lambda f: f.__name__)
def test_explain_reports_zero_key_sites(fn):
    q, k, v = inputs("keys")
    torch._dynamo.reset()  # static shapes, as a first call has (earlier tests compiled these functions)
    report = fa_compile.explain(fn, q, k, v)
    assert len(report.rewritten) == 1, str(report)
    assert report.rows[0].kernel_fwd == "reference"
    assert "keys = 0" in str(report)
