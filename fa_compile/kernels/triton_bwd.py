"""Fused attention backward in Triton: delta preprocess, dK/dV kernel, dQ kernel (no atomics by default).

dK/dV: one program per (key block, B * Hkv); it loops over the G query heads of its group and over
the query blocks that reach its keys, so the GQA reduction happens in registers. It works on the
transposed score tile (keys down), as the operand layouts of P^T dO and dS^T Q want.
dQ: one program per (query block, B * Hq), looping over key blocks like the forward; with a bias
that needs its gradient, it also writes dS (fp32) for the launcher to reduce over broadcast dims.
Each output element is written by exactly one program, so the backward is deterministic.
FUSED_DQ (opt-in, triton_family.fuses_dq): the dK/dV kernel also adds each tile's dS^T K into an fp32 dQ buffer
by atomics (DQA, [B * Hq, Nq, D], zeroed by the launcher, scaled and cast after) and no dQ kernel runs; the
sums then arrive in varying order. Keys and values past kv_lens are zeroed in the dK/dV kernel, as the dQ
kernel never loads them: their dS is exactly 0 whatever those slots hold.
Run-time positions and segments (HAS_QPOS, HAS_SEG; see triton_fwd.py): dQ reads keys as the forward does
(up to the tile's largest position, within the span of key tiles whose ids can meet the query tile's);
dK/dV loops over the span of query tiles that can reach its keys: some position at or after its first
key, some id in its keys' [min, max] (triton_common.query_tile_range).
"""
from __future__ import annotations

import triton
import triton.language as tl

from .triton_common import (
    dropout_keep, dropout_row_hash, key_limit, key_tile_range, kv_block_range, position_segment_ok, program_ids,
    q_block_range, query_tile_range, row_positions, score_tile, segment_ids, structural_ok,
)


@triton.jit
def attn_bwd_preprocess_kernel(
    O, DO, DELTA, stride_ob, stride_oh, stride_om, stride_db, stride_dh, stride_dm, Hq, Nq, DV,
    BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    pid_m, bh = program_ids(tl.cdiv(Nq, BLOCK_M), False)
    b = bh // Hq
    h = bh % Hq
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_dv = tl.arange(0, BLOCK_DV)
    mask = (offs_m[:, None] < Nq) & (offs_dv[None, :] < DV)
    o = tl.load(O + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh + offs_m[:, None].to(tl.int64) * stride_om + offs_dv[None, :], mask=mask, other=0.0)
    do = tl.load(DO + b.to(tl.int64) * stride_db + h.to(tl.int64) * stride_dh + offs_m[:, None].to(tl.int64) * stride_dm + offs_dv[None, :], mask=mask, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(DELTA + bh.to(tl.int64) * Nq + offs_m, delta, mask=offs_m < Nq)


@triton.jit
def _dkdv_tile(
    dk, dv, k, v, q_base, do_base, q_desc, do_desc, b, h, lse_base, delta_base, bias_base, seed, bh,
    offs_m, offs_n, offs_d, offs_dv,
    stride_qm, stride_dom, stride_bm, stride_bn, Nq, Nk, n_lim, D, DV,
    qk_scale, softcap, cap_scale, diag_offset, window_left, window_right, drop_threshold, drop_scale,
    start_m, qp, qs, ks, dqa_base,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, USE_TMA: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_WL: tl.constexpr, HAS_WR: tl.constexpr,
    MASK: tl.constexpr, BIAS_KIND: tl.constexpr, SOFTCAP: tl.constexpr, DROPOUT: tl.constexpr,
    PLAIN: tl.constexpr, HAS_QPOS: tl.constexpr, HAS_SEG: tl.constexpr, ZERO_EMPTY: tl.constexpr,
    FUSED_DQ: tl.constexpr,
):
    m_ok = offs_m < Nq
    if USE_TMA:  # zero fill past Nq and past the head dim
        qT = tl.trans(q_desc.load([b, h, start_m, 0]).reshape(BLOCK_M, BLOCK_D))
    else:
        qT = tl.load(
            q_base + offs_m[None, :].to(tl.int64) * stride_qm + offs_d[:, None],
            mask=m_ok[None, :] & (offs_d[:, None] < D), other=0.0,
        )
    # Rows past Nq: lse = +inf makes their probabilities exactly 0.
    lse = tl.load(lse_base + offs_m, mask=m_ok, other=float("inf"))
    empty = lse == float("-inf")
    lse2 = tl.where(empty, 0.0, lse) * 1.4426950408889634
    kq = tl.dot(k, qT)  # [BN, BM]
    extraT = position_segment_ok(qp[None, :], offs_n[:, None], qs[None, :], ks[:, None], HAS_QPOS, HAS_SEG)
    if PLAIN:  # scale folded into exp2's FMA (see the forward)
        if MASK:
            okT = structural_ok(offs_m[None, :], offs_n[:, None], n_lim, diag_offset, window_left, window_right,
                                IS_CAUSAL, HAS_WL, HAS_WR)
            kq = tl.where(okT, kq, float("-inf"))
        if HAS_QPOS or HAS_SEG:
            kq = tl.where(extraT, kq, float("-inf"))
        pT = tl.math.exp2(kq * qk_scale - lse2[None, :])
        tT = kq
    else:
        sT, tT = score_tile(
            kq, offs_m[None, :], offs_n[:, None], qk_scale, softcap, cap_scale,
            bias_base, stride_bm, stride_bn, Nq, Nk, n_lim, diag_offset, window_left, window_right,
            IS_CAUSAL, HAS_WL, HAS_WR, MASK, BIAS_KIND, SOFTCAP,
        )
        if HAS_QPOS or HAS_SEG:
            sT = tl.where(extraT, sT, float("-inf"))
        pT = tl.math.exp2(sT - lse2[None, :])
    if USE_TMA:
        do = do_desc.load([b, h, start_m, 0]).reshape(BLOCK_M, BLOCK_DV)
    else:
        do = tl.load(
            do_base + offs_m[:, None].to(tl.int64) * stride_dom + offs_dv[None, :],
            mask=m_ok[:, None] & (offs_dv[None, :] < DV), other=0.0,
        )
    delta = tl.load(delta_base + offs_m, mask=m_ok, other=0.0)
    if ZERO_EMPTY:  # a row with no key: its P is 0, and its dO (maybe not finite) must weigh nothing either
        do = tl.where(empty[:, None], 0.0, do)
        delta = tl.where(empty, 0.0, delta)
    if DROPOUT:
        row_hash = dropout_row_hash(seed, bh, Nq, offs_m)[None, :]
        keep = dropout_keep(row_hash, offs_n[:, None], drop_threshold)
        # The keep mask rides in Pᵀ's sign (Pᵀ >= 0) across the next product instead of as a [BN, BM] mask of
        # its own: at d64 with 64 x 64 tiles that mask held the registers the kernel spilled (255 registers,
        # 48 bytes of spills under ptxas for sm_90; none with the sign). An element with Pᵀ = 0 gets dSᵀ = 0
        # either way.
        pT = tl.where(keep, pT, -pT)
        pdT = tl.maximum(pT, 0.0) * drop_scale
    else:
        pdT = pT
    dv = tl.dot(pdT.to(do.dtype), do, dv)
    dpT = tl.dot(v, tl.trans(do))  # [BN, BM]
    if DROPOUT:
        dpT = tl.where(pT > 0.0, dpT * drop_scale, 0.0)
        pT = tl.abs(pT)
    dsT = pT * (dpT - delta[None, :])
    if SOFTCAP:
        dsT = dsT * (1.0 - tT * tT)
    dk = tl.dot(dsT.to(qT.dtype), tl.trans(qT), dk)
    if FUSED_DQ:  # this key tile's share of dQ (unscaled), summed in fp32 over the key tiles by atomics
        dq = tl.dot(tl.trans(dsT.to(k.dtype)), k)
        tl.atomic_add(dqa_base + offs_m[:, None].to(tl.int64) * D + offs_d[None, :], dq,
                      mask=m_ok[:, None] & (offs_d[None, :] < D), sem="relaxed")
    return dk, dv


@triton.jit
def _dkdv_range(
    dk, dv, k, v, q_base, do_base, q_desc, do_desc, b, h, lse_base, delta_base, bias_base, seed, bh,
    offs_n, offs_d, offs_dv,
    stride_qm, stride_dom, stride_bm, stride_bn, Nq, Nk, n_lim, D, DV,
    qk_scale, softcap, cap_scale, diag_offset, window_left, window_right, drop_threshold, drop_scale,
    lo, hi, qpos_base, stride_pm, qseg_base, stride_qsm, ks, q_first, q_last, dqa_base,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, USE_TMA: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_WL: tl.constexpr, HAS_WR: tl.constexpr,
    MASK: tl.constexpr, BIAS_KIND: tl.constexpr, SOFTCAP: tl.constexpr, DROPOUT: tl.constexpr,
    PLAIN: tl.constexpr, HAS_QPOS: tl.constexpr, HAS_SEG: tl.constexpr, ZERO_EMPTY: tl.constexpr,
    FUSED_DQ: tl.constexpr,
):
    if HAS_QPOS or HAS_SEG:  # only the span of query tiles that can reach these keys
        lo = tl.maximum(lo, q_first)
        hi = tl.minimum(hi, q_last)
    for start_m in range(lo, hi, BLOCK_M):
        start_m = tl.multiple_of(start_m, BLOCK_M)
        offs_m = start_m + tl.arange(0, BLOCK_M)
        qp = offs_m
        qs = offs_m
        if HAS_QPOS:
            qp = row_positions(qpos_base, stride_pm, offs_m, Nq, Nk)
        if HAS_SEG:
            qs = segment_ids(qseg_base, stride_qsm, offs_m, Nq, start_m)
        dk, dv = _dkdv_tile(
            dk, dv, k, v, q_base, do_base, q_desc, do_desc, b, h, lse_base, delta_base, bias_base, seed, bh,
            offs_m, offs_n, offs_d, offs_dv,
            stride_qm, stride_dom, stride_bm, stride_bn, Nq, Nk, n_lim, D, DV,
            qk_scale, softcap, cap_scale, diag_offset, window_left, window_right, drop_threshold, drop_scale,
            start_m, qp, qs, ks, dqa_base,
            BLOCK_M, BLOCK_D, BLOCK_DV, USE_TMA, IS_CAUSAL, HAS_WL, HAS_WR, MASK, BIAS_KIND, SOFTCAP, DROPOUT,
            PLAIN, HAS_QPOS, HAS_SEG, ZERO_EMPTY, FUSED_DQ,
        )
    return dk, dv


@triton.jit
def attn_bwd_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV_, BIAS, KVLENS, SEED, q_desc, k_desc, v_desc, do_desc,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_dom,
    stride_dkb, stride_dkh, stride_dkn,
    stride_dvb, stride_dvh, stride_dvn,
    stride_bb, stride_bh, stride_bm, stride_bn,
    Hq, Hkv, G, Nq, Nk, D, DV,
    qk_scale, softcap, cap_scale, scale, diag_offset, window_left, window_right, drop_threshold, drop_scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    IS_CAUSAL: tl.constexpr, HAS_WL: tl.constexpr, HAS_WR: tl.constexpr, HAS_KVLEN: tl.constexpr,
    BIAS_KIND: tl.constexpr, SOFTCAP: tl.constexpr, DROPOUT: tl.constexpr, PLAIN: tl.constexpr,
    USE_TMA: tl.constexpr,
    QPOS=None, stride_pb=0, stride_pm=0, HAS_QPOS: tl.constexpr = False,
    QSEG=None, stride_qsb=0, stride_qsm=0, KSEG=None, stride_ksb=0, stride_ksn=0, HAS_SEG: tl.constexpr = False,
    ZERO_EMPTY: tl.constexpr = False, DQA=None, FUSED_DQ: tl.constexpr = False,
):
    # Inductor's launcher types float arguments fp64; the math is fp32 (a dot's accumulator must stay fp32).
    qk_scale = tl.cast(qk_scale, tl.float32)
    softcap = tl.cast(softcap, tl.float32)
    cap_scale = tl.cast(cap_scale, tl.float32)
    scale = tl.cast(scale, tl.float32)
    drop_scale = tl.cast(drop_scale, tl.float32)
    pid_n, bhk = program_ids(tl.cdiv(Nk, BLOCK_N), False)
    b = bhk // Hkv
    hk = bhk % Hkv
    n0 = pid_n * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    n_ok = offs_n < Nk
    if USE_TMA:
        k = k_desc.load([b, hk, n0, 0]).reshape(BLOCK_N, BLOCK_D)
        v = v_desc.load([b, hk, n0, 0]).reshape(BLOCK_N, BLOCK_DV)
    else:
        k = tl.load(
            K + b.to(tl.int64) * stride_kb + hk.to(tl.int64) * stride_kh + offs_n[:, None].to(tl.int64) * stride_kn + offs_d[None, :],
            mask=n_ok[:, None] & (offs_d[None, :] < D), other=0.0,
        )
        v = tl.load(
            V + b.to(tl.int64) * stride_vb + hk.to(tl.int64) * stride_vh + offs_n[:, None].to(tl.int64) * stride_vn + offs_dv[None, :],
            mask=n_ok[:, None] & (offs_dv[None, :] < DV), other=0.0,
        )
    n_lim = key_limit(KVLENS, b, Nk, HAS_KVLEN)
    if HAS_KVLEN:  # keys past the limit are never read (as in the dQ kernel): their dS is then exactly 0,
        # where a non-finite key or value there would make it NaN (and reach dQ in the fused form)
        k = tl.where((offs_n < n_lim)[:, None], k, 0.0)
        v = tl.where((offs_n < n_lim)[:, None], v, 0.0)
    seed = 0
    if DROPOUT:
        seed = tl.load(SEED).to(tl.uint32)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    lo, full_lo, full_hi, hi = q_block_range(
        n0, Nq, n_lim, diag_offset, window_left, window_right, IS_CAUSAL, HAS_WL, HAS_WR, BLOCK_M, BLOCK_N,
    )
    # Run-time structure: this key tile's ids and their [min, max] over its existing keys (placeholders without).
    qpos_base = QPOS
    qseg_base = QSEG
    ks = offs_n
    k_lo = 0
    k_hi = 0
    if HAS_QPOS:
        qpos_base = QPOS + b.to(tl.int64) * stride_pb
    if HAS_SEG:
        qseg_base = QSEG + b.to(tl.int64) * stride_qsb
        ks = segment_ids(KSEG + b.to(tl.int64) * stride_ksb, stride_ksn, offs_n, tl.minimum(n_lim, Nk), n0)
        k_lo = tl.min(ks, 0)
        k_hi = tl.max(ks, 0)
    q_first = lo
    q_last = hi
    if HAS_QPOS or HAS_SEG:  # (positions and ids are the same for every head of the group)
        q_first, q_last = query_tile_range(qpos_base, stride_pm, qseg_base, stride_qsm, Nq, Nk, n0, k_lo, k_hi, lo, hi,
                                           BLOCK_M, HAS_QPOS, HAS_SEG)
    for g in range(0, G):
        h = hk * G + g
        bh = b * Hq + h
        q_base = Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
        do_base = DO + b.to(tl.int64) * stride_dob + h.to(tl.int64) * stride_doh
        lse_base = LSE + bh.to(tl.int64) * Nq
        delta_base = DELTA + bh.to(tl.int64) * Nq
        dqa_base = DQA
        if FUSED_DQ:
            dqa_base = DQA + bh.to(tl.int64) * Nq * D
        bias_base = BIAS
        if BIAS_KIND != 0:
            bias_base = BIAS + b.to(tl.int64) * stride_bb + h.to(tl.int64) * stride_bh
        dk, dv = _dkdv_range(
            dk, dv, k, v, q_base, do_base, q_desc, do_desc, b, h, lse_base, delta_base, bias_base, seed, bh,
            offs_n, offs_d, offs_dv,
            stride_qm, stride_dom, stride_bm, stride_bn, Nq, Nk, n_lim, D, DV,
            qk_scale, softcap, cap_scale, diag_offset, window_left, window_right, drop_threshold, drop_scale,
            full_lo, full_hi, qpos_base, stride_pm, qseg_base, stride_qsm, ks, q_first, q_last, dqa_base,
            BLOCK_M, BLOCK_D, BLOCK_DV, USE_TMA, IS_CAUSAL, HAS_WL, HAS_WR, False, BIAS_KIND, SOFTCAP, DROPOUT, PLAIN,
            HAS_QPOS, HAS_SEG, ZERO_EMPTY, FUSED_DQ,
        )
        dk, dv = _dkdv_range(
            dk, dv, k, v, q_base, do_base, q_desc, do_desc, b, h, lse_base, delta_base, bias_base, seed, bh,
            offs_n, offs_d, offs_dv,
            stride_qm, stride_dom, stride_bm, stride_bn, Nq, Nk, n_lim, D, DV,
            qk_scale, softcap, cap_scale, diag_offset, window_left, window_right, drop_threshold, drop_scale,
            lo, full_lo, qpos_base, stride_pm, qseg_base, stride_qsm, ks, q_first, q_last, dqa_base,
            BLOCK_M, BLOCK_D, BLOCK_DV, USE_TMA, IS_CAUSAL, HAS_WL, HAS_WR, True, BIAS_KIND, SOFTCAP, DROPOUT, PLAIN,
            HAS_QPOS, HAS_SEG, ZERO_EMPTY, FUSED_DQ,
        )
        dk, dv = _dkdv_range(
            dk, dv, k, v, q_base, do_base, q_desc, do_desc, b, h, lse_base, delta_base, bias_base, seed, bh,
            offs_n, offs_d, offs_dv,
            stride_qm, stride_dom, stride_bm, stride_bn, Nq, Nk, n_lim, D, DV,
            qk_scale, softcap, cap_scale, diag_offset, window_left, window_right, drop_threshold, drop_scale,
            full_hi, hi, qpos_base, stride_pm, qseg_base, stride_qsm, ks, q_first, q_last, dqa_base,
            BLOCK_M, BLOCK_D, BLOCK_DV, USE_TMA, IS_CAUSAL, HAS_WL, HAS_WR, True, BIAS_KIND, SOFTCAP, DROPOUT, PLAIN,
            HAS_QPOS, HAS_SEG, ZERO_EMPTY, FUSED_DQ,
        )
    dk = dk * scale
    st_mask = n_ok[:, None]
    tl.store(
        DK + b.to(tl.int64) * stride_dkb + hk.to(tl.int64) * stride_dkh + offs_n[:, None].to(tl.int64) * stride_dkn + offs_d[None, :],
        dk.to(DK.dtype.element_ty), mask=st_mask & (offs_d[None, :] < D),
    )
    tl.store(
        DV_ + b.to(tl.int64) * stride_dvb + hk.to(tl.int64) * stride_dvh + offs_n[:, None].to(tl.int64) * stride_dvn + offs_dv[None, :],
        dv.to(DV_.dtype.element_ty), mask=st_mask & (offs_dv[None, :] < DV),
    )


@triton.jit
def _dq_tile(
    dq, q, do, lse2, delta, row_hash, k_base, v_base, k_desc, v_desc, b, hk, bias_base, ds_base,
    offs_m, offs_n, offs_d, offs_dv,
    stride_kn, stride_vn, stride_bm, stride_bn, Nq, Nk, n_lim, D, DV,
    qk_scale, softcap, cap_scale, diag_offset, window_left, window_right, drop_threshold, drop_scale,
    start_n, qp, qs, ks,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, USE_TMA: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_WL: tl.constexpr, HAS_WR: tl.constexpr,
    MASK: tl.constexpr, BIAS_KIND: tl.constexpr, SOFTCAP: tl.constexpr, DROPOUT: tl.constexpr,
    WRITE_DS: tl.constexpr, PLAIN: tl.constexpr, HAS_QPOS: tl.constexpr, HAS_SEG: tl.constexpr,
):
    n_ok = offs_n < Nk
    n_read = offs_n < n_lim  # keys past the limit (kv_lens, the tile's last position) are never read
    if USE_TMA:
        kT = tl.trans(k_desc.load([b, hk, start_n, 0]).reshape(BLOCK_N, BLOCK_D))
        vT = tl.trans(v_desc.load([b, hk, start_n, 0]).reshape(BLOCK_N, BLOCK_DV))
        if MASK:  # TMA loads whole tiles: the one that straddles the limit is zeroed past it, as the loads below do
            kT = tl.where(n_read[None, :], kT, 0.0)
            vT = tl.where(n_read[None, :], vT, 0.0)
    else:
        kT = tl.load(
            k_base + offs_n[None, :].to(tl.int64) * stride_kn + offs_d[:, None],
            mask=n_read[None, :] & (offs_d[:, None] < D), other=0.0,
        )
        vT = tl.load(
            v_base + offs_n[None, :].to(tl.int64) * stride_vn + offs_dv[:, None],
            mask=n_read[None, :] & (offs_dv[:, None] < DV), other=0.0,
        )
    qk = tl.dot(q, kT)
    extra = position_segment_ok(qp[:, None], offs_n[None, :], qs[:, None], ks[None, :], HAS_QPOS, HAS_SEG)
    if PLAIN:
        if MASK:
            ok = structural_ok(offs_m[:, None], offs_n[None, :], n_lim, diag_offset, window_left, window_right,
                               IS_CAUSAL, HAS_WL, HAS_WR)
            qk = tl.where(ok, qk, float("-inf"))
        if HAS_QPOS or HAS_SEG:
            qk = tl.where(extra, qk, float("-inf"))
        p = tl.math.exp2(qk * qk_scale - lse2[:, None])
        t = qk
    else:
        s, t = score_tile(
            qk, offs_m[:, None], offs_n[None, :], qk_scale, softcap, cap_scale,
            bias_base, stride_bm, stride_bn, Nq, Nk, n_lim, diag_offset, window_left, window_right,
            IS_CAUSAL, HAS_WL, HAS_WR, MASK, BIAS_KIND, SOFTCAP,
        )
        if HAS_QPOS or HAS_SEG:
            s = tl.where(extra, s, float("-inf"))
        p = tl.math.exp2(s - lse2[:, None])
    dp = tl.dot(do, vT)
    if DROPOUT:
        keep = dropout_keep(row_hash, offs_n[None, :], drop_threshold)
        dp = tl.where(keep, dp * drop_scale, 0.0)
    ds = p * (dp - delta[:, None])
    if WRITE_DS:
        tl.store(
            ds_base + offs_m[:, None].to(tl.int64) * Nk + offs_n[None, :], ds,
            mask=(offs_m[:, None] < Nq) & n_ok[None, :],
        )
    if SOFTCAP:
        ds = ds * (1.0 - t * t)
    dq = tl.dot(ds.to(kT.dtype), tl.trans(kT), dq)
    return dq


@triton.jit
def _dq_range(
    dq, q, do, lse2, delta, row_hash, k_base, v_base, k_desc, v_desc, b, hk, bias_base, ds_base,
    offs_m, offs_d, offs_dv,
    stride_kn, stride_vn, stride_bm, stride_bn, Nq, Nk, n_lim, D, DV,
    qk_scale, softcap, cap_scale, diag_offset, window_left, window_right, drop_threshold, drop_scale,
    lo, hi, qp, qs, seg_first, seg_last, kseg_base, stride_ksn,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, USE_TMA: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_WL: tl.constexpr, HAS_WR: tl.constexpr,
    MASK: tl.constexpr, BIAS_KIND: tl.constexpr, SOFTCAP: tl.constexpr, DROPOUT: tl.constexpr,
    WRITE_DS: tl.constexpr, PLAIN: tl.constexpr, HAS_QPOS: tl.constexpr, HAS_SEG: tl.constexpr,
):
    if HAS_SEG:  # key tiles outside the span are never read (dS stays 0 there)
        lo = tl.maximum(lo, seg_first)
        hi = tl.minimum(hi, seg_last)
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        offs_n = start_n + tl.arange(0, BLOCK_N)
        ks = qs
        if HAS_SEG:
            ks = segment_ids(kseg_base, stride_ksn, offs_n, Nk, start_n)
        dq = _dq_tile(
            dq, q, do, lse2, delta, row_hash, k_base, v_base, k_desc, v_desc, b, hk, bias_base, ds_base,
            offs_m, offs_n, offs_d, offs_dv,
            stride_kn, stride_vn, stride_bm, stride_bn, Nq, Nk, n_lim, D, DV,
            qk_scale, softcap, cap_scale, diag_offset, window_left, window_right, drop_threshold, drop_scale,
            start_n, qp, qs, ks,
            BLOCK_N, BLOCK_D, BLOCK_DV, USE_TMA, IS_CAUSAL, HAS_WL, HAS_WR, MASK, BIAS_KIND, SOFTCAP, DROPOUT,
            WRITE_DS, PLAIN, HAS_QPOS, HAS_SEG,
        )
    return dq


@triton.jit
def attn_bwd_dq_kernel(
    Q, K, V, DO, LSE, DELTA, DQ, DS, BIAS, KVLENS, SEED, q_desc, k_desc, v_desc, do_desc,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_dom,
    stride_dqb, stride_dqh, stride_dqm,
    stride_bb, stride_bh, stride_bm, stride_bn,
    Hq, G, Nq, Nk, D, DV,
    qk_scale, softcap, cap_scale, scale, diag_offset, window_left, window_right, drop_threshold, drop_scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    IS_CAUSAL: tl.constexpr, HAS_WL: tl.constexpr, HAS_WR: tl.constexpr, HAS_KVLEN: tl.constexpr,
    BIAS_KIND: tl.constexpr, SOFTCAP: tl.constexpr, DROPOUT: tl.constexpr, WRITE_DS: tl.constexpr,
    REVERSE_M: tl.constexpr, PLAIN: tl.constexpr, USE_TMA: tl.constexpr,
    QPOS=None, stride_pb=0, stride_pm=0, HAS_QPOS: tl.constexpr = False,
    QSEG=None, stride_qsb=0, stride_qsm=0, KSEG=None, stride_ksb=0, stride_ksn=0, HAS_SEG: tl.constexpr = False,
    ZERO_EMPTY: tl.constexpr = False,
):
    # Inductor's launcher types float arguments fp64; the math is fp32 (a dot's accumulator must stay fp32).
    qk_scale = tl.cast(qk_scale, tl.float32)
    softcap = tl.cast(softcap, tl.float32)
    cap_scale = tl.cast(cap_scale, tl.float32)
    scale = tl.cast(scale, tl.float32)
    drop_scale = tl.cast(drop_scale, tl.float32)
    pid_m, bh = program_ids(tl.cdiv(Nq, BLOCK_M), REVERSE_M)
    b = bh // Hq
    h = bh % Hq
    hk = h // G
    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    m_ok = offs_m < Nq
    q = tl.load(
        Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh + offs_m[:, None].to(tl.int64) * stride_qm + offs_d[None, :],
        mask=m_ok[:, None] & (offs_d[None, :] < D), other=0.0,
    )
    do = tl.load(
        DO + b.to(tl.int64) * stride_dob + h.to(tl.int64) * stride_doh + offs_m[:, None].to(tl.int64) * stride_dom + offs_dv[None, :],
        mask=m_ok[:, None] & (offs_dv[None, :] < DV), other=0.0,
    )
    lse = tl.load(LSE + bh.to(tl.int64) * Nq + offs_m, mask=m_ok, other=float("inf"))
    empty = lse == float("-inf")
    lse2 = tl.where(empty, 0.0, lse) * 1.4426950408889634
    delta = tl.load(DELTA + bh.to(tl.int64) * Nq + offs_m, mask=m_ok, other=0.0)
    if ZERO_EMPTY:  # as in the dK/dV kernel
        do = tl.where(empty[:, None], 0.0, do)
        delta = tl.where(empty, 0.0, delta)
    k_base = K + b.to(tl.int64) * stride_kb + hk.to(tl.int64) * stride_kh
    v_base = V + b.to(tl.int64) * stride_vb + hk.to(tl.int64) * stride_vh
    bias_base = BIAS
    if BIAS_KIND != 0:
        bias_base = BIAS + b.to(tl.int64) * stride_bb + h.to(tl.int64) * stride_bh
    ds_base = DS
    if WRITE_DS:
        ds_base = DS + bh.to(tl.int64) * Nq * Nk
    n_lim = key_limit(KVLENS, b, Nk, HAS_KVLEN)
    row_hash = offs_m[:, None]
    if DROPOUT:
        seed = tl.load(SEED).to(tl.uint32)
        row_hash = dropout_row_hash(seed, bh, Nq, offs_m)[:, None]
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # Run-time structure of the tile's rows, as in the forward.
    qp = offs_m
    qs = offs_m
    kseg_base = KSEG
    if HAS_QPOS:
        qp = row_positions(QPOS + b.to(tl.int64) * stride_pb, stride_pm, offs_m, Nq, Nk)
        n_lim = tl.minimum(n_lim, tl.max(qp, 0) + 1)
    lo, full_lo, full_hi, hi = kv_block_range(
        m0, Nq, n_lim, diag_offset, window_left, window_right, IS_CAUSAL, HAS_WL, HAS_WR, BLOCK_M, BLOCK_N,
    )
    seg_first = lo
    seg_last = hi
    if HAS_SEG:
        qs = segment_ids(QSEG + b.to(tl.int64) * stride_qsb, stride_qsm, offs_m, Nq, m0)
        kseg_base = KSEG + b.to(tl.int64) * stride_ksb
        seg_first, seg_last = key_tile_range(kseg_base, stride_ksn, Nk, n_lim, tl.min(qs, 0), tl.max(qs, 0), lo, hi,
                                             BLOCK_N)
    dq = _dq_range(
        dq, q, do, lse2, delta, row_hash, k_base, v_base, k_desc, v_desc, b, hk, bias_base, ds_base,
        offs_m, offs_d, offs_dv,
        stride_kn, stride_vn, stride_bm, stride_bn, Nq, Nk, n_lim, D, DV,
        qk_scale, softcap, cap_scale, diag_offset, window_left, window_right, drop_threshold, drop_scale,
        full_lo, full_hi, qp, qs, seg_first, seg_last, kseg_base, stride_ksn,
        BLOCK_N, BLOCK_D, BLOCK_DV, USE_TMA, IS_CAUSAL, HAS_WL, HAS_WR, False, BIAS_KIND, SOFTCAP, DROPOUT, WRITE_DS, PLAIN,
        HAS_QPOS, HAS_SEG,
    )
    dq = _dq_range(
        dq, q, do, lse2, delta, row_hash, k_base, v_base, k_desc, v_desc, b, hk, bias_base, ds_base,
        offs_m, offs_d, offs_dv,
        stride_kn, stride_vn, stride_bm, stride_bn, Nq, Nk, n_lim, D, DV,
        qk_scale, softcap, cap_scale, diag_offset, window_left, window_right, drop_threshold, drop_scale,
        full_hi, hi, qp, qs, seg_first, seg_last, kseg_base, stride_ksn,
        BLOCK_N, BLOCK_D, BLOCK_DV, USE_TMA, IS_CAUSAL, HAS_WL, HAS_WR, True, BIAS_KIND, SOFTCAP, DROPOUT, WRITE_DS, PLAIN,
        HAS_QPOS, HAS_SEG,
    )
    if HAS_WL:
        dq = _dq_range(
            dq, q, do, lse2, delta, row_hash, k_base, v_base, k_desc, v_desc, b, hk, bias_base, ds_base,
            offs_m, offs_d, offs_dv,
            stride_kn, stride_vn, stride_bm, stride_bn, Nq, Nk, n_lim, D, DV,
            qk_scale, softcap, cap_scale, diag_offset, window_left, window_right, drop_threshold, drop_scale,
            lo, full_lo, qp, qs, seg_first, seg_last, kseg_base, stride_ksn,
            BLOCK_N, BLOCK_D, BLOCK_DV, USE_TMA, IS_CAUSAL, HAS_WL, HAS_WR, True, BIAS_KIND, SOFTCAP, DROPOUT, WRITE_DS, PLAIN,
            HAS_QPOS, HAS_SEG,
        )
    dq = dq * scale
    tl.store(
        DQ + b.to(tl.int64) * stride_dqb + h.to(tl.int64) * stride_dqh + offs_m[:, None].to(tl.int64) * stride_dqm + offs_d[None, :],
        dq.to(DQ.dtype.element_ty), mask=m_ok[:, None] & (offs_d[None, :] < D),
    )
