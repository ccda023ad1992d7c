"""fa3::dropped_uniform_rows on CUDA: its Triton kernels against its torch path at bf16 / fp16 on larger shapes
(outputs poisoned first), and compiled sites with dropout over fully masked rows against eager's arithmetic in fp64
with the op's keep mask, outputs and gradients, every element (the method of test_dropout_masked_rows.py), on the
kernels dispatch picks and on our Triton family; compiled, the lowering folds the dropped rows into our kernels
(fa3_triton.dropped_rows_fill / dropped_rows_bwd), which these tests check it did."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fa_compile
from fa_compile import dropped_rows
from fa_compile.kernels.dropout_hash import dropout_keep_mask
from fa_compile.lowering import records
from fa_compile.patterns.emit import DROPOUT_SEED_HIGH

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

P, SCALE = 0.3, 0.125
MIN32 = torch.finfo(torch.float32).min


def _lse(b: int, hq: int, nq: int) -> torch.Tensor:
    lse = torch.randn(b, hq, nq, device="cuda")
    lse[0, :, nq - 50:] = float("-inf")
    lse[1] = float("-inf")
    lse[2, 3, 7] = float("-inf")
    return lse


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [64, 128])
def test_kernels_equal_the_torch_path(dtype, d):
    b, hq, hkv, nq, nk = 4, 8, 2, 300, 333
    g = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(b, nq, hq, d, device="cuda", generator=g).to(dtype).transpose(1, 2)
    k, v = (torch.randn(b, nk, hkv, d, device="cuda", generator=g).to(dtype).transpose(1, 2) for _ in range(2))
    lse, seed = _lse(b, hq, nq), torch.tensor(4242, device="cuda")
    fill = dropped_rows.fill_triton(v, lse, seed, P, hq, out=torch.full((b, hq, nq, d), float("nan"), dtype=dtype,
                                                                         device="cuda"))
    torch.testing.assert_close(fill, dropped_rows.fill_torch(q, v, lse, seed, P), atol=2e-2, rtol=2e-2)
    dfill = torch.randn(b, hq, nq, d, device="cuda", generator=g).to(dtype)
    for softcap, qk_grad in ((0.0, 1.0), (5.0, 0.5), (0.0, 0.0)):
        got = dropped_rows.backward_triton(dfill, q, k, v, lse, seed, P, SCALE, softcap, qk_grad,
                                           grads=tuple(torch.full_like(t, float("nan")) for t in (q, k, v)))
        want = dropped_rows.backward_torch(dfill, q, k, v, lse, seed, P, SCALE, softcap, qk_grad)
        for name, a, e in zip(("dq", "dk", "dv"), got, want):
            assert not a.isnan().any(), name
            torch.testing.assert_close(a.float(), e.float(), atol=2e-2, rtol=2e-2, msg=lambda m, n=name: f"{n}: {m}")


B, H, N, D = 3, 4, 200, 64


def _pad() -> torch.Tensor:
    p = torch.ones(B, N, dtype=torch.bool, device="cuda")
    p[0, 150:] = False
    p[1] = False
    p[2, :7] = False
    return p


def masked_fill(q, k, v, pad):
    s = (q @ k.transpose(-1, -2) * SCALE).masked_fill(~pad[:, None, None, :], torch.finfo(q.dtype).min)
    return F.dropout(s.softmax(-1), p=P, training=True) @ v


def additive(q, k, v, pad):
    bias = (1.0 - pad[:, None, None, :].to(q.dtype)) * torch.finfo(q.dtype).min
    return F.dropout((q @ k.transpose(-1, -2) * SCALE + bias).softmax(-1), p=P, training=True) @ v


def sdpa_additive(q, k, v, pad):
    bias = (1.0 - pad[:, None, None, :].to(q.dtype)) * torch.finfo(q.dtype).min
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, dropout_p=P, scale=SCALE)


def _eager_with_keep(fn, q, k, v, pad, seed):
    """fn's arithmetic in fp64 with the op's keep mask. The hand-written sites add or fill finfo(dtype).min in
    the scores' own dtype, which absorbs every score (as fp32's finfo.min does in fp64); SDPA adds its float mask
    to fp32 scores, where fp16's finfo.min (-65504) absorbs nothing: its fully masked rows are softmax(s)."""
    m = ~pad[:, None, None, :]
    bias = m.double() * (torch.finfo(q.dtype).min if fn is sdpa_additive else MIN32)
    q, k, v = (t.double() for t in (q, k, v))
    s = q @ k.transpose(-1, -2) * SCALE
    s = s.masked_fill(m, MIN32) if fn is masked_fill else s + bias
    return (s.softmax(-1) * dropout_keep_mask(seed, B, H, N, N, P, q.device) / (1 - P)) @ v


@pytest.mark.parametrize("kernel", [None, "triton"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fn", [masked_fill, additive, sdpa_additive])
def test_compiled_sites_equal_eager_with_the_same_bits(fn, dtype, kernel):
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
    g = torch.randn(B, H, N, D, device="cuda", dtype=dtype)
    torch._dynamo.reset()
    n = len(records())
    # no cache hits: a cached graph is not lowered again, and the fold records below would be missing
    with torch._inductor.config.patch(fallback_random=True, fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        compiled = torch.compile(fn, backend=fa_compile.backend(kernel=kernel) if kernel else "fa3")
        torch.manual_seed(7)
        out = compiled(q, k, v, _pad())
    torch.manual_seed(7)
    seed = torch.randint(0, DROPOUT_SEED_HIGH, (), dtype=torch.int64, device="cuda")
    grads = torch.autograd.grad((out * g).sum(), (q, k, v))
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    want = _eager_with_keep(fn, *leaves, _pad(), seed)
    want_grads = torch.autograd.grad((want * g.double()).sum(), leaves)
    # bf16 / fp16 against fp64: the inputs' rounding (the same bounds as the kernels' own GPU tests)
    tol = dict(atol=3e-2, rtol=3e-2) if dtype == torch.bfloat16 else dict(atol=5e-3, rtol=5e-3)
    torch.testing.assert_close(out.double(), want, **tol)
    for name, a, e in zip("qkv", grads, want_grads):
        torch.testing.assert_close(a.double(), e.double(), **tol, msg=lambda m, n=name: f"d{n}: {m}")
    assert want_grads[2][1].abs().max() > 1e-3  # the fully padded batch's rows reach dv
    folded = [(r.decision.target, r.decision.folded) for r in records()[n:]]
    # fp16's finfo.min added to SDPA's fp32 scores empties no row: nothing to fold there
    empties = not (fn is sdpa_additive and dtype == torch.float16)
    assert [f for _, f in folded] == [
        "empty rows: dropped uniform weights times V written by the kernel",
        "empty rows: their dout zeroed, the dropped uniform weights' gradients added by the kernel",
    ] if empties else ["", ""], folded
