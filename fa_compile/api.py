"""`fa_compile.attention`: the op for people who call it directly (FA3-style arguments)."""
from __future__ import annotations

import math
from typing import Optional, Union

import torch
from torch import Tensor

from . import ops  # noqa: F401  (registers torch.ops.fa3)

CAUSAL_ALIGNMENTS = ("top_left", "bottom_right")


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    scale: Optional[float] = None,
    causal: Union[bool, str] = False,
    window: tuple[int, int] = (-1, -1),
    bias: Optional[Tensor] = None,
    kv_lens: Optional[Tensor] = None,
    softcap: float = 0.0,
    dropout_p: float = 0.0,
    layout: str = "bhsd",
    return_lse: bool = False,
    kernel: Optional[str] = None,
):
    """Fused attention. q [B, Hq, Nq, D], k/v [B, Hkv, Nk, D] ("bhsd") or [B, N, H, D] ("bshd").

    causal: False, True / "top_left" (SDPA's alignment) or "bottom_right" (a KV cache's: the last
    query sees every key). window: (left, right) keys around the aligned diagonal, -1 = unbounded.
    The result has q's layout; with return_lse also the fp32 log-sum-exp [B, Hq, Nq].
    """
    if layout not in ("bhsd", "bshd"):
        raise ValueError(f"layout: must be 'bhsd' or 'bshd', got {layout!r}")
    if layout == "bshd":
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    if causal is True:
        causal = "top_left"
    if causal not in (False, *CAUSAL_ALIGNMENTS):
        raise ValueError(f"causal: must be False, True, 'top_left' or 'bottom_right', got {causal!r}")
    if len(window) != 2:
        raise ValueError(f"window: expected (left, right), got {window!r}")
    offset = 0
    if causal == "bottom_right" or (not causal and tuple(window) != (-1, -1)):
        # A window alone is aligned bottom-right, as in FlashAttention.
        offset = k.shape[2] - q.shape[2]
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    seed = None
    if dropout_p > 0:
        seed = torch.randint(0, 2**31 - 1, (), dtype=torch.int64, device=q.device)
    out, lse = torch.ops.fa3.attention(
        q, k, v, float(scale), bool(causal), offset, int(window[0]), int(window[1]), bias, kv_lens, float(softcap),
        float(dropout_p), seed, kernel,
    )
    if layout == "bshd":
        out = out.transpose(1, 2)
    return (out, lse) if return_lse else out
