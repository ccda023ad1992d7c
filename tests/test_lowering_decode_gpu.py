"""The decode kernel's compile-time lowering on the GPU: a static-cache decode step of Hugging Face's eager
attention code with its mask as data (so the rewrite adds the run-time key limit and dispatch picks the
split-KV kernel) compiled with backend="fa3": lowered to fa3_decode.fwd, every element against an fp32
eager run (bf16 tolerances), left padding and a fully padded batch row included."""
from __future__ import annotations

import pytest
import torch

import fa_compile
from fa_compile.kernels import triton_family as tf

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or not tf.triton_available(), reason="needs a CUDA GPU")


def _step(q, k, v, mask):
    """HF's eager_attention_forward for one decode step: repeat_kv, scores * scale + mask, fp32 softmax."""
    g = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(g, 1)
    v = v.repeat_interleave(g, 1)
    s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5 + mask
    p = torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype)
    return p @ v


@pytest.mark.parametrize("nq", [1, 4])
def test_decode_step_with_a_data_mask_is_lowered(nq):
    torch._dynamo.reset()
    g = torch.Generator(device="cuda").manual_seed(0)
    b, hq, hkv, lmax, d, dt = 3, 16, 4, 4096, 128, torch.bfloat16
    q = torch.randn(b, hq, nq, d, device="cuda", dtype=dt, generator=g)
    k = torch.randn(b, hkv, lmax, d, device="cuda", dtype=dt, generator=g)
    v = torch.randn(b, hkv, lmax, d, device="cuda", dtype=dt, generator=g)
    keep = torch.zeros(b, 1, nq, lmax, dtype=torch.bool, device="cuda")
    keep[0, ..., :1000] = True
    keep[1, ..., 7:300] = True  # left padding
    keep[2, ..., 500:] = True  # (a valid part that ends at the cache's end)
    mask = torch.zeros(keep.shape, device="cuda", dtype=dt).masked_fill(~keep, torch.finfo(dt).min)
    report = str(fa_compile.explain(_step, q, k, v, mask))
    assert "fa3_decode.fwd" in report, report
    got = torch.compile(_step, backend="fa3")(q, k, v, mask)
    want = _step(q.float(), k.float(), v.float(), mask.float())
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)
