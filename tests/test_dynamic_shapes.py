"""Issue 3 item 7: with dynamic=True, and with torch._dynamo.mark_dynamic on the sequence dim, a model
compiled once serves other sequence lengths without a recompile per length, and keeps its rewrite.

Compiles are counted by the capturing backend (one call per graph Dynamo compiles) and cross-checked
with torch._dynamo.utils.counters["stats"]["unique_graphs"].
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.utils import counters

from fused_helpers import Capture, assert_same, count_attention

LENGTHS = (5, 7, 12)  # >= 2: Dynamo specializes sizes 0 and 1
TOL = dict(atol=2e-5, rtol=2e-5)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def serve(fn, make_args, *, mode: str, seq_dims, inner="eager", no_grad=False):
    """Compile fn once and call it at every length; return the capture (graphs, reports, compiles)."""
    cap = Capture(inner)
    compiled = torch.compile(fn, backend=cap, dynamic=True if mode == "dynamic" else None)
    for n in LENGTHS:
        args = make_args(n)
        if mode == "mark_dynamic":
            for a, d in zip(args, seq_dims):
                if d is not None:
                    torch._dynamo.mark_dynamic(a, d)
        with torch.set_grad_enabled(not no_grad):
            out, ref = compiled(*args), fn(*args)
        assert_same(out, ref, **TOL)
    return cap


def assert_one_compile_with_rewrite(cap, sites=1):
    assert cap.compiles == 1, f"{cap.compiles} compiles for {len(LENGTHS)} lengths"
    assert counters["stats"]["unique_graphs"] == 1
    assert [r.rewritten for r in cap.reports] == [True] * sites, [r.reason for r in cap.reports]
    assert count_attention(cap.graphs[0]) == sites
    # the rewritten graph really is symbolic in the sequence length (not specialized to the first)
    q = cap.reports[0].call.args[0].meta["example_value"]
    assert isinstance(q.shape[2], torch.SymInt), q.shape


MODES = ["dynamic", "mark_dynamic"]


def qkv(n, h=4, hkv=4, d=8, seed=0):
    g = torch.Generator().manual_seed(seed + n)
    return (torch.randn(2, h, n, d, generator=g), torch.randn(2, hkv, n, d, generator=g),
            torch.randn(2, hkv, n, d, generator=g))


@pytest.mark.parametrize("mode", MODES)
def test_sdpa_causal(mode):
    fn = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)
    cap = serve(fn, qkv, mode=mode, seq_dims=(2, 2, 2))
    assert_one_compile_with_rewrite(cap)


@pytest.mark.parametrize("mode", MODES)
def test_sdpa_gqa_with_mask_built_in_the_graph(mode):
    def fn(q, k, v):
        n = q.shape[2]
        keep = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        return F.scaled_dot_product_attention(q, k, v, attn_mask=keep, enable_gqa=True)

    cap = serve(fn, lambda n: qkv(n, h=4, hkv=2), mode=mode, seq_dims=(2, 2, 2))
    assert_one_compile_with_rewrite(cap)
    assert cap.reports[0].mask == "causal"


@pytest.mark.parametrize("mode", MODES)
def test_sdpa_padding_mask_input(mode):
    def make(n):
        q, k, v = qkv(n)
        keep = torch.ones(2, 1, 1, n, dtype=torch.bool)
        keep[1, ..., n - 2:] = False
        return q, k, v, keep

    fn = lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m)
    cap = serve(fn, make, mode=mode, seq_dims=(2, 2, 2, 3))
    assert_one_compile_with_rewrite(cap)


@pytest.mark.parametrize("mode", MODES)
def test_multihead_attention_eval(mode):
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(16, 4, batch_first=True).eval()
    fn = lambda x: mha(x, x, x, need_weights=False)[0]
    make = lambda n: (torch.randn(2, n, 16, generator=torch.Generator().manual_seed(n)),)
    cap = serve(fn, make, mode=mode, seq_dims=(1,))
    assert_one_compile_with_rewrite(cap)


def test_multihead_attention_training_with_mark_dynamic_gradients():
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(16, 4, batch_first=True, dropout=0.0).train()
    fn = lambda x: mha(x, x, x, need_weights=False)[0]
    cap = Capture("aot_eager")
    compiled = torch.compile(fn, backend=cap)
    for n in LENGTHS:
        x = torch.randn(2, n, 16, generator=torch.Generator().manual_seed(n), requires_grad=True)
        torch._dynamo.mark_dynamic(x, 1)
        out = compiled(x)
        (gx,) = torch.autograd.grad(out.square().sum(), x)
        ref = fn(x)
        (rx,) = torch.autograd.grad(ref.square().sum(), x)
        assert_same(out, ref, **TOL)
        torch.testing.assert_close(gx, rx, **TOL)
    assert_one_compile_with_rewrite(cap)


def test_multihead_attention_training_dynamic_true_refuses_symbolic_dropout():
    """dynamic=True turns the module's dropout float into a graph input: the site is left alone, with
    that reason, and still compiles once."""
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(16, 4, batch_first=True, dropout=0.0).train()
    fn = lambda x: mha(x, x, x, need_weights=False)[0]
    make = lambda n: (torch.randn(2, n, 16, generator=torch.Generator().manual_seed(n)),)
    cap = serve(fn, make, mode="dynamic", seq_dims=(1,))
    assert cap.compiles == 1
    assert [r.rewritten for r in cap.reports] == [False]
    assert "dropout_p is a symbolic float" in cap.reports[0].reason


class DropoutModuleAttention(nn.Module):
    """Hand-written attention with nn.Dropout on the probabilities: under dynamic=True its float p is a graph
    input (`p.item()`), not a constant."""

    def __init__(self, p: float):
        super().__init__()
        self.drop = nn.Dropout(p)

    def forward(self, q, k, v):
        return self.drop((q @ k.transpose(-2, -1) * 0.35).softmax(-1)) @ v


def test_dropout_module_in_eval_under_dynamic_true_is_the_identity():
    cap = serve(DropoutModuleAttention(0.1).eval(), qkv, mode="dynamic", seq_dims=(2, 2, 2))
    assert_one_compile_with_rewrite(cap)


def test_dropout_module_in_training_under_dynamic_true_reads_p_as_a_checked_constant():
    # the graph input `p.item()` is read as a constant the backend checks on every call (test_constant_guard.py
    # changes it between calls), as a float scale is
    m = DropoutModuleAttention(0.0).train()  # p=0 so eager's result is deterministic
    cap = serve(m, qkv, mode="dynamic", seq_dims=(2, 2, 2))
    assert_one_compile_with_rewrite(cap)


@pytest.mark.parametrize("mode", MODES)
def test_transformer_encoder_layer_fast_path(mode):
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 4, 32, batch_first=True).eval()
    make = lambda n: (torch.randn(2, n, 16, generator=torch.Generator().manual_seed(n)),)
    cap = serve(lambda x: layer(x), make, mode=mode, seq_dims=(1,), no_grad=True)
    assert_one_compile_with_rewrite(cap)


@pytest.mark.parametrize("mode", MODES)
def test_hf_gpt2_sdpa(mode):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=97, n_positions=64, bos_token_id=0,
                                  eos_token_id=0, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    fn = lambda ids: model(input_ids=ids).logits
    make = lambda n: (torch.randint(0, 97, (2, n), generator=torch.Generator().manual_seed(n)),)
    cap = serve(fn, make, mode=mode, seq_dims=(1,), no_grad=True)
    assert_one_compile_with_rewrite(cap, sites=2)


@pytest.mark.parametrize("mode", MODES)
def test_hand_written_causal_attention(mode):
    """The hand-written recognizer (find_sites) under symbolic sequence lengths."""

    def fn(q, k, v):
        n = q.shape[2]
        s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
        return torch.softmax(s, dim=-1) @ v

    cap = serve(fn, qkv, mode=mode, seq_dims=(2, 2, 2))
    assert_one_compile_with_rewrite(cap)
    assert cap.reports[0].mask == "causal"


def test_compiled_with_inductor_serves_other_lengths():
    """The same with the default inner compiler (Inductor on CPU): one compile, outputs match."""
    fn = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)
    import fa_compile

    cap = Capture()
    be = fa_compile.backend(inner="inductor")

    def counting(gm, example_inputs):
        cap.compiles += 1
        return be(gm, example_inputs)

    compiled = torch.compile(fn, backend=counting, dynamic=True)
    for n in LENGTHS:
        q, k, v = qkv(n)
        assert_same(compiled(q, k, v), fn(q, k, v), **TOL)
    assert cap.compiles == 1
    assert counters["fa_compile"]["sites_rewritten"] == 1


class _PaddedCausalSelfAttention(nn.Module):
    """Hand-written attention under a causal mask and a key-padding mask read from an input (finfo.min fill)."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(16, 48)

    def forward(self, x, am):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, 2, 8).permute(2, 0, 3, 1, 4)
        keep = torch.ones(n, n, dtype=torch.bool).tril()[None, None] & am[:, None, None, :].bool()
        s = (q @ k.transpose(-1, -2) * 8 ** -0.5).masked_fill(~keep, torch.finfo(torch.float32).min)
        return (torch.softmax(s, -1) @ v).transpose(1, 2).reshape(b, n, 16)


@pytest.mark.parametrize("mode", MODES)
def test_training_with_a_padding_mask_input_compiles_once_under_inductor(mode):
    """Training under Inductor: the lowered forward folds the empty-row fix-up only where the out it saves keeps the
    strides the backward was traced with. It gave that out other strides, which AOTAutograd wrote into the
    backward's input as numbers: mark_dynamic raised a ConstraintViolationError and dynamic=True recompiled at
    every length."""
    import fa_compile

    torch.manual_seed(0)
    model = _PaddedCausalSelfAttention()
    ref_model = _PaddedCausalSelfAttention()
    ref_model.load_state_dict(model.state_dict())
    compiles = 0
    be = fa_compile.backend(inner="inductor")

    def counting(gm, example_inputs):
        nonlocal compiles
        compiles += 1
        return be(gm, example_inputs)

    compiled = torch.compile(model, backend=counting, dynamic=True if mode == "dynamic" else None)
    for n in LENGTHS:
        x = torch.randn(2, n, 16, generator=torch.Generator().manual_seed(n))
        am = torch.ones(2, n, dtype=torch.long)
        am[1, :2] = 0  # left padding: the first rows of sequence 1 admit no key
        xs = [x.clone().requires_grad_(), x.clone().requires_grad_()]
        if mode == "mark_dynamic":
            torch._dynamo.mark_dynamic(xs[0], 1)
            torch._dynamo.mark_dynamic(am, 1)
        out, ref = compiled(xs[0], am), ref_model(xs[1], am)
        assert_same(out, ref, **TOL)
        g = torch.randn(out.shape, generator=torch.Generator().manual_seed(100 + n))
        out.backward(g)
        ref.backward(g)
        assert_same(xs[0].grad, xs[1].grad, **TOL)
        for (name, p), p_ref in zip(model.named_parameters(), ref_model.parameters()):
            assert_same(p.grad, p_ref.grad, **TOL)
            p.grad, p_ref.grad = None, None
    assert compiles == 1, f"{compiles} compiles for {len(LENGTHS)} lengths"
    assert counters["fa_compile"]["sites_rewritten"] == 1


_TRIU_N = 8  # a module constant: the mask's size stays static (a closure's int would be made symbolic too)


def _triu_offset_attention(q, k, v, off):
    s = (q @ k.transpose(-1, -2) * 0.3).masked_fill(torch.ones(_TRIU_N, _TRIU_N, dtype=torch.bool).triu(off), -math.inf)
    return torch.softmax(s, -1) @ v


def test_run_time_diagonal_offset_keeps_the_op_without_a_failed_lowering():
    # torch.ones(N, N).triu(off) with `off` a Python int, symbolic under dynamic=True: the site's diagonal offset is
    # a run-time value the traced math of a small inference site cannot read. The lowering refuses it up front (the
    # op and its run-time dispatch stay), where it had failed inside Inductor with a warning.
    import warnings

    import fa_compile

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, _TRIU_N, 8, generator=g, requires_grad=True) for _ in range(3))
    f = _triu_offset_attention
    cf = torch.compile(f, backend=fa_compile.backend(), dynamic=True)
    for off in (1, 2, 3):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = cf(q, k, v, off)
        assert not [w for w in caught if "fa_compile" in str(w.message)], [str(w.message) for w in caught]
        want = f(q, k, v, off)
        torch.testing.assert_close(got, want, **TOL)
        gq, = torch.autograd.grad(got.sum(), q)
        wq, = torch.autograd.grad(want.sum(), q)
        torch.testing.assert_close(gq, wq, **TOL)
    assert counters["fa_compile"]["sites_rewritten"] >= 1


def _keys_cut_at_a_read_length(q, k, v, length):
    n = length.item()
    torch._check(n >= 1)
    torch._check(n <= k.shape[-2])
    k, v = k[:, :, :n], v[:, :, :n]
    return (q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5).softmax(-1) @ v


@pytest.mark.parametrize("dynamic", [False, True])
def test_a_key_length_read_with_item_keeps_the_op_and_trains(dynamic):
    # Keys cut to a length read from a tensor (an unbacked size): Inductor cannot lay out a lowered backward's
    # outputs there (GuardOnDataDependentSymNode failed the compile); the op and its run-time dispatch keep the site.
    import fa_compile
    from fa_compile.lowering import records

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, n, 8, generator=g, requires_grad=True) for n in (3, 8, 8))
    cf = torch.compile(_keys_cut_at_a_read_length, backend=fa_compile.backend(), dynamic=dynamic)
    n0 = len(records())
    for n in (5, 8):
        length = torch.tensor(n)
        with torch._dynamo.config.patch(capture_scalar_outputs=True), \
                torch._inductor.config.patch(fx_graph_cache=False), \
                torch._functorch.config.patch(enable_autograd_cache=False):  # a cache hit lowers nothing
            got = cf(q, k, v, length)
        want = _keys_cut_at_a_read_length(q, k, v, length)
        torch.testing.assert_close(got, want, **TOL)
        w = torch.randn(got.shape, generator=g)
        for a, b in zip(torch.autograd.grad((got * w).sum(), (q, k, v)),
                        torch.autograd.grad((want * w).sum(), (q, k, v))):
            torch.testing.assert_close(a, b, **TOL)
    assert counters["fa_compile"]["sites_rewritten"] >= 1
    kept = [r for r in records()[n0:] if not r.decision.lowered]
    assert {r.decision.direction for r in kept} == {"forward", "backward"}, records()[n0:]
    assert all("data-dependent sizes" in r.decision.reason for r in kept), kept


# ------------------------------------------------------------------ bounds decided at every size, not the first


def _window3(q, k, v):
    i, j = torch.arange(q.shape[-2])[:, None], torch.arange(k.shape[-2])[None, :]
    s = (q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5).masked_fill(~((i >= j) & (i - j < 3)), -1e4)
    return s.softmax(-1) @ v


def _causal_offset2(q, k, v):
    m = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril(2)
    return (q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5).masked_fill(~m, float("-inf")).softmax(-1) @ v


def _lower_band(q, k, v):
    m = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).triu(-2)
    return (q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5).masked_fill(~m, float("-inf")).softmax(-1) @ v


def _sdpa_band(q, k, v):
    m = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril().triu(-2)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=m)


@pytest.mark.parametrize("fn", [_window3, _causal_offset2, _lower_band, _sdpa_band], ids=lambda f: f.__name__)
def test_a_band_that_admits_every_key_at_the_first_length_is_kept_for_the_next(fn):
    # Compiled with dynamic=True at 3 queries, the window (or the offset causal bound) admits every key, and the
    # lowering dropped it by the size of that call: the same graph ran at 8 and 13 queries without it (1.0-2.2 off),
    # and Inductor's cache handed it to other processes. A bound is vacuous only when it is at every size.
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="fa3", dynamic=True)
    for n in (3, 8, 13):
        q, k, v = qkv(n, seed=n)
        mine = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        ref = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        got, want = compiled(*mine), fn(*ref)
        assert_same(got, want)
        g = torch.randn(got.shape, generator=torch.Generator().manual_seed(n))
        for a, b in zip(torch.autograd.grad(got, mine, g), torch.autograd.grad(want, ref, g)):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def _sdpa_causal_gqa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])


def _matmul_attention(q, k, v):
    return torch.softmax(q @ k.transpose(-1, -2) * 0.3, dim=-1) @ v


@pytest.mark.parametrize("fn", [_sdpa_causal_gqa, _matmul_attention], ids=["sdpa", "matmul"])
@pytest.mark.parametrize("dims,q_heads,kv_heads", [((1,), 2, 2), ((0, 1, 2), 2, 2), ((1,), 4, 2)],
                         ids=["heads", "bhn", "heads-gqa"])
@pytest.mark.parametrize("requires_grad", [False, True], ids=["inference", "training"])
def test_heads_marked_dynamic_compile_and_match_eager(fn, dims, q_heads, kv_heads, requires_grad):
    # The lowerings read the group Hq / Hkv as an int: int() of a symbolic head count added a guard that failed the
    # compile (ConstraintViolationError: "you marked ... as dynamic but your code specialized it"). The group now
    # comes from the symbols' ratio, and a site whose ratio is not a constant keeps the op.
    if fn is _matmul_attention and kv_heads != q_heads:
        pytest.skip("the matmul spelling has no head repeat here")
    g = torch.Generator().manual_seed(len(dims) + q_heads)
    q = torch.randn(2, q_heads, 8, 8, generator=g).requires_grad_(requires_grad)
    k, v = (torch.randn(2, kv_heads, 8, 8, generator=g).requires_grad_(requires_grad) for _ in range(2))
    args = [t.detach().clone().requires_grad_(requires_grad) for t in (q, k, v)]
    for t in args:  # the compiled call's own tensors (a clone does not carry the marks)
        for d in dims:
            torch._dynamo.mark_dynamic(t, d)
    got = torch.compile(fn, backend="fa3")(*args)
    want = fn(q, k, v)
    assert_same(got, want, **TOL)
    if requires_grad:
        go = torch.randn(want.shape, generator=g)
        for a, b in zip(torch.autograd.grad(got, args, go), torch.autograd.grad(want, (q, k, v), go)):
            assert_same(a, b, **TOL)


class FloatAttributes(nn.Module):
    """A softcap (Gemma 2's spelling) and a padding fill kept as Python floats: under dynamic=True Dynamo passes each
    as a graph input (a 0-d tensor read with .item()), not as a constant."""

    def __init__(self, softcap: float = 5.0, fill: float = torch.finfo(torch.float32).min):
        super().__init__()
        self.softcap, self.fill = softcap, fill

    def forward(self, q, k, v, lens):
        s = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
        s = torch.tanh(s / self.softcap) * self.softcap
        keep = torch.arange(k.shape[2])[None, :] < lens[:, None]
        return torch.softmax(s.masked_fill(~keep[:, None, None], self.fill), -1) @ v


class _DropoutAttribute(nn.Module):
    def __init__(self):
        super().__init__()
        self.p = 0.0

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, dropout_p=self.p)


def test_float_attributes_in_the_pre_grad_pass_are_guarded_constants():
    # FA_COMPILE=1's pass runs inside Inductor, where no backend can ask Dynamo to trace again: a float Dynamo made a
    # graph input under dynamic=True (MultiheadAttention's and SDPA's dropout_p) is specialized with a guard on its
    # value. It was refused ("dropout_p is a symbolic float"). A new value recompiles: p = 1 drops every weight.
    from fa_compile import ops  # noqa: F401  (registers torch.ops.fa3.attention)
    from fa_compile.compiler import PreGradRewritePass

    pass_, graphs = PreGradRewritePass(), []

    def backend(gm, example_inputs):
        pass_(gm.graph)
        graphs.append(gm)
        return gm.forward

    m = _DropoutAttribute()
    compiled = torch.compile(m, backend=backend, dynamic=True)
    op = torch.ops.fa3.attention.default
    for n in (6, 9):
        q, k, v = qkv(n)
        assert_same(compiled(q, k, v), m(q, k, v), **TOL)
    assert len(graphs) == 1 and sum(n.target is op for n in graphs[0].graph.nodes) == 1
    m.p = 1.0
    q, k, v = qkv(7)
    out = compiled(q, k, v)
    assert len(graphs) == 2, "a new dropout_p must recompile"
    assert torch.equal(out, torch.zeros_like(out)) and torch.equal(m(q, k, v), out)


@pytest.mark.parametrize("inner", ["eager", "aot_eager"])
def test_float_attributes_under_dynamic_true_are_checked_constants(inner):
    # Both were refused under dynamic=True: Dynamo passes such floats as graph inputs (Gemma 2's generate() rewrote
    # none of its sites there). The pass reads them as constants that the backend's check compares on every call; a
    # changed value runs the graph as traced ("eager"). Under AOTAutograd ("aot_eager", as under Inductor) Dynamo is
    # asked to trace again with the floats specialized, and its guards recompile for a new value.
    import warnings

    g = torch.Generator().manual_seed(0)
    m = FloatAttributes()
    cap = Capture(inner)
    torch._dynamo.reset()
    compiled = torch.compile(m, backend=cap, dynamic=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # unchanged values: the compiled graph runs
        for n in (6, 9):  # the second sequence fully padded: the finfo.min fill gives the mean of V there
            args = [torch.randn(2, 2, n, 8, generator=g, requires_grad=True) for _ in range(3)] + [torch.tensor([n, 0])]
            want, got = m(*args), compiled(*args)
            assert_same(got, want)
            grads = torch.autograd.grad(want.sum(), args[:3])
            for a, w in zip(torch.autograd.grad(got.sum(), args[:3]), grads):
                assert_same(a, w)
    last = cap.reports[-1]
    assert count_attention(cap.graphs[-1]) == 1 and last.rewritten and last.softcap == 5.0, cap.reports
    assert last.mask == "key-padding", last
    for softcap, fill in ((2.0, m.fill), (5.0, -1.0)):  # a new softcap; a fill that no longer absorbs
        m.softcap, m.fill = softcap, fill
        args = [torch.randn(2, 2, 7, 8, generator=g, requires_grad=True) for _ in range(3)] + [torch.tensor([7, 0])]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # ("eager": the check's fallback warns)
            assert_same(compiled(*args), m(*args))


def test_head_dims_marked_dynamic_each_are_not_lowered_on_one_calls_hint(monkeypatch, tmp_path):
    # q, k and v marked dynamic on their head dims apart: V's may differ from Q's on a later call, so aten's CPU
    # flash kernel (equal head dims) is not chosen on the first call's equal values; it was, and the splice's
    # check refused it with a warning
    import warnings

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))

    def causal(q, k, v):
        s = q @ k.transpose(-1, -2) * 0.5
        s = s.masked_fill(torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).triu(1), float("-inf"))
        return s.softmax(-1) @ v

    f = torch.compile(causal, backend="fa3")
    for d in (4, 8):
        args = [torch.randn(1, 2, 5, d, requires_grad=True) for _ in range(3)]
        for x in args:
            torch._dynamo.mark_dynamic(x, 3)
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            got = f(*[a.detach().clone().requires_grad_() for a in args])
        torch.testing.assert_close(got, causal(*args), atol=1e-5, rtol=1e-5)
