"""fa3::dropped_uniform_rows and its backward as Triton kernels: no host sync (fa_compile/dropped_rows.py says what
they compute).

Most batches have no fully masked row. Each program reads its rows' lse first; where none is -inf it writes zeros
(the op's value and gradients there) and reads nothing else. Only a program with such a row reads V (and dO, Q, K)
and computes eager's terms densely over the keys, with the op's counter hash (triton_common.dropout_keep, the bits
of kernels/dropout_hash.py), in fp32 with IEEE fp32 products. Each output element is written by one program:
deterministic.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .dropout_hash import keep_threshold
from .triton_common import dropout_keep, dropout_row_hash, tanh_f32


@triton.jit
def _empty_rows(LSE, bh, Nq, rows):
    lse = tl.load(LSE + bh.to(tl.int64) * Nq + rows, mask=rows < Nq, other=0.0)
    return (lse == float("-inf")) & (rows < Nq)


@triton.jit
def _kept_sum(v_base, stride_vn, stride_vd, row_hash, empty, Nk, DV, threshold,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DV: tl.constexpr):
    """sum_j keep_ij V_j over every key for a block of rows, fp32 (0 on the rows that are not `empty`)."""
    offs_dv = tl.arange(0, BLOCK_DV)
    dv_ok = offs_dv < DV
    o = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    for n0 in range(0, Nk, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        n_ok = cols < Nk
        keep = dropout_keep(row_hash, cols[None, :], threshold) & empty[:, None] & n_ok[None, :]
        vt = tl.load(v_base + cols[:, None].to(tl.int64) * stride_vn + offs_dv[None, :] * stride_vd,
                     mask=n_ok[:, None] & dv_ok[None, :], other=0.0).to(tl.float32)
        o += tl.dot(keep.to(tl.float32), vt, input_precision="ieee")
    return o


@triton.jit
def dropped_rows_fwd_kernel(
    V, LSE, SEED, FILL,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_fb, stride_fh, stride_fm, stride_fd,
    Hq, G, Nq, Nk, DV, threshold, inv,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DV: tl.constexpr, ONLY_EMPTY: tl.constexpr,
):
    """FILL[b, h, i] = sum_j keep_ij V[b, h // G, j] * inv (inv = 1 / (Nk (1 - p))) on rows whose lse is -inf, 0 on
    the others; with ONLY_EMPTY the other rows are left as they are (FILL is the attention's out). Grid (query
    blocks, B * Hq)."""
    inv = tl.cast(inv, tl.float32)  # Inductor's launcher types float arguments fp64
    bh = tl.program_id(1)
    b = (bh // Hq).to(tl.int64)
    h = (bh % Hq).to(tl.int64)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    empty = _empty_rows(LSE, bh, Nq, rows)
    offs_dv = tl.arange(0, BLOCK_DV)
    dv_ok = offs_dv < DV
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    n_empty = tl.sum(empty.to(tl.int32), 0)
    if n_empty > 0:
        row_hash = dropout_row_hash(tl.load(SEED).to(tl.uint32), bh, Nq, rows)[:, None]
        acc = _kept_sum(V + b * stride_vb + (h // G) * stride_vh, stride_vn, stride_vd, row_hash, empty, Nk, DV,
                        threshold, BLOCK_M, BLOCK_N, BLOCK_DV)
    acc = acc * inv
    ptr = FILL + b * stride_fb + h * stride_fh + rows[:, None].to(tl.int64) * stride_fm + offs_dv[None, :] * stride_fd
    if ONLY_EMPTY:
        if n_empty > 0:
            tl.store(ptr, acc.to(FILL.dtype.element_ty), mask=empty[:, None] & dv_ok[None, :])
    else:
        tl.store(ptr, acc.to(FILL.dtype.element_ty), mask=(rows[:, None] < Nq) & dv_ok[None, :])


@triton.jit
def _row_terms(v_base, stride_vn, stride_vd, row_hash, empty, df, Nk, DV, threshold, inv,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DV: tl.constexpr):
    """delta_i = dF_i . F_i for a block of rows, F the fill (recomputed over every key)."""
    o = _kept_sum(v_base, stride_vn, stride_vd, row_hash, empty, Nk, DV, threshold, BLOCK_M, BLOCK_N, BLOCK_DV)
    return tl.sum(df * (o * inv), 1)


@triton.jit
def _score_grad(q, kt, vt, df, keep, delta, n_ok, empty, Nk, drop_scale, scale, softcap, qk_grad,
                SOFTCAP: tl.constexpr):
    """ds [BLOCK_M, BLOCK_N] times scale * qk_grad: softmax's gradient at P = 1/Nk through the dropout and the
    softcap's tanh'."""
    dp = tl.dot(df, tl.trans(vt), input_precision="ieee")
    ds = (tl.where(keep, dp * drop_scale, 0.0) - delta[:, None]) / (Nk * 1.0)
    if SOFTCAP:
        t = tanh_f32(tl.dot(q, tl.trans(kt), input_precision="ieee") * (scale / softcap))
        ds = ds * (1.0 - t * t)
    return tl.where(empty[:, None] & n_ok[None, :], ds * (scale * qk_grad), 0.0)


@triton.jit
def dropped_rows_bwd_kernel(
    Q, K, V, DF, LSE, SEED, DQ, DK, DV_,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_fb, stride_fh, stride_fm, stride_fd,
    stride_dqb, stride_dqh, stride_dqm, stride_dqd,
    stride_dkb, stride_dkh, stride_dkn, stride_dkd,
    stride_dvb, stride_dvh, stride_dvn, stride_dvd,
    Hq, Hkv, G, Nq, Nk, D, DV, threshold, inv, drop_scale, scale, softcap, qk_grad,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    QK: tl.constexpr, SOFTCAP: tl.constexpr, ADD: tl.constexpr,
):
    """(DQ, DK, DV_) of the fill, written whole (zeros where no row is empty), or with ADD added into them where
    some row is empty (the attention backward's own gradients: nothing is read or written elsewhere). Grid
    (B * Hkv, blocks): program (b * Hkv + hk, i) takes DQ's query block i of the group's query heads and DK / DV's
    key block i, summed over them (each where the block exists). See dropped_rows.py."""
    inv = tl.cast(inv, tl.float32)
    drop_scale = tl.cast(drop_scale, tl.float32)
    scale = tl.cast(scale, tl.float32)
    softcap = tl.cast(softcap, tl.float32)
    qk_grad = tl.cast(qk_grad, tl.float32)
    bhk = tl.program_id(0)
    blk = tl.program_id(1)
    b = (bhk // Hkv).to(tl.int64)
    hk = (bhk % Hkv).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    d_ok = offs_d < D
    dv_ok = offs_dv < DV
    seed = tl.load(SEED).to(tl.uint32)
    k_base = K + b * stride_kb + hk * stride_kh
    v_base = V + b * stride_vb + hk * stride_vh
    if blk * BLOCK_M < Nq:  # dq of query block blk, head by head
        rows = blk * BLOCK_M + tl.arange(0, BLOCK_M)
        for g in range(0, G):
            h = hk * G + g
            bh = b * Hq + h
            acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
            empty = _empty_rows(LSE, bh, Nq, rows)
            n_empty = tl.sum(empty.to(tl.int32), 0)
            if QK:
                if n_empty > 0:
                    row_hash = dropout_row_hash(seed, bh, Nq, rows)[:, None]
                    df = tl.load(DF + b * stride_fb + h * stride_fh + rows[:, None].to(tl.int64) * stride_fm
                                 + offs_dv[None, :] * stride_fd, mask=empty[:, None] & dv_ok[None, :],
                                 other=0.0).to(tl.float32)
                    q = tl.load(Q + b * stride_qb + h * stride_qh + rows[:, None].to(tl.int64) * stride_qm
                                + offs_d[None, :] * stride_qd, mask=empty[:, None] & d_ok[None, :],
                                other=0.0).to(tl.float32)
                    delta = _row_terms(v_base, stride_vn, stride_vd, row_hash, empty, df, Nk, DV, threshold, inv,
                                       BLOCK_M, BLOCK_N, BLOCK_DV)
                    for n0 in range(0, Nk, BLOCK_N):
                        cols = n0 + tl.arange(0, BLOCK_N)
                        n_ok = cols < Nk
                        keep = dropout_keep(row_hash, cols[None, :], threshold)
                        kt = tl.load(k_base + cols[:, None].to(tl.int64) * stride_kn + offs_d[None, :] * stride_kd,
                                     mask=n_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
                        vt = tl.load(v_base + cols[:, None].to(tl.int64) * stride_vn + offs_dv[None, :] * stride_vd,
                                     mask=n_ok[:, None] & dv_ok[None, :], other=0.0).to(tl.float32)
                        ds = _score_grad(q, kt, vt, df, keep, delta, n_ok, empty, Nk, drop_scale, scale, softcap,
                                         qk_grad, SOFTCAP)
                        acc += tl.dot(ds, kt, input_precision="ieee")
            dq_ptr = DQ + b * stride_dqb + h * stride_dqh + rows[:, None].to(tl.int64) * stride_dqm \
                + offs_d[None, :] * stride_dqd
            if ADD:
                if QK:
                    if n_empty > 0:
                        ok = empty[:, None] & d_ok[None, :]
                        cur = tl.load(dq_ptr, mask=ok, other=0.0).to(tl.float32)
                        tl.store(dq_ptr, (cur + acc).to(DQ.dtype.element_ty), mask=ok)
            else:
                tl.store(dq_ptr, acc.to(DQ.dtype.element_ty), mask=(rows[:, None] < Nq) & d_ok[None, :])
    if blk * BLOCK_N < Nk:  # dk and dv of key block blk, summed over the group's query heads
        cols = blk * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = cols < Nk
        count = 0
        for g in range(0, G):
            for m0 in range(0, Nq, BLOCK_M):
                count += tl.sum(_empty_rows(LSE, b * Hq + hk * G + g, Nq, m0 + tl.arange(0, BLOCK_M)).to(tl.int32), 0)
        acc_k = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
        acc_v = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
        if count > 0:
            kt = tl.load(k_base + cols[:, None].to(tl.int64) * stride_kn + offs_d[None, :] * stride_kd,
                         mask=n_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
            vt = tl.load(v_base + cols[:, None].to(tl.int64) * stride_vn + offs_dv[None, :] * stride_vd,
                         mask=n_ok[:, None] & dv_ok[None, :], other=0.0).to(tl.float32)
            for g in range(0, G):
                h = hk * G + g
                bh = b * Hq + h
                for m0 in range(0, Nq, BLOCK_M):
                    rows = m0 + tl.arange(0, BLOCK_M)
                    empty = _empty_rows(LSE, bh, Nq, rows)
                    if tl.sum(empty.to(tl.int32), 0) > 0:
                        row_hash = dropout_row_hash(seed, bh, Nq, rows)[:, None]
                        keep = dropout_keep(row_hash, cols[None, :], threshold)
                        df = tl.load(DF + b * stride_fb + h * stride_fh + rows[:, None].to(tl.int64) * stride_fm
                                     + offs_dv[None, :] * stride_fd, mask=empty[:, None] & dv_ok[None, :],
                                     other=0.0).to(tl.float32)
                        w = tl.where(keep & empty[:, None] & n_ok[None, :], inv, 0.0)
                        acc_v += tl.dot(tl.trans(w), df, input_precision="ieee")
                        if QK:
                            q = tl.load(Q + b * stride_qb + h * stride_qh + rows[:, None].to(tl.int64) * stride_qm
                                        + offs_d[None, :] * stride_qd, mask=empty[:, None] & d_ok[None, :],
                                        other=0.0).to(tl.float32)
                            delta = _row_terms(v_base, stride_vn, stride_vd, row_hash, empty, df, Nk, DV, threshold,
                                               inv, BLOCK_M, BLOCK_N, BLOCK_DV)
                            ds = _score_grad(q, kt, vt, df, keep, delta, n_ok, empty, Nk, drop_scale, scale, softcap,
                                             qk_grad, SOFTCAP)
                            acc_k += tl.dot(tl.trans(ds), q, input_precision="ieee")
        dk_ptr = DK + b * stride_dkb + hk * stride_dkh + cols[:, None].to(tl.int64) * stride_dkn \
            + offs_d[None, :] * stride_dkd
        dv_ptr = DV_ + b * stride_dvb + hk * stride_dvh + cols[:, None].to(tl.int64) * stride_dvn \
            + offs_dv[None, :] * stride_dvd
        k_ok = n_ok[:, None] & d_ok[None, :]
        v_ok = n_ok[:, None] & dv_ok[None, :]
        if ADD:
            if count > 0:
                if QK:
                    acc_k += tl.load(dk_ptr, mask=k_ok, other=0.0).to(tl.float32)
                    tl.store(dk_ptr, acc_k.to(DK.dtype.element_ty), mask=k_ok)
                acc_v += tl.load(dv_ptr, mask=v_ok, other=0.0).to(tl.float32)
                tl.store(dv_ptr, acc_v.to(DV_.dtype.element_ty), mask=v_ok)
        else:
            tl.store(dk_ptr, acc_k.to(DK.dtype.element_ty), mask=k_ok)
            tl.store(dv_ptr, acc_v.to(DV_.dtype.element_ty), mask=v_ok)


def launch_fill(run, v, lse, seed, fill, dropout_p: float, q_heads: int, only_empty: bool, tiles: dict) -> None:
    """dropped_rows_fwd_kernel into `fill` [B, Hq, Nq, Dv] through `run` (the kernel, or wrap_triton's)."""
    b, hkv, nk, dv = v.shape
    nq = lse.shape[2]
    run[(triton.cdiv(nq, tiles["BLOCK_M"]), b * q_heads, 1)](
        v, lse, seed, fill, *v.stride(), *fill.stride(), q_heads, q_heads // hkv, nq, nk, dv,
        keep_threshold(dropout_p), 1.0 / (nk * (1.0 - dropout_p)), ONLY_EMPTY=only_empty, **tiles)


def launch_backward(run, dfill, q, k, v, lse, seed, dq, dk, dv, dropout_p: float, scale: float, softcap: float,
                    qk_grad: float, add: bool, tiles: dict, block_d: int) -> None:
    """dropped_rows_bwd_kernel into (or, with `add`, adding into) dq, dk, dv through `run`."""
    b, hq, nq, d = q.shape
    hkv, nk, dvs = v.shape[1], v.shape[2], v.shape[3]
    blocks = max(triton.cdiv(nq, tiles["BLOCK_M"]), triton.cdiv(nk, tiles["BLOCK_N"]))
    run[(b * hkv, blocks, 1)](
        q, k, v, dfill, lse, seed, dq, dk, dv,
        *q.stride(), *k.stride(), *v.stride(), *dfill.stride(), *dq.stride(), *dk.stride(), *dv.stride(),
        hq, hkv, hq // hkv, nq, nk, d, dvs, keep_threshold(dropout_p), 1.0 / (nk * (1.0 - dropout_p)),
        1.0 / (1.0 - dropout_p), scale, softcap if softcap > 0 else 1.0, qk_grad,
        BLOCK_D=block_d, QK=qk_grad != 0, SOFTCAP=softcap > 0, ADD=add, **tiles)
