"""Mask structure analysis (patterns/masks.py): what each mask spelling is proven to be, and that the
rewrite built from that proof computes eager's numbers, fully masked rows included.

`analyze_mask` is exercised directly on Dynamo-captured graphs: a small test-only rewriter (`_rewrite`)
finds the plain `softmax(q @ k^T * scale <mask terms>) @ v` sites these tests write, calls
`analyze_mask`, emits the op with `emit_attention` and drops the dead mask code, so the numbers come
from the real fa3.attention op (reference kernel on CPU).
"""
from __future__ import annotations

import math
import operator
from typing import Any, Optional

import expecttest
import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F

import fa_compile  # noqa: F401  (registers torch.ops.fa3)
from fa_compile import ops  # noqa: F401
from fa_compile.patterns import constants, masks
from fa_compile.patterns.aliasing import is_inplace
from fa_compile.patterns.emit import emit_attention, example_value
from fa_compile.patterns.site import MaskSpec, MaskTerm

NEG_INF = float("-inf")
TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.float16: dict(atol=2e-3, rtol=2e-3),
       torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2)}


# ----------------------------------------------------------------------------- a test-only site rewriter

def _is_softmax(n: fx.Node) -> bool:
    return n.op in ("call_function", "call_method") and "softmax" in str(getattr(n.target, "__name__", n.target))


def _is_matmul(n: Any) -> bool:
    return isinstance(n, fx.Node) and n.target in (operator.matmul, torch.matmul)


def _peel_terms(x: fx.Node) -> tuple[fx.Node, list]:
    """Walk back from the softmax input through mask terms to the (scaled) scores."""
    terms: list = []
    while True:
        if x.target in (operator.add, torch.add):
            a, b = x.args[0], x.args[1]
            scores_first = _is_matmul(a) or (isinstance(a, fx.Node) and a.target in (operator.mul, operator.truediv)
                                             and _is_matmul(a.args[0])) or (isinstance(a, fx.Node) and terms_root(a))
            if scores_first:
                terms.insert(0, MaskTerm("add", b))
                x = a
            else:
                terms.insert(0, MaskTerm("add", a))
                x = b
        elif x.op == "call_method" and x.target == "masked_fill" or x.target is torch.masked_fill:
            terms.insert(0, MaskTerm("fill", x.args[1], x.args[2]))
            x = x.args[0]
        elif x.target is torch.where:
            terms.insert(0, MaskTerm("where", x.args[0], x.args[2]))
            x = x.args[1]
        else:
            return x, terms


def terms_root(n: fx.Node) -> bool:
    """True when n is itself a mask-term node on top of the scores (stacked terms)."""
    if n.target in (operator.add, torch.add):
        return any(_is_matmul(a) or (isinstance(a, fx.Node) and terms_root(a)) for a in n.args[:2])
    if (n.op == "call_method" and n.target == "masked_fill") or n.target is torch.where:
        return True
    return False


def _scores(x: fx.Node) -> tuple[fx.Node, fx.Node, float]:
    scale = 1.0
    if x.target in (operator.mul, operator.truediv):
        scale = x.args[1] if x.target is operator.mul else 1.0 / x.args[1]
        x = x.args[0]
    assert _is_matmul(x), x.format_node()
    q, kt = x.args
    assert kt.op == "call_method" and kt.target == "transpose", kt.format_node()
    return q, kt.args[0], float(scale)


class Rewriter:
    """A backend that rewrites the test's attention sites with analyze_mask and records the results."""

    def __init__(self, sdpa: bool = False):
        self.specs: list = []
        self.graphs: list = []
        self.sdpa = sdpa

    def __call__(self, gm: fx.GraphModule, example_inputs):
        g = gm.graph
        for sm in [n for n in g.nodes if _is_softmax(n)]:
            base, terms = _peel_terms(sm.args[0])
            q, k, scale = _scores(base)
            (user,) = sm.users
            pv = user if _is_matmul(user) else next(iter(user.users))
            v = pv.args[1]
            ev = example_value(base)
            b, h, nq, nk = ev.shape
            with constants.reading():  # module buffers may be read as constants (the backend guards them)
                spec = masks.analyze_mask(gm, terms, batch=b, q_heads=h, q_len=nq, k_len=nk, scores_dtype=ev.dtype,
                                          insert_before=pv, sdpa=self.sdpa)
            self.specs.append(spec)
            if isinstance(spec, str):
                continue
            with g.inserting_before(pv):
                out, _ = emit_attention(g, q, k, v, scale=scale, causal=spec.causal, diag_offset=spec.diag_offset,
                                        window_left=spec.window_left, window_right=spec.window_right, bias=spec.bias,
                                        kv_lens=spec.kv_lens, empty_rows=spec.empty_rows,
                                        fill=spec.fill, filled=spec.filled)
            pv.replace_all_uses_with(out)
        g.eliminate_dead_code(is_impure_node=lambda n: n.is_impure() or is_inplace(n))
        g.lint()
        gm.recompile()
        self.graphs.append(gm)
        return gm.forward

    @property
    def spec(self) -> Any:
        assert len(self.specs) == 1, self.specs
        return self.specs[0]


def compile_and_check(fn, *args, dtypes=(torch.float32, torch.float16), dynamic_dim: Optional[int] = None,
                      more: tuple = (), sdpa: bool = False) -> Rewriter:
    """Compile fn with the test rewriter, compare with eager on args (cast per dtype) and on `more` args."""
    rw = Rewriter(sdpa=sdpa)
    for dt in dtypes:
        torch._dynamo.reset()
        rw.specs.clear()
        cast = tuple(a.to(dt) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)
        if dynamic_dim is not None:
            for a in cast[:3]:
                torch._dynamo.mark_dynamic(a, dynamic_dim)
        compiled = torch.compile(fn, backend=rw, fullgraph=True)
        for call_args in (cast, *(tuple(a.to(dt) if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                                        for a in m) for m in more)):
            expected = fn(*call_args)
            got = compiled(*call_args)
            torch.testing.assert_close(got, expected, equal_nan=True, **TOL[dt])
    return rw


def qkv(b=2, h=2, nq=6, nk=6, d=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, h, nq, d, generator=g), torch.randn(b, h, nk, d, generator=g),
            torch.randn(b, h, nk, d, generator=g))


def nxn_nodes(gm: fx.GraphModule, nq, nk) -> list:
    """Nodes whose value is an N x N tensor (last two dims (nq, nk)) other than the op's own inputs."""
    found = []
    for n in gm.graph.nodes:
        v = example_value(n)
        if isinstance(v, torch.Tensor) and v.dim() >= 2 and tuple(v.shape[-2:]) == (nq, nk) and n.op != "placeholder":
            found.append(n.name)
    return found


def assert_spec(spec: Any, kind: str, empty_rows: str, **fields) -> None:
    assert isinstance(spec, MaskSpec), spec
    assert spec.kind == kind, spec
    assert spec.empty_rows == empty_rows, spec
    for name, want in fields.items():
        got = getattr(spec, name)
        if isinstance(got, fx.Node):
            got = example_value(got)
        assert got == want, (name, got, want, spec)


# ----------------------------------------------------------------------------- causal spellings

class NanoGPT(torch.nn.Module):
    """nanoGPT / GPT-2: a registered tril buffer sliced to [:T, :T] (Dynamo lifts it to a graph input)."""

    def __init__(self, block: int = 16):
        super().__init__()
        self.register_buffer("bias", torch.tril(torch.ones(block, block)).view(1, 1, block, block))

    def forward(self, q, k, v):
        t = q.size(-2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :t, :t] == 0, float("-inf"))
        return F.softmax(att, dim=-1) @ v


@pytest.mark.parametrize("dynamic", [False, True])
def test_nanogpt_buffer(dynamic):
    torch.manual_seed(0)
    model = NanoGPT()
    rw = compile_and_check(model, *qkv(), dynamic_dim=2 if dynamic else None,
                           more=(qkv(nq=9, nk=9, seed=1),) if dynamic else ())
    assert_spec(rw.spec, "causal", "impossible", causal=True, diag_offset=0)
    assert nxn_nodes(rw.graphs[-1], 6, 6) == []


def test_tril_ones_eq_zero():
    def fn(q, k, v):
        t = q.shape[-2]
        s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
        mask = torch.tril(torch.ones(t, t))
        s = s.masked_fill(mask == 0, float("-inf"))
        return torch.softmax(s, dim=-1) @ v

    rw = compile_and_check(fn, *qkv())
    assert_spec(rw.spec, "causal", "impossible", diag_offset=0)
    assert nxn_nodes(rw.graphs[-1], 6, 6) == []


def test_tril_diagonal_minus_one_keeps_nan_rows():
    """tril(diagonal=-1): row 0 admits no key; eager gives NaN there, and so must the rewrite."""

    def fn(q, k, v):
        t = q.shape[-2]
        s = q @ k.transpose(-2, -1)
        s = s.masked_fill(torch.ones(t, t, dtype=torch.bool).tril(-1).logical_not(), float("-inf"))
        return s.softmax(-1) @ v

    rw = compile_and_check(fn, *qkv())
    assert_spec(rw.spec, "causal-offset", "nan", diag_offset=-1)
    out = torch.compile(fn, backend=Rewriter())(*qkv())
    assert out[:, :, 0].isnan().all() and not out[:, :, 1:].isnan().any()


def test_triu_masked_is_causal_dynamic():
    def fn(q, k, v):
        t = q.shape[-2]
        s = (q @ k.transpose(-2, -1)) * 0.25
        s = s.masked_fill(torch.triu(torch.ones(t, t, dtype=torch.bool), diagonal=1), float("-inf"))
        return s.softmax(dim=-1) @ v

    rw = compile_and_check(fn, *qkv(), dynamic_dim=2, more=(qkv(nq=11, nk=11, seed=3),))
    assert_spec(rw.spec, "causal", "impossible", diag_offset=0)
    assert nxn_nodes(rw.graphs[-1], 6, 6) == []


@pytest.mark.parametrize("dynamic", [False, True])
def test_arange_where_finfo_min(dynamic):
    def fn(q, k, v):
        t = q.shape[-2]
        s = q @ k.transpose(-2, -1)
        m = torch.arange(t)[:, None] >= torch.arange(t)[None, :]
        s = torch.where(m, s, torch.finfo(s.dtype).min)
        return s.softmax(-1) @ v

    rw = compile_and_check(fn, *qkv(), dynamic_dim=2 if dynamic else None,
                           more=(qkv(nq=10, nk=10, seed=2),) if dynamic else ())
    assert_spec(rw.spec, "causal", "impossible", diag_offset=0)


@pytest.mark.parametrize("dynamic", [False, True])
def test_bottom_right_causal_arange(dynamic):
    """A KV cache's alignment: query i sits at position Nk - Nq + i."""

    def fn(q, k, v):
        nq, nk = q.shape[-2], k.shape[-2]
        s = q @ k.transpose(-2, -1)
        qpos = torch.arange(nq)[:, None] + (nk - nq)
        keep = torch.arange(nk)[None, :] <= qpos
        s = s.masked_fill(~keep, float("-inf"))
        return s.softmax(-1) @ v

    q, k, v = qkv(nq=3, nk=7)
    rw = Rewriter()
    torch._dynamo.reset()
    if dynamic:
        for t in (q, k, v):
            torch._dynamo.mark_dynamic(t, 2)
    compiled = torch.compile(fn, backend=rw, fullgraph=True)
    for args in ((q, k, v), qkv(nq=4, nk=9, seed=5)) if dynamic else ((q, k, v),):
        torch.testing.assert_close(compiled(*args), fn(*args), **TOL[torch.float32])
    assert rw.spec.kind == "causal-bottom-right" and rw.spec.causal
    if dynamic:
        assert isinstance(rw.spec.diag_offset, fx.Node)  # Nk - Nq computed from the size symbols
        # For dynamic sizes Nk >= Nq is not known, so rows may be empty: eager's NaN is kept.
        assert rw.spec.empty_rows == "nan"
    else:
        assert rw.spec.diag_offset == 4 and rw.spec.empty_rows == "impossible"


def test_bottom_right_with_empty_rows_matches_eager():
    """Nq > Nk with bottom-right alignment: the first Nq - Nk query rows see no key (NaN in eager)."""

    def fn(q, k, v):
        nq, nk = q.shape[-2], k.shape[-2]
        s = q @ k.transpose(-2, -1)
        keep = torch.arange(nk)[None, :] - torch.arange(nq)[:, None] <= nk - nq
        return torch.where(keep, s, NEG_INF).softmax(-1) @ v

    rw = compile_and_check(fn, *qkv(nq=7, nk=4))
    assert_spec(rw.spec, "causal-bottom-right", "nan", diag_offset=-3)


def test_full_neg_inf_triu_additive():
    """nn.Transformer.generate_square_subsequent_mask: triu(full(-inf), 1) added to the scores."""

    def fn(q, k, v):
        t = q.shape[-2]
        s = q @ k.transpose(-2, -1) * 0.3
        return (s + torch.full((t, t), float("-inf"), dtype=q.dtype).triu(1)).softmax(-1) @ v

    rw = compile_and_check(fn, *qkv())
    assert_spec(rw.spec, "causal", "impossible")
    assert nxn_nodes(rw.graphs[-1], 6, 6) == []


def test_mask_plus_scores_swapped_dynamic():
    def fn(q, k, v):
        t = q.shape[-2]
        mask = torch.full((t, t), float("-inf"), dtype=q.dtype).triu(diagonal=1)
        s = mask + q @ k.transpose(-2, -1)
        return s.softmax(-1) @ v

    rw = compile_and_check(fn, *qkv(), dynamic_dim=2, more=(qkv(nq=5, nk=5, seed=1),))
    assert_spec(rw.spec, "causal", "impossible")


def test_masked_fill_not_mask_finfo_min():
    def fn(q, k, v):
        t = q.shape[-2]
        s = q @ k.transpose(-2, -1)
        mask = torch.ones(t, t, dtype=torch.bool).tril()
        return s.masked_fill(~mask, torch.finfo(s.dtype).min).softmax(-1) @ v

    rw = compile_and_check(fn, *qkv())
    assert_spec(rw.spec, "causal", "impossible")


def test_concrete_only_spelling_is_refused_structure_when_dynamic():
    """flip().flip() has no symbolic rule: proven by evaluation for static shapes only."""

    def fn(q, k, v):
        t = q.shape[-2]
        s = q @ k.transpose(-2, -1)
        mask = torch.ones(t, t).tril().flip(0).flip(0)
        return s.masked_fill(mask == 0, NEG_INF).softmax(-1) @ v

    rw = compile_and_check(fn, *qkv(), dtypes=(torch.float32,))
    assert_spec(rw.spec, "causal", "impossible")
    rw = compile_and_check(fn, *qkv(), dtypes=(torch.float32,), dynamic_dim=2, more=(qkv(nq=8, nk=8, seed=4),))
    assert_spec(rw.spec, "bool-mask", "nan")  # kept as a residual keep-mask: correct, not structural


def test_inplace_built_mask_is_not_trusted():
    def fn(q, k, v):
        t = q.shape[-2]
        m = torch.ones(t, t)
        m.tril_()
        s = q @ k.transpose(-2, -1)
        return s.masked_fill(m == 0, NEG_INF).softmax(-1) @ v

    rw = compile_and_check(fn, *qkv(), dtypes=(torch.float32,))
    assert not rw.spec.causal and rw.spec.kind == "bool-mask"


# ----------------------------------------------------------------------------- windows

@pytest.mark.parametrize("dynamic", [False, True])
def test_sliding_window(dynamic):
    w = 3

    def fn(q, k, v):
        t = q.shape[-2]
        i = torch.arange(t).view(t, 1)
        j = torch.arange(t).view(1, t)
        keep = (j <= i) & (j > i - w)
        return (q @ k.transpose(-2, -1)).masked_fill(keep.logical_not(), NEG_INF).softmax(-1) @ v

    rw = compile_and_check(fn, *qkv(nq=8, nk=8), dynamic_dim=2 if dynamic else None,
                           more=(qkv(nq=10, nk=10, seed=6),) if dynamic else ())
    assert_spec(rw.spec, "window", "impossible", causal=True, diag_offset=0, window_left=w - 1)
    assert nxn_nodes(rw.graphs[-1], 8, 8) == []


def test_two_sided_band_from_tril_triu():
    def fn(q, k, v):
        t = q.shape[-2]
        band = torch.ones(t, t, dtype=torch.bool).tril(2).triu(-1)
        return torch.where(band, q @ k.transpose(-2, -1), NEG_INF).softmax(-1) @ v

    rw = compile_and_check(fn, *qkv(nq=7, nk=7))
    assert_spec(rw.spec, "window", "impossible", causal=True, diag_offset=2, window_left=3)


# ----------------------------------------------------------------------------- key padding and stacking

@pytest.mark.parametrize("dynamic", [False, True])
def test_key_padding_from_lengths(dynamic):
    def fn(q, k, v, lens):
        nk = k.shape[-2]
        keep = torch.arange(nk)[None, :] < lens[:, None]
        s = q @ k.transpose(-2, -1)
        return s.masked_fill(~keep[:, None, None, :], NEG_INF).softmax(-1) @ v

    q, k, v = qkv(nq=5, nk=7)
    lens = torch.tensor([7, 3])
    rw = compile_and_check(fn, q, k, v, lens, dynamic_dim=2 if dynamic else None,
                           more=((*qkv(nq=5, nk=7, seed=9), torch.tensor([0, 5])),))
    assert_spec(rw.spec, "key-padding", "nan")
    assert rw.spec.bias is None and rw.spec.kv_lens is not None
    assert nxn_nodes(rw.graphs[-1], 5, 7) == []


def test_key_lengths_out_of_int32_range_keep_their_meaning():
    """The op gets int32 lengths; a length past int32 (every key) or below 0 (no key) must not wrap."""

    def fn(q, k, v, lens):
        keep = torch.arange(k.shape[-2])[None, :] < lens[:, None]
        return (q @ k.transpose(-2, -1)).masked_fill(~keep[:, None, None, :], NEG_INF).softmax(-1) @ v

    q, k, v = qkv(nq=5, nk=7)
    rw = compile_and_check(fn, q, k, v, torch.tensor([2**40, 3]),
                           more=((*qkv(nq=5, nk=7, seed=4), torch.tensor([4, -2**40])),))
    assert_spec(rw.spec, "key-padding", "nan")


def test_causal_and_data_padding_residual_is_small():
    """HF masking_utils style: causal & padding[b, j] -> where(mask, 0, finfo.min)."""

    def fn(q, k, v, am):
        nq, nk = q.shape[-2], k.shape[-2]
        qi = torch.arange(nq)[None, None, :, None]
        kj = torch.arange(nk)[None, None, None, :]
        bi = torch.arange(am.shape[0])[:, None, None, None]
        mask = (kj <= qi) & am.bool()[bi, kj]
        mask = mask.expand(am.shape[0], -1, nq, nk)
        add = torch.where(mask, torch.zeros((), dtype=q.dtype), torch.finfo(q.dtype).min)
        return (q @ k.transpose(-2, -1) * 0.35 + add).softmax(-1, dtype=torch.float32).to(q.dtype) @ v

    am = torch.ones(2, 6, dtype=torch.long)
    am[0, :2] = 0  # left padding: query rows 0 and 1 of batch 0 see no key -> uniform average in eager
    rw = compile_and_check(fn, *qkv(), am)
    assert_spec(rw.spec, "causal+bool-mask", "mean_v_add")
    assert tuple(example_value(rw.spec.bias).shape) == (2, 1, 1, 6)
    assert nxn_nodes(rw.graphs[-1], 6, 6) == []


@pytest.mark.parametrize("how", ["add", "fill"])
def test_finfo_min_empty_rows_keep_eager_gradient(how):
    """A fully masked row is uniform in eager either way, but an added finfo.min mask (HF eager models
    with left padding) passes the gradient to the absorbed scores: eager's dq / dk get softmax's
    gradient at P = 1/Nk from that row, which the rewrite must keep; masked_fill gives them none."""

    def fn(q, k, v, keep):
        s = q @ k.transpose(-2, -1) * 0.4
        if how == "add":
            s = s + torch.where(keep, 0.0, torch.finfo(s.dtype).min)
        else:
            s = s.masked_fill(~keep, torch.finfo(s.dtype).min)
        return s.softmax(-1) @ v

    q, k, v = (t.requires_grad_() for t in qkv(nq=5, nk=7, d=4, seed=3))
    keep = torch.rand(2, 1, 5, 7, generator=torch.Generator().manual_seed(4)) > 0.4
    keep[1, 0, :2] = False  # rows with no key at all
    keep[0, 0, 4] = False
    rw = Rewriter()
    got = torch.compile(fn, backend=rw, fullgraph=True)(q, k, v, keep)
    assert_spec(rw.spec, "bool-mask", "mean_v_add" if how == "add" else "mean_v")
    ref = fn(q, k, v, keep)
    torch.testing.assert_close(got, ref, **TOL[torch.float32])
    dout = torch.randn(ref.shape, generator=torch.Generator().manual_seed(5))
    ref_grads = torch.autograd.grad(ref, (q, k, v), dout)
    for name, a, b in zip("qkv", torch.autograd.grad(got, (q, k, v), dout), ref_grads):
        torch.testing.assert_close(a, b, **TOL[torch.float32], msg=name)
    if how == "add":  # the empty rows' eager gradient of q is not zero: the check above has teeth
        assert ref_grads[0][1, :, :2].abs().max() > 1e-3


def test_causal_fill_plus_bert_padding_bias():
    """Stacked terms: causal masked_fill(-inf) then an additive [B, 1, 1, Nk] padding bias (fp32: the op adds
    the untouched bias in fp32, which is eager's arithmetic, fully padded rows included)."""

    def fn(q, k, v, am):
        t = q.shape[-2]
        s = q @ k.transpose(-2, -1)
        s = s.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), NEG_INF)
        ext = (1.0 - am[:, None, None, :].to(torch.float32)) * torch.finfo(torch.float32).min
        return (s + ext).softmax(-1) @ v

    am = torch.ones(2, 6)
    am[1, :3] = 0
    rw = compile_and_check(fn, *qkv(), am, dtypes=(torch.float32,))
    assert_spec(rw.spec, "causal+bias", "nan")
    assert tuple(example_value(rw.spec.bias).shape) == (2, 1, 1, 6)


def test_bert_extended_padding_mask_is_bias():
    def fn(q, k, v, am):
        ext = (1.0 - am[:, None, None, :]) * torch.finfo(q.dtype).min
        return (q @ k.transpose(-2, -1) / 5 ** 0.5 + ext).softmax(-1) @ v

    am = torch.ones(2, 6)
    am[0, 4:] = 0
    rw = compile_and_check(fn, *qkv(), am, dtypes=(torch.float32,))
    assert_spec(rw.spec, "bias", "nan")
    assert rw.spec.bias.name == "mul" or tuple(example_value(rw.spec.bias).shape) == (2, 1, 1, 6)


def test_alibi_bias_plus_causal():
    slopes = torch.tensor([0.5, 0.25])

    def fn(q, k, v):
        t = q.shape[-2]
        pos = torch.arange(t)
        alibi = slopes[:, None, None] * (pos[None, :] - pos[:, None])[None].float()
        s = q @ k.transpose(-2, -1) + alibi
        return s.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), NEG_INF).softmax(-1) @ v

    rw = compile_and_check(fn, *qkv(), dtypes=(torch.float32,))
    assert_spec(rw.spec, "causal+bias", "nan")


# ----------------------------------------------------------------------------- fully masked rows

def test_neg_inf_fill_empty_rows_are_nan():
    def fn(q, k, v, keep):
        return (q @ k.transpose(-2, -1)).masked_fill(~keep, NEG_INF).softmax(-1) @ v

    keep = torch.rand(2, 1, 6, 6, generator=torch.Generator().manual_seed(1)) > 0.5
    keep[0, 0, 2] = False
    rw = compile_and_check(fn, *qkv(), keep)
    assert_spec(rw.spec, "bool-mask", "nan")


def test_finfo_min_fill_empty_rows_are_uniform():
    def fn(q, k, v, keep):
        s = q @ k.transpose(-2, -1)
        return s.masked_fill(keep.logical_not(), torch.finfo(s.dtype).min).softmax(-1) @ v

    keep = torch.rand(2, 1, 6, 6, generator=torch.Generator().manual_seed(2)) > 0.4
    keep[1, 0, 3] = False
    keep[0, 0, 0] = False
    rw = compile_and_check(fn, *qkv(), keep)
    assert_spec(rw.spec, "bool-mask", "mean_v")
    got = torch.compile(fn, backend=Rewriter())(*qkv(), keep)
    torch.testing.assert_close(got[1, :, 3], qkv()[2][1].mean(dim=-2))


def test_minus_1e9_causal_offset_keeps_its_share():
    """where(keep, s, -1e9): a finite fill keeps its exact share on every row (row 0, fully masked, is
    the mean of V), not a -inf mask."""

    def fn(q, k, v):
        t = q.shape[-2]
        s = q @ k.transpose(-2, -1)
        keep = torch.arange(t)[None, :] < torch.arange(t)[:, None]  # strictly below the diagonal
        return torch.where(keep, s, -1e9).softmax(-1) @ v

    rw = compile_and_check(fn, *qkv(), dtypes=(torch.float32,))
    assert_spec(rw.spec, "causal-offset", "fill", diag_offset=-1, fill=-1e9)


def test_sdpa_bool_mask_empty_rows_are_zero():
    q, k, v = qkv()
    keep = torch.ones(6, 6, dtype=torch.bool).tril()
    keep[2] = False
    # torch's SDPA math path returns 0 on a row without admissible keys
    assert (F.scaled_dot_product_attention(q, k, v, attn_mask=keep)[:, :, 2] == 0).all()

    def fn(q, k, v, m):
        return (q @ k.transpose(-2, -1)).masked_fill(~m, NEG_INF).softmax(-1) @ v

    gm, node = capture_terms(fn, q, k, v, keep)
    spec = masks.analyze_mask(gm, [MaskTerm("bool", node.args[1].args[0])], batch=2, q_heads=2, q_len=6, k_len=6,
                              scores_dtype=torch.float32, insert_before=node)
    assert_spec(spec, "bool-mask", "zero")


# ----------------------------------------------------------------------------- refusals

def capture_terms(fn, *args) -> tuple[fx.GraphModule, fx.Node]:
    """The Dynamo graph of fn and its (single) softmax input node."""
    box: list = []

    def backend(gm, example_inputs):
        box.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=backend, fullgraph=True)(*args)
    (gm,) = box
    (sm,) = [n for n in gm.graph.nodes if _is_softmax(n)]
    return gm, sm.args[0]


def _analyze(fn, *args, sdpa=False):
    gm, x = capture_terms(fn, *args)
    base, terms = _peel_terms(x)
    b, h, nq, nk = example_value(base).shape
    return masks.analyze_mask(gm, terms, batch=b, q_heads=h, q_len=nq, k_len=nk,
                              scores_dtype=example_value(base).dtype, insert_before=x, sdpa=sdpa)


@pytest.mark.parametrize("fill", [-10.0, 1e9])
def test_small_and_positive_fill_values_are_exact(fill):
    """Fills that are far from negligible (-10 against scores of a few units, or +1e9) keep their share."""

    def fn(q, k, v, m):
        return (q @ k.transpose(-2, -1)).masked_fill(m, fill).softmax(-1) @ v

    m = torch.rand(6, 6, generator=torch.Generator().manual_seed(4)) > 0.6
    rw = compile_and_check(fn, *qkv(), m, dtypes=(torch.float32, torch.float16) if fill < 0 else (torch.float32,))
    assert_spec(rw.spec, "bool-mask", "fill", fill=fill)


def test_refuse_mixed_finite_fills():
    def fn(q, k, v, m1, m2):
        s = (q @ k.transpose(-2, -1)).masked_fill(m1, -1e9)
        return s.masked_fill(m2, torch.finfo(s.dtype).min).softmax(-1) @ v

    m = torch.zeros(6, 6, dtype=torch.bool)
    reason = _analyze(fn, *qkv(), m, m)
    assert isinstance(reason, str) and "fill values" in reason


def test_refuse_finite_fill_then_additive_float():
    """-1e9 fill then an additive float mask: eager's masked scores hold -1e9 + bias, which the op
    can neither reproduce with -inf masking nor as an additive -1e9 (fp32 s - 1e9 keeps s)."""

    def fn(q, k, v, m, bias):
        s = (q @ k.transpose(-2, -1)).masked_fill(m, -1e9)
        return (s + bias).softmax(-1) @ v

    reason = _analyze(fn, *qkv(), torch.zeros(6, 6, dtype=torch.bool), torch.zeros(2, 1, 1, 6))
    assert isinstance(reason, str) and "finite fill -1000000000.0 followed by an additive mask" in reason


def test_additive_float_then_finite_fill_is_mean_v():
    """An additive mask before a finfo.min fill: eager overwrites s + bias with c, so a fully masked row
    is uniform (empty_rows "mean_v") and the bias goes to the op as it is (was refused before)."""

    def fn(q, k, v, m, x, w):
        bias = (x @ w)[:, None, None, :]  # a product, as plausible as the scores (a bias from the inputs is refused:
        s = (q @ k.transpose(-2, -1)) + bias  # test_mask_values.py)
        return s.masked_fill(m, torch.finfo(torch.float32).min).softmax(-1) @ v

    m = torch.rand(6, 6, generator=torch.Generator().manual_seed(15)) > 0.6
    m[2] = True  # a fully masked row
    x, w = torch.randn(2, 3, generator=torch.Generator().manual_seed(16)), torch.randn(3, 6)
    rw = compile_and_check(fn, *qkv(), m, x, w, dtypes=(torch.float32,))
    assert_spec(rw.spec, "bool-mask+bias", "mean_v")


def test_legacy_gpt2_causal_where_plus_extended_padding():
    """where(causal, s, finfo.min) + (1 - m) * finfo.min (GPT-2 before transformers 4.48, GPT-J, GPT-Neo):
    passed as one additive bias, so left-padded rows keep eager's uniform average over keys."""

    class Legacy(GPT2Legacy):
        def forward(self, q, k, v, am):
            w = torch.matmul(q, k.transpose(-1, -2))
            ql, kl = q.size(-2), k.size(-2)
            causal = self.bias[:, :, kl - ql: kl, :kl]
            w = torch.where(causal, w, torch.finfo(w.dtype).min)
            w = w + (1.0 - am[:, None, None, :].to(w.dtype)) * torch.finfo(w.dtype).min
            return torch.matmul(torch.softmax(w, dim=-1), v)

    am = torch.ones(2, 6)
    am[0, :3] = 0
    rw = compile_and_check(Legacy(), *qkv(), am, dtypes=(torch.float32,))
    assert_spec(rw.spec, "bias", "nan")


def test_additive_bool_mask_adds_one():
    """scores + bool adds 1.0 where True (HF GPT-Neo given a bool mask): passed as a 0/1 float bias."""

    def fn(q, k, v, m):
        return ((q @ k.transpose(-2, -1)) + m).softmax(-1) @ v

    m = torch.rand(2, 1, 1, 6, generator=torch.Generator().manual_seed(3)) > 0.5
    rw = compile_and_check(fn, *qkv(), m, dtypes=(torch.float32,))
    assert_spec(rw.spec, "bias", "nan")
    assert example_value(rw.spec.bias).dtype == torch.float32


def test_refuse_additive_integer_mask():
    def fn(q, k, v, m):
        return ((q @ k.transpose(-2, -1)) + m).softmax(-1) @ v

    gm, x = capture_terms(fn, *qkv(), torch.zeros(6, 6, dtype=torch.int64))
    (int_mask,) = [n for n in gm.graph.nodes if n.op == "placeholder" and example_value(n).dtype == torch.int64]
    reason = masks.analyze_mask(gm, [MaskTerm("add", int_mask)], batch=2, q_heads=2, q_len=6, k_len=6,
                                scores_dtype=torch.float32, insert_before=x)
    assert isinstance(reason, str) and "not a float dtype" in reason


def test_noop_slices_keep_the_residual():
    """bias[:, :, -T:, :] / [..., :Nk] that keep the whole dim do not hide a structure or a small residual."""

    def fn(q, k, v, pad):
        t = q.shape[-2]
        causal = torch.ones(t, t, dtype=torch.bool).tril()[None, None]
        keep = (causal & pad[:, None, None, :])[:, :, -t:, :t]
        return (q @ k.transpose(-2, -1)).masked_fill(~keep, NEG_INF).softmax(-1) @ v

    pad = torch.ones(2, 6, dtype=torch.bool)
    pad[0, :2] = False
    rw = compile_and_check(fn, *qkv(), pad, dtypes=(torch.float32,))
    assert_spec(rw.spec, "causal+bool-mask", "nan")
    assert tuple(example_value(rw.spec.bias).shape)[-2] == 1


def test_refuse_fill_with_tensor_value():
    def fn(q, k, v, m, c):
        return (q @ k.transpose(-2, -1)).masked_fill(m, c).softmax(-1) @ v

    reason = _analyze(fn, *qkv(), torch.zeros(6, 6, dtype=torch.bool), torch.tensor(-1e9))
    assert isinstance(reason, str) and "is not a number" in reason


def test_refuse_unknown_term_op():
    gm, x = capture_terms(lambda q, k, v: (q @ k.transpose(-2, -1)).softmax(-1) @ v, *qkv())
    reason = masks.analyze_mask(gm, [MaskTerm("mul", x)], batch=2, q_heads=2, q_len=6, k_len=6,
                                scores_dtype=torch.float32, insert_before=x)
    assert isinstance(reason, str) and "unknown mask term" in reason


def test_no_terms_is_none():
    gm, x = capture_terms(lambda q, k, v: (q @ k.transpose(-2, -1)).softmax(-1) @ v, *qkv())
    spec = masks.analyze_mask(gm, [], batch=2, q_heads=2, q_len=6, k_len=6, scores_dtype=torch.float32,
                              insert_before=x)
    assert_spec(spec, "none", "impossible")


# ----------------------------------------------------------------------------- through the whole pipeline

class PipelineRun:
    """The real pass (canonicalize -> sites -> masks.analyze_mask -> emit) with eager as inner compiler."""

    def __init__(self):
        self.reports: list = []
        self.graphs: list = []

    def __call__(self, gm: fx.GraphModule, example_inputs):
        from fa_compile.compiler import run_pass

        self.reports.extend(run_pass(gm))
        self.graphs.append(gm)
        return gm.forward


def pipeline_check(fn, *args, dtypes=(torch.float32, torch.float16), dynamic_dim=None, more=()) -> PipelineRun:
    run = PipelineRun()
    for dt in dtypes:
        torch._dynamo.reset()
        cast = tuple(a.to(dt) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)
        if dynamic_dim is not None:
            for a in cast[:3]:
                torch._dynamo.mark_dynamic(a, dynamic_dim)
        compiled = torch.compile(fn, backend=run, fullgraph=True)
        for call_args in (cast, *(tuple(a.to(dt) if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                                        for a in m) for m in more)):
            torch.testing.assert_close(compiled(*call_args), fn(*call_args), equal_nan=True, **TOL[dt])
    return run


def _fn_tril(q, k, v):
    t = q.shape[-2]
    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    return torch.softmax(s.masked_fill(torch.tril(torch.ones(t, t, device=q.device)) == 0, float("-inf")), dim=-1) @ v


def _fn_arange_where(q, k, v):
    t = q.shape[-2]
    s = q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5
    m = torch.arange(t, device=q.device)[:, None] >= torch.arange(t, device=q.device)[None, :]
    return torch.where(m, s, torch.finfo(s.dtype).min).softmax(-1) @ v


def _fn_full_triu(q, k, v):
    t = q.shape[-2]
    mask = torch.full((t, t), float("-inf"), dtype=q.dtype, device=q.device).triu(1)
    return F.softmax(mask + q @ k.transpose(-2, -1), dim=-1) @ v


def _fn_window(q, k, v):
    t = q.shape[-2]
    i = torch.arange(t).view(t, 1)
    j = torch.arange(t).view(1, t)
    keep = (j <= i) & (j > i - 2)
    return (q @ k.transpose(-2, -1)).masked_fill(keep.logical_not(), NEG_INF).softmax(-1) @ v


def _fn_lens(q, k, v, lens):
    keep = torch.arange(k.shape[-2])[None, :] < lens[:, None]
    return (q @ k.transpose(-2, -1)).masked_fill(~keep[:, None, None, :], NEG_INF).softmax(-1) @ v


def _fn_sdpa_tril(q, k, v):
    t = q.shape[-2]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(t, t, dtype=torch.bool).tril())


PIPELINE_CASES = [
    ("tril-eq-0", _fn_tril, lambda: qkv(), "causal", True),
    ("arange-where-min", _fn_arange_where, lambda: qkv(), "causal", True),
    ("full-triu-add", _fn_full_triu, lambda: qkv(), "causal", True),
    ("window", _fn_window, lambda: qkv(), "window", True),
    ("kv-lens", _fn_lens, lambda: (*qkv(nq=5, nk=7), torch.tensor([7, 0])), "key-padding", True),
    ("nanogpt", NanoGPT(), lambda: qkv(), "causal", True),
    ("sdpa-bool-tril", _fn_sdpa_tril, lambda: qkv(), "causal", True),
]


@pytest.mark.parametrize("name,fn,make,kind,dynamic", PIPELINE_CASES)
def test_pipeline_static(name, fn, make, kind, dynamic):
    args = make()
    run = pipeline_check(fn, *args)
    assert [r.mask for r in run.reports if r.rewritten] == [kind] * len(run.reports), run.reports
    nq, nk = args[0].shape[-2], args[1].shape[-2]
    assert nxn_nodes(run.graphs[-1], nq, nk) == [], run.graphs[-1].code
    torch._dynamo.reset()
    report = fa_compile.explain(fn, *args)
    assert [s.mask for s in report.sites] == [kind], report


@pytest.mark.parametrize("name,fn,make,kind,dynamic", PIPELINE_CASES)
def test_pipeline_dynamic(name, fn, make, kind, dynamic):
    args = make()
    more = tuple(a[..., :4, :].contiguous() if isinstance(a, torch.Tensor) and a.dim() == 4 else a for a in args)
    run = pipeline_check(fn, *args, dtypes=(torch.float32,), dynamic_dim=2, more=(more,))
    assert len(run.graphs) == 1, "recompiled for another sequence length"
    assert [r.mask for r in run.reports if r.rewritten] == [kind] * len(run.reports), run.reports


def _hf_model(name: str, impl: str):
    transformers = pytest.importorskip("transformers")
    small = dict(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                 num_key_value_heads=1, max_position_embeddings=64)
    if name == "llama":
        cfg, cls = transformers.LlamaConfig(**small), transformers.LlamaForCausalLM
    elif name == "mistral":
        cfg, cls = transformers.MistralConfig(sliding_window=3, **small), transformers.MistralForCausalLM
    else:
        cfg = transformers.GPT2Config(vocab_size=32, n_embd=16, n_layer=1, n_head=2, n_positions=64)
        cls = transformers.GPT2LMHeadModel
    cfg._attn_implementation = impl
    torch.manual_seed(0)
    return cls(cfg).eval()


@pytest.mark.parametrize("name,impl,padded,kind", [
    ("llama", "eager", False, "causal"),
    ("llama", "eager", True, "causal+bool-mask"),
    ("llama", "sdpa", True, "causal+bool-mask"),
    ("mistral", "eager", True, "window+bool-mask"),
    ("gpt2", "eager", True, "causal+bool-mask"),
])
def test_hf_masks(name, impl, padded, kind):
    """HF masking_utils: causal / sliding window proven, the padding stays a [B, 1, 1, Nk] residual; left-padded
    query rows (no admissible key) keep eager's value (uniform average for finfo.min, 0 for SDPA)."""
    model = _hf_model(name, impl)
    ids = torch.randint(0, 32, (2, 6), generator=torch.Generator().manual_seed(0))
    am = torch.ones(2, 6, dtype=torch.long)
    am[0, :2] = 0

    def fn(i, a):
        return model(input_ids=i, attention_mask=a if padded else None).logits

    with torch.no_grad():
        run = pipeline_check(fn, ids, am, dtypes=(torch.float32,))
    assert [r.mask for r in run.reports] == [kind], run.reports
    calls = [n for n in run.graphs[-1].graph.nodes if n.target is torch.ops.fa3.attention.default]
    bias = calls[0].args[8]
    if padded:
        assert tuple(example_value(bias).shape) == (2, 1, 1, 6)
    else:
        assert bias is None


class GPT2Legacy(torch.nn.Module):
    """transformers < 4.48 GPT-2: bool tril buffer sliced bottom-right, where() with a 0-d tensor fill."""

    def __init__(self, n: int = 16):
        super().__init__()
        self.register_buffer("bias", torch.tril(torch.ones((n, n), dtype=torch.bool)).view(1, 1, n, n),
                             persistent=False)

    def forward(self, q, k, v):
        w = torch.matmul(q, k.transpose(-1, -2)) / torch.full([], v.size(-1) ** 0.5, dtype=q.dtype)
        ql, kl = q.size(-2), k.size(-2)
        causal = self.bias[:, :, kl - ql: kl, :kl]
        fill = torch.full([], torch.finfo(w.dtype).min, dtype=w.dtype, device=w.device)
        w = torch.where(causal, w.to(w.dtype), fill)
        return torch.matmul(torch.softmax(w, dim=-1), v)


@pytest.mark.parametrize("dynamic", [False, True])
def test_gpt2_legacy_bottom_right_buffer(dynamic):
    """The slice start Nk - Nq is symbolic under dynamic shapes; Dynamo's guard Nk - Nq >= 0 proves it."""
    model = GPT2Legacy()
    run = pipeline_check(model, *qkv(nq=3, nk=7), dynamic_dim=2 if dynamic else None,
                         more=(qkv(nq=5, nk=9, seed=3),) if dynamic else ())
    assert [r.mask for r in run.reports] == ["causal-bottom-right"] * 2
    if dynamic:
        assert len(run.graphs) == 2  # one graph per dtype, none per length
    assert nxn_nodes(run.graphs[-1], 3, 7) == []


def test_t5_style_position_bias_plus_causal():
    """position_bias + causal 0/finfo.min mask summed first, then added. The bias is a tensor from outside the graph
    whose values are not known: where it reaches finfo.min on a row's kept keys, eager weighs the causally masked
    keys too (test_mask_values.py), so the sum is passed to the op whole, eager's own arithmetic."""
    pos_bias = torch.randn(1, 2, 6, 6, generator=torch.Generator().manual_seed(4))

    def fn(q, k, v):
        t = q.shape[-2]
        causal = torch.ones(t, t, dtype=torch.bool).tril()[None, None]
        mask = torch.where(causal, 0.0, torch.finfo(q.dtype).min).to(q.dtype)
        bias = pos_bias.to(q.dtype) + mask
        return torch.softmax(q @ k.transpose(-2, -1) + bias, dim=-1) @ v

    rw = compile_and_check(fn, *qkv())
    assert_spec(rw.spec, "bias", "nan")
    assert tuple(example_value(rw.spec.bias).shape) == (1, 2, 6, 6)


def test_learned_bias_in_additive_mask_with_empty_rows_is_passed_untouched():
    """A learned bias summed with a 0/finfo.min padding mask (T5 / BEiT style with padding): on a fully
    masked row eager's gradient reaches the bias (softmax's at uniform P); with the structure extracted
    the op would give it 0 there, so the whole mask is the op's bias (eager's arithmetic) and every
    gradient matches."""
    pos_bias = torch.randn(1, 2, 5, 7, generator=torch.Generator().manual_seed(6), requires_grad=True)

    def fn(q, k, v, am):
        mask = torch.where(am.bool()[:, None, None, :], 0.0, torch.finfo(q.dtype).min)
        return torch.softmax(q @ k.transpose(-2, -1) + (pos_bias + mask), dim=-1) @ v

    q, k, v = (t.requires_grad_() for t in qkv(nq=5, nk=7, d=4, seed=7))
    am = torch.ones(2, 7, dtype=torch.long)
    am[1] = 0  # every key of batch 1 masked: its rows are uniform in eager
    rw = Rewriter()
    got = torch.compile(fn, backend=rw, fullgraph=True)(q, k, v, am)
    assert isinstance(rw.spec, MaskSpec) and rw.spec.empty_rows != "mean_v_add", rw.spec
    ref = fn(q, k, v, am)
    torch.testing.assert_close(got, ref, **TOL[torch.float32])
    dout = torch.randn(ref.shape, generator=torch.Generator().manual_seed(8))
    ref_grads = torch.autograd.grad(ref, (q, k, v, pos_bias), dout)
    for name, a, b in zip(("q", "k", "v", "bias"), torch.autograd.grad(got, (q, k, v, pos_bias), dout), ref_grads):
        torch.testing.assert_close(a, b, **TOL[torch.float32], msg=name)
    assert ref_grads[3].abs().max() > 1e-3


def test_data_mask_minus_1e9_fill_uniform_rows():
    """The Annotated Transformer: masked_fill(mask == 0, -1e9) with a data mask; an all-zero row is uniform
    (the finite fill's exact share, empty_rows "fill", covers it)."""

    def fn(q, k, v, mask):
        s = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))
        return F.softmax(s.masked_fill(mask == 0, -1e9), dim=-1) @ v

    mask = torch.ones(2, 1, 1, 6, dtype=torch.long)
    mask[1, ..., 3:] = 0
    rw = compile_and_check(fn, *qkv(), mask, dtypes=(torch.float32,))
    assert_spec(rw.spec, "bool-mask", "fill", fill=-1e9)
    mask[1] = 0  # every key of batch 1 masked: eager averages V uniformly
    rw = compile_and_check(fn, *qkv(), mask, dtypes=(torch.float32,))


def test_guard_implied_condition():
    """masks._sym_true accepts a condition Dynamo guards on (Nk - Nq >= 0), and nothing it does not."""
    seen = {}

    def backend(gm, example_inputs):
        (sub,) = [n for n in gm.graph.nodes if n.target is operator.sub]
        d = example_value(sub)
        seen["ge0"] = masks._sym_true(d >= 0)
        seen["ge1"] = masks._sym_true(d >= 1)
        return gm.forward

    def fn(x, y):
        n, m = x.shape[0], y.shape[0]
        return y[m - n: m] * 2

    x, y = torch.randn(3), torch.randn(7)
    torch._dynamo.reset()
    torch._dynamo.mark_dynamic(x, 0)
    torch._dynamo.mark_dynamic(y, 0)
    torch.compile(fn, backend=backend)(x, y)
    assert seen == {"ge0": True, "ge1": False}


@pytest.mark.parametrize("name", ["llama", "mistral", "gpt2"])
def test_hf_dead_mask_code_removed(name):
    """After the rewrite no N x N mask-building node of HF's masking_utils survives DCE."""
    model = _hf_model(name, "eager")
    ids = torch.randint(0, 32, (2, 6), generator=torch.Generator().manual_seed(0))
    am = torch.ones(2, 6, dtype=torch.long)
    am[0, :2] = 0
    with torch.no_grad():
        run = pipeline_check(lambda i, a: model(input_ids=i, attention_mask=a).logits, ids, am,
                             dtypes=(torch.float32,))
    assert nxn_nodes(run.graphs[-1], 6, 6) == [], run.graphs[-1].code


@pytest.mark.parametrize("spelling", ["tril", "triu-masked", "arange-cmp"])
@pytest.mark.parametrize("diag", [-2, 0, 1, 3])
@pytest.mark.parametrize("dynamic", [False, True])
def test_causal_offsets_any_diagonal(spelling, diag, dynamic):
    """Any diagonal, Nq != Nk: the op's causal(diag_offset) equals eager, empty rows (diag < 0) included."""

    def fn(q, k, v):
        nq, nk = q.shape[-2], k.shape[-2]
        s = q @ k.transpose(-2, -1)
        if spelling == "tril":
            return s.masked_fill(torch.ones(nq, nk).tril(diag) == 0, NEG_INF).softmax(-1) @ v
        if spelling == "triu-masked":
            return s.masked_fill(torch.ones(nq, nk, dtype=torch.bool).triu(diag + 1), NEG_INF).softmax(-1) @ v
        keep = torch.arange(nk)[None, :] - diag <= torch.arange(nq)[:, None]
        return torch.where(keep, s, torch.finfo(s.dtype).min).softmax(-1) @ v

    rw = compile_and_check(fn, *qkv(nq=5, nk=8), dtypes=(torch.float32,), dynamic_dim=2 if dynamic else None,
                           more=(qkv(nq=6, nk=9, seed=7),) if dynamic else ())
    spec = rw.spec
    assert spec.causal and spec.bias is None, spec
    want_kind = "causal" if diag == 0 else "causal-offset"
    if diag == 8 - 5 and not dynamic:
        want_kind = "causal-bottom-right"  # the offset equals Nk - Nq at these static sizes
    assert spec.kind == want_kind, spec
    assert (example_value(spec.diag_offset) if isinstance(spec.diag_offset, fx.Node) else spec.diag_offset) == diag
    if diag >= 0:
        assert spec.empty_rows == "impossible"
    else:
        assert spec.empty_rows == ("mean_v" if spelling == "arange-cmp" else "nan")


def test_band_of_concrete_classification():
    d = torch.arange(7)[None, :] - torch.arange(5)[:, None]
    assert masks._band_of((d <= 1) & (d >= -2)) == masks._Keep(lo=-2, hi=1)
    assert masks._band_of(d <= 10) == masks._Keep()
    assert masks._band_of(d >= -4) == masks._Keep()  # the lowest diagonal of a 5 x 7 matrix is -4
    assert masks._band_of(d != 0) is None  # not a band
    assert masks._band_of(d > 100) is None  # empty


def test_expanded_data_mask_residual_is_the_small_node():
    """A [B, 1, 1, Nk] padding mask expanded to [B, 1, Nq, Nk] before use: the residual is the small one."""

    def fn(q, k, v, pad):
        nq = q.shape[-2]
        m = pad[:, None, None, :].expand(-1, 1, nq, -1)
        return (q @ k.transpose(-2, -1)).masked_fill(~m, NEG_INF).softmax(-1) @ v

    pad = torch.ones(2, 6, dtype=torch.bool)
    pad[1, 4:] = False
    rw = compile_and_check(fn, *qkv(), pad)
    assert_spec(rw.spec, "bool-mask", "nan")
    assert tuple(example_value(rw.spec.bias).shape) == (2, 1, 1, 6)
    assert nxn_nodes(rw.graphs[-1], 6, 6) == []


def test_expanded_float_bias_passes_small_node():
    def fn(q, k, v, bias):
        nq = q.shape[-2]
        return (q @ k.transpose(-2, -1) + bias[:, None, None, :].expand(-1, 2, nq, -1)).softmax(-1) @ v

    bias = torch.randn(2, 6)
    rw = compile_and_check(fn, *qkv(), bias, dtypes=(torch.float32,))
    assert_spec(rw.spec, "bias", "nan")
    assert tuple(example_value(rw.spec.bias).shape) == (2, 1, 1, 6)


@pytest.mark.parametrize("dynamic", [False, True])
def test_old_tutorial_square_subsequent_mask(dynamic):
    """PyTorch's old tutorial: (triu(ones) == 1).transpose(0, 1), then .float() filled -inf / 0.0."""

    def fn(q, k, v):
        sz = q.shape[-2]
        mask = (torch.triu(torch.ones(sz, sz)) == 1).transpose(0, 1)
        mask = mask.float().masked_fill(mask == 0, float("-inf")).masked_fill(mask == 1, float(0.0))
        return (q @ k.transpose(-2, -1) + mask).softmax(-1) @ v

    rw = compile_and_check(fn, *qkv(), dtypes=(torch.float32,), dynamic_dim=2 if dynamic else None,
                           more=(qkv(nq=9, nk=9, seed=2),) if dynamic else ())
    assert_spec(rw.spec, "causal", "impossible", diag_offset=0)
    assert nxn_nodes(rw.graphs[-1], 6, 6) == []


def test_triu_times_large_negative_passes_untouched():
    """s + triu(1) * -1e9 keeps s in s - 1e9 (fp32): exact only as the op's float bias, never as causal."""

    def fn(q, k, v):
        t = q.shape[-2]
        return (q @ k.transpose(-2, -1) + torch.triu(torch.ones(t, t), diagonal=1) * -1e9).softmax(-1) @ v

    rw = compile_and_check(fn, *qkv(), dtypes=(torch.float32,), dynamic_dim=2, more=(qkv(nq=8, nk=8, seed=1),))
    assert_spec(rw.spec, "bias", "nan")


def test_triu_times_finfo_min_is_causal():
    """The same with finfo.min: s + c == c for every plausible score, so causal structure is exact."""

    def fn(q, k, v):
        t = q.shape[-2]
        c = torch.finfo(torch.float32).min
        return (q @ k.transpose(-2, -1) + torch.triu(torch.ones(t, t), diagonal=1) * c).softmax(-1) @ v

    rw = compile_and_check(fn, *qkv(), dtypes=(torch.float32,), dynamic_dim=2, more=(qkv(nq=8, nk=8, seed=1),))
    assert_spec(rw.spec, "causal", "impossible", diag_offset=0)


def test_symbolic_window_width_falls_back_to_the_mask():
    """A window whose width depends on the sequence length (T // 2) is no int window: the mask is passed."""

    def fn(q, k, v):
        t = q.shape[-2]
        i = torch.arange(t)[:, None]
        j = torch.arange(t)[None, :]
        keep = (j <= i) & (j > i - t // 2)
        return torch.where(keep, q @ k.transpose(-2, -1), NEG_INF).softmax(-1) @ v

    rw = compile_and_check(fn, *qkv(nq=8, nk=8), dtypes=(torch.float32,), dynamic_dim=2,
                           more=(qkv(nq=12, nk=12, seed=2),))
    assert_spec(rw.spec, "bool-mask", "nan")
    rw = compile_and_check(fn, *qkv(nq=8, nk=8), dtypes=(torch.float32,))
    assert_spec(rw.spec, "window", "impossible", window_left=3)


def test_refuse_fill_mask_not_bool():
    def fn(q, k, v, m):
        return (q @ k.transpose(-2, -1)).masked_fill(m.bool(), NEG_INF).softmax(-1) @ v

    gm, x = capture_terms(fn, *qkv(), torch.zeros(6, 6))
    float_mask = [n for n in gm.graph.nodes if n.op == "placeholder"][-1]
    reason = masks.analyze_mask(gm, [MaskTerm("fill", float_mask, NEG_INF)], batch=2, q_heads=2, q_len=6,
                                k_len=6, scores_dtype=torch.float32, insert_before=x)
    assert isinstance(reason, str) and "is not a bool tensor" in reason


@pytest.mark.parametrize("dynamic", [False, True])
def test_local_attention_abs_distance(dynamic):
    """Two-sided local window |i - j| <= 2 (Longformer-style): a window with left and right bounds."""

    def fn(q, k, v):
        t = q.shape[-2]
        pos = torch.arange(t)
        keep = (pos[:, None] - pos[None, :]).abs() <= 2
        return torch.where(keep, q @ k.transpose(-2, -1), NEG_INF).softmax(-1) @ v

    rw = compile_and_check(fn, *qkv(nq=8, nk=8), dtypes=(torch.float32,), dynamic_dim=2 if dynamic else None,
                           more=(qkv(nq=11, nk=11, seed=2),) if dynamic else ())
    assert_spec(rw.spec, "window", "impossible", causal=True, diag_offset=2, window_left=4)


def _pinned_code(fn, *args) -> str:
    rw = Rewriter()
    torch._dynamo.reset()
    torch.compile(fn, backend=rw, fullgraph=True)(*args)
    return rw.graphs[-1].code.strip()


def test_pinned_graph_causal_and_padding():
    """The rewritten graph: causal as a flag, the [B, 1, 1, Nk] padding as bias, no mask-building left."""

    def fn(q, k, v, am):
        nq, nk = q.shape[-2], k.shape[-2]
        mask = (torch.arange(nk)[None, :] <= torch.arange(nq)[:, None]) & am.bool()[:, None, None, :]
        s = q @ k.transpose(-2, -1) + torch.where(mask, 0.0, torch.finfo(q.dtype).min)
        return s.softmax(-1) @ v

    am = torch.ones(2, 6, dtype=torch.long)
    expecttest.assert_expected_inline(_pinned_code(fn, *qkv(), am), """\
def forward(self, L_q_ : torch.Tensor, L_k_ : torch.Tensor, L_am_ : torch.Tensor, L_v_ : torch.Tensor):
    l_q_ = L_q_
    l_k_ = L_k_
    l_am_ = L_am_
    l_v_ = L_v_
    bool_1 = l_am_.bool();  l_am_ = None
    getitem_2 = bool_1[(slice(None, None, None), None, None, slice(None, None, None))];  bool_1 = None
    attention_default = torch.ops.fa3.attention.default(l_q_, l_k_, l_v_, 1.0, True, 0, -1, -1, getitem_2, None, 0.0, 0.0, None, None);  l_q_ = l_k_ = getitem_2 = None
    getitem_3 = attention_default[0]
    getitem_4 = attention_default[1];  attention_default = None
    isneginf = torch.isneginf(getitem_4);  getitem_4 = None
    unsqueeze = torch.unsqueeze(isneginf, -1);  isneginf = None
    mean = torch.mean(l_v_, dim = 2, keepdim = True);  l_v_ = None
    to = mean.to(torch.float32);  mean = None
    where_1 = torch.where(unsqueeze, to, getitem_3);  unsqueeze = to = getitem_3 = None
    return (where_1,)""")


def test_pinned_graph_key_lengths():
    def fn(q, k, v, lens):
        keep = torch.arange(k.shape[-2])[None, :] < lens[:, None]
        return (q @ k.transpose(-2, -1)).masked_fill(~keep[:, None, None, :], NEG_INF).softmax(-1) @ v

    expecttest.assert_expected_inline(_pinned_code(fn, *qkv(), torch.tensor([6, 2])), """\
def forward(self, L_k_ : torch.Tensor, L_lens_ : torch.Tensor, L_q_ : torch.Tensor, L_v_ : torch.Tensor):
    l_k_ = L_k_
    l_lens_ = L_lens_
    l_q_ = L_q_
    l_v_ = L_v_
    getitem_1 = l_lens_[(slice(None, None, None), None)];  l_lens_ = None
    reshape = torch.reshape(getitem_1, (-1,));  getitem_1 = None
    clamp = reshape.clamp(0, 2147483647);  reshape = None
    to = clamp.to(torch.int32);  clamp = None
    attention_default = torch.ops.fa3.attention.default(l_q_, l_k_, l_v_, 1.0, False, 0, -1, -1, None, to, 0.0, 0.0, None, None);  l_q_ = l_k_ = l_v_ = to = None
    getitem_3 = attention_default[0]
    getitem_4 = attention_default[1];  attention_default = None
    isneginf = torch.isneginf(getitem_4);  getitem_4 = None
    unsqueeze = torch.unsqueeze(isneginf, -1);  isneginf = None
    full_like = torch.full_like(getitem_3, nan)
    where = torch.where(unsqueeze, full_like, getitem_3);  unsqueeze = full_like = getitem_3 = None
    return (where,)""")


def test_additive_minus_1e9_mask_with_empty_rows_passes_untouched():
    """where(keep, 0, -1e9) added in fp32 keeps s in s - 1e9: a fully masked row is softmax(s), not uniform.
    Structure would need -inf masking plus a uniform fix-up, which is wrong there, so the mask is passed."""

    def fn(q, k, v):
        t = q.shape[-2]
        keep = torch.arange(t)[None, :] < torch.arange(t)[:, None]  # row 0 admits no key
        s = q @ k.transpose(-2, -1) * 20.0  # scores large enough that s - 1e9 does not round to -1e9
        return (s + torch.where(keep, 0.0, -1e9)).softmax(-1) @ v

    rw = compile_and_check(fn, *qkv(), dtypes=(torch.float32,))
    assert_spec(rw.spec, "bias", "nan")


def test_additive_minus_1e9_causal_passes_untouched():
    """The same -1e9 mask with the diagonal admitted: no row is empty, but a masked s - 1e9 still outweighs
    admissible scores below it, so only the untouched bias is exact."""

    def fn(q, k, v):
        t = q.shape[-2]
        keep = torch.arange(t)[None, :] <= torch.arange(t)[:, None]
        return (q @ k.transpose(-2, -1) + torch.where(keep, 0.0, -1e9)).softmax(-1) @ v

    rw = compile_and_check(fn, *qkv(), dtypes=(torch.float32,))
    assert_spec(rw.spec, "bias", "nan")  # (the op's own value on an empty row, were there one)


def test_unexpected_failure_is_a_reason_not_a_crash(monkeypatch):
    gm, x = capture_terms(lambda q, k, v, m: (q @ k.transpose(-2, -1)).masked_fill(m, NEG_INF).softmax(-1) @ v,
                          *qkv(), torch.zeros(6, 6, dtype=torch.bool))
    before = len(gm.graph.nodes)

    def boom(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(masks.analyze, "_emit_spec", boom)
    reason = masks.analyze_mask(gm, [MaskTerm("fill", x.args[1], NEG_INF)], batch=2, q_heads=2, q_len=6, k_len=6,
                                scores_dtype=torch.float32, insert_before=x)
    assert reason == "mask analysis failed: RuntimeError: boom"
    assert len(gm.graph.nodes) == before


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sdpa_float_mask_causal_padding(dtype):
    """SDPA with a float 0/finfo.min mask (older HF sdpa path): causal proven, padding residual, and
    left-padded rows stay SDPA's uniform average (a finite mask is not SDPA's all -inf zero case)."""

    def fn(q, k, v, am):
        nq, nk = q.shape[-2], k.shape[-2]
        keep = (torch.arange(nk)[None, :] <= torch.arange(nq)[:, None]) & am.bool()[:, None, None, :]
        mask = torch.where(keep, 0.0, torch.finfo(q.dtype).min).to(q.dtype)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    am = torch.ones(2, 6, dtype=torch.long)
    am[1, :2] = 0
    run = pipeline_check(fn, *qkv(), am, dtypes=(dtype,))
    assert [r.mask for r in run.reports] == ["causal+bool-mask"], run.reports
    assert nxn_nodes(run.graphs[-1], 6, 6) == []


@pytest.mark.parametrize("form", ["full_like", "zeros_like", "new_full"])
def test_masks_shaped_like_the_scores(form, ):
    """Masks built from the scores' own shape (full_like(s, -inf).triu(1), ...) depend on no score value."""

    def fn(q, k, v):
        s = q @ k.transpose(-2, -1)
        t = s.shape[-1]
        if form == "full_like":
            mask = torch.full_like(s, float("-inf")).triu(1)
        elif form == "zeros_like":
            mask = torch.zeros_like(s).masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
        else:
            mask = s.new_full((t, t), float("-inf")).triu(diagonal=1)
        return (s + mask).softmax(-1) @ v

    rw = compile_and_check(fn, *qkv(), dtypes=(torch.float32,), dynamic_dim=2, more=(qkv(nq=9, nk=9, seed=1),))
    assert_spec(rw.spec, "causal", "impossible")
    assert nxn_nodes(rw.graphs[-1], 6, 6) == []


# ----------------------------------------------------------------------------- random stacks: rewritten => equal

_FILLS = [NEG_INF, "min", -1e9, -1e4]


def _random_stack(rng):
    """A random stack of 1-3 mask terms (causal / window / padding / lengths / float biases, any fill)."""
    kinds = ["fill-band", "where-band", "add-band", "add-pad", "fill-pad", "add-bias", "fill-lens"]
    stack = []
    for _ in range(rng.randint(1, 3)):
        kind = rng.choice(kinds)
        stack.append((kind, rng.choice(_FILLS), rng.randint(-2, 3), rng.randint(0, 3)))
    return stack


def _apply_stack(stack, s, am, lens, bias):
    nq, nk = s.shape[-2], s.shape[-1]
    for kind, fill, diag, width in stack:
        c = torch.finfo(s.dtype).min if fill == "min" else fill
        i = torch.arange(nq)[:, None]
        j = torch.arange(nk)[None, :]
        band = (j - i <= diag) & (j - i >= diag - width - 1)
        if kind == "fill-band":
            s = s.masked_fill(~band, c)
        elif kind == "where-band":
            s = torch.where(band, s, c)
        elif kind == "add-band":
            s = s + torch.where(band, 0.0, c).to(s.dtype)
        elif kind == "add-pad":
            s = s + (1.0 - am[:, None, None, :]).to(s.dtype) * torch.finfo(s.dtype).min
        elif kind == "fill-pad":
            s = s.masked_fill(am[:, None, None, :] == 0, c)
        elif kind == "add-bias":
            s = s + bias
        else:
            s = s.masked_fill((torch.arange(nk)[None, :] >= lens[:, None])[:, None, None, :], c)
    return s


@pytest.mark.parametrize("seed", [*range(12), 36, 42])  # 36, 42: a fill overwriting an earlier -inf
def test_random_mask_stacks_rewritten_only_when_equal(seed):
    import random

    rng = random.Random(seed)
    stack = _random_stack(rng)

    def fn(q, k, v, am, lens, bias):
        s = q @ k.transpose(-2, -1)
        return _apply_stack(stack, s, am, lens, bias).softmax(-1) @ v

    g = torch.Generator().manual_seed(seed)
    am = (torch.rand(2, 7, generator=g) > 0.3).float()
    am[1] = 0.0 if seed % 3 == 0 else am[1]  # sometimes a sequence with no key at all
    lens = torch.tensor([7, rng.randint(0, 7)])
    bias = torch.randn(1, 2, 5, 7, generator=g)
    rw = compile_and_check(fn, *qkv(nq=5, nk=7, seed=seed), am, lens, bias, dtypes=(torch.float32,))
    assert len(rw.specs) == 1
    if isinstance(rw.spec, str):  # refused: must say why
        assert "fully masked rows" in rw.spec or "finite fill" in rw.spec, (stack, rw.spec)


def test_parameter_bias_is_never_folded():
    """A learned additive bias that is all zeros at compile time must stay a bias (it will train)."""

    class Learned(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.rel = torch.nn.Parameter(torch.zeros(1, 2, 6, 6))
            self.frozen = torch.nn.Parameter(torch.zeros(6, 6), requires_grad=False)

        def forward(self, q, k, v):
            return (q @ k.transpose(-2, -1) + self.rel + self.frozen).softmax(-1) @ v

    model = Learned()
    rw = compile_and_check(model, *qkv(), dtypes=(torch.float32,))
    assert isinstance(rw.spec, MaskSpec) and rw.spec.kind == "bias", rw.spec
    with torch.no_grad():
        model.rel.add_(torch.randn(1, 2, 6, 6))
        model.frozen.add_(torch.randn(6, 6))
    compiled = torch.compile(model, backend=Rewriter(), fullgraph=True)
    torch.testing.assert_close(compiled(*qkv()), model(*qkv()), **TOL[torch.float32])


@pytest.mark.parametrize("dynamic", [False, True])
def test_float_positions_and_threshold_comparisons(dynamic):
    """arange(...).float() positions and `mask < 0.5` on a 0/1 mask keep their meaning."""

    def fn(q, k, v):
        t = q.shape[-2]
        pos = torch.arange(t).float()
        tri = (pos[None, :] <= pos[:, None]).float()  # 1 on and below the diagonal
        return (q @ k.transpose(-2, -1)).masked_fill(tri < 0.5, NEG_INF).softmax(-1) @ v

    rw = compile_and_check(fn, *qkv(), dtypes=(torch.float32,), dynamic_dim=2 if dynamic else None,
                           more=(qkv(nq=9, nk=9, seed=1),) if dynamic else ())
    if dynamic:  # any length is admitted, and fp32 positions stop being exact at 2**24: not proven
        assert_spec(rw.spec, "bool-mask", "nan")
    else:
        assert_spec(rw.spec, "causal", "impossible")


@pytest.mark.parametrize("name,kind", [("llama", "causal+bool-mask"), ("mistral", "window+bool-mask")])
def test_hf_masks_dynamic_true(name, kind):
    """dynamic=True: one graph serves every sequence length and keeps the proven structure."""
    model = _hf_model(name, "eager")
    run = PipelineRun()
    torch._dynamo.reset()
    compiled = torch.compile(lambda i, a: model(input_ids=i, attention_mask=a).logits, backend=run, dynamic=True)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for t in (6, 9, 13):
            ids = torch.randint(0, 32, (2, t), generator=g)
            am = torch.ones(2, t, dtype=torch.long)
            am[0, :2] = 0
            torch.testing.assert_close(compiled(ids, am), model(input_ids=ids, attention_mask=am).logits,
                                       **TOL[torch.float32])
    assert len(run.graphs) == 1
    assert [r.mask for r in run.reports] == [kind]


def _legacy_fill_then_add(subsumed: bool):
    """where(causal, s, finfo.min) then an added 0/finfo.min mask: key padding only (legacy GPT-2 style),
    or causal & padding (GPT-Neo with HF's mask), which masks every filled entry again."""
    MIN = torch.finfo(torch.float32).min

    def fn(q, k, v, am):
        n = q.shape[-2]
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        s = torch.where(causal, q @ k.transpose(-1, -2) * 0.5, MIN)
        keep = am[:, None, None, :].bool()
        if subsumed:
            keep = keep & causal
        return (s + torch.where(keep, 0.0, MIN)).softmax(-1) @ v

    return fn


@pytest.mark.parametrize("subsumed", [False, True])
def test_finite_fill_passed_as_additive_bias_keeps_eager_gradient(subsumed):
    """Passing masked_fill(T, finfo.min) as + where(T, finfo.min, 0) gives the filled scores softmax's
    gradient on a fully masked row (uniform there), eager's fill gives them none: exact when a later added
    mask masks every filled entry too (their sum is -inf), else through MaskSpec.filled (emit removes it)."""
    fn = _legacy_fill_then_add(subsumed)
    q, k, v = (t.requires_grad_() for t in qkv(nq=6, nk=6, d=4, seed=9))
    am = torch.ones(2, 6)
    am[1, :3] = 0  # left padding: queries 0..2 of row 1 see no key
    rw = Rewriter()
    got = torch.compile(fn, backend=rw, fullgraph=True)(q, k, v, am)
    ref = fn(q, k, v, am)
    torch.testing.assert_close(got, ref, **TOL[torch.float32])
    assert isinstance(rw.spec, MaskSpec) and (rw.spec.filled is None) == subsumed, rw.spec
    dout = torch.randn(ref.shape, generator=torch.Generator().manual_seed(10))
    for name, a, b in zip("qkv", torch.autograd.grad(got, (q, k, v), dout), torch.autograd.grad(ref, (q, k, v), dout)):
        torch.testing.assert_close(a, b, **TOL[torch.float32], msg=name)
    with torch.no_grad():  # no gradient: the additive form is exact
        rw = Rewriter()
        got = torch.compile(fn, backend=rw, fullgraph=True)(q, k, v, am)
        assert isinstance(rw.spec, MaskSpec) and rw.spec.kind == "bias", rw.spec
        torch.testing.assert_close(got, fn(q, k, v, am), **TOL[torch.float32])


def test_bias_then_finfo_min_fill_overwrites_empty_rows():
    """MPT: s + alibi (here a learned bias), then masked_fill(causal | padding, finfo.min). The fill comes
    last, so a fully masked row is all finfo.min in eager: uniform, and no gradient to q, k or the bias
    there. The structure is extracted, the bias passed, empty rows are the mean of V."""
    MIN = torch.finfo(torch.float32).min
    bias = torch.nn.Parameter(torch.randn(1, 2, 6, 6, generator=torch.Generator().manual_seed(11)))

    def fn(q, k, v, am):
        n = q.shape[-2]
        masked = torch.ones(n, n, dtype=torch.bool).triu(1) | ~am[:, None, None, :].bool()
        return ((q @ k.transpose(-1, -2) * 0.5 + bias).masked_fill(masked, MIN)).softmax(-1) @ v

    q, k, v = (t.requires_grad_() for t in qkv(nq=6, nk=6, d=4, seed=12))
    am = torch.ones(2, 6)
    am[1, :3] = 0  # left padding: queries 0..2 of row 1 see no key
    rw = Rewriter()
    got = torch.compile(fn, backend=rw, fullgraph=True)(q, k, v, am)
    assert_spec(rw.spec, "bool-mask+bias", "mean_v")
    ref = fn(q, k, v, am)
    torch.testing.assert_close(got, ref, **TOL[torch.float32])
    dout = torch.randn(ref.shape, generator=torch.Generator().manual_seed(13))
    ins = (q, k, v, bias)
    for name, a, b in zip(("q", "k", "v", "bias"), torch.autograd.grad(got, ins, dout), torch.autograd.grad(ref, ins, dout)):
        torch.testing.assert_close(a, b, **TOL[torch.float32], msg=name)


def test_finfo_min_fill_then_added_bias_is_still_refused_on_empty_rows():
    """The other order: masked_fill(finfo.min) then + bias keeps the bias on a fully masked row
    (softmax(bias) in eager, not uniform): no structure may be extracted."""
    MIN = torch.finfo(torch.float32).min
    bias = torch.randn(1, 2, 6, 6, generator=torch.Generator().manual_seed(14))

    def fn(q, k, v, am):
        masked = ~am[:, None, None, :].bool()
        return ((q @ k.transpose(-1, -2)).masked_fill(masked, MIN) + bias).softmax(-1) @ v

    am = torch.ones(2, 6)
    am[1] = 0
    rw = compile_and_check(fn, *qkv(), am, dtypes=(torch.float32,))
    assert isinstance(rw.spec, str) or rw.spec.empty_rows != "mean_v", rw.spec
