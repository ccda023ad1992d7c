"""CPU: the reference math lowered to aten's CPU flash kernel where it computes the same function.

`aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout_p, is_causal, *, attn_mask,
scale) -> (out, logsumexp)` (torch 2.11 and 2.13): fp16 / bf16 / fp32 inputs (fp64 too, but the op's fp32 lse would round its backward) with one head
dim for Q, K and V; is_causal aligned top-left; attn_mask additive in q's dtype, broadcasting to
[B, H, Nq, Nk]; logsumexp [B, H, Nq], natural log, fp32 (fp64 for fp64 inputs), stored [B, Nq, H];
out with q's dimension order. A row whose keys are all masked gets out 0 and lse 0, so the op's
-inf is put back from the mask (`conventions.empty_rows`). Its backward takes the same lse.
A row whose scores are all NaN (a NaN in its query, or in every key it admits) gets the same out 0 and
lse 0 from the kernel, where the op's reference gives NaN: such rows are put back to NaN
(`cpu_flash_op._nan_rows`), so a NaN input is never turned into a finite number. The kernel adds its mask, so a key
holding a NaN that a bool bias or kv_lens excludes would poison every row (NaN + -inf): its NaN elements
are zeroed for the kernel, and the rows that admit it made NaN (`conventions.without_nan_keys`).

Past a decode step's 16 queries, the kernel and those conventions run as one op,
`fa3::cpu_flash_forward`, rather than as graph ops around the kernel (`GRAPH_OPS_MAX_QUERIES` says why not
below): on CPU a decision on the data costs no device sync, and every correction above is
needed only when an input holds a non-finite value or a row admits no key. So the op checks that first
(a sum over q and over k is finite exactly when no element is NaN or infinite, and a sum that overflows
only sends a finite input down the exact path) and pays for the corrections only then; as graph ops,
Inductor's CPU code computed every check on every call in small reductions (about 0.6 ms per layer of
a padded BERT forward at B8 x 128, 4 heads, d64, on 2 cores, against 0.8 ms for the kernel itself). It
also writes emit's empty-row fix-up (NaN, or the mean of V) where the lowering folds it
(`fills_empty_rows`, see empty_rows.py); in training too for the mean of V (`fills_saved_empty_rows`).
The backward of that fix-up (two `where`s on dO, the mean's gradient, eager's uniform-row gradient of q
and k, and three adds) joins the kernel's backward in one op, `fa3::cpu_flash_backward`, which reads the
lse once and computes it only when some row admits no key (`folds_empty_row_grads`,
empty_rows_backward.py): a padded BERT training step had paid a pass over dO, dQ, dK and dV for it per
layer on every batch.

What it cannot express exactly goes to the reference math as graph ops (decomposed.py, CPU_REFERENCE_MATH,
which Inductor fuses), as does an enclosing sdpa_kernel() without SDPBackend.FLASH_ATTENTION (SDPA's CPU
flash path honours it too): softcap, sliding windows, dropout (ours is a counter hash), a causal diagonal other
than top-left, V head dim != QK head dim, a float bias in another dtype than q (rounding it would change the
scores), a bias gradient. A forced kernel="reference" keeps the op, and so do no keys or queries (the op's
exact trivial path).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch.fx.experimental.symbolic_shapes import statically_known_true

from .. import dispatch
from ..candidates import common as c
from ..cpu_flash_op import (_BWD, _CPU_FLASH_BACKWARD, _CPU_FLASH_FORWARD, _repeat_kv, corrected_forward,
                            last_dim_dense, native_gqa)
from ..kernels.reference import zero_past_kv_lens
from . import choice, conventions


# Decode-shaped sites (the decode kernel's 1..16 queries) keep the corrections as graph ops: over a few query
# rows Inductor's fused checks cost less host time than the one op's dispatches (~60 us a call), which a
# CPU generate() step of four layers felt (Llama, B2, 64 + 32 tokens: 0.94x of SDPA's tokens/s with graph
# ops, 0.80x through the op). Longer sites take the op, whose checks are one sum over q and over k. (Such sites now
# reach this lowering only with the decode-step math switched off, FA_COMPILE_DECODE_MATH=0: lowering/decomposed.py.)
GRAPH_OPS_MAX_QUERIES = 16


class CpuFlash:
    same_kernel = False  # the reference math, computed by another (exact) kernel

    def target(self, direction: str) -> str:
        return "aten._scaled_dot_product_flash_attention_for_cpu" + ("_backward" if direction == "backward" else "")

    def reasons(self, args: dispatch.AttentionArgs, direction: str) -> list[str]:
        what = "aten's CPU flash kernel"
        r = []
        if args.q.device.type != "cpu":
            return [f"{what} runs on CPU only"]
        if not torch.backends.cuda.flash_sdp_enabled():
            r.append("an enclosing sdpa_kernel() disables SDPBackend.FLASH_ATTENTION, which SDPA honours on CPU too")
        d, dv = c.static_int(args.q.shape[3]), c.static_int(args.v.shape[3])
        # two symbols equal on this call's hint may differ on the next (marked dynamic each on its own)
        if d is None or dv is None or d != dv or not statically_known_true(args.q.shape[3] == args.v.shape[3]):
            r.append(f"{what} needs the V head dim equal to the QK head dim (static), got {args.q.shape[3]} / {args.v.shape[3]}")
        if args.softcap > 0:
            r.append(f"{what} has no softcap")
        if args.dropout_p > 0:
            r.append(f"{what} cannot draw the op's dropout mask (the counter hash of fa_compile/kernels/dropout_hash.py)")
        if c.has_window(args):
            r.append(f"{what} has no sliding window")
        if args.causal and not c.causal_vacuous(args):
            off = args.diag_offset
            if not isinstance(off, int) or off != 0:
                r.append(f"{what}: is_causal is aligned top-left (diag_offset 0), this site's diagonal is at {off}")
        nk = c.static_int(args.k.shape[2]) if not choice._symbolic(args.k.shape[2]) else -1
        if nk == 0:
            r.append(f"{what}: no keys (Nk = 0)")
        # no queries (or an empty batch / head axis): the kernel stops the process (SIGFPE, torch 2.13)
        empty = [name for name, n in (("B", args.q.shape[0]), ("Hq", args.q.shape[1]), ("Nq", args.q.shape[2]))
                 if not choice._symbolic(n) and c.static_int(n) == 0]
        if empty:
            r.append(f"{what}: {', '.join(empty)} = 0 (the op's exact trivial path runs instead)")
        hq, hkv = args.q.shape[1], args.k.shape[1]
        if hq != hkv and (choice._symbolic(hq) or choice._symbolic(hkv)):
            r.append(f"{what}: GQA with symbolic head counts")
        if args.q.dtype == torch.float64:
            r.append(f"{what}: fp64 (the op keeps an fp32 lse, which its fp64 backward would read back rounded)")
        b = args.bias
        if b is not None and b.dtype != torch.bool and b.dtype != args.q.dtype:
            r.append(f"{what} adds the mask in q's dtype {args.q.dtype}; bias is {b.dtype} and rounding it would change scores")
        if args.bias_requires_grad:
            r.append(f"{what} backward computes no bias gradient")
        if direction == "backward" and b is not None and b.dtype != torch.bool:
            # its forward is exact there, its backward is not (torch 2.13: gradients off by O(1))
            r.append(f"{what} backward is wrong on a row whose float mask values all absorb the scores (finfo.min)")
        return r

    @staticmethod
    def _causal(args) -> bool:
        return bool(args.causal) and not c.causal_vacuous(args)

    fills_empty_rows = True  # forward_fn takes empty_fill: the op writes emit's empty-row fix-up (empty_rows.py)
    # and in training too: its backward (and the op's) zeroes the empty rows' dO, so their filled out weighs nothing
    fills_saved_empty_rows = True

    def forward_fn(self, args: dispatch.AttentionArgs, empty_fill: str = "zero",
                   out_strides: Optional[tuple] = None):
        """fn(q, k, v[, bias][, kv_lens]) -> (out, lse) in the op's conventions; out holds `empty_fill` on
        rows that admit no key and has `out_strides` where given (the fix-up's output it stands for)."""
        scale, causal = float(args.scale), self._causal(args)
        has_bias, has_lens = args.bias is not None, args.kv_lens is not None
        groups = choice.group_count(args)
        nq = c.static_int(args.q.shape[2])
        checked = nq is None or nq > GRAPH_OPS_MAX_QUERIES  # the op; else graph ops

        def fn(q, k, v, *rest):
            bias = rest[0] if has_bias else None
            kv_lens = rest[-1] if has_lens else None
            if checked:
                out, lse = _CPU_FLASH_FORWARD(q, k, v, bias, kv_lens, scale, causal, groups, empty_fill)
            else:
                out, lse = corrected_forward(q, k, v, bias, kv_lens, scale, causal, groups, empty_fill, checked=False)
            out, lse = conventions.finish(out, lse, None)  # empty rows are written above
            return (out if out_strides is None else conventions.with_strides(out, out_strides)), lse

        return fn

    folds_empty_row_grads = True  # backward_fn takes empty_grad: the op computes the fix-up's backward

    def backward_fn(self, args: dispatch.AttentionArgs, empty_grad: Optional[str] = None,
                    out_strides: Optional[tuple] = None):
        """fn(dout, q, k, v, out, lse[, bias][, kv_lens]) -> (dq, dk, dv, empty dbias). With `empty_grad`
        (empty_rows_backward.py), dout is the gradient of emit's empty-row fix-up and the one op
        `fa3::cpu_flash_backward` adds that fix-up's backward; `out_strides` (dq, dk, dv; None: the op's
        own) are then the strides of the graph values the gradients stand for."""
        scale, causal = float(args.scale), self._causal(args)
        has_bias, has_lens = args.bias is not None, args.kv_lens is not None
        excludes = has_lens or (has_bias and args.bias.dtype == torch.bool)  # the forward's NaN keys were zeroed
        groups = choice.group_count(args)
        native = groups > 1 and native_gqa()  # the kernel reads each kv head for its group itself

        def fn(dout, q, k0, v0, out, lse, *rest):
            bias = rest[0] if has_bias else None
            kv_lens = rest[-1] if has_lens else None
            mask = conventions.additive_mask(q, k0, bias, kv_lens)
            # keys and values past kv_lens are never read (a cache's unused slots): zeroed, as the forward does
            k, v = zero_past_kv_lens(k0, kv_lens), zero_past_kv_lens(v0, kv_lens)
            dq_nan = None
            if excludes and empty_grad is None:  # (the op below decides on the data itself)
                k, dq_nan = conventions.nan_keys_for_backward(k)
            if empty_grad is not None:
                # eager's uniform row on an empty row weighs every key, those past kv_lens too
                full = (k0, v0) if has_lens and empty_grad == "uniform" else (None, None)
                grads = _CPU_FLASH_BACKWARD(dout, q, k, v, out, lse, mask, scale, causal, groups, empty_grad, *full)
                grads = [g if s is None else conventions.with_strides(g, s)
                         for g, s in zip(grads, out_strides or (None,) * 3)]
                return (*grads, q.new_empty((0,)))
            # An empty row's lse is -inf; its scores are all -inf, so any finite lse gives P = 0 there.
            lse_b = lse.masked_fill(torch.isneginf(lse), 0.0) if mask is not None else lse
            rep = 1 if native else groups
            kd, vd = last_dim_dense(k), last_dim_dense(v)
            dq, dk, dv = _BWD(last_dim_dense(dout), last_dim_dense(q), _repeat_kv(kd, rep), _repeat_kv(vd, rep),
                              last_dim_dense(out), lse_b, 0.0, causal, attn_mask=mask, scale=scale)
            if rep > 1:  # dK, dV per query head: each kv head's is the sum over its group
                b, hkv, nk, d = k.shape
                dk = dk.view(b, hkv, groups, nk, d).sum(dim=2)
                dv = dv.view(b, hkv, groups, nk, v.shape[3]).sum(dim=2)
            if dq_nan is not None:
                dq = conventions.with_nan_columns(dq, dq_nan)
            return (conventions.dense_like(dq, q), conventions.dense_like(dk, k0), conventions.dense_like(dv, v0),
                    q.new_empty((0,)))

        return fn


CPU_FLASH = CpuFlash()
choice.register("cpu", "reference", CPU_FLASH)
