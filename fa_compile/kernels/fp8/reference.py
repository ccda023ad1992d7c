"""Emulation in torch (any device) of what the FP8 kernel computes, step for step: the same quantization
(quantize.py), the same key-block order and online softmax (running max in log2 units), 448 P (scaled
inside exp2) rounded to e4m3 against the running max of its block, fp32 products of the e4m3 values and, with
`two_level`, each block's P.V summed fresh and added to the fp32 total. The oracle of the kernel tests,
and the method's error on CPU in benchmarks/fp8_accuracy.py.

What it cannot mirror bit for bit on a GPU: exp2's last bit (ex2.approx) and the order of the fp32 sums
inside a tensor-core product, so a p on a rounding boundary of e4m3 may round the other way there.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .config import HADAMARD_DEFAULT, LN2, LOG2E, QK_INT8_DEFAULT, SMOOTH_Q_DEFAULT, default_blocks, structural_ok
from .quantize import FP8, FP8_MAX, Quantized, quantize

LOG2_448 = 8.807354922057604  # P is scaled to e4m3's range inside exp2 (as the kernel does)


def bias_view(bias: Optional[Tensor], b: int, h: int, nq: int, nk: int) -> Optional[Tensor]:
    """The bias as a broadcast [B, Hq, Nq, Nk] view (no copy), or None."""
    if bias is None:
        return None
    t = bias.reshape((1,) * (4 - bias.dim()) + tuple(bias.shape)) if bias.dim() < 4 else bias
    return t.expand(b, h, nq, nk)


def fp8_reference(
    q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool = False, diag_offset: int = 0,
    window_left: int = -1, window_right: int = -1, bias: Optional[Tensor] = None, kv_lens: Optional[Tensor] = None,
    *, q_descale: Optional[Tensor] = None, k_descale: Optional[Tensor] = None, v_descale: Optional[Tensor] = None,
    smooth_k: bool = True, smooth_q: Optional[bool] = None, hadamard: Optional[bool] = None,
    out_dtype: Optional[torch.dtype] = None,
    two_level: bool = True, qk_int8: Optional[bool] = None, block_m: Optional[int] = None,
    block_n: Optional[int] = None,
    quantized: Optional[Quantized] = None, flip_bound: bool = False,
):
    """(out [B, Hq, Nq, Dv] in the output dtype, lse [B, Hq, Nq] fp32 natural log), as fp8_forward returns
    them. Block sizes default to the kernel's on a Hopper GPU; `quantized` reuses a quantization.

    flip_bound: also return, per output element, the most by which one p rounded to its other e4m3
    neighbour moves it (the kernel's exp2 and sum order may move a p across a rounding boundary):
    max_j ulp(p8_j) / l_i * max_j |v_jd|, in fp32 [B, Hq, Nq, Dv]."""
    b, hq, nq, d = q.shape
    hk, nk, dv = k.shape[1], k.shape[2], v.shape[3]
    smooth_q = SMOOTH_Q_DEFAULT if smooth_q is None else smooth_q
    hadamard = HADAMARD_DEFAULT if hadamard is None else hadamard
    qk_int8 = QK_INT8_DEFAULT if qk_int8 is None else qk_int8
    if quantized is not None:
        block_m, block_n = quantized.block_m, quantized.block_n
    if block_m is None or block_n is None:
        bm, bn = default_blocks(max(d, dv))
        block_m, block_n = block_m or bm, block_n or bn
    qz = quantized or quantize(
        q, k, v, block_m=block_m, block_n=block_n, kv_lens=kv_lens, smooth_k=smooth_k, smooth_q=smooth_q,
        hadamard=hadamard, q_descale=q_descale, k_descale=k_descale, v_descale=v_descale, qk_int8=qk_int8,
    )
    odt = out_dtype or (torch.bfloat16 if q.dtype == FP8 else q.dtype)
    g = hq // hk
    nq_pad, nk_pad = qz.q8.shape[2], qz.k8.shape[2]
    dev = q.device
    q8 = qz.q8.float()
    k8 = qz.k8.float().repeat_interleave(g, dim=1)
    v8 = qz.v8t.float().transpose(2, 3).repeat_interleave(g, dim=1)  # [B, Hq, Nk_pad, Dv]
    ks = qz.k_scale.repeat_interleave(g, dim=1)
    qk_scale = float(scale) * LOG2E
    qs_rows = (qz.q_scale * qk_scale).repeat_interleave(block_m, dim=2)  # [B, Hq, Nq_pad]
    qmk = None if qz.qm_k is None else qz.qm_k.repeat_interleave(block_m, dim=2)  # [B, Hq, Nq_pad, Nk_pad]
    bv = bias_view(bias, b, hq, nq, nk)
    rows = torch.arange(nq_pad, device=dev)
    n_lim = torch.full((b,), nk, device=dev, dtype=torch.int64)
    if kv_lens is not None:
        n_lim = kv_lens.to(device=dev, dtype=torch.int64).clamp(0, nk)
    m = torch.full((b, hq, nq_pad), float("-inf"), device=dev)
    l_i = torch.zeros((b, hq, nq_pad), device=dev)
    acc = torch.zeros((b, hq, nq_pad, dv), device=dev)
    fb = torch.zeros((b, hq, nq_pad), device=dev) if flip_bound else None
    for n0 in range(0, nk_pad, block_n):
        cols = torch.arange(n0, n0 + block_n, device=dev)
        qk = q8 @ k8[:, :, n0:n0 + block_n].transpose(2, 3)
        s = qk * (qs_rows * ks[:, :, n0 // block_n, None])[..., None]
        if qmk is not None:
            s = s + qmk[..., n0:n0 + block_n] * qk_scale
        if bv is not None:
            tile = bv[:, :, rows.clamp(max=nq - 1)][..., cols.clamp(max=nk - 1)]  # padded rows / cols: any value
            if tile.dtype == torch.bool:
                s = torch.where(tile, s, float("-inf"))
            else:
                s = s + tile.float() * LOG2E
        ok = structural_ok(rows[:, None], cols[None, :], n_lim[:, None, None, None], diag_offset, window_left,
                           window_right, causal)
        s = torch.where(ok, s, float("-inf"))
        m_new = torch.maximum(m, s.amax(-1))
        m_use = torch.where(m_new == float("-inf"), 0.0, m_new)
        p = torch.exp2(s - (m_use - LOG2_448)[..., None])  # 448 p
        alpha = torch.exp2(m - m_use)
        l_i = l_i * alpha + p.sum(-1)
        p8 = p.clamp(max=FP8_MAX).to(FP8).float()
        blk = p8 @ v8[:, :, n0:n0 + block_n]
        acc = acc * alpha[..., None] + blk  # (two_level or not: the same sum in exact fp32)
        if fb is not None:
            # (a p of exactly 0, from a masked score, is 0 in the kernel too)
            fb = torch.maximum(fb * alpha, torch.where(p > 0, e4m3_ulp(p8), 0.0).amax(-1))
        m = m_new
    empty = l_i == 0
    inv_l = torch.where(empty, 0.0, 1.0 / torch.where(empty, 1.0, l_i))
    vs = qz.v_scale.repeat_interleave(g, dim=1)  # [B, Hq, Dv]
    out = acc * inv_l[..., None] * vs[:, :, None, :]
    lse = torch.where(empty, float("-inf"), (m + (torch.log2(torch.where(empty, 1.0, l_i)) - LOG2_448)) * LN2)
    out, lse = out[:, :, :nq], lse[:, :, :nq]
    if qz.q_kmean is not None:
        lse = lse + qz.q_kmean * float(scale)
    out = out.to(odt).transpose(1, 2).contiguous().transpose(1, 2)
    if fb is not None:
        vmax = v8.abs().amax(2) * vs  # [B, Hq, Dv]
        return out, lse.contiguous(), ((fb * inv_l)[..., None] * vmax[:, :, None, :])[:, :, :nq]
    return out, lse.contiguous()


def e4m3_ulp(x: Tensor) -> Tensor:
    """The spacing of e4m3 values at |x| (x itself e4m3-representable): 2^(e - 3), 2^-9 below 2^-6."""
    e = torch.floor(torch.log2(x.abs().clamp_min(2.0 ** -6)))
    return torch.exp2(e - 3)
