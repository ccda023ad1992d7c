"""The never-silently-wrong rules on a CUDA device, through every kernel family that takes the site:
finite fills (whose band fix-up runs a second backward call that reads delta from the `out` it is
given), grad-mode regions, writes into caller tensors and zero-size dimensions. Each compiled result
(fp16) must be at least as close to the fp64 program as eager fp16 is, up to a factor of two and
fp16's own rounding; gradients the same way, and `.grad is None` exactly where eager's is."""
from __future__ import annotations

from typing import Callable, Optional

import pytest
import torch

import fa_compile

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

KERNELS = [None, "cudnn", "flash", "efficient", "triton", "reference"]
B, H, N, D = 2, 4, 96, 64


def _leaves(*shapes, scale: float = 1.0, seed: int = 0, grad: bool = True) -> list:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [(torch.randn(*s, device="cuda", generator=g, dtype=torch.float64) * scale).requires_grad_(grad)
            for s in shapes]


def _run(fn: Callable, leaves: list, dtype: torch.dtype, backend: Optional[Callable]) -> tuple:
    xs = [x.detach().to(dtype).requires_grad_(x.requires_grad) for x in leaves]
    f = torch.compile(fn, backend=backend, fullgraph=True) if backend is not None else fn
    out = f(*xs)
    grads: list = [None] * len(xs)
    if out.requires_grad:
        out.float().square().sum().backward()
        grads = [x.grad for x in xs]
    return out, grads


def _close(got: Optional[torch.Tensor], eager: Optional[torch.Tensor], ref: Optional[torch.Tensor], what: str) -> None:
    assert (got is None) == (ref is None), f"{what}: grad presence differs from eager"
    if ref is None:
        return
    assert got.shape == ref.shape, f"{what}: shape {tuple(got.shape)}, eager {tuple(ref.shape)}"
    if ref.numel() == 0:
        return
    ref = ref.double()
    err_got = (got.double() - ref).abs().max().item()
    err_eager = (eager.double() - ref).abs().max().item()
    floor = 2e-3 * max(1.0, ref.abs().max().item())
    assert err_got <= 2 * err_eager + floor, f"{what}: max error {err_got:.3g}, eager fp16 {err_eager:.3g}"


def _check(fn: Callable, leaves: list, kernel: Optional[str], dtype: torch.dtype = torch.float16) -> None:
    torch._dynamo.reset()
    ref_out, ref_grads = _run(fn, leaves, torch.float64, None)
    eager_out, eager_grads = _run(fn, leaves, dtype, None)
    try:
        out, grads = _run(fn, leaves, dtype, fa_compile.backend(kernel=kernel))
    except Exception as e:  # a forced kernel that cannot take the site says so: not this test's concern
        if kernel is not None and "kernel" in str(e):
            pytest.skip(f"{kernel} does not take this site: {str(e).splitlines()[0]}")
        raise
    _close(out, eager_out, ref_out, "out")
    for i, (g, e, r) in enumerate(zip(grads, eager_grads, ref_grads)):
        _close(g, e, r, f"grad {i}")


def _causal_fill(fill: float) -> Callable:
    def f(q, k, v):
        s = q @ k.transpose(-1, -2) * D ** -0.5
        n = s.shape[-1]
        keep = torch.ones(n, n, dtype=torch.bool, device=s.device).tril()
        return s.masked_fill(~keep, fill).softmax(-1) @ v
    return f


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("fill,scale", [(-1e4, 1.0), (-30.0, 3.0)])
def test_finite_causal_fill_on_cuda(kernel, fill, scale):
    # scale 3: scores of spread ~9 * sqrt(64) / 8, so some rows' admissible scores fall below -30
    q, k, v = _leaves((B, H, N, D), (B, H, N, D), (B, H, N, D), scale=scale)
    _check(_causal_fill(fill), [q, k, v], kernel)


@pytest.mark.parametrize("kernel", KERNELS)
def test_finite_key_padding_fill_on_cuda(kernel):
    q, k, v = _leaves((B, H, N, D), (B, H, N, D), (B, H, N, D), scale=2.0)
    lens = torch.tensor([N, N // 3], device="cuda")

    def f(q, k, v):
        s = q @ k.transpose(-1, -2) * D ** -0.5
        pad = torch.arange(s.shape[-1], device=s.device)[None, :] >= lens[:, None]
        return s.masked_fill(pad[:, None, None, :], -20.0).softmax(-1) @ v

    _check(f, [q, k, v], kernel)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("mask_dtype", ["scores", "float32"])
def test_absorbing_float_mask_on_cuda(kernel, mask_dtype):
    # An HF-style extended mask from a float attention_mask (data the pass cannot prove 0 / 1) reaches the
    # op as a float bias; sequence 1 is all padding, so eager (bf16, where s + finfo.min rounds to
    # finfo.min) weighs its rows uniformly. cuDNN and our Triton kernels read such rows as empty: dispatch
    # refuses them for a bias that can hold such values (fa_compile/kernels/reference.py absorbing_bias_refusal).
    q, k, v = _leaves((B, H, N, D), (B, H, N, D), (B, H, N, D))
    am, = _leaves((B, N), grad=False)
    am.data.fill_(1.0)
    am.data[0, N // 3:] = 0.0
    am.data[1] = 0.0

    def f(q, k, v, am):
        dt = q.dtype if mask_dtype == "scores" else torch.float32
        mask = (1.0 - am[:, None, None, :].to(dt)) * torch.finfo(dt).min
        s = q @ k.transpose(-1, -2) * D ** -0.5 + mask
        return s.softmax(-1).to(q.dtype) @ v

    _check(f, [q, k, v, am], kernel, dtype=torch.bfloat16)


@pytest.mark.parametrize("kernel", [None, "triton"])
def test_scores_under_no_grad_on_cuda(kernel):
    q, k, v = _leaves((B, H, N, D), (B, H, N, D), (B, H, N, D))

    def f(q, k, v):
        with torch.no_grad():
            s = q @ k.transpose(-1, -2) * D ** -0.5
        return s.softmax(-1) @ v

    _check(f, [q, k, v], kernel)


def test_matmul_out_buffer_on_cuda():
    q, k, v = (t.detach().half() for t in _leaves((B, H, N, D), (B, H, N, D), (B, H, N, D), grad=False))

    def f(q, k, v, buf):
        p = (q @ k.transpose(-1, -2) * D ** -0.5).softmax(-1)
        torch.matmul(p, v, out=buf)
        return buf

    torch._dynamo.reset()
    want = f(q, k, v, torch.empty_like(q))
    buf = torch.full_like(q, float("nan"))
    got = torch.compile(f, backend="fa3")(q, k, v, buf)
    assert got.data_ptr() == buf.data_ptr()
    assert not buf.isnan().any()
    torch.testing.assert_close(buf, want, atol=5e-3, rtol=5e-3)


@pytest.mark.parametrize("dim", ["batch", "heads", "queries", "keys"])
def test_zero_size_on_cuda(dim):
    shape = dict(batch=(0, H, N, D), heads=(B, 0, N, D), queries=(B, H, 0, D), keys=(B, H, N, D))[dim]
    kshape = (B, H, 0, D) if dim == "keys" else shape
    q, = _leaves(shape)
    k, v = _leaves(kshape, kshape, seed=1)

    def f(q, k, v):
        return (q @ k.transpose(-1, -2) * D ** -0.5).softmax(-1) @ v

    _check(f, [q, k, v], None)
