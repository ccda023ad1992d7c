"""A mask is recognised alike on every device: spellings whose masks are compile-time constants (buffers, index
arithmetic of static shapes) get the same site reports on CUDA as on CPU, and their compiled outputs and
gradients on CUDA equal eager's. The pass evaluates such constants to analyse them, and compares them with index
tensors it builds on the host; a constant that stayed on the model's device made that comparison fail, and the
site was refused on CUDA only."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import fa_compile
from test_masks import NanoGPT, _fn_arange_where, _fn_tril
from test_spellings import TrilBufferMask, _chunked_causal

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def square_subsequent_mask(q, k, v):
    """PyTorch's old tutorial: (triu(ones) == 1).transpose(0, 1), then .float() filled -inf / 0.0."""
    sz = q.shape[-2]
    mask = (torch.triu(torch.ones(sz, sz, device=q.device)) == 1).transpose(0, 1)
    mask = mask.float().masked_fill(mask == 0, float("-inf")).masked_fill(mask == 1, 0.0)
    return (q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]) + mask).softmax(-1) @ v


def window_from_arange(q, k, v):
    n = q.shape[-2]
    i, j = torch.arange(n, device=q.device)[:, None], torch.arange(n, device=q.device)[None, :]
    return (q @ k.transpose(-2, -1)).masked_fill((j > i) | (i - j > 2), float("-inf")).softmax(-1) @ v


def setitem_causal(q, k, v):
    s = q @ k.transpose(-2, -1) * 0.25
    n = s.shape[-1]
    s[torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1).expand(s.shape)] = -math.inf
    return torch.softmax(s, -1) @ v


class BufferFillValue(nn.Module):
    """Reformer: the fill is a 0-d module buffer, torch.where(keep, s, self.mask_value)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("mask_value", torch.tensor(torch.finfo(torch.float32).min), persistent=False)

    def forward(self, q, k, v):
        n = q.shape[-2]
        keep = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        return torch.softmax(torch.where(keep, q @ k.transpose(-2, -1) * 0.25, self.mask_value), -1) @ v


CASES = [
    ("nanogpt tril buffer", NanoGPT, (2, 2, 6, 8)),
    ("multiplicative tril buffer", lambda: TrilBufferMask(-1e9), (2, 2, 6, 8)),
    ("reformer chunks", lambda: _chunked_causal(False), (2, 2, 2, 3, 8)),
    ("tril of ones", lambda: _fn_tril, (2, 2, 6, 8)),
    ("arange where", lambda: _fn_arange_where, (2, 2, 6, 8)),
    ("square subsequent mask", lambda: square_subsequent_mask, (2, 2, 6, 8)),
    ("window from arange", lambda: window_from_arange, (2, 2, 6, 8)),
    ("0-d buffer fill", BufferFillValue, (2, 2, 6, 8)),
    ("setitem of a causal mask", lambda: setitem_causal, (2, 2, 6, 8)),
]


def _inputs(shape, device):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(*shape, generator=g).to(device).requires_grad_() for _ in range(3)]


def _on(fn, device):
    return fn.to(device) if isinstance(fn, nn.Module) else fn


def _summary(fn, shape, device) -> list:
    rep = fa_compile.explain(_on(fn, device), *[x.detach() for x in _inputs(shape, device)])
    return [(s.rewritten, s.mask, s.reason) for s in rep.sites]


@pytest.mark.parametrize("name,make,shape", CASES, ids=[c[0] for c in CASES])
def test_same_reports_on_cuda_as_on_cpu(name, make, shape):
    on_cpu = _summary(make(), shape, "cpu")
    assert on_cpu and all(r[0] for r in on_cpu), on_cpu
    assert _summary(make(), shape, "cuda") == on_cpu


@pytest.mark.parametrize("name,make,shape", CASES, ids=[c[0] for c in CASES])
def test_compiled_on_cuda_equals_eager(name, make, shape):
    fn = _on(make(), "cuda")
    ref_args, got_args = _inputs(shape, "cuda"), _inputs(shape, "cuda")
    torch._dynamo.reset()
    out = torch.compile(fn, backend="fa3")(*got_args)
    ref = fn(*ref_args)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    g = torch.randn_like(ref)
    for a, b in zip(torch.autograd.grad(out, got_args, g), torch.autograd.grad(ref, ref_args, g)):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=2e-5)

