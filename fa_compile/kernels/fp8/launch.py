"""Launcher of the FP8 attention forward: reasons, tiles, quantization, the kernel call.

q/k/v bf16 / fp16 are quantized on the fly (quantize.py rules; fused Triton kernels on the GPU, torch
elsewhere); float8_e4m3fn q/k/v are taken as already quantized with FA3-style [B, H] descales.
out [B, Hq, Nq, Dv] stored BSHD in the input dtype (out_dtype, bf16 by default, for e4m3 inputs) and
lse [B, Hq, Nq] fp32 in natural log, as the op returns them.
"""
from __future__ import annotations

import importlib.util
import os
import warnings
from typing import Optional

import torch
from torch import Tensor

from .config import (
    HADAMARD_DEFAULT, HEAD_DIMS, LOG2E, QK_INT8_DEFAULT, SMOOTH_Q_DEFAULT, default_blocks, two_level_default,
)
from .quantize import FP8, Quantized, quantize

# Tests and the benchmark may pin (block_m, block_n, num_warps, num_stages) per head-dim block.
CONFIG_OVERRIDE: dict = {}


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def fp8_supported_by_triton() -> bool:
    if importlib.util.find_spec("triton") is None:
        return False
    import triton.language as tl

    return hasattr(tl, "float8e4nv")


def fp8_reasons(q: Tensor, k: Tensor, v: Tensor, bias: Optional[Tensor] = None, kv_lens: Optional[Tensor] = None,
                **_ignored) -> list[str]:
    """Why the FP8 kernel cannot take these inputs (empty: it can). Softcap, dropout, sinks, run-time
    positions / segments and gradients are the caller's to exclude."""
    reasons: list[str] = []
    if importlib.util.find_spec("triton") is None:
        return ["triton not installed"]
    if not fp8_supported_by_triton():
        return ["this triton has no float8e4nv (e4m3) type"]
    dev = q.device
    if dev.type == "cpu":
        if not _interpreting():
            reasons.append("CPU tensors need the Triton interpreter (TRITON_INTERPRET=1)")
    elif dev.type != "cuda" or torch.version.hip is not None:
        reasons.append(f"device {dev.type} is not a CUDA GPU")
    elif not torch.cuda.is_available():
        reasons.append("CUDA is not available in this process")
    elif torch.cuda.get_device_capability(dev) < (9, 0):
        cap = torch.cuda.get_device_capability(dev)
        reasons.append(f"FP8 tensor cores need compute capability >= 9.0 (Hopper), got {cap[0]}.{cap[1]}")
    if q.dtype == FP8:
        if k.dtype != FP8 or v.dtype != FP8:
            reasons.append(f"q is float8_e4m3fn but k is {k.dtype} and v is {v.dtype}: all three or none")
    elif q.dtype not in (torch.float16, torch.bfloat16):
        reasons.append(f"dtype {q.dtype} is not supported (bf16, fp16 or float8_e4m3fn)")
    elif k.dtype != q.dtype or v.dtype != q.dtype:
        reasons.append(f"q, k, v dtypes differ ({q.dtype}, {k.dtype}, {v.dtype})")
    d, dv = q.shape[-1], v.shape[-1]
    if d not in HEAD_DIMS or dv not in HEAD_DIMS:
        reasons.append(f"head dims {d}/{dv}: the FP8 kernel takes {'/'.join(map(str, HEAD_DIMS))}")
    if bias is not None and bias.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.bool):
        reasons.append(f"bias dtype {bias.dtype} is not supported")
    return reasons


def pick_config(head_dim: int, device: torch.device) -> tuple[int, int, int, int]:
    """(block_m, block_n, num_warps, num_stages) for the head-dim block on this device."""
    hit = CONFIG_OVERRIDE.get(head_dim)
    if hit is not None:
        return hit
    if device.type != "cuda":
        bm, bn = default_blocks(head_dim, interpreter=True)
        return bm, bn, 4, 1
    bm, bn = default_blocks(head_dim)
    return (bm, bn, 4, 3) if head_dim <= 128 else (bm, bn, 8, 2)


def _use_tma(device: torch.device) -> bool:
    """K / V tiles by tensor descriptors: on Hopper (FA_COMPILE_FP8_TMA=0 turns it off); =1 forces it on
    under the interpreter too (tests)."""
    mode = os.environ.get("FA_COMPILE_FP8_TMA", "auto")
    if mode == "0":
        return False
    if device.type != "cuda":
        return mode == "1" and _interpreting()
    return torch.cuda.get_device_capability(device)[0] == 9


def _desc(t: Tensor, block: list[int]):
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor(t, list(t.shape), list(t.stride()), block)


def quantize_inputs(q: Tensor, k: Tensor, v: Tensor, *, block_m: int, block_n: int, kv_lens=None,
                    smooth_k: bool = True, smooth_q: bool = False, hadamard: bool = False,
                    q_descale=None, k_descale=None, v_descale=None, qk_int8: bool = False) -> Quantized:
    """quantize.quantize, through the fused Triton kernels where they apply (CUDA, bf16 / fp16 inputs)."""
    kw = dict(block_m=block_m, block_n=block_n, kv_lens=kv_lens, smooth_k=smooth_k, smooth_q=smooth_q,
              hadamard=hadamard, q_descale=q_descale, k_descale=k_descale, v_descale=v_descale, qk_int8=qk_int8)
    key = (q.shape[-1], v.shape[-1], block_m, block_n, q.dtype, bool(hadamard), bool(qk_int8))
    if (q.device.type == "cuda" and q.dtype != FP8 and os.environ.get("FA_COMPILE_FP8_QUANT") != "torch"
            and key not in _QUANT_FAILED):
        from triton.runtime.errors import OutOfResources

        from .quantize_triton import quantize_triton

        try:
            return quantize_triton(q, k, v, **kw)
        except OutOfResources as e:  # compile-time: nothing was written; the torch path gives the same values
            _QUANT_FAILED.add(key)
            warnings.warn(f"fa_compile: the fused FP8 quantization does not fit ({str(e)[:120]}); "
                          "quantizing with torch instead", RuntimeWarning)
    return quantize(q, k, v, **kw)


# Shapes whose fused quantization did not fit in the GPU's resources (the torch path runs for them).
_QUANT_FAILED: set = set()


def fp8_forward(
    q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool = False, diag_offset: int = 0,
    window_left: int = -1, window_right: int = -1, bias: Optional[Tensor] = None, kv_lens: Optional[Tensor] = None,
    *, q_descale: Optional[Tensor] = None, k_descale: Optional[Tensor] = None, v_descale: Optional[Tensor] = None,
    smooth_k: bool = True, smooth_q: Optional[bool] = None, hadamard: Optional[bool] = None,
    out_dtype: Optional[torch.dtype] = None, two_level: Optional[bool] = None, qk_int8: Optional[bool] = None,
    out: Optional[Tensor] = None, lse: Optional[Tensor] = None, quantized: Optional[Quantized] = None,
) -> tuple[Tensor, Tensor]:
    """(out, lse) as the op returns them; `out` / `lse` may be given (tests poison them), `quantized`
    skips the quantization (the benchmark times the kernel alone). None: the defaults of config.py.
    Pre-quantized (float8_e4m3fn) inputs are never smoothed or rotated."""
    from .kernel import attn_fwd_fp8_kernel

    reasons = fp8_reasons(q, k, v, bias, kv_lens)
    if reasons:
        raise ValueError("fp8_forward cannot take these inputs: " + "; ".join(reasons))
    smooth_q = SMOOTH_Q_DEFAULT if smooth_q is None else smooth_q
    hadamard = HADAMARD_DEFAULT if hadamard is None else hadamard
    qk_int8 = QK_INT8_DEFAULT if qk_int8 is None else qk_int8
    b, hq, nq, d = q.shape
    hk, nk, dv = k.shape[1], k.shape[2], v.shape[3]
    two_level = two_level_default(max(d, dv)) if two_level is None else two_level
    if hk == 0 or hq % hk:
        raise ValueError(f"q heads ({hq}) must be a multiple of k/v heads ({hk})")
    odt = out_dtype or (torch.bfloat16 if q.dtype == FP8 else q.dtype)
    if out is None:
        out = torch.empty((b, nq, hq, dv), device=q.device, dtype=odt).transpose(1, 2)
    if lse is None:
        lse = torch.empty((b, hq, nq), device=q.device, dtype=torch.float32)
    if b * hq * nq == 0:
        return out, lse
    if nk == 0:  # no keys: every row is empty
        out.zero_()
        lse.fill_(float("-inf"))
        return out, lse
    if out.stride(-1) != 1:
        raise ValueError("out must have a unit last stride")
    bm, bn, warps, stages = pick_config(max(d, dv), q.device)
    qz = quantized or quantize_inputs(
        q, k, v, block_m=bm, block_n=bn, kv_lens=kv_lens, smooth_k=smooth_k, smooth_q=smooth_q, hadamard=hadamard,
        q_descale=q_descale, k_descale=k_descale, v_descale=v_descale, qk_int8=qk_int8,
    )
    if qz.block_m != bm or qz.block_n != bn:
        raise ValueError(f"quantized blocks {qz.block_m}x{qz.block_n} differ from the kernel's {bm}x{bn}")
    nq_pad, nk_pad = qz.q8.shape[2], qz.k8.shape[2]
    from ..triton_family import _bias4  # the bf16 kernels' bias convention, shared

    bias_t, bias_kind, bstr = _bias4(bias, b, hq, nq, nk)
    vs = qz.v_scale
    use_tma = _use_tma(q.device)
    k_desc = _desc(qz.k8, [1, 1, bn, d]) if use_tma else None
    v_desc = _desc(qz.v8t, [1, 1, dv, bn]) if use_tma else None
    dummy = qz.q_scale
    kw = dict(
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=d, BLOCK_DV=dv, IS_CAUSAL=bool(causal), HAS_WL=int(window_left) >= 0,
        HAS_WR=int(window_right) >= 0, HAS_KVLEN=kv_lens is not None, BIAS_KIND=bias_kind,
        KSMOOTH=qz.q_kmean is not None, QSMOOTH=qz.qm_k is not None, TWO_LEVEL=bool(two_level),
        REVERSE_M=bool(causal), USE_TMA=use_tma, EMULATE_CVT=_interpreting(),
        QK_INT8=qz.q8.dtype == torch.int8, PLAIN=bias_kind == 0 and qz.qm_k is None and float(scale) > 0,
        WARP_SPEC=os.environ.get("FA_COMPILE_FP8_WS", "0") == "1",
    )
    grid = (triton_cdiv(nq, bm) * b * hq,)
    ctx = torch.cuda.device(q.device) if q.device.type == "cuda" else _Null()
    from triton.runtime.errors import OutOfResources

    while True:
        if not _interpreting():
            kw.update(num_warps=warps, num_stages=stages)
        try:
            with ctx:
                attn_fwd_fp8_kernel[grid](
                    qz.q8, qz.k8, qz.v8t, k_desc, v_desc, qz.q_scale, qz.k_scale, vs,
                    qz.q_kmean if qz.q_kmean is not None else dummy, qz.qm_k if qz.qm_k is not None else dummy,
                    out, lse, bias_t if bias_t is not None else dummy, kv_lens if kv_lens is not None else dummy,
                    out.stride(0), out.stride(1), out.stride(2), bstr[0], bstr[1], bstr[2], bstr[3],
                    hq, hq // hk, nq, nk, nq_pad, nk_pad, float(scale) * LOG2E, float(scale), int(diag_offset),
                    int(window_left), int(window_right), **kw,
                )
            LAST_CONFIG["fwd"] = (bm, bn, warps, stages)
            return out, lse
        except OutOfResources:  # compile time, nothing written: a shallower pipeline (same tiles, same scales)
            if stages <= 1:
                raise
            stages -= 1


# The (block_m, block_n, num_warps, num_stages) of the last launch (for the benchmark's report).
LAST_CONFIG: dict = {}


def triton_cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
