"""Training graphs whose fully masked rows carry eager's gradient through what lies between the scores
and the mask: a softcap under an additive finfo.min mask (Gemma2 with padding), and a finfo.min fill
(`where(window, s, min)`) followed by an additive finfo.min mask (GPT-Neo's local layers with padding),
whose filled scores get no gradient in eager. The rewrite keeps eager's outputs and every gradient, on
every element."""
from __future__ import annotations

import math

import pytest
import torch

import fa_compile
import fa_compile.ops  # noqa: F401  (registers torch.ops.fa3)
from conftest import TOL, Compiled

transformers = pytest.importorskip("transformers")

B, HQ, HKV, N, D = 3, 4, 2, 8, 8
CAP = 5.0  # small enough that tanh' differs visibly from 1 on scores of unit size


def _left_padded_keep(n: int = N) -> torch.Tensor:
    """Causal AND left padding, [B, 1, N, N]: row 1 pads 3 keys (its queries 0-2 see none), row 2
    pads every key (all of its queries see none)."""
    am = torch.ones(B, n, dtype=torch.bool)
    am[1, :3] = False
    am[2, :] = False
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    return (causal[None] & am[:, None, :])[:, None]


def softcapped_attention(q, k, v, keep, cap: float = CAP):
    """Gemma2's eager attention: repeat_kv for GQA, scale, softcap, + the additive finfo.min mask that
    Hugging Face builds from the bool keep-mask, softmax, @ V."""
    mask = torch.where(keep, torch.tensor(0.0, dtype=q.dtype), torch.finfo(q.dtype).min)
    g = q.shape[1] // k.shape[1]
    b, h, n, d = k.shape
    k = k[:, :, None].expand(b, h, g, n, d).reshape(b, h * g, n, d)
    v = v[:, :, None].expand(b, h, g, n, v.shape[-1]).reshape(b, h * g, n, v.shape[-1])
    s = torch.matmul(q, k.transpose(2, 3)) * d ** -0.5
    s = torch.tanh(s / cap) * cap
    s = s + mask
    p = torch.softmax(s, dim=-1, dtype=torch.promote_types(s.dtype, torch.float32)).to(q.dtype)
    return torch.matmul(p, v)


class SoftcappedLayer(torch.nn.Module):
    """Projections around softcapped_attention, so that parameter gradients pass through it."""

    def __init__(self, dim: int = 16):
        super().__init__()
        self.q = torch.nn.Linear(dim, HQ * D, bias=False)
        self.k = torch.nn.Linear(dim, HKV * D, bias=False)
        self.v = torch.nn.Linear(dim, HKV * D, bias=False)
        self.o = torch.nn.Linear(HQ * D, dim, bias=False)

    def forward(self, x, keep):
        b, n, _ = x.shape
        q = self.q(x).view(b, n, HQ, D).transpose(1, 2)
        k = self.k(x).view(b, n, HKV, D).transpose(1, 2)
        v = self.v(x).view(b, n, HKV, D).transpose(1, 2)
        return self.o(softcapped_attention(q, k, v, keep).transpose(1, 2).reshape(b, n, HQ * D))


def _assert_grads_equal(got, want, dtype, names):
    for name, a, b in zip(names, got, want):
        torch.testing.assert_close(a, b, **TOL[dtype], msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_softcap_left_padding_training_keeps_eagers_gradients(dtype):
    gen = torch.Generator().manual_seed(0)
    q = (torch.randn(B, HQ, N, D, generator=gen, dtype=dtype) * 3).requires_grad_()
    k = (torch.randn(B, HKV, N, D, generator=gen, dtype=dtype) * 3).requires_grad_()
    v = torch.randn(B, HKV, N, D, generator=gen, dtype=dtype).requires_grad_()
    keep = _left_padded_keep()
    c = Compiled(softcapped_attention, inner="aot_eager")
    out = c(q, k, v, keep)
    assert len(c.rewritten) == 1 and not c.missed, [r.reason for r in c.missed]
    assert any(n.target is torch.ops.fa3.uniform_row_grad.default for gm in c.graphs for n in gm.graph.nodes)
    ref = softcapped_attention(q, k, v, keep)
    torch.testing.assert_close(out, ref, **TOL[dtype])
    dout = torch.randn(ref.shape, generator=gen, dtype=dtype)
    want = torch.autograd.grad(ref, (q, k, v), dout)
    # the fully masked rows' gradient is not negligible: without it dq / dk would differ
    assert want[0][1, :, :3].abs().amax() > 1e-2 and want[0][2].abs().amax() > 1e-2
    _assert_grads_equal(torch.autograd.grad(out, (q, k, v), dout), want, dtype, ("dq", "dk", "dv"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_softcap_left_padding_layer_parameter_gradients(dtype):
    torch.manual_seed(1)
    layer = SoftcappedLayer().to(dtype)
    x = (torch.randn(B, N, 16, dtype=dtype) * 2).requires_grad_()
    keep = _left_padded_keep()
    torch._dynamo.reset()
    report = fa_compile.explain(layer, x, keep)
    assert len(report.rows) == 1 and len(report.rewritten) == 1, str(report)
    assert "with exact gradient of fully masked rows (fa3.uniform_row_grad)" in report.table(), report.table()
    torch._dynamo.reset()
    out = torch.compile(layer, backend="fa3")(x, keep)
    ref = layer(x, keep)
    torch.testing.assert_close(out, ref, **TOL[dtype])
    dout = torch.randn(ref.shape, dtype=dtype)
    params = [x, *layer.parameters()]
    got = torch.autograd.grad(out, params, dout)
    want = torch.autograd.grad(ref, params, dout)
    _assert_grads_equal(got, want, dtype, ["x", *(n for n, _ in layer.named_parameters())])


def _softcap_reference(dg, q, k, v, scale, cap):
    """uniform_row_grad_backward written with autograd in fp64: softmax's backward at uniform P through
    the softcap of every raw score, on every row."""
    qd, kd = q.detach().double().requires_grad_(), k.detach().double().requires_grad_()
    g = q.shape[1] // k.shape[1]
    kr = kd.repeat_interleave(g, dim=1)
    vc = v.double() - v.double().mean(dim=2, keepdim=True)
    raw = qd @ kr.transpose(-1, -2) * scale
    s = torch.tanh(raw / cap) * cap
    # d/ds of sum_ij s_ij * ds_ij with ds_ij = dg_i . vc_j / Nk fixed: the backward at uniform P
    ds = dg.double() @ vc.repeat_interleave(g, dim=1).transpose(-1, -2) / k.shape[2]
    return torch.autograd.grad((s * ds).sum(), (qd, kd))


@pytest.mark.parametrize("hq,hkv,live", [(4, 4, "some"), (4, 2, "some"), (6, 1, "all"), (4, 2, "none"), (4, 2, "nan")])
def test_uniform_row_grad_softcap_op_matches_reference(hq, hkv, live):
    gen = torch.Generator().manual_seed(hq * 10 + hkv)
    q = torch.randn(2, hq, 5, 8, dtype=torch.float32, generator=gen, requires_grad=True)
    k = torch.randn(2, hkv, 7, 8, dtype=torch.float32, generator=gen, requires_grad=True)
    v = torch.randn(2, hkv, 7, 3, dtype=torch.float32, generator=gen)
    dg = torch.randn(2, hq, 5, 3, dtype=torch.float32, generator=gen)
    if live == "some":  # nonzero on a few (batch, head, query) rows only, as torch.where passes it
        dg = dg * (torch.rand(2, hq, 5, 1, generator=gen) < 0.3)
    elif live == "none":
        dg = torch.zeros_like(dg)
    out = torch.ops.fa3.uniform_row_grad(q, k, v, 0.7, 2.0)
    assert out.shape == (2, hq, 5, 3) and not out.any()
    dq, dk = torch.autograd.grad(out, (q, k), dg)
    rq, rk = _softcap_reference(dg, q, k, v, 0.7, 2.0)
    torch.testing.assert_close(dq.double(), rq, **TOL[torch.float32])
    torch.testing.assert_close(dk.double(), rk, **TOL[torch.float32])
    assert dq.dtype == q.dtype and dk.dtype == k.dtype


@pytest.mark.parametrize("hq,hkv,live", [(4, 4, "some"), (4, 2, "some"), (6, 1, "all"), (4, 2, "none"), (4, 2, "nan")])
def test_uniform_row_grad_cpu_backward_skips_dead_rows(hq, hkv, live, monkeypatch):
    """On CPU the gradient without a softcap comes from fa3::uniform_row_grad_backward (softcap 0), which
    returns zeros without any matmul when no row of dg is nonzero, and the factorized terms otherwise:
    both equal softmax's backward at uniform P in fp64, on every element."""
    import fa_compile.row_fixups as ops

    gen = torch.Generator().manual_seed(hq * 7 + hkv)
    q = torch.randn(2, hq, 5, 8, dtype=torch.float32, generator=gen, requires_grad=True)
    k = torch.randn(2, hkv, 7, 8, dtype=torch.float32, generator=gen, requires_grad=True)
    v = torch.randn(2, hkv, 7, 3, dtype=torch.float32, generator=gen)
    dg = torch.randn(2, hq, 5, 3, dtype=torch.float32, generator=gen)
    if live == "some":
        dg = dg * (torch.rand(2, hq, 5, 1, generator=gen) < 0.3)
    elif live == "none":
        dg = torch.zeros_like(dg)
    elif live == "nan":  # a NaN is not a zero: it must reach the gradients as in eager
        dg = torch.zeros_like(dg)
        dg[0, 1, 2, 0] = float("nan")
    calls = []
    real = ops._uniform_grads
    monkeypatch.setattr(ops, "_uniform_grads", lambda *a: calls.append(1) or real(*a))
    out = torch.ops.fa3.uniform_row_grad(q, k, v, 0.7)
    dq, dk = torch.autograd.grad(out, (q, k), dg)
    assert len(calls) == (0 if live == "none" else 1)
    g = hq // hkv
    qd, kd = q.detach().double().requires_grad_(), k.detach().double().requires_grad_()
    vc = v.double() - v.double().mean(dim=2, keepdim=True)
    raw = qd @ kd.repeat_interleave(g, dim=1).transpose(-1, -2) * 0.7
    ds = dg.double() @ vc.repeat_interleave(g, dim=1).transpose(-1, -2) / k.shape[2]
    rq, rk = torch.autograd.grad((raw * ds).sum(), (qd, kd))
    torch.testing.assert_close(dq.double(), rq, equal_nan=live == "nan", **TOL[torch.float32])
    torch.testing.assert_close(dk.double(), rk, equal_nan=live == "nan", **TOL[torch.float32])
    if live == "nan":
        assert dq.isnan().any() and dk.isnan().any()
    if live == "none":
        assert not dq.any() and not dk.any()


def test_uniform_row_grad_softcap_op_blocks_and_no_keys(monkeypatch):
    """Query positions split over several blocks give the same sums; no keys give zero gradients."""
    import fa_compile.row_fixups as ops

    gen = torch.Generator().manual_seed(5)
    q = torch.randn(1, 2, 9, 4, dtype=torch.float64, generator=gen)
    k = torch.randn(1, 1, 6, 4, dtype=torch.float64, generator=gen)
    v = torch.randn(1, 1, 6, 2, dtype=torch.float64, generator=gen)
    dg = torch.randn(1, 2, 9, 2, dtype=torch.float64, generator=gen)
    monkeypatch.setattr(ops, "_ROW_BLOCK_NUMEL", 2 * 6 * 2)  # two query positions per block
    dq, dk = torch.ops.fa3.uniform_row_grad_backward(dg, q, k, v, 0.5, 3.0)
    rq, rk = _softcap_reference(dg, q, k, v, 0.5, 3.0)
    torch.testing.assert_close(dq, rq, **TOL[torch.float64])
    torch.testing.assert_close(dk, rk, **TOL[torch.float64])
    empty_k, empty_v = k[:, :, :0], v[:, :, :0]
    dq0, dk0 = torch.ops.fa3.uniform_row_grad_backward(dg, q, empty_k, empty_v, 0.5, 3.0)
    assert dq0.shape == q.shape and not dq0.any() and dk0.shape == empty_k.shape


def test_hf_gemma2_left_padding_trains_with_every_site_rewritten():
    """Hugging Face's Gemma2 (softcap, sliding and full layers, GQA) from a tiny config, left padding in
    training: both sites rewritten, outputs and every parameter gradient equal to eager."""
    torch.manual_seed(0)
    cfg = transformers.Gemma2Config(
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8, hidden_size=32,
        intermediate_size=64, vocab_size=50, sliding_window=4, attn_logit_softcapping=2.0,
        query_pre_attn_scalar=8, layer_types=["sliding_attention", "full_attention"], attn_implementation="eager")
    model = transformers.Gemma2Model(cfg).train()
    ids = torch.randint(0, 50, (2, 8))
    am = torch.ones(2, 8, dtype=torch.long)
    am[1, :3] = 0
    c = Compiled(model, inner="aot_eager", fullgraph=False)
    out = c(ids, attention_mask=am).last_hidden_state
    assert len(c.reports) == 2 and len(c.rewritten) == 2, [r.reason for r in c.missed]
    assert all(r.softcap == 2.0 for r in c.rewritten)
    ref = model(ids, attention_mask=am).last_hidden_state
    torch.testing.assert_close(out, ref, **TOL[torch.float32])
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    params = [p for p in model.parameters() if p.requires_grad]
    got = torch.autograd.grad(out, params, g, allow_unused=True)
    want = torch.autograd.grad(ref, params, g, allow_unused=True)
    for (name, p), a, b in zip(model.named_parameters(), got, want):
        a = torch.zeros_like(p) if a is None else a
        b = torch.zeros_like(p) if b is None else b
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4, msg=name)



WINDOW = 2


class WhereThenMask(torch.nn.Module):
    """GPT-Neo's eager attention (no scale): `where(window_buffer, s, finfo.min)`, then + Hugging Face's
    additive causal + padding mask (finfo.min), softmax, @ V."""

    def __init__(self, window: int = WINDOW, n: int = 16, fill: float = float(torch.finfo(torch.float32).min)):
        super().__init__()
        self.fill = fill  # GPT-Neo's scores are fp32: finfo(fp32).min
        bias = torch.ones(n, n, dtype=torch.bool).tril()
        if window:
            bias = torch.bitwise_xor(bias, torch.tril(bias, -window))
        self.register_buffer("bias", bias.view(1, 1, n, n), persistent=False)

    def forward(self, q, k, v, am):
        ql, kl = q.shape[-2], k.shape[-2]
        s = torch.matmul(q, k.transpose(-1, -2))
        m = torch.tensor(self.fill, dtype=s.dtype) if s.dtype == torch.float32 else self.fill  # GPT-Neo's spelling
        s = torch.where(self.bias[:, :, kl - ql:kl, :kl], s, m)
        keep = torch.ones(ql, kl, dtype=torch.bool).tril()[None, None] & am[:, None, None, :].bool()
        s = s + torch.where(keep, torch.tensor(0.0, dtype=s.dtype), self.fill)
        return torch.matmul(torch.softmax(s, dim=-1), v)


def _padding(how: str) -> torch.Tensor:
    am = torch.ones(B, N, dtype=torch.long)
    if how == "left":
        am[1, :3] = 0
    else:  # right padding: queries past the valid keys by a window or more see none in their window
        am[1, 3:] = 0
        am[0, 6:] = 0
    am[2, :] = 0  # every key padded
    return am


def _filled_as_additive(layer: WhereThenMask, q, k, v, am):
    """The same scores with the fill added instead (where(window, 0, min) + mask): equal values, but the
    filled scores get softmax's gradient."""
    ql, kl = q.shape[-2], k.shape[-2]
    s = torch.matmul(q, k.transpose(-1, -2))
    mn = layer.fill
    s = s + torch.where(layer.bias[:, :, kl - ql:kl, :kl], torch.tensor(0.0, dtype=s.dtype), mn)
    keep = torch.ones(ql, kl, dtype=torch.bool).tril()[None, None] & am[:, None, None, :].bool()
    s = s + torch.where(keep, torch.tensor(0.0, dtype=s.dtype), mn)
    return torch.matmul(torch.softmax(s, dim=-1), v)


@pytest.mark.parametrize("window", [WINDOW, 0])
@pytest.mark.parametrize("how", ["left", "right"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fill_then_additive_mask_training_keeps_eagers_gradients(dtype, how, window):
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(B, HQ, N, D, generator=gen, dtype=dtype).requires_grad_() for _ in range(3))
    am = _padding(how)
    # fp64: a fill whose sums stay in fp32's range (the op's lse is fp32; see the test below)
    layer = WhereThenMask(window) if dtype == torch.float32 else WhereThenMask(window, fill=-1e30)
    torch._dynamo.reset()  # a fresh compile: no automatic dynamic sizes or floats from an earlier case
    report = fa_compile.explain(layer, q, k, v, am)
    assert len(report.rows) == 1 and len(report.rewritten) == 1, str(report)
    c = Compiled(layer, inner="aot_eager")
    out = c(q, k, v, am)
    assert len(c.rewritten) == 1, [r.reason for r in c.missed]
    ref = layer(q, k, v, am)
    torch.testing.assert_close(out, ref, **TOL[dtype], equal_nan=True)
    dout = torch.randn(ref.shape, generator=gen, dtype=dtype)
    want = torch.autograd.grad(ref, (q, k, v), dout)
    got = torch.autograd.grad(out, (q, k, v), dout)
    _assert_grads_equal(got, want, dtype, ("dq", "dk", "dv"))
    if window and how == "right":
        # the inputs reach the rows where the op alone would differ: its gradient passes the filled scores
        plain = torch.autograd.grad(_filled_as_additive(layer, q, k, v, am), (q, k, v), dout)
        assert not torch.allclose(plain[0], want[0], **TOL[dtype])
        assert any(n.target is torch.ops.fa3.filled_scores_grad.default for gm in c.graphs for n in gm.graph.nodes)


@pytest.mark.parametrize("blocks", ["one", "several"])
def test_filled_scores_grad_op_is_the_gradient_difference(blocks, monkeypatch):
    """The op's gradient equals eager's (fill: no gradient to the filled scores) minus the additive
    form's (gradient to every score), on every row it is given, softcap and GQA included."""
    if blocks == "several":
        import fa_compile.row_fixups as ops

        monkeypatch.setattr(ops, "_ROW_BLOCK_NUMEL", 2 * 4 * 7 * 2)  # two query positions per block
    gen = torch.Generator().manual_seed(11)
    q = torch.randn(2, 4, 6, 8, dtype=torch.float64, generator=gen, requires_grad=True)
    k = torch.randn(2, 2, 7, 8, dtype=torch.float64, generator=gen, requires_grad=True)
    v = torch.randn(2, 2, 7, 3, dtype=torch.float64, generator=gen)
    filled = torch.rand(2, 1, 6, 7, generator=gen) < 0.5
    other = torch.rand(2, 1, 6, 7, generator=gen) < 0.5
    mn = torch.finfo(torch.float64).min
    zeros = torch.zeros(2, 1, 6, 7, dtype=torch.float64)
    bias = zeros.masked_fill(filled, mn) + zeros.masked_fill(other, mn)
    bias[0, 0, 1] = mn  # a uniform row and an all -inf one
    bias[1, 0, 2] = float("-inf")
    filled[0, 0, 1] = True
    scale, cap = 0.4, 3.0

    def attn(detach_filled: bool):
        kr, vr = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
        s = cap * torch.tanh(q @ kr.transpose(-1, -2) * scale / cap)
        if detach_filled:
            s = torch.where(filled, s.detach(), s)
        z = s + bias
        m = z.amax(dim=-1, keepdim=True).detach()
        e = torch.exp(z - torch.where(torch.isneginf(m), 0.0, m))
        tot = e.sum(dim=-1, keepdim=True)
        return (e / torch.where(tot == 0, 1.0, tot)) @ vr  # softmax, 0 on a row of -inf only

    dout = torch.randn(2, 4, 6, 3, dtype=torch.float64, generator=gen)
    eager = torch.autograd.grad(attn(True), (q, k), dout)
    additive = torch.autograd.grad(attn(False), (q, k), dout)
    zero = torch.ops.fa3.filled_scores_grad(q, k, v, bias, filled, scale, cap)
    assert zero.shape == (2, 4, 6, 3) and not zero.any()
    corr = torch.autograd.grad(zero, (q, k), dout)
    for a, b, c in zip(eager, additive, corr):
        torch.testing.assert_close(b + c, a, **TOL[torch.float64])


@pytest.mark.parametrize("c", [torch.finfo(torch.float64).min, float(torch.finfo(torch.float32).min)])
def test_fill_then_additive_mask_beyond_the_fp32_lse_is_refused(c):
    """fp64 scores with a fill and a mask whose sum leaves fp32's range: a fully masked row's lse would not
    fit the op's fp32 lse (read as an empty row, NaN instead of eager's uniform average)."""
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(B, HQ, N, D, generator=gen, dtype=torch.float64).requires_grad_() for _ in range(3))
    am = _padding("left")
    layer = WhereThenMask(WINDOW, fill=c)
    c_ = Compiled(layer, inner="aot_eager")
    out = c_(q, k, v, am)
    (miss,) = c_.missed
    assert not c_.rewritten and "fp32 log-sum-exp" in miss.reason, miss.reason
    torch.testing.assert_close(out, layer(q, k, v, am), **TOL[torch.float64])


@pytest.mark.parametrize("how", ["left", "right"])
def test_hf_gpt_neo_padding_trains_with_every_site_rewritten(how):
    """Hugging Face's GPT-Neo (global and local layers: `where(window, s, min)` then + the causal/padding
    mask) from a tiny config, padded, in training: both sites rewritten, outputs and every parameter
    gradient equal to eager. Right padding reaches the local layer's rows where the filled scores would
    otherwise get the op's gradient."""
    torch.manual_seed(0)
    cfg = transformers.GPTNeoConfig(
        num_layers=2, attention_types=[[["global", "local"], 1]], hidden_size=32, num_heads=4, vocab_size=50,
        max_position_embeddings=32, window_size=2, bos_token_id=0, eos_token_id=0, embed_dropout=0.0, attention_dropout=0.0, resid_dropout=0.0,
        attn_implementation="eager")
    model = transformers.GPTNeoModel(cfg).train()
    ids = torch.randint(0, 50, (2, 8))
    am = torch.ones(2, 8, dtype=torch.long)
    if how == "left":
        am[1, :3] = 0
    else:
        am[1, 3:] = 0
    c = Compiled(model, inner="aot_eager", fullgraph=False)
    out = c(ids, attention_mask=am).last_hidden_state
    assert len(c.reports) == 2 and len(c.rewritten) == 2, [r.reason for r in c.missed]
    ref = model(ids, attention_mask=am).last_hidden_state
    torch.testing.assert_close(out, ref, **TOL[torch.float32])
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    params = [p for p in model.parameters() if p.requires_grad]
    got = torch.autograd.grad(out, params, g, allow_unused=True)
    want = torch.autograd.grad(ref, params, g, allow_unused=True)
    for (name, p), a, b in zip(model.named_parameters(), got, want):
        a = torch.zeros_like(p) if a is None else a
        b = torch.zeros_like(p) if b is None else b
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4, msg=name)


@pytest.mark.parametrize("case", ["softcap", "filled"])
def test_zero_valued_fixups_become_zeros_after_lowering(case):
    """After AOTAutograd the forward graph makes the fix-ups' zeros itself (no run-time op call): their
    gradient lives in the backward graph (fa3::*_backward), which Inductor compiles around; gradients
    still equal eager's."""
    from fa_compile.lowering import capture_graphs

    gen = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(B, HQ, N, D, generator=gen).requires_grad_() for _ in range(3))
    if case == "softcap":
        fn, args, name = softcapped_attention, (q, k[:, :HKV], v[:, :HKV], _left_padded_keep()), "uniform_row_grad"
    else:
        fn, args, name = WhereThenMask(WINDOW), (q, k, v, _padding("right")), "filled_scores_grad"
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    torch._dynamo.reset()
    # the lowering runs on a real compile only, never on a cache hit
    with inductor_config.patch(fx_graph_cache=False), functorch_config.patch(enable_autograd_cache=False), \
            capture_graphs() as graphs:
        out = torch.compile(fn, backend="fa3")(*args)
        ref = fn(*args)
        dout = torch.randn(ref.shape, generator=gen)
        leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
        got = torch.autograd.grad(out, leaves, dout)  # the backward graph compiles here
    assert graphs and f"{name}.default" not in graphs[0] and "aten.full.default" in graphs[0], graphs[0]
    torch.testing.assert_close(out, ref, **TOL[torch.float32])
    _assert_grads_equal(got, torch.autograd.grad(ref, leaves, dout), torch.float32, ("dq", "dk", "dv"))


def test_float_bias_rows_of_finfo_min_keep_eagers_gradient_after_lowering():
    """A float bias whose every value on some rows is finfo.min (eager: uniform there): lowered on CPU, the
    forward may run aten's CPU flash kernel, the backward must not (its gradient there is off by O(1))."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 6, 8, generator=gen).requires_grad_() for _ in range(3))
    mn = torch.finfo(torch.float32).min
    bias = torch.zeros(2, 1, 6, 6)
    bias[0, :, :2] = mn  # two uniform rows
    bias[1, :, 1, :3], bias[1, :, 1, 3:] = mn, float("-inf")  # uniform over three keys

    def fn(q, k, v, bias):
        return fa_compile.attention(q, k, v, bias=bias)

    torch._dynamo.reset()
    with inductor_config.patch(fx_graph_cache=False), functorch_config.patch(enable_autograd_cache=False):
        out = torch.compile(fn, backend="fa3")(q, k, v, bias)
        dout = torch.randn(out.shape, generator=gen)
        got = torch.autograd.grad(out, (q, k, v), dout)
    ref = torch.softmax(q @ k.transpose(-1, -2) * 8 ** -0.5 + bias, dim=-1) @ v
    torch.testing.assert_close(out, ref, **TOL[torch.float32])
    _assert_grads_equal(got, torch.autograd.grad(ref, (q, k, v), dout), torch.float32, ("dq", "dk", "dv"))


def test_fixup_ops_pass_opcheck():
    """Schemas, fake implementations and autograd registrations of the zero-valued fix-ups and their
    backward ops agree with their real implementations."""
    gen = torch.Generator().manual_seed(8)
    q = torch.randn(2, 4, 5, 8, generator=gen, requires_grad=True)
    k = torch.randn(2, 2, 6, 8, generator=gen, requires_grad=True)
    v = torch.randn(2, 2, 6, 8, generator=gen)
    dg = torch.randn(2, 4, 5, 8, generator=gen)
    filled = torch.rand(1, 1, 5, 6, generator=gen) < 0.5
    bias = torch.zeros(2, 1, 5, 6).masked_fill(filled, torch.finfo(torch.float32).min)
    cases = [
        (torch.ops.fa3.uniform_row_grad.default, (q, k, v, 0.5, 2.0)),
        (torch.ops.fa3.filled_scores_grad.default, (q, k, v, bias, filled, 0.5, 0.0)),
        (torch.ops.fa3.uniform_row_grad_backward.default, (dg, q.detach(), k.detach(), v, 0.5, 2.0)),
        (torch.ops.fa3.filled_scores_grad_backward.default, (dg, q.detach(), k.detach(), v, bias, filled, 0.5, 2.0)),
    ]
    for op, args in cases:
        torch.library.opcheck(op, args)


@pytest.mark.parametrize("live", ["none", "some"])
@pytest.mark.parametrize("softcap", [0.0, 3.0])
def test_row_fixup_gradients_come_in_the_layout_of_q_and_k(live, softcap):
    """The fix-ups' gradients are added to the attention kernel's, which come in q's / k's own layout
    (BSHD when heads are a view of a projection): they have the strides `empty_like` gives (fake and real
    alike, checked by opcheck), so the sum keeps that layout instead of a transposing copy per layer."""
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(2, 5, 3 * 4 * 8, generator=gen)
    q, k, _ = (t.reshape(2, 5, 4, 8).transpose(1, 2) for t in x.split(4 * 8, dim=-1))  # BSHD views, not dense
    k = k.contiguous().transpose(1, 2).contiguous().transpose(1, 2)  # dense BSHD
    v = torch.randn(2, 4, 5, 3, generator=gen)
    dg = torch.zeros(2, 4, 5, 3) if live == "none" else torch.randn(2, 4, 5, 3, generator=gen)
    for op, args in ((torch.ops.fa3.uniform_row_grad_backward.default, (dg, q, k, v, 0.5, softcap)),
                     (torch.ops.fa3.filled_scores_grad_backward.default,
                      (dg, q, k, v, torch.zeros(2, 1, 5, 5), torch.rand(2, 1, 5, 5, generator=gen) < 0.5, 0.5, softcap))):
        dq, dk = op(*args)
        assert dq.stride() == torch.empty_like(q).stride() and dk.stride() == torch.empty_like(k).stride()
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))
