"""Hand-written softmax attention, however spelled: rewritten to fa3.attention and equal to eager.

Every form compiles with the fa3 pass (inner "eager" so the rewritten graph itself runs), is compared
with eager on fresh random inputs under a fixed seed, and must show exactly one rewritten site (or a
precise reason when it is not attention or not provably equivalent).
"""
from __future__ import annotations

import math

import expecttest
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import TOL, Compiled
from eager_diff import check as diff_check

B, H, N, D = 2, 4, 8, 16


def rand(*shape, dtype=torch.float32, seed=0, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float32).to(dtype).requires_grad_(requires_grad)


def qkv(dtype=torch.float32, shape=(B, H, N, D), kv_shape=None, seed=0):
    kv_shape = kv_shape or shape
    return rand(*shape, dtype=dtype, seed=seed), rand(*kv_shape, dtype=dtype, seed=seed + 1), \
        rand(*kv_shape, dtype=dtype, seed=seed + 2)


def check(fn, *args, dtype=torch.float32, rewritten=1, dynamic=None, inner="eager"):
    c = Compiled(fn, inner=inner, dynamic=dynamic)
    out = c(*args)
    ref = fn(*args)
    torch.testing.assert_close(out, ref, **TOL[dtype])
    assert len(c.rewritten) == rewritten, [r.reason for r in c.missed]
    assert c.op_calls() == rewritten
    return c


# ----------------------------------------------------------------------------------- softmax spellings

class WithSoftmaxModule(nn.Module):
    def __init__(self):
        super().__init__()
        self.softmax = nn.Softmax(dim=-1)

    def forward(self, q, k, v):
        return self.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))) @ v


SOFTMAX_FORMS = {
    "F.softmax": lambda q, k, v: F.softmax(q @ k.transpose(-2, -1) * 0.25, dim=-1) @ v,
    "torch.softmax_pos_dim": lambda q, k, v: torch.softmax(q @ k.transpose(-2, -1) * 0.25, 3) @ v,
    "Tensor.softmax": lambda q, k, v: (q @ k.transpose(-2, -1) * 0.25).softmax(-1) @ v,
    "nn.Softmax": WithSoftmaxModule(),
    "dtype_float32_then_to": lambda q, k, v: F.softmax(q @ k.transpose(-2, -1) * 0.25, dim=-1,
                                                       dtype=torch.float32).to(q.dtype) @ v,
    "float_then_type_as": lambda q, k, v: torch.softmax((q @ k.transpose(-2, -1)).float() * 0.25, -1).type_as(q) @ v,
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("form", list(SOFTMAX_FORMS))
def test_softmax_spellings(form, dtype):
    check(SOFTMAX_FORMS[form], *qkv(dtype), dtype=dtype)


# ----------------------------------------------------------------------------------------- scale forms

class Buffered(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("scale", torch.tensor(0.3))

    def forward(self, q, k, v):
        return torch.softmax(torch.matmul(q, k.transpose(-1, -2)) * self.scale, -1) @ v


class PerHeadTemperature(nn.Module):
    """A learned per-head temperature: a tensor constant along the key axis, folded into q."""

    def __init__(self):
        super().__init__()
        self.t = nn.Parameter(torch.linspace(0.5, 2.0, H).view(H, 1, 1))

    def forward(self, q, k, v):
        return torch.softmax((q @ k.transpose(-2, -1)) * self.t, -1) @ v


SCALE_FORMS = {
    "div_sqrt_d": lambda q, k, v: torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.size(-1)), -1) @ v,
    "mul_d_pow": lambda q, k, v: torch.softmax(q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5, -1) @ v,
    "number_first": lambda q, k, v: torch.softmax(0.125 * (q @ k.transpose(-2, -1)), -1) @ v,
    "torch.mul": lambda q, k, v: torch.softmax(torch.mul(q @ k.transpose(-2, -1), 0.2), -1) @ v,
    "torch.div": lambda q, k, v: torch.softmax(torch.div(q @ k.transpose(-2, -1), 3.0), -1) @ v,
    "zero_d_tensor_buffer": Buffered(),
    "q_prescaled": lambda q, k, v: torch.softmax((q * 0.25) @ k.transpose(-2, -1), -1) @ v,
    "k_prescaled": lambda q, k, v: torch.softmax(q @ (k.transpose(-2, -1) / 4.0), -1) @ v,
    "both_prescaled": lambda q, k, v: torch.softmax((q * 0.5) @ (k * 0.5).transpose(-2, -1), -1) @ v,
    "no_scale": lambda q, k, v: torch.softmax(q @ k.transpose(-2, -1), -1) @ v,
    "two_scales": lambda q, k, v: torch.softmax(q @ k.transpose(-2, -1) / 2.0 * 0.5, -1) @ v,
    "per_head_temperature": PerHeadTemperature(),
    "constant_shift": lambda q, k, v: torch.softmax(q @ k.transpose(-2, -1) * 0.25 - 3.0, -1) @ v,
    "row_max_shift": lambda q, k, v: torch.softmax(
        (lambda s: s - s.max(dim=-1, keepdim=True).values.detach())(q @ k.transpose(-2, -1) * 0.25), -1) @ v,
    "row_amax_shift": lambda q, k, v: torch.softmax(
        (lambda s: s - s.amax(-1, keepdim=True))(q @ k.transpose(-2, -1) * 0.25), -1) @ v,
}


@pytest.mark.parametrize("form", list(SCALE_FORMS))
def test_scale_forms(form):
    c = check(SCALE_FORMS[form], *qkv())
    if form in ("div_sqrt_d", "mul_d_pow"):
        assert c.rewritten[0].scale == pytest.approx(0.25)
    if form in ("q_prescaled", "k_prescaled", "both_prescaled"):
        assert c.rewritten[0].scale == pytest.approx(0.25)  # the pre-scale moved into the op


def test_symbolic_scale_under_dynamic_shapes():
    f = SCALE_FORMS["div_sqrt_d"]
    c = Compiled(f, dynamic=True)
    for n in (8, 11):
        q, k, v = qkv(shape=(B, H, n, D), seed=n)
        torch.testing.assert_close(c(q, k, v), f(q, k, v), **TOL[torch.float32])
    assert len(c.graphs) == 1 and len(c.rewritten) == 1


def test_mark_dynamic_sequence_keeps_the_rewrite():
    f = SCALE_FORMS["mul_d_pow"]
    c = Compiled(f)
    for n in (8, 13, 21):
        q, k, v = qkv(shape=(B, H, n, D), seed=n)
        for t in (q, k, v):
            torch._dynamo.mark_dynamic(t, 2)
        torch.testing.assert_close(c(q, k, v), f(q, k, v), **TOL[torch.float32])
    assert len(c.graphs) == 1 and len(c.rewritten) == 1


# --------------------------------------------------------------------------------- contraction spellings

def bmm_3d(q, k, v):
    b, h, n, d = q.shape
    q3, k3, v3 = (t.reshape(b * h, n, d) for t in (q, k, v))
    p = torch.softmax(torch.bmm(q3, k3.transpose(1, 2)) / math.sqrt(d), dim=-1)
    return torch.bmm(p, v3).view(b, h, n, d)


def baddbmm_alpha(q, k, v):
    b, h, n, d = q.shape
    q3, k3, v3 = (t.reshape(b * h, n, d) for t in (q, k, v))
    s = torch.baddbmm(torch.empty(b * h, n, n, dtype=q.dtype), q3, k3.transpose(1, 2), beta=0.0, alpha=d ** -0.5)
    return torch.bmm(s.softmax(-1), v3).view(b, h, n, d)


CONTRACTION_FORMS = {
    "operator.matmul": lambda q, k, v: torch.softmax(q @ k.transpose(-2, -1), -1) @ v,
    "torch.matmul": lambda q, k, v: torch.matmul(torch.softmax(torch.matmul(q, k.transpose(2, 3)), -1), v),
    "Tensor.matmul": lambda q, k, v: torch.softmax(q.matmul(k.transpose(-2, -1)), -1).matmul(v),
    "bmm_3d": bmm_3d,
    "baddbmm_alpha": baddbmm_alpha,
    "einsum": lambda q, k, v: torch.einsum("bhqk,bhkd->bhqd", torch.einsum("bhqd,bhkd->bhqk", q, k).softmax(-1), v),
    "einsum_ellipsis": lambda q, k, v: torch.einsum("...qk,...kd->...qd",
                                                    torch.einsum("...qd,...kd->...qk", q, k).softmax(-1), v),
    "einsum_bshd_out": lambda q, k, v: torch.einsum("bhqk,bhkd->bqhd",
                                                    torch.einsum("bhqd,bhkd->bhqk", q, k).softmax(-1), v),
    "single_head_2d": lambda q, k, v: torch.softmax(q[0, 0] @ k[0, 0].T, -1) @ v[0, 0],
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("form", list(CONTRACTION_FORMS))
def test_contraction_spellings(form, dtype):
    check(CONTRACTION_FORMS[form], *qkv(dtype), dtype=dtype)


# --------------------------------------------------------------------------------------------- layouts

def bshd(q, k, v):
    """Inputs [B, N, H, D]: the usual .transpose(1, 2) views, out back to [B, N, H*D]."""
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    y = torch.softmax(q @ k.transpose(-2, -1) * 0.25, -1) @ v
    return y.transpose(1, 2).reshape(q.shape[0], q.shape[2], -1)


def bshd_permute(q, k, v):
    """k.permute(0, 2, 3, 1) of a BSHD k IS k^T of its BHSD view: a legitimate spelling."""
    s = q.permute(0, 2, 1, 3) @ k.permute(0, 2, 3, 1)
    return (torch.softmax(s * 0.25, -1) @ v.permute(0, 2, 1, 3)).permute(0, 2, 1, 3).contiguous()


def view_after_out(q, k, v):
    """A consumer that `.view`s the P·V result: must still work on the op's output layout."""
    y = torch.softmax(q @ k.transpose(-2, -1) * 0.25, -1) @ v
    return y.view(q.shape[0], -1, q.shape[-1])


@pytest.mark.parametrize("form", [bshd, bshd_permute, view_after_out], ids=lambda f: f.__name__)
def test_layouts(form):
    shape = (B, N, H, D) if form is not view_after_out else (B, H, N, D)
    c = check(form, *qkv(shape=shape))
    if form is not view_after_out:
        # q/k/v reach the op as transpose/permute views of the BSHD inputs, never as copies
        gm = c.graphs[0]
        (op,) = [n for n in gm.graph.nodes if n.target is torch.ops.fa3.attention.default]
        for a in op.args[:3]:
            assert a.target in ("transpose", torch.permute), a.format_node()
            assert a.args[0].op == "placeholder", a.format_node()


def test_returned_output_keeps_eager_strides():
    """The op stores its output BSHD; a P·V result returned to the caller must stay contiguous as in
    eager, or a caller's `.view()` would fail."""
    f = SCALE_FORMS["no_scale"]
    q, k, v = qkv()
    out = check(f, q, k, v).fn(q, k, v)
    assert out.is_contiguous() and out.stride() == f(q, k, v).stride()


def test_issue_195320_permute_is_not_a_transpose():
    """k.permute(0, 2, 3, 1) of a BHSD k is NOT k^T: with N == H the shapes line up and Inductor's
    template matched it as a transpose (pytorch issue 195320). The contraction axes are read from the
    ops, so the site is rewritten with the k view the graph really contracts with, and stays equal."""
    n = H  # sequence length == head count
    q, k, v = qkv(shape=(B, H, n, D))

    def f(q, k, v):
        return torch.softmax(q @ k.permute(0, 2, 3, 1) * 0.25, -1) @ v

    c = check(f, q, k, v)
    wrong = torch.softmax(q @ k.transpose(-2, -1) * 0.25, -1) @ v
    assert not torch.allclose(c(q, k, v), wrong, atol=1e-3)  # a transpose reading would be wrong here
    # the op gets k.permute(0, 2, 1, 3): heads and positions swapped, exactly as eager contracts them
    gm = c.graphs[0]
    (perm,) = [n for n in gm.graph.nodes if n.target is torch.permute]
    assert tuple(perm.args[1]) == (0, 2, 1, 3)


@pytest.mark.parametrize("form", ["bmm_3d", "baddbmm_alpha", "einsum_bshd_out", "single_head_2d"])
def test_contractions_under_dynamic_shapes(form):
    f = CONTRACTION_FORMS[form]
    c = Compiled(f, dynamic=True)
    for n in (8, 11):
        q, k, v = qkv(shape=(B, H, n, D), seed=n)
        torch.testing.assert_close(c(q, k, v), f(q, k, v), **TOL[torch.float32])
    assert len(c.graphs) == 1 and len(c.rewritten) == 1, [r.reason for r in c.missed]


# ------------------------------------------------------------------------------------------------- GQA

HKV = 2


def repeat_kv(x, g):
    b, h, n, d = x.shape
    return x[:, :, None, :, :].expand(b, h, g, n, d).reshape(b, h * g, n, d)


GQA_FORMS = {
    "repeat_kv": lambda q, k, v: torch.softmax(q @ repeat_kv(k, H // HKV).transpose(2, 3) * 0.25, -1)
    @ repeat_kv(v, H // HKV),
    "repeat_interleave": lambda q, k, v: torch.softmax(
        q @ k.repeat_interleave(H // HKV, dim=1).transpose(-2, -1) * 0.25, -1) @ torch.repeat_interleave(v, H // HKV, dim=1),
    "repeat_interleave_mT": lambda q, k, v: torch.softmax(  # Tensor.mT: Dynamo's getattr(k, "mT")
        q @ k.repeat_interleave(H // HKV, dim=1).mT * 0.25, -1) @ v.repeat_interleave(H // HKV, dim=1),
    "repeat_interleave_mH": lambda q, k, v: torch.softmax(  # Tensor.mH of a real tensor: its mT
        q @ k.repeat_interleave(H // HKV, dim=1).mH * 0.25, -1) @ v.repeat_interleave(H // HKV, dim=1),
    "grouped_broadcast_5d": lambda q, k, v: (torch.softmax(
        q.unflatten(1, (HKV, H // HKV)) @ k.unsqueeze(2).transpose(-2, -1) * 0.25, -1) @ v.unsqueeze(2)).flatten(1, 2),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("form", list(GQA_FORMS))
def test_gqa_native(form, dtype):
    q, k, v = qkv(dtype, kv_shape=(B, HKV, N, D))
    c = check(GQA_FORMS[form], q, k, v, dtype=dtype)
    r = c.rewritten[0]
    assert r.k_shape[1] == HKV and r.q_shape[1] == H, r  # the op reads the un-repeated K/V
    gm = c.graphs[0]
    assert not [n for n in gm.graph.nodes if n.op == "call_method" and n.target in ("expand", "repeat_interleave")]


def test_mqa_broadcast_matmul():
    q, k, v = qkv(kv_shape=(B, 1, N, D))
    c = check(lambda q, k, v: torch.softmax(q @ k.transpose(-2, -1) * 0.25, -1) @ v, q, k, v)
    assert c.rewritten[0].k_shape[1] == 1


def test_repeat_tiles_heads_kept_repeated():
    """x.repeat(1, G, 1, 1) tiles heads (h % Hkv), which is not the op's GQA: stays repeated, still equal."""
    q, k, v = qkv(kv_shape=(B, HKV, N, D))
    f = lambda q, k, v: torch.softmax(q @ k.repeat(1, H // HKV, 1, 1).transpose(-2, -1), -1) @ v.repeat(1, H // HKV, 1, 1)  # noqa: E731
    c = check(f, q, k, v)
    assert c.rewritten[0].k_shape[1] == H


# ------------------------------------------------------------------------------------ softcap, dropout

def test_softcap():
    f = lambda q, k, v: torch.softmax(torch.tanh(q @ k.transpose(-2, -1) * 0.25 / 5.0) * 5.0, -1) @ v  # noqa: E731
    q, k, v = (t * 4 for t in qkv())  # large scores so the cap matters
    c = check(f, q, k, v)
    assert c.rewritten[0].softcap == 5.0


class DropoutAttention(nn.Module):
    def __init__(self, p):
        super().__init__()
        self.drop = nn.Dropout(p)

    def forward(self, q, k, v):
        return self.drop(torch.softmax(q @ k.transpose(-2, -1) * 0.25, -1)) @ v


def test_dropout_eval_is_dropped():
    m = DropoutAttention(0.3).eval()
    c = check(m, *qkv())
    assert c.rewritten[0].dropout_p == 0.0


def test_dropout_training_statistics():
    """With dropout on, outputs differ per draw; their mean over draws matches the no-dropout output,
    and the spread matches eager's dropout spread."""
    torch.manual_seed(0)
    m = DropoutAttention(0.2).train()
    q, k, v = qkv(shape=(1, 2, 16, 8))
    c = Compiled(m)
    outs = torch.stack([c(q, k, v) for _ in range(200)])
    eager = torch.stack([m(q, k, v) for _ in range(200)])
    assert c.rewritten[0].dropout_p == pytest.approx(0.2)
    clean = m.eval()(q, k, v)
    m.train()
    # mean: within 5 standard errors of the clean output, element-wise
    se = eager.std(0) / math.sqrt(200)
    assert ((outs.mean(0) - clean).abs() <= 5 * se + 1e-6).float().mean() > 0.99
    # variance of the compiled draws matches eager's within 25% on average
    ratio = outs.var(0).mean() / eager.var(0).mean()
    assert 0.75 < ratio.item() < 1.25, ratio


# --------------------------------------------------------------------------------------------- masks

class NanoGPT(nn.Module):
    """nanoGPT's CausalSelfAttention (non-flash path): registered tril buffer sliced to [:T, :T]."""

    def __init__(self, n_embd=32, n_head=4, block_size=16):
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.n_head = n_head
        self.register_buffer("bias", torch.tril(torch.ones(block_size, block_size)).view(1, 1, block_size, block_size))

    def forward(self, x):
        b, t, c = x.size()
        q, k, v = self.c_attn(x).split(c, dim=2)
        k = k.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        q = q.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        v = v.view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :t, :t] == 0, float("-inf"))
        att = F.softmax(att, dim=-1)
        y = att @ v
        y = y.transpose(1, 2).contiguous().view(b, t, c)
        return self.c_proj(y)


def causal_where_min(q, k, v):
    n = q.shape[-2]
    keep = torch.ones(n, n, dtype=torch.bool).tril()
    s = q @ k.transpose(-2, -1) * 0.25
    return torch.softmax(torch.where(keep, s, torch.finfo(s.dtype).min), -1) @ v


def additive_mask_first(q, k, v, m):
    return torch.softmax(m + q @ k.transpose(-2, -1) * 0.25, -1) @ v


def alibi_bias(q, k, v):
    n = q.shape[-2]
    slopes = torch.tensor([2.0 ** -(i + 1) for i in range(q.shape[1])]).view(1, -1, 1, 1)
    pos = torch.arange(n)
    bias = -(pos.view(1, n) - pos.view(n, 1)).abs().float() * slopes
    return torch.softmax(q @ k.transpose(-2, -1) * 0.25 + bias, -1) @ v


def padding_mask(q, k, v, keep):  # keep: bool [B, Nk]
    s = (q @ k.transpose(-2, -1)) * 0.25
    s = s.masked_fill(~keep[:, None, None, :], float("-inf"))
    return torch.softmax(s, -1) @ v


def test_nanogpt_causal_training_matches_eager():
    torch.manual_seed(0)
    m = NanoGPT()
    ref = NanoGPT()
    ref.load_state_dict(m.state_dict())
    x = rand(2, 12, 32, requires_grad=True)
    xr = x.detach().clone().requires_grad_(True)
    c = Compiled(m, inner="aot_eager")
    out = c(x)
    torch.testing.assert_close(out, ref(xr), **TOL[torch.float32])
    assert len(c.rewritten) == 1 and c.rewritten[0].mask == "causal"
    g = rand(*out.shape, seed=5)
    out.backward(g)
    ref(xr).backward(g)
    torch.testing.assert_close(x.grad, xr.grad, atol=1e-4, rtol=1e-4)
    for (name, p), pr in zip(m.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, pr.grad, atol=1e-4, rtol=1e-4, msg=name)


def test_causal_where_finfo_min():
    c = check(causal_where_min, *qkv())
    assert c.rewritten[0].mask == "causal"


def test_additive_mask_operand_first():
    q, k, v = qkv()
    m = rand(B, 1, N, N, seed=9)
    check(additive_mask_first, q, k, v, m)


def test_alibi_bias():
    check(alibi_bias, *qkv())


def test_key_padding_mask():
    q, k, v = qkv()
    keep = torch.ones(B, N, dtype=torch.bool)
    keep[1, 5:] = False
    check(padding_mask, q, k, v, keep)


def full_inf_triu(q, k, v):
    n = q.shape[-2]
    return torch.softmax(q @ k.transpose(-2, -1) * 0.25 + torch.full((n, n), float("-inf")).triu(1), -1) @ v


def arange_sliding_window(q, k, v):
    n = q.shape[-2]
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    keep = (j <= i) & (j > i - 3)
    return torch.softmax((q @ k.transpose(-2, -1) * 0.25).masked_fill(~keep, float("-inf")), -1) @ v


def causal_and_padding(q, k, v, keep):
    n = q.shape[-2]
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    s = (q @ k.transpose(-2, -1) * 0.25).masked_fill(~(causal & keep[:, None, None, :]), torch.finfo(q.dtype).min)
    return torch.softmax(s, -1) @ v


class RelativeBias(nn.Module):
    """T5 / Swin style: a learned bias [1, H, N, N] added to unscaled scores."""

    def __init__(self):
        super().__init__()
        self.bias = nn.Parameter(torch.randn(1, H, N, N) * 0.5)

    def forward(self, q, k, v):
        return torch.softmax(q @ k.transpose(-2, -1) + self.bias, -1) @ v


@pytest.mark.parametrize("fn,kind", [(full_inf_triu, "causal"), (arange_sliding_window, "window")],
                         ids=["full_inf_triu", "arange_window"])
def test_structural_masks(fn, kind):
    c = check(fn, *qkv())
    assert c.rewritten[0].mask == kind


def test_causal_combined_with_padding():
    q, k, v = qkv()
    keep = torch.ones(B, N, dtype=torch.bool)
    keep[0, 6:] = False
    check(causal_and_padding, q, k, v, keep)


def test_relative_position_bias_trains():
    m = RelativeBias()
    q, k, v = (t.requires_grad_(True) for t in qkv())
    c = Compiled(m, inner="aot_eager")
    out = c(q, k, v)
    assert len(c.rewritten) == 1
    g = rand(*out.shape, seed=4)
    got = torch.autograd.grad(out, [q, k, v, m.bias], g)
    ref = m(q, k, v)
    torch.testing.assert_close(out, ref, **TOL[torch.float32])
    want = torch.autograd.grad(ref, [q, k, v, m.bias], g)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_clamp_to_finfo_min_after_mask_keeps_empty_rows_uniform():
    """OPT/XGLM: max(s, finfo.min) after a -inf mask; a fully masked row is then uniform (mean of V), not NaN."""
    def f(q, k, v, keep):
        s = (q @ k.transpose(-2, -1) * 0.25).masked_fill(~keep, float("-inf"))
        s = torch.max(s, torch.full((), torch.finfo(s.dtype).min))
        return torch.softmax(s, -1) @ v

    q, k, v = qkv()
    keep = rand(B, 1, N, N, seed=12) > 0
    keep[0, 0, 3] = False  # one fully masked row
    c = check(f, q, k, v, keep)
    assert not torch.isnan(c.fn(q, k, v, keep)).any()


def _additive_min_mask(keep, dtype):
    """BART / XGLM's 4-d mask: 0 where a key is kept, finfo.min elsewhere."""
    return torch.zeros(keep.shape, dtype=dtype).masked_fill(~keep, torch.finfo(dtype).min)


def clamp_after_additive_mask(q, k, v, keep):
    """XGLM: scores + a 0 / finfo.min mask, then max(s, finfo.min). On a fully masked row every score
    ties the clamp, and torch.maximum's backward gives each tied operand half the gradient."""
    s = q @ k.transpose(-2, -1) * 0.25 + _additive_min_mask(keep, q.dtype)
    s = torch.max(s, torch.full((), torch.finfo(s.dtype).min))
    return torch.softmax(s, -1) @ v


def clamp_after_mask_input(q, k, v, mask):
    """The same with the float mask given as data: the op adds it itself."""
    s = torch.max(q @ k.transpose(-2, -1) * 0.25 + mask, torch.full((), torch.finfo(q.dtype).min))
    return torch.softmax(s, -1) @ v


def clamp_min_after_additive_mask(q, k, v, keep):
    """The clamp spelled clamp(min=finfo.min): its backward passes the whole gradient where s >= min, ties too."""
    s = q @ k.transpose(-2, -1) * 0.25 + _additive_min_mask(keep, q.dtype)
    return torch.softmax(s.clamp(min=torch.finfo(s.dtype).min), -1) @ v


def torch_clamp_min_after_additive_mask(q, k, v, keep):
    s = q @ k.transpose(-2, -1) * 0.25 + _additive_min_mask(keep, q.dtype)
    return torch.softmax(torch.clamp_min(s, torch.finfo(s.dtype).min), -1) @ v


def clamp_after_neg_inf_mask(q, k, v, keep):
    """clamp(s, finfo.min) positionally after a -inf fill: a fully masked row is uniform, not NaN."""
    s = (q @ k.transpose(-2, -1) * 0.25).masked_fill(~keep, float("-inf"))
    return torch.softmax(torch.clamp(s, torch.finfo(s.dtype).min), -1) @ v


@pytest.mark.parametrize("fn", [clamp_min_after_additive_mask, torch_clamp_min_after_additive_mask,
                                clamp_after_neg_inf_mask], ids=lambda f: f.__name__)
def test_clamp_spellings_keep_the_whole_gradient_of_fully_masked_rows(fn):
    q, k, v = (rand(B, H, N, D, seed=30 + i, requires_grad=True) for i in range(3))
    keep = torch.ones(B, 1, N, N, dtype=torch.bool).tril()
    keep[1, :, :, :3] = False
    res = diff_check(fn, [q, k, v, keep], inner="aot_eager")
    assert len(res.rewritten) == 1, res.reasons


@pytest.mark.parametrize("inner", ["aot_eager", "inductor"])
@pytest.mark.parametrize("mask_as_input", [False, True], ids=["mask_in_graph", "mask_input"])
def test_clamp_ties_halve_the_gradient_of_fully_masked_rows(inner, mask_as_input):
    q, k, v = (rand(B, H, N, D, seed=20 + i, requires_grad=True) for i in range(3))
    keep = torch.ones(B, 1, N, N, dtype=torch.bool).tril()
    keep[1, :, :, :3] = False  # left padding under causality: the first 3 queries of batch 1 see no key
    last = _additive_min_mask(keep, torch.float32) if mask_as_input else keep
    fn = clamp_after_mask_input if mask_as_input else clamp_after_additive_mask
    res = diff_check(fn, [q, k, v, last], inner=inner)
    assert len(res.rewritten) == 1, res.reasons


def fill_then_scale(q, k, v):
    n = q.shape[-2]
    s = (q @ k.transpose(-2, -1)).masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(s / math.sqrt(q.shape[-1]), -1) @ v


def min_fill_then_scale_overflows(q, k, v):
    """finfo.min * 4 overflows to -inf in eager: the op gets eager's -inf, so a fully masked row stays NaN."""
    n = q.shape[-2]
    s = (q @ k.transpose(-2, -1)).masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), torch.finfo(q.dtype).min)
    return torch.softmax(s * 4.0, -1) @ v


def bias_then_scale(q, k, v, m):
    return torch.softmax((q @ k.transpose(-2, -1) + m) * 0.25, -1) @ v


@pytest.mark.parametrize("fn", [fill_then_scale, min_fill_then_scale_overflows], ids=lambda f: f.__name__)
def test_mask_applied_before_the_scale(fn):
    c = check(fn, *qkv())
    assert c.rewritten[0].mask == "causal"


def test_bias_added_before_the_scale():
    q, k, v = qkv()
    check(bias_then_scale, q, k, v, rand(B, 1, N, N, seed=13))


def test_baddbmm_with_additive_input():
    """BLOOM-style: baddbmm(alibi, q, k^T, beta=1, alpha=1/sqrt(d)) adds the bias inside the contraction."""
    def f(q, k, v, bias):
        b, h, n, d = q.shape
        q3, k3, v3 = (t.reshape(b * h, n, d) for t in (q, k, v))
        s = torch.baddbmm(bias, q3, k3.transpose(1, 2), beta=1.0, alpha=d ** -0.5)
        return torch.bmm(torch.softmax(s, -1), v3).view(b, h, n, d)

    q, k, v = qkv()
    check(f, q, k, v, rand(B * H, 1, N, seed=7))


def test_scores_regrouped_between_3d_and_4d():
    """Scores computed [B*H, N, N], viewed [B, H, N, N] to add a mask, back to 3-D for the bmm with V."""
    def f(q, k, v, mask):
        b, h, n, d = q.shape
        s = torch.bmm(q.reshape(b * h, n, d), k.reshape(b * h, n, d).transpose(1, 2)).view(b, h, n, n) * 0.25 + mask
        p = torch.softmax(s, -1).view(b * h, n, n)
        return torch.bmm(p, v.reshape(b * h, n, d)).view(b, h, n, d)

    q, k, v = qkv()
    c = check(f, q, k, v, rand(B, 1, 1, N, seed=3))
    assert c.rewritten[0].q_shape == (B, H, N, D)  # the op sees the 4-D q, not a reshape of a reshape


def test_tensor_scale_applied_in_a_regrouped_view():
    """A per-(batch*head) temperature multiplies [B*H, N, N] scores that softmax sees as [B, H, N, N]."""
    def f(q, k, v, t):
        b, h, n, d = q.shape
        s = torch.bmm(q.reshape(b * h, n, d), k.reshape(b * h, n, d).transpose(1, 2)) * t
        p = torch.softmax(s.view(b, h, n, n), -1).view(b * h, n, n)
        return torch.bmm(p, v.reshape(b * h, n, d)).view(b, h, n, d)

    q, k, v = qkv()
    check(f, q, k, v, rand(B * H, 1, 1, seed=8).abs())


def swin_windows(q, k, v, rel, mask):
    """Swin (timm): relative bias, then the window mask added in a [B, nW, H, N, N] view of the scores."""
    nw = mask.shape[0]
    attn = (q * 0.25) @ k.transpose(-2, -1)
    attn = attn + rel.unsqueeze(0)
    b_, h, n, _ = attn.shape
    attn = attn.view(-1, nw, h, n, n) + mask.unsqueeze(1).unsqueeze(0)
    attn = attn.view(-1, h, n, n).softmax(-1)
    return (attn @ v).transpose(1, 2).reshape(b_, n, -1)


def test_swin_window_mask_in_a_regrouped_view():
    q, k, v = qkv(shape=(6, 2, 9, 8))
    mask = torch.where(rand(3, 9, 9, seed=5) > 0.3, 0.0, -100.0)
    c = check(swin_windows, q, k, v, rand(2, 9, 9, seed=6), mask)
    assert c.rewritten[0].scale == pytest.approx(0.25)


def test_cross_attention_nq_ne_nk_and_dv_ne_d():
    q, k, v = rand(B, H, 5, 16), rand(B, H, 11, 16, seed=1), rand(B, H, 11, 24, seed=2)
    c = check(SCALE_FORMS["div_sqrt_d"], q, k, v)
    r = c.rewritten[0]
    assert r.q_shape == (B, H, 5, 16) and r.v_shape == (B, H, 11, 24)


def test_einsum_reads_bshd_directly():
    def f(q, k, v):
        s = torch.einsum("bqhd,bkhd->bhqk", q, k) * 0.25
        return torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), v)

    c = check(f, *qkv(shape=(B, N, H, D)))
    assert c.rewritten[0].q_shape == (B, H, N, D)


def mqa_einsum(q, k, v):  # one K / V for every head, not repeated (PaLM-style multi-query code)
    s = torch.einsum("bhid,bjd->bhij", q, k) * 0.25
    return torch.einsum("bhij,bjd->bhid", s.softmax(-1), v)


def gqa_einsum(q, k, v):  # q grouped as [B, N, Hkv, G, D] against a [B, N, Hkv, D] cache
    b, n, h, d = q.shape
    qg = q.view(b, n, HKV, h // HKV, d)
    s = torch.einsum("bqhgd,bkhd->bhgqk", qg, k) * 0.25
    return torch.einsum("bhgqk,bkhd->bqhgd", s.softmax(-1), v).reshape(b, n, h, d)


def heads_mixed(q, k, v):  # the extra letter summed away after the softmax: not attention per head
    s = torch.einsum("bhid,bjd->bhij", q, k) * 0.25
    return torch.einsum("bhij,bjd->bid", s.softmax(-1), v)


@pytest.mark.parametrize("fn", [mqa_einsum, gqa_einsum, heads_mixed], ids=lambda f: f.__name__)
def test_einsum_with_query_heads_the_keys_lack(fn):
    # were refused: "scores are not a Q·Kᵀ contraction (reached einsum)" (a second row letter)
    if fn is mqa_einsum:
        args = [rand(B, H, N, D), rand(B, N, D, seed=1), rand(B, N, D, seed=2)]
    else:
        args = [rand(B, N, H, D), rand(B, N, HKV, D, seed=1), rand(B, N, HKV, D, seed=2)]
    if fn is heads_mixed:
        args = [rand(B, H, N, D), rand(B, N, D, seed=1), rand(B, N, D, seed=2)]
    diff_check(fn, [a.requires_grad_(True) for a in args], rewritten=0 if fn is heads_mixed else 1)


class TestPinnedEinsumGroups(expecttest.TestCase):
    def test_pinned_mqa_einsum(self):
        # K and V reach the op as one kv head (a view), which it shares among the query heads: no repeat
        args = [rand(B, H, N, D), rand(B, N, D, seed=1), rand(B, N, D, seed=2)]
        self.assertExpectedInline(pinned(mqa_einsum, *args), """\
unsqueeze(l_k_, 1)
unsqueeze(l_v_, 1)
fa3.attention(l_q_, unsqueeze, unsqueeze_1, 0.25, False, 0, -1, -1, None, None, 0.0, 0.0, None, None)
getitem(attention_default, 0)
contiguous(getitem)""")


# ------------------------------------------------------------------------------------------- training

@pytest.mark.parametrize("form", ["repeat_kv", "bshd", "per_head_temperature"])
def test_training_grads_match_eager(form):
    fn = {"repeat_kv": GQA_FORMS["repeat_kv"], "bshd": bshd, "per_head_temperature": PerHeadTemperature()}[form]
    kv_shape = (B, HKV, N, D) if form == "repeat_kv" else None
    shape = (B, N, H, D) if form == "bshd" else (B, H, N, D)
    q, k, v = (t.requires_grad_(True) for t in qkv(shape=shape, kv_shape=kv_shape if kv_shape else shape))
    c = Compiled(fn, inner="aot_eager")
    out = c(q, k, v)
    assert len(c.rewritten) == 1
    g = rand(*out.shape, seed=11)
    grads = torch.autograd.grad(out, [q, k, v] + list(getattr(fn, "parameters", lambda: [])()), g)
    ref = fn(q, k, v)
    torch.testing.assert_close(out, ref, **TOL[torch.float32])
    ref_grads = torch.autograd.grad(ref, [q, k, v] + list(getattr(fn, "parameters", lambda: [])()), g)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


# ------------------------------------------------------------------------------- misses (each a reason)

class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.head = nn.Linear(D, 3)

    def forward(self, q, k, v):
        return torch.softmax(self.head(q), dim=-1)


def returns_probs(q, k, v):
    p = torch.softmax(q @ k.transpose(-2, -1) * 0.25, -1)
    return p @ v, p


def returns_scores(q, k, v):
    s = q @ k.transpose(-2, -1) * 0.25
    return torch.softmax(s, -1) @ v, s


def probs_used_twice(q, k, v):
    p = torch.softmax(q @ k.transpose(-2, -1) * 0.25, -1)
    return p @ v + p.sum(-1, keepdim=True)


def softmax_dim_1(q, k, v):
    return torch.softmax(q @ k.transpose(-2, -1), dim=1) @ v


def mask_before_softcap(q, k, v):
    n = q.shape[-2]
    s = (q @ k.transpose(-2, -1)).masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), -1e9)
    return torch.softmax(torch.tanh(s / 5.0) * 5.0, -1) @ v


def elementwise_tensor_mul(q, k, v):
    return torch.softmax(q @ k.transpose(-2, -1) * torch.sigmoid(q @ k.transpose(-2, -1)), -1) @ v


def inplace_scale_elsewhere(q, k, v):
    s = q @ k.transpose(-2, -1)
    rows = s.view(B, H * N, N)  # an alias of the scores read after the write: not functional
    s.div_(4.0)
    return torch.softmax(s, -1) @ v + rows.sum(-1).view(B, H, N, 1)


def probs_transposed(q, k, v):
    p = torch.softmax(q @ k.transpose(-2, -1), -1)
    return p.transpose(-2, -1) @ v


MISSES = {
    "classifier": (Classifier(), "scores are not a Q·Kᵀ contraction"),
    "output_attentions": (returns_probs, "probabilities are also returned to the caller (output_attentions)"),
    "scores_returned": (returns_scores, "also used outside the attention"),
    "probs_used_twice": (probs_used_twice, "probabilities have 2 users"),
    "softmax_dim_1": (softmax_dim_1, "softmax is over dim 1, not the last dim"),
    "mask_before_softcap": (mask_before_softcap, "a mask is applied to the scores before the softcap"),
    "elementwise_tensor_mul": (elementwise_tensor_mul, "multiplied elementwise by a tensor"),
    "inplace_scale": (inplace_scale_elsewhere, "modified in place"),
    "probs_transposed": (probs_transposed, "probabilities feed transpose"),
}


@pytest.mark.parametrize("name", list(MISSES))
def test_missed_sites_say_why(name):
    import fa_compile

    fn, reason = MISSES[name]
    args = qkv()
    c = Compiled(fn)
    out = c(*args)
    torch.testing.assert_close(out, fn(*args), **TOL[torch.float32])
    assert c.op_calls() == 0
    (miss,) = c.missed
    assert reason in miss.reason, miss.reason
    report = fa_compile.explain(fn, *args)
    assert "MISSED" in str(report) and reason in str(report)


def test_unrelated_inplace_op_survives_the_rewrite():
    def f(q, k, v):
        y = q * 2
        y.add_(1)  # an in-place op with no users: DCE must keep it
        return torch.softmax(q @ k.transpose(-2, -1), -1) @ v + y

    check(f, *qkv())


def test_two_sites_in_one_graph():
    def f(q, k, v):
        a = torch.softmax(q @ k.transpose(-2, -1) * 0.25, -1) @ v
        return torch.softmax(a @ k.transpose(-2, -1) * 0.5, -1) @ v

    check(f, *qkv(), rewritten=2)


# ---------------------------------------------------------------------------------- pinned graphs

def summary(gm) -> str:
    """One line per call node: target and arguments (node names), stable across torch versions."""
    lines = []
    for n in gm.graph.nodes:
        if n.op in ("placeholder", "output"):
            continue
        t = n.target if isinstance(n.target, str) else (
            "fa3.attention" if n.target is torch.ops.fa3.attention.default else getattr(n.target, "__name__", str(n.target)))
        args = ", ".join(a.op if False else (a.name if isinstance(a, torch.fx.Node) else repr(a)) for a in n.args)
        lines.append(f"{t}({args})")
    return "\n".join(lines)


def pinned(fn, *args) -> str:
    c = Compiled(fn)
    c(*args)
    return summary(c.graphs[0])


class TestPinnedGraphs(expecttest.TestCase):
    def test_pinned_bhsd_sqrt(self):
        self.assertExpectedInline(pinned(SCALE_FORMS["div_sqrt_d"], *qkv()), """\
fa3.attention(l_q_, l_k_, l_v_, 0.25, False, 0, -1, -1, None, None, 0.0, 0.0, None, None)
getitem(attention_default, 0)
contiguous(getitem)""")

    def test_pinned_bshd(self):
        self.assertExpectedInline(pinned(bshd, *qkv(shape=(B, N, H, D))), """\
permute(l_q_, (0, 2, 1, 3))
permute(l_k_, (0, 2, 1, 3))
permute(l_v_, (0, 2, 1, 3))
fa3.attention(permute, permute_1, permute_2, 0.25, False, 0, -1, -1, None, None, 0.0, 0.0, None, None)
getitem(attention_default, 0)
transpose(getitem, 1, 2)
reshape(transpose_4, 2, 8, -1)""")

    def test_pinned_repeat_kv(self):
        self.assertExpectedInline(pinned(GQA_FORMS["repeat_kv"], *qkv(kv_shape=(B, HKV, N, D))), """\
fa3.attention(l_q_, l_k_, l_v_, 0.25, False, 0, -1, -1, None, None, 0.0, 0.0, None, None)
getitem(attention_default, 0)
contiguous(getitem_2)""")

    def test_pinned_bmm_3d(self):
        self.assertExpectedInline(pinned(bmm_3d, *qkv()), """\
reshape(l_q_, 8, 8, 16)
reshape(l_k_, 8, 8, 16)
reshape(l_v_, 8, 8, 16)
unsqueeze(q3, 1)
unsqueeze(k3, 1)
unsqueeze(v3, 1)
fa3.attention(unsqueeze, unsqueeze_1, unsqueeze_2, 0.25, False, 0, -1, -1, None, None, 0.0, 0.0, None, None)
getitem(attention_default, 0)
squeeze(getitem, 1)
view(squeeze, 2, 4, 8, 16)""")


def mask_expanded_as_the_scores(q, k, v, keep):
    """XLM: the [B, 1, 1, N] mask expanded to the scores' shape with expand_as, then masked_fill_."""
    s = q @ k.transpose(-2, -1) * 0.25
    s.masked_fill_(~keep.expand_as(s), torch.finfo(s.dtype).min)
    return torch.softmax(s, -1) @ v


def bias_reshaped_as_the_scores(q, k, v, bias):
    """SAM: a bias of the scores' element count reshaped to their shape with reshape_as."""
    s = q @ k.transpose(-2, -1) * 0.25
    return torch.softmax(s + bias.reshape_as(s), -1) @ v


@pytest.mark.parametrize("fn", [mask_expanded_as_the_scores, bias_reshaped_as_the_scores], ids=lambda f: f.__name__)
def test_the_scores_read_for_their_shape_only(fn):
    """`x.expand_as(s)` / `x.reshape_as(s)` read only the scores' shape: no second use of their values."""
    q, k, v = (rand(B, H, N, D, seed=30 + i, requires_grad=True) for i in range(3))
    if fn is mask_expanded_as_the_scores:
        last = torch.ones(B, 1, 1, N, dtype=torch.bool)
        last[1, ..., 5:] = False
    else:
        last = rand(B * H, N, N, seed=34)
    res = diff_check(fn, [q, k, v, last])
    assert len(res.rewritten) == 1, res.reasons
