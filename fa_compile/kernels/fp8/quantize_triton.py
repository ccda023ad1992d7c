"""The quantization of quantize.py as fused Triton kernels (the GPU path): the same rules and values.

Three passes over the inputs' own strides, no torch chain over the full tensors:
1. kv stats, grid (B * Hk, key chunks): per chunk the sum of K (K smoothing's mean) and the amax of V
   per channel over the valid keys; then one small program per (batch, kv head) reduces the chunks in
   a fixed order to the K mean (rotated, with `hadamard`) and V's channel scales. (That finalisation
   was ~10 torch ops and a matmul, ~0.15 ms of host time per call on the H200's host.)
2. kv quant, grid (B * Hk * key blocks): K block - mean, its amax, scale and e4m3 values; V divided by
   its channel scales and stored transposed ([Dv, keys]: the layout the kernel's P.V reads).
3. q quant, grid (B * Hq * query blocks): q_i . kmean (the lse correction), the block mean (Q
   smoothing), the block's amax, scale and e4m3 values.
With `hadamard`, passes 2 and 3 rotate each tile by one tensor-core product with R (+-1 entries, in the
input dtype: exact products, fp32 sums) before anything else.
Divisions are correctly rounded (div_rn) so the values match the torch path bit for bit given the same
K mean (whose fp32 sum runs in another order here).
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl
from torch import Tensor

from .kernel import to_e4m3
from .quantize import FP8, Quantized, _matmul_fp32, hadamard_matrix, valid_keys

KV_CHUNK = 1024  # keys per stats program


def _interpreting() -> bool:
    import os

    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _quant_block_int8(x):
    """(values, scale) of one block in int8: scale amax / 127, round half to even by adding and subtracting
    1.5 * 2^23; an all-zero block has scale 1."""
    amax = tl.max(tl.max(tl.abs(x), 1), 0)
    s = tl.where(amax > 0, tl.math.div_rn(amax, 127.0), 1.0)
    y = tl.minimum(tl.maximum(tl.math.div_rn(x, s), -127.0), 127.0)
    y = (y + 12582912.0) - 12582912.0
    return y.to(tl.int8), s


@triton.jit
def _quant_block_e4m3(x, EMULATE_CVT: tl.constexpr):
    """(values, scale) of one block in e4m3: scale amax / 448; an all-zero block has scale 1. (Two
    functions, not one with a constexpr branch: Triton wants one return type per function.)"""
    amax = tl.max(tl.max(tl.abs(x), 1), 0)
    s = tl.where(amax > 0, tl.math.div_rn(amax, 448.0), 1.0)
    return to_e4m3(tl.minimum(tl.maximum(tl.math.div_rn(x, s), -448.0), 448.0), EMULATE_CVT), s


@triton.jit
def _kv_stats_kernel(
    K, V, KSUM, VMAX, KVLENS, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n, Hk, Nk, n_chunks,
    CHUNK: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, HAS_KVLEN: tl.constexpr,
    KSMOOTH: tl.constexpr,
):
    pid = tl.program_id(0)
    c = pid % n_chunks
    bh = pid // n_chunks
    b = bh // Hk
    h = bh % Hk
    n_lim = Nk
    if HAS_KVLEN:
        n_lim = tl.maximum(tl.minimum(tl.load(KVLENS + b).to(tl.int32), Nk), 0)
    offs_d = tl.arange(0, D)
    offs_dv = tl.arange(0, DV)
    k_base = K + b.to(tl.int64) * sk_b + h.to(tl.int64) * sk_h
    v_base = V + b.to(tl.int64) * sv_b + h.to(tl.int64) * sv_h
    ksum = tl.zeros([D], tl.float32)
    vmax = tl.zeros([DV], tl.float32)
    for n0 in range(c * CHUNK, c * CHUNK + CHUNK, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        ok = offs_n < n_lim
        if KSMOOTH:
            k = tl.load(k_base + offs_n[:, None].to(tl.int64) * sk_n + offs_d[None, :], mask=ok[:, None], other=0.0)
            ksum += tl.sum(k.to(tl.float32), 0)
        v = tl.load(v_base + offs_n[:, None].to(tl.int64) * sv_n + offs_dv[None, :], mask=ok[:, None], other=0.0)
        vmax = tl.maximum(vmax, tl.max(tl.abs(v.to(tl.float32)), 0))
    if KSMOOTH:
        tl.store(KSUM + pid.to(tl.int64) * D + offs_d, ksum)
    tl.store(VMAX + pid.to(tl.int64) * DV + offs_dv, vmax)


@triton.jit
def _kv_finalize_kernel(
    KSUM, VMAX, KVLENS, R, KMEAN, VSCALE, Hk, Nk, n_chunks,
    D: tl.constexpr, DV: tl.constexpr, HAS_KVLEN: tl.constexpr, KSMOOTH: tl.constexpr, HADAMARD: tl.constexpr,
):
    """Per (batch, kv head): K mean = sum of the chunk sums / valid keys (at least 1), times R when
    rotating; V scale per channel = amax / 448 (1 where the channel is all zero)."""
    bh = tl.program_id(0)
    offs_d = tl.arange(0, D)
    offs_dv = tl.arange(0, DV)
    vmax = tl.zeros([DV], tl.float32)
    for c in range(0, n_chunks):
        vmax = tl.maximum(vmax, tl.load(VMAX + (bh.to(tl.int64) * n_chunks + c) * DV + offs_dv))
    tl.store(VSCALE + bh.to(tl.int64) * DV + offs_dv, tl.where(vmax > 0, tl.math.div_rn(vmax, 448.0), 1.0))
    if KSMOOTH:
        ksum = tl.zeros([D], tl.float32)
        for c in range(0, n_chunks):
            ksum += tl.load(KSUM + (bh.to(tl.int64) * n_chunks + c) * D + offs_d)
        cnt = Nk
        if HAS_KVLEN:
            cnt = tl.maximum(tl.minimum(tl.load(KVLENS + bh // Hk).to(tl.int32), Nk), 0)
        mean = tl.math.div_rn(ksum, tl.maximum(cnt, 1).to(tl.float32))
        if HADAMARD:  # mean R as a broadcast product (one row: no tensor-core tile to fill)
            rot = tl.load(R + offs_d[:, None] * D + offs_d[None, :]).to(tl.float32)
            mean = tl.sum(mean[:, None] * rot, 0)
        tl.store(KMEAN + bh.to(tl.int64) * D + offs_d, mean)


@triton.jit
def _kv_quant_kernel(
    K, V, KMEAN, VSCALE, K8, KS, V8T, KVLENS, R, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n, Hk, Nk, Nk_pad,
    BLOCK_N: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, HAS_KVLEN: tl.constexpr, KSMOOTH: tl.constexpr,
    HADAMARD: tl.constexpr, QK_INT8: tl.constexpr, EMULATE_CVT: tl.constexpr,
):
    pid = tl.program_id(0)
    nb = Nk_pad // BLOCK_N
    blk = pid % nb
    bh = pid // nb
    b = bh // Hk
    h = bh % Hk
    n_lim = Nk
    if HAS_KVLEN:
        n_lim = tl.maximum(tl.minimum(tl.load(KVLENS + b).to(tl.int32), Nk), 0)
    offs_n = blk * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    offs_dv = tl.arange(0, DV)
    ok = offs_n < n_lim
    k = tl.load(K + b.to(tl.int64) * sk_b + h.to(tl.int64) * sk_h + offs_n[:, None].to(tl.int64) * sk_n
                + offs_d[None, :], mask=ok[:, None], other=0.0)
    if HADAMARD:  # k R: products with +-1 are exact, summed in fp32
        k = tl.dot(k, tl.load(R + offs_d[:, None] * D + offs_d[None, :]))
    k = k.to(tl.float32)
    if KSMOOTH:
        k = tl.where(ok[:, None], k - tl.load(KMEAN + bh.to(tl.int64) * D + offs_d)[None, :], 0.0)
    if QK_INT8:
        k8, s = _quant_block_int8(k)
    else:
        k8, s = _quant_block_e4m3(k, EMULATE_CVT)
    tl.store(K8 + (bh.to(tl.int64) * Nk_pad + offs_n[:, None]) * D + offs_d[None, :], k8)
    tl.store(KS + pid, s)
    v = tl.load(V + b.to(tl.int64) * sv_b + h.to(tl.int64) * sv_h + offs_n[:, None].to(tl.int64) * sv_n
                + offs_dv[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
    vs = tl.load(VSCALE + bh.to(tl.int64) * DV + offs_dv)
    v8 = to_e4m3(tl.minimum(tl.maximum(tl.math.div_rn(v, vs[None, :]), -448.0), 448.0), EMULATE_CVT)
    tl.store(V8T + (bh.to(tl.int64) * DV + offs_dv[None, :]) * Nk_pad + offs_n[:, None], v8)


@triton.jit
def _q_quant_kernel(
    Q, KMEAN, Q8, QS, QKM, QMEAN, R, sq_b, sq_h, sq_n, Hq, G, Nq, Nq_pad,
    BLOCK_M: tl.constexpr, D: tl.constexpr, KSMOOTH: tl.constexpr, QSMOOTH: tl.constexpr,
    HADAMARD: tl.constexpr, QK_INT8: tl.constexpr, EMULATE_CVT: tl.constexpr,
):
    pid = tl.program_id(0)
    nb = Nq_pad // BLOCK_M
    blk = pid % nb
    bh = pid // nb
    b = bh // Hq
    h = bh % Hq
    offs_m = blk * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    ok = offs_m < Nq
    q = tl.load(Q + b.to(tl.int64) * sq_b + h.to(tl.int64) * sq_h + offs_m[:, None].to(tl.int64) * sq_n
                + offs_d[None, :], mask=ok[:, None], other=0.0)
    if HADAMARD:  # q R / D (a power of two: exact)
        q = tl.dot(q, tl.load(R + offs_d[:, None] * D + offs_d[None, :])) * (1.0 / D)
    q = q.to(tl.float32)
    if KSMOOTH:
        km = tl.load(KMEAN + (b * (Hq // G) + h // G).to(tl.int64) * D + offs_d)
        tl.store(QKM + bh.to(tl.int64) * Nq + offs_m, tl.sum(q * km[None, :], 1), mask=ok)
    if QSMOOTH:
        cnt = tl.minimum(Nq - blk * BLOCK_M, BLOCK_M).to(tl.float32)
        mean = tl.math.div_rn(tl.sum(q, 0), cnt)
        tl.store(QMEAN + pid.to(tl.int64) * D + offs_d, mean)
        q = tl.where(ok[:, None], q - mean[None, :], 0.0)
    if QK_INT8:
        q8, s = _quant_block_int8(q)
    else:
        q8, s = _quant_block_e4m3(q, EMULATE_CVT)
    tl.store(Q8 + (bh.to(tl.int64) * Nq_pad + offs_m[:, None]) * D + offs_d[None, :], q8)
    tl.store(QS + pid, s)


def _unit_last(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def quantize_triton(
    q: Tensor, k: Tensor, v: Tensor, *, block_m: int, block_n: int, kv_lens: Optional[Tensor] = None,
    smooth_k: bool = True, smooth_q: bool = False, hadamard: bool = False,
    q_descale=None, k_descale=None, v_descale=None, qk_int8: bool = False,
) -> Quantized:
    """quantize.quantize for bf16 / fp16 inputs by the fused kernels."""
    if q.dtype == FP8:
        raise ValueError("quantize_triton takes bf16 / fp16 inputs (pre-quantized ones take quantize.quantize)")
    q, k, v = _unit_last(q), _unit_last(k), _unit_last(v)
    b, hq, nq, d = q.shape
    hk, nk, dv = k.shape[1], k.shape[2], v.shape[3]
    g = hq // hk
    nq_pad, nk_pad = -(-nq // block_m) * block_m, -(-nk // block_n) * block_n
    nbm, nbn = nq_pad // block_m, nk_pad // block_n
    dev = q.device
    f32 = dict(device=dev, dtype=torch.float32)
    emulate = _interpreting()
    # the Hadamard products hold a [block, D] fp32 tile (D = 256: 128 KB) in registers: two warpgroups
    launch_kw = {} if emulate else {"num_warps": 8}
    r = hadamard_matrix(d, dev, dtype=q.dtype) if hadamard else None
    r_arg = r if r is not None else q
    chunk = max(block_n, min(KV_CHUNK, nk_pad))
    n_chunks = -(-nk // chunk) if nk else 1
    ksum = torch.empty((b * hk, n_chunks, d), **f32)
    vmax = torch.empty((b * hk, n_chunks, dv), **f32)
    kvl = kv_lens if kv_lens is not None else ksum
    ctx = torch.cuda.device(dev) if dev.type == "cuda" else _Null()
    with ctx:
        _kv_stats_kernel[(b * hk * n_chunks,)](
            k, v, ksum, vmax, kvl, k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
            hk, nk, n_chunks, CHUNK=chunk, BLOCK_N=block_n, D=d, DV=dv, HAS_KVLEN=kv_lens is not None,
            KSMOOTH=bool(smooth_k), **launch_kw,
        )
        k_mean = torch.empty((b, hk, d), **f32) if smooth_k else None
        vs = torch.empty((b, hk, dv), **f32)
        _kv_finalize_kernel[(b * hk,)](
            ksum, vmax, kvl, r_arg, k_mean if k_mean is not None else vs, vs, hk, nk, n_chunks,
            D=d, DV=dv, HAS_KVLEN=kv_lens is not None, KSMOOTH=bool(smooth_k), HADAMARD=bool(hadamard),
            **({} if emulate else {"num_warps": 4}),
        )
        qk_dtype = torch.int8 if qk_int8 else FP8
        k8 = torch.empty((b, hk, nk_pad, d), device=dev, dtype=qk_dtype)
        v8t = torch.empty((b, hk, dv, nk_pad), device=dev, dtype=FP8)
        ks = torch.empty((b, hk, nbn), **f32)
        _kv_quant_kernel[(b * hk * nbn,)](
            k, v, k_mean if k_mean is not None else ks, vs, k8, ks, v8t, kvl, r_arg,
            k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2), hk, nk, nk_pad,
            BLOCK_N=block_n, D=d, DV=dv, HAS_KVLEN=kv_lens is not None, KSMOOTH=bool(smooth_k),
            HADAMARD=bool(hadamard), QK_INT8=bool(qk_int8), EMULATE_CVT=emulate, **launch_kw,
        )
        q8 = torch.empty((b, hq, nq_pad, d), device=dev, dtype=qk_dtype)
        qs = torch.empty((b, hq, nbm), **f32)
        q_kmean = torch.empty((b, hq, nq), **f32) if smooth_k else None
        q_mean = torch.empty((b, hq, nbm, d), **f32) if smooth_q else None
        _q_quant_kernel[(b * hq * nbm,)](
            q, k_mean if k_mean is not None else qs, q8, qs, q_kmean if q_kmean is not None else qs,
            q_mean if q_mean is not None else qs, r_arg, q.stride(0), q.stride(1), q.stride(2), hq, g, nq, nq_pad,
            BLOCK_M=block_m, D=d, KSMOOTH=bool(smooth_k), QSMOOTH=bool(smooth_q), HADAMARD=bool(hadamard),
            QK_INT8=bool(qk_int8), EMULATE_CVT=emulate, **launch_kw,
        )
    qm_k = None
    if smooth_q:
        # qmean_blk . (k_j - kmean) in fp32: one small product per query block (1 / block_m of Q.Kᵀ's work).
        keep = valid_keys(kv_lens, b, nk, nk_pad, dev)
        kf = torch.nn.functional.pad(k.float(), (0, 0, 0, nk_pad - nk))
        if hadamard:
            kf = _matmul_fp32(kf, r.float())
        if k_mean is not None:
            kf = kf - k_mean[:, :, None, :]
        kf = torch.where(keep, kf, 0.0)
        qm_k = _matmul_fp32(q_mean, kf.repeat_interleave(g, dim=1).transpose(2, 3))
    return Quantized(q8=q8, k8=k8, v8t=v8t, q_scale=qs, k_scale=ks, v_scale=vs, q_kmean=q_kmean, qm_k=qm_k,
                     k_mean=k_mean, q_mean=q_mean, block_m=block_m, block_n=block_n)


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
