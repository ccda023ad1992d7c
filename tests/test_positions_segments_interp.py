"""Run-time positions (q_pos) and segment ids (q_seg / k_seg) in the Triton kernels under the Triton
interpreter (CPU): the tiled forward, dQ and dK/dV kernels and the split-KV decode kernel, against the
reference, with outputs and gradient buffers poisoned (NaN) so that every element must be written.

Tiles that must not be read hold NaN as well: keys past a tile's largest position, key tiles outside the
span whose segment ids can meet the query tile's, and (in dK/dV) query tiles outside the span that can
reach a key tile; a kernel that read them would turn the result into NaN (0 * NaN), so finite, exact
results show they were skipped.
Same arrangement as test_kernels_interp.py: unless this process already runs with TRITON_INTERPRET=1,
one test runs this module in a fresh subprocess with it set.
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
    def test_positions_segments_under_interpreter():
        from fa_compile.kernels.triton_testing import run_under_interpreter

        run_under_interpreter(__file__)

else:
    import fa_compile
    from fa_compile import dispatch
    from fa_compile.kernels import decode
    from fa_compile.kernels import reference as ref
    from fa_compile.kernels.decode_reference import gather_cache, key_positions
    from fa_compile.kernels.triton_testing import check_case, make_case, poisoned_backward, poisoned_forward

    pytestmark = pytest.mark.usefixtures("tf32_matmul")
    BLOCK = 16  # the interpreter's tiles (triton_family.pick_config)

    def _gen(seed: int) -> torch.Generator:
        return torch.Generator().manual_seed(seed)

    def seg_ids(lengths: list[int]) -> torch.Tensor:
        """Ids 0, 1, ... repeated by `lengths` (an empty segment: length 0, its id never appears)."""
        return torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))

    # ------------------------------------------------------------------ the tiled kernels, forward and backward
    @pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
    @pytest.mark.parametrize("kw", [
        dict(nq=37, nk=45, d=16, hq=4, hkv=2, kv_lens=[40, 19], bias_shape=(2, 1, 1, 45)),
        dict(nq=33, nk=29, d=32, layout="bshd", bias_shape=(2, 2, 33, 29), bias_bool=True),
        dict(nq=30, nk=50, d=16, causal=True, diag_offset=20, softcap=2.5),
        dict(nq=21, nk=34, d=16, window_left=9, dropout_p=0.2),
    ], ids=["gqa_kvlens_keybias", "bshd_boolbias", "causal_softcap", "window_dropout"])
    def test_positions_forward_backward(kw, dtype):
        case = make_case(dtype=dtype, seed=11, **kw)
        nq, nk = case.q.shape[2], case.k.shape[2]
        # Per batch, random, with negative values (empty rows) and values past Nk (every key).
        case.q_pos = torch.randint(-4, nk + 6, (2, nq), generator=_gen(3))
        check_case(case)

    @pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
    def test_positions_shared_over_the_batch_int32_static_cache(dtype):
        # A static cache's prefill: queries at positions 5..5+Nq-1 of a cache of 64 slots.
        case = make_case(b=2, hq=2, nq=19, nk=64, d=16, dtype=dtype, seed=4, bias_shape=(2, 1, 1, 64))
        case.q_pos = (torch.arange(19) + 5).int()
        check_case(case)

    @pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
    @pytest.mark.parametrize("segs", [
        ([5, 0, 12, 20, 1], [5, 0, 12, 20, 1]),       # sorted, packed, an empty segment, lengths off the tiles
        ([7, 9, 0, 17], [10, 0, 8, 30]),               # sorted, other key lengths; id 1 has no keys: empty rows
    ], ids=["self_packed", "cross_packed"])
    def test_segments_sorted(segs, dtype):
        qs, ks = seg_ids(segs[0]), seg_ids(segs[1])
        case = make_case(b=2, hq=4, hkv=2, nq=len(qs), nk=len(ks), d=16, dtype=dtype, seed=5)
        case.q_seg, case.k_seg = qs, torch.stack([ks, ks.flip(0)])  # batch 1: keys in reverse order
        res = check_case(case)
        empty = (case.q_seg.view(1, -1, 1) != case.k_seg.view(2, 1, -1)).all(-1)  # rows with no key of their id
        assert (res["out"].transpose(1, 2)[empty] == 0).all() and torch.isneginf(res["lse"].transpose(1, 2)[empty]).all()
        assert bool(empty.any()) == any(nq_ > 0 and nk_ == 0 for nq_, nk_ in zip(*segs))

    @pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
    def test_segments_unsorted_with_causal_bias_and_kvlens(dtype):
        case = make_case(b=2, hq=2, nq=41, nk=41, d=16, dtype=dtype, seed=6, causal=True, kv_lens=[41, 23],
                         bias_shape=(1, 2, 41, 41))
        g = _gen(7)
        case.q_seg = torch.randint(0, 3, (2, 41), generator=g)
        case.k_seg = torch.randint(0, 3, (2, 41), generator=g).int()  # another dtype: compared as int64
        check_case(case)

    def test_segments_and_positions_together_softcap():
        case = make_case(b=2, hq=2, nq=35, nk=35, d=16, dtype=torch.float32, seed=8, softcap=3.0)
        ids = seg_ids([9, 14, 12])
        case.q_seg = case.k_seg = ids
        case.q_pos = torch.arange(35).view(1, 35).expand(2, 35) - torch.tensor([[0], [3]])
        check_case(case)

    def test_segment_ids_of_a_leading_one_broadcast():
        case = make_case(b=3, hq=2, nq=18, nk=26, d=16, dtype=torch.float16, seed=9)
        case.q_seg = seg_ids([6, 12]).view(1, 18)
        case.k_seg = seg_ids([10, 16]).view(1, 26)
        check_case(case)

    # --------------------------------------------------------------------------------- what is never read
    def test_keys_past_the_largest_position_are_not_read():
        case = make_case(b=2, hq=2, nq=20, nk=80, d=16, dtype=torch.float32, seed=10)
        case.q_pos = torch.randint(0, 27, (2, 20), generator=_gen(1))  # every position < 27: keys from 27 unread
        want, want_lse = ref.attention_reference(case.q, case.k, case.v, **case.mask_kwargs())
        dout = torch.randn(want.shape, generator=_gen(2))
        r = ref.attention_backward_reference(dout, case.q, case.k, case.v, bias_requires_grad=False,
                                             **case.mask_kwargs())
        case.k, case.v = case.k.clone(), case.v.clone()
        case.k[:, :, 27:] = float("nan")
        case.v[:, :, 27:] = float("nan")
        out, lse = poisoned_forward(case)
        torch.testing.assert_close(out, want, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(lse, want_lse, atol=1e-4, rtol=1e-4)
        dq, dk, dv, _ = poisoned_backward(case, dout, out, lse)
        torch.testing.assert_close(dq, r[0], atol=5e-4, rtol=5e-4)  # dQ read no key past the positions either
        for got, exp in ((dk, r[1]), (dv, r[2])):  # (the NaN keys' own gradients are NaN: not compared)
            torch.testing.assert_close(got[:, :, :27], exp[:, :, :27], atol=5e-4, rtol=5e-4)

    def test_key_tiles_of_other_segments_are_not_read():
        # One query tile of id 1; keys: tile 0 of id 0, tile 1 of id 1, tile 2 of id 2 (NaN: never read).
        case = make_case(b=1, hq=2, nq=16, nk=48, d=16, dtype=torch.float16, seed=12)
        case.q_seg = torch.ones(16, dtype=torch.int64)
        case.k_seg = seg_ids([16, 16, 16])
        want = ref.attention_reference(case.q, case.k, case.v, **case.mask_kwargs())
        case.k, case.v = case.k.clone(), case.v.clone()
        for t in (case.k, case.v):
            t[:, :, :BLOCK] = float("nan")
            t[:, :, 2 * BLOCK:] = float("nan")
        out, lse = poisoned_forward(case)
        torch.testing.assert_close(out, want[0], atol=2e-3, rtol=2e-3)
        dout = torch.randn(out.shape, generator=_gen(2)).half()
        dq, dk, dv, _ = poisoned_backward(case, dout, out, lse)
        r = ref.attention_backward_reference(dout, case.q, case.k.nan_to_num(), case.v.nan_to_num(),
                                             bias_requires_grad=False, **case.mask_kwargs())
        torch.testing.assert_close(dq, r[0], atol=1e-2, rtol=1e-2)
        for got, want_ in ((dk, r[1]), (dv, r[2])):  # key tiles no query reaches: written as 0, nothing read
            torch.testing.assert_close(got, want_, atol=1e-2, rtol=1e-2)

    def test_query_tiles_no_key_reaches_are_not_read_by_dkdv():
        # Query tile 0 (rows 0..15) has no admitted key (positions < 0, as left padding gives, or an id
        # outside every key tile's [min, max]): its Q and dO are NaN, so dK / dV stay finite only if every
        # key tile's span of query tiles leaves it out. (A tile inside the span is masked, not skipped.)
        for kw in (dict(q_pos=torch.cat([torch.full((16,), -1), torch.arange(24) + 5])),
                   dict(q_seg=torch.tensor([7] * 16 + [0] * 16 + [3] * 8), k_seg=torch.tensor([0, 3] * 20))):
            case = make_case(b=1, hq=2, nq=40, nk=40, d=16, dtype=torch.float32, seed=13)
            for name, val in kw.items():
                setattr(case, name, val)
            out, lse = poisoned_forward(case)
            g = _gen(3)
            dout = torch.randn(out.shape, generator=g)
            r = ref.attention_backward_reference(dout, case.q, case.k, case.v, bias_requires_grad=False,
                                                 **case.mask_kwargs())
            case.q = case.q.clone()
            case.q[:, :, :BLOCK] = float("nan")
            dout[:, :, :BLOCK] = float("nan")
            dq, dk, dv, _ = poisoned_backward(case, dout, out, lse)
            torch.testing.assert_close(dk, r[1], atol=5e-4, rtol=5e-4)
            torch.testing.assert_close(dv, r[2], atol=5e-4, rtol=5e-4)
            assert (dq[:, :, :BLOCK] == 0).all()
            torch.testing.assert_close(dq[:, :, BLOCK:], r[0][:, :, BLOCK:], atol=5e-4, rtol=5e-4)

    # -------------------------------------------------------------------------------- the op and dispatch
    def test_through_the_op_with_the_triton_kernel_and_autograd():
        g = _gen(14)
        q = torch.randn(2, 4, 27, 16, generator=g).half().requires_grad_(True)
        k = torch.randn(2, 2, 31, 16, generator=g).half().requires_grad_(True)
        v = torch.randn(2, 2, 31, 16, generator=g).half().requires_grad_(True)
        kw = dict(q_pos=torch.randint(-2, 33, (2, 27), generator=g), q_seg=seg_ids([10, 17]),
                  k_seg=torch.stack([seg_ids([12, 19]), seg_ids([20, 11])]))
        out = fa_compile.attention(q, k, v, kernel="triton", **kw)
        want = fa_compile.attention(q, k, v, kernel="reference", **kw)
        torch.testing.assert_close(out, want, atol=2e-3, rtol=2e-3)
        dout = torch.randn(out.shape, generator=g).half()
        for n, a, b in zip(("dq", "dk", "dv"), torch.autograd.grad(out, (q, k, v), dout),
                           torch.autograd.grad(want, (q, k, v), dout)):
            torch.testing.assert_close(a, b, atol=1e-2, rtol=1e-2, msg=lambda m, n=n: f"{n}: {m}")

    def test_dispatch_sends_a_static_cache_decode_step_to_the_decode_kernel():
        # Nq = 1 per sequence, positions at run time, left padding as a key bias: the split-KV kernel.
        g = _gen(15)
        q = torch.randn(3, 8, 1, 32, generator=g).half()
        k = torch.randn(3, 2, 200, 32, generator=g).half()
        v = torch.randn(3, 2, 200, 32, generator=g).half()
        q_pos = torch.tensor([[150], [199], [3]])
        pad = torch.zeros(3, 1, 1, 200, dtype=torch.bool)
        for bb, left in enumerate((0, 40, 1)):
            pad[bb, ..., left:] = True
        args = dispatch.AttentionArgs(q, k, v, 0.2, bias=pad, q_pos=q_pos)
        assert dispatch.explain_choice(args)[0] == "decode"
        assert dispatch.explain_choice(dispatch.AttentionArgs(q, k, v, 0.2, bias=pad))[0] == "triton"
        long_q = torch.randn(3, 8, 17, 32, generator=g).half()
        assert dispatch.explain_choice(dispatch.AttentionArgs(long_q, k, v, 0.2, q_pos=q_pos.expand(3, 17)))[0] == "triton"
        dispatch.STATS.clear()
        out, lse = fa_compile.attention(q, k, v, scale=0.2, bias=pad, q_pos=q_pos, return_lse=True)
        assert dispatch.STATS[("forward", "decode")] == 1
        want, want_lse = ref.attention_reference(q, k, v, scale=0.2, bias=pad, q_pos=q_pos)
        torch.testing.assert_close(out, want, atol=2e-3, rtol=2e-3)
        torch.testing.assert_close(lse, want_lse, atol=1e-4, rtol=1e-4)
        # Its backward is the family's (the lse is the op's).
        qq, kk, vv = (t.clone().requires_grad_(True) for t in (q, k, v))
        o = fa_compile.attention(qq, kk, vv, scale=0.2, bias=pad, q_pos=q_pos)
        w = fa_compile.attention(qq, kk, vv, scale=0.2, bias=pad, q_pos=q_pos, kernel="reference")
        dout = torch.randn(o.shape, generator=g).half()
        for a, b in zip(torch.autograd.grad(o, (qq, kk, vv), dout), torch.autograd.grad(w, (qq, kk, vv), dout)):
            torch.testing.assert_close(a, b, atol=1e-2, rtol=1e-2)

    # ------------------------------------------------------------------------------------- the decode kernel
    def _decode_args(b, hq, hkv, nq, nk, d, dtype, seed, **kw):
        case = make_case(b=b, hq=hq, hkv=hkv, nq=nq, nk=nk, d=d, dtype=dtype, seed=seed, needs_backward=False, **kw)
        return case

    @pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
    @pytest.mark.parametrize("nq", [1, 4])
    def test_decode_kernel_positions_bias_diagonal(nq, dtype):
        case = _decode_args(3, 8, 2, nq, 301, 32, dtype, 16, kv_lens=[301, 250, 0], bias_shape=(3, 1, nq, 301))
        case.q_pos = torch.randint(-2, 320, (3, nq), generator=_gen(4))
        case.q_pos[1] = torch.arange(nq) + 120
        for causal, off in ((False, 0), (True, 200), (True, -1)):
            case.causal, case.diag_offset = causal, off
            for splits in (1, 3, 0):
                out = torch.full((3, nq, 8, 32), float("nan"), dtype=dtype)
                lse = torch.full((3, 8, nq), float("nan"))
                o, l_ = decode.attention_decode(case, out=out, lse=lse, num_splits=splits)
                want, want_lse = ref.attention_reference(case.q, case.k, case.v, **case.mask_kwargs())
                tol = 2e-3 if dtype == torch.float16 else 1e-4
                torch.testing.assert_close(o, want, atol=tol, rtol=tol)
                torch.testing.assert_close(l_, want_lse, atol=1e-4, rtol=1e-4)

    def test_decode_kernel_reads_only_keys_before_the_largest_position():
        case = _decode_args(2, 4, 2, 2, 512, 16, torch.float32, 17)
        case.q_pos = torch.tensor([[90, 100], [7, -3]])
        want, want_lse = ref.attention_reference(case.q, case.k, case.v, **case.mask_kwargs())
        for t in ("k", "v"):
            poisoned = getattr(case, t).clone()
            poisoned[0, :, 101:] = float("nan")
            poisoned[1, :, 8:] = float("nan")
            setattr(case, t, poisoned)
        for splits in (1, 4):
            o, l_ = decode.attention_decode(case, num_splits=splits)
            torch.testing.assert_close(o, want, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(l_, want_lse, atol=1e-4, rtol=1e-4)

    @pytest.mark.parametrize("page", [16, 5])
    def test_paged_decode_with_positions(page):
        # A shuffled pool of pages, lengths off the page size, positions (not the lengths) end each sequence.
        g = _gen(18)
        b, hq, hkv, nq, d, pages_per_seq = 3, 4, 2, 2, 16, 12
        nblocks = b * pages_per_seq + 3
        kc = torch.randn(nblocks, page, hkv, d, generator=g).half()
        vc = torch.randn(nblocks, page, hkv, d, generator=g).half()
        table = torch.randperm(nblocks, generator=g)[: b * pages_per_seq].view(b, pages_per_seq).int()
        seqlens = torch.tensor([pages_per_seq * page, 33, 1])
        q = torch.randn(b, nq, hq, d, generator=g).half()
        q_pos = torch.tensor([[20, 41], [31, 32], [0, -1]])
        out, lse = decode.paged_decode(q, kc, vc, seqlens, table, scale=0.3, causal=False, num_splits=3, q_pos=q_pos)
        cap = pages_per_seq * page
        k, v = gather_cache(kc, table, b), gather_cache(vc, table, b)
        _, keep = key_positions(seqlens, None, nq, cap, False)
        want, want_lse = ref.attention_reference(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=0.3,
                                                 bias=keep.unsqueeze(1), q_pos=q_pos)
        torch.testing.assert_close(out, want.transpose(1, 2), atol=2e-3, rtol=2e-3)
        torch.testing.assert_close(lse, want_lse, atol=1e-4, rtol=1e-4)
