"""FP8 (e4m3) quantization of attention inputs: block scales, K / Q smoothing, V transposed.

The rules (shared by the Triton quantization kernels, the torch path here and the emulation):
- Q: one scale per (batch, head, block of `block_m` query rows), K: one per (batch, kv-head, block of
  `block_n` keys), scale = amax / 448 (e4m3's largest finite value); an all-zero block gets scale 1.
  The kernel's tiles are these blocks, so the dequantization of a score tile is one scalar.
- V: one scale per (batch, kv-head, channel): o[:, d] = s_d * sum_j p_j v8[j, d] factors exactly.
  V is stored transposed, [B, Hk, Dv, Nk_pad] (keys contiguous): the K-major B operand of FP8 wgmma.
- K smoothing: k - mean over the valid keys (j < kv_lens[b]). Softmax ignores a per-row constant, so
  the scores q_i.(k_j - kmean) give the same probabilities; lse gets q_i.kmean back (`q_kmean`).
  Keys past kv_lens (and the padding up to a block) are stored as 0 and take no part in any scale:
  garbage or NaN there cannot leak into a valid key's block.
- Q smoothing: q - mean over the block's rows; the removed term qmean_blk.(k_j - kmean) is kept in
  fp32 per (block, key) (`qm_k`) and added to the scores by the kernel.
- Hadamard: q R / D and k R with R = diag(random signs) H_D, entries +-1 (R Rᵀ = D I, so the scores are
  unchanged; the products with +-1 are exact, and 1 / D is a power of two). It spreads outlier channels
  over all channels before the rounding: one huge q_c k_c product, whose e4m3 rounding error is a
  fraction of the whole score, becomes D moderate ones whose errors average out.
- Pre-quantized inputs (float8_e4m3fn q, k, v): laid out as above, with the caller's [B, H] descales
  as every block's scale; no smoothing or rotation.
- qk_int8: Q and K as int8 instead (scale = amax / 127, round half to even). With per-block scales, the
  uniform int8 grid rounds Gaussian-like values (after smoothing / rotation) about 2.5x finer than e4m3's
  3-bit mantissa, and the int32 sums of int8 products are exact (|sum| <= 256 * 127^2 < 2^24, so their
  fp32 too); Hopper runs int8 and e4m3 tensor-core products at the same rate.
Every quantized buffer is padded with zeros to whole blocks, so the kernel's loads need no mask.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
INT8_MAX = 127.0


@dataclass
class Quantized:
    """What the FP8 kernel reads. Row counts are padded to whole blocks (n*_pad)."""

    q8: Tensor  # [B, Hq, Nq_pad, D] e4m3 (int8 with qk_int8)
    k8: Tensor  # [B, Hk, Nk_pad, D] e4m3 (int8 with qk_int8)
    v8t: Tensor  # [B, Hk, Dv, Nk_pad] e4m3 (V transposed)
    q_scale: Tensor  # [B, Hq, Nq_pad / block_m] fp32
    k_scale: Tensor  # [B, Hk, Nk_pad / block_n] fp32
    v_scale: Tensor  # [B, Hk, Dv] fp32
    q_kmean: Optional[Tensor]  # [B, Hq, Nq] fp32: q_i . kmean (raw units), added to lse times scale
    qm_k: Optional[Tensor]  # [B, Hq, Nq_pad / block_m, Nk_pad] fp32: qmean_blk . (k_j - kmean)
    k_mean: Optional[Tensor]  # [B, Hk, D] fp32
    q_mean: Optional[Tensor]  # [B, Hq, Nq_pad / block_m, D] fp32
    block_m: int
    block_n: int


def _cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


@functools.lru_cache(maxsize=None)
def _hadamard_cpu(d: int, seed: int) -> Tensor:
    if d < 1 or d & (d - 1):
        raise ValueError(f"hadamard=True needs a power-of-two head dim, got {d}")
    h = torch.ones(1, 1)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    g = torch.Generator().manual_seed(seed)
    signs = torch.randint(0, 2, (d,), generator=g).to(torch.float32) * 2 - 1
    return signs[:, None] * h


def hadamard_matrix(d: int, device, seed: int = 0, dtype: torch.dtype = torch.float32) -> Tensor:
    """R [D, D] = diag(random signs) H_D, entries +-1 (exact in any float dtype), R Rᵀ = D I; fixed signs.
    Kept per device: a copy from host memory on every call would stall the host until the GPU caught up."""
    return _hadamard_on(d, seed, str(torch.device(device)), dtype)


@functools.lru_cache(maxsize=64)
def _hadamard_on(d: int, seed: int, device: str, dtype: torch.dtype) -> Tensor:
    return _hadamard_cpu(d, seed).to(device=device, dtype=dtype)


def _matmul_fp32(a: Tensor, b: Tensor) -> Tensor:
    """a @ b in true fp32 (no TF32 on the GPU, whatever torch's matmul precision says)."""
    if a.device.type != "cuda":
        return a @ b
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        return a @ b
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev


def scale_of(amax: Tensor, qmax: float) -> Tensor:
    """amax / qmax correctly rounded (1 where amax is 0). Divided by a tensor, not a Python number: CUDA
    divides by a scalar as a product with its reciprocal, which can differ in the last bit from the
    fused kernels' div_rn (and from the CPU)."""
    return torch.where(amax > 0, amax / torch.full_like(amax, qmax), torch.ones_like(amax))


def block_scales(x: Tensor, block: int, qmax: float = FP8_MAX) -> Tensor:
    """[..., N_pad, D] -> [..., N_pad / block] fp32: amax / qmax per block of rows, 1 where the block is zero."""
    return scale_of(x.unflatten(-2, (-1, block)).abs().amax(dim=(-2, -1)), qmax)


def to_int8(x: Tensor, scale: Tensor) -> Tensor:
    """x / scale rounded half to even, clamped to +-127."""
    return torch.round(x / scale).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)


def to_fp8(x: Tensor, scale: Tensor) -> Tensor:
    """x / scale rounded to e4m3 (nearest even), clamped to +-448 first (rounding of the scale may push
    the block's largest element a hair above 448)."""
    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def valid_keys(kv_lens: Optional[Tensor], b: int, nk: int, nk_pad: int, device) -> Tensor:
    """[B, 1, Nk_pad, 1] bool: key j of batch b exists (j < min(kv_lens[b], Nk))."""
    j = torch.arange(nk_pad, device=device)
    lim = torch.full((b,), nk, device=device, dtype=torch.int64)
    if kv_lens is not None:
        lim = kv_lens.to(device=device, dtype=torch.int64).clamp(0, nk)
    return (j[None, :] < lim[:, None])[:, None, :, None]


def _pad_rows(x: Tensor, n_pad: int) -> Tensor:
    n = x.shape[-2]
    if n == n_pad:
        return x
    return torch.nn.functional.pad(x, (0, 0, 0, n_pad - n))


def _descale(ds: Optional[Tensor], b: int, h: int, device) -> Tensor:
    if ds is None:
        return torch.ones(b, h, device=device, dtype=torch.float32)
    if tuple(ds.shape) != (b, h):
        raise ValueError(f"descale must have shape [B, H] = [{b}, {h}], got {list(ds.shape)}")
    return ds.to(device=device, dtype=torch.float32)


def quantize(
    q: Tensor, k: Tensor, v: Tensor, *, block_m: int, block_n: int, kv_lens: Optional[Tensor] = None,
    smooth_k: bool = True, smooth_q: bool = False, hadamard: bool = False,
    q_descale: Optional[Tensor] = None, k_descale: Optional[Tensor] = None, v_descale: Optional[Tensor] = None,
    k_mean: Optional[Tensor] = None, qk_int8: bool = False,
) -> Quantized:
    """Quantize [B, H, N, D] views (any strides) for the FP8 kernel, in torch (any device): the rules above.

    float8_e4m3fn inputs are taken as already quantized, with their descales ([B, H] fp32, None = 1).
    `k_mean` [B, Hk, D] replaces the computed K mean (tests compare the fused kernels, whose fp32 sum
    runs in another order, value for value)."""
    b, hq, nq, d = q.shape
    hk, nk, dv = k.shape[1], k.shape[2], v.shape[3]
    nq_pad, nk_pad = _cdiv(nq, block_m) * block_m, _cdiv(nk, block_n) * block_n
    dev = q.device
    if q.dtype == FP8:
        if k.dtype != FP8 or v.dtype != FP8:
            raise ValueError(f"q is float8_e4m3fn, so k and v must be too; got k {k.dtype}, v {v.dtype}")
        qs = _descale(q_descale, b, hq, dev)
        ks = _descale(k_descale, b, hk, dev)
        vs = _descale(v_descale, b, hk, dev)
        keep = valid_keys(kv_lens, b, nk, nk_pad, dev)
        # as bytes (e4m3 0.0 is 0x00): padding and where on uint8 exist on every device and torch version
        k8 = torch.where(keep, _pad_rows(k.view(torch.uint8), nk_pad), 0)
        v8 = torch.where(keep, _pad_rows(v.view(torch.uint8), nk_pad), 0)
        return Quantized(
            q8=_pad_rows(q.view(torch.uint8), nq_pad).contiguous().view(FP8), k8=k8.contiguous().view(FP8),
            v8t=v8.transpose(2, 3).contiguous().view(FP8),
            q_scale=qs[:, :, None].expand(b, hq, nq_pad // block_m).contiguous(),
            k_scale=ks[:, :, None].expand(b, hk, nk_pad // block_n).contiguous(),
            v_scale=vs[:, :, None].expand(b, hk, dv).contiguous(),
            q_kmean=None, qm_k=None, k_mean=None, q_mean=None, block_m=block_m, block_n=block_n,
        )
    if k.dtype == FP8 or v.dtype == FP8:
        raise ValueError(f"k and v are float8_e4m3fn but q is {q.dtype}: pass all three pre-quantized or none")
    qf, kf, vf = q.float(), k.float(), v.float()
    if hadamard:
        if d != k.shape[3]:
            raise ValueError("hadamard=True needs q and k of the same head dim")
        r = hadamard_matrix(d, dev)
        qf, kf = _matmul_fp32(qf, r) * (1.0 / d), _matmul_fp32(kf, r)
    keep = valid_keys(kv_lens, b, nk, nk_pad, dev)
    kf = torch.where(keep, _pad_rows(kf, nk_pad), 0.0)
    vf = torch.where(keep, _pad_rows(vf, nk_pad), 0.0)
    q_kmean = None
    g = hq // hk
    if not smooth_k:
        k_mean = None
    elif k_mean is None:
        cnt = keep.sum(dim=2, dtype=torch.float32).clamp_min(1.0)  # [B, 1, 1]
        k_mean = kf.sum(dim=2) / cnt  # [B, Hk, D]
    if k_mean is not None:
        kf = torch.where(keep, kf - k_mean[:, :, None, :], 0.0)
        km_q = k_mean.repeat_interleave(g, dim=1)  # [B, Hq, D]
        q_kmean = (qf * km_q[:, :, None, :]).sum(-1)
    qf = _pad_rows(qf, nq_pad)
    q_mean = qm_k = None
    if smooth_q:
        rows = (torch.arange(nq_pad, device=dev) < nq).view(1, 1, nq_pad, 1)
        cnt = rows.view(-1, block_m).sum(-1, dtype=torch.float32).clamp_min(1.0)  # [nbm]
        q_mean = qf.unflatten(2, (-1, block_m)).sum(3) / cnt[:, None]  # [B, Hq, nbm, D]
        qf = torch.where(rows, qf - q_mean.repeat_interleave(block_m, dim=2), 0.0)
        qm_k = _matmul_fp32(q_mean, kf.repeat_interleave(g, dim=1).transpose(2, 3))  # [B, Hq, nbm, Nk_pad]
    qmax, cast = (INT8_MAX, to_int8) if qk_int8 else (FP8_MAX, to_fp8)
    qs, ks = block_scales(qf, block_m, qmax), block_scales(kf, block_n, qmax)
    vamax = vf.abs().amax(dim=2)  # [B, Hk, Dv]
    vs = scale_of(vamax, FP8_MAX)
    return Quantized(
        q8=cast(qf, qs.repeat_interleave(block_m, dim=2)[..., None]),
        k8=cast(kf, ks.repeat_interleave(block_n, dim=2)[..., None]),
        v8t=to_fp8(vf, vs[:, :, None, :]).transpose(2, 3).contiguous(),
        q_scale=qs, k_scale=ks, v_scale=vs, q_kmean=q_kmean, qm_k=qm_k, k_mean=k_mean, q_mean=q_mean,
        block_m=block_m, block_n=block_n,
    )
