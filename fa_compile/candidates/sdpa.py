"""cuDNN, FA2 ("flash") and mem-efficient attention through torch's private SDPA ops.

The public `F.scaled_dot_product_attention` hides the log-sum-exp; the private ops return it and
have backward ops that take it, so a forward from one kernel and a backward from another can meet
at the saved lse. Their conventions, as torch 2.11 / 2.13 define them (meta registrations):

| op                                  | lse shape                 | base    | empty row (no key)   |
| _scaled_dot_product_flash_attention | [B, H, Nq]                | natural | no bias: cannot occur |
| _scaled_dot_product_cudnn_attention | [B, H, Nq, 1]             | natural | lse -inf, out 0      |
| _scaled_dot_product_efficient_...   | [B, H, ceil(Nq/32) * 32]  | natural | lse 0 (!), out 0     |

(measured on the H200, torch 2.11.0+cu130, cuDNN 9.19: benchmarks/results/dispatch_h200.json.)
Each is normalised to the op's [B, Hq, Nq] fp32, -inf on an empty row (`common.finish_forward`),
and each backward gets the lse back in its own shape with -inf turned into +inf so P = 0 there.
Mem-efficient's lse 0 on an empty row cannot be told from a real 0, so it takes no bias/kv_lens.

What none of them can do exactly is refused: softcap, sliding windows, dropout (their RNG is not
our counter hash), a causal diagonal other than SDPA's top-left one, fp64.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from . import common as c

# Whether torch's op passes K/V with fewer heads straight to the kernel (no repeat). FA2 and cuDNN
# handle grouped heads natively (H200 anchors: cuDNN SDPA decode with enable_gqa reached 4.05 TB/s
# counting unrepeated K/V bytes, near the 4.22 TB/s copy ceiling); mem-efficient does not.
NATIVE_GQA = {"flash": True, "cudnn": True, "efficient": False}

# Where is_causal puts the diagonal when Nq != Nk, measured on the H200 (torch 2.11, bf16,
# Nq 64, Nk 200; max error against each alignment): flash 0.0015 bottom-right / 2.74 top-left,
# cuDNN and mem-efficient 0.0078 top-left / 2.75 bottom-right. So FA2 through SDPA is bottom-right
# (diag_offset Nk - Nq), the others top-left (diag_offset 0). Only the forward was measured
# non-square, so a backward takes a causal site only where both alignments agree (Nq == Nk).
CAUSAL_ALIGN = {"flash": "bottom_right", "cudnn": "top_left", "efficient": "top_left"}

_ENABLED = {
    "flash": lambda: torch.backends.cuda.flash_sdp_enabled(),
    "cudnn": lambda: torch.backends.cuda.cudnn_sdp_enabled(),
    "efficient": lambda: torch.backends.cuda.mem_efficient_sdp_enabled(),
}
_BACKEND_NAME = {"flash": "FLASH_ATTENTION", "cudnn": "CUDNN_ATTENTION", "efficient": "EFFICIENT_ATTENTION"}
_BIAS_ALIGN = 16  # elements; the private ops need the bias rows aligned (SDPA's front end pads likewise)


@dataclass
class SdpaCandidate:
    """One SDPA kernel family. `kind` is "flash", "cudnn" or "efficient"."""

    name: str
    kind: str
    label: str
    min_cap: tuple
    dtypes: tuple
    fp32_tf32: bool
    max_head_dim: int
    same_dv: bool
    takes_bias: bool
    bias_grad: bool
    backward_ok: bool = True

    def has_backward(self) -> bool:
        return self.backward_ok

    # ---- what it can take -------------------------------------------------------------------
    def not_supported_reasons(self, args) -> list[str]:
        what = self.label
        r = c.cuda_reasons(args, what, self.min_cap)
        if r:
            return r
        if not _ENABLED[self.kind]():
            r.append(f"{what} is disabled (torch.backends.cuda.{self.kind if self.kind != 'efficient' else 'mem_efficient'}_sdp_enabled() "
                     f"is False, e.g. an enclosing sdpa_kernel() without SDPBackend.{_BACKEND_NAME[self.kind]})")
        r += c.dtype_reasons(args, what, self.dtypes, tf32_fp32=self.fp32_tf32)
        r += c.head_dim_reasons(args, what, multiple=8, max_dim=self.max_head_dim, same_dv=self.same_dv)
        r += c.common_feature_reasons(args, what)
        _b, hq, hkv, nq, nk, _d, _dv = c.shapes(args)
        if hq is None or hkv is None or nq is None or nk is None:
            r.append(f"{what}: symbolic heads or sequence lengths")
            return r
        if hq != hkv and not NATIVE_GQA[self.kind]:
            r.append(f"{what} needs as many K/V heads as Q heads; GQA {hq}/{hkv} would repeat K and V "
                     f"{hq // hkv}x in memory")
        if c.effective_causal(args):
            off = args.diag_offset
            want = 0 if CAUSAL_ALIGN[self.kind] == "top_left" else args.k.shape[2] - args.q.shape[2]
            if not c.known_true(off == want):  # at every size, not at the compiling call's (common.known_true)
                side = "top-left (diag_offset 0)" if CAUSAL_ALIGN[self.kind] == "top_left" else f"bottom-right (diag_offset Nk - Nq = {want})"
                r.append(f"{what}: is_causal is aligned {side}, this site's diagonal is at {args.diag_offset}")
            elif nq != nk and args.needs_backward:
                r.append(f"{what} backward: causal with Nq {nq} != Nk {nk} not verified on the device (forward only)")
        if c.has_window(args):
            r.append(f"{what} has no sliding window (window_left={args.window_left}, window_right={args.window_right})")
        if not self.takes_bias:
            note = " (it marks a row with no admissible key by lse 0, which cannot be told from a real 0)" \
                if self.kind == "efficient" else ""
            if args.bias is not None:
                r.append(f"{what} takes no attention bias / mask here{note}")
            if args.kv_lens is not None:
                r.append(f"{what} takes no key-padding lengths (kv_lens) here{note}")
        else:
            b = args.bias
            if b is not None and b.dtype != torch.bool and b.dtype != args.q.dtype:
                r.append(f"{what} adds the bias in q's dtype {args.q.dtype}; bias is {b.dtype} and rounding it would change scores")
            r += c.absorbing_bias_refusal(b, what)  # (fa_compile/kernels/reference.py)
        if args.needs_backward:
            r += c.deterministic_reasons(args, what, deterministic_backward=False)
            if args.bias_requires_grad and not self.bias_grad:
                r.append(f"{what} backward computes no bias gradient")
        return r

    # ---- running ----------------------------------------------------------------------------
    def _bias(self, args, mask: Optional[Tensor] = None) -> Optional[Tensor]:
        """bias and kv_lens as one additive tensor in q's dtype, [B, Hq, Nq, Nk] by broadcast (views);
        `mask`: that sum already built (unpadded, unexpanded)."""
        q, k = args.q, args.k
        b, hq, nq, nk = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
        bias = mask if mask is not None else self._additive(args)
        if bias is None:
            return None
        while bias.dim() < 4:
            bias = bias.unsqueeze(0)
        # The kernels read bias rows with a unit last stride and 16-element aligned row starts.
        if bias.shape[-1] != nk or bias.stride(-1) != 1 or nk % _BIAS_ALIGN:
            width = (nk + _BIAS_ALIGN - 1) // _BIAS_ALIGN * _BIAS_ALIGN
            padded = bias.new_zeros((*bias.shape[:-1], width))
            padded[..., :nk] = bias
            bias = padded[..., :nk]
        return bias.expand(b, hq, nq, nk)

    @staticmethod
    def _additive(args) -> Optional[Tensor]:
        """bias (bool: True = attend) and kv_lens as one additive tensor in q's dtype, its own broadcast shape."""
        q, k = args.q, args.k
        b, nk = q.shape[0], k.shape[2]
        bias = args.bias
        if bias is not None and bias.dtype == torch.bool:
            bias = torch.zeros(bias.shape, dtype=q.dtype, device=q.device).masked_fill(~bias, c.NEG_INF)
        if args.kv_lens is not None:
            j = torch.arange(nk, device=q.device)
            pad = torch.zeros((b, 1, 1, nk), dtype=q.dtype, device=q.device)
            pad = pad.masked_fill((j.view(1, nk) >= args.kv_lens.view(b, 1)).view(b, 1, 1, nk), c.NEG_INF)
            bias = pad if bias is None else bias + pad
        return bias

    def forward(self, args) -> tuple[Tensor, Tensor]:
        q, k, v = (c.last_dim_contiguous(t) for t in (args.q, args.k, args.v))
        b, hq, nq = q.shape[0], q.shape[1], q.shape[2]
        causal = c.effective_causal(args)
        mask, bad_rows = None, None
        if self.kind != "flash" and (args.kv_lens is not None or (args.bias is not None and args.bias.dtype == torch.bool)):
            # a mask the op applies by exclusion, which the kernel adds: a NaN key must not poison the rows
            # that exclude it (NaN + -inf); see lowering/conventions.without_nan_keys
            from ..lowering import conventions

            mask = self._additive(args)
            k, bad_rows = conventions.without_nan_keys(q, k, mask, causal, q.shape[1] // k.shape[1])
        if self.kind == "flash":
            res = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=args.scale)
            out, lse = res[0], res[1]
        elif self.kind == "cudnn":
            res = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, self._bias(args, mask), True, 0.0, causal, False, scale=args.scale)
            out, lse = res[0], res[1].reshape(b, hq, nq)
        else:
            res = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, self._bias(args, mask), True, 0.0, causal, scale=args.scale)
            out, lse = res[0], res[1][:, :, :nq]
        if bad_rows is not None:  # rows that admit a key, never empty ones
            out = out.masked_fill(bad_rows.unsqueeze(-1), float("nan"))
            lse = lse.masked_fill(bad_rows, float("nan"))
        return c.finish_forward(out, lse, c.may_have_empty_rows(args))

    def backward(self, args, dout: Tensor, out: Tensor, lse: Tensor):
        q, k, v, out = (c.last_dim_contiguous(t) for t in (args.q, args.k, args.v, out))
        dq_nan = None
        excludes = args.kv_lens is not None or (args.bias is not None and args.bias.dtype == torch.bool)
        if self.kind != "flash" and excludes:  # the forward's NaN keys were zeroed: conventions.nan_keys_for_backward
            from ..lowering import conventions

            k, dq_nan = conventions.nan_keys_for_backward(k)
        # The kernels read dO with out's strides (cuDNN insists on it).
        if dout.stride() != out.stride():
            dout = torch.empty_like(out).copy_(dout)
        b, hq, nq, nk = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
        causal = c.effective_causal(args)
        lse_b = c.lse_for_backward(lse)
        dev = q.device
        if self.kind == "flash":
            seed = torch.zeros((2,), dtype=torch.uint64, device=dev)
            offset = torch.zeros((), dtype=torch.uint64, device=dev)
            dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
                dout, q, k, v, out, lse_b.contiguous(), None, None, nq, nk, 0.0, causal, seed, offset, scale=args.scale)
        elif self.kind == "cudnn":
            seed = torch.zeros((), dtype=torch.long, device=dev)
            offset = torch.zeros((), dtype=torch.long, device=dev)
            dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
                dout, q, k, v, out, lse_b.reshape(b, hq, nq, 1).contiguous(), seed, offset, self._bias(args), None, None,
                nq, nk, 0.0, causal, scale=args.scale)
        else:
            raise RuntimeError("mem-efficient backward is not used (see EFFICIENT below)")
        if dq_nan is not None:
            from ..lowering import conventions

            dq = conventions.with_nan_columns(dq, dq_nan)
        return dq, dk, dv, None


# Capabilities: torch builds FA2 and cuDNN attention for sm80+, mem-efficient for sm50+.
CUDNN = SdpaCandidate("cudnn", "cudnn", "cuDNN (SDPA)", (8, 0), (torch.float16, torch.bfloat16), False, 256, False,
                      takes_bias=True, bias_grad=False)
FLASH = SdpaCandidate("flash", "flash", "FA2 (SDPA flash)", (8, 0), (torch.float16, torch.bfloat16), False, 256, True,
                      takes_bias=False, bias_grad=False)
# Mem-efficient is registered for the forward only: its backward op, fed an lse in its padded
# [B, H, ceil(Nq/32) * 32] layout, disagreed with the reference on every GPU case (H200, torch 2.11),
# and it is the slowest backward measured (anchors: 2-4x behind cuDNN), so nothing is lost.
EFFICIENT = SdpaCandidate("efficient", "efficient", "mem-efficient (SDPA)", (5, 0), (torch.float16, torch.bfloat16), True, 256,
                          False, takes_bias=False, bias_grad=False, backward_ok=False)
