"""Reference of paged / KV-cache decode attention (`torch.ops.fa3.paged_attention`): plain torch, fp32.

The semantic definition the decode kernels are tested against, and the fallback on any device.

Cache views: `cache_view(t, layout)` gives a [blocks, page, Hkv, D] view of a cache (no copy):
    layout "bshd": (blocks, page, Hkv, D) paged (vLLM / FA3), or [B, Lmax, Hkv, D] contiguous;
    layout "bhsd": (blocks, Hkv, page, D) paged, or [B, Hkv, Lmax, D] contiguous (HF StaticCache).
Without a page table "block" b is batch entry b's whole cache (page = Lmax).

For batch entry b, with end = cache_seqlens[b] and start = cache_leftpad[b] (0 without it):
    key positions j in [start, end) are valid (FA3's cache_seqlens / cache_leftpad);
    position j lives in block page_table[b, j // page] at slot j % page (block b, slot j without a table);
    q[b, i] (i < Nq) is the token at position end - Nq + i; causal: j <= end - Nq + i (bottom-right);
    lse = logsumexp over the admissible keys of scale * <q, k_j> (natural log, fp32; -inf with none,
    where out is 0), out = softmax-weighted sum of v_j.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .reference import attention_reference


def cache_view(t: Tensor, layout: str) -> Tensor:
    """[blocks, page, Hkv, D] view of a cache stored in `layout` ("bshd" or "bhsd")."""
    return t if layout == "bshd" else t.transpose(1, 2)


def key_positions(
    cache_seqlens: Tensor, cache_leftpad: Optional[Tensor], nq: int, capacity: int, causal: bool,
) -> tuple[Tensor, Tensor]:
    """(pos [capacity], keep [B, Nq, capacity] bool): the admissible key positions of each query."""
    dev = cache_seqlens.device
    pos = torch.arange(capacity, device=dev)
    end = cache_seqlens.to(torch.int64).view(-1, 1, 1)
    start = cache_leftpad.to(torch.int64).view(-1, 1, 1) if cache_leftpad is not None else torch.zeros_like(end)
    p = pos.view(1, 1, -1)
    keep = (p >= start) & (p < end)
    if causal:
        i = torch.arange(nq, device=dev).view(1, -1, 1)
        keep = keep & (p <= end - nq + i)
    return pos, keep.expand(cache_seqlens.shape[0], nq, capacity)


def gather_cache(cache: Tensor, page_table: Optional[Tensor], batch: int) -> Tensor:
    """[B, capacity, Hkv, D] copy of each entry's cache in position order (the reference only; no
    kernel makes this copy). cache: a [blocks, page, Hkv, D] view. Table entries beyond the pages a
    sequence uses may hold anything: they are clamped here and their keys masked by the caller."""
    if page_table is None:
        return cache
    nblocks, page = cache.shape[0], cache.shape[1]
    if nblocks == 0:  # no page to read (the lengths are then 0): keys that every row masks
        return cache.new_zeros((batch, page_table.shape[1] * page, cache.shape[2], cache.shape[3]))
    idx = page_table.to(torch.int64).clamp(0, nblocks - 1)
    g = cache[idx]  # [B, max_pages, page, Hkv, D]
    return g.reshape(batch, idx.shape[1] * page, cache.shape[2], cache.shape[3])


def paged_attention_reference(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    cache_seqlens: Tensor,
    page_table: Optional[Tensor] = None,
    cache_leftpad: Optional[Tensor] = None,
    *,
    scale: float,
    causal: bool = True,
    layout: str = "bshd",
) -> tuple[Tensor, Tensor]:
    """(out [B, Nq, Hq, Dv] in q's dtype, lse [B, Hq, Nq] fp32); differentiable through torch autograd
    (gradients of shared pages add up). Arguments are assumed checked (fa_compile.paged checks them)."""
    b, nq = q.shape[0], q.shape[1]
    kc, vc = cache_view(k_cache, layout), cache_view(v_cache, layout)
    if b == 0 or nq == 0:
        return (q.new_zeros((b, nq, q.shape[2], vc.shape[3])),
                torch.zeros((b, q.shape[2], nq), dtype=torch.float32, device=q.device))
    k = gather_cache(kc, page_table, b)
    v = gather_cache(vc, page_table, b)
    lens = cache_seqlens.to(q.device)
    leftpad = None if cache_leftpad is None else cache_leftpad.to(q.device)
    _, keep = key_positions(lens, leftpad, nq, k.shape[1], causal)
    # Slots outside [cache_leftpad, cache_seqlens) are never read (they may hold anything, NaN included): masking
    # their scores is not enough where their values are still multiplied by a probability of 0.
    _, valid = key_positions(lens, leftpad, 1, k.shape[1], False)
    valid = valid.reshape(b, k.shape[1], 1, 1)
    k = torch.where(valid, k, torch.zeros((), dtype=k.dtype, device=k.device))
    v = torch.where(valid, v, torch.zeros((), dtype=v.dtype, device=v.device))
    out, lse = attention_reference(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), scale=scale, bias=keep.unsqueeze(1),
    )
    return out.transpose(1, 2), lse.to(torch.float32)
