"""Attention whose parts run under different grad modes (`no_grad`, `set_grad_enabled`, `enable_grad`
inside `no_grad`), inference mode or autocast: the rewrite gives exactly eager's gradient flow --
`.grad is None` where eager's is -- and eager's dtypes, or leaves the site alone and says why."""
from __future__ import annotations

import copy
from typing import Optional

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fa_compile
from eager_diff import check, rand

B, H, N, D = 2, 2, 8, 16


def qkv(requires_grad: bool = True, dtype: torch.dtype = torch.float32, seed: int = 0) -> list:
    return [rand(B, H, N, D, dtype=dtype, seed=seed + i, requires_grad=requires_grad) for i in range(3)]


def scores_no_grad(q, k, v):
    with torch.no_grad():
        s = q @ k.mT * 0.25
    return s.softmax(-1) @ v


def scores_set_grad_enabled_false(q, k, v):
    torch.set_grad_enabled(False)
    s = torch.matmul(q, k.transpose(-2, -1)) / 4.0
    torch.set_grad_enabled(True)
    return torch.softmax(s, dim=-1) @ v


@torch.no_grad()
def _scores(q, k):
    return torch.einsum("bhqd,bhkd->bhqk", q, k) * 0.25


def scores_in_a_no_grad_function(q, k, v):
    return F.softmax(_scores(q, k), dim=-1) @ v


def probs_no_grad(q, k, v):
    s = q @ k.mT * 0.25
    with torch.no_grad():
        p = s.softmax(-1)
    return p @ v


def pv_no_grad(q, k, v):
    p = (q @ k.mT * 0.25).softmax(-1)
    with torch.no_grad():
        return p @ v


def enable_grad_inside_no_grad(q, k, v):
    with torch.no_grad():
        s = q @ k.mT * 0.25
        with torch.enable_grad():
            return s.softmax(-1) @ v


def all_inside_enable_grad_in_no_grad(q, k, v):
    with torch.no_grad():
        with torch.enable_grad():
            return (q @ k.mT * 0.25).softmax(-1) @ v


def key_cast_no_grad(q, k, v):
    with torch.no_grad():
        kt = k.float().transpose(-2, -1)
    return (q @ kt * 0.25).softmax(-1) @ v


def key_view_no_grad(q, k, v):
    with torch.no_grad():
        kt = k.transpose(-2, -1)
    return (q @ kt * 0.25).softmax(-1) @ v


def query_scaled_no_grad(q, k, v):
    with torch.no_grad():
        qs = q * 0.25
    return (qs @ k.mT).softmax(-1) @ v


def value_view_no_grad(q, k, v):
    with torch.no_grad():
        vt = v.transpose(1, 2)
    return (q @ k.mT * 0.25).softmax(-1) @ vt.transpose(1, 2)


def whole_site_no_grad(q, k, v):
    with torch.no_grad():
        return (q @ k.mT * 0.25).softmax(-1) @ v


def stacked_second_scores_no_grad(q, k, v):
    o = (q @ k.mT * 0.25).softmax(-1) @ v
    with torch.no_grad():
        s = o @ k.mT * 0.25
    return s.softmax(-1) @ v


def stacked_first_pv_no_grad(q, k, v):
    p = (q @ k.mT * 0.25).softmax(-1)
    with torch.no_grad():
        o = p @ v
    return (o @ k.mT * 0.25).softmax(-1) @ v + o


GRAD_FORMS = [scores_no_grad, scores_set_grad_enabled_false, scores_in_a_no_grad_function, probs_no_grad, pv_no_grad,
              enable_grad_inside_no_grad, all_inside_enable_grad_in_no_grad, key_cast_no_grad, key_view_no_grad,
              query_scaled_no_grad, value_view_no_grad, whole_site_no_grad]


@pytest.mark.parametrize("fn", GRAD_FORMS, ids=lambda f: f.__name__)
def test_grad_mode_regions_keep_eager_gradient_flow(fn):
    check(fn, qkv(), rewritten=1)


@pytest.mark.parametrize("fn", [stacked_second_scores_no_grad, stacked_first_pv_no_grad], ids=lambda f: f.__name__)
def test_stacked_sites_across_grad_mode_regions(fn):
    check(fn, qkv(), rewritten=2)


def test_grad_mode_regions_with_inductor():
    check(scores_no_grad, qkv(), inner="inductor", rewritten=1)


def test_grad_mode_regions_in_fp16():
    check(scores_no_grad, qkv(dtype=torch.float16), dtype=torch.float16, rewritten=1)


# --------------------------------------------------------------------------- regrouped batch dims, GQA
# The rewrite reads q, k, v (and mask terms) from before a batch regroup `x.reshape(B*H, N, D)` or a
# GQA repeat; a no_grad region over those nodes must still cut the gradient of what lies before them.


def _rows(x):
    return x.reshape(-1, x.shape[-2], x.shape[-1])


def repeat_kv(x, g=H):
    b, h, n, d = x.shape
    return x[:, :, None].expand(b, h, g, n, d).reshape(b, h * g, n, d)


def qkv_gqa(dtype: torch.dtype = torch.float32) -> list:
    return [rand(B, H, N, D, dtype=dtype, seed=0, requires_grad=True),
            rand(B, 1, N, D, dtype=dtype, seed=1, requires_grad=True),
            rand(B, 1, N, D, dtype=dtype, seed=2, requires_grad=True)]


def bmm_scores_no_grad_after_repeat(q, k, v):
    k, v = repeat_kv(k), repeat_kv(v)
    with torch.no_grad():
        s = torch.bmm(_rows(q), _rows(k).transpose(1, 2)).view(B, H, N, N) * 0.25
    return s.softmax(-1) @ v


def baddbmm_scores_no_grad_after_repeat(q, k, v):
    k, v = repeat_kv(k), repeat_kv(v)
    with torch.no_grad():
        s = torch.baddbmm(torch.zeros(B * H, N, N), _rows(q), _rows(k).mT, alpha=0.25).view(B, H, N, N)
    return s.softmax(-1) @ v


def einsum_scores_no_grad_after_repeat(q, k, v):
    k, v = repeat_kv(k), repeat_kv(v)
    with torch.no_grad():
        s = torch.einsum("bnd,bmd->bnm", _rows(q), _rows(k)).view(B, H, N, N) * 0.25
    return s.softmax(-1) @ v


def key_regroup_no_grad(q, k, v):
    with torch.no_grad():
        k3 = _rows(k)
    s = torch.bmm(_rows(q), k3.transpose(1, 2)).view(B, H, N, N) * 0.25
    return s.softmax(-1) @ v


def query_regroup_no_grad(q, k, v):
    with torch.no_grad():
        q3 = _rows(q)
    s = torch.bmm(q3, _rows(k).mT).view(B, H, N, N) * 0.25
    return s.softmax(-1) @ v


def key_regroup_set_grad_enabled_false(q, k, v):
    torch.set_grad_enabled(False)
    k3 = _rows(k)
    torch.set_grad_enabled(True)
    return (torch.bmm(_rows(q), k3.mT).view(B, H, N, N) * 0.25).softmax(-1) @ v


def value_regroup_no_grad(q, k, v):
    with torch.no_grad():
        v3 = _rows(v)
    p = (q @ k.mT * 0.25).softmax(-1)
    return torch.bmm(_rows(p), v3).view(B, H, N, D)


def value_regroup_no_grad_after_repeat(q, k, v):
    k, v = repeat_kv(k), repeat_kv(v)
    with torch.no_grad():
        v3 = _rows(v)
    p = (q @ k.mT * 0.25).softmax(-1)
    return torch.bmm(_rows(p), v3).view(B, H, N, D)


def regroup_no_grad_scores_in_enable_grad(q, k, v):
    with torch.no_grad():
        k3 = _rows(k)
        with torch.enable_grad():
            s = torch.bmm(_rows(q), k3.mT).view(B, H, N, N) * 0.25
    return s.softmax(-1) @ v


def repeat_no_grad_scores_in_enable_grad(q, k, v):
    with torch.no_grad():
        k = repeat_kv(k)
        with torch.enable_grad():
            s = q @ k.mT * 0.25
    return s.softmax(-1) @ repeat_kv(v)


REGROUP_FORMS = [bmm_scores_no_grad_after_repeat, baddbmm_scores_no_grad_after_repeat,
                 einsum_scores_no_grad_after_repeat, value_regroup_no_grad_after_repeat,
                 repeat_no_grad_scores_in_enable_grad]
REGROUP_FORMS_MHA = [key_regroup_no_grad, query_regroup_no_grad, key_regroup_set_grad_enabled_false,
                     value_regroup_no_grad, regroup_no_grad_scores_in_enable_grad]


@pytest.mark.parametrize("fn", REGROUP_FORMS, ids=lambda f: f.__name__)
def test_no_grad_over_a_gqa_repeat_or_regroup_cuts_the_gradient(fn):
    check(fn, qkv_gqa(), rewritten=1)


@pytest.mark.parametrize("fn", REGROUP_FORMS_MHA, ids=lambda f: f.__name__)
def test_no_grad_over_a_batch_regroup_cuts_the_gradient(fn):
    check(fn, qkv(), rewritten=1)


class BiasRegroupNoGrad(nn.Module):
    """A learned bias read through a batch regroup made under no_grad: eager gives it no gradient."""

    def __init__(self):
        super().__init__()
        self.bias = nn.Parameter(torch.linspace(-1, 1, B * H * N * N).view(B, H, N, N))

    def forward(self, q, k, v):
        with torch.no_grad():
            b3 = _rows(self.bias)
        s = torch.bmm(_rows(q), _rows(k).mT) * 0.25 + b3
        return s.view(B, H, N, N).softmax(-1) @ v


class BiasDetached(nn.Module):
    """A learned bias added detached (read through views by the mask analysis): no gradient either."""

    def __init__(self):
        super().__init__()
        self.bias = nn.Parameter(torch.linspace(-1, 1, N * N).view(1, 1, N, N))

    def forward(self, q, k, v):
        return (q @ k.mT * 0.25 + self.bias.detach().expand(B, H, N, N)).softmax(-1) @ v


class BiasRegroupNoGradAndLearned(nn.Module):
    """One bias cut by no_grad (through a regroup), another learned: one op bias cannot keep both."""

    def __init__(self):
        super().__init__()
        self.cut = nn.Parameter(torch.linspace(-1, 1, B * H * N * N).view(B, H, N, N))
        self.live = nn.Parameter(torch.linspace(1, -1, N * N).view(N, N))

    def forward(self, q, k, v):
        with torch.no_grad():
            b3 = _rows(self.cut)
        s = torch.bmm(_rows(q), _rows(k).mT) * 0.25 + b3 + self.live
        return s.view(B, H, N, N).softmax(-1) @ v


@pytest.mark.parametrize("fn", [BiasRegroupNoGrad, BiasDetached], ids=["regroup_no_grad", "detached"])
def test_bias_read_through_a_gradient_cut_gets_no_gradient(fn):
    check(fn(), qkv(), rewritten=1)


class BiasDetachedAndLearned(nn.Module):
    def __init__(self):
        super().__init__()
        self.cut = nn.Parameter(torch.linspace(-1, 1, N * N).view(1, 1, N, N))
        self.live = nn.Parameter(torch.linspace(1, -1, N * N).view(N, N))

    def forward(self, q, k, v):
        return (q @ k.mT * 0.25 + self.cut.detach() + self.live).softmax(-1) @ v


@pytest.mark.parametrize("fn", [BiasRegroupNoGradAndLearned, BiasDetachedAndLearned], ids=["no_grad", "detach"])
def test_bias_cut_and_learned_bias_together_are_left_alone(fn):
    res = check(fn(), qkv(), rewritten=0)
    assert any("gradient is cut" in r for r in res.reasons), res.reasons


class BiasAfterNoGrad(nn.Module):
    """A learned bias added after scores computed without grad: the bias gets a gradient, q and k do not."""

    def __init__(self, inside: bool):
        super().__init__()
        self.inside = inside
        self.bias = nn.Parameter(torch.linspace(-1, 1, N * N).view(1, 1, N, N))

    def forward(self, q, k, v):
        with torch.no_grad():
            s = q @ k.mT * 0.25
            if self.inside:
                s = s + self.bias
        if not self.inside:
            s = s + self.bias
        return s.softmax(-1) @ v


class TemperatureNoGrad(nn.Module):
    """A per-head temperature (folded into q by the rewrite) applied under no_grad."""

    def __init__(self):
        super().__init__()
        self.t = nn.Parameter(torch.linspace(0.5, 2.0, H).view(H, 1, 1))

    def forward(self, q, k, v):
        with torch.no_grad():
            s = (q @ k.mT) * self.t
        return s.softmax(-1) @ v


@pytest.mark.parametrize("fn", [BiasAfterNoGrad(False), BiasAfterNoGrad(True), TemperatureNoGrad()],
                         ids=["bias_after", "bias_inside", "temperature"])
def test_bias_and_scale_parameters_keep_eager_gradient_flow(fn):
    check(fn, qkv(), rewritten=1)


def test_compiled_under_ambient_no_grad():
    with torch.no_grad():
        check(scores_no_grad, qkv(), rewritten=1)


# --------------------------------------------------------------------------- inference mode, autocast


def scores_inference_mode(q, k, v):
    with torch.inference_mode():
        s = q @ k.mT * 0.25
    return s.clone().softmax(-1) @ v


def whole_site_inference_mode(q, k, v):
    with torch.inference_mode():
        return (q @ k.mT * 0.25).softmax(-1) @ v


def scores_autocast(q, k, v):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        s = q @ k.mT * 0.25
    return s.float().softmax(-1) @ v


def whole_site_autocast(q, k, v):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return (q @ k.mT * 0.25).softmax(-1) @ v


def sdpa_autocast(q, k, v):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def scale_in_autocast(q, k, v):  # the region holds a multiply only: every part computes in fp32
    s = q @ k.mT
    with torch.autocast("cpu", dtype=torch.bfloat16):
        s = s * 0.25
    return s.softmax(-1) @ v


def softmax_with_autocast_off(q, k, v):  # bf16 products, the softmax of bf16 scores in a disabled region
    with torch.autocast("cpu", dtype=torch.bfloat16):
        s = q @ k.mT * 0.25
        with torch.autocast("cpu", enabled=False):
            p = s.softmax(-1)
        return p @ v


def products_in_two_regions(q, k, v):  # two regions of one dtype, a causal mask added between them
    with torch.autocast("cpu", dtype=torch.bfloat16):
        s = q @ k.mT * 0.25
    s = s + torch.full((N, N), float("-inf")).triu(1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return s.softmax(-1) @ v


def products_in_two_dtypes(q, k, v):
    with torch.autocast("cpu", dtype=torch.float16):
        s = q @ k.mT * 0.25
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return s.softmax(-1) @ v


@pytest.mark.parametrize("fn", [scale_in_autocast, softmax_with_autocast_off, products_in_two_regions],
                         ids=lambda f: f.__name__)
def test_an_attention_across_autocast_regions_computes_as_each_product_did(fn):
    # each node's example value carries the dtype its own region computed in: the site finder compares those
    dtype = torch.float32 if fn is scale_in_autocast else torch.bfloat16
    res = check(fn, qkv(), dtype=dtype, rewritten=1)
    assert res.out.dtype == dtype


def test_products_of_two_autocast_dtypes_are_left_alone():
    res = check(products_in_two_dtypes, qkv(), dtype=torch.bfloat16, rewritten=0)
    assert any("different dtypes" in r for r in res.reasons), res.reasons


def test_gpt2_reorder_and_upcast_attn_under_autocast():
    # its fp32 scores are computed in a region that turns autocast off, P·V under the caller's bf16 autocast
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, attn_implementation="eager",
                                  reorder_and_upcast_attn=True, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    model = transformers.GPT2Model(cfg)

    class UnderAutocast(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, x):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return self.model(inputs_embeds=x).last_hidden_state

    check(UnderAutocast(), [rand(2, 8, 32, seed=5, requires_grad=True)], dtype=torch.bfloat16, rewritten=2)


def test_scores_in_inference_mode_are_left_alone():
    res = check(scores_inference_mode, qkv(), rewritten=0)
    assert any("inference_mode" in r for r in res.reasons), res.reasons


def test_whole_site_in_inference_mode():
    check(whole_site_inference_mode, qkv(requires_grad=False), rewritten=1)


def test_scores_partly_in_autocast_are_left_alone():
    res = check(scores_autocast, qkv(), rewritten=0)
    assert any("autocast" in r for r in res.reasons), res.reasons


@pytest.mark.parametrize("fn", [whole_site_autocast, sdpa_autocast], ids=lambda f: f.__name__)
def test_whole_site_in_autocast_computes_in_its_dtype(fn):
    res = check(fn, qkv(), dtype=torch.bfloat16, rewritten=1)
    assert res.out.dtype == res.ref.dtype == torch.bfloat16
    assert res.rewritten[0].dtype in ("torch.bfloat16", "bfloat16")


class MHAAutocast(nn.Module):
    def __init__(self, encoder: bool):
        super().__init__()
        self.encoder = encoder
        self.mha = nn.MultiheadAttention(D, H, batch_first=True)
        self.layer = nn.TransformerEncoderLayer(D, H, 2 * D, dropout=0.0, batch_first=True)

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.layer(x) if self.encoder else self.mha(x, x, x, need_weights=False)[0]


def test_the_fused_encoder_layer_under_autocast_is_left_alone():
    m = MHAAutocast(encoder=True).eval()
    with torch.no_grad():
        # inner "eager": AOTAutograd itself traces the fused encoder layer under autocast as float32
        res = check(m, [rand(B, N, D, seed=7)], dtype=torch.bfloat16, rewritten=0, inner="eager")
    assert res.out.dtype == torch.bfloat16
    assert any("autocast" in r for r in res.reasons), res.reasons


class MHAUnderAutocast(nn.Module):
    """nn.MultiheadAttention in an autocast region (AMP training of CLIP, DETR, ...): the functional's linears,
    attention and masks compute in bfloat16 on float32 inputs and weights."""

    def __init__(self, need_weights: bool, **kw):
        super().__init__()
        self.need_weights = need_weights
        self.mha = nn.MultiheadAttention(D, H, batch_first=True, **kw)

    def forward(self, x, kpm=None, attn_mask=None):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.mha(x, x, x, key_padding_mask=kpm, attn_mask=attn_mask, need_weights=self.need_weights)[0]


def _mha_masks(kind: str) -> list:
    pad = torch.zeros(B, N, dtype=torch.bool)
    pad[1, N - 3:] = True
    if kind == "none":
        return []
    if kind == "key_padding":
        return [pad]
    if kind == "causal":
        return [None, torch.ones(N, N, dtype=torch.bool).triu(1)]
    # float masks: summed in float32 as the functional sums them, then cast by autocast
    return [torch.zeros(B, N).masked_fill(pad, float("-inf")), rand(N, N, seed=11)]


def _mha_run(m: nn.Module, args: list, training: bool, compile_it: bool, dtype=torch.float32,
             weights: Optional[torch.dtype] = None) -> list:
    """Output, then the input's and every parameter's gradient (training) of `m` on clones of `args` in `dtype`
    (the weights in `weights`, or `dtype`)."""
    m = copy.deepcopy(m).to(weights or dtype)
    args = [a.detach().clone().to(dtype) if a is not None and a.is_floating_point() else a for a in args]
    x = args[0].requires_grad_(training)
    if compile_it:
        torch._dynamo.reset()
        m = torch.compile(m, backend="fa3", fullgraph=True)
    with torch.set_grad_enabled(training):
        out = m(*args)
    got = [out]
    if training:
        out.backward(rand(*out.shape, seed=99).to(out.dtype))
        got += [x.grad] + [p.grad for p in m.parameters()]
    return got


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("need_weights", [False, True], ids=["sdpa_path", "weights_path"])
@pytest.mark.parametrize("masks", ["none", "key_padding", "causal", "float"])
def test_multihead_attention_under_autocast_computes_in_its_dtype(masks, need_weights, training):
    torch.manual_seed(0)
    m = MHAUnderAutocast(need_weights).train(training)
    args = [rand(B, N, D, seed=7)] + _mha_masks(masks)
    got, eager = _mha_run(m, args, training, True), _mha_run(m, args, training, False)
    exact = _mha_run(m, args, training, False, torch.float64)  # autocast leaves float64 alone
    assert got[0].dtype == eager[0].dtype == torch.bfloat16
    for i, (a, e, r) in enumerate(zip(got, eager, exact)):
        # every element within bf16's tolerance of eager, or no farther from float64 than twice eager's worst
        # error over the tensor: eager rounds its scores to bf16 before the softmax (the weights path's baddbmm),
        # the fused op keeps them in float32
        assert a.dtype == e.dtype, i
        err, own = (a.double() - r).abs(), (e.double() - r).abs()
        bad = ((a.double() - e.double()).abs() > 2e-2 + 2e-2 * e.double().abs()) & (err > 2 * own.max())
        assert not bad.any(), f"value {i}: {int(bad.sum())} elements, worst {float(err[bad].max())}"
    (site,) = fa_compile.explain(m, *args).sites
    assert site.rewritten and site.dtype in ("torch.bfloat16", "bfloat16"), site


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_multihead_attention_under_autocast_with_activations_in_its_dtype(training):
    # bf16 activations and float32 weights: the output's dtype is the query's, and the weights are cast all the same
    torch.manual_seed(0)
    m = MHAUnderAutocast(False).train(training)
    args = [rand(B, N, D, seed=7, dtype=torch.bfloat16)] + _mha_masks("key_padding")
    got, eager = (_mha_run(m, args, training, c, torch.bfloat16, torch.float32) for c in (True, False))
    for i, (a, e) in enumerate(zip(got, eager)):
        torch.testing.assert_close(a, e, atol=2e-2, rtol=2e-2, msg=lambda msg, i=i: f"value {i}: {msg}")
    (site,) = fa_compile.explain(m, *args).sites
    assert site.rewritten, site


def test_multihead_attention_with_extra_keys_under_autocast():
    torch.manual_seed(0)
    m = MHAUnderAutocast(False, add_bias_kv=True, add_zero_attn=True)
    pad = torch.zeros(B, N, dtype=torch.bool)
    pad[0, :2] = True
    res = check(m, [rand(B, N, D, seed=7, requires_grad=True), pad], dtype=torch.bfloat16, rewritten=1)
    assert res.out.dtype == torch.bfloat16


# ------------------------------------------------------------------- torch.func transforms inside the graph

def _sdpa_loss(q, k, v, go):
    return (F.scaled_dot_product_attention(q, k, v, is_causal=True) * go).sum()


def _biased(q, k, v, bias):
    return torch.softmax(torch.einsum("bhqd,bhkd->bhqk", q, k) * 0.3 + bias, -1) @ v


@pytest.mark.parametrize("transform", ["grad", "vjp", "jvp"])
def test_a_torch_func_transform_inside_the_graph_leaves_it_as_traced(transform):
    # Dynamo traces torch.func.grad / vjp / jvp into the graph (its levels open and close there); the op has no
    # functorch rule, so such a graph is not rewritten, and the compiled program equals eager's.
    q, k, v, t = (torch.randn(2, 4, 7, 8, generator=torch.Generator().manual_seed(i)) for i in range(4))
    bias = torch.randn(7, 7, generator=torch.Generator().manual_seed(9))
    if transform == "grad":
        fn, args = torch.func.grad(_sdpa_loss, argnums=(0, 1, 2)), (q, k, v, t)
    elif transform == "vjp":
        def fn(q, k, v, go):
            _, pull = torch.func.vjp(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=True), q, k, v)
            return pull(go)
        args = (q, k, v, t)
    else:
        def fn(q, k, v, bias, t):
            return torch.func.jvp(lambda a, b, c: _biased(a, b, c, bias), (q, k, v), (t, t, t))
        args = (q, k, v, bias, t)
    want = fn(*args)
    torch._dynamo.reset()
    got = torch.compile(fn, backend="fa3", fullgraph=True)(*args)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=2e-6, rtol=2e-6)
    torch._dynamo.reset()
    (site,) = fa_compile.explain(fn, *args).sites
    assert not site.rewritten and "torch.func transform" in site.reason, site


@pytest.mark.parametrize("kw", [dict(causal=True), dict(bias="bias"), dict(kv_lens="lens")],
                         ids=["causal", "bias", "lens"])
def test_the_eager_op_under_torch_func_transforms(kw):
    # torch.func.grad / jvp / vmap of fa_compile.attention: the reference math (its torch ops have functorch rules),
    # equal to the op's own autograd gradient and output
    q, k, v, go = (torch.randn(2, 4, 7, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(i))
                   for i in range(4))
    extra = {"bias": torch.randn(7, 7, dtype=torch.float64), "lens": torch.tensor([0, 5])}
    kw = {name: extra.get(val, val) if isinstance(val, str) else val for name, val in kw.items()}

    def loss(q, k, v):
        return (fa_compile.attention(q, k, v, **kw) * go).sum()

    got = torch.func.grad(loss, argnums=(0, 1, 2))(q, k, v)
    a = [t.clone().requires_grad_() for t in (q, k, v)]
    want = torch.autograd.grad(loss(*a), a)
    for x, y in zip(got, want):
        torch.testing.assert_close(x, y, atol=1e-12, rtol=1e-12)
    out, tangent = torch.func.jvp(lambda q: fa_compile.attention(q, k, v, **kw), (q,), (go,))
    torch.testing.assert_close(out, fa_compile.attention(q, k, v, **kw), atol=1e-12, rtol=1e-12)
    eps = 1e-6
    fd = (fa_compile.attention(q + eps * go, k, v, **kw) - fa_compile.attention(q - eps * go, k, v, **kw)) / (2 * eps)
    torch.testing.assert_close(tangent, fd, atol=1e-6, rtol=1e-6)
    if "kv_lens" not in kw:  # per-sample lengths would need their own batch axis
        per = torch.vmap(lambda q, k, v: fa_compile.attention(q[None], k[None], v[None], **kw)[0])(q, k, v)
        torch.testing.assert_close(per, fa_compile.attention(q, k, v, **kw), atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("form", ["softmax", "sdpa"])
def test_a_site_inside_vmap_is_left_as_traced_with_its_reason(form):
    # vmap's batched values run only inside its own trace, so the pass cannot build the op's example values:
    # the site stays eager code, the compiled program equals eager's, and explain() says why in words
    def one(q, k, v):
        if form == "sdpa":
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return torch.softmax(q @ k.transpose(-1, -2) * 0.3, -1) @ v

    fn = torch.vmap(one)
    q, k, v = (torch.randn(3, 2, 5, 8, generator=torch.Generator().manual_seed(i), requires_grad=True)
               for i in range(3))
    want = fn(q, k, v)
    torch._dynamo.reset()
    got = torch.compile(fn, backend="fa3")(q, k, v)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=2e-6)
    gw = torch.autograd.grad(want.sum(), (q, k, v))
    gg = torch.autograd.grad(got.sum(), (q, k, v))
    for a, b in zip(gg, gw):
        torch.testing.assert_close(a, b, atol=2e-6, rtol=2e-6)
    torch._dynamo.reset()
    (site,) = fa_compile.explain(fn, q, k, v).sites
    assert not site.rewritten and site.reason.startswith("inside torch.vmap:"), site


# ------------------------------------------------------------------- the op and the scale under autocast

def test_the_op_under_autocast_casts_q_k_v_to_the_region_dtype_and_keeps_the_bias():
    import fa_compile.ops  # noqa: F401  (registers torch.ops.fa3)

    g = torch.Generator().manual_seed(3)
    q, k = torch.randn(2, 4, 6, 8, generator=g), torch.randn(2, 2, 6, 8, generator=g)  # GQA: 4 q heads, 2 k / v
    v = torch.randn(2, 2, 6, 8, generator=g).to(torch.bfloat16)
    bias = torch.zeros(2, 1, 6, 6)
    bias[1, :, 2] = torch.finfo(torch.float32).min  # a row masked entirely: -inf once cast to bf16
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, lse = torch.ops.fa3.attention(q, k, v, 0.3, bias=bias)
        out64, _ = torch.ops.fa3.attention(q.double(), k.double(), v.double(), 0.3, bias=bias)
    want, want_lse = torch.ops.fa3.attention(q.bfloat16(), k.bfloat16(), v, 0.3, bias=bias)
    assert out.dtype == torch.bfloat16 and out64.dtype == torch.float64  # autocast leaves fp64 alone
    torch.testing.assert_close(out, want, atol=0, rtol=0)
    torch.testing.assert_close(lse, want_lse, atol=0, rtol=0)
    assert out.isfinite().all() and lse.isfinite().all()
    # a gradient flows back through the casts to the fp32 leaves
    ql, kl = q.clone().requires_grad_(), k.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        o, _ = torch.ops.fa3.attention(ql, kl, v, 0.3, bias=bias)
    o.float().sum().backward()
    assert ql.grad.dtype == torch.float32 and ql.grad.abs().sum() > 0


def _scaled_before_autocast_product(q, k, v):
    with torch.autocast("cpu", dtype=torch.float16, enabled=q.dtype != torch.float64):
        s = (q * 1e-5) @ (k * 2.0).mT  # the multiplies in fp32, the product casts its operands to fp16
        return torch.softmax(s, -1) @ v


def test_a_scale_before_an_autocast_product_is_not_moved_into_the_op():
    # q ~ 1e5 leaves fp16's range unscaled: moved into the op's scale, the factor would apply after autocast's cast
    g = torch.Generator().manual_seed(4)
    q = (torch.randn(2, 2, 8, 8, generator=g) * 1e5).requires_grad_()
    k, v = (torch.randn(2, 2, 8, 8, generator=g).requires_grad_() for _ in range(2))
    res = check(_scaled_before_autocast_product, [q, k, v], dtype=torch.float16, rewritten=1)
    assert res.out.isfinite().all()


# ------------------------------------------------------------------- masks whose gradient is cut, in the fused forms

def _tri():
    return torch.ones(N, N, dtype=torch.bool).tril()


DETACHED_MASKS = {
    "detach": lambda m, q, k: m.detach(),
    "view_detach": lambda m, q, k: m.view(1, H, N, N).detach(),
    "detach_expand": lambda m, q, k: m.detach()[None].expand(B, H, N, N),
    "detach_clone": lambda m, q, k: m.detach().clone(),
    "where_detach": lambda m, q, k: torch.where(_tri(), m, float("-inf")).detach(),
    "scores_detach": lambda m, q, k: (q @ k.mT * 0.2).detach(),
}


def _no_grad_mask(m, q, k):
    with torch.no_grad():
        return m.expand(B, H, N, N)


DETACHED_MASKS["no_grad_expand"] = _no_grad_mask


@pytest.mark.parametrize("make", list(DETACHED_MASKS), ids=list(DETACHED_MASKS))
def test_sdpa_mask_with_a_cut_gradient_gets_none(make):
    # the mask analysis reads through the cut to a tensor that needs a gradient: the op's bias must not carry one
    def fn(q, k, v, m):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=DETACHED_MASKS[make](m, q, k))

    m = rand(H, N, N, seed=7, requires_grad=True)
    check(fn, qkv() + [m], rewritten=1)


def test_sdpa_mask_needing_a_gradient_with_a_cut_inside():
    # b1 + a causal mask built from b2.detach(): b1 gets its gradient, b2 none
    def fn(q, k, v, b1, b2):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=b1 + torch.where(_tri(), b2, float("-inf")).detach())

    check(fn, qkv() + [rand(H, N, N, seed=8, requires_grad=True), rand(H, N, N, seed=9, requires_grad=True)],
          rewritten=1)


class MHADetachedMask(nn.Module):
    def __init__(self):
        super().__init__()
        self.mha = nn.MultiheadAttention(D * H, H, batch_first=True)
        self.bias = nn.Parameter(torch.randn(N, N))

    def forward(self, x):
        return self.mha(x, x, x, attn_mask=self.bias.detach(), need_weights=False)[0]


def test_multihead_attention_with_a_detached_mask_parameter():
    torch.manual_seed(0)
    check(MHADetachedMask(), [rand(B, N, D * H, seed=3, requires_grad=True)], rewritten=1)


def test_regions_read_which_values_carry_a_gradient_from_the_graph():
    # Dynamo's example value of a view made under no_grad still says requires_grad: the graph's markers decide
    from fa_compile.patterns.regions import Regions

    def f(x, y):
        b = x * 2
        a = b + 1
        c = a + b  # reaches b twice: every input is read before its user
        with torch.no_grad():
            d = c.expand(2, 3)
        e = d.detach() + y
        g = c.detach() * b
        return c, d, e, g

    got: dict = {}

    def backend(gm, example_inputs):
        regions, memo = Regions(gm), {}
        for n in gm.graph.nodes:
            if n.op in ("call_function", "call_method") and isinstance(n.meta.get("example_value"), torch.Tensor):
                got[n.name] = regions.carries_grad(n, memo)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(f, backend=backend)(rand(3, requires_grad=True), rand(3))
    torch._dynamo.reset()
    assert got == {"b": True, "a": True, "c": True, "d": False, "detach": False, "e": False, "detach_1": False,
                   "g": True}, got


class MHALearnedAndDetachedMasks(nn.Module):
    """A learned attn_mask beside a float key_padding_mask computed from a detached parameter: the mask analysis
    combines the two terms, and only the first may pass a gradient."""

    def __init__(self):
        super().__init__()
        self.mha = nn.MultiheadAttention(D * H, H, batch_first=True)
        self.bias = nn.Parameter(torch.randn(N, N) * 0.1)
        self.pad = nn.Parameter(torch.randn(B, N))

    def forward(self, x):
        return self.mha(x, x, x, attn_mask=self.bias, key_padding_mask=self.pad.detach().view(B, N), need_weights=False)[0]


def test_multihead_attention_with_a_learned_mask_and_a_detached_one():
    torch.manual_seed(0)
    check(MHALearnedAndDetachedMasks(), [rand(B, N, D * H, seed=3, requires_grad=True)], rewritten=1)
