"""FP8 (e4m3) attention forward in Triton: Q.Kᵀ and P.V on e4m3 tensor-core products, fp32 softmax.

One program per (block of BLOCK_M query rows, batch * query head); query head h reads kv-head h // G.
Inputs come from quantize.py, padded to whole blocks (no load masks): q8 [B, Hq, Nq_pad, D],
k8 [B, Hk, Nk_pad, D], v8t [B, Hk, Dv, Nk_pad] (V transposed: the K-major B operand of the FP8
wgmma), Q scales per query block and K scales per key block, so a score tile dequantizes with one
scalar, into which the softmax scale and log2(e) are folded (scores in log2 units, exp2).
Per tile: s = (q8.k8ᵀ) * qs*ks [+ qmean.k_j (Q smoothing)] [+ bias] [masks]; the online softmax as
in triton_common.softmax_step (PLAIN: no bias, no Q smoothing, scale > 0, so the dequantization
joins exp2's argument in one FMA and the row max is taken on the raw products); P (in [0, 1] after the running max) times 448 (e4m3's largest value,
folded into exp2's argument; the row sums carry it too) in e4m3 against V;
TWO_LEVEL sums each block's P.V in a fresh accumulator and adds it to the fp32 total (Hopper's FP8
wgmma accumulates in reduced precision within one product chain): tl.dot's max_num_imprecise_acc. Epilogue: out = acc / l times the
per-channel V scale; lse (natural log) plus scale * q_i.kmean when K was smoothed.
USE_TMA: the K / V tiles come through host tensor descriptors (Hopper) instead of pointer loads.
QK_INT8: Q and K are int8 (quantize.py's qk_int8): Q.Kᵀ is an int8 product with int32 sums.
The key loop runs in ascending key order in three ranges (the window's masked left edge, the unmasked
off-band blocks, the masked diagonal / end blocks), the order reference.py emulates.
"""
from __future__ import annotations

import triton
import triton.language as tl

from ..triton_common import key_limit, kv_block_range, load_bias_tile, program_ids, structural_ok


@triton.jit
def to_e4m3(x, EMULATE: tl.constexpr):
    """fp32 -> e4m3, round to nearest even. EMULATE (the interpreter, whose cast gets the exponent wrong
    when rounding carries into it, 125.9 -> 64): round in fp32 first by adding and subtracting
    1.5 * 2^(e + 20) (e: x's exponent, at least e4m3's smallest normal 2^-6), so the cast is exact."""
    if EMULATE:
        bits = x.to(tl.int32, bitcast=True)
        e = tl.maximum(bits & 0x7F800000, 121 << 23)
        c = ((e + (20 << 23)) | 0x400000).to(tl.float32, bitcast=True)
        x = (x + c) - c
    return x.to(tl.float8e4nv)


@triton.jit
def _fp8_range(
    acc, l_i, m_i, q, k_base, v_base, k_desc, v_desc, b, hk, ks_base, qmk_base, bias_base, offs_m,
    stride_bm, stride_bn, Nq, Nk, Nk_pad, n_lim, qs_scaled, qk_scale, diag_offset, window_left, window_right,
    lo, hi,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    IS_CAUSAL: tl.constexpr, HAS_WL: tl.constexpr, HAS_WR: tl.constexpr, MASK: tl.constexpr,
    BIAS_KIND: tl.constexpr, QSMOOTH: tl.constexpr, TWO_LEVEL: tl.constexpr, USE_TMA: tl.constexpr,
    EMULATE_CVT: tl.constexpr, QK_INT8: tl.constexpr, WARP_SPEC: tl.constexpr, PLAIN: tl.constexpr,
):
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    for start_n in tl.range(lo, hi, BLOCK_N, warp_specialize=WARP_SPEC):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        offs_n = start_n + tl.arange(0, BLOCK_N)
        if USE_TMA:
            k = k_desc.load([b, hk, start_n, 0]).reshape(BLOCK_N, BLOCK_D)
        else:
            k = tl.load(k_base + offs_n[:, None] * BLOCK_D + offs_d[None, :])
        if QK_INT8:  # exact int32 sums, exact in fp32 too (below 2^24)
            qk = tl.dot(q, tl.trans(k), out_dtype=tl.int32).to(tl.float32)
        else:
            qk = tl.dot(q, tl.trans(k))
        ts = qs_scaled * tl.load(ks_base + start_n // BLOCK_N)  # the tile's dequantization, in log2 units
        if PLAIN:
            # ts > 0: the row max of qk * ts is (max qk) * ts, and the scale joins exp2's argument in one FMA
            if MASK:
                ok = structural_ok(offs_m[:, None], offs_n[None, :], n_lim, diag_offset, window_left, window_right,
                                   IS_CAUSAL, HAS_WL, HAS_WR)
                qk = tl.where(ok, qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1) * ts)
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            # 448 p in (0, 448]: the e4m3 range, scaled inside exp2 (log2(448) off the row max) for free
            p = tl.math.exp2(qk * ts - (m_use - 8.807354922057604)[:, None])
        else:
            s = qk * ts
            if QSMOOTH:
                s = s + tl.load(qmk_base + offs_n)[None, :] * qk_scale
            if BIAS_KIND != 0:
                bv = load_bias_tile(bias_base, offs_m[:, None], offs_n[None, :], stride_bm, stride_bn, Nq, Nk, MASK,
                                    BIAS_KIND)
                if BIAS_KIND % 2 == 1:
                    s = s + bv.to(tl.float32) * 1.4426950408889634
                else:
                    s = tl.where(bv != 0, s, float("-inf"))
            if MASK:
                ok = structural_ok(offs_m[:, None], offs_n[None, :], n_lim, diag_offset, window_left, window_right,
                                   IS_CAUSAL, HAS_WL, HAS_WR)
                s = tl.where(ok, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.math.exp2(s - (m_use - 8.807354922057604)[:, None])
        alpha = tl.math.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        p8 = to_e4m3(p, EMULATE_CVT)
        if USE_TMA:
            vt = v_desc.load([b, hk, 0, start_n]).reshape(BLOCK_DV, BLOCK_N)
        else:
            vt = tl.load(v_base + offs_dv[:, None].to(tl.int64) * Nk_pad + offs_n[None, :])
        if TWO_LEVEL:
            # Triton sums each BLOCK_N-key product in a fresh accumulator and adds it to acc in fp32 (a plain
            # `acc + tl.dot(p8, v)` may be folded back into one accumulating product by the compiler).
            acc = tl.dot(p8, tl.trans(vt), acc * alpha[:, None], max_num_imprecise_acc=BLOCK_N)
        else:
            acc = tl.dot(p8, tl.trans(vt), acc * alpha[:, None])
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def attn_fwd_fp8_kernel(
    Q8, K8, V8T, k_desc, v_desc, QS, KS, VS, QKM, QMK, OUT, LSE, BIAS, KVLENS,
    stride_ob, stride_oh, stride_om, stride_bb, stride_bh, stride_bm, stride_bn,
    Hq, G, Nq, Nk, Nq_pad, Nk_pad, qk_scale, scale, diag_offset, window_left, window_right,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    IS_CAUSAL: tl.constexpr, HAS_WL: tl.constexpr, HAS_WR: tl.constexpr, HAS_KVLEN: tl.constexpr,
    BIAS_KIND: tl.constexpr, KSMOOTH: tl.constexpr, QSMOOTH: tl.constexpr, TWO_LEVEL: tl.constexpr,
    REVERSE_M: tl.constexpr, USE_TMA: tl.constexpr, EMULATE_CVT: tl.constexpr = False,
    QK_INT8: tl.constexpr = False, WARP_SPEC: tl.constexpr = False, PLAIN: tl.constexpr = False,
):
    n_mblk = tl.cdiv(Nq, BLOCK_M)
    pid_m, bh = program_ids(n_mblk, REVERSE_M)
    b = bh // Hq
    h = bh % Hq
    hk = h // G
    bhk = b * (Hq // G) + hk
    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q = tl.load(Q8 + (bh.to(tl.int64) * Nq_pad + offs_m[:, None]) * BLOCK_D + offs_d[None, :])
    qs_scaled = tl.load(QS + bh.to(tl.int64) * (Nq_pad // BLOCK_M) + pid_m) * qk_scale
    k_base = K8 + bhk.to(tl.int64) * Nk_pad * BLOCK_D
    v_base = V8T + bhk.to(tl.int64) * BLOCK_DV * Nk_pad
    ks_base = KS + bhk.to(tl.int64) * (Nk_pad // BLOCK_N)
    qmk_base = QMK
    if QSMOOTH:
        qmk_base = QMK + (bh.to(tl.int64) * (Nq_pad // BLOCK_M) + pid_m) * Nk_pad
    bias_base = BIAS
    if BIAS_KIND != 0:
        bias_base = BIAS + b.to(tl.int64) * stride_bb + h.to(tl.int64) * stride_bh
    n_lim = key_limit(KVLENS, b, Nk, HAS_KVLEN)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    lo, full_lo, full_hi, hi = kv_block_range(
        m0, Nq, n_lim, diag_offset, window_left, window_right, IS_CAUSAL, HAS_WL, HAS_WR, BLOCK_M, BLOCK_N,
    )
    if HAS_WL:
        acc, l_i, m_i = _fp8_range(
            acc, l_i, m_i, q, k_base, v_base, k_desc, v_desc, b, hk, ks_base, qmk_base, bias_base, offs_m,
            stride_bm, stride_bn, Nq, Nk, Nk_pad, n_lim, qs_scaled, qk_scale, diag_offset, window_left,
            window_right, lo, full_lo, BLOCK_N, BLOCK_D, BLOCK_DV, IS_CAUSAL, HAS_WL, HAS_WR, True, BIAS_KIND,
            QSMOOTH, TWO_LEVEL, USE_TMA, EMULATE_CVT, QK_INT8, False, PLAIN,
        )
    acc, l_i, m_i = _fp8_range(
        acc, l_i, m_i, q, k_base, v_base, k_desc, v_desc, b, hk, ks_base, qmk_base, bias_base, offs_m,
        stride_bm, stride_bn, Nq, Nk, Nk_pad, n_lim, qs_scaled, qk_scale, diag_offset, window_left,
        window_right, full_lo, full_hi, BLOCK_N, BLOCK_D, BLOCK_DV, IS_CAUSAL, HAS_WL, HAS_WR, False, BIAS_KIND,
        QSMOOTH, TWO_LEVEL, USE_TMA, EMULATE_CVT, QK_INT8, WARP_SPEC, PLAIN,
    )
    acc, l_i, m_i = _fp8_range(
        acc, l_i, m_i, q, k_base, v_base, k_desc, v_desc, b, hk, ks_base, qmk_base, bias_base, offs_m,
        stride_bm, stride_bn, Nq, Nk, Nk_pad, n_lim, qs_scaled, qk_scale, diag_offset, window_left,
        window_right, full_hi, hi, BLOCK_N, BLOCK_D, BLOCK_DV, IS_CAUSAL, HAS_WL, HAS_WR, True, BIAS_KIND,
        QSMOOTH, TWO_LEVEL, USE_TMA, EMULATE_CVT, QK_INT8, False, PLAIN,
    )
    empty = l_i == 0.0
    inv_l = tl.where(empty, 0.0, 1.0 / tl.where(empty, 1.0, l_i))
    vs = tl.load(VS + bhk.to(tl.int64) * BLOCK_DV + offs_dv)
    out = acc * inv_l[:, None] * vs[None, :]  # (l sums 448 p: the 448 cancels)
    lse = tl.where(empty, float("-inf"),
                   (m_i + (tl.math.log2(tl.where(empty, 1.0, l_i)) - 8.807354922057604)) * 0.6931471805599453)
    row_ok = offs_m < Nq
    if KSMOOTH:
        lse = lse + tl.load(QKM + bh.to(tl.int64) * Nq + offs_m, mask=row_ok, other=0.0) * scale
    o_ptrs = (OUT + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh
              + offs_m[:, None].to(tl.int64) * stride_om + offs_dv[None, :])
    tl.store(o_ptrs, out.to(OUT.dtype.element_ty), mask=row_ok[:, None])
    tl.store(LSE + bh.to(tl.int64) * Nq + offs_m, lse, mask=row_ok)
