"""Reference attention: plain torch math with fp32 accumulation (fp64 stays fp64).

This is the semantic definition of `torch.ops.fa3.attention`, the CPU path, the fallback on any
device, and the oracle every fused kernel is tested against. Nothing here is fast.

Semantics, for query row i and key column j of one (batch, head):
    s      = scale * <q_i, k_j>
    s      = softcap * tanh(s / softcap)                       if softcap > 0
    s      = s + bias[b, h, i, j]   (float bias)   |   -inf where bias is False (bool mask)
    s      = -inf where the structure forbids j (causal / window / kv_lens), with
             d = j - i - diag_offset:  causal: d <= 0;  window_left >= 0: d >= -window_left;
             window_right >= 0: d <= window_right;  kv_lens: j < kv_lens[b];
             q_pos: j <= q_pos[b, i];  q_seg / k_seg: q_seg[b, i] == k_seg[b, j]
             (q_pos / q_seg [Nq] and k_seg [Nk], or with a leading batch dim of B or 1)
    lse_i  = logsumexp_j s                                      (natural log, fp32; -inf for an empty row)
    p      = exp(s - lse_i), dropped with probability dropout_p and rescaled by 1 / (1 - dropout_p)
    out_i  = sum_j p_ij v_j                                     (0 for an empty row, as FlashAttention)
Sinks (optional, [Hq]): a per-head logit in every row's denominator only,
    lse_i  = logaddexp(sink_h, logsumexp_j s)                   (= sink_h on a row with no admissible key)
    p      = exp(s - lse_i), so sum_j p_ij = 1 - exp(sink_h - lse_i); an empty row has out 0, lse sink_h.
GQA: q has Hq heads, k and v Hkv heads, Hq % Hkv == 0; q head h reads kv head h // (Hq // Hkv).
Zero-size dimensions follow from the same formulas, as in eager: no keys (Nk = 0) gives out 0 and
lse -inf; head dim 0 gives s = 0 (+ bias), so out is the mean of V over the admissible keys; an
empty batch, head, query or V head dim an empty out. Gradients are zeros of the inputs' shapes.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .dropout_hash import dropout_keep_mask


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def structural_keep(
    nq: int, nk: int, *, causal: bool, diag_offset: int, window_left: int, window_right: int, device: torch.device
) -> Optional[Tensor]:
    """[Nq, Nk] bool of admissible keys from causal/window structure, or None when all are admissible."""
    if not causal and window_left < 0 and window_right < 0:
        return None
    i = torch.arange(nq, device=device).unsqueeze(1)
    j = torch.arange(nk, device=device).unsqueeze(0)
    d = j - i - diag_offset
    keep = torch.ones(nq, nk, dtype=torch.bool, device=device)
    if causal:
        keep &= d <= 0
    if window_left >= 0:
        keep &= d >= -window_left
    if window_right >= 0:
        keep &= d <= window_right
    return keep


def scores_reference(
    q: Tensor,
    k: Tensor,
    *,
    scale: float,
    causal: bool = False,
    diag_offset: int = 0,
    window_left: int = -1,
    window_right: int = -1,
    bias: Optional[Tensor] = None,
    kv_lens: Optional[Tensor] = None,
    softcap: float = 0.0,
    q_pos: Optional[Tensor] = None,
    q_seg: Optional[Tensor] = None,
    k_seg: Optional[Tensor] = None,
    bf16_products: bool = False,
) -> Tensor:
    """Masked, scaled scores [B, Hq, Nq, Nk] in the accumulation dtype (bias keeps its autograd link).
    bf16_products: bf16 q and k are multiplied in bf16 (fp32 accumulation, the product rounded to bf16, as
    eager code's own matmul does) instead of in fp32; everything after runs in fp32 either way."""
    b, hq, nq, _ = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    acc = _acc_dtype(q.dtype)
    g = hq // hkv if hkv else 1  # no heads at all (Hq = Hkv = 0): an empty result
    mm = q.dtype if bf16_products and q.dtype == torch.bfloat16 and k.dtype == torch.bfloat16 else acc
    qg = q.to(mm).reshape(b, hkv, g, nq, q.shape[-1])
    s = torch.matmul(qg, k.to(mm).unsqueeze(2).transpose(-2, -1)).reshape(b, hq, nq, nk).to(acc) * scale
    if softcap > 0:
        s = torch.tanh(s / softcap) * softcap
    if bias is not None:
        if bias.dtype == torch.bool:
            s = s.masked_fill(~bias, float("-inf"))
        else:
            s = s + bias.to(acc)
    keep = structural_keep(
        nq, nk, causal=causal, diag_offset=diag_offset, window_left=window_left, window_right=window_right,
        device=q.device,
    )
    if keep is not None:
        s = s.masked_fill(~keep, float("-inf"))
    if kv_lens is not None:
        j = torch.arange(nk, device=q.device)
        s = s.masked_fill((j.view(1, nk) >= kv_lens.to(q.device).view(b, 1)).view(b, 1, 1, nk), float("-inf"))
    keep = position_segment_keep(nq, nk, q_pos, q_seg, k_seg, device=q.device)
    if keep is not None:
        s = s.masked_fill(~keep, float("-inf"))
    return s


def _batch_rows(t: Tensor, n: int) -> Tensor:
    """[B|1, n] int64 view of an index tensor given as [n] or [B|1, n]."""
    return (t.reshape(1, n) if t.dim() == 1 else t).to(torch.int64)


def position_segment_keep(
    nq: int, nk: int, q_pos: Optional[Tensor], q_seg: Optional[Tensor], k_seg: Optional[Tensor], *,
    device: torch.device,
) -> Optional[Tensor]:
    """[B|1, 1, Nq, Nk] bool of the keys q_pos (j <= q_pos[b, i]) and the segment ids (q_seg[b, i] ==
    k_seg[b, j]) admit, or None when neither is given."""
    keep = None
    if q_pos is not None:
        j = torch.arange(nk, device=device).view(1, 1, nk)
        keep = j <= _batch_rows(q_pos.to(device), nq).unsqueeze(-1)
    if q_seg is not None:
        same = _batch_rows(q_seg.to(device), nq).unsqueeze(-1) == _batch_rows(k_seg.to(device), nk).unsqueeze(-2)
        keep = same if keep is None else keep & same
    return None if keep is None else keep.unsqueeze(1)


def _probabilities(s: Tensor, sinks: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """(softmax over the last dim, 0 on empty rows; lse = -inf there), with `sinks` [Hq] in the
    denominator when given (an empty row then has lse = its sink).

    Normalised by the row sum, not by exp(s - lse): on a row whose scores all sit near
    finfo(fp32).min (an additive finfo.min mask over every key) lse = max + log(n) rounds back to
    max, and exp(s - lse) would not sum to 1.
    """
    sink = sinks.to(s.dtype).view(1, -1, 1, 1).expand(*s.shape[:-1], 1) if sinks is not None else None
    if s.shape[-1] == 0:  # no keys at all: every row is empty (amax has no identity to reduce to)
        if sink is not None:
            return s, sink.squeeze(-1) + s.sum(-1)  # (+ 0: keeps the shape's autograd link)
        return s, torch.full(s.shape[:-1], float("-inf"), dtype=s.dtype, device=s.device)
    m = s.amax(dim=-1, keepdim=True)
    if sink is not None:
        m = torch.maximum(m, sink)
    m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)  # empty row: exp(-inf - 0) = 0
    e = torch.exp(s - m)
    total = e.sum(dim=-1, keepdim=True)
    if sink is not None:
        total = total + torch.exp(sink - m)
    p = e / torch.where(total == 0, torch.ones_like(total), total)
    lse = (m + torch.log(total)).squeeze(-1)
    return p, lse


def zero_past_kv_lens(t: Tensor, kv_lens: Optional[Tensor]) -> Tensor:
    """t [B, H, Nk, D] with rows j >= kv_lens[b] set to 0 (t itself without kv_lens). What lies past a
    sequence's length is never read by the op (a cache's unused slots may hold anything, NaN included):
    masking a key's score is not enough for math that still multiplies its value by a probability of 0."""
    if kv_lens is None:
        return t
    b, nk = t.shape[0], t.shape[2]
    j = torch.arange(nk, device=t.device)
    keep = (j.view(1, nk) < kv_lens.to(t.device).view(b, 1)).view(b, 1, nk, 1)
    return torch.where(keep, t, torch.zeros((), dtype=t.dtype, device=t.device))


def attention_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    scale: float,
    causal: bool = False,
    diag_offset: int = 0,
    window_left: int = -1,
    window_right: int = -1,
    bias: Optional[Tensor] = None,
    kv_lens: Optional[Tensor] = None,
    softcap: float = 0.0,
    dropout_p: float = 0.0,
    dropout_seed: Optional[Tensor] = None,
    sinks: Optional[Tensor] = None,
    q_pos: Optional[Tensor] = None,
    q_seg: Optional[Tensor] = None,
    k_seg: Optional[Tensor] = None,
    bf16_products: bool = False,
) -> tuple[Tensor, Tensor]:
    """(out [B, Hq, Nq, Dv] in q.dtype, lse [B, Hq, Nq] fp32); differentiable through torch autograd
    (the sinks included). bf16_products: Q·Kᵀ and P·V of bf16 inputs in bf16 with fp32 accumulation
    (P rounded to bf16 first), eager code's own precision, at the tensor cores' bf16 rate; the mask,
    softmax and lse stay fp32, so a row the bias absorbs is still exact."""
    b, hq, nq, _ = q.shape
    hkv, nk, dv = v.shape[1], v.shape[2], v.shape[3]
    acc = _acc_dtype(q.dtype)
    k, v = zero_past_kv_lens(k, kv_lens), zero_past_kv_lens(v, kv_lens)  # never read (a cache's unused slots)
    s = scores_reference(
        q, k, scale=scale, causal=causal, diag_offset=diag_offset, window_left=window_left,
        window_right=window_right, bias=bias, kv_lens=kv_lens, softcap=softcap, q_pos=q_pos, q_seg=q_seg,
        k_seg=k_seg, bf16_products=bf16_products,
    )
    p, lse = _probabilities(s, sinks)
    if dropout_p > 0:
        if dropout_seed is None:
            raise ValueError("dropout_seed: required when dropout_p > 0")
        keep = dropout_keep_mask(dropout_seed, b, hq, nq, nk, dropout_p, device=q.device)
        p = p * keep.to(acc) / (1.0 - dropout_p)
    g = hq // hkv if hkv else 1  # no heads at all (Hq = Hkv = 0): an empty result
    mm = v.dtype if bf16_products and v.dtype == torch.bfloat16 else acc
    out = torch.matmul(p.to(mm).reshape(b, hkv, g, nq, nk), v.to(mm).unsqueeze(2)).reshape(b, hq, nq, dv)
    return out.to(q.dtype), lse.to(torch.float32 if acc == torch.float32 else acc)


def attention_backward_reference(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    bias_requires_grad: bool,
    scale: float,
    causal: bool = False,
    diag_offset: int = 0,
    window_left: int = -1,
    window_right: int = -1,
    bias: Optional[Tensor] = None,
    kv_lens: Optional[Tensor] = None,
    softcap: float = 0.0,
    dropout_p: float = 0.0,
    dropout_seed: Optional[Tensor] = None,
    out: Optional[Tensor] = None,
    sinks: Optional[Tensor] = None,
    q_pos: Optional[Tensor] = None,
    q_seg: Optional[Tensor] = None,
    k_seg: Optional[Tensor] = None,
    bf16_products: bool = False,
) -> tuple[Tensor, Tensor, Tensor, Optional[Tensor]]:
    """(dq, dk, dv, dbias) by the explicit formulas the fused kernels implement (fp32 accumulation).
    bf16_products: with bf16 inputs every product runs in bf16 with fp32 accumulation, its operands
    (P, dS) rounded to bf16 first, as eager code's own backward does; the rest stays fp32.

    P = softmax(S), Pd = P * keep / (1 - p), O = Pd V (`out` when given: delta is read from the
    forward's output, as every fused kernel does), delta = rowsum(dO * O),
    dV = Pd^T dO, dP = (dO V^T) * keep / (1 - p), dS = P * (dP - delta),
    dX = dS * (1 - (S_capped / softcap)^2) with softcap, dQ = scale dX K, dK = scale dX^T Q.
    With sinks, P has the sink in its denominator and nothing else changes for the keys; the sinks'
    own gradient is `sink_grad_reference`.
    Runs below autograd (inside the custom op), so it cannot lean on torch.autograd.
    """
    b, hq, nq, d = q.shape
    hkv, nk, dv_ = v.shape[1], v.shape[2], v.shape[3]
    g = hq // hkv if hkv else 1  # no heads at all (Hq = Hkv = 0): an empty result
    acc = _acc_dtype(q.dtype)
    k, v = zero_past_kv_lens(k, kv_lens), zero_past_kv_lens(v, kv_lens)  # never read (a cache's unused slots)
    low = bf16_products and all(t.dtype == torch.bfloat16 for t in (q, k, v, dout))
    mm = torch.bfloat16 if low else acc  # the products' operand dtype
    qa, ka, va, doa = q.to(mm), k.to(mm), v.to(mm), dout.to(mm)
    # The capped scores before any mask: masked entries must stay finite for the tanh derivative.
    capped = scores_reference(qa, ka, scale=scale, softcap=softcap, bf16_products=low) if softcap > 0 else None
    s = scores_reference(
        qa, ka, scale=scale, causal=causal, diag_offset=diag_offset, window_left=window_left,
        window_right=window_right, bias=bias, kv_lens=kv_lens, softcap=softcap, q_pos=q_pos, q_seg=q_seg,
        k_seg=k_seg, bf16_products=low,
    )
    p, _ = _probabilities(s, sinks)
    if dropout_p > 0:
        keep = dropout_keep_mask(dropout_seed, b, hq, nq, nk, dropout_p, device=q.device).to(acc) / (1.0 - dropout_p)
    else:
        keep = None
    pd = p * keep if keep is not None else p
    vg = va.unsqueeze(2)  # [B, Hkv, 1, Nk, Dv]
    if out is None:
        o = torch.matmul(pd.to(mm).reshape(b, hkv, g, nq, nk), vg).reshape(b, hq, nq, dv_).to(acc)
    else:
        o = out.to(acc)
    delta = (doa.to(acc) * o).sum(-1, keepdim=True)
    dvv = torch.matmul(pd.to(mm).reshape(b, hkv, g, nq, nk).transpose(-2, -1),
                       doa.reshape(b, hkv, g, nq, dv_)).to(acc).sum(2)
    dp = torch.matmul(doa.reshape(b, hkv, g, nq, dv_), vg.transpose(-2, -1)).reshape(b, hq, nq, nk).to(acc)
    if keep is not None:
        dp = dp * keep
    ds = p * (dp - delta)
    dbias = None
    if bias_requires_grad and bias is not None:
        full = ds
        lead = full.dim() - bias.dim()
        if lead:
            full = full.sum(dim=tuple(range(lead)))
        dims = tuple(i for i, n in enumerate(bias.shape) if n == 1 and full.shape[i] != 1)
        dbias = (full.sum(dim=dims, keepdim=True) if dims else full).to(bias.dtype)
    dx = ds * (1.0 - (capped / softcap) ** 2) if capped is not None else ds
    dxg = dx.to(mm).reshape(b, hkv, g, nq, nk)
    dq = torch.matmul(dxg, ka.unsqueeze(2)).reshape(b, hq, nq, d).to(acc) * scale
    dk = torch.matmul(dxg.transpose(-2, -1), qa.reshape(b, hkv, g, nq, d)).to(acc).sum(2) * scale
    return dq.to(q.dtype), dk.to(k.dtype), dvv.to(v.dtype), dbias


def sink_grad_reference(
    sinks: Tensor, lse: Tensor, dout: Optional[Tensor], out: Tensor, dlse: Optional[Tensor] = None,
) -> Tensor:
    """d sinks [Hq] in sinks' dtype. P_sink,i = exp(sink_h - lse_i) is the sink's probability in row i;
    d out_i / d sink_h = -P_sink,i * out_i and d lse_i / d sink_h = P_sink,i, so
    d sink_h = sum_{b,i} P_sink,i * (dlse_i - rowsum(dO_i * O_i)); with dropout `out` is the dropped
    output, and the same formula holds. fp32 math (fp64 stays fp64); a row whose lse is -inf (a sink of
    -inf and no admissible key) contributes 0."""
    acc = torch.promote_types(_acc_dtype(out.dtype), lse.dtype)
    lse_a = lse.to(acc)
    p_sink = torch.exp(sinks.to(acc).view(1, -1, 1) - lse_a)
    p_sink = torch.where(torch.isneginf(lse_a), torch.zeros_like(p_sink), p_sink)
    coef = torch.zeros_like(lse_a)
    if dout is not None:
        coef = coef - (dout.to(acc) * out.to(acc)).sum(-1)
    if dlse is not None:
        coef = coef + dlse.to(acc)
    return (p_sink * coef).sum(dim=(0, 2)).to(sinks.dtype)


# Float bias dtypes that can hold values <= -1e29 (a finfo.min padding fill, a -1e30 mask); fp16 cannot.
ABSORBING_BIAS_DTYPES = (torch.float32, torch.bfloat16, torch.float64)


def absorbing_bias_refusal(bias: Optional[Tensor], what: str) -> list[str]:
    """Why a fused kernel cannot take this float bias: it may absorb whole rows (metadata only).

    A bias value <= -1e29 absorbs the score it is added to (s + b rounds to b), so a row whose every
    admissible key carries such values (a fully padded sequence under a finfo.min mask) is weighed by
    the bias alone, uniformly over equal fills: eager and this reference compute that. The fused kernels
    scale scores to log2 units, where such a row overflows to -inf and reads as empty (out 0; measured
    for cuDNN and our Triton family on the H200), and a backward that recomputes the weights from the
    saved log-sum-exp gets them wrong there (the lse absorbed log Nk). Values are data, so a bias whose
    dtype can hold them is refused: fp32, bf16, fp64; not fp16, whose finfo.min (-65504) absorbs nothing
    in the kernels' fp32 (the rewrite passes an fp16 mask that eager adds in fp16, where it does absorb,
    as fp32: patterns/masks/combine.py untouched_add). The reference, aten's CPU forward and the split-KV decode kernel (natural-log
    units, forward only) compute such rows exactly.
    """
    if bias is None or bias.dtype not in ABSORBING_BIAS_DTYPES:
        return []
    return [f"{what} is not exact on a row whose every score a {str(bias.dtype).replace('torch.', '')} bias "
            "absorbs (values <= -1e29, e.g. a finfo.min fill over a fully padded sequence): it reads the row as "
            "empty, where eager weighs it by the bias alone"]
