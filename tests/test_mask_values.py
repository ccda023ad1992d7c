"""Masks whose values, not only their pattern, decide eager's result on some rows: a constant mask that varies
along one axis only, and float masks from the inputs that may hold values as low as the fill beside them. Each case
compares the compiled program with eager (outputs and gradients, every element) and states whether the site may be
rewritten: a rewrite that cannot be proven for every value of an input mask is not made, or the mask is passed to
the op as eager adds it."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from eager_diff import check, rand

B, H, N, D = 2, 2, 7, 8
FMIN = torch.finfo(torch.float32).min


def qkv(grad: bool = True) -> list:
    return [rand(B, H, N, D, seed=i, requires_grad=grad) for i in range(3)]


def _ij():
    return torch.arange(N)[:, None], torch.arange(N)[None, :]


# ------------------------------------------------------------------------ constant masks along one axis


def keys_only_and_causal(q, k, v):
    i, j = _ij()
    keep = (j <= 3) & (j <= i)  # [1, N] & [N, N]: the first four keys, causally
    return torch.softmax((q @ k.mT * 0.35).masked_fill(~keep, float("-inf")), -1) @ v


def keys_only_expanded(q, k, v):
    _, j = _ij()
    keep = (j <= 4).expand(N, N)  # a key mask, not j - i <= 4
    return torch.softmax((q @ k.mT * 0.35).masked_fill(~keep, float("-inf")), -1) @ v


def queries_only_expanded(q, k, v):
    i, _ = _ij()
    keep = (i >= 2).expand(N, N)  # rows 0 and 1 masked entirely: a finite fill makes them uniform
    return torch.softmax((q @ k.mT * 0.35).masked_fill(~keep, -1e9), -1) @ v


def keys_only_buffers_multiplied(q, k, v):
    i, j = _ij()
    keep = (j <= 4).float() * (j <= i).float()
    return torch.softmax((q @ k.mT * 0.35).masked_fill(keep == 0, float("-inf")), -1) @ v


@pytest.mark.parametrize("fn", [keys_only_and_causal, keys_only_expanded, queries_only_expanded,
                                keys_only_buffers_multiplied], ids=lambda f: f.__name__)
def test_a_constant_mask_along_one_axis_is_no_band(fn):
    # Such a mask evaluated over its size-1 axis looked like a band relative to row (or key) 0, and broadcast it
    # became causal or causal with an offset: outputs 0.9-2.0 off.
    res = check(fn, qkv(), rewritten=1)
    assert "causal" not in res.rewritten[0].mask or "bool-mask" in res.rewritten[0].mask, res.rewritten[0].mask


# ------------------------------------------------------------------------ float masks from the inputs


def _left_padded_additive(fill: float) -> torch.Tensor:
    keep = torch.ones(B, N)
    keep[1, :3] = 0  # the first queries of batch 1 keep only padded keys under causality
    return (1.0 - keep[:, None, None, :]) * fill if fill != float("-inf") else \
        torch.zeros(B, 1, 1, N).masked_fill(keep[:, None, None, :] == 0, fill)


def added_then_filled(q, k, v, pad):
    s = (q @ k.mT * 0.35 + pad).masked_fill(~torch.ones(N, N, dtype=torch.bool).tril(), FMIN)
    return torch.softmax(s, -1) @ v


def xsoftmax_over_added(q, k, v, pad):
    # DeBERTa's XSoftmax over scores that carry the caller's additive mask
    rmask = ~torch.ones(N, N, dtype=torch.bool).tril()
    p = torch.softmax((q @ k.mT * 0.35 + pad).masked_fill(rmask, FMIN), -1)
    return p.masked_fill(rmask, 0.0) @ v


def causal_finfo_plus_padding(q, k, v, pad):
    causal = torch.zeros(N, N).masked_fill(~torch.ones(N, N, dtype=torch.bool).tril(), FMIN)
    return torch.softmax(q @ k.mT * 0.35 + (causal + pad), -1) @ v


def sdpa_causal_finfo_plus_padding(q, k, v, pad):
    causal = torch.zeros(N, N).masked_fill(~torch.ones(N, N, dtype=torch.bool).tril(), FMIN)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=causal + pad)


@pytest.mark.parametrize("fill", [FMIN, float("-inf")], ids=["finfo_min", "neg_inf"])
@pytest.mark.parametrize("fn,rewritten", [(added_then_filled, 0), (xsoftmax_over_added, 0),
                                          (causal_finfo_plus_padding, 1), (sdpa_causal_finfo_plus_padding, 1)],
                         ids=lambda x: getattr(x, "__name__", str(x)))
def test_a_float_mask_from_the_inputs_may_reach_the_fill(fn, rewritten, fill):
    # A left-padded row keeps only padded keys under causality: with the padding at finfo.min (or -inf) they sit at
    # (or below) the causal fill, so eager weighs every key (or only the causally masked ones) where structure plus
    # an empty-row fix-up averaged the kept keys only (0.2-1.8 off). A fill after such a mask is refused; a sum of
    # the two masks is passed to the op as eager adds it.
    # (SDPA's gradients are not compared: on rows the mask absorbs entirely, eager's CPU flash backward is not that of
    # its own forward, while the op's agrees with SDPA's math backend in fp64.)
    sdpa = fn is sdpa_causal_finfo_plus_padding
    res = check(fn, qkv(grad=not sdpa) + [_left_padded_additive(fill)], rewritten=rewritten)
    if rewritten:
        assert res.rewritten[0].mask == "bias", res.rewritten[0].mask
    else:
        assert any("may itself absorb" in r for r in res.reasons), res.reasons


def alibi_then_filled(q, k, v):
    # MPT: a constant ALiBi bias, then an absorbing fill: the bias is proven moderate, the fill stays structure
    i, j = _ij()
    alibi = -(i - j).abs().float() * torch.tensor([0.5, 0.25]).view(H, 1, 1)
    s = (q @ k.mT * 0.35 + alibi).masked_fill(~torch.ones(N, N, dtype=torch.bool).tril(), FMIN)
    return torch.softmax(s, -1) @ v


def test_a_constant_bias_before_an_absorbing_fill_keeps_the_structure():
    res = check(alibi_then_filled, qkv(), rewritten=1)
    assert res.rewritten[0].mask == "causal+bias", res.rewritten[0].mask


def _bias_written_in_place(how: str) -> torch.Tensor:
    """A zeros bias whose row 2 gets -inf on the keys row 2 admits under causality, written in place."""
    bias = torch.zeros(N, N)
    if how == "setitem":
        bias[2, :3] = float("-inf")
    elif how == "row":
        bias[2] = float("-inf")
    else:
        bias.index_fill_(0, torch.tensor([2]), float("-inf"))
    return bias


@pytest.mark.parametrize("how", ["setitem", "row", "index_fill_"])
def test_a_bias_written_in_place_before_an_absorbing_fill_is_not_judged_by_its_definition(how):
    """Row 2's admissible keys are all -inf in the bias, so eager's row is uniform over the keys the finfo.min fill
    covers (-inf < finfo.min): the mean of V past key 2, which the op's empty-row fix-up (the mean of every V) is
    not. The bias was read as its zeros definition and proven moderate; a written bias is not."""
    def fn(q, k, v):
        s = q @ k.mT * 0.35 + _bias_written_in_place(how)
        s = s.masked_fill(~torch.ones(N, N, dtype=torch.bool).tril(), FMIN)
        return torch.softmax(s, -1) @ v

    args = qkv()
    want = fn(*args)
    assert torch.allclose(want[:, :, 2], args[2][:, :, 3:].mean(2), atol=1e-6)  # the case holds such a row
    res = check(fn, args)
    assert not res.rewritten and any("may itself absorb" in r for r in res.reasons), res.reasons


# ------------------------------------------------------------------------ index arithmetic in its own dtype


N8 = 8  # positions 0..7: int8's 7 + 121 wraps


def _positions(dtype: torch.dtype, scale, offset):
    i = torch.arange(N8, dtype=dtype)[:, None] * scale + offset
    j = torch.arange(N8, dtype=dtype)[None, :] * scale + offset
    return i, j


def qkv8() -> list:
    return [rand(B, H, N8, D, seed=i, requires_grad=True) for i in range(3)]


# Eager computes position arithmetic in the tensor's dtype, where it wraps or rounds: the mask is then not the
# comparison of the integers the positions spell. Each is compared with eager, every element.
WRAPPING = {
    "uint8 i - j > 2 (negative differences wrap to 256 + i - j)":
        lambda i, j: (i - j) > 2,
    "int8 j + 121 > i + 121 (128 wraps to -128)":
        lambda i, j: j + 121 > i + 121,
}


@pytest.mark.parametrize("name", list(WRAPPING))
def test_narrow_integer_positions_wrap_as_eager_computes_them(name):
    dtype = torch.uint8 if name.startswith("uint8") else torch.int8

    def fn(q, k, v):
        i, j = _positions(dtype, 1, 0)
        return torch.softmax((q @ k.mT * 0.35).masked_fill(WRAPPING[name](i, j), FMIN), -1) @ v

    check(fn, qkv8())


@pytest.mark.parametrize("dtype, scale, offset", [
    (torch.int32, 2 ** 29, 0),  # 4 * 2**29 wraps in int32
    (torch.int16, 5000, 0),
    (torch.int32, 1, 2 ** 31 - 4),  # positions near the top of their range
    (torch.float32, 1, 1e8),  # float positions past 2**24 round: every j + 1e8 equals i + 1e8 here
    (torch.float32, 3e7, 0),
], ids=["int32*2^29", "int16*5000", "int32+2^31-4", "fp32+1e8", "fp32*3e7"])
def test_positions_past_their_dtypes_exact_range_are_computed_as_eager(dtype, scale, offset):
    def fn(q, k, v):
        i, j = _positions(dtype, scale, offset)
        return torch.softmax((q @ k.mT * 0.35).masked_fill(j > i, FMIN), -1) @ v

    check(fn, qkv8())
    check(fn, qkv8(), inner="inductor")


def test_positions_in_range_are_still_read_as_causal():
    # the same spelling in int64 (and in fp32 below 2**24) is the causal structure, not a bias
    for dtype in (torch.int64, torch.int32, torch.float32):
        def fn(q, k, v, dtype=dtype):
            i, j = _positions(dtype, 1, 1000)
            return torch.softmax((q @ k.mT * 0.35).masked_fill(j > i, FMIN), -1) @ v

        res = check(fn, qkv8())
        assert [r.mask for r in res.reports] == ["causal"], (dtype, [r.mask for r in res.reports])
