"""CUDA: the SDPA-family kernels dispatch chooses (cuDNN, FA2, mem-efficient) as their aten ops.

The same calls and conventions as candidates/sdpa.py (which documents each op's lse shape and
empty-row marking), written without in-place ops so they trace into the post-grad graph: the mask
built from bias / kv_lens in q's dtype with 16-aligned rows, the lse normalised to [B, Hq, Nq] fp32
with -inf (and out 0) on empty rows, -inf turned into +inf for the backward kernels.
"""
from __future__ import annotations

import torch
from torch import Tensor
from torch._prims_common import make_contiguous_strides_for

from .. import dispatch
from ..candidates import common as c
from ..candidates.sdpa import _BIAS_ALIGN
from ..kernels.reference import zero_past_kv_lens
from . import choice, conventions

aten = torch.ops.aten


def _last_dim_contiguous(t: Tensor) -> Tensor:
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return t if statically_known_true(t.stride(-1) == 1) else t.contiguous()


def _bias(q: Tensor, k: Tensor, bias, kv_lens, mask: "Tensor | None" = None) -> "Tensor | None":
    b, hq, nq, nk = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    mask = conventions.additive_mask(q, k, bias, kv_lens) if mask is None else mask
    if mask is None:
        return None
    nk_i = c.static_int(nk)
    if nk_i is None or nk_i % _BIAS_ALIGN or mask.shape[-1] != nk:
        width = (nk + _BIAS_ALIGN - 1) // _BIAS_ALIGN * _BIAS_ALIGN
        full = mask.expand(*mask.shape[:-1], nk)
        mask = _stored(torch.nn.functional.pad(full, (0, width - nk)))[..., :nk]
    else:
        mask = _stored(mask)
    return mask.expand(b, hq, nq, nk)


def _stored(t: Tensor) -> Tensor:
    """`t` as a dense buffer of its own (broadcast) shape. Inductor's layout rule for the SDPA ops
    (sdpa_constraint) keeps a broadcast bias only when it is a view of a stored buffer; a mask still
    being computed is written out at its expanded size instead ([B, Hq, Nq, Nk], measured on the H200:
    236 us per call at B32 x 512 x 16 heads, and a slower cuDNN kernel reading it)."""
    import torch._inductor.inductor_prims  # noqa: F401  (registers prims.inductor_force_stride_order)

    return torch.ops.prims.inductor_force_stride_order.default(t, list(make_contiguous_strides_for(t.shape)))


class SdpaLowering:
    same_kernel = True
    skips_unread_lse = True  # forward_fn takes lse_read: an inference graph that reads no lse asks for none

    def __init__(self, kind: str):
        self.kind = kind

    def target(self, direction: str) -> str:
        op = {"flash": "_scaled_dot_product_flash_attention", "cudnn": "_scaled_dot_product_cudnn_attention",
              "efficient": "_scaled_dot_product_efficient_attention"}[self.kind]
        return f"aten.{op}" + ("_backward" if direction == "backward" else "")

    def reasons(self, args: dispatch.AttentionArgs, direction: str) -> list[str]:
        if direction == "backward" and self.kind == "efficient":
            return ["mem-efficient has no backward here (see candidates/sdpa.py)"]
        return []  # dispatch chose it: its candidate's reasons were all answered

    def forward_fn(self, args: dispatch.AttentionArgs, lse_read: bool = True):
        """lse_read=False: nothing reads the site's lse (an inference graph), so cuDNN and mem-efficient are asked
        for none, as SDPA asks them without a gradient, unless the empty-row marking needs it; the lse
        returned then is a placeholder that no node reads (removed as dead code)."""
        kind, scale = self.kind, float(args.scale)
        causal = c.effective_causal(args)
        maybe_empty = c.may_have_empty_rows(args)
        has_bias, has_lens = args.bias is not None, args.kv_lens is not None
        # masks the op applies by exclusion, which cuDNN / mem-efficient receive added (conventions.without_nan_keys)
        excludes = kind != "flash" and (has_lens or (has_bias and args.bias.dtype == torch.bool))
        groups = choice.group_count(args) if excludes else 1
        want_lse = lse_read or maybe_empty or excludes

        def fn(q, k, v, *rest):
            bias = rest[0] if has_bias else None
            kv_lens = rest[-1] if has_lens else None
            b, hq, nq = q.shape[0], q.shape[1], q.shape[2]
            k, v = zero_past_kv_lens(k, kv_lens), zero_past_kv_lens(v, kv_lens)  # never read (unused cache slots)
            mask, bad_rows = None, None
            if excludes:
                mask = conventions.additive_mask(q, k, bias, kv_lens)
                k, bad_rows = conventions.without_nan_keys(q, k, mask, bool(causal), groups)
            q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
            if kind == "flash":
                res = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
                out, lse = res[0], res[1]
            elif kind == "cudnn":
                res = aten._scaled_dot_product_cudnn_attention(q, k, v, _bias(q, k, bias, kv_lens, mask), want_lse,
                                                               0.0, causal, False, scale=scale)
                out, lse = res[0], res[1].reshape(b, hq, nq) if want_lse else None
            else:
                res = aten._scaled_dot_product_efficient_attention(q, k, v, _bias(q, k, bias, kv_lens, mask),
                                                                   want_lse, 0.0, causal, scale=scale)
                out, lse = res[0], res[1][:, :, :nq] if want_lse else None
            if lse is None:  # read by no node: the graph drops it
                return conventions.as_bshd(out), out.new_empty((b, hq, nq), dtype=torch.float32)
            lse = lse.to(torch.float32)
            empty = torch.isinf(lse) if maybe_empty else None
            if bad_rows is not None:  # rows that admit a key, never empty ones
                out = out.masked_fill(bad_rows.unsqueeze(-1), float("nan"))
                lse = lse.masked_fill(bad_rows, float("nan"))
            return conventions.finish(out, lse, empty)

        return fn

    def backward_fn(self, args: dispatch.AttentionArgs):
        kind, scale = self.kind, float(args.scale)
        causal = c.effective_causal(args)
        has_bias, has_lens = args.bias is not None, args.kv_lens is not None
        excludes = kind != "flash" and (has_lens or (has_bias and args.bias.dtype == torch.bool))  # as forward_fn

        def fn(dout, q, k, v, out, lse, *rest):
            bias = rest[0] if has_bias else None
            kv_lens = rest[-1] if has_lens else None
            q0, k0, v0 = q, k, v
            k, v = zero_past_kv_lens(k, kv_lens), zero_past_kv_lens(v, kv_lens)  # as the forward read them
            dq_nan = None
            if excludes:  # the forward's NaN keys were zeroed (conventions.nan_keys_for_backward)
                k, dq_nan = conventions.nan_keys_for_backward(k)
            q, k, v, out = (_last_dim_contiguous(t) for t in (q, k, v, out))
            dout = conventions.with_strides(dout, out.stride())  # the kernels read dO with out's strides
            b, hq, nq, nk = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
            lse_b = lse.to(torch.float32).masked_fill(torch.isneginf(lse), float("inf"))
            dev = q.device
            if kind == "flash":
                # Read only with dropout (never here): allocated, never written.
                seed = torch.empty((2,), dtype=torch.uint64, device=dev)
                offset = torch.empty((), dtype=torch.uint64, device=dev)
                dq, dk, dv = aten._scaled_dot_product_flash_attention_backward(
                    dout, q, k, v, out, lse_b, None, None, nq, nk, 0.0, causal, seed, offset, scale=scale)
            else:
                seed = torch.zeros((), dtype=torch.int64, device=dev)
                offset = torch.zeros((), dtype=torch.int64, device=dev)
                dq, dk, dv = aten._scaled_dot_product_cudnn_attention_backward(
                    dout, q, k, v, out, lse_b.reshape(b, hq, nq, 1), seed, offset, _bias(q, k, bias, kv_lens), None,
                    None, nq, nk, 0.0, causal, scale=scale)
            if dq_nan is not None:
                dq = conventions.with_nan_columns(dq, dq_nan)
            return (conventions.dense_like(dq, q0), conventions.dense_like(dk, k0), conventions.dense_like(dv, v0),
                    q0.new_empty((0,)))

        return fn


for _kind in ("cudnn", "flash", "efficient"):
    choice.register("cuda", _kind, SdpaLowering(_kind))
