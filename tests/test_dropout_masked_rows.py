"""Dropout over rows that a finite mask (finfo.min) covers entirely. Eager weighs such a row's keys alike and then
drops some of those weights; the rewrite keeps that with fa3::dropped_uniform_rows (fa_compile/dropped_rows.py),
whose bits are the op's counter hash under the site's seed.

Checked element by element: the compiled function's dropout seed is the first draw of torch's generator after
`manual_seed` (Inductor's random ops fall back to eager's), so the test draws it again, builds the same keep mask
(kernels/dropout_hash.py) and runs eager's arithmetic with that mask in fp64: outputs and the gradients of q, k
and v must match on every element, fully masked rows included. nn.MultiheadAttention, whose projections hide q, k
and v, is checked by the spread over calls on those rows (0 for a fix-up without dropout; eager's ~0.37 at
p = 0.5) and by its mean."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fa_compile
from conftest import TOL
from fa_compile.kernels.dropout_hash import dropout_keep_mask
from fa_compile.lowering import choice
from fa_compile.patterns.emit import DROPOUT_SEED_HIGH

B, H, N, D = 3, 2, 6, 4
P = 0.5
SCALE = 0.5
MIN32 = torch.finfo(torch.float32).min


def _pad() -> torch.Tensor:
    pad = torch.ones(B, N, dtype=torch.bool)
    pad[0, 4:] = False
    pad[1, :] = False  # batch 1: no key at all
    pad[2, :1] = False
    return pad


def masked_fill(q, k, v, pad):
    s = (q @ k.transpose(-1, -2) * SCALE).masked_fill(~pad[:, None, None, :], torch.finfo(q.dtype).min)
    return F.dropout(s.softmax(-1), p=P, training=True) @ v


def additive(q, k, v, pad):  # Hugging Face's extended attention mask
    bias = (1.0 - pad[:, None, None, :].to(q.dtype)) * torch.finfo(q.dtype).min
    return F.dropout((q @ k.transpose(-1, -2) * SCALE + bias).softmax(-1), p=P, training=True) @ v


def sdpa_additive(q, k, v, pad):
    bias = (1.0 - pad[:, None, None, :].to(q.dtype)) * torch.finfo(q.dtype).min
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=P, scale=SCALE)


def sdpa_additive_gqa(q, k, v, pad):
    bias = (1.0 - pad[:, None, None, :].to(q.dtype)) * torch.finfo(q.dtype).min
    return F.scaled_dot_product_attention(q, k[:, :1], v[:, :1], attn_mask=bias, dropout_p=P, scale=SCALE,
                                          enable_gqa=True)


def _eager_with_keep(fn, q, k, v, pad, seed: torch.Tensor) -> torch.Tensor:
    """fn's arithmetic in fp64 with the op's keep mask in place of torch's dropout draw."""
    gqa = fn is sdpa_additive_gqa
    q, k, v = (t.double() for t in (q, k, v))
    if gqa:
        k, v = k[:, :1].expand(-1, H, -1, -1), v[:, :1].expand(-1, H, -1, -1)
    s = q @ k.transpose(-1, -2) * SCALE
    if fn is masked_fill:
        s = s.masked_fill(~pad[:, None, None, :], MIN32)
    else:  # the fp32 bias: it absorbs every fp64 score as it absorbs fp32 ones
        s = s + (1.0 - pad[:, None, None, :].double()) * MIN32
    keep = dropout_keep_mask(seed, B, H, N, N, P, q.device)
    return (s.softmax(-1) * keep / (1 - P)) @ v


@pytest.mark.parametrize("fn", [masked_fill, additive, sdpa_additive, sdpa_additive_gqa])
def test_fully_masked_rows_get_eagers_dropped_uniform_weights_and_gradients(fn):
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, N, D, requires_grad=True) for _ in range(3))
    g = torch.randn(B, H, N, D)
    rep = fa_compile.explain(fn, q, k, v, _pad())
    assert [s.rewritten for s in rep.sites] == [True], rep.table()
    assert "fa3.dropped_uniform_rows" in rep.table(), rep.table()
    # what the lowering reads of the fix-up (a kernel that folds it: test_lowering_triton.py)
    assert choice.emitted_fix(rep.sites[0].call) == "dropped" == choice.emitted_grad_fix(rep.sites[0].call)

    torch._dynamo.reset()
    with torch._inductor.config.patch(fallback_random=True):
        compiled = torch.compile(fn, backend="fa3")
        torch.manual_seed(123)
        out = compiled(q, k, v, _pad())
    torch.manual_seed(123)
    seed = torch.randint(0, DROPOUT_SEED_HIGH, (), dtype=torch.int64)
    grads = torch.autograd.grad((out * g).sum(), (q, k, v))

    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    want = _eager_with_keep(fn, *leaves, _pad(), seed)
    want_grads = torch.autograd.grad((want * g.double()).sum(), leaves)
    assert not torch.isneginf(out).any() and torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), want, **TOL[torch.float32])
    # the fully padded batch's rows: dropped uniform weights, not the mean of V
    assert not torch.allclose(out[1], v[1].mean(dim=1, keepdim=True).expand(H, N, D), atol=1e-3)
    for name, got, exp in zip("qkv", grads, want_grads):
        torch.testing.assert_close(got.double(), exp.double(), **TOL[torch.float32], msg=lambda m, n=name: f"d{n}: {m}")
    if fn is not masked_fill:  # the added mask passes eager's gradient to q and k on the padded batch's rows
        assert grads[0][1].abs().max() > 1e-3 and want_grads[0][1].abs().max() > 1e-3


def _spread(fn, *args) -> tuple[float, torch.Tensor]:
    """(mean over elements of the std over calls, mean over calls) of batch 1's output."""
    outs = torch.stack([fn(*args)[1].detach().double() for _ in range(300)])
    return outs.std(0).mean().item(), outs.mean(0)


def test_multihead_attention_with_dropout_drops_the_weights_of_fully_masked_rows():
    torch.manual_seed(2)
    mha = nn.MultiheadAttention(8, 2, dropout=0.5, batch_first=True).train()
    x = torch.randn(B, N, 8)

    def f(x, pad):
        kpm = (1.0 - pad.to(x.dtype)) * torch.finfo(x.dtype).min
        return mha(x, x, x, key_padding_mask=kpm, need_weights=False)[0]

    rep = fa_compile.explain(f, x, _pad())
    assert [s.rewritten for s in rep.sites] == [True], rep.table()
    torch._dynamo.reset()
    compiled = torch.compile(f, backend="fa3")
    with torch.no_grad():
        spread_e, mean_e = _spread(f, x, _pad())
        spread_c, mean_c = _spread(compiled, x, _pad())
    assert spread_e > 0.05 and abs(spread_c - spread_e) < 0.15 * spread_e, (spread_c, spread_e)
    assert (mean_c - mean_e).abs().max() < 0.1, (mean_c - mean_e).abs().max()


def dropout_keyword(q, k, v):
    return F.dropout(input=(q @ k.transpose(-1, -2) * 0.5).softmax(-1), p=0.0, training=True) @ v


def torch_dropout_keyword(q, k, v):
    return torch.dropout(input=(q @ k.transpose(-1, -2) * 0.5).softmax(-1), p=0.2, train=False) @ v


def test_dropout_given_its_input_by_keyword_is_read():
    # `input=` was read as args[0] and the site refused with an IndexError as its reason
    from eager_diff import check

    for fn in (dropout_keyword, torch_dropout_keyword):
        check(fn, [torch.randn(B, H, N, D, requires_grad=True) for _ in range(3)], rewritten=1)


def annotated_transformer(q, k, v, mask):
    """The Annotated Transformer's spelling: a finite fill of -1e9 under a key-padding mask [B, 1, 1, N]."""
    s = q @ k.transpose(-2, -1) * SCALE
    return F.dropout(s.masked_fill(mask == 0, -1e9).softmax(-1), p=P, training=True) @ v


def causal_finite_fill(q, k, v, mask):
    n = q.shape[-2]
    s = (q @ k.transpose(-2, -1) * SCALE).masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), -1e9)
    return F.dropout(s.masked_fill(mask == 0, -1e9).softmax(-1), p=P, training=True) @ v


def test_a_finite_fill_of_padded_keys_keeps_eagers_dropout_on_every_key():
    """The op gets eager's own scores on every key (masked keys' K zeroed plus the fill as their bias), so its
    dropout drops the filled keys' weights as eager does: every element of outputs and gradients against eager's
    arithmetic with the op's keep mask, a fully padded sequence included."""
    torch.manual_seed(1)
    q, k, v = (torch.randn(B, H, N, D, requires_grad=True) for _ in range(3))
    mask = _pad().long()[:, None, None, :]
    g = torch.randn(B, H, N, D)
    rep = fa_compile.explain(annotated_transformer, q, k, v, mask)
    assert [s.rewritten for s in rep.sites] == [True], rep.table()
    torch._dynamo.reset()
    with torch._inductor.config.patch(fallback_random=True):
        compiled = torch.compile(annotated_transformer, backend="fa3")
        torch.manual_seed(9)
        out = compiled(q, k, v, mask)
    torch.manual_seed(9)
    seed = torch.randint(0, DROPOUT_SEED_HIGH, (), dtype=torch.int64)
    grads = torch.autograd.grad((out * g).sum(), (q, k, v))
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    s = (leaves[0] @ leaves[1].transpose(-1, -2) * SCALE).masked_fill(mask == 0, -1e9)
    want = (s.softmax(-1) * dropout_keep_mask(seed, B, H, N, N, P, q.device) / (1 - P)) @ leaves[2]
    want_grads = torch.autograd.grad((want * g.double()).sum(), leaves)
    torch.testing.assert_close(out.double(), want, **TOL[torch.float32])
    for name, a, e in zip("qkv", grads, want_grads):
        torch.testing.assert_close(a.double(), e, **TOL[torch.float32], msg=lambda m, n=name: f"d{n}: {m}")


def test_a_finite_fill_that_varies_along_queries_with_dropout_is_left_alone():
    q, k, v = (torch.randn(B, H, N, D) for _ in range(3))
    rep = fa_compile.explain(causal_finite_fill, q, k, v, _pad().long()[:, None, None, :])
    assert [s.rewritten for s in rep.sites] == [False], rep.table()
    assert "vary along queries" in rep.sites[0].reason, rep.sites[0].reason
