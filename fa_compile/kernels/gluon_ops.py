"""`fa3_gluon::bwd`: the Gluon backward kernel (gluon_bwd.py) as an op that Inductor's generated code calls.

`wrap_triton` cannot launch Gluon kernels (triton_ops.py says why), so where the lowering would give a
site's backward to the pointer kernels of `fa3_triton::bwd` and the Gluon kernel takes it (Hopper, strides
TMA accepts, structural masks, key lengths, a boolean key-padding mask, dropout: `gluon_backward` in
fa_compile/lowering/triton.py), its graph calls this op instead. Inductor keeps the op as an extern call: one
Python call per site and step, for a kernel that does one pass over the score tiles where the pointer pair
does two (a padded BERT's B32 x 512, d64, dropout 0.1: 0.40 ms against 0.50 on the H200,
benchmarks/results/gluon-bwd-dropout-h200-2026-12-04.txt).

That call is host time on the step's critical path (a padded BERT's training step left the GPU waiting
~0.3 ms before each Gluon launch under the profiler), so the op does only what Inductor cannot: it zeroes the
fp32 dQ buffer, builds the TMA descriptors and launches the kernel. Its first call with a given layout launches
through Triton and records the launch; later calls replay it with their own tensors (replay.py, `_replay_key`),
which skips Triton's binding of the 35 arguments, the five descriptors' checks and the checks of this module. Everything around it is graph ops that
Inductor launches itself: δ = rowsum(out · dout) before it, the cast of the fp32 dQ sums into dq's strides
after it, and, where the site folds the empty-row fix-up's backward, that fix-up's kernel
(`fa3_triton::empty_rows_bwd`, a triton_op). The op is defined through torch.library.Library: custom_op's own
layers around the body cost ~15-60 us per call.

On an empty row (lse -inf) P is 0, so its dout weighs nothing in the Gluon kernel's products as long as it is
finite (the pointer kernels zero it outright, `zero_empty`; a non-finite dout there turns into NaN in dV here,
where eager's fix-up puts it into the mean of V's gradient). Whatever the Gluon kernel cannot take at run time
(strides TMA refuses, a failed build, which warns once: triton_family.backward_gluon) runs `fa3_triton::bwd`'s
kernels with the given tiles and returns their dq as fp32.

This module imports no Triton until the op is traced or runs: the lowering's cache key (graph_pass.uuid) imports
it, so that the op exists before Inductor's cached code calls it in a fresh process."""
from __future__ import annotations

import os
from typing import Optional

import torch
from torch import Tensor


def _outputs(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(dQ sums: fp32 [B, Hq, Nq, D] contiguous, dk, dv dense in k / v's dimension order, allocated as
    fa3_triton::bwd allocates them: its `_empty`, which tests poison)."""
    from .triton_ops import _dense_strides, _empty

    if all(type(x) is int for x in q.shape):
        h, n, d = (max(x, 1) for x in q.shape[1:])  # contiguous strides, as torch gives a size-0 dim
        stride = (h * n * d, n * d, d, 1)
    else:
        stride = tuple(torch._prims_common.make_contiguous_strides_for(q.shape))
    dqs = _empty(q.shape, stride, torch.float32, q.device)
    return (dqs, *(_empty(t.shape, _dense_strides(t), t.dtype, t.device) for t in (k, v)))


_LIB = torch.library.Library("fa3_gluon", "DEF")
_LIB.define(
    "bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor delta, Tensor? bias, "
    "Tensor? kv_lens, Tensor? dropout_seed, float scale, bool causal, int diag_offset, int window_left, "
    "int window_right, float dropout_p, bool zero_empty, int[] dkdv_config, int[] dq_config) "
    "-> (Tensor, Tensor, Tensor)",
    tags=(torch.Tag.pt2_compliant_tag,))


def _impl(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, delta: Tensor, bias: Optional[Tensor],
    kv_lens: Optional[Tensor], dropout_seed: Optional[Tensor], scale: float, causal: bool, diag_offset: int,
    window_left: int, window_right: int, dropout_p: float, zero_empty: bool, dkdv_config: list[int],
    dq_config: list[int],
) -> tuple[Tensor, Tensor, Tensor]:
    """(dQ sums in fp32, [B, Hq, Nq, D] contiguous; dk; dv). Arguments as fa3_triton::bwd takes them (no softcap,
    no dS; bias: None or a boolean key-padding mask, triton_family.is_key_mask), plus δ = rowsum(out · dout) in
    fp32 [B, Hq, Nq] and `zero_empty` for a dout that is the empty-row fix-up's gradient (rows with lse -inf add
    nothing). `out` is read by the fallback only. dkdv_config / dq_config: the pointer kernels' tiles, for it."""
    from torch._library.triton import set_wrap_triton_enabled

    key = _replay_key(dout, q, k, v, lse, delta, bias, kv_lens, dropout_seed, scale, causal, diag_offset,
                      window_left, window_right, dropout_p)
    if key is not None:
        done = _replayed(key, dout, q, k, v, lse, delta, bias, kv_lens, dropout_seed, dropout_p)
        if done is not None:
            return done
    # The body sees real tensors only: the fallback's `wrap_triton` launches go straight to the kernels instead of
    # through the higher-order op's dispatch (~240 against ~70 us of host time per launch).
    with set_wrap_triton_enabled(False):
        return _bwd(dout, q, k, v, out, lse, delta, bias, kv_lens, dropout_seed, scale, causal, diag_offset,
                    window_left, window_right, dropout_p, zero_empty, dkdv_config, dq_config, key)


# The Gluon kernel's recorded launches by _replay_key: Inductor's code calls the op once per site and step with
# tensors of the same layout, and a replay skips Triton's binding and the descriptors' checks (replay.py).
# FA_COMPILE_REPLAY=0 launches through Triton every time (benchmarks/gluon_op_host.py times both).
_REPLAYS: dict[tuple, tuple] = {}  # key -> (replay.Replay, the outputs' (shape, stride, dtype), dQ sums' view)
_MAX_REPLAYS = 256
# the kernel's arguments that hold the call's tensors (gluon_bwd.attn_bwd_gluon_kernel), in _replayed's order
_DYNAMIC = ("q_desc", "k_desc", "v_desc", "do_desc", "LSE", "DELTA", "dqa_desc", "DK", "DV", "KVLENS", "SEED",
            "KMASK")


def _replay_key(dout, q, k, v, lse, delta, bias, kv_lens, seed, scale, causal, diag_offset, window_left,
                window_right, dropout_p) -> Optional[tuple]:
    """Everything the Gluon path reads but the tensors' addresses: layouts, devices, scalars, and deterministic
    mode (which refuses the kernel). None off CUDA, with FA_COMPILE_REPLAY=0, or while a tile is pinned
    (triton_family.CONFIG_OVERRIDE, for tests and benchmarks): Triton's path. The switches that only choose
    among exact kernels or tiles (FA_COMPILE_GLUON, FA_COMPILE_TRITON_TMA, tile tuning) are read when a layout is
    first launched, as the lowering reads them when it compiles: each is an environment read per call otherwise
    (~1-3 µs apiece on the device's host)."""
    from . import triton_family as tf

    dev = q.get_device()
    if dev < 0 or tf.CONFIG_OVERRIDE or os.environ.get("FA_COMPILE_REPLAY") == "0":
        return None
    return (dev, torch.are_deterministic_algorithms_enabled(), scale, causal, diag_offset, window_left, window_right,
            dropout_p, *[None if t is None else (t.shape, t.stride(), t.dtype, t.get_device())
                         for t in (dout, q, k, v, lse, delta, bias, kv_lens, seed)])


def _replayed(key: tuple, dout, q, k, v, lse, delta, bias, kv_lens, seed,
              dropout_p: float) -> Optional[tuple[Tensor, Tensor, Tensor]]:
    """The op's outputs by a replay of the launch recorded under `key` (_bwd records it), or None: no replay,
    another current device, or an address the replay refuses (nothing written then)."""
    from .triton_ops import _empty

    hit = _REPLAYS.get(key)
    if hit is None or torch.cuda.current_device() != key[0]:
        return None
    r, (dq_spec, dk_spec, dv_spec), rows = hit
    dqs, dk, dvv = (_empty(*spec, q.device) for spec in (dq_spec, dk_spec, dv_spec))
    dqa = dqs.view(rows).zero_()
    # as triton_family._backward_gluon passes them: lse stands in for what the site lacks
    kvl = kv_lens if kv_lens is not None else lse
    sd = seed.to(q.device).reshape(1) if float(dropout_p) > 0 else lse
    km = bias.view(torch.uint8) if bias is not None else lse
    if not r.launch((q, k, v, dout, lse, delta, dqa, dk, dvv, kvl, sd, km), key[0]):
        return None
    return dqs, dk, dvv


def _bwd(dout, q, k, v, out, lse, delta, bias, kv_lens, dropout_seed, scale, causal, diag_offset, window_left,
         window_right, dropout_p, zero_empty, dkdv_config, dq_config, key=None):
    from .. import dispatch
    from . import replay
    from . import triton_family as tf
    from . import triton_ops

    cap = tf._capability(q.device)
    b, hq, nq = q.shape[:3]
    hkv, nk = k.shape[1], k.shape[2]
    if cap[0] == 9 and b * hq * nq > 0 and b * hkv * nk > 0:
        args = dispatch.AttentionArgs(q, k, v, scale, causal, diag_offset=diag_offset, window_left=window_left,
                                      window_right=window_right, bias=bias, kv_lens=kv_lens, dropout_p=dropout_p,
                                      dropout_seed=dropout_seed, needs_backward=True)
        qq, kk, vv, dd = (tf._unit_last(t) for t in (q, k, v, dout))
        lse32, delta32 = lse.to(torch.float32).contiguous(), delta.to(torch.float32).contiguous()
        dqs, dk, dvv = _outputs(q, k, v)
        # a replay passes the op's own tensors: only where the launch took them as they are
        same = all(a is b for a, b in zip((qq, kk, vv, dd, lse32, delta32), (q, k, v, dout, lse, delta)))
        rec = {} if key is not None and same else None
        with tf._device_ctx(q):
            # bias: None or a key-padding mask, constant along query rows (_bias4's kind 4)
            if tf.backward_gluon(args, qq, kk, vv, dd, lse32, delta32, dqs, dk, dvv, cap, 0 if bias is None else 4,
                                 dq_sums=True, record=rec):
                if rec:
                    r = replay.Replay.record(rec["kernel"], rec["handle"], rec["grid"], rec["args"], rec["kwargs"],
                                             _DYNAMIC)
                    if r is not None:
                        if len(_REPLAYS) >= _MAX_REPLAYS:
                            _REPLAYS.clear()
                        specs = tuple((t.shape, t.stride(), t.dtype) for t in (dqs, dk, dvv))
                        _REPLAYS[key] = (r, specs, (1, b * hq, nq, q.shape[3]))
                return dqs, dk, dvv
    empty_grad = triton_ops.EMPTY_GRADS["none"] if zero_empty else 0
    dq, dk, dvv, _ = triton_ops.bwd(dout, q, k, v, out, lse, bias, kv_lens, dropout_seed, scale, causal, diag_offset,
                                    window_left, window_right, 0.0, dropout_p, False, dkdv_config, dq_config,
                                    empty_grad, False)
    return dq.to(torch.float32, memory_format=torch.contiguous_format), dk, dvv


def _fake(dout, q, k, v, out, lse, delta, bias, kv_lens, dropout_seed, scale, causal, diag_offset, window_left,
          window_right, dropout_p, zero_empty, dkdv_config, dq_config):
    return _outputs(q, k, v)


_LIB.impl("bwd", _impl, "CompositeExplicitAutograd")
torch.library.register_fake("fa3_gluon::bwd", _fake, lib=_LIB)
bwd = torch.ops.fa3_gluon.bwd
