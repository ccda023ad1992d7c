"""Decode-sized sites as the op's reference math in graph ops, which Inductor fuses with the model; and, at any
size, the sites whose dispatch choice is the reference itself.

CUDA: for what the decode kernel does not take (choice.decide asks the decode kernel's lowering first,
lowering/decode.py: one launch costs less host time than this math's matmuls, casts and softmax; this form
serves what that kernel cannot compute: softcap, windows, sinks, segment ids, or a length bound it cannot plan).
A decode step (a few query tokens against a short cache) does microseconds of GPU work per call, so its cost is
host time and launches: a fused kernel's call plus the output conventions around it cost more than the
attention itself. The same model's eager attention code under plain Inductor was the fastest variant of
GPT-2's `generate()` on the H200 (BENCHMARKS.md).

CPU: every decode-sized site, and inference sites whose scores per head are small (`SMALL_SCORES`). The other
CPU path, aten's flash kernel (cpu_flash.py), reads every slot of a static cache, so the slots past kv_lens
(which may hold anything, NaN included) had to be zeroed in copies of K and V and the keys checked for NaN:
passes over the whole cache per layer and step that SDPA's code does not make (a 4-layer GPT-2 decode step, B4,
cache 512: 0.76x of SDPA code's speed that way). Inductor's CPU code fuses this math into one loop nest per site
that reads K and V once, as it does the model's eager code; at a short encoder or vision site it also saves
the flash op's fixed cost per call. A training graph's forward keeps aten's kernel there: its backward reads
the lse, and with the math forward the step measured slower.

This lowering writes the op's reference (fa_compile/kernels/reference.py: fp32 scores and softmax, every mask
argument, sinks, run-time positions and segment ids, empty rows out 0 / lse -inf) into the graph: GQA by
grouping the query heads (no repeated K/V), the scores in fp32, no dense mask beyond the [B, Hq, Nq, Nk]
scores (no larger than the scores the model's own eager code makes).

Taken where: forward nodes of inference sites (a training graph's forward keeps the kernel whose backward reads
its lse: that backward recomputes the scores in its own arithmetic, choice.decode_step_gate), no dropout, Nq <= 16 (on CPU also an inference site with Nq x Nk <= 128 x 128), no
forced kernel; on CUDA also
Nk <= 2048 (the scores stay a small fp32 buffer; past it the decode kernel's single pass over the cache is
worth its launch). Symbolic lengths are fine: the math is the same at every size, so one lowered graph
serves a cache that grows (`dynamic=True`, Hugging Face's DynamicCache). FA_COMPILE_DECODE_MATH=0
turns it off (the site then goes to its dispatch kernel, lowered or not).

The same math also lowers, at any size and in both directions, a site whose dispatch choice is the
reference itself (`ReferenceMath`, FA_COMPILE_REFERENCE_MATH=0 turns it off): a site no fused kernel
computes exactly, such as one whose float bias can absorb whole rows, then runs as Inductor would run the
model's eager code. On CPU it takes the reference choice's sites that aten's CPU flash kernel refuses.
"""
from __future__ import annotations

import os
from typing import Optional

from .. import dispatch
from ..kernels.reference import attention_backward_reference, attention_reference
from . import choice, conventions

DECODE_MAX_QUERIES = 16
# Beyond, the fused kernels' single pass over the cache is worth their launch. patterns/key_limit.py's
# MIN_KEYS is the same bound: past it a data mask's key limit becomes kv_lens, which this math (over
# every key) would not shorten but the split-KV decode kernel's reads stop at.
DECODE_MAX_KEYS = 2048
_STRUCTURE = ("sinks", "q_pos", "q_seg", "k_seg")
DEVICES = ("cuda",)  # of CUDA's ReferenceMath (tests add "cpu"); CPU has its own below
DECODE_MATH_DEVICES = ("cuda", "cpu")
KEY_LIMITED_DEVICES = ("cuda",)  # where DECODE_MAX_KEYS applies: CPU has no fused decode kernel to prefer
# CPU also gives the math inference sites whose scores per head are this small (ViT's 65 and BERT's 128 tokens):
# there aten's flash kernel's fixed cost per call outweighs what its tiles save (BENCHMARKS.md, "Short encoder
# and vision sites on CPU"). Beyond, the kernel's tiles beat a fp32 scores buffer.
SMALL_SCORES_DEVICES = ("cpu",)
SMALL_SCORES = 128 * 128


def _present(args: dispatch.AttentionArgs, lowering) -> list[str]:
    """The optional tensors graph_pass passes `lowering` after q, k, v (after dout .. lse backward), in its
    order: bias, kv_lens, the dropout seed where the lowering takes it, then sinks and the run-time structure
    (sites with sinks never reach ReferenceMath: choice.decide asks for takes_sinks)."""
    seed = ("dropout_seed",) if getattr(lowering, "takes_dropout_seed", False) else ()
    return [n for n in ("bias", "kv_lens") + seed + _STRUCTURE if getattr(args, n) is not None]


def _reference_kwargs(args: dispatch.AttentionArgs, bf16_products: bool) -> dict:
    return dict(scale=float(args.scale), causal=bool(args.causal), diag_offset=args.diag_offset,
                window_left=args.window_left, window_right=args.window_right, softcap=float(args.softcap),
                dropout_p=float(args.dropout_p), bf16_products=bf16_products)


def _offset_reasons(args: dispatch.AttentionArgs, what: str) -> list[str]:
    if choice._symbolic(args.diag_offset) and not choice.bottom_right(args):
        return [f"{what}: a symbolic diagonal offset other than Nk - Nq (a run-time value the traced math cannot read)"]
    return []


def _with_offset(kw: dict, q, k) -> dict:
    """`kw` with a symbolic diagonal offset (Nk - Nq: _offset_reasons) computed from the traced q and k."""
    if choice._symbolic(kw["diag_offset"]):
        return dict(kw, diag_offset=k.shape[2] - q.shape[2])
    return kw


def _reference_forward_fn(args: dispatch.AttentionArgs, lowering, bf16_products: bool):
    """fn(q, k, v, *the present tensors) -> (out, lse) in the op's conventions, by the reference math."""
    present, kw = _present(args, lowering), _reference_kwargs(args, bf16_products)

    def fn(q, k, v, *rest):
        out, lse = attention_reference(q, k, v, **_with_offset(kw, q, k), **dict(zip(present, rest)))
        return conventions.finish(out, lse, None)

    return fn


class DecodeMath:
    same_kernel = False
    takes_structure = True  # graph_pass passes sinks, q_pos, q_seg, k_seg after bias and kv_lens

    def target(self, direction: str) -> str:
        return "graph ops (the reference math, fused by Inductor)"

    def reasons(self, args: dispatch.AttentionArgs, direction: str) -> list[str]:
        what = "the decode-step math"
        r = choice.decode_step_gate(what, "FA_COMPILE_DECODE_MATH", DECODE_MATH_DEVICES, args, direction)
        if r:
            return r
        if args.dropout_p > 0:
            r.append(f"{what} has no dropout")
        r += _offset_reasons(args, what)
        nq = choice.upper_bound(args.q.shape[2])
        nk = choice.upper_bound(args.k.shape[2])
        if nq is None or nq > DECODE_MAX_QUERIES:
            small = (args.q.device.type in SMALL_SCORES_DEVICES and nk is not None and nq is not None
                     and nq * nk <= SMALL_SCORES)
            if not small:
                r.append(f"{what}: Nq {args.q.shape[2]} above {DECODE_MAX_QUERIES} (or unbounded)"
                         + (f", scores {args.q.shape[2]} x {args.k.shape[2]} above {SMALL_SCORES}"
                            if args.q.device.type in SMALL_SCORES_DEVICES else ""))
        if args.q.device.type in KEY_LIMITED_DEVICES and (nk is None or nk > DECODE_MAX_KEYS):
            r.append(f"{what}: Nk {args.k.shape[2]} above {DECODE_MAX_KEYS} (or unbounded)")
        return r

    def forward_fn(self, args: dispatch.AttentionArgs):
        """fn(q, k, v[, bias][, kv_lens][, sinks][, q_pos][, q_seg, k_seg]) -> (out, lse), op conventions."""
        return _reference_forward_fn(args, self, bf16_products=False)

    def backward_fn(self, args: dispatch.AttentionArgs):
        raise NotImplementedError("the decode-step math lowers forwards without a gradient only")


DECODE_MATH = DecodeMath()
choice.register("cuda", "decode_math", DECODE_MATH)
choice.register("cpu", "decode_math", DECODE_MATH)


class ReferenceMath:
    """CUDA sites of any size whose dispatch choice is the reference (no fused kernel is exact there, e.g. a
    float bias that can absorb whole rows: fa_compile/kernels/reference.py absorbing_bias_refusal): the reference
    forward and backward as graph ops, which Inductor fuses as it would the model's eager code, instead of
    the op's run-time calls of the Python reference (fp32 copies and products, a dense mask, a launch per
    step). On CUDA bf16 inputs are multiplied in bf16 with fp32 accumulation, eager code's own precision (on CPU
    in fp32, as aten's CPU flash kernel, which may lower the other direction of the same site); masks,
    softmax and lse stay fp32, so a row the bias absorbs stays exact. Dropout draws the op's counter-hash
    mask from the node's seed, the same in both directions. Sites with sinks keep the op (choice.decide
    asks for takes_sinks, which the argument order here does not give).

    On CPU (`devices`) it takes what aten's CPU flash kernel, the lowering of CPU's reference choice
    (cpu_flash.py), refuses: sliding windows, softcap, dropout, a causal diagonal other than top-left, a V head
    dim of its own, fp64, a float bias in another dtype or with a gradient. Those sites ran the op's Python
    reference at run time; as graph ops a small model's forward at such sites took about half the time (CPU,
    2 cores: Gemma 3 and Cohere 2 with windows, DeepSeek V2 / V3 with their V head dim, BENCHMARKS.md)."""

    same_kernel = False
    takes_dropout_seed = True  # graph_pass: the seed after bias and kv_lens,
    takes_structure = True  # then q_pos, q_seg, k_seg

    def __init__(self, devices: Optional[tuple] = None, bf16_products: bool = True):
        self.devices = devices  # None: DEVICES (tests add "cpu")
        # CPU: products of fp32 operands, the arithmetic of aten's CPU flash kernel, which lowers the forward of the
        # same sites where it takes them (a backward that rounds Q·Kᵀ to bf16 against that forward's fp32 scores put
        # dq 5x eager's error away from fp64)
        self.bf16_products = bf16_products

    def target(self, direction: str) -> str:
        return "graph ops (the reference math" + (" backward" if direction == "backward" else "") + ", fused by Inductor)"

    def reasons(self, args: dispatch.AttentionArgs, direction: str) -> list[str]:
        what = "the reference math"
        if os.environ.get("FA_COMPILE_REFERENCE_MATH", "1") == "0":
            return [f"{what} is off (FA_COMPILE_REFERENCE_MATH=0)"]
        devices = self.devices if self.devices is not None else DEVICES
        if args.q.device.type not in devices:
            return [f"{what} is lowered on {' and '.join(d.upper() for d in devices)} only"]
        sizes = (("B", args.q.shape[0]), ("Hq", args.q.shape[1]), ("Nq", args.q.shape[2]), ("Nk", args.k.shape[2]))
        empty = [n for n, size in sizes if not choice._symbolic(size) and int(size) == 0]
        if empty:
            return [f"{what}: {', '.join(empty)} = 0 (the op's exact trivial path runs instead)"]
        hq, hkv = args.q.shape[1], args.k.shape[1]
        if (choice._symbolic(hq) or choice._symbolic(hkv)) and hq is not hkv:  # (not one and the same symbol)
            return [f"{what}: GQA with symbolic head counts"]
        return _offset_reasons(args, what)

    def forward_fn(self, args: dispatch.AttentionArgs):
        """fn(q, k, v[, bias][, kv_lens][, dropout_seed][, q_pos][, q_seg, k_seg]) -> (out, lse)."""
        return _reference_forward_fn(args, self, bf16_products=self.bf16_products)

    def backward_fn(self, args: dispatch.AttentionArgs):
        """fn(dout, q, k, v, out, lse, ...as forward) -> (dq, dk, dv, dbias or an empty tensor)."""
        present, kw = _present(args, self), _reference_kwargs(args, bf16_products=self.bf16_products)
        bias_grad = bool(args.bias_requires_grad) and args.bias is not None

        def fn(dout, q, k, v, out, lse, *rest):
            dq, dk, dv, db = attention_backward_reference(
                dout, q, k, v, bias_requires_grad=bias_grad, out=out, **_with_offset(kw, q, k),
                **dict(zip(present, rest)))
            db = db.contiguous() if bias_grad else q.new_empty((0,))
            return conventions.dense_like(dq, q), conventions.dense_like(dk, k), conventions.dense_like(dv, v), db

        return fn


REFERENCE_MATH = ReferenceMath()
choice.register("cuda", "reference", REFERENCE_MATH)
CPU_REFERENCE_MATH = ReferenceMath(devices=("cpu",), bf16_products=False)
choice.register("cpu", "reference_math", CPU_REFERENCE_MATH, fallback_for="reference")
