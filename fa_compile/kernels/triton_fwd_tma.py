"""Hopper forward: the same algorithm as triton_fwd.py, with Q/K/V/O moved by the tensor-memory
accelerator (TMA) through host-side tensor descriptors.

Descriptors are 4-D [B, H, N, D] over the op's strided views, so BSHD and BHSD both work without
copies; TMA zero-fills reads past N or past the head dim (the padded head-dim block) and clips
stores, so no load or store needs a mask. Attention sinks (HAS_SINKS) as in triton_fwd.py. Used on
capability 9.x when every stride but the last is a multiple of 16 bytes (triton_family decides);
otherwise the pointer kernel runs.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .triton_common import add_sink, dropout_keep, dropout_row_hash, key_limit, kv_block_range, program_ids, softmax_step


@triton.jit
def _fwd_tma_range(
    acc, l_i, m_i, q, k_desc, v_desc, b, hk, bias_base, row_hash, offs_m,
    stride_bm, stride_bn, Nq, Nk, n_lim,
    qk_scale, softcap, cap_scale, diag_offset, window_left, window_right, drop_threshold,
    lo, hi,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    IS_CAUSAL: tl.constexpr, HAS_WL: tl.constexpr, HAS_WR: tl.constexpr,
    MASK: tl.constexpr, BIAS_KIND: tl.constexpr, SOFTCAP: tl.constexpr, DROPOUT: tl.constexpr,
    WARP_SPEC: tl.constexpr, PLAIN: tl.constexpr, BIAS_FMA: tl.constexpr, KV_TAIL: tl.constexpr = False,
):
    """KV_TAIL: the range holds the key tile that straddles kv_lens, whose values past it are zeroed after the
    whole-tile load (a non-finite value there times a probability of 0 would be NaN; keys there are masked)."""
    for start_n in tl.range(lo, hi, BLOCK_N, warp_specialize=WARP_SPEC):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        offs_n = start_n + tl.arange(0, BLOCK_N)
        k = k_desc.load([b, hk, start_n, 0]).reshape(BLOCK_N, BLOCK_D)
        qk = tl.dot(q, k.T)
        p, m_new, alpha = softmax_step(
            qk, m_i, offs_m[:, None], offs_n[None, :], qk_scale, softcap, cap_scale,
            bias_base, stride_bm, stride_bn, Nq, Nk, n_lim, diag_offset, window_left, window_right,
            IS_CAUSAL, HAS_WL, HAS_WR, MASK, BIAS_KIND, SOFTCAP, PLAIN, BIAS_FMA,
        )
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if DROPOUT:
            p = tl.where(dropout_keep(row_hash, offs_n[None, :], drop_threshold), p, 0.0)
        v = v_desc.load([b, hk, start_n, 0]).reshape(BLOCK_N, BLOCK_DV)
        if KV_TAIL:
            v = tl.where((offs_n < n_lim)[:, None], v, 0.0)
        acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def attn_fwd_tma_kernel(
    q_desc, k_desc, v_desc, o_desc, LSE, BIAS, KVLENS, SEED,
    stride_bb, stride_bh, stride_bm, stride_bn,
    Hq, G, Nq, Nk,
    qk_scale, softcap, cap_scale, diag_offset, window_left, window_right, drop_threshold, drop_scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    IS_CAUSAL: tl.constexpr, HAS_WL: tl.constexpr, HAS_WR: tl.constexpr, HAS_KVLEN: tl.constexpr,
    BIAS_KIND: tl.constexpr, SOFTCAP: tl.constexpr, DROPOUT: tl.constexpr, REVERSE_M: tl.constexpr,
    WARP_SPEC: tl.constexpr, PLAIN: tl.constexpr, QREG: tl.constexpr = False,
    BIAS_FMA: tl.constexpr = False, SINKS=None, HAS_SINKS: tl.constexpr = False,
):
    pid_m, bh = program_ids(tl.cdiv(Nq, BLOCK_M), REVERSE_M)
    b = bh // Hq
    h = bh % Hq
    hk = h // G
    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    bias_base = BIAS
    if BIAS_KIND != 0:
        bias_base = BIAS + b.to(tl.int64) * stride_bb + h.to(tl.int64) * stride_bh
    n_lim = key_limit(KVLENS, b, Nk, HAS_KVLEN)
    row_hash = offs_m[:, None]
    if DROPOUT:
        seed = tl.load(SEED).to(tl.uint32)
        row_hash = dropout_row_hash(seed, bh, Nq, offs_m)[:, None]
    q = q_desc.load([b, h, m0, 0]).reshape(BLOCK_M, BLOCK_D)
    if QREG:
        # Q as a register operand of the Q·Kᵀ wgmma (anything computed, not loaded, stays in registers):
        # its shared-memory reads would otherwise compete with the K/V tiles for bandwidth.
        q = q + 0.0
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    lo, full_lo, full_hi, hi = kv_block_range(
        m0, Nq, n_lim, diag_offset, window_left, window_right, IS_CAUSAL, HAS_WL, HAS_WR, BLOCK_M, BLOCK_N,
    )
    acc, l_i, m_i = _fwd_tma_range(
        acc, l_i, m_i, q, k_desc, v_desc, b, hk, bias_base, row_hash, offs_m, stride_bm, stride_bn, Nq, Nk, n_lim,
        qk_scale, softcap, cap_scale, diag_offset, window_left, window_right, drop_threshold, full_lo, full_hi,
        BLOCK_N, BLOCK_D, BLOCK_DV, IS_CAUSAL, HAS_WL, HAS_WR, False, BIAS_KIND, SOFTCAP, DROPOUT, WARP_SPEC, PLAIN,
        BIAS_FMA,
    )
    acc, l_i, m_i = _fwd_tma_range(
        acc, l_i, m_i, q, k_desc, v_desc, b, hk, bias_base, row_hash, offs_m, stride_bm, stride_bn, Nq, Nk, n_lim,
        qk_scale, softcap, cap_scale, diag_offset, window_left, window_right, drop_threshold, full_hi, hi,
        BLOCK_N, BLOCK_D, BLOCK_DV, IS_CAUSAL, HAS_WL, HAS_WR, True, BIAS_KIND, SOFTCAP, DROPOUT, False, PLAIN,
        BIAS_FMA, HAS_KVLEN,
    )
    if HAS_WL:
        acc, l_i, m_i = _fwd_tma_range(
            acc, l_i, m_i, q, k_desc, v_desc, b, hk, bias_base, row_hash, offs_m, stride_bm, stride_bn, Nq, Nk, n_lim,
            qk_scale, softcap, cap_scale, diag_offset, window_left, window_right, drop_threshold, lo, full_lo,
            BLOCK_N, BLOCK_D, BLOCK_DV, IS_CAUSAL, HAS_WL, HAS_WR, True, BIAS_KIND, SOFTCAP, DROPOUT, False, PLAIN,
        BIAS_FMA,
        )
    if HAS_SINKS:
        acc, l_i, m_i = add_sink(acc, l_i, m_i, SINKS, h)
    empty = l_i == 0.0
    inv_l = tl.where(empty, 0.0, drop_scale / tl.where(empty, 1.0, l_i))
    out = acc * inv_l[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453)
    o_desc.store([b, h, m0, 0], out.to(q.dtype).reshape(1, 1, BLOCK_M, BLOCK_DV))
    tl.store(LSE + bh.to(tl.int64) * Nq + offs_m, lse, mask=offs_m < Nq)
