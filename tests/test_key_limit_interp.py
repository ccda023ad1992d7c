"""The split-KV decode kernel with a bias and key lengths at once (a data mask's key limit), under the
Triton interpreter: every element against the reference, K and V past each sequence's kv_lens poisoned
(NaN) so that a kernel reading them would fail, additive finfo.min rows (uniform, not empty) included;
dispatch sends such calls to the decode kernel. The key limit's own kernel (`fa3_decode::key_limit`)
against `fa3::key_limit`'s math on every mask kind, and its lowering in a traced graph.
Same arrangement as test_positions_segments_interp.py: unless this process already runs with
TRITON_INTERPRET=1, one test runs this module in a fresh subprocess with it set.
"""
from __future__ import annotations

import os

import pytest
import torch

from fa_compile.kernels import triton_family as tf

IN_CHILD = os.environ.get("TRITON_INTERPRET") == "1"
needs_triton = pytest.mark.skipif(not tf.triton_available(), reason="triton not installed")

if not IN_CHILD:

    @needs_triton
    def test_key_limit_kernels_under_interpreter():
        from fa_compile.kernels.triton_testing import run_under_interpreter

        run_under_interpreter(__file__)

else:
    from torch.fx.experimental.proxy_tensor import make_fx

    from fa_compile import dispatch, key_limit_op
    from fa_compile.kernels import decode, decode_ops
    from fa_compile.lowering import graph_pass
    from fa_compile.lowering import key_limit as key_limit_lowering
    from fa_compile.kernels import reference as ref
    from fa_compile.kernels.triton_testing import make_case

    pytestmark = pytest.mark.usefixtures("tf32_matmul")

    LENS = [301, 77, 0]  # a full cache, a short sequence, an empty one

    def _case(nq: int, dtype: torch.dtype, bool_mask: bool):
        case = make_case(b=3, hq=8, hkv=2, nq=nq, nk=301, d=32, dtype=dtype, seed=21, needs_backward=False,
                         kv_lens=LENS)
        keep = torch.rand(3, 1, nq, 301, generator=torch.Generator().manual_seed(5)) > 0.4
        keep[0, :, 0] = False  # a row with no admissible key: empty (bool) or uniform over finfo.min (float)
        keep[1, :, :, 60:] = False  # the limit (60) ends before the lengths (77)
        if bool_mask:
            case.bias = keep
        else:
            case.bias = torch.zeros(keep.shape, dtype=dtype).masked_fill(~keep, torch.finfo(dtype).min)
        return case

    def _poison(case) -> None:
        for t in ("k", "v"):  # nothing past a sequence's length may be read
            poisoned = getattr(case, t).clone()
            for b, n in enumerate(LENS):
                poisoned[b, :, n:] = float("nan")
            setattr(case, t, poisoned)

    @pytest.mark.parametrize("bool_mask", [False, True])
    @pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
    @pytest.mark.parametrize("nq", [1, 3])
    def test_decode_kernel_bias_with_key_lengths(nq, dtype, bool_mask):
        case = _case(nq, dtype, bool_mask)
        want, want_lse = ref.attention_reference(case.q, case.k, case.v, **case.mask_kwargs())
        _poison(case)
        tol = 2e-3 if dtype == torch.float16 else 1e-4
        for splits in (1, 3, 0):
            out = torch.full((3, nq, 8, 32), float("nan"), dtype=dtype)
            lse = torch.full((3, 8, nq), float("nan"))
            o, l_ = decode.attention_decode(case, out=out, lse=lse, num_splits=splits)
            torch.testing.assert_close(o, want, atol=tol, rtol=tol)
            torch.testing.assert_close(l_, want_lse, atol=1e-4, rtol=1e-4)

    def test_dispatch_sends_key_lengths_with_a_bias_to_the_decode_kernel():
        case = _case(1, torch.float16, False)
        args = dispatch.AttentionArgs(case.q, case.k, case.v, case.scale, bias=case.bias, kv_lens=case.kv_lens)
        assert dispatch.explain_choice(args)[0] == "decode"
        # without the lengths, or with more than a decode step's queries, the tiled kernel
        assert dispatch.explain_choice(dispatch.AttentionArgs(case.q, case.k, case.v, case.scale,
                                                              bias=case.bias))[0] == "triton"
        long_q = torch.randn(3, 8, 17, 32, dtype=torch.float16)
        assert dispatch.explain_choice(dispatch.AttentionArgs(long_q, case.k, case.v, case.scale,
                                                              kv_lens=case.kv_lens,
                                                              bias=case.bias[..., :1, :]))[0] == "triton"

    def _limit_masks(dtype: torch.dtype, nk: int) -> torch.Tensor:
        """[6, Nk] rows: a prefix, all absorbed, left padding with a hole, NaN past the absorbed tail, -inf
        padding, and a row with nothing absorbing but one value just above the threshold's half."""
        if dtype == torch.bool:
            m = torch.rand(6, nk, generator=torch.Generator().manual_seed(3)) > 0.3
            m[0, 70:] = False
            m[1] = False
            m[2, :5] = False
            m[3, nk - 1] = True
            m[4, nk // 2:] = False
            return m
        low = torch.finfo(dtype).min
        m = torch.randn(6, nk, generator=torch.Generator().manual_seed(3)).to(dtype)
        m[0, 70:] = low
        m[1] = low
        m[2, :5] = low
        m[2, 9] = low
        m[3, nk // 2:] = low
        m[3, nk - 3] = float("nan")
        m[4, nk // 3:] = float("-inf")
        m[5] = low
        m[5, 11] = key_limit_op.thresholds(dtype, decode_ops_absorb(dtype))[1]  # exactly the half: "good"
        return m

    def decode_ops_absorb(dtype: torch.dtype) -> float:
        from fa_compile.patterns.key_limit import absorb_threshold

        return absorb_threshold(dtype)

    @pytest.mark.parametrize("block", [None, 64])  # the kernel's default block (one per row), or a loop of 64
    @pytest.mark.parametrize("dtype", [torch.bool, torch.float16, torch.bfloat16, torch.float32])
    def test_key_limit_kernel_equals_the_ops_math(dtype, block, monkeypatch):
        if block is not None:
            monkeypatch.setattr(decode_ops, "KEY_LIMIT_BLOCK", block)
        monkeypatch.setattr(decode_ops, "_empty", lambda shape, stride, dtype, device: torch.full(shape, -7, dtype=dtype))
        absorb = 0.0 if dtype == torch.bool else decode_ops_absorb(dtype)
        for nk in (1, 301, 1000):
            m = _limit_masks(dtype, nk) if nk > 100 else torch.ones(6, nk, dtype=torch.bool).to(dtype)
            want = key_limit_op.key_limit_math(m, absorb)
            torch.testing.assert_close(decode_ops.key_limit(m, absorb), want, rtol=0, atol=0)
            # the [B, 1, 1, Nk] mask's rows, a strided view; and one row shared by the batch
            wide = torch.zeros(6, 2, 3, nk, dtype=dtype)
            wide[:, 1, 2] = m
            torch.testing.assert_close(decode_ops.key_limit(wide[:, 1, 2], absorb), want, rtol=0, atol=0)
            torch.testing.assert_close(decode_ops.key_limit(m[2:3], absorb), want[2:3], rtol=0, atol=0)
        assert decode_ops.key_limit(m, absorb).tolist() == torch.ops.fa3.key_limit(m, absorb).tolist()

    def test_key_limit_lowered_to_the_kernel_in_a_graph(monkeypatch):
        monkeypatch.setattr(key_limit_lowering, "DEVICES", ("cuda", "cpu"))
        mask = _limit_masks(torch.float16, 301)
        absorb = decode_ops_absorb(torch.float16)
        traced = make_fx(lambda m: torch.ops.fa3.key_limit(m, absorb) + 1, tracing_mode="fake")(mask)
        graph_pass.lower_graph(traced.graph)
        traced.recompile()
        code = traced.code
        assert "key_limit" not in code and "triton_kernel_wrapper_functional" in code, code  # the kernel's HOP
        torch.testing.assert_close(traced(mask), key_limit_op.key_limit_math(mask, absorb) + 1, rtol=0, atol=0)
        # fp64 masks: the kernel compares in fp32, so they get the graph ops
        m64 = mask.double()
        traced = make_fx(lambda m: torch.ops.fa3.key_limit(m, absorb), tracing_mode="fake")(m64)
        graph_pass.lower_graph(traced.graph)
        traced.recompile()
        assert "key_limit" not in traced.code and "amax" in traced.code, traced.code
