"""Test helpers for the fused-call rewrites: compile with the pass, capture graphs and reports."""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.fx as fx

from fa_compile.compiler import run_pass
from fa_compile.patterns.pipeline import rewrite_attention
from fa_compile.patterns.site import PassOptions


class Capture:
    """A torch.compile backend that runs the pass, keeps (graph, reports), then runs eagerly or aot_eager."""

    def __init__(self, inner: str = "eager", options: Optional[PassOptions] = None):
        self.inner = inner
        self.options = options
        self.graphs: list[fx.GraphModule] = []
        self.reports: list = []
        self.compiles = 0

    def __call__(self, gm: fx.GraphModule, example_inputs: list) -> Callable:
        self.compiles += 1
        if self.options is not None:
            from fa_compile import ops  # noqa: F401  (registers torch.ops.fa3)

            reports = rewrite_attention(gm, self.options)
        else:
            reports = run_pass(gm)
        self.graphs.append(gm)
        self.reports.extend(reports)
        from fa_compile.constant_guard import guard_constants

        if self.inner == "aot_eager":
            from torch._dynamo.backends.debugging import aot_eager

            return guard_constants(aot_eager(gm, example_inputs), gm, example_inputs)
        return guard_constants(gm.forward, gm, example_inputs)

    @property
    def n_attention(self) -> int:
        return sum(count_attention(gm) for gm in self.graphs)


def count_attention(gm: fx.GraphModule) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target is torch.ops.fa3.attention.default)


def _target_name(n: fx.Node) -> str:
    if n.op == "call_method":
        return f".{n.target}"
    t = n.target
    if isinstance(t, torch._ops.OpOverload):
        return str(t.name()).replace("::", ".")
    mod = getattr(t, "__module__", "") or ""
    name = getattr(t, "__name__", str(t))
    if mod.startswith("_operator") or mod == "operator":
        return name
    return name


def graph_summary(gm: fx.GraphModule) -> str:
    """One line per computing node: target and its constant arguments (node names, which differ
    between torch versions, are replaced by '%'), so expecttest pins the structure of a rewrite."""

    def arg(a: Any) -> str:
        if isinstance(a, fx.Node):
            return "%"
        if isinstance(a, (list, tuple)):
            inner = ", ".join(arg(x) for x in a)
            return f"[{inner}]" if isinstance(a, list) else f"({inner}{',' if len(a) == 1 else ''})"
        if isinstance(a, float):
            return f"{a:.6g}"
        if isinstance(a, torch.dtype):
            return str(a).replace("torch.", "")
        return repr(a)

    lines = []
    for n in gm.graph.nodes:
        if n.op in ("placeholder", "output", "get_attr"):
            continue
        args = [arg(a) for a in n.args] + [f"{k}={arg(v)}" for k, v in n.kwargs.items()]
        lines.append(f"{_target_name(n)}({', '.join(args)})")
    return "\n".join(lines)


def assert_same(out: torch.Tensor, ref: torch.Tensor, **tol: Any) -> None:
    """Every element close (NaN where eager has NaN, and only there)."""
    assert out.shape == ref.shape, (out.shape, ref.shape)
    assert torch.equal(out.isnan(), ref.isnan()), "NaN positions differ from eager"
    torch.testing.assert_close(out, ref, equal_nan=True, **tol)


def tolerances(dtype: torch.dtype) -> dict:
    if dtype == torch.float16:
        return dict(atol=2e-3, rtol=2e-3)
    if dtype == torch.bfloat16:
        return dict(atol=2e-2, rtol=2e-2)
    return dict(atol=2e-5, rtol=2e-5)
