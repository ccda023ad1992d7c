"""Forward-mode AD (torch.autograd.forward_ad) through compiled graphs and through the op (fa_compile/forward_ad.py).

Inductor's generated code drops tangents without a word, for any op. `backend="fa3"` runs a call whose inputs carry
tangents through the graph as traced instead, and the op computes through the reference math when its inputs
carry them (its kernels would drop them). Tangents, primals and reverse-mode gradients are compared with eager
on every element. The direct call through a Triton kernel runs under the interpreter in a child process.
"""
from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.autograd.forward_ad as fwAD

import fa_compile
from fa_compile.kernels import triton_family as tf

IN_CHILD = os.environ.get("TRITON_INTERPRET") == "1"


def _padded(q, k, v, m):
    s = (q @ k.transpose(-1, -2) * 0.3).masked_fill(m, torch.finfo(q.dtype).min)
    return torch.softmax(s, -1) @ v


def _causal_gqa(q, k, v, m):  # (eager SDPA has no forward-AD formula on CPU: the matmul spelling)
    k, v = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    s = q @ k.transpose(-1, -2) * 8 ** -0.5
    causal = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1)
    return torch.softmax(s.masked_fill(causal, float("-inf")), -1) @ v


def _causal(q, k, v):
    s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    causal = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1)
    return torch.softmax(s.masked_fill(causal, float("-inf")), -1) @ v


def _bias(q, k, v, m):
    return torch.softmax(q @ k.transpose(-1, -2) / 3.0 + m.to(q.dtype) * -2.5, dim=-1) @ v


def _inputs(fn, device: str = "cpu"):
    g = torch.Generator().manual_seed(11)
    hkv = 2 if fn is _causal_gqa else 4
    q = torch.randn(2, 4, 12, 8, generator=g)
    k, v = (torch.randn(2, hkv, 12, 8, generator=g) for _ in range(2))
    m = torch.zeros(2, 1, 12, 12, dtype=torch.bool)
    m[0, :, 3] = True  # a row with no key: eager's finfo.min fill gives the mean of V there
    m[1, ..., 7:] = True
    tangents = tuple(torch.randn(t.shape, generator=g).to(device) for t in (q, k, v))
    return tuple(t.to(device) for t in (q, k, v, m)), tangents


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _dual_call(fn, args, tangents, grad: bool):
    q, k, v, m = args
    q = q.clone().requires_grad_(grad)
    with fwAD.dual_level():
        duals = [fwAD.make_dual(x, t) for x, t in zip((q, k, v), tangents)]
        out = fn(*duals, m)
        primal, tangent = fwAD.unpack_dual(out)
    dq = torch.autograd.grad(primal, q, torch.ones_like(primal))[0] if grad else None
    return primal, tangent, dq


@pytest.mark.parametrize("fn", [_padded, _causal_gqa, _bias], ids=["finfo_min_fill", "causal_gqa", "bias"])
@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=cuda)])
def test_tangents_through_a_compiled_graph_equal_eagers(fn, grad, device):
    torch._dynamo.reset()
    args, tangents = _inputs(fn, device)
    compiled = torch.compile(fn, backend="fa3")
    plain = compiled(*args)  # compiled first without tangents: the rewritten, lowered graph
    torch.testing.assert_close(plain, fn(*args), atol=1e-5, rtol=1e-5)
    assert len(fa_compile.explain(fn, *args).rewritten) >= 1
    want = _dual_call(fn, args, tangents, grad)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = _dual_call(compiled, args, tangents, grad)
        _dual_call(compiled, args, tangents, grad)
    assert sum("forward-mode AD" in str(w.message) for w in caught) == 1  # once per graph
    assert got[1] is not None, "the tangent was dropped"
    for name, a, b in zip(("out", "tangent", "dq"), got, want):
        if b is not None:
            assert torch.equal(torch.isnan(a), torch.isnan(b)), name
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, equal_nan=True, msg=lambda s, n=name: f"{n}: {s}")
    # and calls without tangents still run the compiled code
    torch.testing.assert_close(compiled(*args), fn(*args), atol=1e-5, rtol=1e-5)


def test_attention_backward_refuses_tangents():
    g = torch.Generator().manual_seed(2)
    q, k, v, dout = (torch.randn(1, 2, 4, 8, generator=g) for _ in range(4))
    out, lse = torch.ops.fa3.attention(q, k, v, 0.5)
    with fwAD.dual_level(), pytest.raises(RuntimeError, match="forward-mode AD"):
        torch.ops.fa3.attention_backward(fwAD.make_dual(dout, torch.ones_like(dout)), q, k, v, out, lse, 0.5)


@cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_direct_call_on_cuda_carries_tangents(dtype):
    # cuDNN / FA2 / our kernels return plain tensors: without the reference path the tangent would be None.
    g = torch.Generator().manual_seed(5)
    q, k, v, tq, tk, tv = (torch.randn(2, 4, 64, 64, generator=g).to("cuda", dtype) for _ in range(6))
    with fwAD.dual_level():
        duals = [fwAD.make_dual(x, t) for x, t in ((q, tq), (k, tk), (v, tv))]
        got = fwAD.unpack_dual(fa_compile.attention(*duals, causal=True)).tangent
        want = fwAD.unpack_dual(_causal(*(d.float() for d in duals))).tangent
    assert got is not None
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)


if not IN_CHILD:

    @pytest.mark.skipif(not tf.triton_available(), reason="triton not installed")
    def test_direct_calls_under_interpreter():
        from fa_compile.kernels.triton_testing import run_under_interpreter

        run_under_interpreter(__file__)

else:

    @pytest.mark.parametrize("kernel", [None, "triton"])
    def test_direct_call_carries_tangents(kernel):
        # A Triton kernel returns a plain tensor: without the reference path the tangent would be None.
        g = torch.Generator().manual_seed(5)
        q, k, v, tq, tk, tv = (torch.randn(2, 2, 16, 16, generator=g).half() for _ in range(6))
        with fwAD.dual_level():
            duals = [fwAD.make_dual(x, t) for x, t in ((q, tq), (k, tk), (v, tv))]
            out = fa_compile.attention(*duals, causal=True, kernel=kernel)
            got = fwAD.unpack_dual(out).tangent
            want = fwAD.unpack_dual(_causal(*(d.float() for d in duals))).tangent
        assert got is not None
        torch.testing.assert_close(got.float(), want, atol=2e-3, rtol=2e-3)
