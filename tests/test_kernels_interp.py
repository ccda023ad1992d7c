"""The Triton attention kernels under the Triton interpreter (CPU), against the reference op.

The interpreter must be switched on before any Triton kernel is defined, and pytest runs other test
modules (which may import triton or compile with Inductor) in the same process. So, unless this
process already has TRITON_INTERPRET=1, this module runs itself in a fresh subprocess with it set
(one test, which fails with the child's output); in the child the kernel tests run one by one.
Shapes are tiny and odd on purpose: several 16-wide blocks, partial last blocks, padded head dims.
fp16 / fp32 only: the interpreter's bf16 dot is unreliable in triton 3.9.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from fa_compile.kernels import triton_family as tf

IN_CHILD = os.environ.get("TRITON_INTERPRET") == "1"
needs_triton = pytest.mark.skipif(not tf.triton_available(), reason="triton not installed")


class FakeArgs:
    def __init__(self, q, k, v, **kw):
        self.q, self.k, self.v = q, k, v
        self.bias = kw.get("bias")
        for name in ("scale", "causal", "diag_offset", "window_left", "window_right", "kv_lens", "softcap",
                     "dropout_p", "dropout_seed", "needs_backward", "bias_requires_grad"):
            setattr(self, name, kw.get(name))


# Reason checks flip TRITON_INTERPRET, and FakeTensorMode may import triton.language while it is off,
# which would leave the interpreter broken for the kernel tests: they run in the parent only.
@pytest.mark.skipif(IN_CHILD, reason="runs in the parent process")
def test_reasons_on_fake_tensors(monkeypatch):
    from torch._subclasses.fake_tensor import FakeTensorMode

    monkeypatch.setattr(tf, "triton_available", lambda: True)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with FakeTensorMode():
        q = torch.empty(2, 4, 8, 64, dtype=torch.float16)
        k = torch.empty(2, 2, 8, 64, dtype=torch.float16)
        r = tf.TRITON.not_supported_reasons(FakeArgs(q, k, k))
        assert r == ["CPU tensors need the Triton interpreter (TRITON_INTERPRET=1)"]
        r64 = tf.TRITON.not_supported_reasons(FakeArgs(q.double(), k.double(), k.double()))
        assert any("float64" in x for x in r64)
        big = torch.empty(2, 4, 8, 320, dtype=torch.float16)
        assert any("head dims" in x for x in tf.TRITON.not_supported_reasons(FakeArgs(big, big, big)))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    q = torch.empty(1, 1, 4, 32, dtype=torch.float32)
    prev = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        assert any("TF32" in x for x in tf.TRITON.not_supported_reasons(FakeArgs(q, q, q)))
        torch.set_float32_matmul_precision("high")
        assert tf.TRITON.not_supported_reasons(FakeArgs(q, q, q)) == []
        # the interpreter's bf16 dot returns garbage: dispatch must not pick the family for bf16 CPU tensors
        qb = q.bfloat16()
        assert tf.TRITON.not_supported_reasons(FakeArgs(qb, qb, qb)) == [
            "bfloat16 under the Triton interpreter (its bf16 dot is unreliable)"]
    finally:
        torch.set_float32_matmul_precision(prev)


@pytest.mark.skipif(IN_CHILD, reason="runs in the parent process")
def test_absorbing_float_bias_refused(monkeypatch):
    # A float bias whose dtype can hold values <= -1e29 may absorb whole rows, which the kernels read as
    # empty (fa_compile/kernels/reference.py absorbing_bias_refusal): fp32 / bf16 / fp64 biases are refused, fp16
    # (finfo.min -65504 absorbs nothing in fp32) and bool masks are taken.
    from torch._subclasses.fake_tensor import FakeTensorMode

    monkeypatch.setattr(tf, "triton_available", lambda: True)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with FakeTensorMode():
        q = torch.empty(2, 4, 8, 32, dtype=torch.float16)
        for dt in (torch.float32, torch.bfloat16):
            r = tf.TRITON.not_supported_reasons(FakeArgs(q, q, q, bias=torch.empty(2, 1, 1, 8, dtype=dt)))
            assert any("absorbs" in x and str(dt).replace("torch.", "") in x for x in r), r
        for dt in (torch.float16, torch.bool):
            assert tf.TRITON.not_supported_reasons(FakeArgs(q, q, q, bias=torch.empty(2, 1, 1, 8, dtype=dt))) == []


def test_reasons_without_triton(monkeypatch):
    monkeypatch.setattr(tf, "triton_available", lambda: False)
    q = torch.empty(1, 1, 4, 32, dtype=torch.float16)
    assert tf.TRITON.not_supported_reasons(FakeArgs(q, q, q)) == ["triton not installed"]


def test_module_imports_without_triton():
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "from fa_compile.kernels import triton_family\n"
        "assert triton_family.TRITON.name == 'triton'\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr


if not IN_CHILD:

    @needs_triton
    def test_kernels_under_interpreter():
        from fa_compile.kernels.triton_testing import run_under_interpreter

        run_under_interpreter(__file__)

else:
    from fa_compile.kernels import reference as ref
    from fa_compile.kernels.triton_testing import check_case, make_case, poisoned_backward, poisoned_forward

    import triton
    import triton.language as tl

    from fa_compile.kernels.triton_common import dropout_keep, dropout_row_hash, grouped_program_ids

    F16 = torch.float16

    @triton.jit
    def keep_kernel(OUT, SEED, bh, Nq, col0, thr, BLOCK: tl.constexpr):
        """The dropout keep bits of rows [0, BLOCK) and columns [col0, col0 + BLOCK), as the kernels compute them."""
        rows = tl.arange(0, BLOCK)
        cols = col0 + tl.arange(0, BLOCK)
        row_part = dropout_row_hash(tl.load(SEED).to(tl.uint32), bh, Nq, rows)
        keep = dropout_keep(row_part[:, None], cols[None, :], thr)
        tl.store(OUT + rows[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :], keep.to(tl.int8))

    @triton.jit
    def grouped_ids_kernel(OUT, n_inner, n_groups, REVERSE: tl.constexpr):
        inner, outer = grouped_program_ids(n_inner, n_groups, REVERSE)
        tl.store(OUT + 2 * tl.program_id(0), inner)
        tl.store(OUT + 2 * tl.program_id(0) + 1, outer)

    pytestmark = pytest.mark.usefixtures("tf32_matmul")

    @pytest.mark.parametrize(
        "d,nq,nk,layout",
        [(64, 48, 48, "bhsd"), (40, 37, 50, "bshd"), (80, 21, 33, "bshd"), (96, 33, 19, "bhsd")],
    )
    def test_dense_head_dims_and_lengths(d, nq, nk, layout):
        torch.manual_seed(0)
        check_case(make_case(d=d, nq=nq, nk=nk, layout=layout, dtype=F16))

    def test_value_head_dim_strided_last_dim_int64_kv_lens():
        # Dv != D; q with a non-unit last stride (copied by the launcher); kv_lens in int64; window 0.
        case = make_case(nq=26, nk=35, d=48, dv=24, window_left=0, window_right=6, kv_lens=[35, 9])
        case.kv_lens = case.kv_lens.to(torch.int64)
        wide = torch.randn(2, 2, 26, 96, dtype=F16)
        wide[..., ::2] = case.q
        case.q = wide[..., ::2]
        assert case.q.stride(-1) == 2
        check_case(case)

    @pytest.mark.parametrize("align", ["top_left", "bottom_right", "negative"])
    def test_causal(align):
        nq, nk = (37, 53) if align != "negative" else (40, 40)
        off = {"top_left": 0, "bottom_right": nk - nq, "negative": -7}[align]
        case = make_case(hq=4, hkv=2, nq=nq, nk=nk, d=40, layout="bshd", causal=True, diag_offset=off)
        res = check_case(case)
        if align == "negative":  # rows i < 7 have no admissible key
            assert torch.isneginf(res["lse"][:, :, :7]).all() and (res["out"][:, :, :7] == 0).all()
            assert torch.isfinite(res["dq"]).all()

    @pytest.mark.parametrize("wl,wr,causal", [(5, 3, False), (9, -1, True), (-1, 4, False)])
    def test_sliding_window(wl, wr, causal):
        check_case(make_case(nq=45, nk=45, d=32, window_left=wl, window_right=wr, causal=causal, diag_offset=2))

    @pytest.mark.parametrize("kw", [
        dict(d=80, nq=21, nk=33, layout="bshd", hq=4, hkv=2, causal=True, diag_offset=12),
        dict(d=32, nq=30, nk=41, bias_shape=(30, 41), window_left=5, dropout_p=0.3, softcap=2.0, kv_lens=[30, 20]),
    ], ids=["gqa_causal", "all_features"])
    def test_tma_path(kw, monkeypatch):
        # The Hopper path (tensor descriptors, forward and backward), forced on under the interpreter.
        monkeypatch.setenv("FA_COMPILE_TRITON_TMA", "1")
        calls = []
        orig = tf._forward_tma
        monkeypatch.setattr(tf, "_forward_tma", lambda *a: (calls.append(1), orig(*a)))
        check_case(make_case(**kw))
        assert calls == [1]

    @pytest.mark.parametrize("kw", [
        dict(d=32, nq=70, nk=83),  # several unmasked key blocks, a partial last one
        dict(d=32, nq=40, nk=40, hq=4, hkv=2, causal=True, layout="bshd"),
        dict(d=32, nq=35, nk=66, b=3, bias_shape=(1, 2, 35, 66), dropout_p=0.25, softcap=2.0),
        dict(d=32, nq=35, nk=66, b=2, bias_shape=(2, 1, 35, 66), causal=True, diag_offset=31),  # bias in one FMA
        dict(d=32, nq=30, nk=47, bias_shape=(2, 1, 1, 47), bias_bool=True, window_left=20, window_right=3),
    ], ids=["dense", "causal_gqa", "bias_dropout_softcap", "bias_fma_causal", "keymask_window"])
    def test_tma_q_in_registers(kw, monkeypatch):
        # The Hopper forward with Q as a register operand (qreg, the H200 default), forced on under the
        # interpreter; the float-bias cases take the bias-in-one-FMA softmax step.
        monkeypatch.setenv("FA_COMPILE_TRITON_TMA", "1")
        monkeypatch.setitem(tf.CONFIG_OVERRIDE, ("fwd", 32), tf.BlockConfig(16, 16, 4, 1, qreg=True))
        check_case(make_case(**kw))
        assert tf.LAST_COMPILED["attn_fwd_kernel"][0].qreg

    def test_kv_lens_with_empty_batch():
        res = check_case(make_case(b=3, nq=20, nk=37, d=32, kv_lens=[37, 0, 18]))
        assert torch.isneginf(res["lse"][1]).all() and (res["out"][1] == 0).all()
        assert (res["dk"][1] == 0).all() and (res["dv"][1] == 0).all()

    @pytest.mark.parametrize("tma", ["0", "1"], ids=["pointers", "descriptors"])
    @pytest.mark.parametrize("mode", ["1", "0"], ids=["fused_dq", "dq_kernel"])
    def test_nothing_past_kv_lens_is_read(mode, tma, monkeypatch):
        # Non-finite keys and values past a sequence's length (a cache's unused slots) change nothing: the key
        # tile that straddles the limit zeroes them (dK/dV kernel) or never loads them (forward, dQ kernel); with
        # tensor descriptors (the Hopper path, which loads whole tiles) the forward and dQ kernel zero them too.
        monkeypatch.setenv("FA_COMPILE_FUSED_DQ", mode)
        monkeypatch.setenv("FA_COMPILE_TRITON_TMA", tma)
        case = make_case(b=2, hq=4, hkv=2, nq=20, nk=45, d=32, kv_lens=[45, 21])
        clean = check_case(case)
        case.k, case.v = case.k.clone(), case.v.clone()
        case.k[1, :, 21:] = float("nan")
        case.v[1, :, 21:] = float("inf")
        out, lse = poisoned_forward(case)
        grads = poisoned_backward(case, clean["dout"], out, lse)
        for name, got in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, *grads[:3])):
            assert torch.equal(got, clean[name]), name
        assert (grads[1][1, :, 21:] == 0).all() and (grads[2][1, :, 21:] == 0).all()

    @pytest.mark.parametrize(
        "shape", [(2, 2, 30, 41), (1, 2, 1, 41), (30, 41), (2, 1, 1, 41)], ids=["full", "heads_keys", "2d", "batch_keys"]
    )
    def test_float_bias_with_grad(shape):
        check_case(make_case(nq=30, nk=41, d=32, bias_shape=shape, bias_grad=True, causal=len(shape) == 2))

    def test_bool_mask_broadcast_with_empty_rows():
        case = make_case(nq=30, nk=41, d=32, bias_shape=(2, 1, 30, 41), bias_bool=True)
        case.bias[0, 0, 3] = False  # an empty row
        res = check_case(case)
        assert torch.isneginf(res["lse"][0, :, 3]).all() and (res["out"][0, :, 3] == 0).all()

    def test_bool_key_padding_mask_row_broadcast():
        # [B, 1, 1, Nk]: constant along query rows, loaded once per key; batch 1 has no key at all.
        case = make_case(b=2, hq=2, nq=21, nk=37, d=32, bias_shape=(2, 1, 1, 37), bias_bool=True, causal=True, diag_offset=16)
        case.bias[1] = False
        res = check_case(case)
        assert torch.isneginf(res["lse"][1]).all() and (res["out"][1] == 0).all()

    def test_softcap_causal_gqa():
        check_case(make_case(hq=4, hkv=1, nq=33, nk=33, d=64, softcap=1.5, causal=True, scale=0.5))

    def test_fp32_tf32_path():
        check_case(make_case(nq=25, nk=31, d=48, dtype=torch.float32, causal=True, diag_offset=6))

    @pytest.mark.parametrize("p", [0.4, 0.8])  # 0.8: a keep threshold past 2**31 (an int64 kernel argument)
    def test_dropout_mask_bit_exact(p):
        # v = identity, so out = dropped, rescaled P: its zero pattern is the keep mask itself.
        case = make_case(b=2, hq=2, nq=24, nk=32, d=32, dtype=torch.float32, dropout_p=p)
        case.v = torch.eye(32).expand(2, 2, 32, 32).contiguous()
        out, _ = poisoned_forward(case)
        from fa_compile.kernels.dropout_hash import dropout_keep_mask

        keep = dropout_keep_mask(case.dropout_seed, 2, 2, 24, 32, p, device="cpu")
        assert 0 < int(keep.sum()) < keep.numel()
        assert torch.equal(out != 0, keep)

    def test_dropout_hash_past_65536_keys():
        # dropout_keep splits lowbias32's first xor-shift between the row and the column; a column's high half only
        # reaches it past 2**16 keys: the kernels' bits against dropout_hash's formula on columns around there.
        from fa_compile.kernels.dropout_hash import hash32, keep_threshold

        seed, bh, nq, p = 987654321, 3, 16, 0.5
        for col0 in (0, 65536 - 8, 3 * 65536 + 5):
            out = torch.empty(16, 16, dtype=torch.int8)
            keep_kernel[(1,)](out, torch.tensor([seed]), bh, nq, col0, keep_threshold(p), BLOCK=16)
            row = torch.arange(bh * nq, bh * nq + 16, dtype=torch.int64).view(16, 1)
            col = torch.arange(col0, col0 + 16, dtype=torch.int64).view(1, 16)
            want = hash32(hash32(seed ^ hash32(row)) ^ col) >= keep_threshold(p)
            assert torch.equal(out.bool(), want), col0

    @pytest.mark.parametrize("n_inner,n_outer,n_groups", [(5, 7, 3), (4, 6, 6), (3, 5, 1), (1, 4, 2), (6, 9, 4)])
    @pytest.mark.parametrize("reverse", [False, True])
    def test_grouped_program_ids(n_inner, n_outer, n_groups, reverse):
        # Launch order: balanced contiguous groups of outer ids (sizes differ by at most one), the inner id
        # slowest inside a group; every (inner, outer) exactly once. n_groups = n_outer is program_ids' order.
        out = torch.full((n_inner * n_outer, 2), -1, dtype=torch.int32)
        grouped_ids_kernel[(n_inner * n_outer,)](out, n_inner, n_groups, REVERSE=reverse)
        sizes = [n_outer // n_groups + (1 if g < n_outer % n_groups else 0) for g in range(n_groups)]
        want, first = [], 0
        for size in sizes:
            for r in range(size * n_inner):
                inner = r // size
                want.append((n_inner - 1 - inner if reverse else inner, first + r % size))
            first += size
        assert out.tolist() == [list(w) for w in want]
        assert len(set(want)) == n_inner * n_outer

    def test_dropout_forward_backward_with_bias_window():
        check_case(make_case(hq=4, hkv=2, nq=29, nk=35, d=32, dropout_p=0.3, bias_shape=(29, 35), bias_grad=True,
                             window_left=12, softcap=2.0))

    def test_backward_is_deterministic():
        case = make_case(hq=4, hkv=2, nq=40, nk=40, d=32, causal=True, bias_shape=(1, 4, 40, 40), bias_grad=True)
        out, lse = poisoned_forward(case)
        dout = torch.randn_like(out)
        prev = torch.are_deterministic_algorithms_enabled()
        torch.use_deterministic_algorithms(True)
        try:
            a = poisoned_backward(case, dout, out, lse)
            b = poisoned_backward(case, dout, out, lse)
        finally:
            torch.use_deterministic_algorithms(prev)
        for x, y in zip(a, b):
            assert torch.equal(x, y)

    @pytest.mark.parametrize("mode", ["1", "0"], ids=["fused_dq", "dq_kernel"])
    def test_fused_dq_switch(mode, monkeypatch):
        # FA_COMPILE_FUSED_DQ: dQ by the dK/dV kernel's atomics, or the dQ kernel; the same gradients either way
        monkeypatch.setenv("FA_COMPILE_FUSED_DQ", mode)
        tf.LAST_COMPILED.pop("attn_bwd_dq_kernel", None)
        res = check_case(make_case(hq=4, hkv=2, nq=37, nk=45, d=32, dropout_p=0.2, causal=True, diag_offset=8,
                                   kv_lens=[45, 20], bias_shape=(2, 1, 1, 45), bias_bool=True, softcap=3.0))
        assert ("attn_bwd_dq_kernel" in tf.LAST_COMPILED) == (mode == "0")
        assert torch.isfinite(res["dq"]).all()

    def test_through_the_op_with_autograd():
        from fa_compile import dispatch, ops  # noqa: F401  (ops registers torch.ops.fa3)

        dispatch.register(tf.TRITON)
        case = make_case(hq=2, nq=19, nk=23, d=32, layout="bshd", causal=True, diag_offset=4)
        q, k, v = (t.detach().requires_grad_() for t in (case.q, case.k, case.v))
        out, lse = torch.ops.fa3.attention(q, k, v, case.scale, True, 4, force_kernel="triton")
        r_out, r_lse = ref.attention_reference(q.detach(), k.detach(), v.detach(), scale=case.scale, causal=True, diag_offset=4)
        torch.testing.assert_close(out, r_out, atol=2e-3, rtol=2e-3)
        out.float().square().sum().backward()
        qr, kr, vr = (t.detach().float().requires_grad_() for t in (q, k, v))
        o2, _ = ref.attention_reference(qr, kr, vr, scale=case.scale, causal=True, diag_offset=4)
        o2.to(torch.float16).float().square().sum().backward()
        for got, want in ((q.grad, qr.grad), (k.grad, kr.grad), (v.grad, vr.grad)):
            torch.testing.assert_close(got.float(), want, atol=1e-2, rtol=1e-2)

    def test_absorbing_float_mask_rows_equal_eager():
        # An HF-style extended mask built from a float attention_mask (data the pass cannot prove 0 / 1)
        # reaches the op as a float bias. Sequence 2 is all padding: eager weighs its rows uniformly over
        # the finfo.min fills (the mean of V), where the Triton kernel read them as empty and the rewrite's
        # fix-up then wrote NaN. Dispatch now refuses the kernel for such a bias; every element and
        # gradient must equal eager's.
        import math

        import fa_compile

        b, h, n, d = 3, 2, 24, 16

        def f(q, k, v, am):
            mask = (1.0 - am[:, None, None, :]) * torch.finfo(torch.float32).min
            s = (q @ k.transpose(-1, -2)) / math.sqrt(d) + mask
            return torch.softmax(s, -1) @ v

        torch.manual_seed(0)
        q, k, v = (torch.randn(b, h, n, d, requires_grad=True) for _ in range(3))
        am = torch.ones(b, n)
        am[1, n // 3:] = 0
        am[2] = 0
        want = f(q, k, v, am)
        g = torch.randn_like(want)
        want_grads = torch.autograd.grad(want, (q, k, v), g)
        torch._dynamo.reset()
        got = torch.compile(f, backend="fa3", fullgraph=True)(q, k, v, am)
        got_grads = torch.autograd.grad(got, (q, k, v), g)
        assert not got.isnan().any()
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        for a, e in zip(got_grads, want_grads):
            torch.testing.assert_close(a, e, atol=1e-5, rtol=1e-5)
        rows = [r for r in fa_compile.explain(f, q, k, v, am).rows]
        assert rows and all("triton" not in (r.kernel_fwd or "") for r in rows)

    @pytest.mark.parametrize("family", ["t5", "bloom"])
    def test_float_bias_models_padded_sequence_equal_eager(family):
        # Real model families whose padding reaches the op inside a float bias (T5's position bias, Bloom's
        # ALiBi): with the Triton kernels eligible on CPU, a fully padded sequence must still equal eager
        # at every element, outputs and gradients (the kernels read its rows as empty; they are refused).
        import warnings

        import transformers

        import fa_compile

        warnings.filterwarnings("ignore")
        torch.manual_seed(0)
        if family == "t5":
            cfg = transformers.T5Config(d_model=32, d_kv=16, num_heads=2, num_layers=2, d_ff=64, vocab_size=50,
                                        dropout_rate=0.0)
            cls = transformers.T5EncoderModel
        else:
            cfg = transformers.BloomConfig(hidden_size=32, n_head=2, n_layer=2, vocab_size=50)
            cls = transformers.BloomModel
        cfg._attn_implementation = "eager"
        model = cls(cfg)
        ids = torch.randint(1, 50, (3, 12))
        am = torch.ones(3, 12, dtype=torch.long)
        am[1, 5:] = 0
        am[2] = 0
        want = model(input_ids=ids, attention_mask=am)[0]
        want.square().mean().backward()
        want_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        torch._dynamo.reset()
        got = torch.compile(model, backend="fa3")(input_ids=ids, attention_mask=am)[0]
        got.square().mean().backward()
        assert not got.isnan().any()
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        for n, p in model.named_parameters():
            if n in want_grads:
                torch.testing.assert_close(p.grad, want_grads[n], atol=1e-5, rtol=1e-4, msg=n)
