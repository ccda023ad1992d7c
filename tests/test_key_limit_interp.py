"""The split-KV decode kernel with a bias and key lengths at once (a data mask's key limit), under the
Triton interpreter: every element against the reference, K and V past each sequence's kv_lens poisoned
(NaN) so that a kernel reading them would fail, additive finfo.min rows (uniform, not empty) included;
dispatch sends such calls to the decode kernel.
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
    from fa_compile import dispatch
    from fa_compile.kernels import decode
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
