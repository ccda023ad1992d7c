"""Steps between Q·Kᵀ and P·V that change the result, which the site finder once dropped: each is refused now (the
site runs as written, equal to eager), and its harmless twin is still rewritten.

- A row constant (a number, a constant tensor, or the row max) added to the scores is invisible to softmax only if
  everything applied after it moves with it: not a finite fill, not a softcap's tanh, not a column concatenated after
  (attention sinks).
- `div(..., rounding_mode=...)` is not a scale.
- A cast to a narrower dtype than the scores' own (fp8 / bf16 round trips in fp32 code: fake quantization) rounds
  where the op would not.
- `baddbmm(input, ..., beta=0)` ignores its input but gives it a zero gradient, which a rewrite would drop.
Outputs, inputs afterwards and every gradient (and `.grad is None` where eager's is) against eager, through the pass
and AOTAutograd (tests/eager_diff.py)."""
from __future__ import annotations

import pytest
import torch

from eager_diff import check, rand

B, H, N, D = 2, 2, 8, 8
MASK = torch.rand(N, N, generator=torch.Generator().manual_seed(3)) > 0.6  # True: masked


def qkv(seed: int = 0) -> list:
    return [rand(B, H, N, D, seed=seed + i, requires_grad=True) for i in range(3)]


def scores(q, k):
    return q @ k.transpose(-1, -2) * 0.5


# ----------------------------------------------------------------------------- shifts before a finite fill

def shift_then_fill(q, k, v):
    return torch.softmax((scores(q, k) + 2.0).masked_fill(MASK, -1.0), -1) @ v


def rowmax_then_fill(q, k, v):
    s = scores(q, k)
    return torch.softmax((s - s.amax(-1, keepdim=True)).masked_fill(MASK, 0.0), -1) @ v


def const_tensor_shift_then_fill(q, k, v):
    return torch.softmax((scores(q, k) + torch.tensor(5.0)).masked_fill(MASK, -1.0), -1) @ v


def shift_then_where(q, k, v):
    return torch.softmax(torch.where(~MASK, scores(q, k) - 3.0, 1.0), -1) @ v


def shift_then_mult_mask(q, k, v):
    m = (~MASK).float()
    return torch.softmax((scores(q, k) + 1.5) * m + (1 - m) * -1.0, -1) @ v


# harmless twins: the shift after the fill, or a fill that absorbs any score
def fill_then_shift(q, k, v):
    return torch.softmax(scores(q, k).masked_fill(MASK, -1.0) + 2.0, -1) @ v


def shift_then_inf_fill(q, k, v):
    return torch.softmax((scores(q, k) + 2.0).masked_fill(MASK, float("-inf")), -1) @ v


def shift_then_finfo_min_fill(q, k, v):
    s = scores(q, k)
    return torch.softmax((s - s.amax(-1, keepdim=True)).masked_fill(MASK, torch.finfo(s.dtype).min), -1) @ v


# ----------------------------------------------------------------------------- softcap and sinks

def shift_inside_softcap(q, k, v):
    return torch.softmax(torch.tanh((scores(q, k) + 2.0) / 3.0) * 3.0, -1) @ v


def shift_outside_softcap(q, k, v):
    return torch.softmax(torch.tanh(scores(q, k) / 3.0) * 3.0 + 2.0, -1) @ v


SINK = rand(H, seed=7)


def _with_sink(s):
    col = SINK.reshape(1, H, 1, 1).expand(B, H, N, 1)
    return torch.softmax(torch.cat([s, col], -1), -1)[..., :-1]


def shift_before_sink_cat(q, k, v):
    return _with_sink(scores(q, k) + 2.0) @ v


def shift_after_sink_cat(q, k, v):  # GPT-OSS's own spelling: the row max of the combined logits
    s = scores(q, k)
    col = SINK.reshape(1, H, 1, 1).expand(B, H, N, 1)
    c = torch.cat([s, col], -1)
    c = c - c.max(-1, keepdim=True).values
    return torch.softmax(c, -1)[..., :-1] @ v


@pytest.mark.parametrize("fn,rewritten", [
    (shift_then_fill, 0), (rowmax_then_fill, 0), (const_tensor_shift_then_fill, 0), (shift_then_where, 0),
    (shift_then_mult_mask, 0), (fill_then_shift, 1), (shift_then_inf_fill, 1), (shift_then_finfo_min_fill, 1),
    (shift_inside_softcap, 0), (shift_outside_softcap, 1), (shift_before_sink_cat, 0), (shift_after_sink_cat, 1),
], ids=lambda x: getattr(x, "__name__", str(x)))
def test_row_shifts(fn, rewritten):
    res = check(fn, qkv(), rewritten=rewritten)
    if not rewritten:
        assert any("shift" in r or "constant is added" in r for r in res.reasons), res.reasons


# ----------------------------------------------------------------------------- rounding division, narrowing casts

def floor_div(q, k, v):
    return torch.softmax(torch.div(q @ k.transpose(-1, -2), 0.5, rounding_mode="floor"), -1) @ v


def trunc_div_method(q, k, v):
    return torch.softmax((q @ k.transpose(-1, -2)).div(3, rounding_mode="trunc"), -1) @ v


def true_div(q, k, v):
    return torch.softmax(torch.div(q @ k.transpose(-1, -2), 3, rounding_mode=None), -1) @ v


def fp8_scores(q, k, v):
    return torch.softmax(scores(q, k).to(torch.float8_e5m2).float(), -1) @ v


def fp8_probs(q, k, v):
    return torch.softmax(scores(q, k), -1).to(torch.float8_e4m3fn).float() @ v


def bf16_probs_dtype(q, k, v):
    return torch.softmax(scores(q, k), -1, dtype=torch.bfloat16).float() @ v


def widening_casts(q, k, v):  # fp32 -> fp64 -> fp32: nothing is rounded away
    return torch.softmax(scores(q, k).double(), -1).float() @ v


@pytest.mark.parametrize("fn,rewritten", [
    (floor_div, 0), (trunc_div_method, 0), (true_div, 1), (fp8_scores, 0), (fp8_probs, 0), (bf16_probs_dtype, 0),
    (widening_casts, 1),
], ids=lambda x: getattr(x, "__name__", str(x)))
def test_steps_that_round(fn, rewritten):
    res = check(fn, qkv(), rewritten=rewritten)
    if not rewritten:
        assert any("rounding" in r for r in res.reasons), res.reasons


def test_site_dtype_casts_stay_rewritten():
    # A bf16 model's eager code: softmax in fp32, probabilities cast back to the inputs' dtype.
    def hf_style(q, k, v):
        w = torch.softmax(scores(q, k), -1, dtype=torch.float32).to(q.dtype)
        return w @ v

    args = [rand(B, H, N, D, dtype=torch.bfloat16, seed=i, requires_grad=True) for i in range(3)]
    check(hf_style, args, dtype=torch.bfloat16, rewritten=1)


# ----------------------------------------------------------------------------- baddbmm's ignored input

def test_baddbmm_beta0_input_keeps_its_zero_gradient():
    def fn(bias, q, k, v):
        s = torch.baddbmm(bias, q, k.transpose(-1, -2), beta=0, alpha=0.5)
        return torch.softmax(s, -1) @ v

    q, k, v = (rand(B * H, N, D, seed=i, requires_grad=True) for i in range(3))
    bias = rand(B * H, N, N, seed=9, requires_grad=True)
    check(fn, [bias, q, k, v], rewritten=0)
    check(fn, [bias.detach(), q, k, v], rewritten=1)  # no gradient wanted: the input is simply ignored
