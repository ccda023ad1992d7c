"""Differential check against eager: the same function run eagerly and through the fa3 pass on clones
of the same fresh inputs, comparing the output, every input afterwards (writes into caller tensors),
and the gradients of every input and parameter, with `.grad is None` exactly where eager's is."""
from __future__ import annotations

import copy
from typing import Any, Callable, Optional

import torch

import fa_compile
from conftest import TOL, Compiled

TOL_BF16 = dict(atol=2e-2, rtol=2e-2)


def tol_for(dtype: torch.dtype) -> dict:
    return TOL_BF16 if dtype == torch.bfloat16 else TOL[dtype]


def rand(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0, requires_grad: bool = False) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype).requires_grad_(requires_grad)


def _clone(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.detach().clone().requires_grad_(x.requires_grad)
    return x


def _params(fn: Any) -> list:
    return list(fn.parameters()) if isinstance(fn, torch.nn.Module) else []


def _same(got: Any, want: Any, tol: dict, what: str) -> None:
    assert (got is None) == (want is None), f"{what}: {'None' if got is None else 'a tensor'} where eager has " \
                                            f"{'None' if want is None else 'a tensor'}"
    if want is not None:
        torch.testing.assert_close(got, want, equal_nan=True, msg=lambda m: f"{what}: {m}", **tol)


class Result:
    def __init__(self, reports: list, out: Any, ref: Any):
        self.reports, self.out, self.ref = reports, out, ref

    @property
    def rewritten(self) -> list:
        return [r for r in self.reports if r.rewritten]

    @property
    def reasons(self) -> list:
        return [r.reason for r in self.reports if not r.rewritten]


def check(fn: Callable, args: list, *, inner: str = "aot_eager", dtype: torch.dtype = torch.float32,
          rewritten: Optional[int] = None, grad: bool = True, seed: int = 0) -> Result:
    """Run `fn(*args)` eagerly and compiled (inner "eager", "aot_eager" or "inductor"), on clones of
    `args`; assert everything eager produced is reproduced; return the site reports."""
    tol = tol_for(dtype)
    fn_c = copy.deepcopy(fn) if isinstance(fn, torch.nn.Module) else fn
    wants_grad = [isinstance(a, torch.Tensor) and a.requires_grad for a in args]
    a_ref = [_clone(a) for a in args]
    a_got = [_clone(a) for a in args]
    ref = fn(*a_ref)
    if inner == "inductor":
        torch._dynamo.reset()
        out = torch.compile(fn_c, backend="fa3", fullgraph=True)(*a_got)
        reports = fa_compile.explain(copy.deepcopy(fn_c) if isinstance(fn_c, torch.nn.Module) else fn_c,
                                     *[_clone(a) for a in args]).sites
    else:
        c = Compiled(fn_c, inner=inner)
        out = c(*a_got)
        reports = c.reports
    _same(out, ref, tol, "output")
    for i, (x, y) in enumerate(zip(a_got, a_ref)):
        if isinstance(y, torch.Tensor):
            _same(x.detach(), y.detach(), tol, f"argument {i} after the call")
    if grad and isinstance(ref, torch.Tensor) and ref.requires_grad:
        assert out.requires_grad, "output does not require grad where eager's does"
        g = rand(*ref.shape, dtype=ref.dtype, seed=seed + 99)
        ref.backward(g)
        out.backward(g)
        for i, (x, y) in enumerate(zip(a_got, a_ref)):
            if wants_grad[i]:
                _same(x.grad, y.grad, tol, f"grad of argument {i}")
        for (name, p), q in zip(fn.named_parameters() if isinstance(fn, torch.nn.Module) else [], _params(fn_c)):
            _same(q.grad, p.grad, tol, f"grad of parameter {name}")
    elif isinstance(ref, torch.Tensor):
        assert not (isinstance(out, torch.Tensor) and out.requires_grad), "output requires grad where eager's does not"
    res = Result(reports, out, ref)
    if rewritten is not None:
        assert len(res.rewritten) == rewritten, res.reasons
    return res
