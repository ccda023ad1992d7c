"""Inductor's own attention patterns under backend="fa3" (fa_compile/sdpa_pattern_guard.py).

Inductor's fuse_attention patterns match a softmax whatever its dim, so `softmax(dim=-2)` between the two products
became attention over the keys: wrong results under plain torch.compile. The pass refuses such sites; they must
run as written, forward and backward. Compared with eager on fresh inputs, every element; plain Inductor is left
as it is (its check is restored after each compile of ours).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._inductor.custom_graph_pass import CustomGraphPass

import fa_compile
from fa_compile.sdpa_pattern_guard import softmax_on_last_dim


def _dim_minus_2(q, k, v):
    return torch.matmul(q, k.transpose(-2, -1)).div(8 ** 0.5).softmax(dim=-2).matmul(v)


def _dim_1(q, k, v):
    return torch.matmul(q, k.transpose(-2, -1)).div(8 ** 0.5).softmax(dim=1).matmul(v)


def _dim_2_mul(q, k, v):
    return torch.matmul(q, k.transpose(-2, -1)).mul(0.3).softmax(dim=2).matmul(v)


def _dropout_dim_minus_2(q, k, v):
    return F.dropout(torch.matmul(q, k.transpose(-2, -1)).div(3.0).softmax(dim=-2), p=0.0).matmul(v)


CASES = [_dim_minus_2, _dim_1, _dim_2_mul, _dropout_dim_minus_2]


def _inputs(grad: bool):
    g = torch.Generator().manual_seed(7)
    return [torch.randn(2, 8, 8, 8, generator=g).requires_grad_(grad) for _ in range(3)]


@pytest.mark.parametrize("fn", CASES, ids=lambda f: f.__name__.strip("_"))
@pytest.mark.parametrize("lower", [True, False], ids=["lowered", "op_kept"])
def test_refused_softmax_axis_runs_as_written(fn, lower):
    torch._dynamo.reset()
    q, k, v = _inputs(grad=True)
    want = fn(q, k, v)
    want_grads = torch.autograd.grad(want.sum(), (q, k, v))
    assert fa_compile.explain(fn, q, k, v).rewritten == []  # the pass refuses: not an attention over the keys
    got = torch.compile(fn, backend=fa_compile.backend(lower=lower))(q, k, v)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for name, a, b in zip("qkv", torch.autograd.grad(got.sum(), (q, k, v)), want_grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=lambda m, n=name: f"d{n}: {m}")


def test_scores_divided_by_zero_compile_and_match_eager():
    # Inductor's replacement computes 1 / inv_scale: a ZeroDivisionError failed the compile (plain Inductor's too).
    def fn(q, k, v):
        return torch.softmax(q @ k.transpose(-1, -2) / 0.0, -1) @ v

    torch._dynamo.reset()
    q, k, v = _inputs(grad=True)
    want = fn(q, k, v)
    got = torch.compile(fn, backend="fa3")(q, k, v)
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    torch.testing.assert_close(got, want, equal_nan=True)
    got.sum().backward()  # (NaN gradients, as eager's)
    assert q.grad is not None


def test_plain_inductor_keeps_its_own_check():
    from torch._inductor.fx_passes import fuse_attention

    before = fuse_attention._sfdp_params_check
    torch._dynamo.reset()
    q, k, v = _inputs(grad=False)
    torch.compile(_dim_minus_2, backend="fa3")(q, k, v)
    assert fuse_attention._sfdp_params_check is before


@pytest.mark.parametrize("as_list", [False, True], ids=["pass", "list_of_passes"])
def test_users_joint_pass_still_runs(as_list):
    from torch._inductor import custom_graph_pass

    if as_list and not hasattr(custom_graph_pass, "get_custom_graph_passes"):
        pytest.skip("this torch takes one joint-graph pass, not a list")
    seen = []

    class Count(CustomGraphPass):
        def __call__(self, graph):
            seen.append(len(graph.nodes))

        def uuid(self):
            return None  # no key: Inductor compiles anew (a cache hit from an earlier run would skip the passes)

    torch._dynamo.reset()
    q, k, v = _inputs(grad=True)
    be = fa_compile.backend(options={"joint_custom_pre_pass": [Count()] if as_list else Count()})
    out = torch.compile(_dim_1, backend=be)(q, k, v)
    out.sum().backward()
    assert seen, "the user's joint-graph pass did not run"


def test_softmax_on_last_dim_reads_each_reduction():
    class Match:
        def __init__(self, nodes):
            self.nodes = nodes

    def graph_of(dim):
        def f(x):
            return torch.ops.aten._softmax.default(x, dim, False)

        from torch.fx.experimental.proxy_tensor import make_fx

        return make_fx(f)(torch.randn(2, 3, 4))

    for dim, ok in ((-1, True), (2, True), (1, False), (-2, False), (0, False)):
        gm = graph_of(dim)
        for n in gm.graph.nodes:  # make_fx records the value as meta["val"], as Inductor's graphs do
            assert n.op != "call_function" or "val" in n.meta
        assert softmax_on_last_dim(Match(list(gm.graph.nodes))) is ok, dim


def test_env_opt_in_checks_the_softmax_dim_too():
    # FA_COMPILE=1 runs the pass inside torch's own backend: Inductor's patterns get the check for every compile.
    from test_backend import run_python

    r = run_python("""
        import torch
        def f(q, k, v):
            return torch.matmul(q, k.transpose(-2, -1)).div(8 ** 0.5).softmax(dim=-2).matmul(v)
        q, k, v = (torch.randn(2, 8, 8, 8) for _ in range(3))
        print("max-diff", (torch.compile(f)(q, k, v) - f(q, k, v)).abs().max().item())
    """, FA_COMPILE="1")
    assert r.returncode == 0, r.stderr
    assert "max-diff" in r.stdout and float(r.stdout.split("max-diff")[1].split()[0]) < 1e-5, r.stdout
