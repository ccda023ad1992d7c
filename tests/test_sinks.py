"""Attention sinks: the op's `sinks` argument (reference forward and backward, argument checks, dispatch
refusals) and the recognition of GPT-OSS's sink column (patterns/sinks.py), against eager on CPU."""
from __future__ import annotations

import math
from typing import Optional

import expecttest

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fa_compile
from eager_diff import check, rand
from fa_compile import dispatch
from fa_compile.kernels import reference as ref

B, H, HKV, N, D = 2, 4, 2, 7, 8


def eager_sinks(q, k, v, sinks, mask=None, shift=True, scale=None, with_lse=False):
    """GPT-OSS's eager attention: the sink as a last score column, dropped after the softmax."""
    scale = scale if scale is not None else q.shape[-1] ** -0.5
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = q @ k.transpose(-1, -2) * scale
    if mask is not None:
        s = s + mask
    col = sinks.reshape(1, -1, 1, 1).expand(q.shape[0], -1, q.shape[-2], -1)
    c = torch.cat([s, col], dim=-1)
    if shift:
        c = c - c.max(dim=-1, keepdim=True).values
    p = F.softmax(c, dim=-1, dtype=c.dtype)
    out = p[..., :-1] @ v
    return (out, torch.logsumexp(torch.cat([s, col], dim=-1), dim=-1)) if with_lse else out


def _inputs(dtype=torch.float64, nq=N, nk=N):
    q = rand(B, H, nq, D, dtype=dtype, seed=1, requires_grad=True)
    k = rand(B, HKV, nk, D, dtype=dtype, seed=2, requires_grad=True)
    v = rand(B, HKV, nk, D, dtype=dtype, seed=3, requires_grad=True)
    s = (rand(H, dtype=dtype, seed=4) * 2).requires_grad_(True)
    return q, k, v, s


# ------------------------------------------------------------------------------------------------ the op

@pytest.mark.parametrize("causal", [False, True])
def test_op_matches_the_sink_column_outputs_lse_and_gradients(causal):
    q, k, v, s = _inputs()
    mask = None
    if causal:
        mask = torch.full((N, N), float("-inf"), dtype=q.dtype).triu(1)
    want_o, want_l = eager_sinks(q, k, v, s, mask, with_lse=True)
    got_o, got_l = fa_compile.attention(q, k, v, causal=causal, sinks=s, return_lse=True)
    torch.testing.assert_close(got_o, want_o, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(got_l.double(), want_l, atol=1e-6, rtol=1e-6)  # the op's lse is fp32
    go, gl = rand(*want_o.shape, dtype=q.dtype, seed=5), rand(*want_l.shape, dtype=q.dtype, seed=6)
    want = torch.autograd.grad((want_o * go).sum() + (want_l * gl).sum(), (q, k, v, s))
    got = torch.autograd.grad((got_o * go).sum() + (got_l * gl).sum(), (q, k, v, s))
    for name, a, b in zip(("dq", "dk", "dv", "dsinks"), got, want):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def test_sink_gradient_formula_matches_autograd_of_the_reference():
    q, k, v, s = _inputs(torch.float32)
    out, lse = ref.attention_reference(q, k, v, scale=D ** -0.5, causal=True, diag_offset=-2, sinks=s)
    dout = rand(*out.shape, seed=7)
    (want,) = torch.autograd.grad(out, s, dout)
    got = ref.sink_grad_reference(s.detach(), lse.detach(), dout, out.detach())
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_rows_without_keys_attend_to_the_sink():
    # diag_offset -3: the first 3 rows admit no key; the sink takes them: out 0, lse = sink, finite grads.
    q, k, v, s = _inputs()
    out, lse = torch.ops.fa3.attention(q, k, v, D ** -0.5, True, -3, -1, -1, None, None, 0.0, 0.0, None, None, s)
    assert (out[:, :, :3] == 0).all()
    torch.testing.assert_close(lse[:, :, :3], s.detach().float().view(1, H, 1).expand(B, H, 3))
    want_o = eager_sinks(q, k, v, s, _offset_mask(N, N, -3, q.dtype))
    torch.testing.assert_close(out, want_o, atol=1e-10, rtol=1e-10)
    grads = torch.autograd.grad(out.sum(), (q, k, v, s))
    want = torch.autograd.grad(want_o.sum(), (q, k, v, s))
    for a, b in zip(grads, want):  # d sinks reads the op's fp32 lse: fp32 precision
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def _offset_mask(nq: int, nk: int, off: int, dtype) -> torch.Tensor:
    i = torch.arange(nq).view(-1, 1)
    j = torch.arange(nk).view(1, -1)
    return torch.zeros(nq, nk, dtype=dtype).masked_fill(j - i > off, float("-inf"))


def test_no_keys_at_all_gives_the_sink():
    q = torch.randn(1, 2, 3, 4)
    k = v = torch.randn(1, 2, 0, 4)
    s = torch.tensor([0.5, -2.0])
    out, lse = fa_compile.attention(q, k, v, sinks=s, return_lse=True)
    assert out.shape == (1, 2, 3, 4) and (out == 0).all()
    assert torch.equal(lse, s.view(1, 2, 1).expand(1, 2, 3))


@pytest.mark.parametrize("bad,msg", [
    (torch.zeros(3), r"sinks: expected shape \[Hq\] = \[4\]"),
    (torch.zeros(1, 4), r"sinks: expected shape \[Hq\]"),
    (torch.zeros(4, dtype=torch.int64), "sinks: dtype torch.int64 is not a floating type"),
    (torch.zeros(4, device="meta"), "sinks: must be on q's device"),
    ([0.0] * 4, "sinks: expected a Tensor or None"),
])
def test_sinks_argument_errors_name_the_argument(bad, msg):
    q = torch.randn(1, 4, 3, 8)
    with pytest.raises((ValueError, TypeError), match=msg):
        fa_compile.attention(q, q, q, sinks=bad)


def test_calls_without_sinks_keep_their_schema():
    # The new argument is last and optional: a call written before it means the same.
    schema = torch.ops.fa3.attention.default._schema
    names = [a.name for a in schema.arguments]
    assert names[names.index("force_kernel"):] == ["force_kernel", "sinks", "q_pos", "q_seg", "k_seg"]
    bnames = [a.name for a in torch.ops.fa3.attention_backward.default._schema.arguments]
    assert bnames[bnames.index("sinks"):] == ["sinks", "q_pos", "q_seg", "k_seg"]
    q = torch.randn(1, 2, 3, 8)
    a = torch.ops.fa3.attention(q, q, q, 0.3, False, 0, -1, -1, None, None, 0.0, 0.0, None, None)
    b = torch.ops.fa3.attention(q, q, q, 0.3, False, 0, -1, -1, None, None, 0.0, 0.0, None, None, None)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_peers_without_sinks_refuse_them():
    from fa_compile.candidates import common

    q = torch.empty(1, 2, 3, 8)
    args = dispatch.AttentionArgs(q, q, q, 0.3, sinks=torch.zeros(2))
    assert any("attention sinks" in r for r in common.common_feature_reasons(args, "X"))
    assert common.common_feature_reasons(dispatch.AttentionArgs(q, q, q, 0.3), "X") == []
    assert common.common_feature_reasons(args, "X", sinks=True) == []


def test_lowering_keeps_the_op_with_sinks():
    from fa_compile.lowering import choice

    q = torch.empty(1, 2, 160, 8)  # past the decode-step math's sizes: aten's CPU flash kernel takes no sinks
    d = choice.decide(dispatch.AttentionArgs(q, q, q, 0.3, sinks=torch.zeros(2)), None, "forward", measure=False)
    assert not d.lowered and "sinks" in d.reason
    q = torch.empty(1, 2, 3, 8)  # a decode-sized inference site: the math takes the sinks
    d = choice.decide(dispatch.AttentionArgs(q, q, q, 0.3, sinks=torch.zeros(2)), None, "forward", measure=False)
    assert d.kernel == "decode_math" and d.lowered, str(d)


# --------------------------------------------------------------------------------------- recognition

class GptOssAttention(nn.Module):
    """The core of GPT-OSS's eager attention: a learned sink per head as a dropped score column."""

    def __init__(self, heads: int = H, shift: bool = True):
        super().__init__()
        self.sinks = nn.Parameter(torch.randn(heads, generator=torch.Generator().manual_seed(11)))
        self.shift = shift

    def forward(self, q, k, v, mask=None):
        return eager_sinks(q, k, v, self.sinks, mask, shift=self.shift)


@pytest.mark.parametrize("shift", [True, False], ids=["max_shift", "no_shift"])
def test_gpt_oss_sink_column_is_rewritten(shift):
    q, k, v, _ = _inputs(torch.float32)
    res = check(GptOssAttention(shift=shift), [q, k, v], rewritten=1)
    assert res.rewritten[0].call.args[-1] is not None  # the op got the sinks


def test_gpt_oss_sink_column_under_dynamic_shapes():
    from conftest import Compiled

    m = GptOssAttention()
    c = Compiled(m, inner="aot_eager", dynamic=True)
    for n in (7, 9):
        q, k, v, _ = _inputs(torch.float32, nq=n, nk=n)
        torch.testing.assert_close(c(q, k, v), m(q, k, v), atol=2e-5, rtol=2e-5)
    assert c.reports and all(r.rewritten for r in c.reports), [r.reason for r in c.reports]


class CacheWriteAfter(GptOssAttention):
    """The attention over a cache that the same graph writes into afterwards (a static cache's next write)."""

    def forward(self, q, k, v, mask=None):
        out = eager_sinks(q, k, v, self.sinks, mask)
        k.add_(1.0)
        return out


def test_cache_written_after_the_site_under_no_grad():
    # The sink parameter keeps requires_grad under no_grad, yet no backward is recorded there, so nothing the op
    # would save is overwritten: the site is rewritten (generate() with a static cache). With a gradient wanted,
    # the op reads and saves the repeated copy of k, which the write does not reach (tests/test_caller_writes.py
    # covers the refusal where the op would save the written tensor itself).
    from conftest import Compiled

    q, k, v, _ = _inputs(torch.float32)
    m = CacheWriteAfter()
    k_ref, k_got = k.detach().clone(), k.detach().clone()
    with torch.no_grad():
        want = m(q.detach(), k_ref, v.detach())
        c = Compiled(m, inner="aot_eager")
        got = c(q.detach(), k_got, v.detach())
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(k_got, k_ref)
    assert [r.rewritten for r in c.reports] == [True], [r.reason for r in c.reports]
    # GQA: the repeated copy is what the op reads and saves (its source is written after it, so the repeat is kept)
    res = check(CacheWriteAfter(), [q, k.detach(), v], rewritten=1)
    assert res.rewritten[0].gqa is None, res.rewritten[0].gqa


def test_gpt_oss_sink_column_with_an_additive_causal_mask():
    # HF's additive finfo.min causal mask, rows fully masked included (a negative offset): the sink takes them.
    q, k, v, _ = _inputs(torch.float32)
    i, j = torch.arange(N).view(-1, 1), torch.arange(N).view(1, -1)
    mask = torch.zeros(N, N).masked_fill(j - i > -2, torch.finfo(torch.float32).min)
    check(GptOssAttention(), [q, k, v, mask], rewritten=1)


def _sink_column_with_key_padding(additive: bool):
    def f(q, k, v, s, keep):
        sc = q @ k.transpose(-1, -2) * D ** -0.5
        lo = torch.finfo(sc.dtype).min
        if additive:
            sc = sc + torch.zeros(B, 1, 1, N, dtype=sc.dtype).masked_fill(~keep[:, None, None, :], lo)
        else:
            sc = sc.masked_fill(~keep[:, None, None, :], lo)
        c = torch.cat([sc, s.reshape(1, H, 1, 1).expand(B, H, N, 1)], -1)
        p = torch.softmax(c - c.max(-1, keepdim=True).values, -1)[..., :-1]
        return p @ v

    return f


@pytest.mark.parametrize("additive", [False, True], ids=["masked_fill", "additive"])
def test_a_sink_of_minus_inf_leaves_a_fully_masked_row_to_the_finite_fill(additive):
    # A head whose sink is -inf has no sink: on a row whose keys are all finfo.min, eager weighs them alike (the mean
    # of V), where a finite sink would take the row (0). Both kinds of heads in one call, outputs and gradients.
    q, k, v = (rand(B, H, N, D, seed=i, requires_grad=True) for i in (1, 2, 3))
    s = torch.tensor([float("-inf"), 0.0, 1.5, float("-inf")], requires_grad=True)
    keep = torch.ones(B, N, dtype=torch.bool)
    keep[0, 4:] = False
    keep[1] = False  # every key of the second sequence padded
    check(_sink_column_with_key_padding(additive), [q, k, v, s, keep], rewritten=1)


class CastColumn(nn.Module):
    """A sink column cast after its expand (`.to(scores.dtype)`, or a rounding round trip): the casts
    move to the logits, so the op sees the values eager's softmax sees."""

    def __init__(self, casts: tuple):
        super().__init__()
        self.sinks = nn.Parameter(torch.randn(H, generator=torch.Generator().manual_seed(5)) * 3)
        self.casts = casts

    def forward(self, q, k, v):
        s = q @ k.repeat_interleave(2, 1).transpose(-1, -2) * q.shape[-1] ** -0.5
        col = self.sinks.reshape(1, -1, 1, 1).expand(q.shape[0], -1, q.shape[-2], -1)
        for dt in self.casts:
            col = col.to(dt)
        p = torch.softmax(torch.cat([s, col], -1), -1)[..., :-1]
        return p @ v.repeat_interleave(2, 1)


@pytest.mark.parametrize("casts", [(torch.float64,), (torch.float32, torch.float64), (torch.float16, torch.float64)],
                         ids=["to_dtype", "round_trip_fp32", "round_trip_fp16"])
def test_sink_column_cast_after_its_expand(casts):
    q, k, v, _ = _inputs(torch.float64)
    m = CastColumn(casts).double()
    if torch.float16 in casts:
        m.sinks.requires_grad_(False)
    # With the fp16 round trip eager rounds each row's sink gradient to fp16 before the expand's sum (the
    # rewrite rounds the sum): the sinks are frozen there, q, k and v's gradients still compared; outputs to fp64 rounding,
    # which only holds if the round trip is kept (dropped, the fp16 rounding of the logits shows: ~5e-4).
    res = check(m, [q, k, v], rewritten=1)
    assert res.rewritten[0].call.args[-1] is not None
    from conftest import Compiled

    out = Compiled(m, inner="aot_eager")(q, k, v)
    torch.testing.assert_close(out, m(q, k, v), atol=1e-12, rtol=1e-12)


class SinkFirst(nn.Module):
    """The sink column concatenated before the scores and dropped as [..., 1:] (`wrong_drop`: the last column dropped
    instead, which leaves the sink's weight in P·V and drops a key's: not a sink)."""

    def __init__(self, wrong_drop: bool = False):
        super().__init__()
        self.sinks = nn.Parameter(torch.randn(H, generator=torch.Generator().manual_seed(12)))
        self.wrong_drop = wrong_drop

    def forward(self, q, k, v):
        k, v = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
        s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
        col = self.sinks.view(1, -1, 1, 1).expand(q.shape[0], -1, q.shape[2], 1)
        p = torch.softmax(torch.cat([col, s], -1), -1)
        return (p[..., :-1] if self.wrong_drop else p[..., 1:]) @ v


def test_sink_column_before_the_scores():
    # refused before: "scores are not a Q·Kᵀ contraction (reached cat)"
    q, k, v, _ = _inputs(torch.float32)
    res = check(SinkFirst(), [q, k, v], rewritten=1)
    assert res.rewritten[0].call.args[-1] is not None
    check(SinkFirst(wrong_drop=True), [q, k, v], rewritten=0)


@pytest.mark.parametrize("column", ["new_zeros", "zeros_first", "full_zero", "full_one"])
def test_a_column_of_zeros_is_a_sink_of_zero_for_every_head(column):
    # softmax1 ("quiet" attention): 1 added to every row's denominator; a column of ones is no such constant
    # logit the pass reads, and is left alone
    def f(q, k, v):
        s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
        s = s.masked_fill(torch.ones(N, N, dtype=torch.bool).triu(1), float("-inf"))
        if column == "zeros_first":
            return torch.softmax(torch.cat([torch.zeros(B, H, N, 1), s], -1), -1)[..., 1:] @ v
        col = s.new_zeros(B, H, N, 1) if column == "new_zeros" else torch.full((B, H, N, 1), float(column == "full_one"))
        return torch.softmax(torch.cat([s, col], -1), -1)[..., :-1] @ v

    q, k, v = (rand(B, H, N, D, seed=i, requires_grad=True) for i in range(3))
    res = check(f, [q, k, v], rewritten=0 if column == "full_one" else 1)
    if column != "full_one":
        assert res.rewritten[0].call.args[-1] is not None


@pytest.mark.parametrize("write", ["setitem", "add_"])
def test_a_column_of_zeros_written_in_place_is_not_a_sink_of_zero(write):
    def f(q, k, v):
        s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
        z = s.new_zeros(B, H, N, 1)
        if write == "setitem":
            z[1] = 5.0
        else:
            z[:, :, 2:].add_(3.0)
        return torch.softmax(torch.cat([s, z], -1), -1)[..., :-1] @ v

    check(f, [rand(B, H, N, D, seed=i, requires_grad=True) for i in range(3)], rewritten=0)


@pytest.mark.parametrize("decompose", [False, True])
def test_exported_column_of_zeros_is_a_sink(decompose):
    # torch.export writes the drop of the column as aten.slice(p, 3, 0, -1), and new_zeros / cat as overloads
    import warnings

    class Quiet(nn.Module):
        def forward(self, q, k, v):
            s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
            return torch.softmax(torch.cat([s, s.new_zeros(B, H, N, 1)], -1), -1)[..., :-1] @ v

    args = [rand(B, H, N, D, seed=i, requires_grad=True) for i in range(3)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ep = torch.export.export(Quiet(), tuple(a.detach() for a in args))
        m = (ep.run_decompositions() if decompose else ep).module()
    check(m, args, rewritten=1)


def test_sink_column_that_varies_per_query_is_not_a_sink():
    class PerQuery(nn.Module):
        def forward(self, q, k, v):
            s = q @ k.repeat_interleave(2, 1).transpose(-1, -2)
            col = s.mean(-1, keepdim=True)  # a data-dependent column, not a per-head constant
            p = torch.softmax(torch.cat([s, col], -1), -1)[..., :-1]
            return p @ v.repeat_interleave(2, 1)

    q, k, v, _ = _inputs(torch.float32)
    res = check(PerQuery(), [q, k, v])
    assert not res.rewritten


def test_sink_tokens_are_ordinary_keys():
    # StreamingLLM: a few sink tokens concatenated before a window of keys, a window mask on the rest.
    def streaming(q, k, v, k_sink, v_sink):
        kk, vv = torch.cat([k_sink, k], 2), torch.cat([v_sink, v], 2)
        s = q @ kk.transpose(-1, -2) / math.sqrt(D)
        i = torch.arange(q.shape[2]).view(-1, 1)
        j = torch.arange(kk.shape[2]).view(1, -1) - k_sink.shape[2]
        keep = (j < 0) | ((j <= i) & (j > i - 3))
        s = s.masked_fill(~keep, float("-inf"))
        return torch.softmax(s, -1) @ vv

    q = rand(B, H, N, D, seed=1, requires_grad=True)
    k, v = rand(B, H, N, D, seed=2, requires_grad=True), rand(B, H, N, D, seed=3, requires_grad=True)
    ks, vs = rand(B, H, 2, D, seed=4, requires_grad=True), rand(B, H, 2, D, seed=5, requires_grad=True)
    check(streaming, [q, k, v, ks, vs], rewritten=1)


class TestPinnedSinkGraph(expecttest.TestCase):
    def test_pinned_gpt_oss_sink_column(self):
        from test_patterns_softmax import pinned

        q, k, v, _ = _inputs(torch.float32)
        self.assertExpectedInline(pinned(GptOssAttention(), q.detach(), k.detach(), v.detach()), """\
reshape(l_self_parameters_sinks_, (-1,))
fa3.attention(l_q_, l_k_, l_v_, 0.3535533905932738, False, 0, -1, -1, None, None, 0.0, 0.0, None, None, reshape_1)
getitem(attention_default, 0)
clone(getitem_3)""")


class _LastHidden(nn.Module):
    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(ids).last_hidden_state


def test_hf_gpt_oss_sites_rewritten_with_sinks_and_train():
    # A tiny GPT-OSS (eager attention): a sliding-window and a full layer, each with learned sinks; every
    # attention site is rewritten (the MoE router's softmax is no attention), outputs and every parameter's
    # gradient (the sinks included) equal to eager.
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GptOssConfig(
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8, hidden_size=32,
        intermediate_size=32, vocab_size=50, num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
        max_position_embeddings=64, attn_implementation="eager", layer_types=["sliding_attention", "full_attention"],
        # Batched-mm experts: the grouped-mm experts' backward does not compile on CUDA under
        # every transformers version (a data-dependent guard), and this test is about the attention.
        experts_implementation="batched_mm")
    torch.manual_seed(0)
    model = transformers.GptOssModel(cfg)
    with torch.no_grad():
        for layer in model.layers:
            layer.self_attn.sinks.normal_()  # initialised to 0: random logits exercise them
    model.train()
    res = check(_LastHidden(model), [torch.randint(0, 50, (2, 8))])
    attention = [r for r in res.reports if r.rewritten]
    assert len(attention) == 2, res.reasons
    assert sorted(r.mask for r in attention) == ["causal", "window"]
    assert all(r.call.args[-1] is not None for r in attention)


# --------------------------------------------------------------------------------------- sinks as an output gate

class GateSinkAttention(nn.Module):
    """GraniteSWA's eager attention: the sink as a gate sigmoid(logsumexp(S) - sink) on the P·V product. fill: a
    causal mask with a negative offset (so some rows have no admissible key) built in the graph with that value."""

    def __init__(self, fill: Optional[float] = None, shift_inside: bool = False, gate_other: bool = False,
                 axis: str = "unsqueeze"):
        super().__init__()
        self.sinks = nn.Parameter(torch.randn(H, generator=torch.Generator().manual_seed(13)))
        self.fill, self.shift_inside, self.gate_other, self.axis = fill, shift_inside, gate_other, axis

    def forward(self, q, k, v):
        g = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
        s = q @ k.transpose(2, 3) * q.shape[-1] ** -0.5
        if self.fill is not None:
            i, j = torch.arange(N).view(-1, 1), torch.arange(N).view(1, -1)
            s = s + torch.zeros(N, N).masked_fill(j - i > -2, self.fill)
        lse = torch.logsumexp(s, dim=-1)
        gate = (lse - self.sinks.view(1, -1, 1)).to(torch.float32).sigmoid()
        if self.shift_inside:
            s = s + 1.5  # softmax ignores it, the gate's logsumexp does not
        out = F.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype) @ v
        if self.gate_other:
            out = out + 0.0  # the gate then multiplies another tensor than the product
        if self.axis == "index":
            gate = gate[..., None]
        elif self.axis == "slices":
            gate = gate[:, :, :, None]
        elif self.axis == "view":
            gate = gate.view(*gate.shape, 1)
        else:
            gate = gate.unsqueeze(-1)
        return out * gate.to(out.dtype)


@pytest.mark.parametrize("axis", ["index", "slices", "view"])
def test_sink_gate_spellings_of_its_trailing_axis(axis):
    # `[..., None]` (the form GraniteSWA-style code also takes) was refused: "the scores are also used outside"
    q, k, v, _ = _inputs(torch.float32)
    check(GateSinkAttention(axis=axis), [q, k, v], rewritten=1)


def test_sink_gate_is_the_ops_sinks():
    # the gate's value and gradients (q, k, v and the sink parameter) against eager, also with HF's additive
    # finfo.min causal mask whose fully masked rows (a negative offset) eager gates to 0, as the op's sink does
    q, k, v, _ = _inputs(torch.float32)
    res = check(GateSinkAttention(), [q, k, v], rewritten=1)
    assert res.rewritten[0].call.args[-1] is not None  # the op got the sinks
    check(GateSinkAttention(fill=torch.finfo(torch.float32).min), [q, k, v], rewritten=1)


def test_sink_gate_refusals():
    q, k, v, _ = _inputs(torch.float32)
    # -inf on fully masked rows: eager's softmax is NaN there and NaN times the gate stays NaN
    res = check(GateSinkAttention(fill=float("-inf")), [q, k, v], rewritten=0)
    assert any("sink gate" in r for r in res.reasons), res.reasons
    check(GateSinkAttention(shift_inside=True), [q, k, v], rewritten=0)
    check(GateSinkAttention(gate_other=True), [q, k, v], rewritten=0)
