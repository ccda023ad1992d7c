"""Run-time positions (q_pos) and segment ids in the Triton kernels on a CUDA GPU (skipped without one):
the tiled forward and backward at tile sizes the interpreter never uses, and the split-KV decode kernel
that dispatch picks for a static-cache decode step, against the reference (triton_testing.check_case)."""
from __future__ import annotations

import pytest
import torch

from fa_compile.kernels import triton_family as tf

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available() or not tf.triton_available(), reason="needs CUDA and triton"),
]
BF16 = torch.bfloat16


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("dtype", [torch.float16, BF16])
@pytest.mark.parametrize("d", [64, 128])
def test_positions_and_segments_tiled(dtype, d):
    from fa_compile.kernels.triton_testing import check_case, make_case

    case = make_case(device="cuda", b=2, hq=8, hkv=2, nq=333, nk=1029, d=d, dtype=dtype, seed=1,
                     bias_shape=(2, 1, 1, 1029))
    case.q_pos = torch.randint(-8, 1100, (2, 333), generator=_gen(2)).cuda()
    check_case(case)
    case = make_case(device="cuda", b=2, hq=4, nq=777, nk=777, d=d, dtype=dtype, seed=3, causal=True)
    lengths = torch.tensor([100, 0, 257, 64, 356])
    ids = torch.repeat_interleave(torch.arange(5), lengths).cuda()
    case.q_seg = case.k_seg = ids
    check_case(case)
    case.k_seg = ids[torch.randperm(777, generator=_gen(4)).cuda()]  # unsorted keys
    case.causal = False
    check_case(case)


def test_static_cache_decode_step_runs_the_decode_kernel():
    import fa_compile
    from fa_compile import dispatch
    from fa_compile.kernels import reference as ref

    g = _gen(5)
    b, hq, hkv, cap, d = 4, 32, 8, 4096, 128
    q = torch.randn(b, hq, 1, d, generator=g).to("cuda", BF16)
    k = torch.randn(b, hkv, cap, d, generator=g).to("cuda", BF16)
    v = torch.randn(b, hkv, cap, d, generator=g).to("cuda", BF16)
    q_pos = torch.tensor([1023], device="cuda")
    pad = torch.ones(b, 1, 1, cap, dtype=torch.bool, device="cuda")
    pad[1, ..., :37] = False  # left padding of one sequence
    dispatch.STATS.clear()
    out = fa_compile.attention(q, k, v, bias=pad, q_pos=q_pos)
    assert dispatch.STATS[("forward", "decode")] == 1
    want, _ = ref.attention_reference(q, k, v, scale=d ** -0.5, bias=pad, q_pos=q_pos)
    torch.testing.assert_close(out, want, atol=1.6e-2, rtol=1.6e-2)
