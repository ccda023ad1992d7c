"""CUDA: FlashAttention-3's forward as one thin custom op that Inductor's generated code calls.

FA3's C++ forward (`torch.ops.flash_attn_3.fwd`) has no fake kernel and a schema with mutable
optional arguments (`out!`, `k_new!`, `v_new!`), so it cannot sit in the post-grad graph as it is;
its Python wrapper (`flash_attn_3::_flash_attn_forward`) can, but normalises its arguments per call.
`fa3_lowered::forward` takes exactly what a site needs, all decided at compile time (window, causal,
split count as constants; the key lengths already clamped and int32 in the graph), and its body is
the C++ call through the filled schema template of candidates/fa3.py: one dispatcher hop and one
Python frame per call instead of the fa3 op's run-time dispatch. The output conventions (fp32 lse,
-inf lse and out 0 on empty rows, BSHD out) are graph ops around it. This build of FA3 has no
backward, so a backward node is lowered, or kept, by its own decision.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
from torch import Tensor

from .. import dispatch
from ..candidates import common as c
from ..candidates import fa3 as fa3_cand
from . import choice, conventions

_LIB = "fa3_lowered"


# Declared with torch.library.Library (a schema, a CUDA kernel, a fake) rather than custom_op: the
# call from Inductor's code is then one dispatcher hop into `_forward`, without custom_op's Python
# wrappers per call (the node only ever runs in compiled, post-autograd code).
_LIBRARY = torch.library.Library(_LIB, "DEF")
_LIBRARY.define("forward(Tensor q, Tensor k, Tensor v, Tensor? seqused_k, float scale, bool causal, "
                "int window_left, int window_right, float softcap, int num_splits) -> (Tensor, Tensor)")


def _forward(q: Tensor, k: Tensor, v: Tensor, seqused_k: Optional[Tensor], scale: float, causal: bool,
             window_left: int, window_right: int, softcap: float, num_splits: int) -> tuple[Tensor, Tensor]:
    """q, k, v: [B, N, H, D] with a unit last stride; returns (out [B, Nq, Hq, Dv], lse [B, Hq, Nq] fp32)."""
    op, template, slots = _plan()
    args = list(template)
    for i, value in zip(slots, (q, k, v, seqused_k, scale, causal, window_left, window_right, softcap, num_splits)):
        args[i] = value
    res = op(*args)
    return res[0], res[1]


@functools.lru_cache(maxsize=None)
def _plan() -> tuple:
    """(FA3's C++ forward, its argument template, the positions of _forward's arguments in it): the call is
    filled by position, one frame and no keyword dict per call (host time is what this lowering is for). The
    lowering is only chosen where that direct call exists (FA3Lowering.reasons)."""
    direct = fa3_cand._direct_forward()
    if direct is None:
        raise RuntimeError("fa3_lowered::forward: FA3's C++ forward is not importable with a schema it can fill")
    op, template, index = direct
    names = ("q", "k", "v", "seqused_k", "softmax_scale", "causal", "window_size_left", "window_size_right",
             "softcap", "num_splits")
    return op, template, tuple(index[n] for n in names)


_LIBRARY.impl("forward", _forward, "CUDA")


@torch.library.register_fake(f"{_LIB}::forward", lib=_LIBRARY)
def _(q, k, v, seqused_k, scale, causal, window_left, window_right, softcap, num_splits):
    b, nq, hq, _d = q.shape
    out = q.new_empty((b, nq, hq, v.shape[3]))
    lse = q.new_empty((b, hq, nq), dtype=torch.float32)
    return out, lse


def fa3_forward(*args):
    return torch.ops.fa3_lowered.forward.default(*args)


class FA3Lowering:
    same_kernel = True

    def target(self, direction: str) -> str:
        return f"{_LIB}.forward (FA3's C++ forward)"

    def reasons(self, args: dispatch.AttentionArgs, direction: str) -> list[str]:
        if direction == "backward":
            return ["FA3's backward has no compile-time lowering"]
        if fa3_cand._direct_forward() is None:
            return ["FA3's C++ forward has a schema this lowering cannot fill (its Python wrapper runs instead)"]
        return []

    def forward_fn(self, args: dispatch.AttentionArgs):
        causal, wl, wr = fa3_cand.FA3._window(args)
        scale, softcap = float(args.scale), float(args.softcap)
        nq = c.static_int(args.q.shape[2])
        splits = 1 if nq is not None and nq >= 128 else 0  # as candidates/fa3.py: split-KV for decode shapes
        maybe_empty = c.may_have_empty_rows(args)
        has_lens = args.kv_lens is not None

        def fn(q, k, v, *rest):
            kv_lens = rest[-1] if has_lens else None
            nk = k.shape[2]
            qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
            qt, kt, vt = (t if t.stride(-1) == 1 else t.contiguous() for t in (qt, kt, vt))
            seqused = None if kv_lens is None else kv_lens.clamp(0, nk).to(torch.int32).contiguous()
            out, lse = fa3_forward(qt, kt, vt, seqused, scale, causal, wl, wr, softcap, splits)
            out = out.transpose(1, 2)
            empty = torch.isinf(lse) if maybe_empty else None
            return conventions.finish(out, lse, empty)

        return fn


choice.register("cuda", "fa3", FA3Lowering())
