"""Fused attention forward in Triton: online softmax (fp32, exp2, scale folded), every op feature.

Grid: (query blocks, B * Hq). Query head h reads key/value head h // G (GQA without repeating K/V;
the group's programs run next to each other, so the shared K/V tiles are served from L2).
The key loop is split into masked edge blocks and unmasked off-band blocks (kv_block_range).
Attention sinks (HAS_SINKS, SINKS [Hq] of any float dtype): after the key loop, the head's sink logit
joins the row max and the denominator as one more score with no value, so a row without an admissible
key ends with out 0 and lse = the sink.
Run-time positions (HAS_QPOS, QPOS [B|1, Nq] at strides (stride_pb, stride_pm)): each tile's key range
ends at max(q_pos over its rows) + 1 and every tile is masked by j <= q_pos[i]. Segments (HAS_SEG, QSEG /
KSEG at their strides): the key loops run over the span of key tiles whose ids can meet the query tile's
[min, max] (triton_common.key_tile_range; the tiles outside are never read), masked by equal ids.
Rows that admit no key (EMPTY_FILL): NaN or the mean of V over all keys instead of the op's 0, where the
compile-time lowering found the op's empty-row fix-up after it (fa_compile/lowering/empty_rows.py).
"""
from __future__ import annotations

import triton
import triton.language as tl

from .triton_common import (
    add_sink, dropout_keep, dropout_row_hash, key_limit, key_tile_range, kv_block_range, mean_v, position_segment_ok,
    program_ids, row_positions, segment_ids, softmax_step,
)


@triton.jit
def _fwd_tile(
    acc, l_i, m_i, q, k_base, v_base, bias_base, row_hash, offs_m, offs_n, offs_d, offs_dv,
    stride_kn, stride_vn, stride_bm, stride_bn, Nq, Nk, n_lim, D, DV,
    qk_scale, softcap, cap_scale, diag_offset, window_left, window_right, drop_threshold,
    qp, qs, ks,
    IS_CAUSAL: tl.constexpr, HAS_WL: tl.constexpr, HAS_WR: tl.constexpr,
    MASK: tl.constexpr, BIAS_KIND: tl.constexpr, SOFTCAP: tl.constexpr, DROPOUT: tl.constexpr,
    EVEN_D: tl.constexpr, PLAIN: tl.constexpr, BIAS_FMA: tl.constexpr,
    HAS_QPOS: tl.constexpr, HAS_SEG: tl.constexpr,
):
    k_ptrs = k_base + offs_n[None, :].to(tl.int64) * stride_kn + offs_d[:, None]
    v_ptrs = v_base + offs_n[:, None].to(tl.int64) * stride_vn + offs_dv[None, :]
    if MASK:  # (n_lim, not Nk: keys past the limit, e.g. past the tile's last position, are never read)
        k = tl.load(k_ptrs, mask=(offs_n[None, :] < n_lim) & (offs_d[:, None] < D), other=0.0)
    elif EVEN_D:
        k = tl.load(k_ptrs)
    else:
        k = tl.load(k_ptrs, mask=offs_d[:, None] < D, other=0.0)
    qk = tl.dot(q, k)
    extra = position_segment_ok(qp[:, None], offs_n[None, :], qs[:, None], ks[None, :], HAS_QPOS, HAS_SEG)
    p, m_new, alpha = softmax_step(
        qk, m_i, offs_m[:, None], offs_n[None, :], qk_scale, softcap, cap_scale,
        bias_base, stride_bm, stride_bn, Nq, Nk, n_lim, diag_offset, window_left, window_right,
        IS_CAUSAL, HAS_WL, HAS_WR, MASK, BIAS_KIND, SOFTCAP, PLAIN, BIAS_FMA, extra, HAS_QPOS or HAS_SEG,
    )
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    if DROPOUT:
        p = tl.where(dropout_keep(row_hash, offs_n[None, :], drop_threshold), p, 0.0)
    if MASK:
        v = tl.load(v_ptrs, mask=(offs_n[:, None] < n_lim) & (offs_dv[None, :] < DV), other=0.0)
    elif EVEN_D:
        v = tl.load(v_ptrs)
    else:
        v = tl.load(v_ptrs, mask=offs_dv[None, :] < DV, other=0.0)
    acc = tl.dot(p.to(v.dtype), v, acc)
    m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _fwd_range(
    acc, l_i, m_i, q, k_base, v_base, bias_base, row_hash, offs_m, offs_d, offs_dv,
    stride_kn, stride_vn, stride_bm, stride_bn, Nq, Nk, n_lim, D, DV,
    qk_scale, softcap, cap_scale, diag_offset, window_left, window_right, drop_threshold,
    lo, hi, qp, qs, seg_first, seg_last, kseg_base, stride_ksn,
    BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_WL: tl.constexpr, HAS_WR: tl.constexpr,
    MASK: tl.constexpr, BIAS_KIND: tl.constexpr, SOFTCAP: tl.constexpr, DROPOUT: tl.constexpr,
    EVEN_D: tl.constexpr, PLAIN: tl.constexpr, BIAS_FMA: tl.constexpr,
    HAS_QPOS: tl.constexpr, HAS_SEG: tl.constexpr,
):
    if HAS_SEG:  # only the span of key tiles whose ids can meet the rows' (a multiple of BLOCK_N either way)
        lo = tl.maximum(lo, seg_first)
        hi = tl.minimum(hi, seg_last)
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        offs_n = start_n + tl.arange(0, BLOCK_N)
        ks = qs
        if HAS_SEG:
            ks = segment_ids(kseg_base, stride_ksn, offs_n, Nk, start_n)
        acc, l_i, m_i = _fwd_tile(
            acc, l_i, m_i, q, k_base, v_base, bias_base, row_hash, offs_m, offs_n, offs_d, offs_dv,
            stride_kn, stride_vn, stride_bm, stride_bn, Nq, Nk, n_lim, D, DV,
            qk_scale, softcap, cap_scale, diag_offset, window_left, window_right, drop_threshold,
            qp, qs, ks,
            IS_CAUSAL, HAS_WL, HAS_WR, MASK, BIAS_KIND, SOFTCAP, DROPOUT, EVEN_D, PLAIN, BIAS_FMA,
            HAS_QPOS, HAS_SEG,
        )
    return acc, l_i, m_i


@triton.jit
def attn_fwd_kernel(
    Q, K, V, O, LSE, BIAS, KVLENS, SEED,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_om,
    stride_bb, stride_bh, stride_bm, stride_bn,
    Hq, G, Nq, Nk, D, DV,
    qk_scale, softcap, cap_scale, diag_offset, window_left, window_right, drop_threshold, drop_scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    IS_CAUSAL: tl.constexpr, HAS_WL: tl.constexpr, HAS_WR: tl.constexpr, HAS_KVLEN: tl.constexpr,
    BIAS_KIND: tl.constexpr, SOFTCAP: tl.constexpr, DROPOUT: tl.constexpr, EVEN_D: tl.constexpr,
    REVERSE_M: tl.constexpr, PLAIN: tl.constexpr, BIAS_FMA: tl.constexpr = False,
    SINKS=None, HAS_SINKS: tl.constexpr = False,
    QPOS=None, stride_pb=0, stride_pm=0, HAS_QPOS: tl.constexpr = False,
    QSEG=None, stride_qsb=0, stride_qsm=0, KSEG=None, stride_ksb=0, stride_ksn=0, HAS_SEG: tl.constexpr = False,
    EMPTY_FILL: tl.constexpr = 0,
):
    # Inductor's launcher types float arguments fp64; the math is fp32 (a dot's accumulator must stay fp32).
    qk_scale = tl.cast(qk_scale, tl.float32)
    softcap = tl.cast(softcap, tl.float32)
    cap_scale = tl.cast(cap_scale, tl.float32)
    drop_scale = tl.cast(drop_scale, tl.float32)
    # Causal (REVERSE_M): the longest rows first, so the short ones fill the tail of the wave.
    pid_m, bh = program_ids(tl.cdiv(Nq, BLOCK_M), REVERSE_M)
    b = bh // Hq
    h = bh % Hq
    hk = h // G
    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)

    q_base = Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
    k_base = K + b.to(tl.int64) * stride_kb + hk.to(tl.int64) * stride_kh
    v_base = V + b.to(tl.int64) * stride_vb + hk.to(tl.int64) * stride_vh
    bias_base = BIAS
    if BIAS_KIND != 0:
        bias_base = BIAS + b.to(tl.int64) * stride_bb + h.to(tl.int64) * stride_bh

    n_lim = key_limit(KVLENS, b, Nk, HAS_KVLEN)
    row_hash = offs_m[:, None]
    if DROPOUT:
        seed = tl.load(SEED).to(tl.uint32)
        row_hash = dropout_row_hash(seed, bh, Nq, offs_m)[:, None]

    q = tl.load(
        q_base + offs_m[:, None].to(tl.int64) * stride_qm + offs_d[None, :],
        mask=(offs_m[:, None] < Nq) & (offs_d[None, :] < D), other=0.0,
    )
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)

    # Run-time structure of the tile's rows (placeholders without it; the masks then vanish at compile time).
    qp = offs_m
    qs = offs_m
    kseg_base = KSEG
    if HAS_QPOS:
        qp = row_positions(QPOS + b.to(tl.int64) * stride_pb, stride_pm, offs_m, Nq, Nk)
        n_lim = tl.minimum(n_lim, tl.max(qp, 0) + 1)  # no key past the tile's last position is read
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
    # Off-band blocks: no structural mask, no bounds checks.
    acc, l_i, m_i = _fwd_range(
        acc, l_i, m_i, q, k_base, v_base, bias_base, row_hash, offs_m, offs_d, offs_dv,
        stride_kn, stride_vn, stride_bm, stride_bn, Nq, Nk, n_lim, D, DV,
        qk_scale, softcap, cap_scale, diag_offset, window_left, window_right, drop_threshold,
        full_lo, full_hi, qp, qs, seg_first, seg_last, kseg_base, stride_ksn,
        BLOCK_N, IS_CAUSAL, HAS_WL, HAS_WR, False, BIAS_KIND, SOFTCAP, DROPOUT, EVEN_D, PLAIN, BIAS_FMA,
        HAS_QPOS, HAS_SEG,
    )
    # Band / edge blocks: masked.
    acc, l_i, m_i = _fwd_range(
        acc, l_i, m_i, q, k_base, v_base, bias_base, row_hash, offs_m, offs_d, offs_dv,
        stride_kn, stride_vn, stride_bm, stride_bn, Nq, Nk, n_lim, D, DV,
        qk_scale, softcap, cap_scale, diag_offset, window_left, window_right, drop_threshold,
        full_hi, hi, qp, qs, seg_first, seg_last, kseg_base, stride_ksn,
        BLOCK_N, IS_CAUSAL, HAS_WL, HAS_WR, True, BIAS_KIND, SOFTCAP, DROPOUT, EVEN_D, PLAIN, BIAS_FMA,
        HAS_QPOS, HAS_SEG,
    )
    if HAS_WL:
        acc, l_i, m_i = _fwd_range(
            acc, l_i, m_i, q, k_base, v_base, bias_base, row_hash, offs_m, offs_d, offs_dv,
            stride_kn, stride_vn, stride_bm, stride_bn, Nq, Nk, n_lim, D, DV,
            qk_scale, softcap, cap_scale, diag_offset, window_left, window_right, drop_threshold,
            lo, full_lo, qp, qs, seg_first, seg_last, kseg_base, stride_ksn,
            BLOCK_N, IS_CAUSAL, HAS_WL, HAS_WR, True, BIAS_KIND, SOFTCAP, DROPOUT, EVEN_D, PLAIN, BIAS_FMA,
            HAS_QPOS, HAS_SEG,
        )

    if HAS_SINKS:
        acc, l_i, m_i = add_sink(acc, l_i, m_i, SINKS, h)
    empty = l_i == 0.0
    inv_l = tl.where(empty, 0.0, drop_scale / tl.where(empty, 1.0, l_i))
    out = acc * inv_l[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453)
    # Rows that admit no key: EMPTY_FILL 0 keeps the op's 0, 1 writes NaN (eager's softmax over -inf fills),
    # 2 the mean of V over all keys (over equal finite fills), read only by a tile that has such a row.
    if EMPTY_FILL == 1:
        out = tl.where(empty[:, None], float("nan"), out)
    if EMPTY_FILL == 2:
        any_empty = tl.max((empty & (offs_m < Nq)).to(tl.int32), 0) > 0
        vmean = mean_v(any_empty, v_base, stride_vn, 1, Nk, DV, BLOCK_N, BLOCK_DV)
        out = tl.where(empty[:, None], vmean[None, :], out)
    o_base = O + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh
    tl.store(
        o_base + offs_m[:, None].to(tl.int64) * stride_om + offs_dv[None, :],
        out.to(O.dtype.element_ty),
        mask=(offs_m[:, None] < Nq) & (offs_dv[None, :] < DV),
    )
    tl.store(LSE + bh.to(tl.int64) * Nq + offs_m, lse, mask=offs_m < Nq)
