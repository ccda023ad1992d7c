"""Sites whose dtypes change along the way: inputs the model upcasts, 0-d constants built in another dtype, a mask
wider than the scores. The rewrite computes what eager computes, in eager's dtypes, or leaves the site alone and says
why (outputs and gradients against eager, fresh random inputs)."""
from __future__ import annotations

import math

import pytest
import torch

from eager_diff import check, rand

B, H, N, D = 2, 2, 9, 16


def qkv(dtype: torch.dtype = torch.float32, seed: int = 0, requires_grad: bool = True) -> list:
    return [rand(B, H, N, D, dtype=dtype, seed=seed + i, requires_grad=requires_grad) for i in range(3)]


def upcast_all(q, k, v):  # the whole attention in fp32 from bf16 / fp16 inputs
    s = q.float() @ k.float().transpose(-1, -2) / math.sqrt(D)
    return s.softmax(-1) @ v.float()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_inputs_upcast_for_the_whole_attention_compute_wide(dtype):
    # Eager's output is fp32-accurate: P is never rounded to the inputs' dtype, nor is the output. The site runs in
    # fp32: the output within fp32 tolerances (rounding P and the output to bf16 was off by ~3e-3), the gradients
    # (of bf16 / fp16 leaves) within theirs.
    res = check(upcast_all, qkv(dtype, requires_grad=False), dtype=torch.float32, rewritten=1, grad=False, seed=1)
    assert res.out.dtype == torch.float32
    assert res.rewritten[0].dtype in ("torch.float32", "float32")
    check(upcast_all, qkv(dtype), dtype=dtype, rewritten=1, seed=1)


def scale_bf16(q, k, v):  # 1/3 as bf16 holds it: 0.333984375
    return (q @ k.transpose(-1, -2) * torch.tensor(1 / 3, dtype=torch.bfloat16)).softmax(-1) @ v


def div_fp16(q, k, v):
    return (q @ k.transpose(-1, -2) / torch.tensor(math.sqrt(10), dtype=torch.float16)).softmax(-1) @ v


def full_bf16(q, k, v):
    return (q @ k.transpose(-1, -2) * torch.full((), 1 / 3, dtype=torch.bfloat16)).softmax(-1) @ v


def fill_bf16(q, k, v):  # a fill that absorbs nothing: its bf16 value (-0.69921875) weighs the masked keys
    m = torch.ones(N, N, dtype=torch.bool).triu(1)
    return (q @ k.transpose(-1, -2) * 0.25).masked_fill(m, torch.tensor(-0.7, dtype=torch.bfloat16)).softmax(-1) @ v


@pytest.mark.parametrize("fn", [scale_bf16, div_fp16, full_bf16, fill_bf16], ids=lambda f: f.__name__)
def test_constants_are_the_values_their_dtype_holds(fn):
    # fp32 tolerances: reading the Python literal instead of the bf16 value was off by ~3e-3.
    check(fn, qkv(), rewritten=1, seed=3)


def fill_overflow(q, k, v):  # -1e9 as fp16 holds it is -inf: row 0, which masks every key, is NaN in eager
    m = torch.ones(N, N, dtype=torch.bool).triu(0)
    return (q @ k.transpose(-1, -2) * 0.25).masked_fill(m, torch.tensor(-1e9, dtype=torch.float16)).softmax(-1) @ v


def where_overflow(q, k, v):
    keep = torch.ones(N, N, dtype=torch.bool).tril(-1)
    return torch.where(keep, q @ k.transpose(-1, -2) * 0.25, torch.tensor(-1e9, dtype=torch.float16)).softmax(-1) @ v


@pytest.mark.parametrize("fn", [fill_overflow, where_overflow], ids=lambda f: f.__name__)
def test_a_fill_that_overflows_its_dtype_is_minus_infinity(fn):
    # The rewrite took -1e9 as a finite fill and gave row 0 the mean of V; eager's row is NaN (the fill is -inf).
    res = check(fn, qkv(requires_grad=False), rewritten=1, grad=False, seed=4)
    assert torch.isnan(res.ref[:, :, 0]).all() and not torch.isnan(res.ref[:, :, 1:]).any()


def hf_mask_fp64(q, k, v, m):  # a Hugging Face-style extended mask built in fp64
    ext = (1.0 - m[:, None, None, :].double()) * -1e9
    return (q @ k.transpose(-1, -2) / math.sqrt(D) + ext).softmax(-1).to(q.dtype) @ v


def bias_fp64(q, k, v, b):
    return (q @ k.transpose(-1, -2) / math.sqrt(D) + b).softmax(-1).to(q.dtype) @ v


def test_a_float64_mask_over_narrower_scores_is_left_alone():
    # Eager adds it and takes the softmax in fp64: a fully padded sequence keeps its scores under -1e9 there, and
    # 3e4 + x keeps x to fp64's precision. The kernels add masks in fp32 (off by 1.4 and 1.4e-3 before).
    mask = torch.ones(B, N, dtype=torch.long)
    mask[1] = 0
    res = check(hf_mask_fp64, qkv() + [mask], rewritten=0, seed=5)
    assert any("float64 mask" in r for r in res.reasons), res.reasons
    big = 3e4 + rand(N, N, seed=9).double()
    res = check(bias_fp64, qkv() + [big], rewritten=0, seed=6)
    assert any("float64 mask" in r for r in res.reasons), res.reasons


def test_a_float64_mask_over_float64_scores_is_rewritten():
    res = check(bias_fp64, qkv(torch.float64) + [3e4 + rand(N, N, seed=9).double()], dtype=torch.float64,
                rewritten=1, seed=7)
    assert res.out.dtype == torch.float64


def upcast_scores_narrow_probs(q, k, v):  # GPT-2's reorder_and_upcast_attn: fp32 scores, P cast to V's dtype
    s = torch.baddbmm(torch.empty(B * H, N, N), q.reshape(-1, N, D).float(), k.mT.reshape(-1, D, N).float(),
                      beta=0, alpha=1 / math.sqrt(D)).view(B, H, N, N)
    s = torch.where(torch.ones(N, N, dtype=torch.bool).tril(), s, torch.finfo(torch.float32).min)
    return s.softmax(-1).type(v.dtype) @ v


def narrow_probs_back_to_wide(q, k, v):  # P rounded to bf16 and back, P·V in fp32: a rounding the op does not make
    s = q.float() @ k.float().mT / math.sqrt(D)
    return s.softmax(-1).bfloat16().float() @ v.float()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_probabilities_cast_to_the_inputs_dtype_are_the_ops_rounding(dtype):
    # fp32 scores of upcast q and k (exact products), P rounded to the inputs' dtype for P·V: what a bf16 / fp16 site
    # computes. It was left alone ("probabilities cast narrower than the scores").
    res = check(upcast_scores_narrow_probs, qkv(dtype), dtype=dtype, rewritten=1, seed=4)
    assert res.rewritten[0].dtype in (str(dtype), str(dtype).replace("torch.", ""))
    res = check(narrow_probs_back_to_wide, qkv(dtype), dtype=torch.float32, rewritten=0, seed=4)
    assert "narrower than the torch.float32 of the scores" in res.reasons[0], res.reasons


def narrow_scores_wide_pv(q, k, v):  # bf16 scores and softmax, widened for an fp32 P·V
    return torch.softmax(q @ k.mT / math.sqrt(D), -1).float() @ v.float()


def narrow_scores_fp32_softmax_wide_pv(q, k, v):  # bf16 scores, softmax taken in fp32, P·V in fp32
    return torch.softmax(q @ k.mT / math.sqrt(D), -1, dtype=torch.float32) @ v.float()


@pytest.mark.parametrize("fn", [narrow_scores_wide_pv, narrow_scores_fp32_softmax_wide_pv], ids=lambda f: f.__name__)
def test_scores_narrower_than_the_pv_product_are_left_alone(fn):
    # Eager's fp32 result carries the bf16 rounding of its scores: 3e-3 from fp64 where the op in fp32 is 6e-8, and
    # at fp32's tolerance that is not rounding. The site is left alone and says why.
    res = check(fn, qkv(torch.bfloat16), dtype=torch.float32, rewritten=0, seed=4)
    assert "narrower than the torch.float32 of the P·V product" in res.reasons[0], res.reasons


def upcast_scores_scaled_by_a_tensor(q, k, v, logit_scale):  # a learnable fp32 temperature over fp32 scores
    s = q.float() @ k.float().mT * logit_scale.exp()
    return s.softmax(-1).to(v.dtype) @ v


def test_fp32_scores_scaled_by_a_tensor_at_a_narrow_site_are_left_alone():
    # The op would scale q and round it to bf16: the temperature's gradient came out 70% off (0.76 from fp64 where
    # eager's was 0.0036). The site is left alone and says why.
    scale = rand(H, 1, 1, seed=11, requires_grad=True)
    res = check(upcast_scores_scaled_by_a_tensor, qkv(torch.bfloat16) + [scale], dtype=torch.bfloat16, rewritten=0,
                seed=4)
    assert "scaled by a tensor at a torch.bfloat16 site" in res.reasons[0], res.reasons


def sdpa_with_a_float_mask(q, k, v, mask):
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def test_cpu_reference_backward_computes_the_scores_as_the_forward_kernel():
    # bf16 SDPA with a bf16 float mask, training, on CPU: aten's kernel lowers the forward (fp32 scores) and the
    # reference math the backward. Its products were rounded to bf16 there: dq 0.25 from fp64 where eager's is 0.05.
    mask = (rand(N, N, seed=12) * 2).to(torch.bfloat16)
    check(sdpa_with_a_float_mask, qkv(torch.bfloat16) + [mask], dtype=torch.bfloat16, rewritten=1, inner="inductor",
          seed=4)
    q, k, v = (t.detach() * 3 for t in qkv(torch.bfloat16, seed=7))  # scores of a few units: bf16 rounding shows
    dout = rand(B, H, N, D, seed=13)

    def grads(fn, dtype):
        args = [t.to(dtype).requires_grad_() for t in (q, k, v)]
        return torch.autograd.grad(fn(*args, mask.to(dtype)), args, dout.to(dtype))

    exact = grads(sdpa_with_a_float_mask, torch.float64)
    eager = grads(sdpa_with_a_float_mask, torch.bfloat16)
    torch._dynamo.reset()
    got = grads(torch.compile(sdpa_with_a_float_mask, backend="fa3"), torch.bfloat16)
    for name, a, e, x in zip(("dq", "dk", "dv"), got, eager, exact):
        err, eager_err = (a.double() - x).abs().max().item(), (e.double() - x).abs().max().item()
        assert err <= 2.5 * eager_err, f"{name}: {err:.3g} from fp64, eager {eager_err:.3g}"


def scaled_output(q, k, v):
    return (torch.softmax(q @ k.mT / math.sqrt(D), -1) @ v) * 2


def test_an_output_read_through_an_elementwise_op_keeps_eagers_strides():
    # `o * 2` follows o's layout: with the op's [B, N, H, D] strides the caller's `.view(B, -1)` failed
    q, k, v = qkv(requires_grad=False)
    torch._dynamo.reset()
    got = torch.compile(scaled_output, backend="fa3")(q, k, v)
    want = scaled_output(q, k, v)
    assert got.stride() == want.stride()
    torch.testing.assert_close(got.view(B, -1), want.view(B, -1), atol=1e-5, rtol=1e-5)
