"""CPU: the reference math lowered to aten's CPU flash kernel where it computes the same function.

`aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout_p, is_causal, *, attn_mask,
scale) -> (out, logsumexp)` (torch 2.11 and 2.13): fp16 / bf16 / fp32 inputs (fp64 too, but the op's fp32 lse would round its backward) with one head
dim for Q, K and V; is_causal aligned top-left; attn_mask additive in q's dtype, broadcasting to
[B, H, Nq, Nk]; logsumexp [B, H, Nq], natural log, fp32 (fp64 for fp64 inputs), stored [B, Nq, H];
out with q's dimension order. A row whose keys are all masked gets out 0 and lse 0, so the op's
-inf is put back from the mask (`conventions.empty_rows`). Its backward takes the same lse.
A row whose scores are all NaN (a NaN in its query, or in every key it admits) gets the same out 0 and
lse 0 from the kernel, where the op's reference gives NaN: such rows are put back to NaN
(`_nan_rows`), so a NaN input is never turned into a finite number. The kernel adds its mask, so a key
holding a NaN that a bool bias or kv_lens excludes would poison every row (NaN + -inf): its NaN elements
are zeroed for the kernel, and the rows that admit it made NaN (`conventions.without_nan_keys`).

What it cannot express exactly keeps the op, as do a forced kernel="reference" and an enclosing
sdpa_kernel() without SDPBackend.FLASH_ATTENTION (SDPA's CPU flash path honours it too): softcap, sliding windows, dropout (ours is a counter
hash), a causal diagonal other than top-left, V head dim != QK head dim, a float bias in another
dtype than q (rounding it would change the scores), a bias gradient, no keys.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .. import dispatch
from ..candidates import common as c
from . import choice, conventions

_FWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
_BWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default


def _repeat_kv(t: Tensor, groups: int) -> Tensor:
    """[B, Hkv, N, D] -> [B, Hkv * groups, N, D], head h reading kv head h // groups (the op's GQA)."""
    if groups == 1:
        return t
    b, h, n, d = t.shape
    return t.unsqueeze(2).expand(b, h, groups, n, d).reshape(b, h * groups, n, d)


def _nan_rows(q: Tensor, k: Tensor, out: Tensor, lse: Tensor, groups: int) -> Tensor:
    """[B, Hq, Nq] bool: the rows the reference makes NaN that the kernel returned as out 0, lse 0.

    The kernel takes a row's max over finite scores only, so a row with none ends as if it were empty.
    A non-finite query element (NaN or +-inf) makes every score of its row NaN or infinite, and softmax
    over such a row NaN (inf - inf, or a row of -inf); a row whose admitted scores are all non-finite
    through its keys shows as the kernel's empty-row result (lse 0 and out 0) in a head whose keys hold
    a non-finite value. The caller leaves structurally empty rows out (they stay the op's empty rows)."""
    # x - x is NaN exactly where x is NaN or infinite (0 elsewhere), and y != y is isnan(y), written so
    # that Inductor's CPU code compares whole vectors (its isnan / isfinite are scalar loops there); k is
    # reduced over D, then N, so each loop reads a contiguous row.
    q0, k0 = q - q, k - k
    qbad = q0.ne(q0).any(-1)
    kbad = k0.ne(k0).any(-1).any(-1)
    if groups > 1:
        kbad = kbad.repeat_interleave(groups, dim=1)
    kbad = kbad[..., None]  # [B, Hq, 1]
    dead = kbad & (lse == 0) & (out == 0).all(-1)
    return qbad | dead


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
        if d is None or dv is None or d != dv:
            r.append(f"{what} needs the V head dim equal to the QK head dim (static), got {args.q.shape[3]} / {args.v.shape[3]}")
        if args.softcap > 0:
            r.append(f"{what} has no softcap")
        if args.dropout_p > 0:
            r.append(f"{what} cannot draw the op's dropout mask (the counter hash of kernels/dropout_hash.py)")
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

    def forward_fn(self, args: dispatch.AttentionArgs):
        """fn(q, k, v[, bias][, kv_lens]) -> (out, lse) in the op's conventions."""
        scale, causal = float(args.scale), self._causal(args)
        has_bias, has_lens = args.bias is not None, args.kv_lens is not None
        groups = int(args.q.shape[1]) // int(args.k.shape[1])
        # masks the op applies by exclusion, which the kernel receives added: see conventions.without_nan_keys
        excludes = has_lens or (has_bias and args.bias.dtype == torch.bool)

        def fn(q, k, v, *rest):
            bias = rest[0] if has_bias else None
            kv_lens = rest[-1] if has_lens else None
            mask = conventions.additive_mask(q, k, bias, kv_lens)
            kk, bad_rows = k, None
            if excludes:
                kk, bad_rows = conventions.without_nan_keys(q, k, mask, causal, groups)
            out, lse = _FWD(q, _repeat_kv(kk, groups), _repeat_kv(v, groups), 0.0, causal, attn_mask=mask,
                            scale=scale)
            empty = conventions.empty_rows(q, k, mask, kv_lens, causal, bias)
            nan = _nan_rows(q, k, out, lse, groups)
            if bad_rows is not None:
                nan = nan | bad_rows
            if empty is not None:  # structurally empty rows stay the op's empty rows (finish)
                nan = nan & ~empty
            out = out.masked_fill(nan.unsqueeze(-1), float("nan"))
            lse = lse.masked_fill(nan, float("nan"))
            return conventions.finish(out, lse, empty)

        return fn

    def backward_fn(self, args: dispatch.AttentionArgs):
        """fn(dout, q, k, v, out, lse[, bias][, kv_lens]) -> (dq, dk, dv, empty dbias)."""
        scale, causal = float(args.scale), self._causal(args)
        has_bias, has_lens = args.bias is not None, args.kv_lens is not None
        groups = int(args.q.shape[1]) // int(args.k.shape[1])

        def fn(dout, q, k, v, out, lse, *rest):
            bias = rest[0] if has_bias else None
            kv_lens = rest[-1] if has_lens else None
            mask = conventions.additive_mask(q, k, bias, kv_lens)
            # An empty row's lse is -inf; its scores are all -inf, so any finite lse gives P = 0 there.
            lse_b = lse.masked_fill(torch.isneginf(lse), 0.0) if mask is not None else lse
            kk, vv = _repeat_kv(k, groups), _repeat_kv(v, groups)
            dq, dk, dv = _BWD(dout, q, kk, vv, out, lse_b, 0.0, causal, attn_mask=mask, scale=scale)
            if groups > 1:
                b, hkv, nk, d = k.shape
                dk = dk.view(b, hkv, groups, nk, d).sum(dim=2)
                dv = dv.view(b, hkv, groups, nk, v.shape[3]).sum(dim=2)
            return (conventions.dense_like(dq, q), conventions.dense_like(dk, k), conventions.dense_like(dv, v),
                    q.new_empty((0,)))

        return fn


CPU_FLASH = CpuFlash()
choice.register("cpu", "reference", CPU_FLASH)
