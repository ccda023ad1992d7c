"""CUDA: our split-KV decode kernel (dispatch's "decode" candidate) as the `fa3_decode::fwd` triton_op of
kernels/decode_ops.py, so Inductor launches its kernels from the generated code (and CUDA graphs capture
them) instead of the fa3 op's run-time dispatch, which costs more host time than a decode step's GPU work.

The candidate takes static-cache decode steps (1..16 queries with run-time positions q_pos, or kv_lens
beside a bias: a data mask's key limit, patterns/key_limit.py), forward only. The splits and the key tile
are fixed here from static shapes by the launcher's own rule (kernels/decode.py plan_splits, which never
reads the lengths: they live on the device), so the lowered call runs what the run-time dispatch would.
Dynamic sizes keep the op (the splits depend on the cache length). On CPU the kernels run under the
Triton interpreter only; tests register the lowering for ("cpu", "decode").
"""
from __future__ import annotations

import os
from typing import Callable

import torch

from .. import dispatch
from . import choice, conventions


class DecodeLowering:
    same_kernel = True
    takes_structure = True  # graph_pass passes sinks, q_pos, q_seg, k_seg (those present) after bias and kv_lens

    def target(self, direction: str) -> str:
        return "fa3_decode.fwd"

    def reasons(self, args: dispatch.AttentionArgs, direction: str) -> list[str]:
        from ..kernels import triton_family as tf

        what = "the decode kernel's lowering"
        if direction != "forward":
            return [f"{what}: forward only"]
        dev = args.q.device.type
        if dev == "cpu" and not tf.interpreting():
            return [f"{what}: CPU tensors need the Triton interpreter (TRITON_INTERPRET=1)"]
        if dev not in ("cuda", "cpu"):
            return [f"{what}: device {dev}"]
        if dev == "cuda" and os.environ.get("FA_COMPILE_TRITON_LOWER", "auto") == "0":
            return [f"{what} is off (FA_COMPILE_TRITON_LOWER=0)"]
        dyn = choice.dynamic_dims(args)
        if dyn:
            return [f"{what} fixes the splits from static sizes; dynamic here: {', '.join(dyn)}"]
        if args.sinks is not None or args.q_seg is not None:
            return [f"{what}: no sinks or segment ids"]
        return []

    def _plan(self, args: dispatch.AttentionArgs) -> tuple[int, int]:
        """(splits, keys per tile): kernels/decode.py's choice for a contiguous cache of Nk slots."""
        from ..kernels import decode

        b, hkv, nk = int(args.q.shape[0]), int(args.k.shape[1]), int(args.k.shape[2])
        d, dv = int(args.q.shape[3]), int(args.v.shape[3])
        bn = decode.pick_block_n(max(decode._pow2(d), decode._pow2(dv)), None)
        return decode.plan_splits(0, b, hkv, nk, args.q.device, bn), bn

    def forward_fn(self, args: dispatch.AttentionArgs) -> Callable:
        """fn(q, k, v[, bias][, kv_lens][, q_pos]) -> (out, lse) in the op's conventions, traced functionalized."""
        from ..kernels import decode_ops

        splits, bn = self._plan(args)
        has = [args.bias is not None, args.kv_lens is not None, args.q_pos is not None]
        scale, causal, diag = float(args.scale), bool(args.causal), int(args.diag_offset)

        def fn(q, k, v, *rest):
            it = iter(rest)
            bias, kv_lens, q_pos = (next(it) if h else None for h in has)
            if kv_lens is not None:
                kv_lens = kv_lens.contiguous()
            out, lse = decode_ops.fwd(q, k, v, bias, kv_lens, q_pos, scale, causal, diag, splits, bn)
            return conventions.finish(out, lse, None)  # the kernel writes empty rows itself

        from torch._subclasses.functional_tensor import dispatch_functionalize

        return dispatch_functionalize(fn)

    def backward_fn(self, args: dispatch.AttentionArgs) -> Callable:
        raise NotImplementedError("the decode kernel has no backward (reasons() refuses it)")


DECODE_LOWERING = DecodeLowering()
choice.register("cuda", "decode", DECODE_LOWERING)
