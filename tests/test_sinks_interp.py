"""Attention sinks in the Triton kernels under the Triton interpreter (CPU), against the reference.

Same arrangement as test_kernels_interp.py: unless this process already runs with TRITON_INTERPRET=1,
one test runs this module in a fresh subprocess with it set. Outputs and gradient buffers are poisoned
(NaN) so every element must be written; the sinks' gradient (the autograd formula's reduction over
dO, O and the kernel's lse) is checked against torch autograd of the reference.
"""
from __future__ import annotations

import os

import pytest
import torch

from fa_compile.kernels import triton_family as tf

IN_CHILD = os.environ.get("TRITON_INTERPRET") == "1"
needs_triton = pytest.mark.skipif(not tf.triton_available(), reason="triton not installed")

if not IN_CHILD:

    @needs_triton
    def test_sinks_under_interpreter():
        from fa_compile.kernels.triton_testing import run_under_interpreter

        run_under_interpreter(__file__)

else:
    from fa_compile.kernels import reference as ref
    from fa_compile.kernels.triton_testing import make_case, poisoned_backward, poisoned_forward, tolerances

    pytestmark = pytest.mark.usefixtures("tf32_matmul")

    def _check_with_sinks(case, sinks: torch.Tensor) -> dict:
        case.sinks = sinks
        (fa, fr), (ga, gr) = tolerances(case.q.dtype, case.q.device)
        out, lse = poisoned_forward(case)
        r_out, r_lse = ref.attention_reference(case.q, case.k, case.v, sinks=sinks, **case.mask_kwargs())
        torch.testing.assert_close(out, r_out, atol=fa, rtol=fr, msg=lambda m: "out: " + m)
        torch.testing.assert_close(lse, r_lse, atol=1e-4, rtol=1e-4, msg=lambda m: "lse: " + m)
        g = torch.Generator().manual_seed(1234)
        dout = torch.randn(out.shape, generator=g).to(out.dtype)
        dq, dk, dv, _ = poisoned_backward(case, dout, out, lse)
        r = ref.attention_backward_reference(dout, case.q, case.k, case.v, bias_requires_grad=False, sinks=sinks,
                                             **case.mask_kwargs())
        for name, got, want in (("dq", dq, r[0]), ("dk", dk, r[1]), ("dv", dv, r[2])):
            torch.testing.assert_close(got, want, atol=ga, rtol=gr, msg=lambda m, n=name: f"{n}: " + m)
        # d sinks from the kernel's (out, lse) against autograd of the reference forward (fp32 math).
        s32 = sinks.detach().float().requires_grad_(True)
        a_out, _ = ref.attention_reference(case.q.float(), case.k.float(), case.v.float(), sinks=s32,
                                           **case.mask_kwargs())
        (want_ds,) = torch.autograd.grad(a_out, s32, dout.float())
        got_ds = ref.sink_grad_reference(sinks.float(), lse, dout, out)
        torch.testing.assert_close(got_ds, want_ds, atol=ga, rtol=gr, msg=lambda m: "dsinks: " + m)
        return {"out": out, "lse": lse, "dq": dq}

    @pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
    @pytest.mark.parametrize("kw", [
        dict(nq=37, nk=29, d=40, hq=4, hkv=2, layout="bshd"),
        dict(nq=33, nk=45, d=32, causal=True, diag_offset=12, bias_shape=(33, 45)),
        dict(nq=30, nk=30, d=16, window_left=5, window_right=2, kv_lens=[30, 11], softcap=3.0),
    ], ids=["gqa", "causal_bias", "window_kvlens_softcap"])
    def test_sinks_forward_backward(kw, dtype):
        case = make_case(dtype=dtype, seed=3, **kw)
        hq = case.q.shape[1]
        sinks = torch.randn(hq, generator=torch.Generator().manual_seed(7)) * 2
        _check_with_sinks(case, sinks.to(dtype))

    def test_sinks_empty_rows_attend_to_the_sink():
        # diag_offset -7: rows i < 7 have no admissible key, so they see the sink alone: out 0, lse = sink.
        case = make_case(nq=24, nk=24, d=16, hq=2, causal=True, diag_offset=-7, dtype=torch.float32)
        sinks = torch.tensor([0.5, -1.25])
        res = _check_with_sinks(case, sinks)
        assert (res["out"][:, :, :7] == 0).all()
        assert torch.equal(res["lse"][:, :, :7], sinks.view(1, 2, 1).expand(2, 2, 7))
        assert torch.isfinite(res["dq"]).all()

    @pytest.mark.parametrize("kw", [
        dict(nq=40, nk=56, d=32, hq=4, hkv=2, layout="bshd", causal=True),
        dict(nq=24, nk=24, d=16, hq=2, causal=True, diag_offset=-7),  # rows without keys: the sink alone
    ], ids=["gqa_causal", "empty_rows"])
    def test_sinks_tma_forward(kw, monkeypatch):
        # The descriptor (TMA) forward has the same sink step as the pointer kernel.
        monkeypatch.setenv("FA_COMPILE_TRITON_TMA", "1")
        calls = []
        real = tf._forward_tma
        monkeypatch.setattr(tf, "_forward_tma", lambda *a, **k: calls.append(1) or real(*a, **k))
        case = make_case(dtype=torch.float16, seed=5, **kw)
        _check_with_sinks(case, (torch.randn(case.q.shape[1], generator=torch.Generator().manual_seed(2)) * 2)
                          .to(torch.float16))
        assert calls  # the TMA path ran

    @pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
    @pytest.mark.parametrize("with_dlse", [False, True])
    def test_sink_grad_kernel(dtype, with_dlse):
        # The fused reduction against the reference formula, with rows whose lse is -inf (no key, sink -inf)
        # and a query count that is not a multiple of the block.
        from fa_compile.kernels.sink_grad import sink_grad

        g = torch.Generator().manual_seed(11)
        b, hq, nq, dv = 2, 3, 70, 24
        out = torch.randn(b, nq, hq, dv, generator=g).to(dtype).transpose(1, 2)  # BSHD storage
        dout = torch.randn(b, hq, nq, dv, generator=g).to(dtype)
        lse = torch.randn(b, hq, nq, generator=g) + 2
        sinks = torch.randn(hq, generator=g).to(dtype)
        sinks[2] = float("-inf")
        lse[:, 2, :5] = float("-inf")
        dlse = torch.randn(b, hq, nq, generator=g) if with_dlse else None
        got = sink_grad(sinks, lse, dout, out, dlse)
        want = ref.sink_grad_reference(sinks, lse, dout, out, dlse)
        assert got.dtype == sinks.dtype
        torch.testing.assert_close(got, want, atol=1e-3 if dtype == torch.float16 else 1e-5, rtol=1e-3)

    def test_sinks_with_dropout():
        case = make_case(nq=21, nk=26, d=16, dropout_p=0.25, dtype=torch.float16)
        _check_with_sinks(case, torch.tensor([0.3, 1.7], dtype=torch.float16))

    def test_sinks_through_the_op_with_the_triton_kernel():
        # Dispatch, the op's autograd and its sink gradient around the forced Triton kernel.
        import fa_compile

        g = torch.Generator().manual_seed(5)
        q = torch.randn(2, 4, 19, 16, generator=g).half().requires_grad_(True)
        k = torch.randn(2, 2, 23, 16, generator=g).half().requires_grad_(True)
        v = torch.randn(2, 2, 23, 16, generator=g).half().requires_grad_(True)
        s = torch.randn(4, generator=g).requires_grad_(True)
        out = fa_compile.attention(q, k, v, causal="bottom_right", sinks=s, kernel="triton")
        want = fa_compile.attention(q, k, v, causal="bottom_right", sinks=s, kernel="reference")
        torch.testing.assert_close(out, want, atol=2e-3, rtol=2e-3)
        dout = torch.randn(out.shape, generator=g).half()
        got_g = torch.autograd.grad(out, (q, k, v, s), dout)
        want_g = torch.autograd.grad(want, (q, k, v, s), dout)
        for name, a, b in zip(("dq", "dk", "dv", "dsinks"), got_g, want_g):
            torch.testing.assert_close(a, b, atol=1e-2, rtol=1e-2, msg=lambda m, n=name: f"{n}: {m}")
