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


def test_key_limit_is_one_kernel_and_a_padded_row_stays_uniform():
    """The limit's fa3::key_limit runs as its Triton kernel in Inductor's code (no reduction kernels of its
    own); a sequence whose every key is padding keeps the whole cache (eager: uniform over it)."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    g = torch.Generator(device="cuda").manual_seed(1)
    b, hq, hkv, lmax, d, dt = 3, 8, 2, 4096, 64, torch.bfloat16
    q = torch.randn(b, hq, 1, d, device="cuda", dtype=dt, generator=g)
    k = torch.randn(b, hkv, lmax, d, device="cuda", dtype=dt, generator=g)
    v = torch.randn(b, hkv, lmax, d, device="cuda", dtype=dt, generator=g)
    keep = torch.zeros(b, 1, 1, lmax, dtype=torch.bool, device="cuda")
    keep[0, ..., :1000] = True
    keep[2, ..., 3:2100] = True  # batch row 1: all padding
    mask = torch.zeros(keep.shape, device="cuda", dtype=dt).masked_fill(~keep, torch.finfo(dt).min)
    got, code = run_and_get_code(torch.compile(_step, backend="fa3"), q, k, v, mask)
    code = "\n".join(code)
    assert "key_limit_kernel" in code and "amax" not in code, "the key limit is not the one kernel"
    assert "fa3_decode.key_limit" not in code, "the kernel is an extern call of its op, not Inductor's launch"
    want = _step(q.float(), k.float(), v.float(), mask.float())
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got[1].float(), v[1].float().mean(1, keepdim=True).repeat_interleave(hq // hkv, 0),
                               atol=2e-2, rtol=2e-2)


def _gpt2_step(q, k, v):
    """GPT-2-style causal decode over a cache that grows (its own causal buffer sliced bottom-right)."""
    nq, nk = q.shape[2], k.shape[2]
    causal = torch.ones(nk, nk, dtype=torch.bool, device=q.device).tril()[nk - nq:nk, :nk]
    s = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
    s = torch.where(causal, s, torch.finfo(s.dtype).min)
    return torch.softmax(s, dim=-1) @ v


def test_decode_steps_take_the_kernel_at_every_cache_length():
    # A growing cache as Dynamo's automatic dynamic shapes see it (Hugging Face's DynamicCache): the second
    # length recompiles with a symbolic Nk, and every step is lowered to the decode kernel (no decode-step
    # math, no run-time dispatch), every element against fp32.
    torch._dynamo.reset()
    from fa_compile.lowering import records

    g = torch.Generator(device="cuda").manual_seed(1)
    b, h, d, dt = 4, 16, 64, torch.bfloat16
    q = torch.randn(b, h, 1, d, device="cuda", dtype=dt, generator=g)
    kv = torch.randn(2, b, h, 3000, d, device="cuda", dtype=dt, generator=g)
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    f = torch.compile(_gpt2_step, backend="fa3")
    n = len(records())
    # (no cache hits: the lowering pass must run for its decisions to be recorded)
    with inductor_config.patch(fx_graph_cache=False), functorch_config.patch(enable_autograd_cache=False):
        for nk in (17, 256, 1000, 2999):
            got = f(q, kv[0, :, :, :nk], kv[1, :, :, :nk])
            want = _gpt2_step(q.float(), kv[0, :, :, :nk].float(), kv[1, :, :, :nk].float())
            torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)
    decisions = [str(r.decision) for r in records()[n:]]
    assert decisions and all(x == "decode -> fa3_decode.fwd" for x in decisions), decisions


def _filled_step(q, k, v, keep, fill):
    """A decode step whose mask is data (a key-padding `keep` over the cache): masked_fill with `fill` before
    the softmax. A row with no kept key is the mean of V over the whole cache (finite fill) or NaN (-inf)."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    s = s.masked_fill(~keep, torch.finfo(s.dtype).min if fill == "min" else float("-inf"))
    return torch.softmax(s.float(), dim=-1).to(q.dtype) @ v


@pytest.mark.parametrize("nk", [300, 4096])
@pytest.mark.parametrize("fill", ["min", "-inf"])
def test_empty_rows_are_written_by_the_decode_kernel(fill, nk):
    # emit's fix-up for rows that admit no key (mean of V, or NaN) is folded into the kernel (no reduction
    # over the cache, no `where` launch): every element against fp32 eager, the empty rows included, with
    # one split (300 keys) and with the combine (4096).
    torch._dynamo.reset()
    from fa_compile.lowering import records

    gen = torch.Generator(device="cuda").manual_seed(2)
    b, hq, hkv, d, dt = 3, 16, 4, 128, torch.bfloat16
    q = torch.randn(b, hq, 1, d, device="cuda", dtype=dt, generator=gen)
    k = torch.randn(b, hkv, nk, d, device="cuda", dtype=dt, generator=gen)
    v = torch.randn(b, hkv, nk, d, device="cuda", dtype=dt, generator=gen) + 1.0
    keep = torch.zeros(b, 1, 1, nk, dtype=torch.bool, device="cuda")
    keep[0, ..., : nk // 2] = True
    keep[2, ..., 5:] = True  # batch row 1 keeps nothing
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    n = len(records())
    with inductor_config.patch(fx_graph_cache=False), functorch_config.patch(enable_autograd_cache=False):
        got = torch.compile(_filled_step, backend="fa3")(q, k, v, keep, fill)
    want = _filled_step(q.float(), k.float(), v.float(), keep, fill)
    assert bool(torch.isnan(want[1]).all()) == (fill == "-inf")
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2, equal_nan=True)
    what = "mean of V" if fill == "min" else "NaN"
    decisions = [str(r.decision) for r in records()[n:]]
    assert decisions == [f"decode -> fa3_decode.fwd (empty rows: {what} written by the kernel)"], decisions
