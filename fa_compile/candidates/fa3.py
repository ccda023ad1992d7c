"""FlashAttention-3 (Dao-AILab's hopper/ kernels) through `flash_attn_interface`, when importable.

The PyPI build `tokenspeed-fa3` is forward-only, without softcap and head dim 96, sm90 only; its
`flash_attn_config.CONFIG["build_flags"]` says so and is read here, so another build that has them
is used fully. Conventions: BSHD tensors with a contiguous last dim (our [B, H, N, D] views of BSHD
storage are passed as `.transpose(1, 2)` without a copy); causal and window bounds are aligned
bottom-right (key j admissible for query i iff j - i <= Nk - Nq), so a site takes FA3 only when its
diag_offset is Nk - Nq or the bound admits every key anyway; lse [B, Hq, Nq] fp32, natural log.
`seqused_k` gives key padding, but it also moves the bottom-right diagonal per batch, so kv_lens is
taken only without causal/window bounds.
Attention sinks ([Hq] logits in the denominator) are taken by the forward only, only when the C++
forward's schema has an argument for them (`_SINK_NAMES`, passed fp32), and only with
FA_COMPILE_FA3_SINKS=1: that argument's semantics have not been checked against the reference on a GPU
here, so it must not be picked silently (the backward refuses sinks either way).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor

from .. import config
from . import common as c


@functools.lru_cache(maxsize=None)
def _module() -> tuple[Optional[Any], dict, str]:
    """(flash_attn_interface or None, build flags, why not importable)."""
    try:
        import flash_attn_interface as fai  # noqa: PLC0415
    except Exception as e:  # ImportError, or a binary built for another torch
        return None, {}, f"{type(e).__name__}: {str(e)[:120]}"
    try:
        from flash_attn_config import CONFIG  # noqa: PLC0415

        flags = dict(CONFIG.get("build_flags", {}))
    except Exception:
        flags = {}
    return fai, flags, ""


_WE_PASS = ("q", "k", "v", "seqused_k", "softmax_scale", "causal", "window_size_left", "window_size_right", "softcap",
            "num_splits")
# The wrapper's keyword -> the C++ schema's name, where they differ (FA3 3.0: `is_causal`).
_SCHEMA_NAMES = {"causal": ("causal", "is_causal")}


@functools.lru_cache(maxsize=None)
def _direct_forward() -> Optional[tuple[Any, tuple, dict]]:
    """(op, argument template, name -> position) of `torch.ops.flash_attn_3.fwd`, the C++ op under
    the wrapper's `_flash_attn_forward`, or None when its schema is not one we can fill by name.

    The wrapper is itself a Python custom op (argument normalisation, two `torch.tensor([])` per
    call): measured at tens of microseconds per call on the H200 host, more than FA3's own kernel
    in decode. Our inputs already meet its layout needs (last dim contiguous)."""
    fai, _flags, _ = _module()
    if fai is None:
        return None
    try:
        op = torch.ops.flash_attn_3.fwd.default
    except Exception:
        return None
    return direct_plan(op)


def direct_plan(op) -> Optional[tuple[Any, tuple, dict]]:
    """(op, argument template, name -> position) for an op with FA3's forward schema, or None when
    its schema has a required argument this adapter does not fill."""
    try:
        schema = op._schema.arguments
    except Exception:
        return None
    template, index = [], {}
    for i, a in enumerate(schema):
        index[a.name] = i
        if a.has_default_value():
            template.append(a.default_value)
        elif isinstance(a.type, torch.OptionalType) or a.name in _WE_PASS:
            template.append(None)
        else:
            return None  # a required argument this adapter does not know: use the wrapper
    for ours, spellings in _SCHEMA_NAMES.items():
        found = next((n for n in spellings if n in index), None)
        if found is not None:
            index[ours] = index[found]
    if any(name not in index for name in _WE_PASS) or any(a.kwarg_only for a in schema):
        return None
    return op, tuple(template), index


# Names FA3 builds give the per-head sink logits in the C++ forward's schema.
_SINK_NAMES = ("sinks", "learnable_sink", "s_aux")


def sink_argument() -> Optional[str]:
    """The C++ forward's argument for attention sinks, or None when this build (or the wrapper path) has none."""
    direct = _direct_forward()
    if direct is None:
        return None
    return next((n for n in _SINK_NAMES if n in direct[2]), None)


def _forward_call(q, k, v, **kw):
    """FA3's forward, (out, lse): the C++ op directly when its schema allows, else the wrapper."""
    direct = _direct_forward()
    if direct is None:
        fai, _flags, _ = _module()
        res = fai._flash_attn_forward(q, k, v, **kw)
        return res[0], res[1]
    op, template, index = direct
    args = list(template)
    args[index["q"]], args[index["k"]], args[index["v"]] = q, k, v
    for name, value in kw.items():
        args[index[name]] = value
    res = op(*args)
    return res[0], res[1]


def _seqused(args) -> Optional[Tensor]:
    """kv_lens as FA3's seqused_k: clamped to [0, Nk] as the op defines it (FA3 would read past the keys)."""
    if args.kv_lens is None:
        return None
    return args.kv_lens.clamp(0, args.k.shape[2]).to(torch.int32).contiguous()


def _head_dims(flags: dict) -> tuple[int, ...]:
    dims = []
    for d in (64, 96, 128, 192, 256):
        if not flags.get(f"FLASHATTENTION_DISABLE_HDIM{d}", False):
            dims.append(d)
    return tuple(dims)


@dataclass
class FA3Candidate:
    name: str = "fa3"
    # kv_lens go in as seqused_k, the cache_seqlens of FA3's own KV-cache API (its contract, not tested here
    # with non-finite values past the lengths: FA3 is not installed where the tests run)
    never_reads_past_kv_lens: bool = True

    def has_backward(self) -> bool:
        fai, flags, _ = _module()
        return fai is not None and not flags.get("FLASHATTENTION_DISABLE_BACKWARD", False)

    def not_supported_reasons(self, args) -> list[str]:
        what = "FA3"
        fai, flags, why = _module()
        if fai is None:
            return [f"flash_attn_interface is not importable ({why})"]
        r = c.cuda_reasons(args, what, (9, 0), (9, 0) if flags.get("FLASHATTENTION_DISABLE_SM8x", False) else None)
        if r:
            return r
        r += c.dtype_reasons(args, what, (torch.float16, torch.bfloat16))
        d, dv = c.static_int(args.q.shape[3]), c.static_int(args.v.shape[3])
        dims = _head_dims(flags)
        if d is None or dv is None:
            r.append(f"{what}: head dim is symbolic")
        else:
            if d != dv:
                r.append(f"{what} (this build) needs the V head dim ({dv}) equal to the QK head dim ({d})")
            if d % 8 or d > 256:
                r.append(f"{what} takes head dims that are multiples of 8 up to 256, got {d}")
            else:
                bucket = next((x for x in (64, 96, 128, 192, 256) if d <= x), None)
                if bucket not in dims:
                    r.append(f"{what} (this build) has no kernel for head dim {d} (compiled: {dims})")
        has_sinks = args.sinks is not None
        r += c.common_feature_reasons(args, what, softcap=not flags.get("FLASHATTENTION_DISABLE_SOFTCAP", False),
                                      sinks=has_sinks and not args.needs_backward and sink_argument() is not None
                                      and config.flag_on("FA_COMPILE_FA3_SINKS"))
        if has_sinks and args.needs_backward:
            r.append(f"{what} backward: attention sinks are taken by the forward only")
        elif has_sinks and sink_argument() is None:
            r.append(f"{what} (this build): its C++ forward has no sinks argument")
        elif has_sinks and not config.flag_on("FA_COMPILE_FA3_SINKS"):
            r.append(f"{what}: its sinks argument is untested with this project; opt in with FA_COMPILE_FA3_SINKS=1")
        if args.bias is not None:
            r.append(f"{what} takes no attention bias / mask")
        nq, nk = c.static_int(args.q.shape[2]), c.static_int(args.k.shape[2])
        off = c.static_int(args.diag_offset)
        bounded = c.effective_causal(args) or c.has_window(args)
        if bounded:
            if nq is None or nk is None or off is None:
                r.append(f"{what}: symbolic sequence lengths or diagonal")
            elif not c.known_true(args.diag_offset == args.k.shape[2] - args.q.shape[2]):
                r.append(f"{what} aligns causal/window bounds bottom-right (diag_offset Nk - Nq = {nk - nq}), "
                         f"this site's diagonal is at {off}")
            if args.kv_lens is not None:
                r.append(f"{what}: kv_lens (seqused_k) would move the bottom-right diagonal per batch")
        if args.needs_backward:
            r += c.deterministic_reasons(args, what, deterministic_backward=True)
        return r

    def _window(self, args) -> tuple[bool, int, int]:
        causal = c.effective_causal(args)
        left_free, right_free = c.window_vacuous(args)
        wl = -1 if left_free else args.window_left
        wr = -1 if right_free else args.window_right
        if causal:
            wr = 0 if wr < 0 else min(wr, 0)
        return causal, wl, wr

    def forward(self, args) -> tuple[Tensor, Tensor]:
        q, k, v = (c.last_dim_contiguous(t.transpose(1, 2)) for t in (args.q, args.k, args.v))
        causal, wl, wr = self._window(args)
        seqused = _seqused(args)
        nq = q.shape[1]
        extra = {}
        if args.sinks is not None:
            extra[sink_argument()] = args.sinks.to(torch.float32).contiguous()
        out, lse = _forward_call(
            q, k, v, seqused_k=seqused, softmax_scale=args.scale, causal=causal,
            window_size_left=wl, window_size_right=wr, softcap=float(args.softcap),
            num_splits=1 if nq >= 128 else 0,  # split-KV for decode-like shapes (deterministic either way)
            **extra,
        )
        return c.finish_forward(out.transpose(1, 2), lse, c.may_have_empty_rows(args), args.sinks)

    def backward(self, args, dout: Tensor, out: Tensor, lse: Tensor):
        fai, _flags, _ = _module()
        if not self.has_backward():
            raise RuntimeError("FA3: this build is forward-only")
        q, k, v, o, do = (c.last_dim_contiguous(t.transpose(1, 2)) for t in (args.q, args.k, args.v, out, dout))
        causal, wl, wr = self._window(args)
        seqused = _seqused(args)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        fai._flash_attn_backward(do, q, k, v, o, c.lse_for_backward(lse).contiguous(), None, None, None, seqused, None, None,
                                 dq, dk, dv, args.scale, causal, wl, wr, float(args.softcap), True, 0)
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2), None


FA3 = FA3Candidate()
