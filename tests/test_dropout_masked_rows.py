"""Dropout over rows that a finite mask (finfo.min) covers entirely. Eager weighs such a row's keys alike and then
drops some of those weights, so its output there changes from call to call; the empty-row fix-up (the mean of V) is
deterministic. Such a site is left alone, whatever its spelling (SDPA and nn.MultiheadAttention then run their own
kernels). Checked by the reason given and by the spread over calls on those rows, which was 0 before (eager's is
~0.37 at p = 0.5), and by the mean, which must stay eager's."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import fa_compile

B, H, N, D = 2, 2, 6, 4
CALLS = 300


def _pad() -> torch.Tensor:
    pad = torch.ones(B, N, dtype=torch.bool)
    pad[0, 4:] = False
    pad[1, :] = False  # batch 1: no key at all
    return pad


def _spread(fn, *args) -> tuple[float, torch.Tensor]:
    """(mean over elements of the std over calls, mean over calls) of batch 1's output."""
    outs = torch.stack([fn(*args)[1].detach().double() for _ in range(CALLS)])
    return outs.std(0).mean().item(), outs.mean(0)


def hand_written(q, k, v, pad):
    s = (q @ k.transpose(-1, -2) * 0.5).masked_fill(~pad[:, None, None, :], torch.finfo(q.dtype).min)
    return F.dropout(s.softmax(-1), p=0.5, training=True) @ v


def _left_alone(fn, seed: int) -> tuple:
    """Fresh q, k, v; asserts explain() leaves fn's one site alone for the finfo.min fill with dropout."""
    torch.manual_seed(seed)
    q, k, v = (torch.randn(B, H, N, D) for _ in range(3))
    rep = fa_compile.explain(fn, q, k, v, _pad())
    assert [s.rewritten for s in rep.sites] == [False], rep.sites
    assert "finfo.min" in rep.sites[0].reason and "dropout" in rep.sites[0].reason
    return q, k, v


def test_a_finfo_min_fill_with_dropout_is_left_alone():
    _left_alone(hand_written, 0)


def sdpa_hf(q, k, v, pad):
    bias = (1.0 - pad[:, None, None, :].to(q.dtype)) * torch.finfo(q.dtype).min
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=0.5)


def test_sdpa_with_dropout_drops_the_weights_of_fully_masked_rows():
    q, k, v = _left_alone(sdpa_hf, 1)
    torch._dynamo.reset()
    compiled = torch.compile(sdpa_hf, backend="fa3")
    with torch.no_grad():
        spread_e, mean_e = _spread(sdpa_hf, q, k, v, _pad())
        spread_c, mean_c = _spread(compiled, q, k, v, _pad())
    assert spread_e > 0.25 and abs(spread_c - spread_e) < 0.1 * spread_e, (spread_c, spread_e)
    # means over 300 calls: within ~5 standard errors of each other (per-element std ~0.4 / sqrt(300) ~ 0.023)
    assert (mean_c - mean_e).abs().max() < 0.17, (mean_c - mean_e).abs().max()


def test_multihead_attention_with_dropout_drops_the_weights_of_fully_masked_rows():
    torch.manual_seed(2)
    mha = nn.MultiheadAttention(8, 2, dropout=0.5, batch_first=True).train()
    x = torch.randn(B, N, 8)

    def f(x, pad):
        kpm = (1.0 - pad.to(x.dtype)) * torch.finfo(x.dtype).min
        return mha(x, x, x, key_padding_mask=kpm, need_weights=False)[0]

    rep = fa_compile.explain(f, x, _pad())
    assert [s.rewritten for s in rep.sites] == [False], rep.sites
    assert "finfo.min" in rep.sites[0].reason and "dropout" in rep.sites[0].reason
    torch._dynamo.reset()
    compiled = torch.compile(f, backend="fa3")
    with torch.no_grad():
        spread_e, _ = _spread(f, x, _pad())
        spread_c, _ = _spread(compiled, x, _pad())
    assert spread_e > 0.05 and abs(spread_c - spread_e) < 0.15 * spread_e, (spread_c, spread_e)


def dropout_keyword(q, k, v):
    return F.dropout(input=(q @ k.transpose(-1, -2) * 0.5).softmax(-1), p=0.0, training=True) @ v


def torch_dropout_keyword(q, k, v):
    return torch.dropout(input=(q @ k.transpose(-1, -2) * 0.5).softmax(-1), p=0.2, train=False) @ v


def test_dropout_given_its_input_by_keyword_is_read():
    # `input=` was read as args[0] and the site refused with an IndexError as its reason
    from eager_diff import check

    for fn in (dropout_keyword, torch_dropout_keyword):
        check(fn, [torch.randn(B, H, N, D, requires_grad=True) for _ in range(3)], rewritten=1)
