"""FP8 attention's front door (fa_compile/fp8.py): the opt-in, which sites get FP8 and why not, the
`fa3.attention_fp8` op's checks, its paths without a kernel, and `fa_compile.attention`'s fp8
arguments. CPU; the kernel itself is tested in test_fp8_interp.py and test_fp8_gpu.py."""
from __future__ import annotations

import math

import expecttest
import pytest
import torch
import torch.nn.functional as F

import fa_compile
from eager_diff import rand
from fa_compile import fp8 as fp8_door
from fa_compile.kernels import reference as ref

B, H, HKV, N, D = 2, 4, 2, 24, 16


def eager_attention(q, k, v):
    """Hand-written causal GQA attention, as models spell it."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    return F.softmax(s.float(), dim=-1).to(q.dtype) @ v


def qkv(dtype=torch.bfloat16, requires_grad=False):
    return (rand(B, H, N, D, dtype=dtype, seed=1, requires_grad=requires_grad),
            rand(B, HKV, N, D, dtype=dtype, seed=2, requires_grad=requires_grad),
            rand(B, HKV, N, D, dtype=dtype, seed=3, requires_grad=requires_grad))


def _explained(fn, *args, **kw):
    torch._dynamo.reset()
    return fa_compile.explain(fn, *args, **kw)


def test_fp8_is_off_by_default(monkeypatch):
    monkeypatch.delenv("FA_COMPILE_FP8", raising=False)
    rep = _explained(eager_attention, *qkv())
    assert [r.fp8 for r in rep.rewritten] == [""]
    assert "fp8 at site" not in str(rep)


def test_without_a_kernel_the_site_keeps_the_exact_op_and_says_why(monkeypatch):
    monkeypatch.setattr(fp8_door, "kernel_reasons", lambda *a, **k: ["no CUDA device with capability >= 9.0"])
    q, k, v = qkv()
    with torch.no_grad():
        rep = _explained(eager_attention, q, k, v, fp8=True)
    assert rep.rewritten[0].fp8 == "not used: no CUDA device with capability >= 9.0"
    assert rep.rows[0].kernel_fwd != "fp8"
    assert "fp8 at site 0: not used: no CUDA device with capability >= 9.0" in str(rep)
    torch._dynamo.reset()
    with torch.no_grad():
        got = torch.compile(eager_attention, backend=fa_compile.backend(inner="eager", fp8=True))(q, k, v)
    torch.testing.assert_close(got, eager_attention(q, k, v), atol=1e-2, rtol=1e-2)


def _kernel_takes_everything(monkeypatch, calls: list):
    """The FP8 kernel stood in by exact attention over the same inputs, so the front door can be checked
    without one (the kernel's numerics are its own tests')."""
    import types
    import sys

    def fp8_forward(q, k, v, scale, causal, diag_offset, wl, wr, bias, kv_lens, *, q_descale=None, k_descale=None,
                    v_descale=None, out_dtype=None):
        calls.append((tuple(q.shape), q.dtype, causal))
        f = lambda t, d: t.float() if d is None else t.float() * d[:, :, None, None]
        o, lse = ref.attention_reference(f(q, q_descale), f(k, k_descale), f(v, v_descale), scale=scale, causal=causal,
                                         diag_offset=diag_offset, window_left=wl, window_right=wr, bias=bias,
                                         kv_lens=kv_lens)
        return o.to(out_dtype or q.dtype), lse

    stub = types.SimpleNamespace(fp8_forward=fp8_forward, fp8_reasons=lambda *a, **k: [])
    monkeypatch.setitem(sys.modules, "fa_compile.kernels.fp8", stub)
    import fa_compile.kernels as kernels_pkg

    monkeypatch.setattr(kernels_pkg, "fp8", stub, raising=False)


def test_inference_site_gets_the_fp8_op(monkeypatch):
    calls: list = []
    _kernel_takes_everything(monkeypatch, calls)
    q, k, v = qkv()
    with torch.no_grad():
        rep = _explained(eager_attention, q, k, v, fp8=True)
    assert rep.rewritten[0].fp8 == "used" and rep.rows[0].kernel_fwd == "fp8"
    assert "fp8 at site 0: used" in str(rep)
    torch._dynamo.reset()
    with torch.no_grad():
        got = torch.compile(eager_attention, backend=fa_compile.backend(inner="aot_eager", fp8=True),
                            fullgraph=True)(q, k, v)
    assert calls and calls[-1] == ((B, H, N, D), torch.bfloat16, True)
    torch.testing.assert_close(got, eager_attention(q, k, v), atol=1e-2, rtol=1e-2)


def test_env_flag_asks_for_fp8(monkeypatch):
    calls: list = []
    _kernel_takes_everything(monkeypatch, calls)
    monkeypatch.setenv("FA_COMPILE_FP8", "1")
    with torch.no_grad():
        rep = _explained(eager_attention, *qkv())
    assert rep.rewritten[0].fp8 == "used"
    with torch.no_grad():  # fp8=False in the call wins over the environment
        rep = _explained(eager_attention, *qkv(), fp8=False)
    assert rep.rewritten[0].fp8 == ""


def test_training_site_keeps_bf16_forward_and_exact_gradients(monkeypatch):
    _kernel_takes_everything(monkeypatch, [])
    q, k, v = qkv(torch.float16, requires_grad=True)
    rep = _explained(eager_attention, q, k, v, fp8=True)
    assert rep.rewritten[0].fp8.startswith("not used: gradients are needed")
    torch._dynamo.reset()
    fn = torch.compile(eager_attention, backend=fa_compile.backend(inner="aot_eager", fp8=True))
    got = fn(q, k, v)
    want = eager_attention(*(t.detach().float().requires_grad_() for t in (q, k, v)))
    torch.testing.assert_close(got.float(), want, atol=5e-3, rtol=5e-3)
    g = rand(*got.shape, dtype=got.dtype, seed=9)
    gq = torch.autograd.grad(got, (q, k, v), g)
    ref_in = [t.detach().float().requires_grad_() for t in (q, k, v)]
    wq = torch.autograd.grad(eager_attention(*ref_in), ref_in, g.float())
    for a, b in zip(gq, wq):
        torch.testing.assert_close(a.float(), b, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("what", ["softcap", "fp32", "forced"])
def test_features_outside_the_kernel_are_refused_with_a_reason(monkeypatch, what):
    _kernel_takes_everything(monkeypatch, [])
    q, k, v = qkv(torch.float32 if what == "fp32" else torch.bfloat16)

    def capped(q, k, v):
        s = (q @ k.repeat_interleave(2, 1).transpose(-1, -2)) * 0.25
        s = torch.tanh(s / 30.0) * 30.0
        return F.softmax(s, dim=-1) @ v.repeat_interleave(2, 1)

    fn = capped if what == "softcap" else eager_attention
    kw = dict(kernel="reference") if what == "forced" else {}
    with torch.no_grad():
        rep = _explained(fn, q, k, v, fp8=True, **kw)
    why = rep.rewritten[0].fp8
    assert why.startswith("not used: ")
    assert {"softcap": "softcap", "fp32": "dtype float32", "forced": "a kernel is forced ('reference')"}[what] in why


class TestPinnedFp8Graph(expecttest.TestCase):
    def test_pinned_fp8_site(self):
        from test_patterns_softmax import summary

        mp = pytest.MonkeyPatch()
        try:
            _kernel_takes_everything(mp, [])
            graphs = []

            def capture(gm, example_inputs):
                from fa_compile.compiler import run_pass

                run_pass(gm, fp8=True)
                graphs.append(gm)
                return gm.forward

            torch._dynamo.reset()
            with torch.no_grad():
                torch.compile(eager_attention, backend=capture)(*qkv())
        finally:
            mp.undo()
        self.assertExpectedInline(summary(graphs[0]), """\
attention_fp8.default(l_q_, l_k_, l_v_, 0.25, True, 0, -1, -1, None, None)
getitem(attention_fp8_default, 0)
contiguous(getitem)""")


# ------------------------------------------------------------------------------ float8 inputs, eagerly

def _quantized(dtype=torch.bfloat16):
    q, k, v = qkv(dtype)
    ds = [(t.float().abs().amax(dim=(2, 3)) / 448.0).clamp_min(1e-12) for t in (q, k, v)]
    q8, k8, v8 = ((t.float() / d[:, :, None, None]).to(torch.float8_e4m3fn) for t, d in zip((q, k, v), ds))
    return (q8, k8, v8), ds


@pytest.mark.parametrize("causal", [False, True])
def test_float8_inputs_without_a_kernel_give_the_dequantized_attention(monkeypatch, causal):
    monkeypatch.setattr(fp8_door, "kernel_reasons", lambda *a, **k: ["no FP8 kernel here"])
    (q8, k8, v8), (dq, dk, dv) = _quantized()
    got, lse = fa_compile.attention(q8, k8, v8, causal=causal, q_descale=dq, k_descale=dk, v_descale=dv,
                                    out_dtype=torch.float16, return_lse=True)
    assert got.dtype == torch.float16
    deq = [t.float() * d[:, :, None, None] for t, d in zip((q8, k8, v8), (dq, dk, dv))]
    want, want_lse = ref.attention_reference(*deq, scale=D ** -0.5, causal=causal)
    torch.testing.assert_close(got, want.half(), atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(lse, want_lse, atol=1e-5, rtol=1e-5)


def test_float8_inputs_compile_with_fullgraph(monkeypatch):
    monkeypatch.setattr(fp8_door, "kernel_reasons", lambda *a, **k: ["no FP8 kernel here"])
    (q8, k8, v8), (dq, dk, dv) = _quantized()
    fn = lambda q, k, v: fa_compile.attention(q, k, v, causal=True, q_descale=dq, k_descale=dk, v_descale=dv)
    torch._dynamo.reset()
    got = torch.compile(fn, backend="aot_eager", fullgraph=True)(q8, k8, v8)
    torch.testing.assert_close(got, fn(q8, k8, v8), atol=0, rtol=0)


@pytest.mark.parametrize("bad, match", [
    (dict(q_descale=torch.ones(B, H, 2)), r"q_descale: expected shape \[batch, heads\]"),
    (dict(k_descale=torch.ones(B, HKV, dtype=torch.float64)), "k_descale: dtype must be float32"),
    (dict(out_dtype=torch.int8), "out_dtype: must be one of"),
    (dict(softcap=30.0), "softcap: not supported with float8_e4m3fn inputs"),
    (dict(mixed=True), "q, k, v: either all float8_e4m3fn"),
])
def test_float8_argument_errors_name_the_argument(bad, match):
    (q8, k8, v8), _ = _quantized()
    if bad.pop("mixed", False):
        v8 = v8.to(torch.bfloat16)
    with pytest.raises(ValueError, match=match):
        fa_compile.attention(q8, k8, v8, **bad)


@pytest.mark.parametrize("bad, match", [
    (dict(q_descale=0.5), r"q_descale: expected a float32 Tensor \[batch, heads\] or None, got float"),
    (dict(out_dtype="bfloat16"), "out_dtype: expected a torch.dtype or None, got str"),
])
def test_float8_argument_types_name_the_argument(bad, match):
    # these reached the op's schema check first: a RuntimeError that named no argument of fa_compile.attention
    (q8, k8, v8), _ = _quantized()
    with pytest.raises(TypeError, match=match):
        fa_compile.attention(q8, k8, v8, **bad)


def test_other_float8_formats_say_which_one_is_taken():
    (q8, _, _), _ = _quantized()
    e5 = q8.float().to(torch.float8_e5m2)
    with pytest.raises(ValueError, match="q: dtype torch.float8_e5m2 is not .* or float8_e4m3fn"):
        fa_compile.attention(e5, e5, e5)


def test_descales_on_bf16_inputs_are_an_error():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="q_descale: applies to float8_e4m3fn inputs only"):
        fa_compile.attention(q, k, v, q_descale=torch.ones(B, H))


def test_float8_op_has_no_backward():
    (q8, k8, v8), _ = _quantized()
    q = q8.to(torch.bfloat16).requires_grad_()
    with pytest.raises(RuntimeError, match="q: fa3.attention_fp8 has no backward"):
        torch.ops.fa3.attention_fp8(q, q.detach().clone(), q.detach().clone(), 0.25)


def test_fp8_request_with_gradients_runs_the_exact_op():
    q, k, v = qkv(torch.float16, requires_grad=True)
    got = fa_compile.attention(q, k, v, causal=True, fp8=True)
    want = fa_compile.attention(q, k, v, causal=True)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    assert got.requires_grad
