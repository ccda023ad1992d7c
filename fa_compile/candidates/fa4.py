"""FlashAttention-4 (CuTe DSL kernels) through `flash_attn.cute`, when importable.

Opt-in: no FA4 build was installed on the lent H200, so this path has never been checked against
the reference here. It is offered only with FA_COMPILE_FA4=1 or a forced kernel="fa4"; until a
GPU test has passed on a machine that has it, it must not be picked silently. Conventions assumed
from the upstream interface: BSHD, bottom-right causal/window alignment, lse [B, Hq, Nq] natural log.
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
def _module() -> tuple[Optional[Any], str]:
    try:
        from flash_attn.cute import interface  # noqa: PLC0415
    except Exception as e:
        return None, f"{type(e).__name__}: {str(e)[:120]}"
    if not hasattr(interface, "_flash_attn_fwd"):
        return None, "flash_attn.cute.interface has no _flash_attn_fwd"
    return interface, ""


def opted_in() -> bool:
    return config.flag_on("FA_COMPILE_FA4")


@dataclass
class FA4Candidate:
    name: str = "fa4"

    def opt_in_reason(self) -> Optional[str]:
        """Why dispatch may not pick it unasked (a forced kernel='fa4' skips this)."""
        if opted_in():
            return None
        return "FA4 is untested with this project: opt in with FA_COMPILE_FA4=1 or kernel='fa4'"

    def has_backward(self) -> bool:
        mod, _ = _module()
        return mod is not None and hasattr(mod, "_flash_attn_bwd")

    def not_supported_reasons(self, args) -> list[str]:
        what = "FA4"
        mod, why = _module()
        if mod is None:
            return [f"flash_attn.cute is not importable ({why})"]
        r = c.cuda_reasons(args, what, (9, 0))
        if r:
            return r
        r += c.dtype_reasons(args, what, (torch.float16, torch.bfloat16))
        r += c.head_dim_reasons(args, what, multiple=8, max_dim=128, same_dv=True)
        r += c.common_feature_reasons(args, what, softcap=True)
        if args.bias is not None:
            r.append(f"{what} takes no attention bias / mask")
        if args.kv_lens is not None:
            r.append(f"{what}: kv_lens not wired up")
        nq, nk = c.static_int(args.q.shape[2]), c.static_int(args.k.shape[2])
        off = c.static_int(args.diag_offset)
        if c.effective_causal(args) or c.has_window(args):
            if nq is None or nk is None or off is None or \
                    not c.known_true(args.diag_offset == args.k.shape[2] - args.q.shape[2]):
                r.append(f"{what} aligns causal/window bounds bottom-right (diag_offset Nk - Nq), this site's is {args.diag_offset}")
        if args.needs_backward:
            r += c.deterministic_reasons(args, what, deterministic_backward=False)
        return r

    def _bounds(self, args):
        causal = c.effective_causal(args)
        left_free, right_free = c.window_vacuous(args)
        wl = None if left_free else args.window_left
        wr = None if right_free else args.window_right
        if causal:
            wr = None
        return causal, wl, wr

    def forward(self, args) -> tuple[Tensor, Tensor]:
        mod, _ = _module()
        q, k, v = (c.last_dim_contiguous(t.transpose(1, 2)) for t in (args.q, args.k, args.v))
        causal, wl, wr = self._bounds(args)
        out, lse = mod._flash_attn_fwd(q, k, v, softmax_scale=args.scale, causal=causal, softcap=args.softcap or None,
                                       window_size_left=wl, window_size_right=wr)[:2]
        return c.finish_forward(out.transpose(1, 2), lse, c.may_have_empty_rows(args))

    def backward(self, args, dout: Tensor, out: Tensor, lse: Tensor):
        mod, _ = _module()
        q, k, v, o, do = (c.last_dim_contiguous(t.transpose(1, 2)) for t in (args.q, args.k, args.v, out, dout))
        causal, wl, wr = self._bounds(args)
        dq, dk, dv = mod._flash_attn_bwd(q, k, v, o, do, c.lse_for_backward(lse).contiguous(), softmax_scale=args.scale,
                                         causal=causal, softcap=args.softcap, window_size_left=wl,
                                         window_size_right=wr)[:3]
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2), None


FA4 = FA4Candidate()
