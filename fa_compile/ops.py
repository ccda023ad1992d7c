"""The op family `torch.ops.fa3`: schema, argument checks, fake (meta) implementations, autograd.

`fa3::attention(q, k, v, scale, causal, diag_offset, window_left, window_right, bias, kv_lens,
softcap, dropout_p, dropout_seed, force_kernel, sinks, q_pos, q_seg, k_seg) -> (out, lse)`

- q [B, Hq, Nq, D], k [B, Hkv, Nk, D], v [B, Hkv, Nk, Dv] by shape; any strides, so a BSHD tensor
  is passed as its `.transpose(1, 2)` view, never copied. Hq % Hkv == 0 (GQA / MQA, K/V not repeated).
- causal with `diag_offset`: key j is admissible for query i iff j - i <= diag_offset. 0 is SDPA's
  top-left alignment, Nk - Nq the bottom-right one of a KV cache; the window bounds are measured
  from the same diagonal (-1: unbounded).
- bias: an additive float tensor or a boolean mask (True = attend) that broadcasts to [B, Hq, Nq, Nk];
  kv_lens: int [B], keys at j >= kv_lens[b] are masked (key padding), so values are in effect
  clamped to [0, Nk]; not checked against those bounds (reading them costs a device sync per call).
  Keys and values there are never read: a cache's unused slots may hold anything, NaN included, and
  their gradients are 0 (dispatch zeroes them for a kernel that would multiply them by 0, `_within_kv_lens`).
- zero-size dimensions (B, H, Nq, Nk, D or Dv = 0) are exact, as in eager (no keys: out 0, lse -inf;
  head dim 0: scores 0 + bias); dispatch sends them to the reference before any kernel is asked.
- softcap > 0: s = softcap * tanh(s / softcap) before bias and masks.
- dropout_p with dropout_seed (an int64 scalar tensor on q's device, drawn from torch's generator).
- force_kernel: run this kernel by name (None: dispatch chooses). Not `kernel`: Inductor's
  fallback-kernel constructor takes an argument of that name.
- sinks: float [Hq] (GPT-OSS's learned per-head sink logit, any float dtype, q's device), or None. A
  sink joins each row's softmax denominator only: out_i = sum_j exp(s_ij - m) v_j / (exp(sink_h - m) +
  sum_j exp(s_ij - m)), and lse includes it, so lse_i = logaddexp(sink_h, logsumexp_j s_ij). A row with
  no admissible key attends to the sink alone: out 0 and lse = sink_h (not -inf). Last in the schema,
  so graphs and calls written before it keep their meaning. Its gradient is
  d sink_h = -sum_{b,i} exp(sink_h - lse_i) * rowsum(dO_i * O_i) (plus sum dlse_i * exp(sink_h - lse_i)),
  computed by the autograd formula from (dout, out, lse): the backward kernels need no sink, since P_ij =
  exp(s_ij - lse_i) with that lse is already the probability with the sink in the denominator.
- q_pos: int32 / int64 [Nq] or [B, Nq] (a leading 1 broadcasts over the batch), or None: query i of
  batch b admits key j only if j <= q_pos[b, i] (causality with positions known at run time only, e.g.
  a static KV cache's `cache_position`). Values >= Nk admit every key, negative ones none (an empty row).
- q_seg, k_seg: int32 / int64 [B, Nq] / [B, Nk] (or [Nq] / [Nk], or a leading 1: broadcast over the
  batch), given together or not at all: key j is admitted for query i only if q_seg[b, i] == k_seg[b, j]
  (packed variable-length batches, document masks). Any values: ids need not be sorted or contiguous.
  Both kinds are ANDed with every other mask argument, carry no gradient, and are last in the schema.
- out: [B, Hq, Nq, Dv] in q's dtype, stored BSHD (a `.transpose(1, 2)` view of a contiguous
  [B, Nq, Hq, Dv] buffer) so the usual `transpose(1, 2).reshape(B, N, H * Dv)` that follows is free;
  lse: [B, Hq, Nq] fp32, natural log, -inf on a row with no admissible key (whose out is 0).

`fa3::attention_backward` is the gradient; any kernel's backward can follow any kernel's forward
because the log-sum-exp is the only state they share (dropout excepted, whose mask is defined by
`fa_compile/kernels/dropout_hash.py` for every kernel).

`fa3::uniform_row_grad` and `fa3::filled_scores_grad` (row_fixups.py) are 0 with the gradient eager
gives q and k from rows that an additive finfo.min mask masked entirely (patterns/emit.py).
`fa3::key_limit` (key_limit_op.py) reads a decode step's key limit from its data mask (patterns/key_limit.py).
"""
from __future__ import annotations

import math
import weakref
from typing import Optional, Sequence

import torch
import torch.autograd.forward_ad as _fwad
from torch import Tensor

from . import dispatch, forward_ad
from .kernels import reference as _ref

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# Set by fa_compile.distributed.context while context parallelism is active: the kernel entry points
# below then run ring attention over the sequence shards (eager calls and compiled graphs alike).
_CP_HOOK = None
# lse storages produced by ring attention, by data pointer: their backward must ring too, so outside the
# context attention_backward refuses them instead of computing a local-shard gradient.
_RING_LSE: "weakref.WeakValueDictionary" = weakref.WeakValueDictionary()


def check_args(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    scale: float,
    bias: Optional[Tensor],
    kv_lens: Optional[Tensor],
    softcap: float,
    dropout_p: float,
    dropout_seed: Optional[Tensor],
    window_left: int = -1,
    window_right: int = -1,
    sinks: Optional[Tensor] = None,
    q_pos: Optional[Tensor] = None,
    q_seg: Optional[Tensor] = None,
    k_seg: Optional[Tensor] = None,
    diag_offset: int = 0,
) -> None:
    """Raise a ValueError naming the offending argument; works on fake and symbolic shapes."""
    check_tensors(q, k, v, bias, kv_lens, dropout_seed, sinks, q_pos, q_seg, k_seg)
    check_scalars(scale, softcap, dropout_p, dropout_seed, window_left, window_right, diag_offset)


_OFFSET_LIMIT = 2**62  # offsets and windows past any length act alike; beyond this j - i - offset would overflow int64


def check_scalars(
    scale: float, softcap: float, dropout_p: float, dropout_seed: Optional[Tensor], window_left: int, window_right: int,
    diag_offset: int = 0,
) -> None:
    """The scalar arguments' checks: cheap, so run on every call (a learned temperature changes the
    scale every step)."""
    for name, x in (("diag_offset", diag_offset), ("window_left", window_left), ("window_right", window_right)):
        if isinstance(x, int) and not -_OFFSET_LIMIT <= x <= _OFFSET_LIMIT:
            raise ValueError(f"{name}: must lie in [-2**62, 2**62] (any offset past the sequence lengths acts alike), "
                             f"got {x}")
    if not math.isfinite(scale):
        raise ValueError(f"scale: must be finite, got {scale}")
    if softcap < 0 or not math.isfinite(softcap):
        raise ValueError(f"softcap: must be >= 0 and finite, got {softcap}")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p: must be in [0, 1), got {dropout_p}")
    if dropout_p > 0 and dropout_seed is None:
        raise ValueError("dropout_seed: required when dropout_p > 0")
    if window_left < -1 or window_right < -1:
        raise ValueError(f"window_left, window_right: must be >= 0, or -1 for unbounded; got {window_left}, {window_right}")


def _differ(a, b) -> bool:
    """Whether two sizes differ, for the checks: a size read at run time (an unbacked symbol, `.item()`) that is not
    known to differ passes (guarding on it would fail the compile), as a backed one is guarded."""
    from torch.fx.experimental.symbolic_shapes import guard_or_false

    return bool(guard_or_false(a != b))


def check_tensors(
    q: Tensor, k: Tensor, v: Tensor, bias: Optional[Tensor], kv_lens: Optional[Tensor],
    dropout_seed: Optional[Tensor] = None, sinks: Optional[Tensor] = None, q_pos: Optional[Tensor] = None,
    q_seg: Optional[Tensor] = None, k_seg: Optional[Tensor] = None,
) -> None:
    """The tensor arguments' checks: they read metadata only, so dispatch memoises them with the
    kernel choice (a memo hit means equal metadata passed them before)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name}: expected a Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name}: expected 4 dims [batch, heads, seq, head_dim], got shape {tuple(t.shape)}")
        if t.dtype not in _FLOAT_DTYPES:
            fp8 = " or float8_e4m3fn (FP8, with descales; no other float8 format)" if t.dtype.itemsize == 1 and \
                t.dtype.is_floating_point else ""
            raise ValueError(f"{name}: dtype {t.dtype} is not a floating type (float16, bfloat16, float32, float64)"
                             f"{fp8}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"k, v: dtypes must match q ({q.dtype}); got k {k.dtype}, v {v.dtype}")
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"k, v: must be on q's device {q.device}; got k on {k.device}, v on {v.device}")
    if _differ(k.shape[0], q.shape[0]) or _differ(v.shape[0], q.shape[0]):
        raise ValueError(f"k, v: batch sizes {k.shape[0]}, {v.shape[0]} do not match q's {q.shape[0]}")
    if _differ(v.shape[1], k.shape[1]):
        raise ValueError(f"v: {v.shape[1]} heads, but k has {k.shape[1]}")
    if _differ(v.shape[2], k.shape[2]):
        raise ValueError(f"v: sequence length {v.shape[2]} differs from k's {k.shape[2]}")
    if _differ(k.shape[3], q.shape[3]):
        raise ValueError(f"k: head dim {k.shape[3]} differs from q's {q.shape[3]}")
    if (q.shape[1] % k.shape[1] != 0) if k.shape[1] != 0 else q.shape[1] != 0:
        raise ValueError(f"k: q's {q.shape[1]} heads are not a multiple of k's {k.shape[1]} (GQA needs Hq % Hkv == 0)")
    if bias is not None:
        if bias.dtype != torch.bool and bias.dtype not in _FLOAT_DTYPES:
            raise ValueError(f"bias: dtype {bias.dtype} must be bool (True = attend) or floating (additive)")
        if bias.device != q.device:
            raise ValueError(f"bias: must be on q's device {q.device}, got {bias.device}")
        if bias.dim() > 4:
            raise ValueError(f"bias: at most 4 dims, got shape {tuple(bias.shape)}")
        target = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
        shape = (1,) * (4 - bias.dim()) + tuple(bias.shape)
        for axis, (have, want) in enumerate(zip(shape, target)):
            if _differ(have, 1) and _differ(have, want):
                raise ValueError(f"bias: shape {tuple(bias.shape)} does not broadcast to [B, Hq, Nq, Nk] = {target}")
    if kv_lens is not None:
        if kv_lens.dim() != 1 or _differ(kv_lens.shape[0], q.shape[0]):
            raise ValueError(f"kv_lens: expected shape [batch] = [{q.shape[0]}], got {tuple(kv_lens.shape)}")
        if kv_lens.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"kv_lens: dtype must be int32 or int64, got {kv_lens.dtype}")
        if kv_lens.device != q.device:
            raise ValueError(f"kv_lens: must be on q's device {q.device}, got {kv_lens.device}")
    if dropout_seed is not None:
        if not isinstance(dropout_seed, Tensor):
            raise TypeError(f"dropout_seed: expected an int64 scalar Tensor, got {type(dropout_seed).__name__}")
        if dropout_seed.dtype != torch.int64 or dropout_seed.numel() != 1:
            raise ValueError(f"dropout_seed: expected an int64 tensor of one element, got {dropout_seed.dtype} "
                             f"of shape {tuple(dropout_seed.shape)}")
        if dropout_seed.device != q.device:
            raise ValueError(f"dropout_seed: must be on q's device {q.device}, got {dropout_seed.device}")
    if sinks is not None:
        check_sinks(sinks, q)
    if q_pos is not None or q_seg is not None or k_seg is not None:
        check_positions_segments(q, k, q_pos, q_seg, k_seg)


def _check_index_vector(name: str, t, q: Tensor, n, what: str) -> None:
    """An int32 / int64 index tensor of shape [n] or [B|1, n] on q's device."""
    if not isinstance(t, Tensor):
        raise TypeError(f"{name}: expected an int32 / int64 Tensor or None, got {type(t).__name__}")
    if t.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name}: dtype must be int32 or int64, got {t.dtype}")
    if t.device != q.device:
        raise ValueError(f"{name}: must be on q's device {q.device}, got {t.device}")
    b = q.shape[0]
    ok = (t.dim() == 1 and t.shape[0] == n) or (t.dim() == 2 and t.shape[1] == n and t.shape[0] in (1, b))
    if not ok:
        raise ValueError(f"{name}: expected shape [{what}] = [{n}] or [batch, {what}] = [{b}, {n}], "
                         f"got {tuple(t.shape)}")


def check_positions_segments(q: Tensor, k: Tensor, q_pos: Optional[Tensor], q_seg: Optional[Tensor],
                             k_seg: Optional[Tensor]) -> None:
    """q_pos [Nq] / [B, Nq]; q_seg [Nq] / [B, Nq] with k_seg [Nk] / [B, Nk], both or neither."""
    if q_pos is not None:
        _check_index_vector("q_pos", q_pos, q, q.shape[2], "Nq")
    if (q_seg is None) != (k_seg is None):
        given, missing = ("q_seg", "k_seg") if k_seg is None else ("k_seg", "q_seg")
        raise ValueError(f"{missing}: required when {given} is given (segment ids come in pairs: key j is admitted "
                         f"for query i only if q_seg[b, i] == k_seg[b, j])")
    if q_seg is not None:
        _check_index_vector("q_seg", q_seg, q, q.shape[2], "Nq")
        _check_index_vector("k_seg", k_seg, q, k.shape[2], "Nk")


def check_sinks(sinks: Tensor, q: Tensor) -> None:
    """sinks: one float logit per query head, [Hq], on q's device."""
    if not isinstance(sinks, Tensor):
        raise TypeError(f"sinks: expected a Tensor of shape [Hq] or None, got {type(sinks).__name__}")
    if sinks.dim() != 1 or sinks.shape[0] != q.shape[1]:
        raise ValueError(f"sinks: expected shape [Hq] = [{q.shape[1]}] (one logit per query head), "
                         f"got {tuple(sinks.shape)}")
    if sinks.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"sinks: dtype {sinks.dtype} is not a floating type (float16, bfloat16, float32, float64)")
    if sinks.device != q.device:
        raise ValueError(f"sinks: must be on q's device {q.device}, got {sinks.device}")


def _bshd_strides(q: Tensor, v: Tensor) -> tuple[int, ...]:
    hq, nq, dv = q.shape[1], q.shape[2], v.shape[3]
    return (nq * hq * dv, dv, hq * dv, 1)


def _out_like(q: Tensor, v: Tensor) -> Tensor:
    b, hq, nq, _ = q.shape
    return q.new_empty((b, nq, hq, v.shape[3])).transpose(1, 2)


# Registered through torch.library.Library rather than torch.library.custom_op: the op runs once per
# attention per step, and custom_op's generic wrappers (autograd indirection, redispatch, alias
# checks, dynamo-disable) cost more host time than a whole small attention kernel. Same schema.
_LIB = torch.library.Library("fa3", "DEF")
_TAGS = (torch.Tag.pt2_compliant_tag,)
_LIB.define(
    "attention(Tensor q, Tensor k, Tensor v, float scale, bool causal=False, SymInt diag_offset=0, "
    "SymInt window_left=-1, SymInt window_right=-1, Tensor? bias=None, Tensor? kv_lens=None, "
    "float softcap=0., float dropout_p=0., Tensor? dropout_seed=None, str? force_kernel=None, Tensor? sinks=None, "
    "Tensor? q_pos=None, Tensor? q_seg=None, Tensor? k_seg=None) -> (Tensor, Tensor)",
    tags=_TAGS,
)
_LIB.define(
    "attention_backward(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, float scale, "
    "bool causal=False, SymInt diag_offset=0, SymInt window_left=-1, SymInt window_right=-1, Tensor? bias=None, "
    "Tensor? kv_lens=None, float softcap=0., float dropout_p=0., Tensor? dropout_seed=None, "
    "bool bias_requires_grad=False, str? force_kernel=None, Tensor? sinks=None, Tensor? q_pos=None, "
    "Tensor? q_seg=None, Tensor? k_seg=None) -> (Tensor, Tensor, Tensor, Tensor)",
    tags=_TAGS,
)


def _validate(a: dispatch.AttentionArgs) -> None:
    check_tensors(a.q, a.k, a.v, a.bias, a.kv_lens, a.dropout_seed, a.sinks, a.q_pos, a.q_seg, a.k_seg)


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    scale: float,
    causal: bool = False,
    diag_offset: int = 0,
    window_left: int = -1,
    window_right: int = -1,
    bias: Optional[Tensor] = None,
    kv_lens: Optional[Tensor] = None,
    softcap: float = 0.0,
    dropout_p: float = 0.0,
    dropout_seed: Optional[Tensor] = None,
    force_kernel: Optional[str] = None,
    sinks: Optional[Tensor] = None,
    q_pos: Optional[Tensor] = None,
    q_seg: Optional[Tensor] = None,
    k_seg: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor]:
    """The kernel behind `torch.ops.fa3.attention` on real tensors: checks (memoised with the choice
    of kernel on the inputs' metadata and scalars), dispatch, and the output conventions."""
    check_scalars(scale, softcap, dropout_p, dropout_seed, window_left, window_right, diag_offset)
    if _CP_HOOK is not None:  # inside fa_compile.context_parallel: ring attention (distributed/ring.py)
        return _CP_HOOK.forward(q, k, v, scale, causal, diag_offset, window_left, window_right, bias, kv_lens,
                                softcap, dropout_p, dropout_seed, force_kernel, sinks, q_pos, q_seg, k_seg)
    if kv_lens is not None and not kv_lens.is_contiguous():
        kv_lens = kv_lens.contiguous()  # kernels index it by batch (an expanded [1] length, say)
    args = dispatch.AttentionArgs(q, k, v, scale, causal, diag_offset, window_left, window_right, bias, kv_lens,
                                  softcap, dropout_p, dropout_seed, sinks=sinks, q_pos=q_pos, q_seg=q_seg,
                                  k_seg=k_seg)
    out, lse = dispatch.select_forward(args, force_kernel, _validate).forward(args)
    # Callers (and the fake implementation) rely on out's documented BSHD storage: copy only a kernel
    # result stored otherwise. Kernel outputs never alias inputs, so returning them is safe.
    if out.dtype != q.dtype or out.stride() != _bshd_strides(q, v):
        res = _out_like(q, v)
        res.copy_(out)
        out = res
    if lse.dtype != torch.float32 or not lse.is_contiguous():
        lse = lse.to(torch.float32).contiguous()
    return out, lse


def _attention_fake(
    q, k, v, scale, causal=False, diag_offset=0, window_left=-1, window_right=-1, bias=None, kv_lens=None,
    softcap=0.0, dropout_p=0.0, dropout_seed=None, force_kernel=None, sinks=None, q_pos=None, q_seg=None, k_seg=None,
):
    check_args(q, k, v, scale, bias, kv_lens, softcap, dropout_p, dropout_seed, window_left, window_right, sinks,
               q_pos, q_seg, k_seg, diag_offset)
    b, hq, nq, _ = q.shape
    return _out_like(q, v), q.new_empty((b, hq, nq), dtype=torch.float32)


def attention_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    scale: float,
    causal: bool = False,
    diag_offset: int = 0,
    window_left: int = -1,
    window_right: int = -1,
    bias: Optional[Tensor] = None,
    kv_lens: Optional[Tensor] = None,
    softcap: float = 0.0,
    dropout_p: float = 0.0,
    dropout_seed: Optional[Tensor] = None,
    bias_requires_grad: bool = False,
    force_kernel: Optional[str] = None,
    sinks: Optional[Tensor] = None,
    q_pos: Optional[Tensor] = None,
    q_seg: Optional[Tensor] = None,
    k_seg: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dq, dk, dv, dbias); dbias is an empty tensor unless bias_requires_grad. The sinks' own gradient
    is not among them (see the module docstring): `sinks` is here for kernels that recompute P."""
    if _RING_LSE and _CP_HOOK is None and _RING_LSE.get(lse.data_ptr()) is lse.untyped_storage():
        raise RuntimeError("lse: this is the backward of a ring-attention forward (fa_compile.context_parallel), "
                           "run outside the context, where it would see only this rank's shards; call backward "
                           "inside the context")
    if _CP_HOOK is not None:
        return _CP_HOOK.backward(dout, q, k, v, out, lse, scale, causal, diag_offset, window_left, window_right, bias,
                                 kv_lens, softcap, dropout_p, dropout_seed, bias_requires_grad, force_kernel, sinks,
                                 q_pos, q_seg, k_seg)
    if kv_lens is not None and not kv_lens.is_contiguous():
        kv_lens = kv_lens.contiguous()
    args = dispatch.AttentionArgs(q, k, v, scale, causal, diag_offset, window_left, window_right, bias, kv_lens,
                                  softcap, dropout_p, dropout_seed, True, bias_requires_grad, sinks, q_pos, q_seg, k_seg)
    dq, dk, dv, dbias = dispatch.select_backward(args, force_kernel).backward(args, dout, out, lse)
    outs = []
    for got, like in ((dq, q), (dk, k), (dv, v)):
        if got.dtype != like.dtype or got is like or got.stride() != _dense_strides(like):
            res = torch.empty_like(like)
            res.copy_(got)
            got = res
        outs.append(got)
    if bias_requires_grad and bias is not None:
        db = bias.new_empty(bias.shape)
        db.copy_(dbias)
    else:
        db = q.new_empty((0,))
    return outs[0], outs[1], outs[2], db


def _dense_strides(t: Tensor) -> tuple[int, ...]:
    """The strides torch.empty_like(t) gives (t's dimension order, made dense)."""
    if t.is_contiguous():
        return t.stride()
    return torch.empty_like(t, device="meta").stride()


def _attention_backward_fake(
    dout, q, k, v, out, lse, scale, causal=False, diag_offset=0, window_left=-1, window_right=-1, bias=None,
    kv_lens=None, softcap=0.0, dropout_p=0.0, dropout_seed=None, bias_requires_grad=False, force_kernel=None,
    sinks=None, q_pos=None, q_seg=None, k_seg=None,
):
    db = bias.new_empty(bias.shape) if (bias_requires_grad and bias is not None) else q.new_empty((0,))
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), db


_LIB.impl("attention", attention, "CompositeExplicitAutograd")
_LIB.impl("attention_backward", attention_backward, "CompositeExplicitAutograd")
torch.library.register_fake("fa3::attention", _attention_fake, lib=_LIB)
torch.library.register_fake("fa3::attention_backward", _attention_backward_fake, lib=_LIB)
_ATTENTION = torch.ops.fa3.attention.default
_ATTENTION_BACKWARD = torch.ops.fa3.attention_backward.default

_SCALARS = ("scale", "causal", "diag_offset", "window_left", "window_right", "softcap", "dropout_p", "kernel")


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _runs_directly(tensors: Sequence[Optional[Tensor]]) -> bool:
    """Real eager tensors, no dispatch mode or functorch transform: the kernel below autograd is
    exactly `attention`, so calling it skips a second trip through the dispatcher."""
    if torch._C._len_torch_dispatch_stack() or torch._C._functorch.peek_interpreter_stack() is not None:
        return False
    for t in tensors:
        if t is not None and (type(t) not in _PLAIN or t.is_meta):
            return False
    return True


class _AttentionFunction(torch.autograd.Function):
    """Autograd of fa3::attention: the forward saves (q, k, v, out, lse, ...); the backward is the
    fa3::attention_backward op, so AOTAutograd traces it into the compiled backward graph.

    lse is differentiable too (d lse_i / d s_ij = P_ij), through a second attention_backward call that
    runs only when lse's gradient is not None. It relies on what every backward kernel does (the
    reference included): delta = rowsum(dO * out) is read from the `out` it is given, not recomputed."""

    @staticmethod
    def forward(ctx, q, k, v, scale, causal, diag_offset, window_left, window_right, bias, kv_lens, softcap,
                dropout_p, dropout_seed, force_kernel, sinks=None, q_pos=None, q_seg=None, k_seg=None):
        if _runs_directly((q, k, v, bias, kv_lens, dropout_seed, sinks, q_pos, q_seg, k_seg)):
            out, lse = attention(q, k, v, scale, causal, diag_offset, window_left, window_right, bias, kv_lens,
                                 softcap, dropout_p, dropout_seed, force_kernel, sinks, q_pos, q_seg, k_seg)
        else:
            with torch._C._AutoDispatchBelowAutograd():
                out, lse = _ATTENTION(q, k, v, scale, causal, diag_offset, window_left, window_right, bias, kv_lens,
                                      softcap, dropout_p, dropout_seed, force_kernel, sinks, q_pos, q_seg, k_seg)
        ctx.save_for_backward(q, k, v, out, lse, bias, kv_lens, dropout_seed, sinks, q_pos, q_seg, k_seg)
        # lse is differentiable (a finite masked_fill's exact fix-up reads it, patterns/emit.py); grads
        # are not materialized, so a graph that never differentiates lse gets dlse=None and the
        # backward is exactly the one attention_backward call.
        ctx.set_materialize_grads(False)
        ctx.scalars = dict(zip(_SCALARS, (scale, causal, diag_offset, window_left, window_right, softcap, dropout_p,
                                          force_kernel)))
        ctx.bias_requires_grad = bias is not None and bias.requires_grad and bias.dtype != torch.bool
        return out, lse

    @staticmethod
    def backward(ctx, dout: Optional[Tensor], dlse: Optional[Tensor]):
        q, k, v, out, lse, bias, kv_lens, dropout_seed, sinks, q_pos, q_seg, k_seg = ctx.saved_tensors
        s = ctx.scalars

        def grads(d: Tensor, o: Tensor, vv: Tensor) -> tuple:
            return _ATTENTION_BACKWARD(
                d, q, k, vv, o, lse, s["scale"], s["causal"], s["diag_offset"], s["window_left"],
                s["window_right"], bias, kv_lens, s["softcap"], s["dropout_p"], dropout_seed, ctx.bias_requires_grad,
                s["kernel"], sinks, q_pos, q_seg, k_seg,
            )

        dq = dk = dv = db = None
        if dout is not None:
            dq, dk, dv, db = grads(dout, out, v)
        if dlse is not None:
            # d lse_i / d s_ij = P_ij, so dS gains dlse_i * P_ij. Every backward kernel computes
            # dS = P * (dO V^T - rowsum(dO * O)): with V' = 0, O' = e_0 and dO' = -dlse * e_0 that is
            # exactly dlse * P (dropout and softcap included), so any kernel's backward serves.
            # (no value dims: V' gets one, as e_0 needs a column)
            vz = torch.zeros_like(v) if v.shape[3] > 0 else v.new_zeros((*v.shape[:3], 1))
            d_out, o = _AttentionFunction._lse_grad_operands(q, vz, dlse, lse)
            gq, gk, _, gb = grads(d_out, o, vz)
            dq = gq if dq is None else dq + gq
            dk = gk if dk is None else dk + gk
            db = gb if db is None else db + gb
        db = db if ctx.bias_requires_grad else None
        dsinks = None
        if sinks is not None and ctx.needs_input_grad[14]:
            dsinks = _sink_grad(sinks, lse, dout, out, dlse)
        # (q_pos, q_seg, k_seg are integer structure: no gradient)
        return dq, dk, dv, None, None, None, None, None, db, None, None, None, None, None, dsinks, None, None, None

    @staticmethod
    def _lse_grad_operands(q: Tensor, v: Tensor, dlse: Tensor, lse: Tensor) -> tuple[Tensor, Tensor]:
        """(dO', O') in out's BSHD layout: dO'[..., 0] = -dlse and O'[..., 0] = 1, zero elsewhere, so that
        rowsum(dO' * O') = -dlse."""
        if type(lse) is not Tensor and hasattr(lse, "device_mesh"):  # a DTensor: built on the shards of lse
            from torch.distributed.tensor import DTensor  # (DTensor has no rule for the slice writes below)

            mesh, places = lse.device_mesh, lse.placements
            local = dlse.redistribute(mesh, places).to_local()
            b, hq, nq = local.shape
            d_out = local.new_zeros((b, nq, hq, v.shape[3]), dtype=q.dtype).transpose(1, 2)
            o = torch.zeros_like(d_out)
            d_out[..., 0] = -local.to(d_out.dtype)
            o[..., 0] = 1
            return tuple(DTensor.from_local(t, mesh, places, run_check=False, shape=(*lse.shape, v.shape[3]),
                                            stride=_bshd_strides(q, v)) for t in (d_out, o))
        d_out, o = _out_like(q, v).zero_(), _out_like(q, v).zero_()
        d_out[..., 0] = -dlse.to(d_out.dtype)
        o[..., 0] = 1
        return d_out, o


_REFERENCE_NAMES = ("q", "k", "v", "scale", "causal", "diag_offset", "window_left", "window_right", "bias", "kv_lens",
                    "softcap", "dropout_p", "dropout_seed", "sinks", "q_pos", "q_seg", "k_seg")


def _attention_autograd(
    q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool = False, diag_offset: int = 0, window_left: int = -1,
    window_right: int = -1, bias: Optional[Tensor] = None, kv_lens: Optional[Tensor] = None, softcap: float = 0.0,
    dropout_p: float = 0.0, dropout_seed: Optional[Tensor] = None, force_kernel: Optional[str] = None,
    sinks: Optional[Tensor] = None, q_pos: Optional[Tensor] = None, q_seg: Optional[Tensor] = None,
    k_seg: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor]:
    """The Autograd-key kernel: the autograd Function when a gradient is wanted, else the kernel; the reference
    math when an input carries a forward-AD tangent (forward_ad.py: kernels would drop it) or a torch.func
    transform is active (the Function has no functorch rule)."""
    in_functorch = torch._C._functorch.peek_interpreter_stack() is not None
    if _fwad._current_level >= 0 or in_functorch:
        tensors = (q, k, v, bias, kv_lens, dropout_seed, sinks, q_pos, q_seg, k_seg)
        # inside a torch.func transform (grad, vjp, jvp, vmap) too: the reference's torch ops have its rules
        if in_functorch or forward_ad.has_tangent(tensors):
            check_scalars(scale, softcap, dropout_p, dropout_seed, window_left, window_right, diag_offset)
            check_tensors(*tensors)
            return forward_ad.reference_attention(
                (q, k, v, scale, causal, diag_offset, window_left, window_right, bias, kv_lens, softcap, dropout_p,
                 dropout_seed, sinks, q_pos, q_seg, k_seg), _REFERENCE_NAMES)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad
                                    or (bias is not None and bias.requires_grad)
                                    or (sinks is not None and sinks.requires_grad)):
        return _AttentionFunction.apply(q, k, v, scale, causal, diag_offset, window_left, window_right, bias,
                                        kv_lens, softcap, dropout_p, dropout_seed, force_kernel, sinks, q_pos, q_seg,
                                        k_seg)
    if _runs_directly((q, k, v, bias, kv_lens, dropout_seed, sinks, q_pos, q_seg, k_seg)):
        return attention(q, k, v, scale, causal, diag_offset, window_left, window_right, bias, kv_lens, softcap,
                         dropout_p, dropout_seed, force_kernel, sinks, q_pos, q_seg, k_seg)
    with torch._C._AutoDispatchBelowAutograd():
        return _ATTENTION(q, k, v, scale, causal, diag_offset, window_left, window_right, bias, kv_lens, softcap,
                          dropout_p, dropout_seed, force_kernel, sinks, q_pos, q_seg, k_seg)


_LIB.impl("attention", _attention_autograd, "Autograd")


def _autocast_kernel(device_type: str, key: str):
    """fa3::attention inside an enabled autocast region: q, k and v in the region's dtype, as autocast gives SDPA
    and the matmuls of eager attention code (a rotary step in fp32 beside a bf16 V would otherwise fail the dtype
    check). fp64 tensors stay fp64 (autocast leaves them too). The bias keeps its dtype: the op adds it in fp32,
    and a float32 finfo.min mask cast to bf16 or fp16 would become -inf."""
    keys = torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, key))

    def kernel(q: Tensor, k: Tensor, v: Tensor, *args, **kwargs):
        dt = torch.get_autocast_dtype(device_type)
        q, k, v = (t.to(dt) if t.is_floating_point() and t.dtype != torch.float64 and t.device.type == device_type
                   else t for t in (q, k, v))
        with torch._C._ExcludeDispatchKeyGuard(keys):
            return _ATTENTION(q, k, v, *args, **kwargs)

    return kernel


_LIB.impl("attention", _autocast_kernel("cpu", "AutocastCPU"), "AutocastCPU")
_LIB.impl("attention", _autocast_kernel("cuda", "AutocastCUDA"), "AutocastCUDA")


class _AttentionBackwardFunction(torch.autograd.Function):
    """fa3::attention_backward under grad mode (create_graph=True): a clear error if anything
    differentiates through it, instead of autograd's fallback, which would give wrong numbers."""

    @staticmethod
    def forward(ctx, *args):
        with torch._C._AutoDispatchBelowAutograd():
            return _ATTENTION_BACKWARD(*args)

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError("fa3::attention_backward: double backward (a gradient of an attention gradient) is not "
                           "supported; compute it with the unfused attention, e.g. under fa_compile disabled (FA_COMPILE=0)")


def _attention_backward_autograd(*args) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    if _fwad._current_level >= 0 and forward_ad.has_tangent(args):  # its kernels would drop the tangents
        raise RuntimeError("fa3::attention_backward: forward-mode AD through an attention gradient is not supported; "
                           "compute it with the unfused attention, e.g. under fa_compile disabled (FA_COMPILE=0)")
    if torch.is_grad_enabled() and any(isinstance(a, Tensor) and a.requires_grad for a in args):
        return _AttentionBackwardFunction.apply(*args)
    if _runs_directly([a for a in args if isinstance(a, Tensor)]):
        return attention_backward(*args)
    with torch._C._AutoDispatchBelowAutograd():
        return _ATTENTION_BACKWARD(*args)


_LIB.impl("attention_backward", _attention_backward_autograd, "Autograd")

def _sink_grad(sinks: Tensor, lse: Tensor, dout: Optional[Tensor], out: Tensor, dlse: Optional[Tensor]) -> Tensor:
    """d sinks: one fused Triton reduction for real CUDA tensors run eagerly; the reference's torch ops
    otherwise (CPU, fp64, and traced graphs, where Inductor fuses them)."""
    eager_cuda = (out.is_cuda and dout is not None and out.dtype in (torch.float16, torch.bfloat16, torch.float32)
                  and torch._C._len_torch_dispatch_stack() == 0 and not torch.compiler.is_compiling()
                  and not any(torch._subclasses.fake_tensor.is_fake(t) for t in (out, dout, lse)))
    if eager_cuda:
        from .kernels import triton_family

        if triton_family.triton_available() and not triton_family.device_reasons(out.device):
            from .kernels.sink_grad import sink_grad

            return sink_grad(sinks, lse, dout, out, dlse)
    return _ref.sink_grad_reference(sinks, lse, dout, out, dlse)


# The zero-valued ops that carry eager's gradient on fully masked rows (fa3::uniform_row_grad,
# fa3::filled_scores_grad) live in row_fixups.py; importing it registers them on this library.
from . import row_fixups  # noqa: E402,F401
# fa3::dropped_uniform_rows, eager's value and gradients on such rows under dropout.
from . import dropped_rows  # noqa: E402,F401
# fa3::cpu_flash_forward, which lowered CPU graphs call (also where Inductor's cached code runs in a process
# that has lowered nothing).
from . import cpu_flash_op  # noqa: E402,F401
# fa3::key_limit, a decode step's key limit read from its data mask (patterns/key_limit.py).
from . import key_limit_op  # noqa: E402,F401
