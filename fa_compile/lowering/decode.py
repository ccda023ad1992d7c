"""CUDA: our split-KV decode kernel as the `fa3_decode::fwd` triton_op of fa_compile/kernels/decode_ops.py, so Inductor
launches its kernels from the generated code (and CUDA graphs capture them) instead of the fa3 op's run-time
dispatch, which costs more host time than a decode step's GPU work.

Two ways in:
- dispatch's "decode" candidate (static-cache decode steps: q_pos, or kv_lens beside a bias) is lowered
  here like any kernel;
- at compile time every decode-shaped inference site (1..16 queries, forward only) that the kernel can
  compute comes here first (`step_reasons`, read by choice.decide before the decode-step math and the
  peers): in a step whose GPU work is microseconds, one fused launch (two with splits) costs less host
  time than the math's matmuls, casts and softmax or an SDPA op's call (generate() on the H200:
  benchmarks/generate_steps.py, BENCHMARKS.md). FA_COMPILE_DECODE_KERNEL=0 turns that off.

The splits and the key tile are fixed here by the launcher's own rule (fa_compile/kernels/decode.py plan_splits,
which never reads the lengths: they live on the device), except that a short static cache launched without CUDA
graphs gets one split (HOST_BOUND_MAX_KEYS: there a launch costs more host time than the splits save GPU time). A cache length that is symbolic (Hugging Face's
DynamicCache grows it every step: dynamic=True or Dynamo's automatic dynamic shapes) is fine: the kernel
divides each sequence's own length among the splits at run time, so the count planned from the
length's hint (or bound) is exact at every length, only less even. Other symbolic sizes keep the op.
On CPU the kernels run under the Triton interpreter only; tests register the lowering for ("cpu", "decode").
"""
from __future__ import annotations

import os
from typing import Callable, Optional

import torch

from .. import dispatch
from . import choice, conventions


# Symbolic sizes the kernel takes: the cache length (the grid is planned from B and Hkv).
_KEY_LENGTH_DIMS = ("k.shape[2]", "v.shape[2]", "diag_offset")
STEP_DEVICES = ("cuda",)  # decode steps lowered to the kernel by default (tests add "cpu" under the interpreter)


def _length_hint(n) -> int:
    """A static length, or a symbolic one's upper bound where finite, else its hint (the example value)."""
    upper = choice.upper_bound(n)
    if upper is not None:
        return upper
    try:
        return int(n.node.hint)
    except Exception:
        return 0  # no hint: plan_splits gives one split


# Up to this many cache slots, a graph launched without CUDA graphs runs the decode kernel in one split. The splits'
# combine is one more launch per layer (~10-13 µs of host time in Inductor's code on an H100's host), and a decode
# step of a small model is host-bound, so the GPU time the splits save is hidden while the launch's host time is not:
# at most ~6.5 µs at 1024 slots (B2 x 8 kv heads d128: 13.5 against 7.0 µs; B4 x 16 heads d64: 11.4 against 7.3;
# benchmarks/decode_splits.py). GPT-2 B4, 8 layers, host µs per compiled step, one split against the planner's:
# 1649 / 1772 with 512 slots, 1601 / 1798 with 1024 (benchmarks/launch_host.py; BENCHMARKS.md). Under CUDA graphs a
# launch costs no host time, and a symbolic length may grow past this: both keep the planner's count.
HOST_BOUND_MAX_KEYS = 1024


def _host_bound_short(nk) -> bool:
    """Whether a decode site over `nk` cache slots gets one split (see HOST_BOUND_MAX_KEYS)."""
    import torch._inductor.config as inductor_config

    return isinstance(nk, int) and nk <= HOST_BOUND_MAX_KEYS and not inductor_config.triton.cudagraphs


class DecodeLowering:
    same_kernel = True
    takes_structure = True  # graph_pass passes sinks, q_pos, q_seg, k_seg (those present) after bias and kv_lens
    fills_empty_rows = True  # forward_fn takes empty_fill: the kernel writes emit's empty-row fix-up (empty_rows.py)

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
        dyn = [n for n in choice.dynamic_dims(args) if n not in _KEY_LENGTH_DIMS]
        if dyn:
            return [f"{what} fixes its launch grid from static sizes; dynamic here: {', '.join(dyn)}"]
        if choice._symbolic(args.diag_offset) and not choice.bottom_right(args):
            return [f"{what}: a symbolic diagonal offset other than Nk - Nq"]
        if args.sinks is not None or args.q_seg is not None:
            return [f"{what}: no sinks or segment ids"]
        return []

    def step_reasons(self, args: dispatch.AttentionArgs, direction: str) -> list[str]:
        """Why a site is not lowered to this kernel as a decode step (choice.decide asks before the
        decode-step math and dispatch's order); [] when it is."""
        from ..kernels import decode

        what = "the decode kernel for decode steps"
        return (choice.decode_step_gate(what, "FA_COMPILE_DECODE_KERNEL", STEP_DEVICES, args, direction)
                or decode.kernel_not_supported_reasons(args) or self.reasons(args, direction))

    def _plan(self, args: dispatch.AttentionArgs) -> tuple[int, int]:
        """(splits, keys per tile): fa_compile/kernels/decode.py's choice for a contiguous cache of Nk slots (a
        symbolic Nk: its upper bound, else its hint), or one split for a short static cache launched without
        CUDA graphs (`_host_bound_short`)."""
        from ..kernels import decode

        b, hkv, nk = int(args.q.shape[0]), int(args.k.shape[1]), _length_hint(args.k.shape[2])
        d, dv = int(args.q.shape[3]), int(args.v.shape[3])
        bn = decode.pick_block_n(max(decode._pow2(d), decode._pow2(dv)), None)
        if _host_bound_short(args.k.shape[2]):
            return 1, bn
        return decode.plan_splits(0, b, hkv, nk, args.q.device, bn), bn

    def forward_fn(self, args: dispatch.AttentionArgs, empty_fill: str = "zero",
                   out_strides: Optional[tuple] = None) -> Callable:
        """fn(q, k, v[, bias][, kv_lens][, q_pos]) -> (out, lse) in the op's conventions, traced functionalized;
        out holds `empty_fill` ("zero", the op's own; "nan"; "mean_v") on rows that admit no key, and has
        `out_strides` where given (the fix-up's output it stands for; the op's BSHD strides otherwise)."""
        from ..kernels import decode_ops

        fill = decode_ops.EMPTY_FILLS[empty_fill]
        splits, bn = self._plan(args)
        has = [args.bias is not None, args.kv_lens is not None, args.q_pos is not None]
        scale, causal = float(args.scale), bool(args.causal)
        # A symbolic offset (reasons() admits Nk - Nq only) is read from the traced sizes, not from the
        # node's SymInt: the traced graph must compute it from its own inputs.
        diag = None if choice._symbolic(args.diag_offset) else int(args.diag_offset)

        def fn(q, k, v, *rest):
            it = iter(rest)
            bias, kv_lens, q_pos = (next(it) if h else None for h in has)
            if kv_lens is not None:
                kv_lens = kv_lens.contiguous()
            off = k.shape[2] - q.shape[2] if diag is None else diag
            out, lse = decode_ops.fwd(q, k, v, bias, kv_lens, q_pos, scale, causal, off, splits, bn, fill)
            out, lse = conventions.finish(out, lse, None)  # the kernel writes empty rows itself
            return (out if out_strides is None else conventions.with_strides(out, out_strides)), lse

        from torch._subclasses.functional_tensor import dispatch_functionalize

        return dispatch_functionalize(fn)

    def backward_fn(self, args: dispatch.AttentionArgs) -> Callable:
        raise NotImplementedError("the decode kernel has no backward (reasons() refuses it)")


DECODE_LOWERING = DecodeLowering()
choice.register("cuda", "decode", DECODE_LOWERING)
