"""The decode-step lowering (fa_compile/lowering/decomposed.py): a site with few queries and a short
cache becomes the op's reference math as graph ops, which Inductor fuses (on CPU and CUDA by default; on CPU at
any cache length): outputs equal to eager, every mask
argument carried, the sites it must not take keep their kernel. The same math as the lowering of the
reference choice at any size and in both directions (ReferenceMath): absorbed rows exact, arguments in
graph_pass's order, bf16 products."""
from __future__ import annotations

import contextlib

import pytest
import torch

import fa_compile
from fa_compile.lowering import capture_graphs, choice, decomposed, records

from conftest import TOL


@contextlib.contextmanager
def _lowered_on_cpu(monkeypatch, kernel: str, lowering):
    """`lowering` takes CPU sites whose choice is `kernel`, with Inductor's caches off."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    monkeypatch.setattr(decomposed, "DEVICES", ("cuda", "cpu"))
    monkeypatch.setitem(choice.LOWERINGS, ("cpu", kernel), lowering)
    with inductor_config.patch(fx_graph_cache=False), functorch_config.patch(enable_autograd_cache=False):
        yield


@pytest.fixture
def on_cpu(monkeypatch):
    with _lowered_on_cpu(monkeypatch, "decode_math", decomposed.DECODE_MATH):
        yield


def _decode_inputs(b=3, hq=4, hkv=2, nq=1, nk=37, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, nq, d, generator=g)
    k = torch.randn(b, hkv, nk, d, generator=g)
    v = torch.randn(b, hkv, nk, d, generator=g)
    return q, k, v


def _eager_decode(q, k, v, pad):
    # A decode step as models write it: GQA by repeat, an additive key-padding mask, fp32 softmax.
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    s = s + torch.where(pad, 0.0, float("-inf"))[:, None, None, :]
    return torch.softmax(s.float(), dim=-1).to(q.dtype) @ v


def test_decode_step_lowered_to_its_math_matches_eager(on_cpu):
    q, k, v = _decode_inputs()
    pad = torch.ones(3, 37, dtype=torch.bool)
    pad[0, :5] = False  # left padding
    pad[2, 30:] = False
    torch._dynamo.reset()
    n = len(records())
    with capture_graphs() as graphs:
        got = torch.compile(_eager_decode, backend="fa3")(q, k, v, pad)
    decisions = [r.decision for r in records()[n:]]
    assert [d.kernel for d in decisions] == ["decode_math"] and decisions[0].lowered, [str(d) for d in decisions]
    assert "fa3.attention" not in graphs[0] and "repeat_interleave" not in graphs[0], graphs[0]
    torch.testing.assert_close(got, _eager_decode(q, k, v, pad), **TOL[torch.float32])


def _masked_fill_decode(q, k, v, pad):
    # A decode step whose mask excludes keys by masked_fill: a key it excludes never reaches a row, NaN or not.
    s = (q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5).masked_fill(~pad[:, None, None, :], float("-inf"))
    return torch.softmax(s, dim=-1) @ v


@pytest.mark.parametrize("nk", [37, 3000])
def test_cpu_decode_sites_take_the_math_by_default_and_never_read_excluded_slots(nk):
    # No fixture: the default on CPU, at any cache length. Excluded slots hold NaN keys: the math must not let them
    # reach a row, as eager's masked_fill does not; aten's flash kernel would (NaN + -inf), which is why that path
    # copied the keys. (A non-finite value in an excluded slot is NaN in eager too: p = 0 times inf.)
    q, k, v = _decode_inputs(hkv=4, nk=nk)
    pad = torch.ones(3, nk, dtype=torch.bool)
    pad[0, 20:] = False
    pad[1, :4] = False
    pad[2, nk - 1:] = False
    k[0, :, 25], k[1, :, 2], k[2, :, nk - 1] = float("nan"), float("nan"), float("nan")
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    torch._dynamo.reset()
    n = len(records())
    with capture_graphs() as graphs, inductor_config.patch(fx_graph_cache=False), \
            functorch_config.patch(enable_autograd_cache=False):  # (decisions are recorded on real compiles)
        got = torch.compile(_masked_fill_decode, backend="fa3")(q, k, v, pad)
    decisions = [r.decision for r in records()[n:]]
    assert [d.kernel for d in decisions] == ["decode_math"] and decisions[0].lowered, [str(d) for d in decisions]
    assert "flash_attention_for_cpu" not in graphs[0], graphs[0]
    want = _masked_fill_decode(q, k, v, pad)
    assert torch.isfinite(want).all()
    torch.testing.assert_close(got, want, **TOL[torch.float32])


def _padded_encoder(q, k, v, pad):
    s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    return torch.softmax(s.masked_fill(~pad[:, None, None, :], float("-inf")), dim=-1) @ v


@pytest.mark.parametrize("train", [False, True])
def test_cpu_small_encoder_sites_take_the_math_at_inference_only(train):
    # No fixture: the CPU default. A padded encoder site of 64 x 64 scores (under SMALL_SCORES) takes the math at
    # inference; in training its forward and backward stay aten's kernel. At inference one sequence has no key at all
    # (NaN rows, as eager's; in training such rows' gradients follow the op's own rule, tested elsewhere).
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(3, 2, 64, 16, generator=g, requires_grad=train) for _ in range(3))
    pad = torch.ones(3, 64, dtype=torch.bool)
    pad[0, 41:] = False
    pad[2, 5 if train else 0:] = False
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    torch._dynamo.reset()
    n = len(records())
    with capture_graphs() as graphs, inductor_config.patch(fx_graph_cache=False), \
            functorch_config.patch(enable_autograd_cache=False):
        got = torch.compile(_padded_encoder, backend="fa3")(q, k, v, pad)
        if train:
            got.sum().backward()
    decisions = [(r.decision.direction, r.decision.kernel) for r in records()[n:]]
    if train:
        assert decisions == [("forward", "reference"), ("backward", "reference")], decisions
        assert "cpu_flash_forward" in graphs[0], graphs[0]
    else:
        assert decisions == [("forward", "decode_math")], decisions
        assert "cpu_flash" not in graphs[0] and "flash_attention_for_cpu" not in graphs[0], graphs[0]
    want = _padded_encoder(q, k, v, pad)
    assert got.isnan().any() != train  # inference: sequence 2's rows are NaN in both
    torch.testing.assert_close(got, want, **TOL[torch.float32], equal_nan=True)
    if train:
        grads = [t.grad for t in (q, k, v)]
        for t in (q, k, v):
            t.grad = None
        want.sum().backward()
        for a, t in zip(grads, (q, k, v)):
            torch.testing.assert_close(a, t.grad, **TOL[torch.float32])


@pytest.mark.parametrize("scale", [None, 1e6], ids=["scores_1e4", "scale_1e6"])
def test_a_decode_sized_training_forward_keeps_its_backwards_kernel(scale):
    # No fixture: the CPU default. Five queries in a training graph: the forward stays aten's kernel, whose backward
    # recomputes the scores in the same arithmetic against its lse. With the math's lse, scores near 1e4 put dV 1e-3
    # off (eager's pair: 2e-7), and a scale of 1e6 put it off by the size of dV itself.
    import torch.nn.functional as F

    def fn(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, scale=scale)

    g = torch.Generator().manual_seed(0)
    big = 100.0 if scale is None else 1.0
    q, k = torch.randn(2, 2, 5, 4, generator=g) * big, torch.randn(2, 2, 6, 4, generator=g) * big
    v, dout = torch.randn(2, 2, 6, 4, generator=g), torch.randn(2, 2, 5, 4, generator=g)

    def grads(f):
        args = [t.clone().requires_grad_() for t in (q, k, v)]
        out = f(*args)
        return (out, *torch.autograd.grad(out, args, dout))

    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    torch._dynamo.reset()
    n = len(records())
    with inductor_config.patch(fx_graph_cache=False), functorch_config.patch(enable_autograd_cache=False):
        got = grads(torch.compile(fn, backend="fa3"))
    decisions = [(r.decision.direction, r.decision.kernel) for r in records()[n:]]
    assert decisions == [("forward", "reference"), ("backward", "reference")], decisions
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, grads(fn)):
        torch.testing.assert_close(a, b, **TOL[torch.float32], msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("what", ["q_pos", "segments", "sinks", "kv_lens_causal"])
def test_op_structure_reaches_the_math(on_cpu, what):
    # The op called directly with each structure argument, compiled: lowered, equal to the eager op.
    q, k, v = _decode_inputs(nq=3, nk=20)
    kw: dict = {}
    if what == "q_pos":
        kw["q_pos"] = torch.tensor([[4, 5, 6], [-1, 0, 19], [7, 30, 2]])
    elif what == "segments":
        kw["q_seg"] = torch.tensor([[0, 1, 1], [2, 2, 2], [0, 0, 5]])
        kw["k_seg"] = torch.randint(0, 3, (3, 20), generator=torch.Generator().manual_seed(1))
    elif what == "sinks":
        kw["sinks"] = torch.randn(4)
    else:
        kw.update(causal=True, diag_offset=17, kv_lens=torch.tensor([20, 9, 0]))
    args = [kw.pop(n, None) for n in ("sinks", "q_pos", "q_seg", "k_seg")]
    causal, off, kv_lens = kw.get("causal", False), kw.get("diag_offset", 0), kw.get("kv_lens")

    def fn(q, k, v):
        out, lse = torch.ops.fa3.attention(q, k, v, 0.25, causal, off, -1, -1, None, kv_lens, 0.0, 0.0, None, None,
                                           *args)
        # (the lse read through an op: returned as it is, it would look like a training graph's saved lse, whose
        # forward keeps the kernel of its backward)
        return out, lse * 1.0

    want = fn(q, k, v)
    torch._dynamo.reset()
    n = len(records())
    got = torch.compile(fn, backend="fa3")(q, k, v)
    decisions = [r.decision for r in records()[n:]]
    assert decisions and all(d.kernel == "decode_math" and d.lowered for d in decisions), [str(d) for d in decisions]
    torch.testing.assert_close(got[0], want[0], **TOL[torch.float32])
    torch.testing.assert_close(got[1], want[1], **TOL[torch.float32])  # -inf on empty rows in both


def test_not_taken_for_long_caches_training_or_a_forced_kernel(on_cpu, monkeypatch):
    from fa_compile import dispatch

    with torch._subclasses.FakeTensorMode():
        q, k, v = torch.empty(2, 4, 1, 16), torch.empty(2, 4, 5000, 16), torch.empty(2, 4, 5000, 16)
        long = dispatch.AttentionArgs(q=q, k=k, v=v, scale=0.25)
        # CPU has no fused decode kernel to prefer past DECODE_MAX_KEYS: it takes long caches too
        assert decomposed.DECODE_MATH.reasons(long, "forward") == []
        with monkeypatch.context() as m:  # as CUDA does: the decode kernel's single pass wins there
            m.setattr(decomposed, "KEY_LIMITED_DEVICES", ("cuda", "cpu"))
            assert "above" in " ".join(decomposed.DECODE_MATH.reasons(long, "forward"))
        # on CPU also a short prefill whose scores per head are small (Nq x Nk <= 128 x 128), not a longer one
        q128, q129 = torch.empty(2, 4, 128, 16), torch.empty(2, 4, 129, 16)
        small = dispatch.AttentionArgs(q=q128, k=k[:, :, :128], v=v[:, :, :128], scale=0.25)
        assert decomposed.DECODE_MATH.reasons(small, "forward") == []
        larger = dispatch.AttentionArgs(q=q129, k=k[:, :, :128], v=v[:, :, :128], scale=0.25)
        assert "scores 129 x 128 above" in " ".join(decomposed.DECODE_MATH.reasons(larger, "forward"))
        # a training graph's forward (its lse saved for the backward) keeps aten's kernel at such sizes
        saved = dispatch.AttentionArgs(q=q128, k=k[:, :, :128], v=v[:, :, :128], scale=0.25, saved_for_backward=True)
        assert "training graph" in " ".join(decomposed.DECODE_MATH.reasons(saved, "forward"))
        # decode-sized too: the backward recomputes the scores in its own arithmetic against this lse
        saved_decode = dispatch.AttentionArgs(q=q, k=k[:, :, :64], v=v[:, :, :64], scale=0.25, saved_for_backward=True)
        assert "training graph" in " ".join(decomposed.DECODE_MATH.reasons(saved_decode, "forward"))
        short = dispatch.AttentionArgs(q=q, k=k[:, :, :64], v=v[:, :, :64], scale=0.25)
        assert decomposed.DECODE_MATH.reasons(short, "forward") == []
        train = dispatch.AttentionArgs(q=q, k=k[:, :, :64], v=v[:, :, :64], scale=0.25, needs_backward=True)
        assert "inference" in " ".join(decomposed.DECODE_MATH.reasons(train, "forward"))
        assert choice.decide(short, "reference", "forward", False).kernel == "reference"


@pytest.fixture
def reference_math_on_cpu(monkeypatch):
    # ReferenceMath is CUDA's lowering of the reference choice; here it takes CPU's in place of aten's CPU flash.
    # (The decode-step math, which CPU gives small sites first, is switched off: these sites are for ReferenceMath.)
    monkeypatch.setenv("FA_COMPILE_DECODE_MATH", "0")
    with _lowered_on_cpu(monkeypatch, "reference", decomposed.REFERENCE_MATH):
        yield


def _absorbing_mask_attention(q, k, v, am):
    # An HF-style mask from a float attention_mask (the pass cannot prove it 0 / 1): a float bias.
    mask = (1.0 - am[:, None, None, :]) * torch.finfo(torch.float32).min
    return torch.softmax(q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5 + mask, dim=-1) @ v


def _padding(b: int, n: int, cut: int) -> torch.Tensor:
    am = torch.ones(b, n)
    am[1, cut:] = 0
    am[2] = 0  # all padding: eager weighs its rows uniformly
    return am


def test_reference_choice_lowered_to_its_math_at_any_size(reference_math_on_cpu):
    # A site whose dispatch choice is the reference, at a prefill size, in inference.
    q, k, v = _decode_inputs(b=3, hq=2, hkv=2, nq=40, nk=40)
    am = _padding(3, 40, 25)
    torch._dynamo.reset()
    n = len(records())
    with capture_graphs() as graphs:
        got = torch.compile(_absorbing_mask_attention, backend="fa3")(q, k, v, am)
    decisions = [r.decision for r in records()[n:]]
    assert [d.kernel for d in decisions] == ["reference"] and decisions[0].lowered, [str(d) for d in decisions]
    assert "fa3.attention" not in graphs[0], graphs[0]
    torch.testing.assert_close(got, _absorbing_mask_attention(q, k, v, am), **TOL[torch.float32])


def test_reference_math_bf16_products_keep_absorbed_rows():
    # ReferenceMath multiplies bf16 inputs in bf16 (eager code's precision) and keeps the mask and softmax
    # in fp32: a row the finfo.min bias absorbs is still uniform, the other rows agree with the fp32 math
    # to bf16 rounding.
    from fa_compile.kernels.reference import attention_reference

    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 4, 33, 16, generator=g).to(torch.bfloat16) for _ in range(3))
    bias = torch.zeros(2, 1, 1, 33, dtype=torch.bfloat16)
    bias[1] = torch.finfo(torch.bfloat16).min
    out, lse = attention_reference(q, k, v, scale=0.25, bias=bias, bf16_products=True)
    want, want_lse = attention_reference(q, k, v, scale=0.25, bias=bias)
    uniform = v[1].float().mean(dim=1, keepdim=True).expand(4, 33, 16)
    torch.testing.assert_close(out[1].float(), uniform, atol=8e-3, rtol=8e-3)
    torch.testing.assert_close(out.float(), want.float(), atol=3e-2, rtol=3e-2)
    assert not torch.equal(out, want)  # the bf16 products did run: their rounding differs somewhere
    assert torch.isfinite(lse).all() and lse.dtype == torch.float32


def test_reference_math_training_lowered_both_directions(reference_math_on_cpu):
    # In training the reference choice lowers forward and backward to graph ops (ReferenceMath): the
    # absorbed rows of a fully padded sequence keep eager's uniform weights and eager's gradients.
    q, k, v = (t.requires_grad_() for t in _decode_inputs(b=3, hq=2, hkv=2, nq=24, nk=24))
    am = _padding(3, 24, 9)
    want = _absorbing_mask_attention(q, k, v, am)
    g = torch.randn_like(want)
    want_grads = torch.autograd.grad(want, (q, k, v), g)
    torch._dynamo.reset()
    n = len(records())
    with capture_graphs() as graphs:
        got = torch.compile(_absorbing_mask_attention, backend="fa3")(q, k, v, am)
        got_grads = torch.autograd.grad(got, (q, k, v), g)
    decisions = [r.decision for r in records()[n:]]
    assert sorted(d.direction for d in decisions) == ["backward", "forward"], [str(d) for d in decisions]
    assert all(d.kernel == "reference" and d.lowered for d in decisions), [str(d) for d in decisions]
    assert not any("fa3.attention" in gr for gr in graphs), graphs
    torch.testing.assert_close(got, want, **TOL[torch.float32])
    for a, e in zip(got_grads, want_grads):
        torch.testing.assert_close(a, e, **TOL[torch.float32])


def test_reference_math_passes_every_argument_in_order():
    # forward_fn / backward_fn read the tensors graph_pass passes (bias, kv_lens, dropout seed, q_pos) in
    # its order: fp32 results equal the reference called with the same arguments by name.
    from fa_compile import dispatch
    from fa_compile.kernels.reference import attention_backward_reference, attention_reference

    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 4, 6, 8, generator=g) for _ in range(3))
    k, v = k[:, :2], v[:, :2]
    bias = torch.randn(2, 1, 6, 6, generator=g)
    kv_lens = torch.tensor([6, 4])
    seed = torch.tensor(1234)
    q_pos = torch.tensor([[2, 3, 4, 5, 5, 5], [0, 1, 2, 3, 3, 3]])
    args = dispatch.AttentionArgs(q=q, k=k, v=v, scale=0.3, bias=bias, kv_lens=kv_lens, dropout_p=0.25,
                                  dropout_seed=seed, q_pos=q_pos, needs_backward=True, bias_requires_grad=True)
    m = decomposed.REFERENCE_MATH
    out, lse = m.forward_fn(args)(q, k, v, bias, kv_lens, seed, q_pos)
    kw = dict(scale=0.3, bias=bias, kv_lens=kv_lens, dropout_p=0.25, dropout_seed=seed, q_pos=q_pos)
    want, want_lse = attention_reference(q, k, v, **kw)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
    dout = torch.randn(out.shape, generator=g)
    got = m.backward_fn(args)(dout, q, k, v, out, lse, bias, kv_lens, seed, q_pos)
    ref = attention_backward_reference(dout, q, k, v, bias_requires_grad=True, out=out, **kw)
    for a, e in zip(got, ref):
        assert torch.equal(a, e)


def test_reference_backward_bf16_products_match_fp32():
    # The backward's bf16 products (ReferenceMath in training) agree with the fp32 formulas to bf16
    # rounding, the bias gradient included, and a fully absorbed row still gets softmax's gradient at
    # uniform weights.
    from fa_compile.kernels.reference import attention_backward_reference, attention_reference

    g = torch.Generator().manual_seed(7)
    q, k, v, dout = (torch.randn(2, 4, 20, 16, generator=g).to(torch.bfloat16) for _ in range(4))
    bias = torch.zeros(2, 1, 1, 20, dtype=torch.bfloat16)
    bias[1] = torch.finfo(torch.bfloat16).min
    out, _ = attention_reference(q, k, v, scale=0.25, bias=bias, bf16_products=True)
    kw = dict(scale=0.25, bias=bias, bias_requires_grad=True, out=out)
    got = attention_backward_reference(dout, q, k, v, bf16_products=True, **kw)
    want = attention_backward_reference(dout, q, k, v, **kw)
    for a, e in zip(got, want):
        scale = e.float().abs().max().item()
        torch.testing.assert_close(a.float(), e.float(), atol=2e-2 * scale, rtol=0)
    assert not torch.equal(got[0], want[0])
    assert got[0][1].float().abs().max() > 0  # the absorbed batch's dq: softmax's gradient, not zero
