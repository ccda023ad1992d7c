"""Shared test helpers: compile through the fa3 pass and capture what it reported."""
from __future__ import annotations

from typing import Any, Callable

import pytest
import torch

# Tolerances for compiled-vs-eager: the op accumulates in fp32, eager fp16 rounds scores and probabilities.
TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.float16: dict(atol=5e-3, rtol=5e-3),
       torch.float64: dict(atol=1e-10, rtol=1e-10)}


class Compiled:
    """`Compiled(fn, inner=...)(*args)` runs `fn` through torch.compile with the fa3 pass; `.reports`
    and `.graphs` hold the site reports and rewritten GraphModules of every compile."""

    def __init__(self, fn: Callable, inner: str = "eager", dynamic: Any = None, fullgraph: bool = True):
        from fa_compile.compiler import run_pass

        self.reports: list = []
        self.graphs: list = []

        def backend(gm, example_inputs):
            from fa_compile.constant_guard import guard_constants

            self.reports.extend(run_pass(gm))
            self.graphs.append(gm)
            if inner == "eager":
                return guard_constants(gm.forward, gm, example_inputs)
            from torch._dynamo.backends.debugging import aot_eager

            return guard_constants(aot_eager(gm, example_inputs), gm, example_inputs)

        torch._dynamo.reset()
        self.fn = torch.compile(fn, backend=backend, dynamic=dynamic, fullgraph=fullgraph)

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)

    @property
    def rewritten(self) -> list:
        return [r for r in self.reports if r.rewritten]

    @property
    def missed(self) -> list:
        return [r for r in self.reports if not r.rewritten]

    def op_calls(self) -> int:
        op = torch.ops.fa3.attention.default
        return sum(1 for gm in self.graphs for n in gm.graph.nodes if n.target is op)


@pytest.fixture
def compiled():
    return Compiled


@pytest.fixture
def tf32_matmul():
    """fp32 matmuls at "high" precision (TF32 on GPUs) for the test, as our fp32 kernels require."""
    prev = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    yield
    torch.set_float32_matmul_precision(prev)
