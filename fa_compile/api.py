"""`fa_compile.attention`: the op for people who call it directly (FA3-style arguments)."""
from __future__ import annotations

import math
import numbers
import sys
from typing import Literal, Optional, Union

import torch
from torch import Tensor

from . import dispatch
from . import ops  # noqa: F401  (registers torch.ops.fa3)
from .paged import short_repr

CAUSAL_ALIGNMENTS = ("top_left", "bottom_right")


_FLOAT_MAX = int(sys.float_info.max)  # an int beyond it has no float (float(10**400) raises OverflowError)
INT64_MAX = 2**63 - 1  # the op's int arguments are int64


def _check_number(name: str, x) -> None:
    if type(x) is float:  # the common case, without the ABC checks (host time per call)
        return
    if type(x) is int:
        if -_FLOAT_MAX <= x <= _FLOAT_MAX:
            return
        raise ValueError(f"{name}: {short_repr(x)} is beyond the largest float")
    if isinstance(x, bool) or not isinstance(x, (numbers.Real, torch.SymFloat, torch.SymInt)):
        raise TypeError(f"{name}: expected a real number, got {type(x).__name__} {x!r}")


def _check_window(window) -> tuple[int, int]:
    if type(window) is tuple and len(window) == 2 and type(window[0]) is int and type(window[1]) is int \
            and -1 <= window[0] <= INT64_MAX and -1 <= window[1] <= INT64_MAX:
        return window  # the common case, without the ABC checks
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise TypeError(f"window: expected a pair (left, right) of ints, got {window!r}")
    for x in window:
        if isinstance(x, bool) or not isinstance(x, numbers.Integral):
            raise TypeError(f"window: expected a pair (left, right) of ints, got {window!r} "
                            f"(a {type(x).__name__} is not truncated silently)")
        if x < -1:
            raise ValueError(f"window: each bound must be >= 0, or -1 for unbounded; got {short_repr(tuple(window))}")
        if x > INT64_MAX:
            raise ValueError(f"window: each bound must fit in 64 bits (-1 for unbounded); got {short_repr(tuple(window))}")
    return int(window[0]), int(window[1])


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    scale: Optional[float] = None,
    causal: Union[bool, Literal["top_left", "bottom_right"]] = False,
    window: tuple[int, int] = (-1, -1),
    bias: Optional[Tensor] = None,
    kv_lens: Optional[Tensor] = None,
    softcap: float = 0.0,
    dropout_p: float = 0.0,
    layout: str = "bhsd",
    return_lse: bool = False,
    kernel: Optional[str] = None,
    sinks: Optional[Tensor] = None,
    q_pos: Optional[Tensor] = None,
    q_seg: Optional[Tensor] = None,
    k_seg: Optional[Tensor] = None,
    fp8: bool = False,
    q_descale: Optional[Tensor] = None,
    k_descale: Optional[Tensor] = None,
    v_descale: Optional[Tensor] = None,
    out_dtype: Optional[torch.dtype] = None,
):
    """Fused attention. q [B, Hq, Nq, D], k/v [B, Hkv, Nk, D] ("bhsd") or [B, N, H, D] ("bshd").

    scale: default 1 / sqrt(D); a head dim of 0 has no default (give one: the scores are then 0,
    and each row the mean of its admissible values, as in eager).
    causal: False, True / "top_left" (SDPA's alignment) or "bottom_right" (a KV cache's: the last
    query sees every key). window: (left, right) keys around the aligned diagonal, -1 = unbounded.
    bias: additive float or bool (True = attend), broadcasting to [B, Hq, Nq, Nk] in either layout.
    An fp32 / bf16 / fp64 float bias can hold values that absorb a whole row (finfo.min padding), which
    the fused kernels read as empty rows: such calls run the reference (exact); a bias whose values fit
    fp16 keeps our Triton kernels when passed as fp16, a mask when passed as bool.
    kv_lens: int32/int64 [B], the valid keys of each batch entry: keys j >= kv_lens[b] are masked, and
        neither they nor their values are read (a cache's unused slots may hold anything, NaN included).
    The lengths are clamped to [0, Nk] (beyond Nk: every key; 0 or below: none, out 0). They are not
    checked, since reading them would cost a device sync on every call.
    Zero-size inputs (any of B, H, Nq, Nk, D, Dv = 0) give eager's result and zero gradients.
    sinks: float [Hq], one logit per query head in each row's softmax denominator only (GPT-OSS's
    attention sinks); lse then includes it, and a row with no admissible key gives out 0, lse = sink.
    q_pos: int32/int64 [Nq] or [B, Nq], the position of each query at run time (a static KV cache's
    `cache_position`): query i admits key j only if j <= q_pos[b, i] (>= Nk: every key; < 0: none).
    q_seg, k_seg: int32/int64 [B, Nq] / [B, Nk] (or [Nq] / [Nk]), together: query i admits key j only
    if their ids are equal (packed variable-length sequences; ids may come in any order). Both are
    ANDed with causal, window, bias and kv_lens, in either layout (they index positions, not heads).
    fp8: True quantizes bf16 / fp16 q, k, v to float8_e4m3fn on the fly (per-block scales, K smoothed)
    for the FP8 kernel: faster on Hopper, results within FP8's error, not bf16's. Inference only: with
    a gradient wanted, or features the FP8 kernel lacks (softcap, dropout, sinks, q_pos, segments), or
    no FP8 kernel on this device, the exact bf16 / fp16 attention runs instead.
    q, k, v in float8_e4m3fn (quantized elsewhere) always take the FP8 path: q_descale / k_descale /
    v_descale are fp32 [B, H] factors (FA3's convention: the real value is the fp8 value times the
    descale; None = 1), out_dtype the result's dtype (default bfloat16); no backward.
    The result has q's layout; with return_lse also the fp32 log-sum-exp [B, Hq, Nq].
    Bad arguments raise a TypeError or ValueError that names the argument.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name}: expected a Tensor, got {type(t).__name__}")
    for name, t in (("bias", bias), ("kv_lens", kv_lens), ("sinks", sinks), ("q_pos", q_pos), ("q_seg", q_seg),
                    ("k_seg", k_seg)):
        if t is not None and not isinstance(t, Tensor):
            raise TypeError(f"{name}: expected a Tensor or None, got {type(t).__name__}")
    if not isinstance(layout, str) or layout not in ("bhsd", "bshd"):
        raise ValueError(f"layout: must be 'bhsd' or 'bshd', got {layout!r}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"{name}: expected 4 dims ({layout}), got shape {tuple(t.shape)}")
    if layout == "bshd":
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    if sinks is not None:
        ops.check_sinks(sinks, q)
    if q_pos is not None or q_seg is not None or k_seg is not None:
        ops.check_positions_segments(q, k, q_pos, q_seg, k_seg)
    if causal is True:
        causal = "top_left"
    if not (causal is False or (isinstance(causal, str) and causal in CAUSAL_ALIGNMENTS)):
        raise ValueError(f"causal: must be False, True, 'top_left' or 'bottom_right', got {causal!r}")
    wl, wr = _check_window(window)
    for name, x in (("softcap", softcap), ("dropout_p", dropout_p)):
        _check_number(name, x)
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse: expected a bool, got {type(return_lse).__name__}")
    if kernel is not None:
        dispatch.check_kernel_name(kernel, "kernel")
    offset = 0
    if causal == "bottom_right" or (not causal and (wl, wr) != (-1, -1)):
        # A window alone is aligned bottom-right, as in FlashAttention.
        offset = k.shape[2] - q.shape[2]
    if scale is None:
        if q.shape[-1] == 0:
            raise ValueError("scale: q has head dim 0, so the default 1 / sqrt(head_dim) is undefined; "
                             "pass scale= explicitly")
        scale = 1.0 / math.sqrt(q.shape[-1])
    else:
        _check_number("scale", scale)
    if not isinstance(fp8, bool):
        raise TypeError(f"fp8: expected a bool, got {type(fp8).__name__}")
    from .fp8 import FP8_DTYPES  # noqa: PLC0415

    quantized = q.dtype in FP8_DTYPES or k.dtype in FP8_DTYPES or v.dtype in FP8_DTYPES
    descales = (q_descale, k_descale, v_descale, out_dtype)
    for name, d in zip(("q_descale", "k_descale", "v_descale"), descales):  # before the op's schema check
        if d is not None and not isinstance(d, Tensor):
            raise TypeError(f"{name}: expected a float32 Tensor [batch, heads] or None, got {type(d).__name__}")
    if out_dtype is not None and not isinstance(out_dtype, torch.dtype):
        raise TypeError(f"out_dtype: expected a torch.dtype or None, got {type(out_dtype).__name__} {out_dtype!r}")
    if quantized or (fp8 and _fp8_applies(q, k, v, bias, softcap, dropout_p, sinks, q_pos, q_seg, k_seg, kernel)):
        if quantized:
            for name, bad in (("softcap", softcap != 0), ("dropout_p", dropout_p != 0), ("sinks", sinks is not None),
                              ("q_pos", q_pos is not None), ("q_seg", q_seg is not None),
                              ("k_seg", k_seg is not None), ("kernel", kernel is not None)):
                if bad:
                    raise ValueError(f"{name}: not supported with float8_e4m3fn inputs (the FP8 kernel takes causal, "
                                     f"window, bias and kv_lens)")
        out, lse = torch.ops.fa3.attention_fp8(q, k, v, float(scale), bool(causal), offset, wl, wr, bias, kv_lens,
                                               *descales)
        if layout == "bshd":
            out = out.transpose(1, 2)
        return (out, lse) if return_lse else out
    for name, d in zip(("q_descale", "k_descale", "v_descale", "out_dtype"), descales):
        if d is not None:
            raise ValueError(f"{name}: applies to float8_e4m3fn inputs only; q is {q.dtype}")
    seed = None
    if dropout_p > 0:
        seed = torch.randint(0, 2**31 - 1, (), dtype=torch.int64, device=q.device)
    try:
        out, lse = torch.ops.fa3.attention(
            q, k, v, float(scale), bool(causal), offset, wl, wr, bias, kv_lens, float(softcap),
            float(dropout_p), seed, kernel, sinks, q_pos, q_seg, k_seg,
        )
    except (dispatch.NoKernelError, ValueError) as e:  # the op names its force_kernel: name ours
        renamed = dispatch.renamed_force_error(e, "kernel") if kernel is not None else None
        if renamed is None:
            raise
        raise renamed from None
    if layout == "bshd":
        out = out.transpose(1, 2)
    return (out, lse) if return_lse else out


def _fp8_applies(q: Tensor, k: Tensor, v: Tensor, bias, softcap, dropout_p, sinks, q_pos, q_seg, k_seg,
                 kernel) -> bool:
    """fp8=True on bf16 / fp16 inputs: only for an inference call without features the FP8 kernel lacks
    (otherwise the exact op runs: FP8 is a speed request, never a reason to fail or to drop a feature)."""
    if kernel is not None or softcap != 0 or dropout_p != 0 or any(t is not None for t in (sinks, q_pos, q_seg, k_seg)):
        return False
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, bias)):
        return False
    return q.dtype in (torch.float16, torch.bfloat16)
