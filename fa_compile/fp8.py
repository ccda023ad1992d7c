"""FP8 attention, opt-in: the `fa3::attention_fp8` op, which rewritten sites get it, and why not.

FP8 changes results by more than rounding (Q, K, V and P are rounded to e4m3), so it is never on by
default: `fa_compile.backend(fp8=True)`, `FA_COMPILE_FP8=1` or `fa_compile.attention(..., fp8=True)`
ask for it. Inputs that already are float8_e4m3fn (quantized elsewhere, with FA3-style descales) take
this op whatever the flag, since no other kernel reads them.

A site gets FP8 only where nothing else changes: inference (no input needs a gradient; FP8 has no
backward, so a training site keeps its bf16 forward and the exact bf16 backward of that forward), no
softcap, dropout, sinks, run-time positions or segments, no forced kernel, and the kernel takes the
shapes on this GPU (`fa_compile/kernels/fp8`). `explain()` states the outcome per site.

At run time the op runs the FP8 kernel; inputs it cannot take there (a CPU tensor, say) run the exact
bf16 op for bf16/fp16 inputs and, for float8 inputs, attention in fp32 over the dequantized tensors.
"""
from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

from . import ops
from .kernels.reference import absorbing_bias_refusal

FP8_DTYPES = (torch.float8_e4m3fn,)
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
IN_DTYPES = (torch.bfloat16, torch.float16)

_LIB = torch.library.Library("fa3", "FRAGMENT")
_LIB.define(
    "attention_fp8(Tensor q, Tensor k, Tensor v, float scale, bool causal=False, SymInt diag_offset=0, "
    "SymInt window_left=-1, SymInt window_right=-1, Tensor? bias=None, Tensor? kv_lens=None, "
    "Tensor? q_descale=None, Tensor? k_descale=None, Tensor? v_descale=None, ScalarType? out_dtype=None) "
    "-> (Tensor, Tensor)",
    tags=(torch.Tag.pt2_compliant_tag,),
)


def is_fp8(t: Optional[Tensor]) -> bool:
    return t is not None and t.dtype in FP8_DTYPES


def _check_descale(name: str, d: Optional[Tensor], t: Tensor) -> None:
    if d is None:
        return
    if not isinstance(d, Tensor):
        raise TypeError(f"{name}: expected a float32 Tensor or None, got {type(d).__name__}")
    if d.dtype != torch.float32:
        raise ValueError(f"{name}: dtype must be float32, got {d.dtype}")
    if d.device != t.device:
        raise ValueError(f"{name}: must be on the inputs' device {t.device}, got {d.device}")
    if tuple(d.shape) != (t.shape[0], t.shape[1]):
        raise ValueError(f"{name}: expected shape [batch, heads] = [{t.shape[0]}, {t.shape[1]}], got {tuple(d.shape)}")


def check_fp8_args(q: Tensor, k: Tensor, v: Tensor, bias: Optional[Tensor], kv_lens: Optional[Tensor],
                   q_descale: Optional[Tensor], k_descale: Optional[Tensor], v_descale: Optional[Tensor],
                   out_dtype: Optional[torch.dtype]) -> torch.dtype:
    """The op's checks (metadata only; fake tensors too); returns the output dtype."""
    quantized = [is_fp8(t) for t in (q, k, v)]
    if any(quantized) and not all(quantized):
        raise ValueError("q, k, v: either all float8_e4m3fn (quantized, with descales) or none; got "
                         f"q {q.dtype}, k {k.dtype}, v {v.dtype}")
    if all(quantized):
        if q.dtype != k.dtype or q.dtype != v.dtype:
            raise ValueError(f"k, v: dtypes must match q ({q.dtype}); got k {k.dtype}, v {v.dtype}")
        out = torch.bfloat16 if out_dtype is None else out_dtype
        if out not in OUT_DTYPES:
            raise ValueError(f"out_dtype: must be one of {', '.join(map(str, OUT_DTYPES))}, got {out}")
        for name, d, t in (("q_descale", q_descale, q), ("k_descale", k_descale, k), ("v_descale", v_descale, v)):
            _check_descale(name, d, t)
        # The shape, device and mask checks of the bf16 op, on stand-ins of the output dtype.
        stand_in = [torch.empty_strided(t.shape, t.stride(), dtype=out, device="meta") for t in (q, k, v)]
        ops.check_tensors(*stand_in, _on_meta(bias), _on_meta(kv_lens))
        for name, t in (("k", k), ("v", v), ("bias", bias), ("kv_lens", kv_lens)):
            if t is not None and t.device != q.device:
                raise ValueError(f"{name}: must be on q's device {q.device}, got {t.device}")
        return out
    for name, d in (("q_descale", q_descale), ("k_descale", k_descale), ("v_descale", v_descale)):
        if d is not None:
            raise ValueError(f"{name}: descales apply to float8_e4m3fn inputs only; q is {q.dtype} (quantized "
                             f"on the fly, with scales of its own)")
    if q.dtype not in IN_DTYPES:
        raise ValueError(f"q: FP8 attention quantizes bfloat16 or float16 inputs, got {q.dtype}")
    if out_dtype is not None and out_dtype != q.dtype:
        raise ValueError(f"out_dtype: the output of {q.dtype} inputs is {q.dtype}, got {out_dtype}")
    ops.check_tensors(q, k, v, bias, kv_lens)
    return q.dtype


def _on_meta(t: Optional[Tensor]) -> Optional[Tensor]:
    return None if t is None else torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


def kernel_reasons(q: Tensor, k: Tensor, v: Tensor, causal: bool = False, window_left: int = -1,
                   window_right: int = -1, bias: Optional[Tensor] = None, kv_lens: Optional[Tensor] = None) -> list[str]:
    """Why the FP8 kernel cannot take these inputs ([] = it can); reads metadata only."""
    try:
        from .kernels import fp8 as _kernel  # noqa: PLC0415

        reasons_of = _kernel.fp8_reasons
    except Exception as e:  # triton missing, or a broken install: say so instead of failing
        return [f"the FP8 kernel is not available ({type(e).__name__}: {str(e)[:120]})"]
    r = list(reasons_of(q, k, v, bias=bias, kv_lens=kv_lens, causal=causal, window_left=window_left,
                        window_right=window_right))
    # what the kernel computes on a row that a float bias absorbs entirely is not eager's (the bf16 op
    # then takes the call, and its dispatch the reference)
    return r + absorbing_bias_refusal(bias, "the FP8 kernel")


def _dequantized(t: Tensor, descale: Optional[Tensor]) -> Tensor:
    f = t.to(torch.float32)
    return f if descale is None else f * descale[:, :, None, None]


def _attention_fp8(q, k, v, scale, causal=False, diag_offset=0, window_left=-1, window_right=-1, bias=None,
                   kv_lens=None, q_descale=None, k_descale=None, v_descale=None, out_dtype=None):
    ops.check_scalars(scale, 0.0, 0.0, None, window_left, window_right)
    if ops._CP_HOOK is not None:  # (the ring runs fa3.attention; this op would attend to one shard)
        raise RuntimeError("fa3.attention_fp8: not supported under fa_compile.context_parallel; leave fp8 off there")
    out_dt = check_fp8_args(q, k, v, bias, kv_lens, q_descale, k_descale, v_descale, out_dtype)
    if not kernel_reasons(q, k, v, causal, window_left, window_right, bias, kv_lens):
        from .kernels import fp8 as _kernel  # noqa: PLC0415

        out, lse = _kernel.fp8_forward(q, k, v, scale, causal, diag_offset, window_left, window_right, bias, kv_lens,
                                       q_descale=q_descale, k_descale=k_descale, v_descale=v_descale,
                                       out_dtype=out_dt if is_fp8(q) else None)
    elif is_fp8(q):  # no kernel here: the exact attention of what the float8 tensors encode, in fp32
        out, lse = torch.ops.fa3.attention(_dequantized(q, q_descale), _dequantized(k, k_descale),
                                           _dequantized(v, v_descale), scale, causal, diag_offset, window_left,
                                           window_right, _fp32_bias(bias), kv_lens)
    else:  # no FP8 kernel for these inputs: the exact bf16 / fp16 attention
        out, lse = torch.ops.fa3.attention(q, k, v, scale, causal, diag_offset, window_left, window_right, bias,
                                           kv_lens)
    if out.dtype != out_dt or out.stride() != ops._bshd_strides(q, v):
        res = _out(q, v, out_dt)
        res.copy_(out)
        out = res
    if lse.dtype != torch.float32 or not lse.is_contiguous():
        lse = lse.to(torch.float32).contiguous()
    return out, lse


def _fp32_bias(bias: Optional[Tensor]) -> Optional[Tensor]:
    return bias if bias is None or bias.dtype == torch.bool else bias.to(torch.float32)


def _out(q: Tensor, v: Tensor, dtype: torch.dtype) -> Tensor:
    """[B, Hq, Nq, Dv] with BSHD storage, as the bf16 op returns it."""
    b, hq, nq, _ = q.shape
    return q.new_empty((b, nq, hq, v.shape[3]), dtype=dtype).transpose(1, 2)


def _attention_fp8_fake(q, k, v, scale, causal=False, diag_offset=0, window_left=-1, window_right=-1, bias=None,
                        kv_lens=None, q_descale=None, k_descale=None, v_descale=None, out_dtype=None):
    out_dt = check_fp8_args(q, k, v, bias, kv_lens, q_descale, k_descale, v_descale, out_dtype)
    b, hq, nq, _ = q.shape
    return _out(q, v, out_dt), q.new_empty((b, hq, nq), dtype=torch.float32)


_OP = None


def _attention_fp8_autograd(q, k, v, scale, causal=False, diag_offset=0, window_left=-1, window_right=-1, bias=None,
                            kv_lens=None, q_descale=None, k_descale=None, v_descale=None, out_dtype=None):
    """No backward in FP8: a clear error instead of autograd's silent "no gradient" (or a wrong one)."""
    if torch.is_grad_enabled():
        for name, t in (("q", q), ("k", k), ("v", v), ("bias", bias)):
            if t is not None and t.requires_grad:
                raise RuntimeError(f"{name}: fa3.attention_fp8 has no backward (FP8 attention is inference only); "
                                   f"call it under torch.no_grad(), or use the bf16 op for training")
    with torch._C._AutoDispatchBelowAutograd():
        return torch.ops.fa3.attention_fp8.default(q, k, v, scale, causal, diag_offset, window_left, window_right,
                                                   bias, kv_lens, q_descale, k_descale, v_descale, out_dtype)


_LIB.impl("attention_fp8", _attention_fp8, "CompositeExplicitAutograd")
_LIB.impl("attention_fp8", _attention_fp8_autograd, "Autograd")
torch.library.register_fake("fa3::attention_fp8", _attention_fp8_fake, lib=_LIB)


# ------------------------------------------------------------------------------ sites at compile time
def site_refusal(node: Any) -> Optional[str]:
    """Why the emitted fa3.attention `node` does not get FP8 (None: it does)."""
    from .dispatch import forced_kernel
    from .report import _args_of_call

    a = _args_of_call(node)
    if a is None:
        return "not an fa3.attention call"
    forced = node.args[13] if len(node.args) > 13 else node.kwargs.get("force_kernel")
    if forced_kernel(forced) is not None:
        return f"a kernel is forced ({forced_kernel(forced)!r})"
    if a.needs_backward:
        return "gradients are needed: FP8 has no backward, so the forward stays in bf16 for an exact bf16 backward"
    if a.q.dtype not in IN_DTYPES:
        return f"dtype {str(a.q.dtype).replace('torch.', '')}: FP8 quantizes bfloat16 or float16 inputs"
    for what, present in (("softcap", a.softcap != 0), ("dropout", a.dropout_p > 0), ("sinks", a.sinks is not None),
                          ("run-time query positions", a.q_pos is not None),
                          ("segment ids", a.q_seg is not None or a.k_seg is not None)):
        if present:
            return f"{what}: not in the FP8 kernel"
    reasons = kernel_reasons(a.q, a.k, a.v, a.causal, a.window_left, a.window_right, a.bias, a.kv_lens)
    return "; ".join(reasons) if reasons else None


def convert_sites(gm: Any, reports: list) -> None:
    """Replace each eligible fa3.attention call of `gm` by fa3.attention_fp8 (same arguments, same
    outputs) and record the outcome in its report's `fp8` ("used", or "not used: why")."""
    target = torch.ops.fa3.attention.default
    changed = False
    for r in reports:
        node = getattr(r, "call", None)
        if not r.rewritten or node is None or node.target is not target:
            continue
        why = site_refusal(node)
        if why is not None:
            r.fp8 = f"not used: {why}"
            continue
        with node.graph.inserting_before(node):
            new = node.graph.call_function(torch.ops.fa3.attention_fp8.default, tuple(node.args[:10]))
        new.meta.update(node.meta)
        node.replace_all_uses_with(new)
        node.graph.erase_node(node)
        r.call = new
        r.fp8 = "used"
        changed = True
    if changed:
        gm.graph.lint()
        gm.recompile()
