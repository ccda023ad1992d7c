"""The Triton attention candidate: `TRITON`, a kernel family behind `torch.ops.fa3.attention`.

Supports every feature of the op: causal (any diag_offset), sliding window, kv_lens, float bias or
bool keep-mask broadcasting through strides, softcap, dropout (the counter hash of dropout_hash.py,
bit-identical to the reference), GQA, any strides with a unit last stride (others are copied),
fp16 / bf16, and fp32 through TF32 when torch's matmul precision allows it.
On Hopper the forward of the common cases (structural masks, a float bias tile TMA can read, a float or
bool bias constant along query rows such as a key-padding mask; head dims 33..256) runs the Gluon
warp-specialized kernel of gluon_fwd.py, and the backward of the structural-mask cases (head-dim blocks
64 and 128) the Gluon kernel of gluon_bwd.py, which sums dQ by TMA reductions; everything else, other
GPUs, the interpreter and deterministic mode (torch.use_deterministic_algorithms) run the
Triton-language kernels (triton_fwd*.py, triton_bwd.py). Their backward runs a dQ kernel of its own, or adds dQ
inside the dK/dV kernel by fp32 atomics where `fuses_dq` says so (FA_COMPILE_FUSED_DQ=1; never in deterministic mode).

Triton is imported lazily: without it this module still imports and reports "triton not installed".
Arguments are duck-typed (q, k, v, scale, causal, diag_offset, window_left, window_right, bias, kv_lens,
softcap, dropout_p, dropout_seed, needs_backward, bias_requires_grad, sinks) so fa_compile/kernels/ never imports fa_compile.
Sinks ([Hq] logits in the denominator): the pointer forward takes them (the Gluon and TMA forwards are
skipped); every backward kernel is unchanged, since P = exp(S - lse) with the lse that includes the sink
is already the probability of the keys (the sinks' own gradient is a reduction over (dO, O, lse), ops.py).
Run-time positions and segment ids (q_pos; q_seg / k_seg): the pointer forward and the Triton-language
backward take them (the Gluon forward and backward and the TMA forward are skipped: they have no such
mask); each tile reads only the keys up to its rows' largest position and within the span of tiles
whose segment ids can meet its own (triton_common.py).
"""
from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
import warnings
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor

from .dropout_hash import keep_threshold
from .reference import absorbing_bias_refusal

MAX_HEAD_DIM = 256
LOG2E = 1.4426950408889634


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@dataclass(frozen=True)
class BlockConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    # Forward (TMA) only: Q kept in registers as the A operand of Q·Kᵀ instead of shared memory.
    qreg: bool = False
    # Gluon warp-specialized forward only: the two consumer warpgroups take turns issuing their wgmma.
    pingpong: bool = False
    # Gluon forward only: one program per SM walks the tiles (gluon_fwd.attn_fwd_gluon_ws_kernel).
    persistent: bool = False


# Tests and the benchmark may pin configurations: {(kind, head_dim_block[, causal]): BlockConfig}, kind one of
# "fwd", "fwd_bias", "dkdv", "dq"; a key with `causal` wins over one without.
CONFIG_OVERRIDE: dict = {}
# The last compiled kernel handle per kernel name (registers, spills, PTX for the benchmark's report).
LAST_COMPILED: dict = {}


def _pow2(n: int) -> int:
    return max(16, 1 << (max(n, 1) - 1).bit_length())


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """SMs of `device`; the interpreter (CPU) pretends to be a small GPU so splits and groups get exercised."""
    if device.type == "cuda":
        return _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    return 8


def launch_groups(n_inner: int, n_outer: int, device: torch.device, uneven: bool) -> int:
    """n_groups of triton_common.grouped_program_ids for a grid of n_inner x n_outer programs. Even work
    (no causal mask or window): n_outer, one (batch, head) after another, whose programs share its rows in L2.
    Uneven work (the inner id sets a program's length): groups of at least 2·SMs / n_inner outer ids, so that a
    group's programs fill the GPU twice over and its long ones start in its first wave, while the rows the
    running programs read stay those of a few heads. Not past 64 blocks per (batch, head): there one head's
    programs already fill the GPU and the tail is short (H200, causal, 16k tokens, 128 blocks: 0.97-1.02x of
    the plain order across two runs; 1k-8k tokens: 1.00-1.16x; benchmarks/launch_order.py)."""
    if not uneven or n_outer <= 1 or n_inner > 64:
        return max(n_outer, 1)
    per_group = -(-2 * sm_count(device) // max(n_inner, 1))
    return max(1, n_outer // per_group)


def _uneven_work(args) -> bool:
    """Whether a causal mask or a window makes each block's work depend on its position (launch_groups)."""
    return bool(args.causal) or int(args.window_left) >= 0 or int(args.window_right) >= 0


def _capability(device: torch.device) -> tuple[int, int]:
    if device.type != "cuda":
        return (0, 0)
    return torch.cuda.get_device_capability(device)


def pick_config(kind: str, block_d: int, causal: bool, cap: tuple[int, int], bias_kind: int = 0) -> BlockConfig:
    """Block shapes per kernel, head-dim block and GPU generation (measured on H200; see benchmarks/results).

    Overrides: (kind, block_d, causal) before (kind, block_d); a forward with a bias tile per (row, key)
    (bias_kind 1 or 2) looks up "fwd_bias" before "fwd"."""
    kinds = ("fwd_bias", kind) if kind == "fwd" and bias_kind in (1, 2) else (kind,)
    for key in [(k, block_d, bool(causal)) for k in kinds] + [(k, block_d) for k in kinds]:
        hit = CONFIG_OVERRIDE.get(key)
        if hit is not None:
            return hit
    if cap == (0, 0):  # interpreter: small tiles so tiny test shapes still cross several blocks
        return BlockConfig(16, 16, 4, 1)
    hopper = cap[0] >= 9
    # H200, bf16, 16k tokens, 2026-11-29 (best of two timings each; benchmarks/results/kernels.md):
    if kind == "fwd":
        if block_d <= 64:
            # qreg 441 / causal 423 TFLOP/s vs 422 / 403 with Q in shared memory (223 / 255 regs).
            return BlockConfig(128, 64, 4, 3, qreg=True) if hopper else BlockConfig(128, 64, 4, 2)
        if block_d <= 128:
            # qreg 529 / causal 530 vs 485 / 478 (170 regs, 98 KB: two programs per SM); also the best
            # with a [1, H, N, N] float bias (364 vs 309). 128x128 w8 s3: 512, with qreg 516.
            return BlockConfig(64, 64, 4, 3, qreg=True) if hopper else BlockConfig(128, 32, 8, 2)
        # 535 / causal 522; with qreg 410 (255 regs), 128x32 w8 s3 qreg 515.
        return BlockConfig(128, 64, 8, 2) if hopper else BlockConfig(64, 32, 4, 2)
    if kind == "dkdv":
        # With dq 64x64 w4 s2: d128 403 TFLOP/s (dK/dV 255 regs, 8 B spilled) vs 390 for 64x128 w8 s2 +
        # dq 128x32 w4 s3; d64 339 vs 332.
        if block_d <= 128:
            return BlockConfig(64, 64, 4, 2) if hopper else BlockConfig(32, 64, 4, 2)
        return BlockConfig(64, 64, 8, 2) if hopper else BlockConfig(16, 32, 4, 1)
    # dq
    if block_d <= 128:
        return BlockConfig(64, 64, 4, 2) if hopper else BlockConfig(64, 32, 4, 2)
    return BlockConfig(128, 32, 8, 2) if hopper else BlockConfig(32, 32, 4, 1)


def fuses_dq(want_dbias: bool) -> bool:
    """Whether the Triton-language backward adds each key tile's share of dQ inside the dK/dV kernel (fp32 atomics
    into a zeroed buffer, then one scaled cast; the dK/dV kernel's tiles) instead of running the dQ kernel, which
    computes the scores, P, dP and the dropout mask a second time. Only where FA_COMPILE_FUSED_DQ=1 asks for it,
    and never with a bias gradient (the dQ kernel writes dS) or in deterministic mode (the atomic sums arrive in
    varying order). Off by default: on the H200 (bf16, 2026-12-03) it took 0.97x the two kernels' time at d64
    B32 x 512 with dropout, 1.06x without, and 1.13-1.44x at N 1024 causal (d64, d128, GQA) and d128 with dropout."""
    return (os.environ.get("FA_COMPILE_FUSED_DQ") == "1" and not want_dbias
            and not torch.are_deterministic_algorithms_enabled())


def _smaller(cfg: BlockConfig) -> Optional[BlockConfig]:
    """A config with half the tile (for shared-memory / register out-of-resource fallbacks)."""
    if cfg.num_stages > 2:
        return dataclasses.replace(cfg, num_stages=cfg.num_stages - 1)
    if cfg.block_n > 32:
        return dataclasses.replace(cfg, block_n=cfg.block_n // 2)
    if cfg.block_m > 32:
        return dataclasses.replace(cfg, block_m=cfg.block_m // 2)
    if cfg.num_stages > 1:
        return dataclasses.replace(cfg, num_stages=1)
    return None


# Pruned candidates for first-call tile tuning (FA_COMPILE_TUNE=1, fa_compile/kernels/tile_tuning.py) on Hopper:
# the runners-up of the H200 tile runs (benchmarks/results/kernels.md), each within ~10% of the default
# there, so another Hopper part or shape can pick differently; the default is always timed first.
TUNE_CANDIDATES: dict[tuple[str, int], list[BlockConfig]] = {
    ("fwd_gluon", 64): [BlockConfig(128, 128, 4, 2, qreg=True, pingpong=True), BlockConfig(128, 128, 4, 3, qreg=True)],
    ("fwd_gluon", 128): [BlockConfig(128, 128, 4, 3), BlockConfig(128, 128, 4, 2)],
    ("fwd_gluon", 256): [BlockConfig(128, 64, 4, 2, pingpong=True)],
    ("fwd_gluon_bias", 128): [BlockConfig(128, 128, 4, 2, pingpong=True), BlockConfig(128, 64, 4, 3, pingpong=True)],
    # A key vector per block adds no shared memory: the candidates of the plain Gluon forward (untimed with it).
    ("fwd_gluon_rowbias", 64): [BlockConfig(128, 128, 4, 2, qreg=True, pingpong=True),
                                BlockConfig(128, 128, 4, 3, qreg=True)],
    ("fwd_gluon_rowbias", 128): [BlockConfig(128, 128, 4, 3), BlockConfig(128, 128, 4, 2)],
    ("fwd_gluon_rowbias", 256): [BlockConfig(128, 64, 4, 2, pingpong=True)],
    ("fwd", 64): [BlockConfig(64, 128, 4, 3, qreg=True)],
    ("fwd", 128): [BlockConfig(128, 128, 8, 3, qreg=True)],
    ("fwd", 256): [BlockConfig(128, 32, 8, 3, qreg=True)],
    ("fwd_bias", 128): [BlockConfig(64, 64, 4, 2, qreg=True)],
    ("dkdv", 128): [BlockConfig(64, 128, 8, 2)],
    ("dq", 128): [BlockConfig(128, 32, 4, 3)],
    ("dkdv", 64): [BlockConfig(64, 64, 4, 3)],
    ("dq", 64): [BlockConfig(128, 32, 4, 3)],
}


def _tuned(kind: str, block: int, default: BlockConfig, q: Tensor, causal: bool, bias_kind: int,
           cap: tuple[int, int], run) -> BlockConfig:
    """`default`, or with tuning on the fastest of it and TUNE_CANDIDATES[kind, block] (Hopper; a pinned
    CONFIG_OVERRIDE is never second-guessed). `run(cfg)` must write the full outputs."""
    from . import tile_tuning

    if cap[0] != 9 or not tile_tuning.enabled() or any(k[0] == kind and k[1] == block for k in CONFIG_OVERRIDE):
        return default
    cands = [default] + [c for c in TUNE_CANDIDATES.get((kind, block), []) if c != default]
    key = f"{kind}|bd{block}|{str(q.dtype).replace('torch.', '')}|{'causal' if causal else '-'}|bias{bias_kind}"
    return tile_tuning.choose(key, q.device, cands, run, encode=lambda c: list(dataclasses.astuple(c)),
                              decode=lambda v: BlockConfig(*v))


def _launch(kernel, grid_fn, cfg: BlockConfig, *args, args_fn=None, **const):
    """Launch, falling back to smaller tiles when the compiler reports the config does not fit.

    args_fn(cfg), when given, supplies the leading arguments that depend on the tile (descriptors)."""
    from triton.runtime.errors import OutOfResources

    while True:
        try:
            kw = dict(const, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n)
            if not interpreting():
                kw.update(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
            lead = args_fn(cfg) if args_fn is not None else ()
            handle = kernel[grid_fn(cfg)](*lead, *args, **kw)
            LAST_COMPILED[getattr(kernel, "__name__", str(kernel))] = (cfg, handle)
            return cfg
        except OutOfResources:
            nxt = _smaller(cfg)
            if nxt is None:
                raise
            cfg = nxt


def _unit_last(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()


def _bias4(bias: Optional[Tensor], b: int, h: int, nq: int, nk: int) -> tuple[Any, int, tuple[int, int, int, int]]:
    """(tensor to pass, kind, strides of its broadcast [B, Hq, Nq, Nk] view; 0 on broadcast dims).

    kind: 0 none, 1 float, 2 bool; +2 when the bias does not vary along query rows (see score_tile)."""
    if bias is None:
        return None, 0, (0, 0, 0, 0)
    t = bias.reshape((1,) * (4 - bias.dim()) + tuple(bias.shape)) if bias.dim() < 4 else bias
    kind = 2 if t.dtype == torch.bool else 1
    if kind == 2:
        t = t.view(torch.uint8)
    t = t.expand(b, h, nq, nk)
    if t.stride(2) == 0:
        kind += 2  # constant along query rows: the kernels load one value per key
    return t, kind, tuple(t.stride())


def _mask_consts(args, bias_kind: int) -> dict:
    return dict(
        IS_CAUSAL=bool(args.causal), HAS_WL=int(args.window_left) >= 0, HAS_WR=int(args.window_right) >= 0,
        HAS_KVLEN=args.kv_lens is not None, BIAS_KIND=bias_kind, SOFTCAP=float(args.softcap) > 0,
        DROPOUT=float(args.dropout_p) > 0,
    )


def _plain(args, bias_kind: int) -> bool:
    """No bias, no softcap, positive scale: the forward may fold the scale into exp2's FMA."""
    return bias_kind == 0 and float(args.softcap) == 0 and float(args.scale) > 0


def _bias_fma(args, bias_kind: int) -> bool:
    """A float bias, no softcap, positive scale: the forward adds the bias inside one FMA (softmax_step)."""
    return bias_kind in (1, 3) and float(args.softcap) == 0 and float(args.scale) > 0


def _scalars(args) -> dict:
    scale = float(args.scale)
    softcap = float(args.softcap)
    p = float(args.dropout_p)
    return dict(
        qk_scale=scale * LOG2E, softcap=softcap, cap_scale=(scale / softcap) if softcap > 0 else 0.0,
        drop_threshold=keep_threshold(p) if p > 0 else 0, drop_scale=1.0 / (1.0 - p),
    )


def _device_ctx(t: Tensor):
    return torch.cuda.device(t.device) if t.device.type == "cuda" else _Null()


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


_TMA_STRIDES: dict[tuple, bool] = {}


def tma_enabled(cap: tuple[int, int]) -> bool:
    """Whether the descriptor kernels may run at all: sm90+, or the interpreter with FA_COMPILE_TRITON_TMA=1;
    never with FA_COMPILE_TRITON_TMA=0."""
    mode = os.environ.get("FA_COMPILE_TRITON_TMA", "auto")
    return mode != "0" and (cap[0] >= 9 or (mode == "1" and interpreting()))


def tma_strides_ok(stride: tuple, dtype: torch.dtype) -> bool:
    """fp16 / bf16 with 16-byte multiples for the strides of the first three dims (memoised: run-time launches
    ask this on every call; the lowering asks it of a site's strides)."""
    ok = _TMA_STRIDES.get((stride, dtype))
    if ok is None:
        size = 2 if dtype in (torch.float16, torch.bfloat16) else 0
        ok = _TMA_STRIDES[(stride, dtype)] = size > 0 and not any((s * size) % 16 for s in stride[:3])
    return ok


def _tma_ok(tensors, cap: tuple[int, int]) -> bool:
    """Host tensor descriptors need 16-byte aligned bases and strides (all but the unit last one)."""
    return tma_enabled(cap) and all(tma_strides_ok(t.stride(), t.dtype) and t.data_ptr() % 16 == 0
                                    for t in tensors)


def _desc(t: Tensor, block: list[int]):
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor(t, list(t.shape), list(t.stride()), block)


def _forward_tma(args, q, k, v, out, lse, bias, bias_kind, bstr, consts, sc, seed, block_d, block_dv, cfg,
                 sink_kw: Optional[dict] = None) -> None:
    from .triton_fwd_tma import attn_fwd_tma_kernel

    b, hq, nq, _ = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    warp_spec = os.environ.get("FA_COMPILE_TRITON_WS", "0") == "1"

    def grid(c):
        return (triton_cdiv(nq, c.block_m) * b * hq,)

    while True:
        try:
            kw = dict(consts, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=block_d, BLOCK_DV=block_dv,
                      REVERSE_M=bool(args.causal), WARP_SPEC=warp_spec, PLAIN=_plain(args, bias_kind),
                      QREG=cfg.qreg, BIAS_FMA=_bias_fma(args, bias_kind), **(sink_kw or {}))
            if not interpreting():
                kw.update(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
            handle = attn_fwd_tma_kernel[grid(cfg)](
                _desc(q, [1, 1, cfg.block_m, block_d]), _desc(k, [1, 1, cfg.block_n, block_d]),
                _desc(v, [1, 1, cfg.block_n, block_dv]), _desc(out, [1, 1, cfg.block_m, block_dv]),
                lse, bias if bias is not None else q, args.kv_lens if args.kv_lens is not None else q, seed,
                *bstr, hq, hq // hkv, nq, nk,
                sc["qk_scale"], sc["softcap"], sc["cap_scale"], int(args.diag_offset), int(args.window_left),
                int(args.window_right), sc["drop_threshold"], sc["drop_scale"], **kw,
            )
            LAST_COMPILED["attn_fwd_kernel"] = (cfg, handle)
            return
        except Exception as e:  # OutOfResources: smaller tiles
            from triton.runtime.errors import OutOfResources

            if not isinstance(e, OutOfResources) or _smaller(cfg) is None:
                raise
            cfg = _smaller(cfg)


@functools.lru_cache(maxsize=None)
def gluon_available() -> bool:
    try:
        return importlib.util.find_spec("triton.experimental.gluon.language.nvidia.hopper") is not None
    except ModuleNotFoundError:
        return False


# Gluon forward tiles on Hopper, {head-dim block: BlockConfig}; block_m is always 128 (two consumer
# warpgroups of 64 rows and a producer warp), num_warps 4 (the default partition). H200, bf16, 16k tokens,
# 2026-11-30, best of two timings (benchmarks/results/kernels.md, run E): d128 128x128 s3 ping-pong 640
# TFLOP/s vs 618 without ping-pong and 527 for the tl kernel; d64 128x128 s2 447 (ping-pong 445);
# d256 128x64 s2 661 (ping-pong 655).
# Persistent: one program per SM walks the tiles (the same bits as one tile per program). H200, bf16, 2026-12-04,
# benchmarks/persistent_fwd.py, 16k tokens, time against one tile per program (two runs where two are given):
#   no mask   d64 0.84x at N 1k, 0.91-0.93x at 2k, 0.98-1.00x at 16k; d128 0.98x, 0.93-0.95x, 0.99-1.01x;
#             d256 1.08x at 1k (O shares Q's shared tile there, so the next tile's Q waits for the output's
#             store), 0.98-0.99x at 2k and 16k: d256 stays one tile per program.
#   causal    d64 0.80x at 1k, 0.90-0.92x at 2k, 1.04x at 16k; d128 0.82x, 0.95-0.97x, 1.39x at 16k (d256 1.44x).
# So under a causal mask or a window (work that differs per tile) programs are persistent only up to
# GLUON_PERSISTENT_UNEVEN_BLOCKS query blocks per (batch, head); past it one program per tile (_forward_gluon).
GLUON_CONFIGS: dict[int, BlockConfig] = {
    64: BlockConfig(128, 128, 4, 2, qreg=True, persistent=True),
    128: BlockConfig(128, 128, 4, 3, pingpong=True, persistent=True),
    256: BlockConfig(128, 64, 4, 2),
}
GLUON_PERSISTENT_UNEVEN_BLOCKS = 16  # N 2k; benchmarks/persistent_fwd.py --uneven raises it
# With a float bias tile the ring holds two bias tiles per slot as well: two stages fit in shared memory.
# H200, bf16, d128, N 4096, B 4, H 16, [1, H, N, N] bias, 2026-12-01, four timings per variant in three
# runs: 128x128 s2 without ping-pong best 472-485 TFLOP/s (medians 449-464), with it 458-505 (450-456),
# 128x64 s3 420-427; our no-bias forward there 576-590 at s2 or s3 alike, so the ring's depth is not what
# the bias costs (benchmarks/results/kernels.md, run I). With bf16 pairs widened by gluon_fwd._widen: medians
# 472 against our no-bias ~578 (0.82x); run L 0.815x.
GLUON_BIAS_CONFIGS: dict[int, BlockConfig] = {
    64: BlockConfig(128, 128, 4, 2, qreg=True),
    128: BlockConfig(128, 128, 4, 2),
    256: BlockConfig(128, 64, 4, 2),
}
# With a bias constant along query rows (a key-padding mask) each consumer loads one [BLOCK_N] vector per key
# block into registers: the same tiles. sm_90 under Triton 3.6, bool / bf16 / fp32 masks: no spill in the
# key loop for d64..256 alone or with causal; window + kv_lens on top spill a few registers there (d256
# float ~100 B), a rare combination. H200, run I: a [4, 1, 1, 4096] bool mask at d128 ran at 0.84x our no-bias
# forward.
GLUON_ROWBIAS_CONFIGS: dict[int, BlockConfig] = dict(GLUON_CONFIGS)
# A bias tile shared by the batch but not the heads ([1, H, N, N]): launch the batch elements of one (query
# block, head) together so they read its rows from L2 (gluon_fwd._batch_inner_ids). Same runs as above,
# medians: 449-464 TFLOP/s against 432-444 in the usual order (450-456 against 424-433 with ping-pong); a
# [1, 1, N, N] bias (32 MB, read by every head) showed no gain and keeps the usual order. A switch for
# benchmarks/kernel_peers.py --bias.
GLUON_BIAS_BATCH_INNER = True


def _bias_batch_inner(gb, batch: int) -> bool:
    """Whether the Gluon forward launches the batch fastest: a bias tile (`gb`, from _gluon_bias) shared by a
    batch of more than one but not by the heads."""
    return GLUON_BIAS_BATCH_INNER and gb is not None and gb[1] == 0 and gb[2] == 1 and batch > 1


# Shared-memory layouts of the Gluon TMA tiles, {(rows, cols, dtype): NVMMASharedLayout}.
_GLUON_LAYOUTS: dict = {}
# Keys whose Gluon launch raised (e.g. a Triton release whose Gluon API moved): the tl kernel runs instead.
_GLUON_FAILED: set = set()



def _gluon_bias(bias: Optional[Tensor], q: Tensor) -> Optional[tuple[Tensor, int, int]]:
    """A float bias the Gluon forward reads by TMA: (a [B|1, H|1, Nq, Nk] view without broadcast strides,
    batch and head coordinate multipliers (0 on broadcast dims)), or None when it cannot (other dtype,
    a bias constant along query rows, unaligned strides)."""
    if bias is None or bias.dtype != q.dtype or bias.dim() < 2 or bias.stride(-1) != 1:
        return None
    t = bias.reshape((1,) * (4 - bias.dim()) + tuple(bias.shape)) if bias.dim() < 4 else bias
    nq, nk = t.shape[2], t.shape[3]
    if nq != q.shape[2] or t.stride(2) == 0 or nq == 1:
        return None
    row = t.stride(2)
    sizes, strides, muls = [], [], []
    for i in (0, 1):
        bcast = t.shape[i] == 1 or t.stride(i) == 0
        sizes.append(1 if bcast else t.shape[i])
        strides.append(row * nq if bcast else t.stride(i))  # any aligned stride will do for a size-1 dim
        muls.append(0 if bcast else 1)
    view = t.as_strided(sizes + [nq, nk], strides + [row, 1])
    if view.data_ptr() % 16 or any((st * view.element_size()) % 16 for st in view.stride()[:3]):
        return None
    return view, muls[0], muls[1]


def _gluon_ok(args, tensors, cap: tuple[int, int], bias_kind: int, block: int, gb) -> bool:
    """The Gluon forward (fa_compile/kernels/gluon_fwd.py) takes the structural masks, a float bias tile that TMA can
    read (`gb`, from _gluon_bias) and a float or bool bias constant along query rows (_bias4 kinds 3, 4: read
    by plain loads, any strides), on Hopper, for head-dim blocks 64..256 (smaller heads keep the tl kernel,
    tuned for them)."""
    if os.environ.get("FA_COMPILE_GLUON", "1") == "0" or cap[0] != 9 or interpreting() or block not in GLUON_CONFIGS:
        return False
    if float(args.softcap) != 0 or float(args.dropout_p) > 0 or float(args.scale) <= 0:
        return False
    if bias_kind not in (0, 3, 4) and gb is None:
        return False
    return gluon_available() and _tma_ok(tensors, cap)


def _gluon_config(gb, block: int, row_bias: bool = False) -> tuple[str, BlockConfig]:
    """(tuning kind, pinned or default tile) of the Gluon forward: plain, with a bias tile (`gb`) or with a
    bias constant along query rows (`row_bias`)."""
    if gb is not None:
        return "fwd_gluon_bias", CONFIG_OVERRIDE.get(("fwd_gluon_bias", block)) or GLUON_BIAS_CONFIGS[block]
    if row_bias:
        cfg = CONFIG_OVERRIDE.get(("fwd_gluon_rowbias", block)) or GLUON_ROWBIAS_CONFIGS[block]
        return "fwd_gluon_rowbias", cfg
    return "fwd_gluon", CONFIG_OVERRIDE.get(("fwd_gluon", block)) or GLUON_CONFIGS[block]


def _gluon_desc(t: Tensor, rows: int, cols: int):
    """A TMA descriptor of [rows, cols] tiles of a [B, H, N, D] view, with Gluon's default swizzle."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    block = [1, 1, rows, cols]
    key = (rows, cols, t.dtype)
    layout = _GLUON_LAYOUTS.get(key)
    if layout is None:  # ~19 us to build each time: five per call
        gdt = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32}[t.dtype]
        layout = _GLUON_LAYOUTS[key] = gl.NVMMASharedLayout.get_default_for(block, gdt)
    return TensorDescriptor(t, list(t.shape), list(t.stride()), block, layout)


def _forward_gluon(args, q, k, v, out, lse, block_d: int, block_dv: int, cfg: BlockConfig, gb, rb=None,
                   sinks: Optional[Tensor] = None) -> None:
    """`gb`: a bias tile view for TMA (_gluon_bias); `rb`: (tensor, _bias4 kind 3 or 4, strides) of a bias
    constant along query rows, read at batch, head and key strides (0 on broadcast dims); `sinks`: [Hq]."""
    from .gluon_fwd import attn_fwd_gluon_ws_kernel

    b, hq, nq, _ = q.shape
    hkv, nk = k.shape[1], k.shape[2]
    desc = _gluon_desc
    bias_args = (desc(gb[0], 64, cfg.block_n), gb[1], gb[2]) if gb is not None else (desc(k, cfg.block_n, block_d), 0, 0)
    # None without one: constexpr, so the kernel compiles exactly as without these arguments.
    rb_args = (rb[0], rb[2][0], rb[2][1], rb[2][3]) if rb is not None else (None, None, None, None)
    row_bias = 0 if rb is None else (1 if rb[1] == 3 else 2)
    kvl = args.kv_lens
    if cfg.block_m != 128 or cfg.num_warps != 4:
        raise ValueError(f"Gluon forward config {cfg}: block_m must be 128 (two warpgroups of 64) and num_warps 4")
    wg_m = 64
    n_mblk = triton_cdiv(nq, cfg.block_m)
    n_tiles = n_mblk * b * hq
    # Under a causal mask or a window the tiles' work differs: persistent only up to GLUON_PERSISTENT_UNEVEN_BLOCKS
    # query blocks per (batch, head) (GLUON_CONFIGS). Where it is off the kernel compiles as if it had no tile loop.
    uneven = _uneven_work(args)
    if cfg.persistent and uneven and n_mblk > GLUON_PERSISTENT_UNEVEN_BLOCKS:
        cfg = dataclasses.replace(cfg, persistent=False)
    grid = min(n_tiles, sm_count(q.device)) if cfg.persistent else n_tiles
    handle = attn_fwd_gluon_ws_kernel[(grid,)](
        desc(q, wg_m, block_d), desc(k, cfg.block_n, block_d), desc(v, cfg.block_n, block_dv),
        desc(out, wg_m, block_dv), lse, kvl if kvl is not None else lse, *bias_args, *rb_args,
        hq, hq // hkv, nq, nk, float(args.scale) * LOG2E, int(args.diag_offset), int(args.window_left),
        int(args.window_right), launch_groups(n_mblk, b * hq, q.device, uneven), n_tiles,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=block_d, BLOCK_DV=block_dv, STAGES=cfg.num_stages,
        IS_CAUSAL=bool(args.causal), HAS_WL=int(args.window_left) >= 0, HAS_WR=int(args.window_right) >= 0,
        HAS_KVLEN=kvl is not None, REVERSE_M=bool(args.causal), QREG=cfg.qreg, CONSUMER_REGS=240,
        PINGPONG=cfg.pingpong, HAS_BIAS=gb is not None, ROW_BIAS=row_bias,
        BATCH_INNER=_bias_batch_inner(gb, b), SINKS=sinks, HAS_SINKS=sinks is not None,
        SEP_O=_gluon_separate_o(cfg, block_d, block_dv, gb[0].element_size() if gb is not None else 0),
        PERSISTENT=cfg.persistent, num_warps=4,
    )
    LAST_COMPILED["attn_fwd_gluon_kernel"] = (cfg, handle)


# Shared memory a Hopper block may use (227 KB), less room for the barriers and the compiler's own scratch.
_GLUON_SMEM = 232448 - 8192


def _gluon_separate_o(cfg: BlockConfig, block_d: int, block_dv: int, bias_bytes: int) -> bool:
    """Whether the Gluon forward stages its output in a shared tile of its own (SEP_O) rather than in Q's slot:
    always where their widths differ; for a persistent program wherever it fits, so that the next tile's Q can
    land while this tile's output is stored. Bytes: Q and O 2 x 64 rows, the K/V ring, the bias tiles."""
    if block_d != block_dv:
        return True
    if not cfg.persistent:
        return False
    ring = cfg.num_stages * cfg.block_n * (block_d + block_dv) * 2 + 2 * cfg.num_stages * 64 * cfg.block_n * bias_bytes
    return 2 * 64 * (block_d + block_dv) * 2 + ring <= _GLUON_SMEM


# Gluon backward tiles on Hopper, {head-dim block: BlockConfig(query rows per step, keys per program = 128,
# num_warps 8 = two consumer warpgroups, Q/dO ring stages)}. H200, bf16, 16k tokens, 2026-12-01: d128
# s2 484 TFLOP/s (three stages do not fit beside the dQ tiles); d64 s3 381 vs s2 371 (causal 365 / 367);
# 128 query rows at d64 spill (248). Again 2026-12-04 with lse and delta staged in shared memory
# (benchmarks/results/gluon-bwd-tiles-h200-2026-12-04.txt): d64 s3 422 vs s2 412 (causal 411 / 410), d128
# s2 534 (causal 503).
GLUON_BWD_CONFIGS: dict[int, BlockConfig] = {
    64: BlockConfig(64, 128, 8, 3),
    128: BlockConfig(64, 128, 8, 2),
}


def gluon_backward_applies(args, cap: tuple[int, int]) -> bool:
    """Whether the backward of these inputs runs the Gluon kernel (fa_compile/kernels/gluon_bwd.py), from shapes and
    settings alone (dispatch asks this of fake tensors): Hopper, structural masks, a boolean key-padding mask
    shared by the heads (is_key_mask) and dropout only, head dims 33..128
    in multiples of 8 (rows of the fp32 dQ buffer must be 16-byte multiples for TMA), and not when torch
    asks for deterministic algorithms (its dQ sums arrive in varying order). The launcher also needs
    strides TMA accepts (_tma_ok)."""
    if os.environ.get("FA_COMPILE_GLUON", "1") == "0" or cap[0] != 9 or interpreting() or not gluon_available():
        return False
    d, dv = args.q.shape[-1], args.v.shape[-1]
    if not all(isinstance(x, int) and x % 8 == 0 and _pow2(x) in GLUON_BWD_CONFIGS for x in (d, dv)):
        return False
    if (args.bias is not None and not is_key_mask(args.bias)) or float(args.softcap) != 0 or float(args.scale) <= 0:
        return False
    if getattr(args, "q_pos", None) is not None or getattr(args, "q_seg", None) is not None:
        return False  # no run-time position / segment mask in the Gluon backward
    return not torch.are_deterministic_algorithms_enabled()


def is_key_mask(bias: Tensor) -> bool:
    """A boolean bias the Gluon backward reads as a key-padding mask: one value per batch (or one for all) and key,
    broadcast over heads and query rows ([B | 1, 1, 1, Nk] or fewer dims). Sizes only, and a symbolic size of the
    head or query dim is no (nothing here adds a guard)."""
    return bias.dtype == torch.bool and 1 <= bias.dim() <= 4 and all(
        isinstance(x, int) and x == 1 for x in bias.shape[-3:-1])


def gluon_key_mask(bias: Tensor) -> Optional[tuple[Tensor, int, int]]:
    """(bytes, batch stride, key stride) of a bias that is_key_mask accepts, None for any other; for the launch."""
    if not is_key_mask(bias):
        return None
    t = bias.reshape((1,) * (4 - bias.dim()) + tuple(bias.shape)) if bias.dim() < 4 else bias
    return t.view(torch.uint8), (int(t.stride(0)) if int(t.shape[0]) > 1 else 0), int(t.stride(3))


def _backward_gluon(args, q, k, v, dout, lse, delta, dq, dk, dvv, block_d: int, block_dv: int,
                    cfg: BlockConfig, dq_sums: bool = False, record: Optional[dict] = None) -> None:
    """`record`, when given, receives the launch (kernel, grid, args, kwargs, handle) for replay.Replay."""
    from .gluon_bwd import attn_bwd_gluon_kernel

    b, hq, nq, d = q.shape
    hkv, nk, dv = k.shape[1], k.shape[2], v.shape[3]
    if cfg.block_n != 128 or cfg.num_warps != 8 or cfg.block_m not in (64, 128):
        raise ValueError(f"Gluon backward config {cfg}: block_n must be 128, num_warps 8, block_m 64 or 128")
    # scale·dQ summed in fp32 over the key blocks (TMA reductions), then cast into dq's own strides; with
    # `dq_sums`, dq is that fp32 buffer ([B, Hq, Nq, D] contiguous) and the caller casts it.
    if dq_sums:
        dqa = dq.view(1, b * hq, nq, d).zero_()
    else:
        dqa = torch.zeros((1, b * hq, nq, d), device=q.device, dtype=torch.float32)
    kvl = args.kv_lens
    dropout = float(args.dropout_p) > 0
    seed = args.dropout_seed.to(q.device).reshape(1) if dropout else lse
    sc = _scalars(args)
    km = gluon_key_mask(args.bias) if args.bias is not None else None
    kmask, s_kmb, s_kmn = km if km is not None else (lse, 0, 0)
    n_kblk = triton_cdiv(nk, cfg.block_n)
    grid = (n_kblk * b * hkv,)
    pos = (
        _gluon_desc(q, cfg.block_m, block_d), _gluon_desc(k, cfg.block_n, block_d),
        _gluon_desc(v, cfg.block_n, block_dv), _gluon_desc(dout, cfg.block_m, block_dv),
        lse, delta, _gluon_desc(dqa, cfg.block_m, block_d), dk, dvv, kvl if kvl is not None else lse,
        dk.stride(0), dk.stride(1), dk.stride(2), dvv.stride(0), dvv.stride(1), dvv.stride(2),
        hq, hkv, hq // hkv, nq, nk, d, dv, float(args.scale) * LOG2E, float(args.scale), int(args.diag_offset),
        int(args.window_left), int(args.window_right), seed, sc["drop_threshold"], sc["drop_scale"],
        kmask, s_kmb, s_kmn, launch_groups(n_kblk, b * hkv, q.device, _uneven_work(args)),
    )
    kw = dict(
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=block_d, BLOCK_DV=block_dv, STAGES=cfg.num_stages,
        IS_CAUSAL=bool(args.causal), HAS_WL=int(args.window_left) >= 0, HAS_WR=int(args.window_right) >= 0,
        HAS_KVLEN=kvl is not None, DROPOUT=dropout, KEY_MASK=km is not None, num_warps=8,
    )
    handle = attn_bwd_gluon_kernel[grid](*pos, **kw)
    if record is not None:
        record.update(kernel=attn_bwd_gluon_kernel, grid=grid, args=pos, kwargs=kw, handle=handle)
    if not dq_sums:
        dq.copy_(dqa.view(b, hq, nq, d))
    LAST_COMPILED["attn_bwd_gluon_kernel"] = (cfg, handle)


def attention_forward(args, out: Optional[Tensor] = None, lse: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """(out [B, Hq, Nq, Dv] stored BSHD, lse [B, Hq, Nq] fp32); `out`/`lse` may be given (tests poison them)."""
    from .triton_fwd import attn_fwd_kernel

    q, k, v = _unit_last(args.q), _unit_last(args.k), _unit_last(args.v)
    b, hq, nq, d = q.shape
    hkv, nk, dv = k.shape[1], k.shape[2], v.shape[3]
    if out is None:
        out = q.new_empty((b, nq, hq, dv)).transpose(1, 2)
    if lse is None:
        lse = torch.empty((b, hq, nq), device=q.device, dtype=torch.float32)
    if b * hq * nq == 0:
        return out, lse
    bias, bias_kind, bstr = _bias4(args.bias, b, hq, nq, nk)
    consts = _mask_consts(args, bias_kind)
    sc = _scalars(args)
    seed = args.dropout_seed.to(q.device).reshape(1) if consts["DROPOUT"] else q
    block_d, block_dv = _pow2(d), _pow2(dv)
    cap = _capability(q.device)
    block = max(block_d, block_dv)
    # a bias or sink variant that fails to build keeps the plain one
    gkey = (block, q.dtype, bool(args.causal), bias_kind, getattr(args, "sinks", None) is not None)
    gb = _gluon_bias(args.bias, q) if bias_kind == 1 and cap[0] == 9 else None
    rb = (bias, bias_kind, bstr) if bias_kind in (3, 4) else None
    sinks = _sinks(args)
    sink_kw = dict(SINKS=sinks, HAS_SINKS=True) if sinks is not None else {}  # every forward has the sink step
    # Run-time positions and segments run the pointer kernel only (no such mask in the Gluon and TMA forwards).
    struct_kw = structure_kwargs(args, b)
    pointer_only = bool(struct_kw)
    if not pointer_only and gkey not in _GLUON_FAILED and _gluon_ok(args, (q, k, v, out), cap, bias_kind, block, gb):
        try:
            with _device_ctx(q):
                kind, cfg = _gluon_config(gb, block, rb is not None)
                cfg = _tuned(kind, block, cfg, q, bool(args.causal), bias_kind, cap,
                             lambda c: _forward_gluon(args, q, k, v, out, lse, block_d, block_dv, c, gb, rb, sinks))
                _forward_gluon(args, q, k, v, out, lse, block_d, block_dv, cfg, gb, rb, sinks)
            return out, lse
        except Exception as e:  # compile-time failure only: nothing was written; the tl kernel takes over
            if os.environ.get("FA_COMPILE_GLUON") == "1":
                raise
            _GLUON_FAILED.add(gkey)
            warnings.warn(f"fa_compile: the Gluon forward failed to build ({type(e).__name__}: {str(e)[:200]}); "
                          "using the Triton forward instead", RuntimeWarning)
    cfg = pick_config("fwd", max(block_d, block_dv), bool(args.causal), cap, bias_kind)
    if not pointer_only and _tma_ok((q, k, v, out), cap):
        with _device_ctx(q):
            cfg = _tuned("fwd_bias" if bias_kind in (1, 2) else "fwd", max(block_d, block_dv), cfg, q,
                         bool(args.causal), bias_kind, cap,
                         lambda c: _forward_tma(args, q, k, v, out, lse, bias, bias_kind, bstr, consts, sc, seed,
                                                block_d, block_dv, c, sink_kw))
            _forward_tma(args, q, k, v, out, lse, bias, bias_kind, bstr, consts, sc, seed, block_d, block_dv, cfg,
                         sink_kw)
        return out, lse
    with _device_ctx(q):
        _launch(
            attn_fwd_kernel, lambda c: (triton_cdiv(nq, c.block_m) * b * hq,), cfg,
            q, k, v, out, lse, bias if bias is not None else q, args.kv_lens if args.kv_lens is not None else q, seed,
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2),
            *bstr, hq, hq // hkv, nq, nk, d, dv,
            sc["qk_scale"], sc["softcap"], sc["cap_scale"], int(args.diag_offset), int(args.window_left),
            int(args.window_right), sc["drop_threshold"], sc["drop_scale"],
            BLOCK_D=block_d, BLOCK_DV=block_dv, EVEN_D=(d == block_d and dv == block_dv),
            REVERSE_M=bool(args.causal), PLAIN=_plain(args, bias_kind), BIAS_FMA=_bias_fma(args, bias_kind), **consts,
            **sink_kw, **struct_kw,
        )
    return out, lse


def _rows_view(t: Tensor, batch: int) -> tuple[Tensor, int, int]:
    """(tensor, batch stride, position stride) of an index tensor [n] or [B|1, n]: 0 on broadcast dims."""
    if t.dim() == 1:
        return t, 0, t.stride(0)
    return t, (0 if t.shape[0] == 1 else t.stride(0)), t.stride(1)


def structure_kwargs(args, batch: int) -> dict:
    """The kernels' keyword arguments for the op's q_pos and q_seg / k_seg ({} without them). Segment ids
    of two dtypes are compared as int64 (one copy of the int32 side)."""
    kw: dict = {}
    q_pos = getattr(args, "q_pos", None)
    if q_pos is not None:
        t, sb, sm = _rows_view(q_pos, batch)
        kw.update(QPOS=t, stride_pb=sb, stride_pm=sm, HAS_QPOS=True)
    q_seg, k_seg = getattr(args, "q_seg", None), getattr(args, "k_seg", None)
    if q_seg is not None and k_seg is not None:
        if q_seg.dtype != k_seg.dtype:
            q_seg, k_seg = q_seg.to(torch.int64), k_seg.to(torch.int64)
        qs, qsb, qsm = _rows_view(q_seg, batch)
        ks, ksb, ksn = _rows_view(k_seg, batch)
        kw.update(QSEG=qs, stride_qsb=qsb, stride_qsm=qsm, KSEG=ks, stride_ksb=ksb, stride_ksn=ksn, HAS_SEG=True)
    return kw


def _sinks(args) -> Optional[Tensor]:
    """The op's sinks [Hq] as a contiguous tensor on q's device, or None."""
    s = getattr(args, "sinks", None)
    return None if s is None else s.contiguous()


def device_reasons(dev: torch.device) -> list[str]:
    """Why Triton kernels cannot run on `dev` (empty: they can): a CUDA GPU of sm80+, or the CPU
    under the interpreter. Shared by every Triton family here."""
    if dev.type == "cpu":
        return [] if interpreting() else ["CPU tensors need the Triton interpreter (TRITON_INTERPRET=1)"]
    if dev.type != "cuda" or torch.version.hip is not None:
        return [f"device {dev.type} is not a CUDA GPU"]
    if not torch.cuda.is_available():
        return ["CUDA is not available in this process"]
    if torch.cuda.get_device_capability(dev) < (8, 0):
        return [f"needs compute capability >= 8.0, got {torch.cuda.get_device_capability(dev)}"]
    return []


def triton_cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def _reduce_dbias(ds: Tensor, bias: Tensor) -> Tensor:
    """Sum dS [B, Hq, Nq, Nk] over the dims the bias broadcasts along (its shape, its dtype)."""
    full = ds
    lead = full.dim() - bias.dim()
    if lead:
        full = full.sum(dim=tuple(range(lead)))
    dims = tuple(i for i, n in enumerate(bias.shape) if n == 1 and full.shape[i] != 1)
    return (full.sum(dim=dims, keepdim=True) if dims else full).to(bias.dtype)


def backward_gluon(args, q: Tensor, k: Tensor, v: Tensor, dout: Tensor, lse: Tensor, delta: Tensor, dq: Tensor,
                   dk: Tensor, dvv: Tensor, cap: tuple[int, int], bias_kind: int, dq_sums: bool = False,
                   record: Optional[dict] = None) -> bool:
    """dq, dk, dv by the Gluon kernel where it takes the inputs (gluon_backward_applies, strides TMA accepts) and
    builds: True when it wrote them. q, k, v, dout with unit last strides, lse fp32 contiguous, delta computed
    (bwd_delta), on q's device; with `dq_sums`, dq is an fp32 [B, Hq, Nq, D] contiguous buffer that receives dQ
    uncast. A failed build warns once per kind and returns False (FA_COMPILE_GLUON=1 raises), having written
    nothing the caller's `tl` kernels do not rewrite. `record`: as _backward_gluon's, of the launch that wrote them."""
    block_d, block_dv = _pow2(q.shape[-1]), _pow2(v.shape[-1])
    block = max(block_d, block_dv)
    gkey = ("bwd", block_d, block_dv, q.dtype, bool(args.causal), float(args.dropout_p) > 0, bias_kind)
    if gkey in _GLUON_FAILED or not gluon_backward_applies(args, cap) or not _tma_ok((q, k, v, dout), cap):
        return False
    try:
        cfg = CONFIG_OVERRIDE.get(("bwd_gluon", block)) or GLUON_BWD_CONFIGS[block]
        cfg = _tuned("bwd_gluon", block, cfg, q, bool(args.causal), bias_kind, cap,
                     lambda c: _backward_gluon(args, q, k, v, dout, lse, delta, dq, dk, dvv, block_d, block_dv, c,
                                               dq_sums))
        _backward_gluon(args, q, k, v, dout, lse, delta, dq, dk, dvv, block_d, block_dv, cfg, dq_sums, record)
        return True
    except Exception as e:  # compile-time failure
        if os.environ.get("FA_COMPILE_GLUON") == "1":
            raise
        _GLUON_FAILED.add(gkey)
        warnings.warn(f"fa_compile: the Gluon backward failed to build ({type(e).__name__}: "
                      f"{str(e)[:200]}); using the Triton backward instead", RuntimeWarning)
        return False


def bwd_delta(out: Tensor, dout: Tensor, delta: Tensor, cap: tuple[int, int]) -> None:
    """delta[b, h, i] = rowsum(out * dout) in fp32 (the backward's δ; out and dout with unit last strides)."""
    from .triton_bwd import attn_bwd_preprocess_kernel

    b, hq, nq, dv = out.shape
    pre_m = 16 if cap == (0, 0) else 64
    attn_bwd_preprocess_kernel[(triton_cdiv(nq, pre_m) * b * hq,)](
        out, dout, delta, out.stride(0), out.stride(1), out.stride(2), dout.stride(0), dout.stride(1),
        dout.stride(2), hq, nq, dv, BLOCK_M=pre_m, BLOCK_DV=_pow2(dv),
    )


def attention_backward(
    args, dout: Tensor, out: Tensor, lse: Tensor,
    grads: Optional[tuple[Tensor, Tensor, Tensor]] = None,
) -> tuple[Tensor, Tensor, Tensor, Optional[Tensor]]:
    """(dq, dk, dv, dbias | None); `grads` = preallocated (dq, dk, dv) buffers (tests poison them)."""
    from .triton_bwd import attn_bwd_dkdv_kernel, attn_bwd_dq_kernel

    q, k, v = _unit_last(args.q), _unit_last(args.k), _unit_last(args.v)
    dout, out = _unit_last(dout), _unit_last(out)
    lse = lse.to(torch.float32).contiguous()
    b, hq, nq, d = q.shape
    hkv, nk, dv = k.shape[1], k.shape[2], v.shape[3]
    if grads is None:
        dq, dk, dvv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    else:
        dq, dk, dvv = grads
    want_dbias = bool(args.bias_requires_grad) and args.bias is not None and args.bias.dtype != torch.bool
    if b * hkv * nk == 0 or b * hq * nq == 0:
        dq.zero_(), dk.zero_(), dvv.zero_()
        dbias = torch.zeros_like(args.bias) if want_dbias else None
        return dq, dk, dvv, dbias
    bias, bias_kind, bstr = _bias4(args.bias, b, hq, nq, nk)
    consts = _mask_consts(args, bias_kind)
    sc = _scalars(args)
    seed = args.dropout_seed.to(q.device).reshape(1) if consts["DROPOUT"] else q
    block_d, block_dv = _pow2(d), _pow2(dv)
    cap = _capability(q.device)
    delta = torch.empty((b, hq, nq), device=q.device, dtype=torch.float32)
    ds = torch.zeros((b, hq, nq, nk), device=q.device, dtype=torch.float32) if want_dbias else lse
    kvl = args.kv_lens if args.kv_lens is not None else q
    bias_arg = bias if bias is not None else q
    common = (
        sc["qk_scale"], sc["softcap"], sc["cap_scale"], float(args.scale), int(args.diag_offset),
        int(args.window_left), int(args.window_right), sc["drop_threshold"], sc["drop_scale"],
    )
    use_tma = _tma_ok((q, k, v, dout), cap)
    struct_kw = structure_kwargs(args, b)

    def descs(c: BlockConfig, kind: str) -> tuple:
        if not use_tma:
            return (q, q, q, q)
        bm, bn = c.block_m, c.block_n
        return (_desc(q, [1, 1, bm, block_d]), _desc(k, [1, 1, bn, block_d]),
                _desc(v, [1, 1, bn, block_dv]), _desc(dout, [1, 1, bm, block_dv]))

    with _device_ctx(q):
        bwd_delta(out, dout, delta, cap)
        if backward_gluon(args, q, k, v, dout, lse, delta, dq, dk, dvv, cap, bias_kind):
            return dq, dk, dvv, None
        block = max(block_d, block_dv)

        fused = fuses_dq(want_dbias)
        dqa = torch.empty((b, hq, nq, d), device=q.device, dtype=torch.float32) if fused else q

        def dkdv(c: BlockConfig) -> None:
            if fused:  # the atomics add into it: zeroed before each launch (tuning runs several)
                dqa.zero_()
            _launch(
                attn_bwd_dkdv_kernel, lambda c: (triton_cdiv(nk, c.block_n) * b * hkv,), c,
                q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
                v.stride(0), v.stride(1), v.stride(2), dout.stride(0), dout.stride(1), dout.stride(2),
                dk.stride(0), dk.stride(1), dk.stride(2), dvv.stride(0), dvv.stride(1), dvv.stride(2),
                *bstr, hq, hkv, hq // hkv, nq, nk, d, dv, *common,
                BLOCK_D=block_d, BLOCK_DV=block_dv, PLAIN=_plain(args, bias_kind), USE_TMA=use_tma, **consts,
                **struct_kw, DQA=dqa, FUSED_DQ=fused,
                args_fn=lambda c: (q, k, v, dout, lse, delta, dk, dvv, bias_arg, kvl, seed, *descs(c, "dkdv")),
            )

        def dq_(c: BlockConfig) -> None:
            _launch(
                attn_bwd_dq_kernel, lambda c: (triton_cdiv(nq, c.block_m) * b * hq,), c,
                q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
                v.stride(0), v.stride(1), v.stride(2), dout.stride(0), dout.stride(1), dout.stride(2),
                dq.stride(0), dq.stride(1), dq.stride(2),
                *bstr, hq, hq // hkv, nq, nk, d, dv, *common,
                BLOCK_D=block_d, BLOCK_DV=block_dv, WRITE_DS=want_dbias, REVERSE_M=bool(args.causal),
                PLAIN=_plain(args, bias_kind), USE_TMA=use_tma, **consts, **struct_kw,
                args_fn=lambda c: (q, k, v, dout, lse, delta, dq, ds, bias_arg, kvl, seed, *descs(c, "dq")),
            )

        # Each kernel stores (never accumulates) its outputs, so timing candidates leaves nothing behind.
        causal = bool(args.causal)
        dkdv(_tuned("dkdv", block, pick_config("dkdv", block, causal, cap), q, causal, bias_kind, cap, dkdv))
        if fused:
            dq.copy_(dqa.mul_(float(args.scale)))
        else:
            dq_(_tuned("dq", block, pick_config("dq", block, causal, cap), q, causal, bias_kind, cap, dq_))
    dbias = _reduce_dbias(ds, args.bias) if want_dbias else None
    return dq, dk, dvv, dbias


class TritonAttention:
    """Candidate object for fa_compile.dispatch (duck-typed args)."""

    name = "triton"
    never_reads_past_kv_lens = True  # pointer loads are masked there; TMA tiles are zeroed past the length

    def not_supported_reasons(self, args) -> list[str]:
        if not triton_available():
            return ["triton not installed"]
        q, k, v = args.q, args.k, args.v
        dev = q.device
        reasons = device_reasons(dev)
        if q.dtype == torch.float64:
            reasons.append("float64 is not supported (tensor cores have no fp64 path here)")
        elif q.dtype == torch.float32 and torch.get_float32_matmul_precision() == "highest":
            reasons.append("float32 needs TF32 (torch.set_float32_matmul_precision('high')); precision is 'highest'")
        elif q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            reasons.append(f"dtype {q.dtype} is not supported")
        elif q.dtype == torch.bfloat16 and dev.type == "cpu":
            reasons.append("bfloat16 under the Triton interpreter (its bf16 dot is unreliable)")
        d, dv = q.shape[-1], v.shape[-1]
        if d > MAX_HEAD_DIM or dv > MAX_HEAD_DIM:
            reasons.append(f"head dims {d}/{dv} exceed {MAX_HEAD_DIM}")
        if args.bias is not None and args.bias.dtype == torch.float64:
            reasons.append("float64 bias is not supported")
        reasons += absorbing_bias_refusal(args.bias, "our Triton family")
        return reasons

    def forward(self, args) -> tuple[Tensor, Tensor]:
        return attention_forward(args)

    def backward(self, args, dout: Tensor, out: Tensor, lse: Tensor):
        return attention_backward(args, dout, out, lse)


TRITON = TritonAttention()
