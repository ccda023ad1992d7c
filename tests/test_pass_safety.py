"""A refusal never fails the compile: what the pass cannot take it leaves exactly as the user wrote
it, with a reason in explain(). Scalar arguments the op rejects are refused at the site; an
exception inside any rewrite (injected here) costs that site only, its partial edits rolled back;
one that escapes a step of the pass gives the user back the graph Dynamo traced."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fa_compile
from fa_compile.compiler import run_pass
from fa_compile.patterns import emit, fused_calls, fused_common, find_sites, pipeline
from eager_diff import check, rand
from fused_helpers import graph_summary

B, H, N, D = 2, 2, 8, 16


def qkv(requires_grad: bool = True) -> list:
    return [rand(B, H, N, D, seed=i, requires_grad=requires_grad) for i in range(3)]


# ------------------------------------------------------------------- scalars the op would reject


def sdpa_dropout_one(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, dropout_p=1.0)


def sdpa_nan_scale(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, scale=float("nan"))


def sdpa_inf_scale(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, scale=math.inf)


def softmax_dropout_one(q, k, v):
    return F.dropout((q @ k.mT * 0.25).softmax(-1), p=1.0, training=True) @ v


def softmax_scale_overflows(q, k, v):
    return (q @ k.mT / 1e-200 / 1e-200).softmax(-1) @ v  # the Python scale is inf, eager's scores too


class MHADropoutOne(nn.Module):
    def __init__(self):
        super().__init__()
        self.mha = nn.MultiheadAttention(D, H, dropout=1.0, batch_first=True)

    def forward(self, x):
        return self.mha(x, x, x, need_weights=False)[0]


SCALARS = {
    sdpa_dropout_one: "dropout_p=1.0 is outside [0, 1)",
    sdpa_nan_scale: "scale=nan is not finite",
    sdpa_inf_scale: "scale=inf is not finite",
    softmax_dropout_one: "dropout with p >= 1",
    softmax_scale_overflows: "scale is not finite",
}


@pytest.mark.parametrize("fn", list(SCALARS), ids=lambda f: f.__name__)
def test_rejected_scalars_are_refused_at_the_site(fn):
    res = check(fn, qkv(), rewritten=0)
    assert any(SCALARS[fn] in r for r in res.reasons), res.reasons


def test_rejected_scalars_with_inductor():
    res = check(sdpa_dropout_one, qkv(), inner="inductor", rewritten=0)
    assert any("dropout_p=1.0" in r for r in res.reasons), res.reasons


def test_mha_training_dropout_one_is_refused():
    m = MHADropoutOne().train()
    res = check(m, [rand(B, N, D, seed=3, requires_grad=True)], rewritten=0)
    assert any("dropout_p=1.0 is outside [0, 1)" in r for r in res.reasons), res.reasons


# ------------------------------------------------------------------------- injected failures


class Injected(RuntimeError):
    pass


def _emit_then_fail(real):
    def emit_attention(graph, *args, **kwargs):
        real(graph, *args, **kwargs)  # the op and its glue are in the graph when the failure comes
        raise Injected("injected failure after emitting")
    return emit_attention


def softmax_site(q, k, v):
    return (q @ k.mT * 0.25).softmax(-1) @ v


def sdpa_site(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def two_sites(q, k, v):
    return softmax_site(q, k, v) + sdpa_site(q, k, v)


def _assert_left_as_traced(fn, args, why: str) -> None:
    """The pass reports `why` for every site and leaves Dynamo's graph node for node as it was."""
    seen: list = []

    def backend(gm, example_inputs):
        before = graph_summary(gm)
        reports = run_pass(gm)
        seen.append((before, graph_summary(gm), reports))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=backend, fullgraph=True)(*args)
    (before, after, reports), = seen
    assert after == before
    assert reports and all(not r.rewritten and why in r.reason for r in reports), [r.reason for r in reports]


@pytest.mark.parametrize("fn", [softmax_site, sdpa_site], ids=lambda f: f.__name__)
def test_failure_inside_a_rewrite_costs_that_site_only(fn, monkeypatch):
    monkeypatch.setattr(emit, "emit_attention", _emit_then_fail(emit.emit_attention))
    res = check(fn, qkv(), rewritten=0)
    assert any("Injected: injected failure after emitting" in r for r in res.reasons), res.reasons
    _assert_left_as_traced(fn, qkv(), "injected failure after emitting")
    rep = fa_compile.explain(fn, *qkv(requires_grad=False))
    assert "injected failure after emitting" in str(rep)


def test_failure_after_the_uses_were_repointed_is_rolled_back(monkeypatch):
    real = fused_common.replace_output

    def replace_then_fail(graph, old, new):
        real(graph, old, new)
        raise Injected("injected failure after repointing")

    monkeypatch.setattr(fused_common, "replace_output", replace_then_fail)
    res = check(two_sites, qkv())
    assert len(res.rewritten) == 1 and res.rewritten[0].form != "sdpa"
    assert any("injected failure after repointing" in r for r in res.reasons), res.reasons


def test_failure_on_one_site_keeps_the_others(monkeypatch):
    def fail(*args, **kwargs):
        raise Injected("injected failure in the glue")

    monkeypatch.setattr(find_sites.rewrite, "needs_contiguous", fail)
    res = check(two_sites, qkv())
    assert [r.form for r in res.rewritten] == ["sdpa"]
    assert any("injected failure in the glue" in r for r in res.reasons), res.reasons


@pytest.mark.parametrize("where", ["canonicalize", "fused calls", "softmax sites", "finish"])
def test_failure_escaping_a_step_restores_the_traced_graph(where, monkeypatch):
    def boom(*args, **kwargs):
        raise Injected(f"injected failure in {where}")

    if where == "canonicalize":
        monkeypatch.setattr(pipeline, "canonicalize", boom)
    elif where == "fused calls":
        real_visit = fused_calls._visit

        def visit_then_fail(graph, node, *args):
            real_visit(graph, node, *args)
            if any(n.op == "call_function" and n.target is torch.ops.fa3.attention.default for n in graph.nodes):
                boom()  # after one site was rewritten: its edits must go too

        monkeypatch.setattr(fused_calls, "_visit", visit_then_fail)
    elif where == "softmax sites":
        monkeypatch.setattr(find_sites.rewrite, "Regions", boom)
    else:
        real_finish = pipeline._finish

        def finish_then_fail(gm, reports, *rest):
            real_finish(gm, reports, *rest)
            boom()

        monkeypatch.setattr(pipeline, "_finish", finish_then_fail)
    res = check(two_sites, qkv(), rewritten=0)
    assert any(f"injected failure in {where}" in r for r in res.reasons), res.reasons
    _assert_left_as_traced(two_sites, qkv(), f"injected failure in {where}")
    assert f"injected failure in {where}" in str(fa_compile.explain(two_sites, *qkv(requires_grad=False)))


def test_failure_escaping_a_step_with_inductor(monkeypatch):
    monkeypatch.setattr(find_sites.rewrite, "Regions", lambda gm: (_ for _ in ()).throw(Injected("injected")))
    check(two_sites, qkv(), inner="inductor", rewritten=0)


# ------------------------------------------------------------------- what the pass leaves in the graph


def attention_beside_vmap(q, k, v, x, y):
    o = torch.softmax(q @ k.transpose(-1, -2) * 0.125, dim=-1) @ v
    a, b = torch.vmap(lambda s, t: (s * t, s + t))(x, y)  # `a` is never read
    return o, b


@pytest.mark.parametrize("inner", ["aot_eager", "inductor"])
def test_unread_nodes_the_program_kept_survive_the_rewrite(inner):
    """torch.vmap's _vmap_increment_nesting / _vmap_decrement_nesting have no users; the pass's final
    dead-code sweep removes only what its rewrites left unread, or AOTAutograd's replay of the batch
    levels fails (Jamba, Zamba)."""
    q, k, v = qkv(requires_grad=False)
    x, y = rand(3, 5, seed=7), rand(3, 5, seed=8)
    reports: list = []
    be = fa_compile.backend(inner)

    def backend(gm, example_inputs):
        reports.extend(run_pass(gm))
        return be(gm, example_inputs)

    torch._dynamo.reset()
    got = torch.compile(attention_beside_vmap, backend=backend, fullgraph=True)(q, k, v, x, y)
    want = attention_beside_vmap(q, k, v, x, y)
    assert [r.rewritten for r in reports] == [True]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=2e-5)


# ------------------------------------------------------------------- the caller's context at compile time


@pytest.mark.parametrize("inner", ["eager", "aot_eager", "inductor"])
def test_first_call_inside_non_reentrant_checkpoint(inner):
    """The compile happens at the first call, here inside torch.utils.checkpoint(use_reentrant=False),
    whose saved-tensor hooks count every tensor autograd saves: the pass's own fake-tensor example values
    must not add to that count (the recomputation would see fewer saves and the backward raise)."""
    from torch.utils.checkpoint import checkpoint

    def attn(q, k, v):
        return (q @ k.transpose(-1, -2) * 0.3).softmax(-1) @ v

    got_args, want_args = qkv(), qkv()
    torch._dynamo.reset()
    compiled = torch.compile(attn, backend=fa_compile.backend(inner))
    out = checkpoint(compiled, *got_args, use_reentrant=False)
    want = attn(*want_args)
    torch.testing.assert_close(out, want, atol=2e-5, rtol=2e-5)
    g = rand(*want.shape, seed=9)
    out.backward(g)
    want.backward(g)
    for a, b in zip(got_args, want_args):
        torch.testing.assert_close(a.grad, b.grad, atol=2e-5, rtol=2e-5)
