"""Compile-time lowering on a CUDA GPU: each SDPA-family kernel as its aten op in Inductor's graph,
against the same kernel run by the op's run-time dispatch (outputs, log-sum-exp, gradients), and
the sites that keep the op (our Triton family, dynamic sizes). Skipped without CUDA (CI has none)."""
from __future__ import annotations

import pytest
import torch

import fa_compile
from fa_compile.lowering import records

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

F16 = torch.float16
TOL = dict(atol=5e-3, rtol=5e-3)


@pytest.fixture(autouse=True)
def _no_compile_caches():
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    with inductor_config.patch(fx_graph_cache=False), functorch_config.patch(enable_autograd_cache=False):
        yield


def _inputs(b=2, hq=4, hkv=4, nq=256, nk=256, d=64, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    # BSHD storage, as models hold them
    q = torch.randn(b, nq, hq, d, device="cuda", generator=g, dtype=F16).transpose(1, 2)
    k = torch.randn(b, nk, hkv, d, device="cuda", generator=g, dtype=F16).transpose(1, 2)
    v = torch.randn(b, nk, hkv, d, device="cuda", generator=g, dtype=F16).transpose(1, 2)
    return q, k, v


def _run(fn, q, k, v, w, grad=True):
    q, k, v = (t.detach().clone().requires_grad_(grad) for t in (q, k, v))
    out, lse = fn(q, k, v)
    if not grad:
        return out, lse
    (out.float() * w).sum().backward()
    return out, lse, q.grad, k.grad, v.grad


def _padding(b, nk):
    keep = torch.ones(b, 1, 1, nk, dtype=torch.bool, device="cuda")
    keep[0, ..., nk - 37:] = False
    keep[1] = False  # an empty batch: every row empty
    return keep


CASES = {
    # name: (input kwargs, attention kwargs, forced kernel, gradients, expected lowered kernel)
    "dense": ({}, {}, None, True, "cudnn"),
    "causal": ({}, dict(causal=True), None, True, "cudnn"),
    "gqa_causal": (dict(hq=8, hkv=2), dict(causal=True), None, True, "cudnn"),
    "key_padding": ({}, dict(bias="padding"), None, True, "cudnn"),
    "kv_lens": ({}, dict(kv_lens="lens"), None, True, None),  # cuDNN, or FA3 where installed
    "flash_causal": ({}, dict(causal=True), "flash", True, "flash"),
    "efficient_forward": ({}, {}, "efficient", False, "efficient"),
    "decode_gqa": (dict(hq=16, hkv=8, nq=1, nk=320, d=128), {}, None, False, None),
    "fa3_causal": ({}, dict(causal=True), "fa3", False, "fa3"),
    "fa3_decode_kv_lens": (dict(hq=16, hkv=8, nq=1, nk=320, d=128), dict(kv_lens="lens"), "fa3", False, "fa3"),
    # a static cache's prefill: run-time positions over a longer cache (only the Triton family takes them)
    "positions": (dict(hq=8, hkv=2, nq=200, nk=320), dict(q_pos="positions"), None, True, "triton"),
    "segments": ({}, dict(causal=True, q_seg="segments", k_seg="segments"), None, True, "triton"),
}


def _kwargs(spec, b, nk):
    kw = dict(spec)
    if kw.get("bias") == "padding":
        kw["bias"] = _padding(b, nk)
    if kw.get("kv_lens") == "lens":
        kw["kv_lens"] = torch.tensor([nk - 50, 0], device="cuda")
    if kw.get("q_pos") == "positions":  # sequence 0 from slot 0, sequence 1 from slot 100, one row with no key
        pos = torch.stack([torch.arange(200), torch.arange(100, 300)]).to("cuda")
        pos[1, 7] = -1
        kw["q_pos"] = pos
    if kw.get("q_seg") == "segments":  # packed sequences of 100, 1 and 155 tokens
        seg = torch.tensor([0] * 100 + [1] + [2] * 155, dtype=torch.int32, device="cuda")
        kw["q_seg"] = kw["k_seg"] = seg
    return kw


@pytest.mark.parametrize("case", list(CASES))
def test_lowered_kernel_matches_the_op(case):
    shape, spec, forced, grad, expect = CASES[case]
    if forced == "fa3":
        from fa_compile.candidates.fa3 import _module

        if _module()[0] is None:
            pytest.skip("FA3 (flash_attn_interface) not installed")
    q, k, v = _inputs(**shape)
    kw = _kwargs(spec, q.shape[0], k.shape[2])

    def fn(q, k, v):
        return fa_compile.attention(q, k, v, return_lse=True, kernel=forced, **kw)

    w = torch.randn(q.shape[0], q.shape[1], q.shape[2], v.shape[3], device="cuda")
    torch._dynamo.reset()
    n = len(records())
    got = _run(torch.compile(fn, backend="fa3", fullgraph=True), q, k, v, w, grad)
    want = _run(fn, q, k, v, w, grad)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(a, b, **TOL, msg=lambda m: f"{name}: {m}")
    decisions = [r.decision for r in records()[n:]]
    assert decisions and all(d.lowered for d in decisions), [str(d) for d in decisions]
    if expect is not None:
        assert all(d.kernel == expect for d in decisions), [str(d) for d in decisions]


@pytest.mark.parametrize("kernel", ["cudnn", "efficient", "flash"])
@pytest.mark.parametrize("causal", [False, True])
def test_an_inference_site_that_reads_no_lse_matches_the_op(kernel, causal):
    """Only out is read: cuDNN and mem-efficient are asked for no lse (lowering/sdpa.py); every element compared."""
    q, k, v = _inputs()

    def fn(q, k, v):
        return fa_compile.attention(q, k, v, causal=causal, kernel=kernel).transpose(1, 2).reshape(2, 256, -1)

    torch._dynamo.reset()
    n = len(records())
    with torch.no_grad():
        got = torch.compile(fn, backend="fa3", fullgraph=True)(q, k, v)
        want = fn(q, k, v)
    torch.testing.assert_close(got, want, **TOL)
    decisions = [r.decision for r in records()[n:]]
    assert decisions and all(d.lowered and d.kernel == kernel for d in decisions), [str(d) for d in decisions]


@pytest.mark.parametrize("switch", ["auto", "0"])
def test_triton_family_lowering_follows_its_switch(switch, monkeypatch):
    # A forced Triton kernel at a short length (Nq x Nk <= 1024 x 1024: the pointer kernels) is lowered to
    # fa3_triton's ops by default, and keeps the op with FA_COMPILE_TRITON_LOWER=0; the numbers match
    # either way, forward and backward.
    from fa_compile.kernels import triton_family as tf

    if not tf.triton_available():
        pytest.skip("triton not installed")
    monkeypatch.setenv("FA_COMPILE_TRITON_LOWER", switch)
    q, k, v = _inputs()
    fn = lambda q, k, v: fa_compile.attention(q, k, v, causal=True, return_lse=True, kernel="triton")
    w = torch.randn(2, 4, 256, 64, device="cuda")
    torch._dynamo.reset()
    n = len(records())
    got = _run(torch.compile(fn, backend="fa3"), q, k, v, w)
    for a, b in zip(got, _run(fn, q, k, v, w)):
        torch.testing.assert_close(a, b, **TOL)
    decisions = [r.decision for r in records()[n:]]
    assert decisions and all(d.kernel == "triton" for d in decisions), [str(d) for d in decisions]
    assert all(d.lowered == (switch == "auto") for d in decisions), [str(d) for d in decisions]


def test_dynamic_sizes_keep_the_op_on_cuda():
    fn = lambda q, k, v: fa_compile.attention(q, k, v, causal=True, return_lse=True)
    torch._dynamo.reset()
    n = len(records())
    f = torch.compile(fn, backend="fa3", dynamic=True)
    for nq in (128, 200):
        q, k, v = _inputs(nq=nq, nk=nq, seed=nq)
        for a, b in zip(f(q, k, v), fn(q, k, v)):
            torch.testing.assert_close(a, b, **TOL)
    decisions = [r.decision for r in records()[n:]]
    assert decisions and all(not d.lowered and "dynamic" in d.reason for d in decisions)


@pytest.mark.parametrize("mode", ["reduce-overhead", "max-autotune-no-cudagraphs"])
def test_modes_run_the_lowered_kernel(mode):
    fn = lambda q, k, v: fa_compile.attention(q, k, v, causal=True, return_lse=True)
    torch._dynamo.reset()
    n = len(records())
    f = torch.compile(fn, backend="fa3", mode=mode)
    for seed in (0, 1, 2):
        q, k, v = _inputs(seed=seed)
        for a, b in zip(f(q, k, v), fn(q, k, v)):
            torch.testing.assert_close(a, b, **TOL)
    assert any(r.decision.lowered for r in records()[n:])
