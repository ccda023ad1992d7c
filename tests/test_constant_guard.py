"""Rewrites that rest on a module buffer's values stay right when the buffer changes after compiling.

The mask analysis reads a static buffer (nanoGPT's lower-triangular `bias`, a positions buffer) as a
constant; Dynamo does not guard its contents. `fa_compile.backend()` checks each such buffer (same
object, same version counter) before every call and, once one changed, compiles the graph as traced again with the
buffers read as data (or runs it as traced where that cannot be done);
Inductor's pre-grad pass (FA_COMPILE=1), which cannot install that check, treats buffers as data.
"""
from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fa_compile
from fa_compile.compiler import PreGradRewritePass, run_pass
from conftest import TOL

T, C, H = 12, 32, 4


class TrilBufferAttention(nn.Module):
    """nanoGPT's causal self-attention: a [1, 1, T, T] tril buffer sliced and compared with 0."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(C, 3 * C)
        self.register_buffer("bias", torch.tril(torch.ones(T, T)).view(1, 1, T, T))

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = (z.view(b, t, H, c // H).transpose(1, 2) for z in self.qkv(x).split(c, dim=2))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :t, :t] == 0, float("-inf"))
        return (F.softmax(att, dim=-1) @ v).transpose(1, 2).reshape(b, t, c)


class PositionsBufferAttention(nn.Module):
    """A decode-style step: the keys a query sees end at a position kept in a buffer the caller moves."""

    def __init__(self):
        super().__init__()
        self.register_buffer("pos", torch.tensor(3))

    def forward(self, q, k, v):
        j = torch.arange(k.shape[2])
        s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        s = s.masked_fill((j > self.pos).view(1, 1, 1, -1), float("-inf"))
        return s.softmax(-1) @ v


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(TrilBufferAttention(), TrilBufferAttention())


def _x(seed: int = 0, requires_grad: bool = False) -> torch.Tensor:
    return torch.randn(2, 10, C, generator=torch.Generator().manual_seed(seed)).requires_grad_(requires_grad)


def _recording(inner: str, reports: list):
    be = fa_compile.backend(inner)

    def backend(gm, example_inputs):
        reports.extend(run_pass(gm))  # the backend's own pass is then a no-op: its guard still applies
        return be(gm, example_inputs)

    return backend


@pytest.mark.parametrize("inner", ["aot_eager", "inductor"])
def test_unchanged_buffers_keep_the_compiled_graph(inner):
    """Causality read from the buffers; training and inference calls pass the check (no fallback warning)."""
    model, reports = _model(), []
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=_recording(inner, reports))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        for seed in range(2):
            x_ref, x_got = _x(seed, True), _x(seed, True)
            ref, got = model(x_ref), compiled(x_got)
            torch.testing.assert_close(got, ref, **TOL[torch.float32])
            ref.pow(2).sum().backward()
            got.pow(2).sum().backward()
            torch.testing.assert_close(x_got.grad, x_ref.grad, **TOL[torch.float32])
        with torch.no_grad():
            torch.testing.assert_close(compiled(_x(5)), model(_x(5)), **TOL[torch.float32])
    assert reports and all(r.rewritten and r.mask == "causal" for r in reports), reports


def _change(model: nn.Module, change: str) -> None:
    window = torch.tril(torch.ones(T, T)) - torch.tril(torch.ones(T, T), -3)  # keys i-2..i only
    if change == "in_place":
        model[0].bias.copy_(window.view(1, 1, T, T))
    elif change == "new_data":
        model[0].bias.data = window.view(1, 1, T, T).clone()
    elif change == "swap_tensors":  # what module.to() does under swap_module_params_on_conversion
        torch.utils.swap_tensors(model[0].bias, window.view(1, 1, T, T).clone())
    else:
        model[0].bias = window.view(1, 1, T, T).clone()


@pytest.mark.parametrize("inner", ["aot_eager", "inductor"])
@pytest.mark.parametrize("change", ["in_place", "new_tensor", "new_data", "swap_tensors"])
def test_a_changed_buffer_compiles_the_graph_again_reading_it_as_data(inner, change, monkeypatch):
    # The graph as traced is rewritten and compiled again, once, with the buffers read as data (their masks reach
    # the op as boolean masks): no warning, and every later call runs that compiled graph.
    from fa_compile import compiler

    passes: list = []
    real_pass = compiler.run_pass

    def spy(gm, *args, **kwargs):
        reports = real_pass(gm, *args, **kwargs)
        passes.append((kwargs.get("constants", True), [(r.rewritten, r.mask) for r in reports]))
        return reports

    monkeypatch.setattr(compiler, "run_pass", spy)
    model = _model()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=fa_compile.backend(inner))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        torch.testing.assert_close(compiled(_x()), model(_x()), **TOL[torch.float32])
        assert passes == [(True, [(True, "causal")] * 2)], passes
        _change(model, change)
        for seed in (1, 2):
            torch.testing.assert_close(compiled(_x(seed)), model(_x(seed)), **TOL[torch.float32])
    assert passes[1:] == [(False, [(True, "bool-mask")] * 2)], passes


def test_a_changed_buffer_under_symbolic_shapes_runs_the_traced_graph():
    # Dynamo's symbols need its own context to compile the graph again: the graph as traced runs, with one warning
    model = _model()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=fa_compile.backend("aot_eager"), dynamic=True)
    with torch.no_grad():
        torch.testing.assert_close(compiled(_x()), model(_x()), **TOL[torch.float32])
        _change(model, "in_place")
        with pytest.warns(RuntimeWarning, match=r"_buffers\['bias'\].*changed since"):
            got = compiled(_x(1))
        torch.testing.assert_close(got, model(_x(1)), **TOL[torch.float32])
        torch.testing.assert_close(compiled(_x(2)), model(_x(2)), **TOL[torch.float32])


def test_a_compile_that_fails_again_runs_the_traced_graph(monkeypatch):
    from fa_compile import compiler

    model = _model()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=fa_compile.backend("aot_eager"))
    with torch.no_grad():
        torch.testing.assert_close(compiled(_x()), model(_x()), **TOL[torch.float32])

        def broken(*args, **kwargs):
            raise RuntimeError("no compiler here")

        monkeypatch.setattr(compiler, "_inner_compile", broken)
        _change(model, "in_place")
        with pytest.warns(RuntimeWarning, match="compiling the graph again with its buffers read as data failed"):
            got = compiled(_x(1))
        torch.testing.assert_close(got, model(_x(1)), **TOL[torch.float32])


def test_a_positions_buffer_moved_between_steps():
    model = PositionsBufferAttention()
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 1, 8, generator=g), torch.randn(1, 2, 9, 8, generator=g),
               torch.randn(1, 2, 9, 8, generator=g))
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=fa_compile.backend("aot_eager"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for step in range(3, 7):
            model.pos.fill_(step)
            torch.testing.assert_close(compiled(q, k, v), model(q, k, v), **TOL[torch.float32])


def test_pre_grad_pass_reads_no_buffer():
    """FA_COMPILE=1's pass cannot check the buffers: they are data, and a later write is honoured."""
    model = _model()
    torch._dynamo.reset()
    pass_, graphs = PreGradRewritePass(), []

    def backend(gm, example_inputs):
        pass_(gm.graph)
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(model, backend=backend)
    with torch.no_grad():
        torch.testing.assert_close(compiled(_x()), model(_x()), **TOL[torch.float32])
        op = torch.ops.fa3.attention.default
        assert sum(n.target is op for gm in graphs for n in gm.graph.nodes) == 2
        model[1].bias.zero_()  # every key masked: eager's rows are NaN
        torch.testing.assert_close(compiled(_x(1)), model(_x(1)), equal_nan=True, **TOL[torch.float32])


def test_pre_grad_pass_still_rewrites_the_site():
    reports: list = []
    model = _model()

    def backend(gm, example_inputs):
        reports.extend(run_pass(gm, constants=False))
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(model, backend=backend)(_x())
    assert [(r.rewritten, r.mask) for r in reports] == [(True, "bool-mask")] * 2, reports


class DropoutAttribute(torch.nn.Module):
    def __init__(self, p: float):
        super().__init__()
        self.p = p

    def forward(self, q, k, v):
        return F.dropout((q @ k.transpose(-1, -2) * 0.5).softmax(-1), self.p, self.training) @ v


@pytest.mark.parametrize("inner", ["eager", "aot_eager"])
def test_a_dropout_p_made_a_graph_input_is_read_as_a_checked_constant(inner):
    """dynamic=True makes a module's float attribute a graph input: its p is read as a constant the backend checks
    on every call, as the scale is; a new p runs the traced graph (its own dropout) instead of the old p."""
    from torch._dynamo.utils import counters

    model = DropoutAttribute(0.0)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 8, 4, generator=g) for _ in range(3))
    torch._dynamo.reset()
    counters["fa_compile"].clear()
    compiled = torch.compile(model, backend=fa_compile.backend(inner), dynamic=True)
    plain = model(q, k, v)
    torch.testing.assert_close(compiled(q, k, v), plain, **TOL[torch.float32])
    assert counters["fa_compile"]["sites_rewritten"] == 1, dict(counters["fa_compile"])
    model.p = 0.5
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        dropped = compiled(q, k, v)
    # with p = 0.5 about half the weights are dropped and the rest doubled: far from the p = 0 result
    assert (dropped - plain).abs().max() > 0.1
    torch._dynamo.reset()
