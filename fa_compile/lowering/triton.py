"""CUDA: our Triton family (kernel "triton") as the `fa3_triton` triton_ops of fa_compile/kernels/triton_ops.py.

The replacement calls `fa3_triton.fwd` / `fa3_triton.bwd` and is traced functionalized, so each op
decomposes into `triton_kernel_wrapper_functional` nodes with constant strides, constexprs and grid
(what AOTAutograd makes of a triton_op in user code): Inductor reinplaces them onto the op's own
`empty` outputs and launches the kernels from its generated code, and CUDA graphs capture them.
The tiles are the family's `pick_config` for this GPU, fixed here; on a real GPU each is built and
run once on real tensors of the site's shapes, and a tile that does not fit takes the family's
smaller one (`_smaller`), as its run-time OutOfResources retry would (none fitting: the node keeps
the op, with one warning).

Only the pointer kernels lower (wrap_triton takes neither host TensorDescriptors nor Gluon kernels:
see fa_compile/kernels/triton_ops.py), so a site keeps the op, with its reason, where the family would run
another member or something the straight-line form cannot reproduce: its TMA-descriptor or Gluon
kernels (Hopper, 16-byte aligned strides; FA_COMPILE_TRITON_TMA=0 selects the pointer kernels),
first-call tile tuning (FA_COMPILE_TUNE on Hopper), dynamic sizes. Dropout lowers: the node's seed
tensor is an input of the replacement (`takes_dropout_seed`), so the mask is the op's counter hash.
Attention sinks lower too (`takes_sinks`): the forward kernel's sink step; the backward kernels read P
from the lse, which includes the sinks, and the sinks' own gradient stays the graph's arithmetic.
The forward writes emit's fix-up of rows with no admissible key itself where it is all that reads the
op's outputs (`fills_empty_rows`, empty_rows.py): NaN or the mean of V, read only by a tile with such a row;
in training too for the mean of V (`fills_saved_empty_rows`). The backward takes that fix-up's backward
(`folds_empty_row_grads`, empty_rows_backward.py): its kernels zero the dO of rows whose lse is -inf, and one
more kernel (fa_compile/kernels/triton_empty_rows_bwd.py) adds the mean's and eager's uniform-row gradients, reading
only the lse when no row is empty. A padded BERT training step had run them as graph ops on every layer.
The backward runs the dK/dV and dQ kernels, or adds dQ inside the dK/dV kernel where the family's `fuses_dq`
says so (FA_COMPILE_FUSED_DQ=1; never with a bias gradient or in deterministic mode, which the pass's cache key
and the tiles' signature include; explain() names it, FUSED_DQ_TEXT).
Run-time positions and segment ids (q_pos, q_seg / k_seg; a static cache's prefill reads its positions from
`cache_position`) lower too (`takes_structure`): the pointer kernels read them, as the family's run-time path
does, which runs its pointer forward for such a site whatever its length.
A site with a key-padding mask (one value per sequence and key) also gets that mask's key limit as kv_lens
(`cuts_padded_keys`, graph_pass and key_limit.for_site): the kernels' key loops end at each sequence's last kept
key, and the dK/dV programs past it write zeros.

On CPU the family runs under the Triton interpreter only; the lowering takes such sites (tests
register it for ("cpu", "triton")), never Inductor, which cannot build a user kernel for the CPU.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Callable, Optional

import torch
from torch import Tensor
from torch._prims_common import make_contiguous_strides_for

from .. import dispatch
from . import choice, conventions
from .splice import SpliceError

_VERIFIED: dict = {}  # signature of a site and direction -> tiles that built and ran, or why none


def _family():
    from ..kernels import triton_family

    return triton_family


def _ops():
    from ..kernels import triton_ops

    return triton_ops


def _capability(t: Tensor) -> tuple[int, int]:
    return torch.cuda.get_device_capability(t.device) if t.device.type == "cuda" else (0, 0)


def _descriptor_path(tensors: list, cap: tuple[int, int]) -> bool:
    """Whether the family would run its TMA-descriptor / Gluon kernels (triton_family._tma_ok, with
    16-byte aligned data pointers, as allocations are: only strides are known at compile time)."""
    tf = _family()
    return tf.tma_enabled(cap) and all(tf.tma_strides_ok(tuple(int(s) for s in stride), dtype)
                                       for _, stride, dtype in tensors)


def _site_meta(args: dispatch.AttentionArgs) -> list:
    """(shape, strides, dtype) of q, k, v and of the forward's out / the backward's dout (taken to have out's BSHD
    strides), for _descriptor_path."""
    b, hq, nq = (int(x) for x in args.q.shape[:3])
    dv = int(args.v.shape[3])
    bshd = ((b, hq, nq, dv), conventions.bshd_strides(b, hq, nq, dv), args.q.dtype)
    return [(t.shape, t.stride(), t.dtype) for t in (args.q, args.k, args.v)] + [bshd]


def _bias_kind(args: dispatch.AttentionArgs) -> int:
    b, hq, nq, nk = (int(x) for x in (args.q.shape[0], args.q.shape[1], args.q.shape[2], args.k.shape[2]))
    return _family()._bias4(args.bias, b, hq, nq, nk)[1]


def _tile(cfg) -> list[int]:
    return [cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages]


def _signature(args: dispatch.AttentionArgs, direction: str) -> tuple:
    def meta(t: Optional[Tensor]):
        return None if t is None else (tuple(t.shape), tuple(t.stride()), t.dtype, str(t.device))

    overrides = tuple(sorted(_family().CONFIG_OVERRIDE.items(), key=repr))
    return (direction, meta(args.q), meta(args.k), meta(args.v), meta(args.bias), meta(args.kv_lens),
            bool(args.causal), int(args.diag_offset), int(args.window_left), int(args.window_right),
            float(args.softcap), float(args.scale), bool(args.bias_requires_grad), overrides,
            direction == "backward" and fuses_dq(args), meta(args.q_pos), meta(args.q_seg), meta(args.k_seg))


def _wants_dbias(args: dispatch.AttentionArgs) -> bool:
    return bool(args.bias_requires_grad) and args.bias is not None and args.bias.dtype != torch.bool


def fuses_dq(args: dispatch.AttentionArgs) -> bool:
    """Whether the site's backward adds dQ inside the dK/dV kernel (the family's rule, triton_family.fuses_dq)."""
    return _family().fuses_dq(_wants_dbias(args))


# explain(): how the lowered backward sums dQ where it has no dQ kernel of its own
FUSED_DQ_TEXT = "dQ added by the dK/dV kernel through fp32 atomics (a dQ kernel in deterministic mode)"
# explain(): the lowered backward that calls the Gluon kernel's op
GLUON_BWD_TEXT = "the Gluon backward kernel: one pass over the score tiles, launched by the op"


# The Gluon kernel's op is a Python call in Inductor's code (~140 µs of host time per call on an H100's host,
# replayed: kernels/gluon_ops.py) where Inductor launches the pointer pair itself, so it pays only where the
# GPU time it saves is larger. Padded BERT training steps with attention dropout 0.1 (H100, bf16, d64,
# benchmarks/padded_keys.py, each row one process; B x heads x Nq x Nk scores per site, Gluon / pointer pair
# against SDPA code under Inductor): B32 x 12 x 256^2 (25.2M) 1.124x / 1.012x; B32 x 12 x 384^2 (56.6M)
# 0.975x / 1.004x; B32 x 16 x 512^2 (134M) 0.954x / 1.010x (benchmarks/results/gluon-bwd-crossover-h100-2026-12-07.txt).
# Below GLUON_BWD_MIN_WORK, about where those lines cross, the step is host-bound and the pair is faster.
GLUON_BWD_MIN_WORK = 48_000_000
# Without dropout the pair computes nothing twice and the Gluon kernel saves less: on the H200 (bf16, d64, the
# models of benchmarks/models.py) a ViT training step (B64 x 197) ran 1.2% more GPU time with it than with the
# pair, while at B32 x 512 it took 0.326 ms against 0.346 and at 1024 keys less still. With dropout the pair
# computes the dropout hash in both of its kernels and the Gluon kernel once: 1.24-1.38x at 512 and 1024 keys
# (benchmarks/results/gluon-bwd-dropout-h200-2026-12-04.txt). So without dropout it also needs
# GLUON_BWD_MIN_SCORES per head.
GLUON_BWD_MIN_SCORES = 512 * 512


def gluon_backward(args: dispatch.AttentionArgs) -> bool:
    """Whether the lowered backward calls fa3_gluon::bwd (fa_compile/kernels/gluon_ops.py) rather than the pointer
    kernels: on Hopper, where the family's Gluon backward takes the site (triton_family.gluon_backward_applies,
    which also reads FA_COMPILE_GLUON and deterministic mode), TMA takes q, k, v and a BSHD dout's strides, and
    the site has GLUON_BWD_MIN_WORK scores in all and, without dropout, GLUON_BWD_MIN_SCORES per head.
    FA_COMPILE_GLUON=1 takes the Gluon kernel at every size."""
    return _gluon_kernel_takes(args) and not _gluon_too_small(args)


def _gluon_kernel_takes(args: dispatch.AttentionArgs) -> bool:
    if args.q.device.type != "cuda" or _wants_dbias(args):
        return False
    cap = _capability(args.q)
    if cap[0] != 9 or not _family().gluon_backward_applies(args, cap):
        return False
    return _descriptor_path(_site_meta(args), cap)


def _gluon_too_small(args: dispatch.AttentionArgs) -> str:
    """Why the site is too small for the Gluon op (GLUON_BWD_MIN_WORK, GLUON_BWD_MIN_SCORES), or ""."""
    if os.environ.get("FA_COMPILE_GLUON") == "1":
        return ""
    b, h, nq = (int(x) for x in args.q.shape[:3])
    nk = int(args.k.shape[2])
    if b * h * nq * nk < GLUON_BWD_MIN_WORK:
        return (f"{b * h * nq * nk / 1e6:.1f}M scores, under the {GLUON_BWD_MIN_WORK / 1e6:.0f}M from which the "
                "Gluon kernel's GPU time saves more than its op's host time costs")
    if float(args.dropout_p) == 0 and nq * nk < GLUON_BWD_MIN_SCORES:
        return f"Nq x Nk = {nq} x {nk} without dropout, under 512 x 512, where the Gluon kernel saves no GPU time"
    return ""


def settings_key() -> tuple:
    """What the lowering reads besides the graph, for the pass's cache key: the descriptor-kernel and
    tile-tuning switches, pinned tiles, and the sources of the tile table and the ops."""
    from torch._inductor.custom_graph_pass import get_hash_for_files

    from ..kernels import tile_tuning

    tf = _family()
    here = os.path.dirname(os.path.abspath(tf.__file__))
    files = tuple(os.path.join(here, f) for f in ("triton_family.py", "triton_ops.py", "decode.py", "decode_ops.py",
                                                  "gluon_ops.py"))
    return (os.environ.get("FA_COMPILE_TRITON_TMA", "auto"), os.environ.get("FA_COMPILE_TRITON_LOWER", "auto"),
            os.environ.get("FA_COMPILE_GLUON", "1"),
            os.environ.get("FA_COMPILE_FUSED_DQ", "auto"), torch.are_deterministic_algorithms_enabled(),
            tile_tuning.enabled(),
            repr(sorted(tf.CONFIG_OVERRIDE.items(), key=repr)), get_hash_for_files(files).hex())


# Up to Nq x Nk = 1024 x 1024 the lowering launches the pointer kernels even where the family would run
# its TMA-descriptor / Gluon kernels (which wrap_triton cannot launch): on the H200 (bf16, d64-d128) the
# pointer forward was as fast or faster there (B32 x 512 with key padding: 0.13 ms against 0.18; B8 x 1024
# d128 causal: 0.23 against 0.20), while the kept op costs ~180 us more host time per call than the
# lowered launch. Beyond it the descriptor kernels' speed (0.26 against 0.35 ms at B2 x 4096 d128) is
# worth more than the host time, which the GPU work then hides.
SHORT_SCORES = 1024 * 1024


class TritonLowering:
    same_kernel = True
    takes_dropout_seed = True  # graph_pass passes the node's dropout_seed after bias and kv_lens
    takes_sinks = True  # and then its sinks: the forward kernel has the sink step; the backward needs none
    fills_empty_rows = True  # forward_fn takes empty_fill: the kernel writes emit's empty-row fix-up (empty_rows.py)
    # and in training too (the mean of V): the backward zeroes the empty rows' dO, so their filled out weighs nothing
    fills_saved_empty_rows = True
    folds_empty_row_grads = True  # backward_fn takes empty_grad: the kernels compute the fix-up's backward
    # and the dropped uniform rows of a site with dropout (fa3::dropped_uniform_rows): written into out and added
    # into the gradients in place by kernels/dropped_rows_ops.py
    fills_dropped_rows = True
    folds_dropped_rows = True
    # kv_lens beside a bias ends each sequence's key loops (and its dK/dV programs) there: graph_pass gives a
    # key-padding mask's limit to the site (key_limit.for_site) where it has more keys than one tile
    cuts_padded_keys = True
    # graph_pass passes the node's q_pos, q_seg, k_seg (those present) after the sinks: the pointer forward and
    # the pointer backward read them (a static cache's prefill: positions from cache_position)
    takes_structure = True

    def key_tile(self, args: dispatch.AttentionArgs, direction: str) -> int:
        """The smallest key tile of the site's kernels (the family's tile table; nothing is run)."""
        return min(int(c.block_n) for c in _table_configs(args, direction))

    def backward_note(self, args: dispatch.AttentionArgs) -> str:
        """For explain(): GLUON_BWD_TEXT where the lowered backward calls the Gluon kernel's op, FUSED_DQ_TEXT
        where it has no dQ kernel."""
        if gluon_backward(args):
            return GLUON_BWD_TEXT
        note = FUSED_DQ_TEXT if fuses_dq(args) else ""
        small = _gluon_kernel_takes(args) and _gluon_too_small(args)
        if small:
            note = "; ".join(x for x in (note, f"the pointer kernels, not the Gluon backward: {small}") if x)
        return note

    def target(self, direction: str) -> str:
        return "fa3_triton.bwd" if direction == "backward" else "fa3_triton.fwd"

    def target_for(self, args: dispatch.AttentionArgs, direction: str) -> str:
        return "fa3_gluon.bwd" if direction == "backward" and gluon_backward(args) else self.target(direction)

    def reasons(self, args: dispatch.AttentionArgs, direction: str) -> list[str]:
        tf = _family()
        what = "the Triton family's lowering"
        dev = args.q.device.type
        if dev == "cpu" and not tf.interpreting():
            return [f"{what}: CPU tensors need the Triton interpreter (TRITON_INTERPRET=1)"]
        if dev not in ("cuda", "cpu"):
            return [f"{what}: device {dev}"]
        dyn = choice.dynamic_dims(args)
        dyn += [n for n in ("window_left", "window_right") if choice._symbolic(getattr(args, n))]
        if dyn:
            return [f"{what} fixes sizes and strides at compile time; dynamic here: {', '.join(dyn)}"]
        r = []
        mode = os.environ.get("FA_COMPILE_TRITON_LOWER", "auto")
        if dev == "cuda" and mode == "0":
            return [f"{what} is off (FA_COMPILE_TRITON_LOWER=0)"]
        cap = _capability(args.q)
        nq, nk = int(args.q.shape[2]), int(args.k.shape[2])
        structure = args.q_pos is not None or args.q_seg is not None
        # (with run-time positions or segment ids the family runs its pointer forward anyway)
        descriptors = _descriptor_path(_site_meta(args), cap) and not (structure and direction == "forward")
        if descriptors and mode != "1" and nq * nk > SHORT_SCORES:
            r.append(f"{what}: on this GPU the family runs its TMA-descriptor / Gluon kernels for these strides "
                     f"and lengths (Nq x Nk = {nq} x {nk} > 1024 x 1024), which wrap_triton cannot launch "
                     "(FA_COMPILE_TRITON_LOWER=1 lowers the pointer kernels anyway)")
        if direction == "backward" and cap[0] == 9:
            from ..kernels import tile_tuning

            if tile_tuning.enabled():
                r.append(f"{what}: tile tuning (FA_COMPILE_TUNE) picks the backward tiles at the first call")
        return r

    def _plan(self, args: dispatch.AttentionArgs, direction: str) -> list:
        """Tiles ([block_m, block_n, warps, stages]; two for the backward). On a real GPU they are built
        and run first (here, not in reasons(): explain() runs nothing); SpliceError when none fits, so
        the node keeps the op with one warning."""
        key = _signature(args, direction)
        hit = _VERIFIED.get(key)
        if isinstance(hit, str):
            raise SpliceError(hit)
        if hit is not None:
            return hit
        cfgs = _table_configs(args, direction)
        if args.q.device.type == "cuda" and torch.cuda.is_available():
            cfgs = _verify(args, direction, cfgs)
        plan = [_tile(c) for c in cfgs] if not isinstance(cfgs, str) else cfgs
        _VERIFIED[key] = plan
        if isinstance(plan, str):
            raise SpliceError(plan)
        return plan

    def forward_fn(self, args: dispatch.AttentionArgs, empty_fill: str = "zero",
                   out_strides: Optional[tuple] = None) -> Callable:
        """fn(q, k, v[, bias][, kv_lens]) -> (out, lse) in the op's conventions, traced functionalized; out
        holds `empty_fill` ("zero", the op's own; "nan"; "mean_v"; "dropped": fa3::dropped_uniform_rows's value,
        written after the kernel by fa3_triton::dropped_rows_fill) on rows that admit no key, and has
        `out_strides` where given (the fix-up's output it stands for; the op's BSHD strides otherwise)."""
        (config,) = self._plan(args, "forward")
        ops = _ops()
        dropped = empty_fill == "dropped"
        if dropped:
            _verify_dropped(args, "forward")
        fill = ops.EMPTY_FILLS["zero" if dropped else empty_fill]
        s = _site_scalars(args)
        unpack = _optional_inputs(args)

        def fn(q, k, v, *rest):
            bias, kv_lens, seed, sinks, q_pos, q_seg, k_seg = unpack(q, rest)
            out, lse = ops.fwd(q, k, v, bias, kv_lens, seed, *s, config, sinks, fill, q_pos, q_seg, k_seg)
            if dropped:
                from ..kernels import dropped_rows_ops

                dropped_rows_ops.dropped_rows_fill(out, v, lse, seed, float(args.dropout_p))
            out, lse = conventions.finish(out, lse, None)  # the kernel writes empty rows itself
            return (out if out_strides is None else conventions.with_strides(out, out_strides)), lse

        return _functionalized(fn)

    def backward_fn(self, args: dispatch.AttentionArgs, empty_grad: Optional[str] = None,
                    out_strides: Optional[tuple] = None, qk_grad: float = 0.0) -> Callable:
        """fn(dout, q, k, v, out, lse[, bias][, kv_lens]) -> (dq, dk, dv, dbias or an empty tensor). With
        `empty_grad` (empty_rows_backward.py), dout is the gradient of emit's empty-row fix-up and the kernels
        add that fix-up's backward; `out_strides` (dq, dk, dv; None: the op's own) are then the strides of
        the graph values the gradients stand for. "dropped": the kernels zero the empty rows' dout, and
        fa3_triton::dropped_rows_bwd adds fa3::dropped_uniform_rows's gradients (`qk_grad` as that op's) after them."""
        dkdv_config, dq_config = self._plan(args, "backward")  # also the Gluon op's fallback tiles
        fused = fuses_dq(args)
        bwd = _ops().bwd
        gluon = gluon_backward(args)
        dropped = empty_grad == "dropped"
        if dropped:
            _verify_dropped(args, "backward", qk_grad, fp32_dq=gluon)
        grad_code = 0 if empty_grad is None else _ops().EMPTY_GRADS["none" if dropped else empty_grad]
        mean_v, uniform = _ops().EMPTY_GRADS["mean_v"], _ops().EMPTY_GRADS["uniform"]
        strides = out_strides or (None, None, None)
        s = _site_scalars(args)
        unpack = _optional_inputs(args)
        want_ds = _wants_dbias(args)
        reduce_dbias = _family()._reduce_dbias

        def fn(dout, q, k, v, out, lse, *rest):
            bias, kv_lens, seed, _sinks, q_pos, q_seg, k_seg = unpack(q, rest)  # lse includes the sinks
            if gluon:  # no softcap, and no bias but a boolean key-padding mask, here (gluon_backward)
                from ..kernels import gluon_ops

                # δ, the empty-row fix-up's kernel and dQ's cast are graph ops around the op (gluon_ops.py)
                scale, causal, diag_offset, wl, wr, _softcap, dropout_p = s
                delta = (out.to(torch.float32) * dout.to(torch.float32)).sum(-1)
                dq, dk, dv = gluon_ops.bwd(dout, q, k, v, out, lse, delta, bias, kv_lens, seed, scale, causal,
                                           diag_offset, wl, wr, dropout_p, grad_code != 0, dkdv_config, dq_config)
                if grad_code in (mean_v, uniform):
                    _ops().empty_rows_bwd(dout, q, k, v, lse, dq, dk, dv, scale, grad_code == uniform)
                if dropped:
                    _dropped_rows_bwd(dout, q, k, v, lse, seed, dq, dk, dv, args, qk_grad)
                dq = dq.to(q.dtype)
                ds = None
            else:
                dq, dk, dv, ds = bwd(dout, q, k, v, out, lse, bias, kv_lens, seed, *s, want_ds, dkdv_config,
                                     dq_config, grad_code, fused, q_pos, q_seg, k_seg)
                if dropped:
                    _dropped_rows_bwd(dout, q, k, v, lse, seed, dq, dk, dv, args, qk_grad)
            if want_ds:
                db = reduce_dbias(ds, bias)
                db = conventions.with_strides(db, tuple(make_contiguous_strides_for(bias.shape)))
            else:
                db = q.new_empty((0,))
            grads = [conventions.dense_like(g, t) if st is None else conventions.with_strides(g, st)
                     for g, t, st in zip((dq, dk, dv), (q, k, v), strides)]
            return (*grads, db)

        return _functionalized(fn)


_DROPPED_VERIFIED: dict = {}


def _verify_dropped(args: dispatch.AttentionArgs, direction: str, qk_grad: float = 0.0, fp32_dq: bool = False) -> None:
    """Build and run the dropped-rows kernel of `direction` (kernels/dropped_rows_ops.py) once on tiny real tensors
    of the site's dtype and head dims, on a real GPU: a Triton failure raises SpliceError here, so the node keeps
    the op (graph_pass) instead of failing in Inductor's code. Memoised; nothing is run on the CPU."""
    q, v = args.q, args.v
    if q.device.type != "cuda" or not torch.cuda.is_available():
        return
    softcap = float(args.softcap or 0.0)
    key = (direction, q.dtype, int(q.shape[3]), int(v.shape[3]), softcap > 0, qk_grad != 0, fp32_dq, q.device.index)
    hit = _DROPPED_VERIFIED.get(key)
    if hit is None:
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        from ..kernels import dropped_rows_ops

        try:
            with unset_fake_temporarily():
                dev, dt = torch.device("cuda", q.device.index or 0), q.dtype
                qq = torch.randn(1, 2, 3, int(q.shape[3]), dtype=dt, device=dev)
                kk = torch.randn(1, 1, 5, int(q.shape[3]), dtype=dt, device=dev)
                vv = torch.randn(1, 1, 5, int(v.shape[3]), dtype=v.dtype, device=dev)
                lse = torch.full((1, 2, 3), float("-inf"), device=dev)
                seed = torch.ones((), dtype=torch.int64, device=dev)
                if direction == "forward":
                    dropped_rows_ops.dropped_rows_fill(torch.zeros(1, 2, 3, int(v.shape[3]), dtype=v.dtype,
                                                                   device=dev), vv, lse, seed, 0.5)
                else:
                    dq = torch.zeros(qq.shape, dtype=torch.float32 if fp32_dq else dt, device=dev)
                    dropped_rows_ops.dropped_rows_bwd(torch.randn(1, 2, 3, int(v.shape[3]), dtype=v.dtype, device=dev),
                                                      qq, kk, vv, lse, seed, dq, torch.zeros_like(kk),
                                                      torch.zeros_like(vv), 0.5, 1.0, softcap, qk_grad)
                torch.cuda.synchronize(dev)
            hit = ""
        except Exception as e:  # (a GPU or Triton version the kernel was not measured on)
            hit = f"the dropped-rows kernel ({direction}) failed here: {type(e).__name__}: {str(e)[:200]}"
        _DROPPED_VERIFIED[key] = hit
    if hit:
        raise SpliceError(hit)


def _dropped_rows_bwd(dout, q, k, v, lse, seed, dq, dk, dv, args: dispatch.AttentionArgs, qk_grad: float) -> None:
    from ..kernels import dropped_rows_ops

    dropped_rows_ops.dropped_rows_bwd(dout, q, k, v, lse, seed, dq, dk, dv, float(args.dropout_p), float(args.scale),
                                      float(args.softcap or 0.0), float(qk_grad))


def _table_configs(args: dispatch.AttentionArgs, direction: str) -> list:
    """The family's tiles for the site from its table (pick_config): [fwd], or [dK/dV, dQ] for the backward."""
    tf = _family()
    cap = _capability(args.q)
    block = max(tf._pow2(int(args.q.shape[3])), tf._pow2(int(args.v.shape[3])))
    causal = bool(args.causal)
    if direction == "forward":
        return [tf.pick_config("fwd", block, causal, cap, _bias_kind(args))]
    return [tf.pick_config("dkdv", block, causal, cap), tf.pick_config("dq", block, causal, cap)]


def _site_scalars(args: dispatch.AttentionArgs) -> tuple:
    """(scale, causal, diag_offset, window_left, window_right, softcap, dropout_p) as the ops take them."""
    return (float(args.scale), bool(args.causal), int(args.diag_offset), int(args.window_left),
            int(args.window_right), float(args.softcap), float(args.dropout_p))


def _optional_inputs(args: dispatch.AttentionArgs) -> Callable:
    """unpack(q, rest) -> (bias, kv_lens, dropout seed, sinks, q_pos, q_seg, k_seg) from the replacement's trailing
    inputs (graph_pass passes those the node has, in that order): kv_lens contiguous (the kernels index it by
    batch), the seed on q's device (the kernels load it); the seed only with dropout."""
    has = [args.bias is not None, args.kv_lens is not None, args.dropout_seed is not None, args.sinks is not None,
           args.q_pos is not None, args.q_seg is not None, args.k_seg is not None]
    dropout = float(args.dropout_p) > 0

    def unpack(q: Tensor, rest: tuple) -> tuple:
        it = iter(rest)
        bias, kv_lens, seed, sinks, q_pos, q_seg, k_seg = (next(it) if h else None for h in has)
        if kv_lens is not None:
            kv_lens = kv_lens.contiguous()
        seed = seed.to(q.device) if (dropout and seed is not None) else None
        return bias, kv_lens, seed, sinks, q_pos, q_seg, k_seg

    return unpack


def _functionalized(fn: Callable) -> Callable:
    """fn traced under FunctionalTensorMode: each triton_op decomposes into its kernels' functional HOPs."""
    from torch._subclasses.functional_tensor import dispatch_functionalize

    return dispatch_functionalize(fn)


def _verify(args: dispatch.AttentionArgs, direction: str, cfgs: list):
    """Build and run the ops once on real tensors of the site's shapes and strides, shrinking a tile that
    does not fit (OutOfResources) as the family's launcher does; the tiles that ran, or why none did."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from triton.runtime.errors import OutOfResources

    tf, ops = _family(), _ops()
    s = _site_scalars(args)
    with unset_fake_temporarily():
        real = dataclasses.replace(args, **{n: choice._real_like(getattr(args, n)) for n in (
            "q", "k", "v", "bias", "kv_lens", "dropout_seed", "q_pos", "q_seg", "k_seg")})
        structure = (real.q_pos, real.q_seg, real.k_seg)
        if real.kv_lens is not None:
            real = dataclasses.replace(real, kv_lens=real.kv_lens.contiguous().clamp_(0, int(args.k.shape[2])))
        seed = real.dropout_seed.to(real.q.device) if float(args.dropout_p) > 0 else None
        cfgs = list(cfgs)
        while True:
            try:
                with torch.cuda.device(real.q.device):
                    if direction == "forward":
                        ops.fwd(real.q, real.k, real.v, real.bias, real.kv_lens, seed, *s, _tile(cfgs[0]), None, 0,
                                *structure)
                    else:
                        out, lse = ops.fwd(real.q, real.k, real.v, real.bias, real.kv_lens, seed, *s,
                                           _tile(tf.pick_config("fwd", 16, False, (0, 0))))
                        ops.bwd(torch.randn_like(out), real.q, real.k, real.v, out, lse, real.bias, real.kv_lens,
                                seed, *s, _wants_dbias(args), _tile(cfgs[0]), _tile(cfgs[1]), 0, fuses_dq(args),
                                *structure)
                    torch.cuda.synchronize(real.q.device)
                return cfgs
            except OutOfResources as e:  # the message does not name the kernel: shrink every tile that can
                smaller = [tf._smaller(c) for c in cfgs]
                if all(c is None for c in smaller):
                    return f"no tile of the family's fits this GPU ({type(e).__name__}: {str(e)[:120]})"
                cfgs = [n if n is not None else c for n, c in zip(smaller, cfgs)]


TRITON_LOWERING = TritonLowering()
choice.register("cuda", "triton", TRITON_LOWERING)
