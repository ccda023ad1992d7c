"""Hopper backward written in Gluon: dK, dV and dQ from one pass over the score tiles (five products).

The `tl` backward (triton_bwd.py) needs two kernels and seven products, because without atomics dQ
must be recomputed per query block, and its dK/dV kernel runs out of registers at d128. This one is
FA3's schedule:
- a program owns BLOCK_N = 128 keys of one K/V head and loops over the query blocks (of every q head
  of its GQA group) that reach them; K and V stay in shared memory for the whole loop. Each program
  starts its sweep at its own query block, so programs running together reduce into different dQ tiles;
- a producer warp moves each Q and dO tile by TMA into a ring of STAGES shared-memory slots, and the block's
  lse and δ rows beside them (plain loads issued before it waits for the slot). The consumers read those
  from shared memory: when they loaded them from global memory themselves, at the top of each step, the
  load's latency sat on their critical path (Nsight Compute on the H200, d64 N 16k: 3.1 of 9.7 cycles
  between issues stalled on a long scoreboard); moving them here took the kernel from 0.83-0.91x cuDNN's
  backward to 0.93-1.00x (benchmarks/results/gluon-bwd-lse-smem-h200-2026-12-04.txt). Prefetching them a
  step ahead in the consumers' registers instead gained less at d64 and spilled at d128;
- the consumer is two warpgroups (8 warps, 64 keys each) holding dK and dV in registers. Per query
  block of BLOCK_M rows they compute

      Sᵀ = K·Qᵀ, dPᵀ = V·dOᵀ (async)  ->  Pᵀ = exp2(Sᵀ·scale·log2e − lse)  ->  dSᵀ = Pᵀ∘(dPᵀ − δ)
      ->  dQ_blk = dS·K, dK += dSᵀ·Q, dV += Pᵀ·dO (async, in that order)  ->  scale·dQ_blk to shared memory

  with Pᵀ and dSᵀ as register operands; dSᵀ also goes to shared memory (double-buffered), because
  dQ = dS·K needs the whole 128-key tile, half of which the other warpgroup computed;
- a writer warp adds each dQ tile into a zeroed fp32 [B·Hq, Nq, D] buffer with one TMA bulk reduction
  (cp.reduce.async.bulk.tensor), double-buffered, while the consumers go on; the launcher casts it.
  The consumers hand it a tile by a non-blocking arrival at a hardware named barrier (bar.arrive) on
  which the writer waits (bar.sync), as FA3 does: with an mbarrier, one thread's arrival had to follow
  a barrier over all 256 consumer threads, the second of two per step, and that wait cost 2-6%
  (benchmarks/results/gluon-bwd-named-barrier-h200-2026-12-04.txt).
Measured on H200 (benchmarks/results/kernels.md, 2026-12-01): without any dQ reduction the loop runs at
~650 TFLOP/s at d128; per-element atomics from the consumers cost a third of that (395-441), a single TMA
reduction issued by the consumers themselves 407, the writer warp 484 (cuDNN 540); with lse and δ from
shared memory 515-534 against cuDNN's 521-534 (2026-12-04).
The reduction order varies from run to run, so the launcher uses the `tl` kernels when torch asks for
deterministic algorithms.

Scope: the structural masks (causal in any alignment, sliding window, key-padding lengths, ragged
Nq / Nk), a boolean key-padding mask shared by the heads ([B, 1, 1, Nk], as encoders build from their
attention_mask), GQA, dropout (the op's counter hash, as the forward drew it), BSHD / BHSD strides TMA
accepts, fp16 / bf16, head-dim blocks 64 and 128 with head dims a multiple of 8, positive scale. Other
biases and softcap run on the `tl` kernels. Tested on the GPU only (no Gluon interpreter).
Keys and values past a key length are never used: the key block that straddles it zeroes them in shared memory
before its loop (zero_rows_from), since TMA loads whole tiles. Causal programs launch in groups of heads, the
key block with the most query rows first (grouped_program_ids).
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin as _gl_builtin
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma
from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma_wait

from .gluon_fwd import LOG2E, _partition_barrier, _tma_load, zero_rows_from
from .triton_common import dropout_keep, dropout_row_hash, grouped_tile_ids, key_limit, q_block_range, structural_ok


# Helpers of the tl kernels, re-wrapped for Gluon: query-block bounds of a key block (blocks in
# [full_lo, full_hi) need no mask), the admissible (row, key) pairs, the one-axis grid's ids.
_q_range = gluon.jit(q_block_range.fn)
_key_limit = gluon.jit(key_limit.fn)
_structural_ok = gluon.jit(structural_ok.fn)
_grouped_ids = gluon.jit(grouped_tile_ids.fn)
_dropout_row_hash = gluon.jit(dropout_row_hash.fn)
_dropout_keep = gluon.jit(dropout_keep.fn)


@_gl_builtin
def _tma_reduce_add_36(desc, coord, src, _semantic=None):
    """desc[coord] += src (a shared-memory tile) by one TMA bulk reduction, cp.reduce.async.bulk.tensor:
    Triton 3.6's Gluon has the op but no call for it."""
    from triton._C.libtriton import ir

    offsets = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, desc.handle, offsets, src.handle)


# Later releases have the call: tma.async_atomic_add(desc, coord, src).
_tma_reduce_add = getattr(tma, "async_atomic_add", None) or _tma_reduce_add_36

# Hardware named barriers 8 and 9 (of 16) carry the dQ tiles of even and odd steps from the consumers to the
# writer warp; Triton's own barriers here are 0 (the consumer partition's) and 1 (the whole block's). Two ids,
# because the consumers may arrive for step i + 1 before the writer has waited for step i.
DQ_FULL_BAR = gl.constexpr(8)


@gluon.jit
def _dq_full_arrive(bar_id):
    """Every consumer thread arrives at named barrier bar_id without waiting: 256 consumer threads plus the
    writer warp's 32 complete it (the kernel runs with num_warps=8 and a one-warp writer). Memory accesses
    before the arrival are visible to the threads that wait there."""
    gl.inline_asm_elementwise("bar.arrive $1, 288;\n mov.u32 $0, 0;", "=r,r", [bar_id], dtype=gl.int32,
                              is_pure=False, pack=1)


@gluon.jit
def _dq_full_wait(bar_id):
    gl.inline_asm_elementwise("bar.sync $1, 288;\n mov.u32 $0, 0;", "=r,r", [bar_id], dtype=gl.int32,
                              is_pure=False, pack=1)


@gluon.jit
def _block_of(i, n_mblk, rot, lo, BLOCK_M: gl.constexpr):
    """Step i -> (head of the group, first query row). Each program starts its sweep over the query
    blocks at its own offset `rot`, so the programs running together add into different dQ tiles
    instead of all queueing on the same addresses."""
    g = i // n_mblk
    j = i - g * n_mblk + rot
    j = gl.where(j >= n_mblk, j - n_mblk, j)
    return g, lo + j * BLOCK_M


@gluon.jit
def _bwd_producer(q_desc, do_desc, k_desc, v_desc, LSE, DELTA, q_smem, do_smem, k_smem, v_smem, lse_smem, dl_smem,
                  kv_bar, q_full, q_empty, b, hk, G, Hq, n0, lo, n_mblk, n_iter, rot, Nq,
                  BLOCK_M: gl.constexpr, STAGES: gl.constexpr):
    """One warp: K and V once, then per step the Q and dO tiles by TMA and the block's lse and δ rows by plain
    loads (issued before it waits for the slot, so their latency overlaps that wait) into the same slot."""
    row_layout: gl.constexpr = gl.BlockedLayout([BLOCK_M // 32], [32], [1], [0])
    rows0 = gl.arange(0, BLOCK_M, layout=row_layout)
    mbarrier.expect(kv_bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    _tma_load(k_desc, [b, hk, n0, 0], kv_bar, k_smem)
    _tma_load(v_desc, [b, hk, n0, 0], kv_bar, v_smem)
    for i in range(n_iter):
        slot = i % STAGES
        g, start_m = _block_of(i, n_mblk, rot, lo, BLOCK_M)
        h = hk * G + g
        bh = (b * Hq + h).to(gl.int64)
        rows = start_m + rows0
        # Rows past Nq: lse = +inf makes their probabilities exactly 0; an empty row (lse = -inf) reads 0.
        lse = gl.load(LSE + bh * Nq + rows, mask=rows < Nq, other=float("inf"))
        delta = gl.load(DELTA + bh * Nq + rows, mask=rows < Nq, other=0.0)
        mbarrier.wait(q_empty.index(slot), ((i // STAGES) & 1) ^ 1)  # a fresh barrier passes parity 1
        lse_smem.index(slot).store(lse)
        dl_smem.index(slot).store(delta)
        _partition_barrier()  # every lane's rows are stored before the expect's arrive releases them
        mbarrier.expect(q_full.index(slot), q_desc.block_type.nbytes + do_desc.block_type.nbytes)
        _tma_load(q_desc, [b, h, start_m, 0], q_full.index(slot), q_smem.index(slot))
        _tma_load(do_desc, [b, h, start_m, 0], q_full.index(slot), do_smem.index(slot))


@gluon.jit
def _bwd_dq_writer(dqa_desc, dq_smem, dq_empty, hk, G, Hq, b, lo, n_mblk, n_iter, rot, BLOCK_M: gl.constexpr):
    """One warp: each block's scale·dQ tile goes from shared memory into the fp32 buffer by one TMA
    reduction (rows past Nq are clipped by TMA), so the consumers only store it and move on."""
    for i in range(n_iter):
        g, start_m = _block_of(i, n_mblk, rot, lo, BLOCK_M)
        _dq_full_wait(DQ_FULL_BAR + i % 2)
        _tma_reduce_add(dqa_desc, [0, b * Hq + hk * G + g, start_m, 0], dq_smem.index(i % 2))
        tma.store_wait(0)  # the tile has been read out of shared memory
        mbarrier.arrive(dq_empty.index(i % 2))


@gluon.jit
def _bwd_consumer(q_smem, do_smem, k_smem, v_smem, lse_smem, dl_smem, ds_smem, dq_smem, kv_bar, q_full, q_empty,
                  dq_empty, DK, DV,
                  stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn,
                  b, hk, G, Hq, n0, lo, full_lo, full_hi, n_mblk, n_iter, rot, Nq, Nk, n_lim, D, DVD,
                  qk_scale, scale, diag_offset, window_left, window_right, seed, drop_threshold, drop_scale,
                  KMASK, stride_kmb, stride_kmn,
                  BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_D: gl.constexpr, BLOCK_DV: gl.constexpr,
                  STAGES: gl.constexpr, IS_CAUSAL: gl.constexpr, HAS_WL: gl.constexpr, HAS_WR: gl.constexpr,
                  DROPOUT: gl.constexpr, KEY_MASK: gl.constexpr, HAS_KVLEN: gl.constexpr):
    dtype: gl.constexpr = k_smem.dtype
    # Two warpgroups split the key rows of Sᵀ, dPᵀ, dK and dV; for dQ (BLOCK_M rows) they split the columns.
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[8, 1],
                                                       instr_shape=[16, BLOCK_M, 16])
    dk_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[8, 1],
                                                        instr_shape=[16, BLOCK_D, 16])
    dv_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[8, 1],
                                                        instr_shape=[16, BLOCK_DV, 16])
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                        instr_shape=[16, BLOCK_D // 2, 16])
    pt_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dv_layout, k_width=2)
    dst_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dk_layout, k_width=2)

    keys = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, s_layout))
    qcols0 = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, s_layout))
    dk = gl.zeros([BLOCK_N, BLOCK_D], gl.float32, layout=dk_layout)
    dv = gl.zeros([BLOCK_N, BLOCK_DV], gl.float32, layout=dv_layout)
    s_zero = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=s_layout)
    dq_zero = gl.zeros([BLOCK_M, BLOCK_D], gl.float32, layout=dq_layout)

    if KEY_MASK:  # this program's keys of a key-padding mask, the same for every query row and head
        kept = gl.load(KMASK + b.to(gl.int64) * stride_kmb + keys.to(gl.int64) * stride_kmn, mask=keys < Nk,
                       other=0) != 0
    mbarrier.wait(kv_bar, 0)
    k2 = k_smem.reshape([BLOCK_N, BLOCK_D])
    v2 = v_smem.reshape([BLOCK_N, BLOCK_DV])
    if HAS_KVLEN:
        if (n0 < n_lim) & (n0 + BLOCK_N > n_lim):
            # The key block that straddles the length: its keys and values past it are zeroed in shared memory
            # (P is 0 there, but 0 times a non-finite value is NaN in dPᵀ and in dQ's product with K).
            zero_rows_from(k2, n_lim - n0, BLOCK_N, BLOCK_D, 8)
            zero_rows_from(v2, n_lim - n0, BLOCK_N, BLOCK_DV, 8)
            fence_async_shared()
            _partition_barrier()
    for i in range(n_iter):
        slot = i % STAGES
        g, start_m = _block_of(i, n_mblk, rot, lo, BLOCK_M)
        qcols = start_m + qcols0
        mbarrier.wait(q_full.index(slot), (i // STAGES) & 1)
        lse = lse_smem.index(slot).load(gl.SliceLayout(0, s_layout))
        delta = dl_smem.index(slot).load(gl.SliceLayout(0, s_layout))
        lse2 = gl.where(lse == float("-inf"), 0.0, lse) * LOG2E
        q2 = q_smem.index(slot).reshape([BLOCK_M, BLOCK_D])
        do2 = do_smem.index(slot).reshape([BLOCK_M, BLOCK_DV])
        s_tok = warpgroup_mma(k2, q2.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        dp_tok = warpgroup_mma(v2, do2.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        st = warpgroup_mma_wait(1, deps=[s_tok])
        if (start_m < full_lo) | (start_m >= full_hi):
            ok = _structural_ok(gl.expand_dims(qcols, 0), gl.expand_dims(keys, 1), n_lim, diag_offset,
                                window_left, window_right, IS_CAUSAL, HAS_WL, HAS_WR)
            st = gl.where(ok, st, float("-inf"))
        if KEY_MASK:
            st = gl.where(gl.expand_dims(kept, 1), st, float("-inf"))
        pt = gl.exp2(st * qk_scale - gl.expand_dims(lse2, 0))
        if DROPOUT:
            # The op's counter-hash mask (dropout_hash.py), the forward's bits. Kept elements carry Pᵀ, dropped
            # ones -Pᵀ (Pᵀ >= 0): dV takes max(Pᵀ, 0) / (1 - p), dPᵀ is kept where Pᵀ > 0, and dSᵀ uses |Pᵀ|,
            # so no mask stays live across the products (an element with Pᵀ = 0 gets dSᵀ = 0 either way).
            row_part = _dropout_row_hash(seed, b * Hq + hk * G + g, Nq, qcols)
            keep = _dropout_keep(gl.expand_dims(row_part, 0), gl.expand_dims(keys, 1), drop_threshold)
            pt = gl.where(keep, pt, -pt)
            pt16 = gl.convert_layout((gl.maximum(pt, 0.0) * drop_scale).to(dtype), pt_op)
            dpt = warpgroup_mma_wait(0, deps=[dp_tok])
            dpt = gl.where(pt > 0.0, dpt * drop_scale, 0.0)
            pt = gl.abs(pt)
        else:
            pt16 = gl.convert_layout(pt.to(dtype), pt_op)
            dpt = warpgroup_mma_wait(0, deps=[dp_tok])
        dst16 = (pt * (dpt - gl.expand_dims(delta, 0))).to(dtype)
        buf = ds_smem.index(i % 2)
        buf.store(dst16)
        fence_async_shared()
        # Both halves of dSᵀ are in shared memory, and both warpgroups are done with block i - 1 (its
        # products were waited for), so its Q/dO slot can be refilled and the other dS buffer rewritten.
        _partition_barrier()
        if i > 0:
            mbarrier.arrive(q_empty.index((i - 1) % STAGES))
        # dQ first, then dK and dV: dQ's hand-off to the writer warp overlaps the other two products.
        dq_tok = warpgroup_mma(buf.permute((1, 0)), k2, dq_zero, use_acc=False, is_async=True)
        dk_tok = warpgroup_mma(gl.convert_layout(dst16, dst_op), q2, dk, is_async=True)
        dv_tok = warpgroup_mma(pt16, do2, dv, is_async=True)
        dq = warpgroup_mma_wait(2, deps=[dq_tok])
        mbarrier.wait(dq_empty.index(i % 2), ((i // 2) & 1) ^ 1)
        dq_smem.index(i % 2).reshape([BLOCK_M, BLOCK_D]).store(dq * scale)
        fence_async_shared()  # the generic-proxy stores, before the writer's TMA reads them
        _dq_full_arrive(DQ_FULL_BAR + i % 2)
        dk, dv = warpgroup_mma_wait(0, deps=[dk_tok, dv_tok])

    rows_k = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, dk_layout))
    cols_k = gl.arange(0, BLOCK_D, layout=gl.SliceLayout(0, dk_layout))
    dk_ptr = (DK + b.to(gl.int64) * stride_dkb + hk.to(gl.int64) * stride_dkh
              + gl.expand_dims(rows_k.to(gl.int64) * stride_dkn, 1) + gl.expand_dims(cols_k, 0))
    gl.store(dk_ptr, (dk * scale).to(dtype),
             mask=gl.expand_dims(rows_k < Nk, 1) & gl.expand_dims(cols_k < D, 0))
    rows_v = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, dv_layout))
    cols_v = gl.arange(0, BLOCK_DV, layout=gl.SliceLayout(0, dv_layout))
    dv_ptr = (DV + b.to(gl.int64) * stride_dvb + hk.to(gl.int64) * stride_dvh
              + gl.expand_dims(rows_v.to(gl.int64) * stride_dvn, 1) + gl.expand_dims(cols_v, 0))
    gl.store(dv_ptr, dv.to(dtype), mask=gl.expand_dims(rows_v < Nk, 1) & gl.expand_dims(cols_v < DVD, 0))


@gluon.jit
def attn_bwd_gluon_kernel(
    q_desc, k_desc, v_desc, do_desc, LSE, DELTA, dqa_desc, DK, DV, KVLENS,
    stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn,
    Hq, Hkv, G, Nq, Nk, D, DVD, qk_scale, scale, diag_offset, window_left, window_right,
    SEED, drop_threshold, drop_scale, KMASK, stride_kmb, stride_kmn, n_groups,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_D: gl.constexpr, BLOCK_DV: gl.constexpr,
    STAGES: gl.constexpr, IS_CAUSAL: gl.constexpr, HAS_WL: gl.constexpr, HAS_WR: gl.constexpr,
    HAS_KVLEN: gl.constexpr, DROPOUT: gl.constexpr, KEY_MASK: gl.constexpr,
):
    """One program per (BLOCK_N keys, batch x K/V head); launched with num_warps=8 (the consumer).

    dqa_desc: TMA descriptor of a zeroed fp32 [1, B * Hq, Nq, D] buffer that receives scale · dQ;
    DK / DV are written once per element. DROPOUT: SEED points to the op's seed, drop_threshold and
    drop_scale as the `tl` kernels take them. KEY_MASK: KMASK holds a key-padding mask as bytes (nonzero: kept),
    key j of batch b at b * stride_kmb + j * stride_kmn, the same for every head and query row.
    n_groups: the launch order's (batch x K/V head) groups (triton_family.launch_groups; causal: key block 0,
    which has the most query rows, first in each group)."""
    dtype: gl.constexpr = q_desc.dtype
    pid_n, bhk = _grouped_ids(gl.program_id(0), gl.num_programs(0), (Nk + BLOCK_N - 1) // BLOCK_N, n_groups, False)
    b = bhk // Hkv
    hk = bhk % Hkv
    n0 = pid_n * BLOCK_N

    q_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BLOCK_M, BLOCK_D], q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BLOCK_M, BLOCK_DV], do_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [1, 1, BLOCK_N, BLOCK_D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [1, 1, BLOCK_N, BLOCK_DV], v_desc.layout)
    ds_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    ds_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, BLOCK_M], ds_layout)
    row_smem_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    lse_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], row_smem_layout)
    dl_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], row_smem_layout)
    dq_smem = gl.allocate_shared_memory(gl.float32, [2, 1, 1, BLOCK_M, BLOCK_D], dqa_desc.layout)
    dq_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(q_full.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=1)
    for i in gl.static_range(2):
        mbarrier.init(dq_empty.index(i), count=1)

    seed = 0
    if DROPOUT:
        seed = gl.load(SEED).to(gl.uint32)
    n_lim = _key_limit(KVLENS, b, Nk, HAS_KVLEN)
    lo, full_lo, full_hi, hi = _q_range(n0, Nq, n_lim, diag_offset, window_left, window_right,
                                        IS_CAUSAL, HAS_WL, HAS_WR, BLOCK_M, BLOCK_N)
    n_mblk = (hi - lo) // BLOCK_M
    n_iter = G * n_mblk
    rot = pid_n % gl.maximum(n_mblk, 1)

    gl.warp_specialize([
        (_bwd_consumer, (q_smem, do_smem, k_smem, v_smem, lse_smem, dl_smem, ds_smem, dq_smem, kv_bar, q_full,
                         q_empty, dq_empty, DK, DV, stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn,
                         b, hk, G, Hq, n0, lo, full_lo, full_hi, n_mblk, n_iter, rot, Nq, Nk, n_lim, D, DVD,
                         qk_scale, scale, diag_offset, window_left, window_right, seed, drop_threshold,
                         drop_scale, KMASK, stride_kmb, stride_kmn, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, STAGES,
                         IS_CAUSAL, HAS_WL, HAS_WR, DROPOUT, KEY_MASK, HAS_KVLEN)),
        (_bwd_producer, (q_desc, do_desc, k_desc, v_desc, LSE, DELTA, q_smem, do_smem, k_smem, v_smem, lse_smem,
                         dl_smem, kv_bar, q_full, q_empty, b, hk, G, Hq, n0, lo, n_mblk, n_iter, rot, Nq, BLOCK_M,
                         STAGES)),
        (_bwd_dq_writer, (dqa_desc, dq_smem, dq_empty, hk, G, Hq, b, lo, n_mblk, n_iter, rot, BLOCK_M)),
    ], [1, 1], [24, 24])

    mbarrier.invalidate(kv_bar)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(q_full.index(i))
        mbarrier.invalidate(q_empty.index(i))
    for i in gl.static_range(2):
        mbarrier.invalidate(dq_empty.index(i))
