"""The Triton family's pointer kernels as `torch.library.triton_op` custom ops (namespace `fa3_triton`).

`fa3_triton.fwd` runs triton_fwd.attn_fwd_kernel, `fa3_triton.bwd` the three backward kernels of
triton_bwd.py (delta, dK/dV, dQ; USE_TMA off), each launched through `torch.library.wrap_triton`.
A body is straight-line: it allocates its outputs with torch ops and launches with the tile given as
an argument (the lowering picks it at compile time, `triton_family.pick_config`); strides,
constexprs (IS_CAUSAL, BIAS_KIND, PLAIN, ...) and folded scalars are read off the tensors and
arguments in the body. Traced by AOTAutograd (or by the lowering's functionalized trace) a body runs
once: the graph keeps `triton_kernel_wrapper_functional` nodes whose strides, constexprs and grid
are constants, which Inductor reinplaces and launches with its own launcher (and CUDA graphs
capture). Called eagerly, the body runs per call. Conventions are the family's: out [B, Hq, Nq, Dv]
stored BSHD, lse [B, Hq, Nq] fp32, -inf lse and zero out on rows without an admissible key.

What `wrap_triton` / the HOP take (torch 2.13 here, torch 2.11 read from source, the same):
- a `triton.jit` JITFunction: yes. `triton.autotune` Autotuner: yes, configs / key / restore_value /
  reset_to_zero only (no pre/post hooks, warmup or rep). num_warps / num_stages given at launch become
  a one-config autotuner. Grids must be tuples (or a callable returning one) of at most rank 3.
- host-side TensorDescriptor (triton.tools.tensor_descriptor) arguments: not through wrap_triton.
  Its tracing path (TracingTritonHOPifier.call_HOP) always passes `tma_descriptor_metadata={}`
  ("TMA descriptor capturing not yet supported in non-dynamo tracing"), so a descriptor is not a
  graph input but a constant in the kernel side table, holding the trace-time (fake) tensor. The
  HOP, its functionalization and Inductor do take descriptors as tensors plus
  `("stable", (block_shape,))` metadata rebuilt with `TensorDescriptor.from_tensor` at launch
  (what Dynamo emits for a kernel called in user code), so a descriptor kernel would need the HOP
  built by hand, not wrap_triton: triton_fwd_tma and the USE_TMA backward are not lowered here.
- Gluon (`triton.experimental.gluon.jit`, a GluonJITFunction, subclass of JITFunction): no. wrap_triton
  accepts the object, but Inductor re-emits a user kernel's source under `@triton.jit`
  (codegen/wrapper.py define_user_defined_triton_kernel) and compiles it as Triton, and its
  descriptors are Gluon TensorDescriptors with a shared-memory layout, which the stable metadata
  (plain TensorDescriptor.from_tensor) cannot express. gluon_fwd / gluon_bwd stay run-time launches.
- under TRITON_INTERPRET=1 `triton.jit` gives an InterpretedFunction, which wrap_triton returns
  unwrapped (2.13) or refuses (2.11), so a trace would run the interpreter on fake tensors. Here the
  interpreter's kernels are traced through a JITFunction view whose launch is the interpreter's
  (`_InterpretedJit`), so CPU tests exercise the same graphs (Triton's mutation analysis needs a GPU
  driver there and falls back to "every tensor argument is written", which only adds clones).
"""
from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Optional

import torch
from torch import Tensor

from . import triton_family as tf
from .dropout_hash import keep_threshold

NAMESPACE = "fa3_triton"
# What the forward ops write on a row that admits no key (the op's own value is 0), their `empty_fill`
# (fa3_triton::fwd here, fa3_decode::fwd): see fa_compile/lowering/empty_rows.py.
EMPTY_FILLS = {"zero": 0, "nan": 1, "mean_v": 2}
# What fa3_triton::bwd also computes of that fix-up's backward, its `empty_grad` (0: nothing, dout is the op's
# own gradient): see fa_compile/lowering/empty_rows_backward.py and fa_compile/kernels/triton_empty_rows_bwd.py.
EMPTY_GRADS = {"none": 1, "mean_v": 2, "uniform": 3}
_PRE_BLOCK_M_GPU = 64  # delta preprocess rows per program (the family's)


def _empty(shape, stride, dtype: torch.dtype, device: torch.device) -> Tensor:
    """Output allocation (tests replace it by a NaN fill to see that every element is written)."""
    return torch.empty_strided(shape, stride, dtype=dtype, device=device)


@functools.lru_cache(maxsize=None)
def _interpreted_view(kernel):
    from triton.runtime.jit import JITFunction

    class _InterpretedJit(JITFunction):
        """A JITFunction for the tracer (parameters, constexprs) that launches with the interpreter."""

        def __getitem__(self, grid):
            return kernel[grid]

        @property
        def cache_key(self) -> str:  # Triton's key hashes the helpers, InterpretedFunctions here
            return f"interpreted:{kernel.fn.__module__}.{kernel.fn.__qualname__}"

    return _InterpretedJit(kernel.fn)


def _launcher(kernel):
    """`wrap_triton(kernel)`: traced into the HOP under tracing, a plain launch when called eagerly."""
    from torch._library.triton import is_wrap_triton_enabled

    if not tf.interpreting():
        return torch.library.wrap_triton(kernel)
    if not is_wrap_triton_enabled():  # the op's eager body on real tensors
        return kernel
    from torch._higher_order_ops.triton_kernel_wrap import TraceableTritonKernelWrapper

    return TraceableTritonKernelWrapper(_interpreted_view(kernel), None, None)


def _bias_arg(bias: Optional[Tensor], b: int, hq: int, nq: int, nk: int) -> tuple:
    """triton_family._bias4's (tensor, kind, broadcast strides), the tensor being the 4-D view before the
    expand (the strides say how it broadcasts). Where Triton's mutation analysis fails (no GPU driver)
    every argument counts as written, and functionalization would write an expanded one back through a
    broadcast sum (-inf - -inf = NaN in the caller's bias). A bool mask is converted to uint8, not
    viewed as it: Inductor cannot lower a dtype view of a bool buffer it computes (a mask built in the
    graph), and the copy is at the mask's own size, fused into the ops that build it."""
    if bias is None:
        return None, 0, (0, 0, 0, 0)
    t = bias.reshape((1,) * (4 - bias.dim()) + tuple(bias.shape)) if bias.dim() < 4 else bias
    is_bool = t.dtype == torch.bool
    if is_bool:
        t = t.to(torch.uint8)
    _, kind, strides = tf._bias4(t, b, hq, nq, nk)
    return t, kind + 1 if is_bool else kind, strides  # _bias4's uint8 kinds 1/3 are the bool kinds 2/4


def _tile_kwargs(cfg: list[int]) -> dict:
    kw = dict(BLOCK_M=int(cfg[0]), BLOCK_N=int(cfg[1]))
    if not tf.interpreting():
        kw.update(num_warps=int(cfg[2]), num_stages=int(cfg[3]))
    return kw


def check_config(name: str, cfg: list[int]) -> None:
    if len(cfg) != 4 or any(int(x) <= 0 for x in cfg):
        raise ValueError(f"{name}: expected [block_m, block_n, num_warps, num_stages] of positive ints, got {cfg}")


def _consts(bias_kind: int, causal: bool, window_left: int, window_right: int, kv_lens, softcap: float,
            dropout_p: float, scale: float) -> dict:
    return dict(
        IS_CAUSAL=bool(causal), HAS_WL=window_left >= 0, HAS_WR=window_right >= 0, HAS_KVLEN=kv_lens is not None,
        BIAS_KIND=bias_kind, SOFTCAP=softcap > 0, DROPOUT=dropout_p > 0,
        PLAIN=bias_kind == 0 and softcap == 0 and scale > 0,
    )


def _scalars(scale: float, softcap: float, dropout_p: float) -> tuple:
    """(qk_scale, softcap, cap_scale, ..., drop_threshold, drop_scale) as triton_family._scalars."""
    return (scale * tf.LOG2E, softcap, (scale / softcap) if softcap > 0 else 0.0,
            keep_threshold(dropout_p) if dropout_p > 0 else 0, 1.0 / (1.0 - dropout_p))


def _unused(device: torch.device) -> Tensor:
    """A new one-element buffer for pointer arguments a launch does not use (the read-only ones of a launch share
    one). Never an input such as q: Inductor hands a user Triton kernel each argument with its traced strides and
    copies a computed tensor once per argument that receives it (the decode op's q was written into eight buffers
    per layer that way)."""
    return _empty((1,), (1,), torch.float32, device)


def _positions(unused: Tensor, batch: int, q_pos: Optional[Tensor], q_seg: Optional[Tensor],
               k_seg: Optional[Tensor]) -> dict:
    """The kernels' run-time position / segment parameters: the op's q_pos and q_seg / k_seg where given
    (triton_family.structure_kwargs: [N] or [B | 1, N], broadcast dims read with stride 0), `unused` otherwise.
    Every parameter is passed, defaults too: torch 2.11's wrap_triton binds a kernel's arguments by position."""
    if (q_seg is None) != (k_seg is None):
        raise ValueError("q_seg / k_seg: give both segment id tensors or neither")
    kw = dict(QPOS=unused, stride_pb=0, stride_pm=0, HAS_QPOS=False, QSEG=unused, stride_qsb=0, stride_qsm=0,
              KSEG=unused, stride_ksb=0, stride_ksn=0, HAS_SEG=False)
    kw.update(tf.structure_kwargs(SimpleNamespace(q_pos=q_pos, q_seg=q_seg, k_seg=k_seg), batch))
    return kw


@torch.library.triton_op(f"{NAMESPACE}::fwd", mutates_args=())
def fwd(
    q: Tensor, k: Tensor, v: Tensor, bias: Optional[Tensor], kv_lens: Optional[Tensor],
    dropout_seed: Optional[Tensor], scale: float, causal: bool, diag_offset: int, window_left: int,
    window_right: int, softcap: float, dropout_p: float, config: list[int], sinks: Optional[Tensor] = None,
    empty_fill: int = 0, q_pos: Optional[Tensor] = None, q_seg: Optional[Tensor] = None,
    k_seg: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor]:
    """(out, lse) of attn_fwd_kernel; `config` = [block_m, block_n, num_warps, num_stages]; `sinks` [Hq]
    (ops.py: each head's logit in the softmax denominator; lse includes it). `empty_fill` (EMPTY_FILLS):
    out on rows that admit no key is 0 (the op's), NaN, or the mean of V over all keys; lse stays -inf.
    `q_pos`, `q_seg` / `k_seg`: the op's run-time positions and segment ids (ops.py), or None."""
    from .triton_fwd import attn_fwd_kernel

    check_config("config", config)
    if empty_fill not in EMPTY_FILLS.values():
        raise ValueError(f"empty_fill: expected one of {sorted(EMPTY_FILLS.values())}, got {empty_fill}")
    q, k, v = tf._unit_last(q), tf._unit_last(k), tf._unit_last(v)
    b, hq, nq, d = q.shape
    hkv, nk, dv = k.shape[1], k.shape[2], v.shape[3]
    out = _empty((b, hq, nq, dv), (nq * hq * dv, dv, hq * dv, 1), q.dtype, q.device)
    lse = _empty((b, hq, nq), (hq * nq, nq, 1), torch.float32, q.device)
    if b * hq * nq == 0:
        return out, lse
    bias4, bias_kind, bstr = _bias_arg(bias, b, hq, nq, nk)
    consts = _consts(bias_kind, causal, window_left, window_right, kv_lens, softcap, dropout_p, scale)
    qk_scale, cap, cap_scale, thr, drop_scale = _scalars(scale, softcap, dropout_p)
    unused = _unused(q.device)
    seed = dropout_seed.reshape(1) if consts["DROPOUT"] else unused
    block_d, block_dv = tf._pow2(d), tf._pow2(dv)
    grid = (tf.triton_cdiv(nq, int(config[0])) * b * hq, 1, 1)
    _launcher(attn_fwd_kernel)[grid](
        q, k, v, out, lse, bias4 if bias4 is not None else unused, kv_lens if kv_lens is not None else unused, seed,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2),
        *bstr, hq, hq // hkv, nq, nk, d, dv,
        qk_scale, cap, cap_scale, diag_offset, window_left, window_right, thr, drop_scale,
        BLOCK_D=block_d, BLOCK_DV=block_dv, EVEN_D=(d == block_d and dv == block_dv), REVERSE_M=bool(causal),
        BIAS_FMA=bias_kind in (1, 3) and softcap == 0 and scale > 0, **consts, **_tile_kwargs(config),
        SINKS=sinks.contiguous() if sinks is not None else unused, HAS_SINKS=sinks is not None,
        **_positions(unused, b, q_pos, q_seg, k_seg),
        EMPTY_FILL=int(empty_fill),
    )
    return out, lse


@torch.library.triton_op(f"{NAMESPACE}::bwd", mutates_args=())
def bwd(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, bias: Optional[Tensor],
    kv_lens: Optional[Tensor], dropout_seed: Optional[Tensor], scale: float, causal: bool, diag_offset: int,
    window_left: int, window_right: int, softcap: float, dropout_p: float, write_ds: bool,
    dkdv_config: list[int], dq_config: list[int], empty_grad: int = 0, fused_dq: bool = False,
    q_pos: Optional[Tensor] = None, q_seg: Optional[Tensor] = None, k_seg: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dq, dk, dv, ds): dq/dk/dv dense in q/k/v's dimension order; ds the fp32 [B, Hq, Nq, Nk] score
    gradient when `write_ds` (the caller reduces it to the bias' shape), else an empty tensor.
    `lse` is the forward's fp32 [B, Hq, Nq] (-inf on empty rows). With `empty_grad` (EMPTY_GRADS), `dout` is
    the gradient of emit's empty-row fix-up: the kernels zero it on rows with lse -inf, as the fix-up's
    `where` does, and for "mean_v" / "uniform" a last kernel adds the rest of its backward when some row
    is empty (fa_compile/kernels/triton_empty_rows_bwd.py). With `fused_dq` (not with `write_ds`), the dK/dV kernel
    also adds each key tile's share of dQ into an fp32 buffer by atomics (no dQ kernel; `dq_config` unused), so the
    sums arrive in varying order: the lowering asks for it only outside deterministic mode. `q_pos`, `q_seg` /
    `k_seg` as for `fwd`."""
    from .triton_bwd import attn_bwd_dkdv_kernel, attn_bwd_preprocess_kernel

    check_config("dkdv_config", dkdv_config)
    check_config("dq_config", dq_config)
    if fused_dq and write_ds:
        raise ValueError("fused_dq: the dQ kernel writes dS, so write_ds needs fused_dq=False")
    if empty_grad != 0 and empty_grad not in EMPTY_GRADS.values():
        raise ValueError(f"empty_grad: expected 0 or one of {sorted(EMPTY_GRADS.values())}, got {empty_grad}")
    dq, dk, dvv = (_empty(t.shape, _dense_strides(t), t.dtype, t.device) for t in (q, k, v))
    q, k, v = tf._unit_last(q), tf._unit_last(k), tf._unit_last(v)
    dout, out = tf._unit_last(dout), tf._unit_last(out)
    lse = lse.to(torch.float32).contiguous()
    b, hq, nq, d = q.shape
    hkv, nk, dv = k.shape[1], k.shape[2], v.shape[3]
    empty_ds = q.new_empty((0,), dtype=torch.float32)
    ds = torch.zeros((b, hq, nq, nk), device=q.device, dtype=torch.float32) if write_ds else empty_ds
    if b * hkv * nk == 0 or b * hq * nq == 0:
        return dq.zero_(), dk.zero_(), dvv.zero_(), ds
    bias4, bias_kind, bstr = _bias_arg(bias, b, hq, nq, nk)
    consts = _consts(bias_kind, causal, window_left, window_right, kv_lens, softcap, dropout_p, scale)
    qk_scale, cap, cap_scale, thr, drop_scale = _scalars(scale, softcap, dropout_p)
    common = (qk_scale, cap, cap_scale, scale, diag_offset, window_left, window_right, thr, drop_scale)
    unused = _unused(q.device)
    seed = dropout_seed.reshape(1) if consts["DROPOUT"] else unused
    block_d, block_dv = tf._pow2(d), tf._pow2(dv)
    delta = torch.empty((b, hq, nq), device=q.device, dtype=torch.float32)
    kvl = kv_lens if kv_lens is not None else unused
    bias_arg = bias4 if bias4 is not None else unused
    # written only with WRITE_DS / FUSED_DQ, but the kernels' source stores to them: buffers of their own (an
    # input there would be claimed written, and a functional launch copies what it writes)
    ds_arg = ds if write_ds else _unused(q.device)
    pre_m = 16 if tf.interpreting() else _PRE_BLOCK_M_GPU
    _launcher(attn_bwd_preprocess_kernel)[(tf.triton_cdiv(nq, pre_m) * b * hq, 1, 1)](
        out, dout, delta, out.stride(0), out.stride(1), out.stride(2), dout.stride(0), dout.stride(1),
        dout.stride(2), hq, nq, dv, BLOCK_M=pre_m, BLOCK_DV=block_dv,
    )
    strides = (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
               v.stride(0), v.stride(1), v.stride(2), dout.stride(0), dout.stride(1), dout.stride(2))
    # fp32 sums of the key tiles' dQ shares (the fused form; zeros it starts from), [B, Hq, Nq, D] contiguous
    dqa = torch.zeros((b, hq, nq, d), device=q.device, dtype=torch.float32) if fused_dq else _unused(q.device)
    positions = _positions(unused, b, q_pos, q_seg, k_seg)
    _launcher(attn_bwd_dkdv_kernel)[(tf.triton_cdiv(nk, int(dkdv_config[1])) * b * hkv, 1, 1)](
        q, k, v, dout, lse, delta, dk, dvv, bias_arg, kvl, seed, unused, unused, unused, unused, *strides,
        dk.stride(0), dk.stride(1), dk.stride(2), dvv.stride(0), dvv.stride(1), dvv.stride(2),
        *bstr, hq, hkv, hq // hkv, nq, nk, d, dv, *common,
        BLOCK_D=block_d, BLOCK_DV=block_dv, USE_TMA=False, **consts, **_tile_kwargs(dkdv_config),
        **positions, ZERO_EMPTY=empty_grad != 0, DQA=dqa, FUSED_DQ=bool(fused_dq),
    )
    if fused_dq:
        dq.copy_(dqa * scale)
    else:
        _launch_dq(q, k, v, dout, lse, delta, dq, ds_arg, bias_arg, kvl, seed, unused, strides, bstr, common,
                   consts, dq_config, write_ds, causal, empty_grad, positions)
    if empty_grad in (EMPTY_GRADS["mean_v"], EMPTY_GRADS["uniform"]):
        _empty_rows_grads(dout, q, k, v, lse, dq, dk, dvv, scale, empty_grad == EMPTY_GRADS["uniform"])
    return dq, dk, dvv, ds


def _launch_dq(q, k, v, dout, lse, delta, dq, ds_arg, bias_arg, kvl, seed, unused, strides, bstr, common, consts,
               dq_config, write_ds: bool, causal: bool, empty_grad: int, positions: dict) -> None:
    from .triton_bwd import attn_bwd_dq_kernel

    b, hq, nq, d = q.shape
    hkv, nk, dv = k.shape[1], k.shape[2], v.shape[3]
    block_d, block_dv = tf._pow2(d), tf._pow2(dv)
    _launcher(attn_bwd_dq_kernel)[(tf.triton_cdiv(nq, int(dq_config[0])) * b * hq, 1, 1)](
        q, k, v, dout, lse, delta, dq, ds_arg, bias_arg, kvl, seed, unused, unused, unused, unused, *strides,
        dq.stride(0), dq.stride(1), dq.stride(2),
        *bstr, hq, hq // hkv, nq, nk, d, dv, *common,
        BLOCK_D=block_d, BLOCK_DV=block_dv, WRITE_DS=bool(write_ds), REVERSE_M=bool(causal), USE_TMA=False,
        **consts, **_tile_kwargs(dq_config), **positions, ZERO_EMPTY=empty_grad != 0,
    )


def _empty_rows_grads(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, lse: Tensor, dq: Tensor, dk: Tensor,
                      dvv: Tensor, scale: float, uniform: bool) -> None:
    """Add the empty-row fix-up's backward into dq / dk / dv (one program per batch and kv head)."""
    from .triton_empty_rows_bwd import attn_bwd_empty_rows_kernel

    b, hq, nq, d = q.shape
    hkv, nk, dv = k.shape[1], k.shape[2], v.shape[3]
    block_dv = tf._pow2(dv)
    small = 16 if tf.interpreting() else 32  # fp32 [32, Dv] tiles: registers for Dv up to 256
    launch = {} if tf.interpreting() else dict(num_warps=4, num_stages=1)
    _launcher(attn_bwd_empty_rows_kernel)[(b * hkv, 1, 1)](
        q, k, v, dout, lse, dq, dk, dvv,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), dout.stride(0), dout.stride(1), dout.stride(2),
        dq.stride(0), dq.stride(1), dq.stride(2), dk.stride(0), dk.stride(1), dk.stride(2),
        dvv.stride(0), dvv.stride(1), dvv.stride(2),
        hq, hkv, hq // hkv, nq, nk, d, dv, scale,
        BLOCK_M=small, BLOCK_N=small, BLOCK_DC=min(small, tf._pow2(d)), BLOCK_DV=block_dv, UNIFORM=bool(uniform),
        **launch,
    )


@torch.library.triton_op(f"{NAMESPACE}::empty_rows_bwd", mutates_args={"dq", "dk", "dv"})
def empty_rows_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, lse: Tensor, dq: Tensor, dk: Tensor, dv: Tensor,
                   scale: float, uniform: bool) -> None:
    """Add the backward of emit's empty-row fix-up ("mean_v", or "uniform" with `uniform`) into dq, dk, dv in
    place: what fa3_triton::bwd's last kernel does, as an op of its own for a lowered graph whose other kernels
    are not fa3_triton's (the Gluon backward, lowering/triton.py). dq may be fp32 (the Gluon kernel's dQ sums)."""
    b, hq, nq, _ = q.shape
    if b * hq * nq == 0 or k.shape[2] == 0:
        return
    dout, q, k, v = tf._unit_last(dout), tf._unit_last(q), tf._unit_last(k), tf._unit_last(v)
    _empty_rows_grads(dout, q, k, v, lse.to(torch.float32).contiguous(), dq, dk, dv, scale, bool(uniform))


_DENSE_STRIDES: dict[tuple, tuple] = {}


def _dense_strides(t: Tensor) -> tuple:
    """The strides `torch.empty_like(t)` gives (t's dimension order, dense). Memoised on concrete sizes and
    strides: torch's rule builds a class on every call (~25-100 us of host time, three times per backward call
    of an op that runs eagerly)."""
    from torch._prims_common import compute_elementwise_output_strides

    shape, stride = tuple(t.shape), tuple(t.stride())
    if not all(type(x) is int for x in shape + stride):  # symbolic sizes: no memo (and no guards added)
        return tuple(compute_elementwise_output_strides(t))
    key = (shape, stride)
    hit = _DENSE_STRIDES.get(key)
    if hit is None:
        if len(_DENSE_STRIDES) >= 4096:
            _DENSE_STRIDES.clear()
        hit = _DENSE_STRIDES[key] = tuple(compute_elementwise_output_strides(t))
    return hit
