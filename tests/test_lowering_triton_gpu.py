"""Our Triton family lowered at compile time on a CUDA GPU (fa_compile/lowering/triton.py): a one-layer
attention model compiled by Inductor with kernel="triton", forward and backward, against the same model
with the op's run-time dispatch (eager, and compiled with lower=False); the post-grad graph holds the
kernels' triton_kernel_wrapper_functional nodes and no fa3 op, Inductor's code launches the kernels
itself, and mode="reduce-overhead" captures them in a CUDA graph. Skipped without CUDA (CI has none).

The lowering takes the family's pointer kernels; on Hopper the family runs its TMA-descriptor / Gluon
kernels for aligned strides, which the lowering also replaces by the pointer kernels up to Nq x Nk =
1024 x 1024 and leaves to the op beyond (test_hopper_descriptor_kernels_keep_the_op_when_long); the
other tests select the pointer kernels with FA_COMPILE_TRITON_TMA=0, so that the op's run-time
dispatch they compare with runs the same kernels."""
from __future__ import annotations

from typing import Optional

import pytest
import torch
from torch import nn

import fa_compile
from fa_compile.lowering import capture_graphs, records
from fa_compile.lowering.choice import KEYS_CUT_TEXT

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

TOL = {torch.float16: dict(atol=5e-3, rtol=5e-3), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


@pytest.fixture(autouse=True)
def _setup(monkeypatch):
    from fa_compile.kernels import triton_family as tf

    if not tf.triton_available():
        pytest.skip("triton not installed")
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    monkeypatch.setenv("FA_COMPILE_TRITON_TMA", "0")  # the pointer kernels, on Hopper too
    monkeypatch.delenv("FA_COMPILE_TRITON_LOWER", raising=False)  # the default
    with inductor_config.patch(fx_graph_cache=False), functorch_config.patch(enable_autograd_cache=False):
        yield


class OneLayer(nn.Module):
    """qkv projection, attention through the op (BSHD views, as models hold them), output projection."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, causal: bool):
        super().__init__()
        self.h, self.hkv, self.d, self.causal = heads, kv_heads, hidden // heads, causal
        self.qkv = nn.Linear(hidden, (heads + 2 * kv_heads) * self.d)
        self.proj = nn.Linear(heads * self.d, hidden)

    def forward(self, x, keep=None):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).split([self.h * self.d, self.hkv * self.d, self.hkv * self.d], dim=-1)
        q = q.view(b, n, self.h, self.d).transpose(1, 2)
        k = k.view(b, n, self.hkv, self.d).transpose(1, 2)
        v = v.view(b, n, self.hkv, self.d).transpose(1, 2)
        out = fa_compile.attention(q, k, v, causal=self.causal, bias=keep, kernel="triton")
        return self.proj(out.transpose(1, 2).reshape(b, n, self.h * self.d))


CASES = {
    # name: (batch, tokens, hidden, heads, kv heads, causal, key padding mask, dtype)
    "causal_gqa": (2, 200, 256, 4, 2, True, False, torch.float16),
    "key_padding": (3, 130, 256, 4, 4, False, True, torch.float16),
    "decode_like_short": (4, 17, 512, 8, 8, False, False, torch.bfloat16),
}


def _model_and_inputs(name: str, seed: int = 0):
    b, n, hidden, h, hkv, causal, padding, dtype = CASES[name]
    torch.manual_seed(seed)
    model = OneLayer(hidden, h, hkv, causal).to("cuda", dtype)
    x = torch.randn(b, n, hidden, device="cuda", dtype=dtype)
    keep = None
    if padding:
        keep = torch.ones(b, 1, 1, n, dtype=torch.bool, device="cuda")
        keep[0, ..., n - 37:] = False
        keep[1, ..., 5:] = False
    return model, x, keep


def _step(model, x, keep):
    """Output and the gradients of the input and every parameter for the loss (out * w).sum()."""
    model.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_()
    out = model(x, keep)
    w = torch.randn(out.shape, device=out.device, generator=torch.Generator(device=out.device).manual_seed(7))
    (out.float() * w).sum().backward()
    return [("out", out.detach()), ("dx", x.grad)] + [(f"d{n}", p.grad.clone()) for n, p in model.named_parameters()]


def _compare(got, want, dtype, what: str):
    for (name, a), (_, b) in zip(got, want):
        torch.testing.assert_close(a, b, **TOL[dtype], msg=lambda m, n=name: f"{what}, {n}: {m}")


def _decisions_since(n: int) -> list:
    return [r.decision for r in records()[n:]]


@pytest.mark.parametrize("name", list(CASES))
def test_lowered_model_matches_run_time_dispatch(name):
    model, x, keep = _model_and_inputs(name)
    dtype = CASES[name][-1]
    want = _step(model, x, keep)  # eager: the op and its run-time dispatch (the Triton family)
    torch._dynamo.reset()
    n = len(records())
    with capture_graphs() as graphs:
        compiled = torch.compile(model, backend=fa_compile.backend(kernel="triton"), fullgraph=True)
        got = _step(compiled, x, keep)
    decisions = _decisions_since(n)
    info = "\n".join(str(d) for d in decisions) + "\n" + "\n\n".join(graphs)
    assert decisions and all(d.lowered for d in decisions), info
    assert {d.target for d in decisions} == {"fa3_triton.fwd", "fa3_triton.bwd"}, info
    assert all("torch.ops.fa3.attention" not in g for g in graphs), info
    assert sum("triton_kernel_wrapper_functional" in g for g in graphs) == 2, info
    _compare(got, want, dtype, "compiled vs eager")
    torch._dynamo.reset()
    unlowered = torch.compile(model, backend=fa_compile.backend(kernel="triton", lower=False), fullgraph=True)
    _compare(got, _step(unlowered, x, keep), dtype, "lowered vs lower=False")


def test_inductor_code_launches_the_kernels():
    from torch._inductor.utils import run_and_get_code

    model, x, keep = _model_and_inputs("causal_gqa")
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=fa_compile.backend(kernel="triton"), fullgraph=True)
    with torch.no_grad():
        out, codes = run_and_get_code(compiled, x, keep)
        want = model(x, keep)
    code = "\n".join(codes)
    torch.testing.assert_close(out, want, **TOL[torch.float16])
    assert "attn_fwd_kernel" in code, code[-6000:]
    assert "fa3_triton" not in code and "torch.ops.fa3" not in code, code[-6000:]


@pytest.mark.parametrize("name", ["causal_gqa", "key_padding"])
def test_reduce_overhead_captures_the_lowered_kernels(name):
    from torch._dynamo.utils import counters

    model, x, keep = _model_and_inputs(name)
    dtype = CASES[name][-1]
    torch._dynamo.reset()
    counters.clear()
    n = len(records())
    compiled = torch.compile(model, backend=fa_compile.backend(kernel="triton", mode="reduce-overhead"))
    for seed in (0, 1, 2):
        g = torch.Generator(device="cuda").manual_seed(seed)
        xs = torch.randn(x.shape, device="cuda", dtype=dtype, generator=g)
        got = _step(compiled, xs, keep)
        _compare(got, _step(model, xs, keep), dtype, f"reduce-overhead, call {seed}")
    decisions = _decisions_since(n)
    assert decisions and all(d.lowered for d in decisions), [str(d) for d in decisions]
    skips = dict(counters["inductor"])
    assert not any(k.startswith("cudagraph_skips") and v for k, v in skips.items()), skips


def test_hopper_descriptor_kernels_keep_the_op_when_long(monkeypatch):
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the TMA-descriptor / Gluon kernels run on Hopper only")
    monkeypatch.delenv("FA_COMPILE_TRITON_TMA")
    for tokens, lowered in ((200, True), (1100, False)):
        torch.manual_seed(0)
        model = OneLayer(256, 4, 2, True).to("cuda", torch.float16)
        x = torch.randn(2, tokens, 256, device="cuda", dtype=torch.float16)
        want = _step(model, x, None)
        torch._dynamo.reset()
        n = len(records())
        got = _step(torch.compile(model, backend=fa_compile.backend(kernel="triton")), x, None)
        _compare(got, want, torch.float16, f"{tokens} tokens")
        decisions = _decisions_since(n)
        assert decisions and all(d.lowered == lowered for d in decisions), [str(d) for d in decisions]
        if not lowered:
            assert all("TMA-descriptor / Gluon" in d.reason for d in decisions), [str(d) for d in decisions]


def test_dropout_lowers_with_the_ops_mask():
    # The node's seed reaches the kernels: the same counter-hash mask as the op's run-time kernel.
    g = torch.Generator(device="cuda").manual_seed(3)
    q, k, v = (torch.randn(2, 96, 4, 64, device="cuda", dtype=torch.float16, generator=g).transpose(1, 2)
               for _ in range(3))
    seed = torch.tensor(1234, device="cuda")

    def fn(q, k, v, seed):
        return torch.ops.fa3.attention(q, k, v, 0.125, True, 0, dropout_p=0.2, dropout_seed=seed,
                                       force_kernel="triton")

    def step(f):
        qq, kk, vv = (t.detach().clone().requires_grad_() for t in (q, k, v))
        out, lse = f(qq, kk, vv, seed)
        out.float().square().sum().backward()
        return [("out", out.detach()), ("lse", lse.detach()), ("dq", qq.grad), ("dk", kk.grad), ("dv", vv.grad)]

    want = step(fn)
    torch._dynamo.reset()
    n = len(records())
    got = step(torch.compile(fn, backend=fa_compile.backend(kernel="triton"), fullgraph=True))
    decisions = _decisions_since(n)
    assert decisions and all(d.lowered for d in decisions), [str(d) for d in decisions]
    _compare(got, want, torch.float16, "dropout")


class PaddedEncoderAttention(nn.Module):
    """An encoder's eager attention: scores plus an additive key-padding mask, finfo.min where the mask is 0
    (the masked_fill form; a mask the pass passes to the kernel as bool key padding), or `fill`; with `dropout`,
    dropout on the probabilities in training, as BERT's eager code has it."""

    def __init__(self, hidden: int, heads: int, dropout: float = 0.0, fill: Optional[float] = None):
        super().__init__()
        self.h, self.d, self.dropout, self.fill = heads, hidden // heads, dropout, fill
        self.qkv = nn.Linear(hidden, 3 * hidden)

    def forward(self, x, mask):
        b, n, _ = x.shape
        q, k, v = (t.view(b, n, self.h, self.d).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        fill = torch.finfo(x.dtype).min if self.fill is None else self.fill
        add = torch.zeros(b, 1, 1, n, dtype=x.dtype, device=x.device).masked_fill(mask[:, None, None, :] == 0, fill)
        p = torch.softmax(q @ k.transpose(-1, -2) * self.d ** -0.5 + add, dim=-1)
        if self.dropout:
            p = nn.functional.dropout(p, self.dropout, training=self.training)
        return (p @ v).transpose(1, 2).reshape(b, n, self.h * self.d), v


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_inference_fixup_of_empty_rows_is_written_by_the_forward_kernel(dtype):
    # A sequence whose every key is padding: eager's uniform weights give the mean of V on its rows, which
    # the forward kernel writes itself in an inference graph (no `where` / mean left in the graph).
    torch.manual_seed(0)
    model = PaddedEncoderAttention(256, 4).to("cuda", dtype)
    x = torch.randn(3, 77, 256, device="cuda", dtype=dtype)
    mask = torch.ones(3, 77, device="cuda", dtype=torch.long)
    mask[0] = 0
    mask[2, 40:] = 0
    torch._dynamo.reset()
    n = len(records())
    with torch.no_grad(), capture_graphs() as graphs:
        want, v = model(x, mask)
        got, _ = torch.compile(model, backend=fa_compile.backend(kernel="triton"), fullgraph=True)(x, mask)
    decisions = _decisions_since(n)
    info = "\n".join(str(d) for d in decisions) + "\n" + "\n\n".join(graphs)
    assert [_folded(d) for d in decisions] == ["triton -> fa3_triton.fwd (empty rows: mean of V written by the kernel)"], info
    assert not any("aten.where" in g or "aten.mean" in g for g in graphs), info
    # the kernel's [B, N, H, D] out is what `.transpose(1, 2).reshape(...)` reads: no copy either way
    assert not any("aten.clone" in g or "copy_strided" in g for g in graphs), info
    torch.testing.assert_close(got, want, **TOL[dtype])
    mean_v = v[0].float().mean(dim=1).reshape(1, -1).expand(77, -1)  # [H, D] -> [N, H * D], as the output
    torch.testing.assert_close(got[0].float(), mean_v, **TOL[dtype])


def _folded(d) -> str:
    """A decision as text, without the key-limit note (whether a site cuts keys depends on this GPU's tiles)."""
    return f"{d.kernel} -> {d.target}" + (f" ({d.folded})" if d.folded else "") if d.lowered else str(d)


def _padded_encoder_decisions(model, x, mask, grad: bool = False) -> tuple[list, torch.Tensor, torch.Tensor]:
    torch._dynamo.reset()
    n = len(records())
    compiled = torch.compile(model, backend=fa_compile.backend(), fullgraph=True)
    with torch.set_grad_enabled(grad):
        got, _ = compiled(x, mask)
        want, _ = model(x, mask)
    return [_folded(d) for d in _decisions_since(n)], got, want


def test_padded_inference_sites_prefer_the_kernel_that_fills_empty_rows():
    # Dispatch's own choice (cuDNN on the H200) keeps the fix-up as graph ops; at short lengths and d64 the
    # lowering takes our Triton forward, which writes those rows itself (lowering/choice.py _filling_kernel).
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.manual_seed(0)
    model = PaddedEncoderAttention(256, 4).to("cuda", torch.bfloat16)
    x = torch.randn(3, 77, 256, device="cuda", dtype=torch.bfloat16)
    mask = torch.ones(3, 77, device="cuda", dtype=torch.long)
    mask[0] = 0
    decisions, got, want = _padded_encoder_decisions(model, x, mask)
    assert decisions == ["triton -> fa3_triton.fwd (empty rows: mean of V written by the kernel)"], decisions
    torch.testing.assert_close(got, want, **TOL[torch.bfloat16])
    # The user narrows the SDPA backends: dispatch's choice stands.
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        decisions, got, want = _padded_encoder_decisions(model, x, mask)
    assert len(decisions) == 1 and not decisions[0].startswith("triton"), decisions
    torch.testing.assert_close(got, want, **TOL[torch.bfloat16])
    # Training: the lse is saved for the backward, the fix-up stays graph ops, and the rule does not apply.
    model.requires_grad_(True)
    decisions, got, want = _padded_encoder_decisions(model, x, mask, grad=True)
    assert decisions and not any("written by the kernel" in d for d in decisions), decisions
    torch.testing.assert_close(got, want, **TOL[torch.bfloat16])


@pytest.mark.parametrize("n_keys", [77, 300])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_training_fixup_and_its_backward_run_in_the_kernels(dtype, n_keys):
    # Training with kernel="triton": the forward kernel writes the mean of V on the fully padded sequence's rows
    # and the backward kernels compute that fix-up's backward (fa3_triton.bwd's empty_grad): none of its
    # where / mean / sum / add is left in either graph. Output and every gradient against fp32 eager.
    torch.manual_seed(0)
    model = PaddedEncoderAttention(256, 4).to("cuda", dtype)
    ref = PaddedEncoderAttention(256, 4).to("cuda", torch.float32)
    ref.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    x = torch.randn(3, n_keys, 256, device="cuda", dtype=dtype)
    mask = torch.ones(3, n_keys, device="cuda", dtype=torch.long)
    mask[0] = 0
    mask[2, 40:] = 0  # at 300 keys, tiles past the limit: the kernels cut them (key_limit.for_site)
    g = torch.randn(3, n_keys, 256, device="cuda", dtype=dtype)

    def step(m, params, xx):
        for p in params:
            p.grad = None
        xx = xx.detach().clone().requires_grad_()
        out, _ = m(xx, mask)
        out.backward(g.to(out.dtype))
        return [out.detach(), xx.grad] + [p.grad.clone() for p in params]

    torch._dynamo.reset()
    n = len(records())
    with capture_graphs() as graphs:
        got = step(torch.compile(model, backend=fa_compile.backend(kernel="triton"), fullgraph=True),
                   list(model.parameters()), x)
    want = step(ref, list(ref.parameters()), x.float())
    eager = step(model, list(model.parameters()), x)  # eager's own rounding in this dtype
    decisions = _decisions_since(n)
    info = "\n".join(str(d) for d in decisions) + "\n" + "\n\n".join(graphs)
    assert [_folded(d) for d in decisions] == [
        "triton -> fa3_triton.fwd (empty rows: mean of V written by the kernel)",
        "triton -> fa3_triton.bwd (empty rows: their dout zeroed, the mean of V's gradient and eager's uniform-row "
        "q / k gradients by the kernel)"], info
    if n_keys == 300:
        assert all(d.keys == KEYS_CUT_TEXT for d in decisions), info
    assert not any(op in gr for gr in graphs for op in ("aten.where", "aten.mean", "uniform_row_grad")), info
    assert "attn_bwd_empty_rows_kernel" in info or "UNIFORM" in info, info
    for i, (a, e, r) in enumerate(zip(got, eager, want)):
        # every element within the tolerance of fp32 eager, or within twice eager's own worst error in this dtype
        # over the tensor (flash-attention's rule: weight gradients sum hundreds of rounded products, and at one
        # element eager's rounding may be lucky where ours is not)
        err, own = (a.float() - r).abs(), (e.float() - r).abs()
        bad = (err > TOL[dtype]["atol"] + TOL[dtype]["rtol"] * r.abs()) & (err > 2 * own.max())
        assert not bad.any(), f"value {i}: {int(bad.sum())} elements, worst {float(err[bad].max())} " \
                              f"(eager's own error there {float(own[bad].max())})"


@pytest.mark.parametrize("d", [64, 128, 256])
def test_bwd_op_computes_the_fixups_backward_on_the_gpu(d):
    # The empty-row kernel at the head dims whose C / E tiles are largest (fp32 [32, Dv] chunks), GQA, BSHD,
    # every element against the fp64 reference plus autograd through the fill.
    from fa_compile.kernels import reference as ref
    from fa_compile.kernels import triton_family as tf
    from fa_compile.kernels import triton_ops
    from fa_compile.row_fixups import _uniform_row_grad_autograd

    gen = torch.Generator(device="cuda").manual_seed(d)
    b, hq, hkv, n = 3, 4, 2, 150
    q, k, v = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16, generator=gen).transpose(1, 2)
               for h in (hq, hkv, hkv))
    v = v + 0.5
    keep = torch.ones(b, 1, 1, n, dtype=torch.bool, device="cuda")
    keep[1] = False
    keep[2, ..., 90:] = False
    scale = d ** -0.5
    block = max(tf._pow2(d), 16)
    cfg = [tf.pick_config("fwd", block, False, (9, 0))]
    tile = [cfg[0].block_m, cfg[0].block_n, cfg[0].num_warps, cfg[0].num_stages]
    bt = [tf.pick_config(kd, block, False, (9, 0)) for kd in ("dkdv", "dq")]
    bt = [[c.block_m, c.block_n, c.num_warps, c.num_stages] for c in bt]
    out, lse = triton_ops.fwd(q, k, v, keep, None, None, scale, False, 0, -1, -1, 0.0, 0.0, tile, None,
                              triton_ops.EMPTY_FILLS["mean_v"])
    empty = torch.isneginf(lse)[..., None]
    dout = torch.randn(out.shape, device="cuda", dtype=out.dtype, generator=gen).masked_fill(empty, 3.0)
    dq, dk, dv, _ = triton_ops.bwd(dout, q, k, v, out, lse, keep, None, None, scale, False, 0, -1, -1, 0.0, 0.0,
                                   False, *bt, triton_ops.EMPTY_GRADS["uniform"])
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    want = ref.attention_backward_reference(dout.double().masked_fill(empty, 0.0), *leaves, bias_requires_grad=False,
                                            scale=scale, bias=keep)
    fill = leaves[2].mean(dim=2, keepdim=True).repeat_interleave(hq // hkv, dim=1).expand(out.shape)
    fill = fill + _uniform_row_grad_autograd(*leaves, scale)
    extra = torch.autograd.grad(fill, leaves, dout.double().masked_fill(~empty, 0.0))
    for name, got, w, e in zip(("dq", "dk", "dv"), (dq, dk, dv), want, extra):
        torch.testing.assert_close(got.double(), w + e, **TOL[torch.bfloat16], msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("heads", [4, 2], ids=["d64", "d128"])
def test_hopper_training_backward_calls_the_gluon_kernel(heads, monkeypatch):
    # On Hopper, with the descriptor path on (the default), a padded encoder's training backward with dropout is
    # lowered to fa3_gluon.bwd: one pass of the Gluon kernel, the key-padding mask read per key, the forward's
    # dropout bits. Against the same compiled model with the Gluon backward switched off (the pointer kernels,
    # the same counter hash): output and every gradient; and the Gluon kernel is what ran. The mask is -inf: a
    # finfo.min mask with dropout is left alone (tests/test_dropout_masked_rows.py), and a sequence with no key
    # would be NaN, so every sequence keeps a key.
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon backward runs on Hopper only")
    from fa_compile.kernels import triton_family as tf

    monkeypatch.delenv("FA_COMPILE_TRITON_TMA")
    torch.manual_seed(0)
    model = PaddedEncoderAttention(256, heads, dropout=0.1, fill=float("-inf")).to("cuda", torch.bfloat16).train()
    x = torch.randn(4, 300, 256, device="cuda", dtype=torch.bfloat16)
    mask = torch.ones(4, 300, device="cuda", dtype=torch.long)
    mask[1, 150:] = 0
    mask[2, 7:] = 0
    mask[3, 1:] = 0
    g = torch.randn(4, 300, 256, device="cuda", dtype=torch.bfloat16)

    def step(env: str):
        monkeypatch.setenv("FA_COMPILE_GLUON", env)
        torch._dynamo.reset()
        torch.manual_seed(11)  # the op's dropout seed is drawn from torch's generator, as in eager
        model.zero_grad(set_to_none=True)
        xx = x.detach().clone().requires_grad_()
        n = len(records())
        out, _ = torch.compile(model, backend=fa_compile.backend(kernel="triton"), fullgraph=True)(xx, mask)
        out.backward(g)
        grads = [("out", out.detach()), ("dx", xx.grad)] + [(f"d{k}", p.grad.clone())
                                                          for k, p in model.named_parameters()]
        return grads, _decisions_since(n)

    tf.LAST_COMPILED.pop("attn_bwd_gluon_kernel", None)
    got, decisions = step("1")
    assert "attn_bwd_gluon_kernel" in tf.LAST_COMPILED
    assert [d.target for d in decisions] == ["fa3_triton.fwd", "fa3_gluon.bwd"], [str(d) for d in decisions]
    want, decisions = step("0")
    assert [d.target for d in decisions] == ["fa3_triton.fwd", "fa3_triton.bwd"], [str(d) for d in decisions]
    for (name, a), (_, b) in zip(got, want):
        assert torch.isfinite(a).all(), name
    _compare(got, want, torch.bfloat16, "Gluon backward against the pointer kernels")
