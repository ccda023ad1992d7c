"""Attention sinks on the GPU: every forward of the Triton family (Gluon and TMA-descriptor kernels on
Hopper, the pointer kernel everywhere) against the fp32 reference, outputs and every gradient (the
sinks' own too), outputs poisoned first; and a compiled module whose sink site is lowered to the
Triton ops, against eager. Tolerances are bf16's (triton_testing.tolerances)."""
from __future__ import annotations

import pytest
import torch

import fa_compile
from fa_compile.kernels import reference as ref
from fa_compile.kernels import triton_family as tf

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or not tf.triton_available(), reason="needs a CUDA GPU")

PATHS = {  # environment of each forward path, and the kernel it must run
    "gluon": ({}, "attn_fwd_gluon_ws_kernel"),
    "tma": ({"FA_COMPILE_GLUON": "0"}, "attn_fwd_tma_kernel"),
    "pointer": ({"FA_COMPILE_TRITON_TMA": "0"}, "attn_fwd_kernel"),
}


def _forward_ran() -> str:
    """The name of the forward kernel the last call launched (triton_family.LAST_COMPILED's handle)."""
    for key in ("attn_fwd_gluon_kernel", "attn_fwd_kernel"):
        if key in tf.LAST_COMPILED:
            handle = tf.LAST_COMPILED[key][1]
            return str(getattr(handle, "name", None) or getattr(getattr(handle, "metadata", None), "name", key))
    return "none"


def _hopper() -> bool:
    return torch.cuda.get_device_capability()[0] == 9


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("d,causal,hq,hkv,n,key_pad", [
    (64, True, 8, 2, 1000, False), (128, True, 8, 8, 777, True), (128, False, 4, 2, 1031, False),
    (256, True, 4, 4, 640, False),
], ids=["d64_causal_gqa", "d128_causal_keypad", "d128_gqa", "d256_causal"])
def test_sinks_each_forward_path(path, d, causal, hq, hkv, n, key_pad, monkeypatch):
    env, kernel = PATHS[path]
    if path != "pointer" and not _hopper():
        pytest.skip("the Gluon and TMA forwards run on Hopper")
    for k_, v_ in env.items():
        monkeypatch.setenv(k_, v_)
    g = torch.Generator(device="cuda").manual_seed(0)
    b, dev, dt = 2, "cuda", torch.bfloat16
    q = torch.randn(b, hq, n, d, device=dev, dtype=dt, generator=g).requires_grad_()
    k = torch.randn(b, hkv, n, d, device=dev, dtype=dt, generator=g).requires_grad_()
    v = torch.randn(b, hkv, n, d, device=dev, dtype=dt, generator=g).requires_grad_()
    sinks = (torch.randn(hq, device=dev, generator=g) * 3).requires_grad_()
    bias = None
    if key_pad:  # a key-padding mask: batch row 1 keeps its first 300 keys
        keep = torch.ones(b, 1, 1, n, dtype=torch.bool, device=dev)
        keep[1, ..., 300:] = False
        bias = keep
    tf.LAST_COMPILED.clear()
    out = fa_compile.attention(q, k, v, causal=causal, sinks=sinks, bias=bias, kernel="triton")
    assert _forward_ran() == kernel, f"{path}: {kernel} did not run ({_forward_ran()})"
    do = torch.randn(out.shape, device=dev, dtype=dt, generator=g)
    out.backward(do)
    qr, kr, vr, sr = (t.detach().float().requires_grad_() for t in (q, k, v, sinks))
    r_out, _ = ref.attention_reference(qr, kr, vr, scale=d ** -0.5, causal=causal, bias=bias, sinks=sr)
    r_out.backward(do.float())
    torch.testing.assert_close(out.float(), r_out, atol=2e-2, rtol=2e-2, msg=lambda m: "out: " + m)
    for name, got, want in (("dq", q.grad, qr.grad), ("dk", k.grad, kr.grad), ("dv", v.grad, vr.grad)):
        torch.testing.assert_close(got.float(), want, atol=5e-2, rtol=5e-2, msg=lambda m, nm=name: f"{nm}: " + m)
    # d sinks sums B x Nq terms: compared relative to its scale
    torch.testing.assert_close(sinks.grad, sr.grad, atol=2e-2 * float(sr.grad.abs().max()) + 1e-3, rtol=2e-2)


@pytest.mark.parametrize("path", ["gluon", "tma"])
def test_sinks_rows_without_keys(path, monkeypatch):
    # causal with a negative diagonal: rows 0..6 see no key, so they attend to the sink alone (out 0).
    if not _hopper():
        pytest.skip("the Gluon and TMA forwards run on Hopper")
    env, kernel = PATHS[path]
    for k_, v_ in env.items():
        monkeypatch.setenv(k_, v_)
    g = torch.Generator(device="cuda").manual_seed(1)
    q, k, v = (torch.randn(1, 4, 256, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    sinks = torch.randn(4, device="cuda", generator=g)
    tf.LAST_COMPILED.clear()
    out, lse = torch.ops.fa3.attention(q, k, v, 128 ** -0.5, True, -7, -1, -1, None, None, 0.0, 0.0, None,
                                       "triton", sinks)
    assert _forward_ran() == kernel, _forward_ran()
    assert (out[:, :, :7] == 0).all()
    torch.testing.assert_close(lse[:, :, :7], sinks.view(1, 4, 1).expand(1, 4, 7), atol=1e-5, rtol=1e-5)
    r_out, r_lse = ref.attention_reference(q.float(), k.float(), v.float(), scale=128 ** -0.5, causal=True,
                                           diag_offset=-7, sinks=sinks)
    torch.testing.assert_close(out.float(), r_out, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, r_lse, atol=1e-3, rtol=1e-3)


class _SinkAttention(torch.nn.Module):
    """GPT-OSS's spelling: a learned sink column concatenated before softmax, then dropped."""

    def __init__(self, heads: int):
        super().__init__()
        self.sinks = torch.nn.Parameter(torch.randn(heads))

    def forward(self, q, k, v):
        s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
        n = s.shape[-1]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
        col = self.sinks.reshape(1, -1, 1, 1).expand(q.shape[0], -1, q.shape[-2], -1)
        combined = torch.cat([s, col.to(s.dtype)], dim=-1)
        combined = combined - combined.max(dim=-1, keepdim=True).values
        p = torch.softmax(combined, dim=-1, dtype=combined.dtype)[..., :-1]
        return p @ v


def test_compiled_sink_site_is_lowered():
    torch._dynamo.reset()
    m = _SinkAttention(8).cuda()
    g = torch.Generator(device="cuda").manual_seed(2)
    q, k, v = (torch.randn(2, 8, 256, 64, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
               for _ in range(3))
    report = fa_compile.explain(m, q, k, v)
    assert "fa3_triton.fwd" in str(report), str(report)
    got = torch.compile(m, backend="fa3")(q, k, v)
    do = torch.randn(got.shape, device="cuda", dtype=torch.bfloat16, generator=g)
    got.backward(do)
    grads = [t.grad.clone() for t in (q, k, v)] + [m.sinks.grad.clone()]
    for t in (q, k, v):
        t.grad = None
    m.sinks.grad = None
    qr, kr, vr = (t.detach().float().requires_grad_() for t in (q, k, v))
    mr = _SinkAttention(8).cuda()
    mr.load_state_dict(m.state_dict())
    want = mr(qr, kr, vr)
    want.backward(do.float())
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)
    for name, a, b in zip(("dq", "dk", "dv", "dsinks"), grads, (qr.grad, kr.grad, vr.grad, mr.sinks.grad)):
        torch.testing.assert_close(a.float(), b, atol=5e-2 * max(1.0, float(b.abs().max())), rtol=5e-2,
                                   msg=lambda msg, n=name: f"{n}: " + msg)
