"""The FP8 attention kernel (fa_compile/kernels/fp8/kernel.py) under the Triton interpreter, against its emulation.

The interpreter must be on before Triton defines a kernel, so unless this process has TRITON_INTERPRET=1
the module reruns itself in a child with it (one parent test). The interpreter's e4m3 products are exact
and the kernel rounds P to e4m3 in fp32 there (to_e4m3), so the kernel and fp8_reference agree to the
last unit of the output dtype on every element; outputs are poisoned with NaN first. Shapes are tiny
and odd: 16 x 16 tiles, partial last blocks, several key blocks.
"""
from __future__ import annotations

import os

import pytest
import torch

from fa_compile.kernels import triton_family as tf

IN_CHILD = os.environ.get("TRITON_INTERPRET") == "1"
needs_triton = pytest.mark.skipif(not tf.triton_available(), reason="triton not installed")


@pytest.mark.skipif(IN_CHILD, reason="runs in the parent process")
def test_reasons():
    from fa_compile.kernels.fp8 import fp8_reasons

    q = torch.empty(1, 2, 8, 64, dtype=torch.bfloat16)
    if tf.triton_available():
        assert any("interpreter" in r for r in fp8_reasons(q, q, q))
    r = fp8_reasons(q.float(), q.float(), q.float())
    assert any("float32" in x for x in r) or r == ["triton not installed"]
    odd = torch.empty(1, 2, 8, 80, dtype=torch.bfloat16)
    assert any("head dims" in x for x in fp8_reasons(odd, odd, odd)) or not tf.triton_available()


if not IN_CHILD:

    @needs_triton
    def test_fp8_kernel_under_interpreter():
        from fa_compile.kernels.triton_testing import run_under_interpreter

        run_under_interpreter(__file__)

else:
    from fa_compile.kernels.fp8 import FP8, fp8_forward, fp8_reasons, fp8_reference
    from fa_compile.kernels.triton_testing import make_case

    TOL = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}  # two units in the last place of O(1) values

    def run_both(c, **kw):
        b, hq, nq, _ = c.q.shape
        dv = c.v.shape[-1]
        odt = kw.get("out_dtype") or (torch.bfloat16 if c.q.dtype == FP8 else c.q.dtype)
        out = torch.full((b, nq, hq, dv), float("nan"), dtype=odt).transpose(1, 2)
        lse = torch.full((b, hq, nq), float("nan"))
        mk = dict(causal=c.causal, diag_offset=c.diag_offset, window_left=c.window_left,
                  window_right=c.window_right, bias=c.bias, kv_lens=c.kv_lens)
        assert fp8_reasons(c.q, c.k, c.v, c.bias, c.kv_lens) == []
        got, got_lse = fp8_forward(c.q, c.k, c.v, c.scale, **mk, **kw, out=out, lse=lse)
        assert got is out and got_lse is lse
        want, want_lse = fp8_reference(c.q, c.k, c.v, c.scale, **mk, **kw, block_m=16, block_n=16)
        assert got.dtype == odt and got.stride() == out.stride()
        tol = TOL[odt]
        torch.testing.assert_close(got, want, atol=tol, rtol=tol, msg=lambda m: "out: " + m)
        torch.testing.assert_close(got_lse, want_lse, atol=1e-5, rtol=1e-6, msg=lambda m: "lse: " + m)
        return got, got_lse

    @pytest.mark.parametrize("kw", [
        dict(d=32, nq=37, nk=50, layout="bshd"),
        dict(d=64, dv=32, nq=21, nk=33, dtype=torch.bfloat16),
        dict(d=32, nq=40, nk=19, hq=4, hkv=2),
        dict(d=32, nq=35, nk=70, hq=4, hkv=1, causal=True, diag_offset=35, layout="bshd"),
    ], ids=["dense_bshd", "bf16_dv", "gqa", "causal_mqa_bottom_right"])
    def test_shapes(kw):
        run_both(make_case(**kw))

    def test_causal_negative_offset_empty_rows():
        out, lse = run_both(make_case(d=32, nq=40, nk=40, causal=True, diag_offset=-7))
        assert torch.isneginf(lse[:, :, :7]).all() and (out[:, :, :7] == 0).all()

    @pytest.mark.parametrize("wl,wr,causal", [(5, 3, False), (20, -1, True), (-1, 4, False)])
    def test_window(wl, wr, causal):
        run_both(make_case(d=32, nq=45, nk=45, window_left=wl, window_right=wr, causal=causal, diag_offset=2))

    def test_kv_lens_with_empty_batch_and_garbage():
        c = make_case(b=3, d=32, nq=20, nk=37, kv_lens=[37, 0, 18])
        c.k[2, :, 18:] = float("nan")  # past kv_lens: never read into a valid block
        out, lse = run_both(c)
        assert torch.isneginf(lse[1]).all() and (out[1] == 0).all()
        assert torch.isfinite(out).all()

    @pytest.mark.parametrize("shape,boolean", [((2, 2, 30, 41), False), ((30, 41), False), ((2, 1, 1, 41), True),
                                               ((1, 2, 30, 41), True)], ids=["full", "2d", "keymask", "bool_tile"])
    def test_bias(shape, boolean):
        run_both(make_case(d=32, nq=30, nk=41, bias_shape=shape, bias_bool=boolean, causal=len(shape) == 2))

    def test_smoothing_and_rotation_options():
        # The defaults (K smoothing, Hadamard) run everywhere else: here Q smoothing, and neither default.
        c = make_case(d=32, hq=4, hkv=2, nq=33, nk=40, causal=True)
        c.q = (c.q.float() + 2).half()
        run_both(c, smooth_q=True)
        run_both(c, smooth_k=False, hadamard=False)

    def test_int8_qk():
        run_both(make_case(d=32, hq=4, hkv=2, nq=37, nk=50, causal=True, diag_offset=13), qk_int8=True)
        run_both(make_case(d=64, nq=30, nk=41, bias_shape=(30, 41), kv_lens=[41, 22], window_left=11),
                 qk_int8=True, hadamard=False)

    def test_one_level_accumulation_and_negative_scale():
        run_both(make_case(d=32, nq=33, nk=50), two_level=False)
        run_both(make_case(d=32, nq=20, nk=37, causal=True, scale=-0.3))  # no row max shortcut for scale < 0

    def test_prequantized_with_descales():
        c = make_case(b=2, hq=4, hkv=2, d=32, nq=29, nk=40, causal=True)
        c.q, c.k, c.v = (t.to(FP8) for t in (c.q, c.k, c.v))
        g = torch.Generator().manual_seed(3)
        ds = [torch.rand(2, h, generator=g) + 0.5 for h in (4, 2, 2)]
        run_both(c, q_descale=ds[0], k_descale=ds[1], v_descale=ds[2])
        run_both(c, out_dtype=torch.float16)

    def test_tensor_descriptors(monkeypatch):
        # The Hopper path (K / V tiles by TMA descriptors), forced on under the interpreter.
        monkeypatch.setenv("FA_COMPILE_FP8_TMA", "1")
        run_both(make_case(d=32, dv=64, hq=4, hkv=2, nq=37, nk=45, causal=True, diag_offset=8))
        run_both(make_case(d=32, nq=30, nk=41, bias_shape=(2, 1, 1, 41), kv_lens=[41, 17], window_left=9))

    @pytest.mark.parametrize("kw,qkw", [
        (dict(b=2, hq=4, hkv=2, d=32, dv=64, nq=37, nk=45, layout="bshd"), dict()),
        (dict(b=3, d=64, nq=20, nk=50, kv_lens=[50, 0, 21]), dict()),
        (dict(d=32, nq=33, nk=40, dtype=torch.bfloat16), dict(smooth_k=False)),
        (dict(d=32, hq=4, hkv=2, nq=33, nk=40), dict(smooth_q=True)),
        (dict(d=32, hq=4, hkv=2, nq=33, nk=40, kv_lens=[40, 20]), dict(hadamard=True)),
        (dict(d=32, hq=4, hkv=2, nq=33, nk=40, kv_lens=[40, 20]), dict(qk_int8=True)),
    ], ids=["gqa_bshd", "kv_lens", "bf16_no_smoothing", "smooth_q", "hadamard", "int8_qk"])
    def test_fused_quantization_matches_torch(kw, qkw):
        from fa_compile.kernels.fp8 import quantize
        from fa_compile.kernels.fp8.quantize_triton import quantize_triton

        c = make_case(**kw)
        c.k = c.k + 2.0
        if c.kv_lens is not None:
            last = int(c.kv_lens[-1])
            c.k[-1, :, last:] = float("nan")  # past kv_lens: ignored
        got = quantize_triton(c.q, c.k, c.v, block_m=16, block_n=16, kv_lens=c.kv_lens, **qkw)
        if got.k_mean is not None:
            want_mean = quantize(c.q, c.k, c.v, block_m=16, block_n=16, kv_lens=c.kv_lens, **qkw).k_mean
            # fp32 sums in another order: rounding of d (rotated: d * d) terms of size max |k| at most
            d = c.k.shape[-1]
            bound = (d * d if qkw.get("hadamard") else d) * 2.0 ** -24 * float(c.k[c.k.isfinite()].abs().max())
            torch.testing.assert_close(got.k_mean, want_mean, atol=bound, rtol=1e-6)
        # given the same K mean (fp32 sums in another order), every value and scale is the torch path's
        want = quantize(c.q, c.k, c.v, block_m=16, block_n=16, kv_lens=c.kv_lens, k_mean=got.k_mean, **qkw)
        # Q smoothing's block mean and the rotation's sums run in another fp32 order too
        approx = ("q8", "q_scale") if qkw.get("smooth_q") else ("q8", "q_scale", "k8", "k_scale") if \
            qkw.get("hadamard") else ()
        exact = [x for x in ("k8", "v8t", "k_scale", "v_scale", "q8", "q_scale") if x not in approx]
        for name in exact:
            a, b = getattr(got, name), getattr(want, name)
            if a.dtype == FP8:
                a, b = a.view(torch.uint8), b.view(torch.uint8)
            assert a.dtype == b.dtype, name
            assert torch.equal(a, b), name
        for name in ("q_kmean", "q_mean", "qm_k"):
            a, b = getattr(got, name), getattr(want, name)
            assert (a is None) == (b is None), name
            if a is not None:
                torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
        for v8, scale in zip(approx[::2], approx[1::2]):  # a hair off may cross an e4m3 rounding boundary
            diff = getattr(got, v8).float() != getattr(want, v8).float()
            assert diff.float().mean() < 0.01, v8
            torch.testing.assert_close(getattr(got, scale), getattr(want, scale), atol=0, rtol=1e-6)
        out, lse = fp8_forward(c.q, c.k, c.v, c.scale, kv_lens=c.kv_lens, quantized=got, **qkw)
        r_out, r_lse = fp8_reference(c.q, c.k, c.v, c.scale, kv_lens=c.kv_lens, quantized=got, **qkw)
        torch.testing.assert_close(out, r_out, atol=TOL[out.dtype], rtol=TOL[out.dtype])
        torch.testing.assert_close(lse, r_lse, atol=1e-5, rtol=1e-6)

    def test_compiled_site_runs_the_fp8_kernel():
        # The front door end to end: a hand-written causal GQA attention compiled with fp8=True under
        # no_grad gets fa3.attention_fp8, whose run is the kernel's own result on the same inputs.
        import math

        import fa_compile

        def attn(q, k, v):
            k, v = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
            s = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
            s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
            return torch.softmax(s.float(), dim=-1).to(q.dtype) @ v

        c = make_case(d=32, hq=4, hkv=2, nq=40, nk=40)
        with torch.no_grad():
            torch._dynamo.reset()
            rep = fa_compile.explain(attn, c.q, c.k, c.v, fp8=True)
            assert [r.fp8 for r in rep.rewritten] == ["used"], str(rep)
            torch._dynamo.reset()
            got = torch.compile(attn, backend=fa_compile.backend(inner="aot_eager", fp8=True), fullgraph=True)(
                c.q, c.k, c.v)
            want, _ = fp8_forward(c.q, c.k, c.v, 32 ** -0.5, causal=True)
            assert torch.equal(got, want)
            exact = attn(c.q.float(), c.k.float(), c.v.float())
            assert float((got.float() - exact).norm() / exact.norm()) < 0.1  # FP8's error, not a wrong result
