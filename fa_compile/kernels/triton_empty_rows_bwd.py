"""The backward of emit's empty-row fix-up in one Triton kernel, run after the backward kernels.

A row that admits no key gets out 0 from the op; where eager gives the mean of V there, emit writes it
after the op (fa_compile/lowering/empty_rows.py), and in training that fix-up has a backward of its own
(fa_compile/lowering/empty_rows_backward.py names its terms). With dg the incoming gradient on those
rows (0 elsewhere), Nk the number of keys and v̄ the mean of V over them:

    dV_j += sum_i dg_i / Nk                                        (every key j; "mean_v", "uniform")
    dQ_i += scale * dg_i . C^T,   C = sum_j k_j (v_j - v̄)^T / Nk    (eager's q / k gradient at uniform
    dK_j += (v_j - v̄) . E^T / Nk,  E = scale * sum_i q_i dg_i^T     weights; "uniform" only)

summed over the query heads of a GQA group for dK and dV (row_fixups._uniform_grads, factorized the same
way: no [Nq, Nk] term). Most batches have no such row, so the kernel first counts them from the lse
(-inf exactly there): one program per (batch, kv head) reads its group's lse rows and stops when none is
empty. Only then does it read V, dO, K and Q and add the terms into dQ, dK and dV in place (each element
by one program: deterministic). Sums and products are fp32 (the products in IEEE fp32, not TF32), and
each gradient is rounded once, after its term is added.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _rows(LSE, row_base, m0, Nq, BLOCK_M: tl.constexpr):
    """(row indices, whether each is an existing row with lse -inf) of the query block at m0."""
    rows = m0 + tl.arange(0, BLOCK_M)
    lse = tl.load(LSE + row_base + rows, mask=rows < Nq, other=0.0)
    return rows, (lse == float("-inf")) & (rows < Nq)


@triton.jit
def attn_bwd_empty_rows_kernel(
    Q, K, V, DO, LSE, DQ, DK, DV_,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_dom,
    stride_dqb, stride_dqh, stride_dqm,
    stride_dkb, stride_dkh, stride_dkn,
    stride_dvb, stride_dvh, stride_dvn,
    Hq, Hkv, G, Nq, Nk, D, DV, scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DC: tl.constexpr, BLOCK_DV: tl.constexpr,
    UNIFORM: tl.constexpr,
):
    scale = tl.cast(scale, tl.float32)  # Inductor's launcher types float arguments fp64
    bhk = tl.program_id(0)
    b = (bhk // Hkv).to(tl.int64)
    hk = (bhk % Hkv).to(tl.int64)
    offs_n = tl.arange(0, BLOCK_N)
    offs_dv = tl.arange(0, BLOCK_DV)
    dv_ok = offs_dv < DV
    count = 0
    for g in range(0, G):
        row_base = (b * Hq + hk * G + g) * Nq
        for m0 in range(0, Nq, BLOCK_M):
            _, empty = _rows(LSE, row_base, m0, Nq, BLOCK_M)
            count += tl.sum(empty.to(tl.int32), 0)
    if count > 0:
        nkf = Nk * 1.0
        v_base = V + b * stride_vb + hk * stride_vh
        k_base = K + b * stride_kb + hk * stride_kh
        # v̄, and the empty rows' dO summed over the group
        vsum = tl.zeros([BLOCK_DV], tl.float32)
        for n0 in range(0, Nk, BLOCK_N):
            keys = n0 + offs_n
            vt = tl.load(v_base + keys[:, None].to(tl.int64) * stride_vn + offs_dv[None, :],
                         mask=(keys[:, None] < Nk) & dv_ok[None, :], other=0.0)
            vsum += tl.sum(vt.to(tl.float32), 0)
        vbar = vsum / nkf
        dsum = tl.zeros([BLOCK_DV], tl.float32)
        for g in range(0, G):
            h = hk * G + g
            row_base = (b * Hq + h) * Nq
            do_base = DO + b * stride_dob + h * stride_doh
            for m0 in range(0, Nq, BLOCK_M):
                rows, empty = _rows(LSE, row_base, m0, Nq, BLOCK_M)
                dg = tl.load(do_base + rows[:, None].to(tl.int64) * stride_dom + offs_dv[None, :],
                             mask=empty[:, None] & dv_ok[None, :], other=0.0)
                dsum += tl.sum(dg.to(tl.float32), 0)
        dv_base = DV_ + b * stride_dvb + hk * stride_dvh
        for n0 in range(0, Nk, BLOCK_N):
            keys = n0 + offs_n
            ptr = dv_base + keys[:, None].to(tl.int64) * stride_dvn + offs_dv[None, :]
            ok = (keys[:, None] < Nk) & dv_ok[None, :]
            cur = tl.load(ptr, mask=ok, other=0.0).to(tl.float32)
            tl.store(ptr, (cur + dsum[None, :] / nkf).to(DV_.dtype.element_ty), mask=ok)
        if UNIFORM:
            dk_base = DK + b * stride_dkb + hk * stride_dkh
            # one chunk of the q / k head dim at a time: C and E are [BLOCK_DC, BLOCK_DV] in registers
            for c0 in range(0, D, BLOCK_DC):
                offs_c = c0 + tl.arange(0, BLOCK_DC)
                c_ok = offs_c < D
                cm = tl.zeros([BLOCK_DC, BLOCK_DV], tl.float32)
                for n0 in range(0, Nk, BLOCK_N):
                    keys = n0 + offs_n
                    n_ok = keys < Nk
                    kt = tl.load(k_base + keys[:, None].to(tl.int64) * stride_kn + offs_c[None, :],
                                 mask=n_ok[:, None] & c_ok[None, :], other=0.0).to(tl.float32)
                    vt = tl.load(v_base + keys[:, None].to(tl.int64) * stride_vn + offs_dv[None, :],
                                 mask=n_ok[:, None] & dv_ok[None, :], other=0.0).to(tl.float32)
                    vc = tl.where(n_ok[:, None] & dv_ok[None, :], vt - vbar[None, :], 0.0)
                    cm += tl.dot(tl.trans(kt), vc, input_precision="ieee")
                cm = cm / nkf
                em = tl.zeros([BLOCK_DC, BLOCK_DV], tl.float32)
                for g in range(0, G):
                    h = hk * G + g
                    row_base = (b * Hq + h) * Nq
                    q_base = Q + b * stride_qb + h * stride_qh
                    do_base = DO + b * stride_dob + h * stride_doh
                    dq_base = DQ + b * stride_dqb + h * stride_dqh
                    for m0 in range(0, Nq, BLOCK_M):
                        rows, empty = _rows(LSE, row_base, m0, Nq, BLOCK_M)
                        if tl.sum(empty.to(tl.int32), 0) > 0:
                            dg = tl.load(do_base + rows[:, None].to(tl.int64) * stride_dom + offs_dv[None, :],
                                         mask=empty[:, None] & dv_ok[None, :], other=0.0).to(tl.float32)
                            qt = tl.load(q_base + rows[:, None].to(tl.int64) * stride_qm + offs_c[None, :],
                                         mask=empty[:, None] & c_ok[None, :], other=0.0).to(tl.float32)
                            em += tl.dot(tl.trans(qt), dg, input_precision="ieee")
                            ptr = dq_base + rows[:, None].to(tl.int64) * stride_dqm + offs_c[None, :]
                            ok = empty[:, None] & c_ok[None, :]
                            cur = tl.load(ptr, mask=ok, other=0.0).to(tl.float32)
                            upd = tl.dot(dg, tl.trans(cm), input_precision="ieee") * scale
                            tl.store(ptr, (cur + upd).to(DQ.dtype.element_ty), mask=ok)
                em = em * (scale / nkf)
                for n0 in range(0, Nk, BLOCK_N):
                    keys = n0 + offs_n
                    n_ok = keys < Nk
                    vt = tl.load(v_base + keys[:, None].to(tl.int64) * stride_vn + offs_dv[None, :],
                                 mask=n_ok[:, None] & dv_ok[None, :], other=0.0).to(tl.float32)
                    vc = tl.where(n_ok[:, None] & dv_ok[None, :], vt - vbar[None, :], 0.0)
                    ptr = dk_base + keys[:, None].to(tl.int64) * stride_dkn + offs_c[None, :]
                    ok = n_ok[:, None] & c_ok[None, :]
                    cur = tl.load(ptr, mask=ok, other=0.0).to(tl.float32)
                    upd = tl.dot(vc, tl.trans(em), input_precision="ieee")
                    tl.store(ptr, (cur + upd).to(DK.dtype.element_ty), mask=ok)
