"""Finite fills keep eager's meaning on every row: masked_fill / where with a finite c (-1e4, -1e9,
Megatron's fp16 -10000.0, -10) and additive finite masks ((1 - m) * -10000.0), with logits large
enough that a row's admissible scores lie below the fill (eager then weighs the masked keys) and with
normal logits; outputs and gradients of q, k, v against eager, every element, through the whole
pass and AOTAutograd. -inf and finfo.min fills stay structure with no fix-up and one backward call.

Scores are built exactly representable (integer multiples of `unit`, a constant key dimension carries
a per-row offset) so that eager and the op see the same scores in every dtype: the comparison then
tests the masking semantics, not the rounding of scores near 1e4.
"""
from __future__ import annotations

import math
from typing import Callable, Optional

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.backends.common import aot_autograd

from conftest import TOL, Compiled

TOLS = {**TOL, torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2)}
B, H, N, D = 2, 2, 8, 4
NEG_INF = float("-inf")


def crossing_qkv(dtype: torch.dtype, fill: float, *, unit: float = 1.0, nq: int = N, nk: int = N, hkv: int = H,
                 seed: int = 0, near: bool = True, key_offsets: Optional[torch.Tensor] = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v (leaves needing grad) whose score rows sit near the fill, far below it, near 0, or above it.

    s_ij = offset_i + unit * (small integer): key dimension 0 is 1, query dimension 0 the row offset;
    the other dimensions are integers in [-2, 2] (times sqrt(unit) each side). near=False leaves out
    the rows within a few units of the fill, where a band's fix-up reads the op's fp32 lse (rounded to
    half an ulp of |fill|, see emit._finite_fill). key_offsets [Nk]: the offset is per key instead
    (s_ij = key_offsets[j] + ...), for additive masks whose masked s + c must outweigh the rest."""
    g = torch.Generator().manual_seed(seed)
    r = math.sqrt(unit)
    qv = torch.randint(-2, 3, (B, H, nq, D - 1), generator=g).double().mul(r).to(dtype).requires_grad_()
    kv = torch.randint(-2, 3, (B, hkv, nk, D - 1), generator=g).double().mul(r).to(dtype).requires_grad_()
    v = torch.randn(B, hkv, nk, D, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    offsets = torch.tensor([fill - 3 * unit, fill - 40 * unit, 0.0, fill + unit])  # near, far below, normal, above
    if not near:
        offsets = torch.tensor([fill - 40 * unit, 0.0, fill * 2, fill + 40 * unit])
    q0 = offsets.repeat(nq)[:nq].view(1, 1, nq, 1).expand(B, H, nq, 1).to(dtype)
    k0 = torch.ones(B, hkv, nk, 1, dtype=dtype)
    if key_offsets is not None:
        q0, k0 = torch.ones(B, H, nq, 1, dtype=dtype), key_offsets.view(1, 1, nk, 1).expand(B, hkv, nk, 1).to(dtype)
    # the offset column is a constant: its gradient (|offset| times dS) would swamp the comparison
    q, k = torch.cat([q0, qv], -1), torch.cat([k0, kv], -1)
    _LEAVES[id(q)], _LEAVES[id(k)] = (q, qv), (k, kv)
    return q, k, v


_LEAVES: dict = {}  # id(q or k from crossing_qkv) -> (that tensor, the leaf of its variable columns)


def _leaf(a: torch.Tensor) -> torch.Tensor:
    entry = _LEAVES.get(id(a))
    return entry[1] if entry is not None and entry[0] is a else a


def grad_backend(counts: list) -> Callable:
    """The fa3 pass, then AOTAutograd; records the fa3.attention_backward calls of each backward graph."""
    from fa_compile.compiler import run_pass

    def bw(gm, _):
        counts.append(sum(n.target is torch.ops.fa3.attention_backward.default for n in gm.graph.nodes))
        return gm.forward

    inner = aot_autograd(fw_compiler=lambda gm, _: gm.forward, bw_compiler=bw)

    def backend(gm, example_inputs):
        run_pass(gm)
        return inner(gm, example_inputs)

    return backend


def check(fn: Callable, *args, dtype: torch.dtype, kind: Optional[str]) -> Compiled:
    """Outputs and gradients of the compiled fn (fa3 pass + AOTAutograd) against eager; kind None: the
    site must be left alone (and still give eager's numbers)."""
    c = Compiled(fn, inner="aot_eager")
    out = c(*args)
    ref = fn(*args)
    if kind is None:
        assert not c.rewritten, [(r.mask, r.reason) for r in c.reports]
    else:
        assert [r.mask for r in c.reports] == [kind] and c.rewritten, [(r.mask, r.reason) for r in c.reports]
    torch.testing.assert_close(out, ref, **TOLS[dtype])
    leaves = [_leaf(a) for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    dout = torch.randn(ref.shape, generator=torch.Generator().manual_seed(7)).to(dtype)
    got = torch.autograd.grad(out, leaves, dout)
    want = torch.autograd.grad(ref, leaves, dout)
    for i, (a, b) in enumerate(zip(got, want)):
        torch.testing.assert_close(a, b, **TOLS[dtype], msg=lambda m: f"gradient {i}: {m}")
    return c


def assert_fill_matters(make: Callable, fill: float, *args, as_inf: Optional[Callable] = None) -> None:
    """The inputs cross the fill: eager's result differs from the same mask with -inf (`as_inf`, else
    make(-inf)) on rows that admit a key (rows that admit none are NaN with -inf)."""
    with torch.no_grad():
        a, b = make(fill)(*args).float(), (as_inf or make(NEG_INF))(*args).float()
    assert (((a - b).abs() > 0.1) & ~b.isnan()).any()


# ----------------------------------------------------------------------------- spellings

def causal_fill(c):
    def fn(q, k, v):
        n = q.shape[-2]
        return (q @ k.transpose(-2, -1)).masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), c).softmax(-1) @ v
    return fn


def causal_fill_inplace(c):
    def fn(q, k, v):
        n = q.shape[-2]
        s = q @ k.transpose(-2, -1)
        s.masked_fill_(torch.ones(n, n, dtype=torch.bool).triu(1), c)
        return F.softmax(s, dim=-1) @ v
    return fn


def causal_where(c):
    def fn(q, k, v):
        n = q.shape[-2]
        keep = torch.arange(n)[:, None] >= torch.arange(n)[None, :]
        return torch.where(keep, q @ k.transpose(-2, -1), c).softmax(-1) @ v
    return fn


def window_fill(c):
    def fn(q, k, v):
        n = q.shape[-2]
        i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
        return (q @ k.transpose(-2, -1)).masked_fill((j > i) | (i - j > 2), c).softmax(-1) @ v
    return fn


def offset_fill(c):
    """tril(-1): row 0 admits no key (eager: the mean of V)."""
    def fn(q, k, v):
        n = q.shape[-2]
        return (q @ k.transpose(-2, -1)).masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(-1), c).softmax(-1) @ v
    return fn


# masked_fill_ on scores nothing else aliases is read as the functional masked_fill
SPELLINGS = [(causal_fill, "causal"), (causal_fill_inplace, "causal"), (causal_where, "causal"),
             (window_fill, "bool-mask"), (offset_fill, "causal-offset")]


@pytest.mark.parametrize("make,kind", SPELLINGS, ids=[m.__name__ for m, _ in SPELLINGS])
@pytest.mark.parametrize("dtype,fill,unit,near", [(torch.float32, -1e4, 1.0, False), (torch.float32, -100.0, 1.0, True),
                                                  (torch.float16, -1e4, 16.0, True), (torch.float16, -10.0, 1.0, True),
                                                  (torch.bfloat16, -10.0, 1.0, True)])
def test_structural_finite_fills_cross(make, kind, dtype, fill, unit, near):
    args = crossing_qkv(dtype, fill, unit=unit, near=near)
    assert_fill_matters(make, fill, *args)
    check(make(fill), *args, dtype=dtype, kind=kind)


@pytest.mark.parametrize("make,kind", SPELLINGS[:1] + SPELLINGS[3:4], ids=["causal", "window"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_structural_finite_fills_normal_logits(make, kind, dtype):
    """Logits far above the fill: the fix-up leaves the op's result (the common row) as it is."""
    g = torch.Generator().manual_seed(1)
    args = [torch.randn(B, H, N, D, generator=g).to(dtype).requires_grad_() for _ in range(3)]
    check(make(-1e4), *args, dtype=dtype, kind=kind)


def key_padding(c, spelling):
    def fn(q, k, v, pad):
        s = q @ k.transpose(-2, -1)
        if spelling == "fill":
            s = s.masked_fill(pad[:, None, None, :] == 0, c)
        else:
            s = torch.where(pad[:, None, None, :].bool(), s, c)
        return s.softmax(-1) @ v
    return fn


@pytest.mark.parametrize("spelling", ["fill", "where"])
@pytest.mark.parametrize("dtype,fill,unit", [(torch.float32, -1e9, 64.0), (torch.float32, -1e4, 1.0),
                                             (torch.float16, -1e4, 16.0)])
def test_key_padding_finite_fill(spelling, dtype, fill, unit):
    pad = torch.ones(B, N, dtype=torch.long)
    pad[0, 5:] = 0
    pad[1, :] = 0  # a sequence with no key: eager averages V
    args = (*crossing_qkv(dtype, fill, unit=unit), pad)
    assert_fill_matters(lambda c: key_padding(c, spelling), fill, *args)
    check(key_padding(fill, spelling), *args, dtype=dtype, kind="bool-mask")


def test_causal_and_key_lengths_combined():
    """Causal and key lengths (j < lens[b]) filled with one finite value: structure plus kv_lens."""

    def make(c):
        def fn(q, k, v, lens):
            n = q.shape[-2]
            s = (q @ k.transpose(-2, -1)).masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), c)
            s = s.masked_fill((torch.arange(n)[None, :] >= lens[:, None])[:, None, None, :], c)
            return s.softmax(-1) @ v
        return fn

    args = (*crossing_qkv(torch.float32, -1e4, near=False), torch.tensor([N, 3]))
    assert_fill_matters(make, -1e4, *args)
    check(make(-1e4), *args, dtype=torch.float32, kind="causal+key-padding")


@pytest.mark.parametrize("inplace", [True, False])
@pytest.mark.parametrize("dtype,unit", [(torch.float16, 16.0), (torch.float32, 1.0)])
def test_megatron_fp16_data_mask(dtype, unit, inplace):
    """Megatron: scores.masked_fill_(mask, -10000.0) with a bool [B, 1, N, N] mask given as data (the
    in-place spelling is read as the functional one: both are rewritten)."""

    def make(c):
        def fn(q, k, v, mask):
            s = torch.matmul(q, k.transpose(-2, -1))
            if inplace:
                s.masked_fill_(mask, c)
            else:
                s = s.masked_fill(mask, c)
            return torch.matmul(torch.nn.Softmax(dim=-1)(s), v)
        return fn

    mask = torch.ones(N, N, dtype=torch.bool).triu(1).expand(B, 1, N, N).clone()
    mask[1, :, :, 6:] = True
    mask[1, :, 2] = True  # a fully masked row
    args = (*crossing_qkv(dtype, -10000.0, unit=unit, near=dtype != torch.float32), mask)
    assert_fill_matters(make, -10000.0, *args)
    check(make(-10000.0), *args, dtype=dtype, kind="bool-mask")


def test_scaled_after_the_fill():
    """(s.masked_fill(m, -1e4)) / 2: eager scales the fill too; the masked score is -5e3."""

    def make(c):
        def fn(q, k, v):
            n = q.shape[-2]
            return ((q @ k.transpose(-2, -1)).masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), c) / 2.0
                    ).softmax(-1) @ v
        return fn

    args = crossing_qkv(torch.float32, -1e4, unit=2.0, near=False)
    assert_fill_matters(make, -1e4, *args)
    check(make(-1e4), *args, dtype=torch.float32, kind="causal")


def test_bias_then_finite_fill():
    """s + bias, then masked_fill(causal, -1e4): the fill overwrites s + bias, the bias stays the op's."""

    def make(c):
        def fn(q, k, v, bias):
            n = q.shape[-2]
            return (q @ k.transpose(-2, -1) + bias).masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), c
                                                                 ).softmax(-1) @ v
        return fn

    bias = torch.randint(-3, 4, (1, H, N, N), generator=torch.Generator().manual_seed(3)).float().requires_grad_()
    args = (*crossing_qkv(torch.float32, -1e4, near=False), bias)
    assert_fill_matters(make, -1e4, *args)
    check(make(-1e4), *args, dtype=torch.float32, kind="causal+bias")


def test_gqa_finite_fill():
    """K/V with fewer heads (repeat_kv removed): the masked keys' mean is read per kv head."""

    def make(c):
        def fn(q, k, v):
            n = q.shape[-2]
            k, v = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
            return (q @ k.transpose(-2, -1)).masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), c
                                                          ).softmax(-1) @ v
        return fn

    args = crossing_qkv(torch.float32, -1e4, hkv=1, near=False)
    assert_fill_matters(make, -1e4, *args)
    check(make(-1e4), *args, dtype=torch.float32, kind="causal")


# ----------------------------------------------------------------------------- additive finite masks

@pytest.mark.parametrize("dtype,unit", [(torch.float32, 1.0), (torch.float16, 16.0)])
def test_hf_bert_old_additive_key_mask(dtype, unit):
    """(1.0 - m[:, None, None, :]) * -10000.0 added to the scores keeps s in s - 1e4: the [B, 1, 1, Nk]
    mask is passed as the op's float bias (eager's arithmetic), never as key lengths."""

    def make(c):
        def fn(q, k, v, am):
            ext = (1.0 - am[:, None, None, :].to(q.dtype)) * c
            return (q @ k.transpose(-2, -1) + ext).softmax(-1) @ v
        return fn

    def as_inf(q, k, v, am):
        return (q @ k.transpose(-2, -1)).masked_fill(am[:, None, None, :] == 0, NEG_INF).softmax(-1) @ v

    am = torch.ones(B, N)
    am[:, 5:] = 0
    am[1, 0] = 0
    # keys 5-7 (masked) score 1e4 + 3 units above the others: s - 1e4 outweighs them, -inf would not
    key_off = torch.tensor([0.0] * 5 + [1e4 + 3 * unit] * 3)
    args = (*crossing_qkv(dtype, -1e4, unit=unit, key_offsets=key_off), am)
    assert_fill_matters(make, -10000.0, *args, as_inf=as_inf)
    c = check(make(-10000.0), *args, dtype=dtype, kind="bias")
    (site,) = c.rewritten
    bias = site.call.args[8]
    assert tuple(bias.meta["example_value"].shape) == (B, 1, 1, N)


def test_additive_causal_finite_mask():
    """s + triu(1) * -1e4: the masked score is s - 1e4, not -1e4, nor -inf; passed as a float bias."""

    def make(c):
        def fn(q, k, v):
            n = q.shape[-2]
            return (q @ k.transpose(-2, -1) + torch.triu(torch.ones(n, n), diagonal=1) * c).softmax(-1) @ v
        return fn

    key_off = torch.tensor([0.0, 0.0, 1e4 + 3, 1e4, 0.0, 1e4 + 5, 0.0, 1e4 + 2])  # later keys outweigh earlier rows
    args = crossing_qkv(torch.float32, -1e4, key_offsets=key_off)
    assert_fill_matters(make, -1e4, *args, as_inf=causal_fill(NEG_INF))
    check(make(-1e4), *args, dtype=torch.float32, kind="bias")


# ----------------------------------------------------------------------------- the common case costs nothing

def _graphs(make, fill, *args) -> tuple[list, list, list]:
    counts: list = []
    graphs: list = []
    inner = grad_backend(counts)

    def backend(gm, example_inputs):
        graphs.append(gm)
        return inner(gm, example_inputs)

    torch._dynamo.reset()
    out = torch.compile(make(fill), backend=backend, fullgraph=True)(*args)
    out.sum().backward()
    targets = [str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"]
    return targets, counts, graphs


@pytest.mark.parametrize("fill", [NEG_INF, "min"])
def test_negligible_fills_get_no_fixup(fill):
    """-inf and finfo.min fills: no fix-up in the forward graph, one attention_backward in the backward."""
    args = crossing_qkv(torch.float32, -1e4)
    c = torch.finfo(torch.float32).min if fill == "min" else fill
    targets, counts, _ = _graphs(causal_fill, c, *args)
    assert not any("sigmoid" in t or "log" in t for t in targets), targets
    assert counts == [1]


def test_finite_fill_adds_one_lse_backward():
    """A finite fill: the lse's gradient is one more attention_backward call, only at that site."""
    args = crossing_qkv(torch.float32, -1e4)
    targets, counts, _ = _graphs(causal_fill, -1e4, *args)
    assert any("sigmoid" in t for t in targets), targets
    assert counts == [2]


def test_finite_fill_with_dropout_is_refused():
    """Eager drops the masked keys' weights too, which the fix-up cannot: the site is left alone."""

    def fn(q, k, v):
        n = q.shape[-2]
        p = (q @ k.transpose(-2, -1)).masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), -1e4).softmax(-1)
        return F.dropout(p, 0.1, training=True) @ v

    c = Compiled(fn)
    c(*crossing_qkv(torch.float32, -1e4))
    (rep,) = c.reports
    assert not rep.rewritten and "finite fill" in rep.reason


def test_band_window_finite_fill():
    """A sliding window proven as a band (keep = j <= i and i - j <= 2): prefix sums give its masked share."""

    def make(c):
        def fn(q, k, v):
            n = q.shape[-2]
            i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
            return (q @ k.transpose(-2, -1)).masked_fill(~((j <= i) & (i - j <= 2)), c).softmax(-1) @ v
        return fn

    args = crossing_qkv(torch.float16, -1e4, unit=16.0)
    assert_fill_matters(make, -1e4, *args)
    check(make(-1e4), *args, dtype=torch.float16, kind="window")


def test_dynamic_lengths_finite_fill():
    """Dynamic sequence lengths: the fix-up's sizes are the graph's symbols; one graph serves both."""
    c = Compiled(causal_fill(-10.0), inner="aot_eager")
    for n in (8, 11):
        args = crossing_qkv(torch.float32, -10.0, nq=n, nk=n)
        for a in args:
            torch._dynamo.mark_dynamic(a, 2)
        out, ref = c(*args), causal_fill(-10.0)(*args)
        torch.testing.assert_close(out, ref, **TOLS[torch.float32])
        leaves = [_leaf(a) for a in args]
        for a, b in zip(torch.autograd.grad(out, leaves, torch.ones_like(ref)),
                        torch.autograd.grad(ref, leaves, torch.ones_like(ref))):
            torch.testing.assert_close(a, b, **TOLS[torch.float32])
    assert [r.mask for r in c.rewritten] == ["causal"] and not c.missed and len(c.graphs) == 1


# ----------------------------------------------------------------------------- masks applied before an upcast

@pytest.mark.parametrize("softmax", ["float", "dtype_arg"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_mask_applied_before_the_softmax_upcast(dtype, softmax):
    """Scores masked in half precision and cast to fp32 for the softmax (Hugging Face's
    `softmax(s + mask, dtype=torch.float32)`): eager rounds the masked scores in half precision, where fp16's
    finfo.min absorbs them, so a sequence with no kept key averages V. The analysis reads each term in the
    dtype of the node that applies it, not the softmax input's (fp32, where -65504 absorbs nothing and the
    op would weigh such a row by its scores). Output and gradients equal eager's, every element."""
    from eager_diff import check as diff_check, rand

    def fn(q, k, v, keep):
        s = q @ k.transpose(-1, -2) * 0.25
        s = s + torch.where(keep, 0.0, torch.finfo(s.dtype).min).to(s.dtype)
        p = s.float().softmax(-1) if softmax == "float" else torch.softmax(s, -1, dtype=torch.float32)
        return p.to(q.dtype) @ v

    keep = torch.ones(3, 1, 1, 11, dtype=torch.bool)
    keep[0, ..., 6:] = False
    keep[2] = False  # no kept key: eager's row is the mean of V
    q, k, v = (rand(3, 2, 11, 16, dtype=dtype, seed=i, requires_grad=True) for i in range(3))
    res = diff_check(fn, [q, k, v, keep], dtype=dtype, rewritten=1)
    mean_v = v.detach().float().mean(dim=2)[2]
    torch.testing.assert_close(res.out[2].float(), mean_v[:, None].expand(2, 11, 16), **TOLS[dtype])


def test_fp32_fill_that_overflows_the_half_precision_scores():
    """torch.where(keep, s, finfo(float32).min) on fp16 scores rounds the fill to -inf (eager: a row with no
    kept key is NaN), then the softmax runs in fp32: the analysis takes the fill as -inf, not as an absorbing
    finite value whose fix-up would give the mean of V."""
    from eager_diff import check as diff_check, rand

    def fn(q, k, v, keep):
        s = torch.where(keep, q @ k.transpose(-1, -2), torch.finfo(torch.float32).min)
        return s.float().softmax(-1).to(q.dtype) @ v

    keep = torch.ones(2, 1, 1, 9, dtype=torch.bool)
    keep[1] = False
    q, k, v = (rand(2, 2, 9, 8, dtype=torch.float16, seed=i) for i in range(3))
    res = diff_check(fn, [q, k, v, keep], dtype=torch.float16, rewritten=1, grad=False)
    assert res.ref[1].isnan().all() and res.out[1].isnan().all() and not res.out[0].isnan().any()


@pytest.mark.parametrize("learned", [False, True])
@pytest.mark.parametrize("softmax", ["half", "float"])
def test_fp16_data_mask_with_finfo_min(softmax, learned):
    """An fp16 mask given as data (0 / finfo.min, the structure unproven) added to fp16 scores: eager's fp16 sum
    absorbs the score into -65504, so a sequence with no kept key averages V. The op adds its bias in fp32,
    where -65504 absorbs nothing: the rewrite passes such entries as fp32 finfo.min, which does (and a learned
    bias added with the mask keeps its gradient). Output and gradients equal eager's, every element."""
    from eager_diff import check as diff_check, rand

    def fn(q, k, v, m, pos):
        s = q @ k.transpose(-1, -2) * 0.25 + (m + pos if learned else m)
        p = s.float().softmax(-1).to(q.dtype) if softmax == "float" else s.softmax(-1)
        return p @ v

    m = torch.zeros(3, 1, 1, 10, dtype=torch.float16)
    m[0, ..., 6:] = torch.finfo(torch.float16).min
    m[2] = torch.finfo(torch.float16).min  # no kept key
    q, k, v = (rand(3, 2, 10, 16, dtype=torch.float16, seed=i, requires_grad=True) for i in range(3))
    pos = rand(1, 2, 10, 10, dtype=torch.float16, seed=7, requires_grad=learned)
    res = diff_check(fn, [q, k, v, m, pos], dtype=torch.float16, rewritten=1)
    mean_v = v.detach().float().mean(dim=2)[2]
    torch.testing.assert_close(res.out[2].float(), mean_v[:, None].expand(2, 10, 16), **TOLS[torch.float16])


def test_fp16_mask_summed_in_the_graph_under_inductor():
    """T5 in fp16: `scores += position_bias + mask` with the mask's finfo.min on padded queries and keys. Inductor
    fuses the sum into the rewrite's test of it against fp16's finfo.min without rounding it to fp16 first (a
    positive position bias leaves -65503.x): the test reads it as eager's fp16 value (anything below -65488 rounds
    to -65504), so a padded query's row stays uniform, as eager's. Output and gradients, every element."""
    from eager_diff import check as diff_check, rand

    def fn(q, k, v, pb, m):
        s = q @ k.transpose(3, 2)
        s += pb + m
        return torch.softmax(s.float(), dim=-1).type_as(s) @ v

    m = torch.zeros(2, 1, 7, 7, dtype=torch.float16)
    m[1, :, 5:, :] = torch.finfo(torch.float16).min
    m[1, ..., 5:] = torch.finfo(torch.float16).min
    q, k, v = (rand(2, 2, 7, 8, dtype=torch.float16, seed=i, requires_grad=True) for i in range(3))
    pb = rand(1, 2, 7, 7, dtype=torch.float16, seed=5)
    res = diff_check(fn, [q, k, v, pb, m], dtype=torch.float16, inner="inductor", rewritten=1)
    mean_v = v.detach().float().mean(dim=2)[1]
    torch.testing.assert_close(res.out[1, :, 5:].float(), mean_v[:, None].expand(2, 2, 8), **TOLS[torch.float16])


@pytest.mark.parametrize("inner", ["aot_eager", "inductor"])
@pytest.mark.parametrize("spelling", ["m_times_big", "one_minus_keep_times_big", "two_terms_overflow"])
def test_fp16_additive_terms_that_overflow_to_minus_inf(spelling, inner):
    """fp16 masks whose eager arithmetic overflows: `m.half() * -1e9` is -inf in fp16 (the constant rounds in the
    product's dtype), and two terms of -4e4 sum past fp16's range. Eager's fully masked row is NaN there, not the
    mean of V that a finite fill would give; the rewrite reads the terms in eager's dtype, also where Inductor
    fuses their fp16 sum into fp32 without rounding it. Every element, NaN where eager's is."""
    from eager_diff import check as diff_check, rand

    def fn(q, k, v, m):
        s = q @ k.transpose(-2, -1) * 0.25
        if spelling == "m_times_big":
            return torch.softmax(s + m.to(s.dtype) * -1e9, -1) @ v
        if spelling == "one_minus_keep_times_big":
            return torch.softmax(s + (1.0 - (~m).to(s.dtype)) * -70000.0, -1) @ v
        return torch.softmax(s + m.to(s.dtype) * -4e4 + m.to(s.dtype) * -4e4, -1) @ v

    m = torch.zeros(2, 1, 6, 6, dtype=torch.bool)
    m[..., 0, :] = True  # row 0: no key (NaN in eager)
    m[..., 1, 2] = True
    q, k, v = (rand(2, 2, 6, 8, dtype=torch.float16, seed=i) for i in range(3))
    res = diff_check(fn, [q, k, v, m], dtype=torch.float16, inner=inner, rewritten=1, grad=False)
    assert res.ref[:, :, 0].isnan().all() and res.out[:, :, 0].isnan().all()
    assert not res.out[:, :, 1:].isnan().any()
