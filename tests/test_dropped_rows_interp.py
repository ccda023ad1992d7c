"""fa3::dropped_uniform_rows's Triton kernels (kernels/triton_dropped_rows.py) under the Triton interpreter, every
element against the op's torch path (itself checked against eager in test_dropped_rows.py), outputs poisoned (NaN)
first: rows fully masked in some batches and query positions only, a batch with none, GQA, partial tiles, padded
head dims, a softcap, each qk_grad. Same arrangement as test_key_limit_interp.py: unless this process already runs
with TRITON_INTERPRET=1, one test runs this module in a fresh subprocess with it set."""
from __future__ import annotations

import os

import pytest
import torch

from fa_compile.kernels import triton_family as tf

IN_CHILD = os.environ.get("TRITON_INTERPRET") == "1"
needs_triton = pytest.mark.skipif(not tf.triton_available(), reason="triton not installed")

if not IN_CHILD:

    @needs_triton
    def test_dropped_rows_kernels_under_interpreter():
        from fa_compile.kernels.triton_testing import run_under_interpreter

        run_under_interpreter(__file__)

else:
    import fa_compile.ops  # noqa: F401  (registers the op)
    from fa_compile import dropped_rows

    B, HQ, HKV, D, DV = 3, 4, 2, 24, 20
    SHAPES = [(37, 70), (70, 37)]  # (Nq, Nk): more key blocks than query blocks, and fewer
    P, SCALE = 0.25, 0.3

    def _inputs(dtype: torch.dtype, NQ: int = 37, NK: int = 70):
        g = torch.Generator().manual_seed(3)
        q = torch.randn(B, HQ, NQ, D, generator=g).to(dtype)
        k = torch.randn(B, NK, HKV, D, generator=g).to(dtype).transpose(1, 2)  # BSHD memory
        v = torch.randn(B, HKV, NK, DV, generator=g).to(dtype)
        lse = torch.randn(B, HQ, NQ, generator=g)
        lse[0, :, 30:] = float("-inf")  # batch 0: its last query positions admit no key (a partial last tile)
        lse[0, 1, 3] = float("-inf")  # and one row of one head
        lse[2] = float("-inf")  # batch 2: every row; batch 1: none
        return q, k, v, lse, torch.tensor(987654321)

    @pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
    @pytest.mark.parametrize("NQ, NK", SHAPES)
    def test_fill_equals_the_torch_path(dtype, NQ, NK):
        q, k, v, lse, seed = _inputs(dtype, NQ, NK)
        poisoned = torch.full((B, HQ, NQ, DV), float("nan"), dtype=dtype)
        got = dropped_rows.fill_triton(v, lse, seed, P, HQ, out=poisoned)
        want = dropped_rows.dropped_uniform_rows(q, k, v, lse, seed, P, SCALE)
        assert not got.isnan().any()
        assert want[0, :, 30:].abs().max() > 0.1 and want[1].abs().max() == 0
        tol = dict(atol=1e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-3, rtol=2e-3)
        torch.testing.assert_close(got, want, **tol)

    @pytest.mark.parametrize("softcap", [0.0, 3.0])
    @pytest.mark.parametrize("qk_grad", [0.0, 0.5, 1.0])
    @pytest.mark.parametrize("NQ, NK", SHAPES)
    def test_backward_equals_the_torch_path(softcap, qk_grad, NQ, NK):
        q, k, v, lse, seed = _inputs(torch.float32, NQ, NK)
        dfill = torch.randn(B, HQ, NQ, DV, generator=torch.Generator().manual_seed(4))
        poisoned = tuple(torch.full_like(t, float("nan")) for t in (q, k, v))
        got = dropped_rows.backward_triton(dfill, q, k, v, lse, seed, P, SCALE, softcap, qk_grad, grads=poisoned)
        want = dropped_rows.dropped_uniform_rows_backward(dfill, q, k, v, lse, seed, P, SCALE, softcap, qk_grad)
        for name, a, e in zip(("dq", "dk", "dv"), got, want):
            assert not a.isnan().any(), name
            assert a.stride() == e.stride(), name
            torch.testing.assert_close(a, e, atol=1e-5, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")
        assert want[2].abs().max() > 0.01 and (qk_grad == 0) == (want[0].abs().max() == 0)

    def test_no_fully_masked_row_writes_zeros():
        NQ = 37
        q, k, v, _, seed = _inputs(torch.float32, NQ)
        lse = torch.zeros(B, HQ, NQ)
        fill = dropped_rows.fill_triton(v, lse, seed, P, HQ, out=torch.full((B, HQ, NQ, DV), float("nan")))
        assert fill.abs().max() == 0
        grads = dropped_rows.backward_triton(torch.randn(B, HQ, NQ, DV), q, k, v, lse, seed, P, SCALE, 0.0, 1.0,
                                             grads=tuple(torch.full_like(t, float("nan")) for t in (q, k, v)))
        assert all(g.abs().max() == 0 for g in grads)
