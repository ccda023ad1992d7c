"""The kernel candidates behind `torch.ops.fa3.attention` and the order dispatch tries them in.

The order is measured, not guessed. Three sources, all one H200, torch 2.11.0+cu130, cuDNN 9.19,
bf16, medians of triton.testing.do_bench:
  [A] the peer anchors (shared/anchors/h200-2026-11-29.json): B*N = 16k tokens, H*D = 2048;
  [P] benchmarks/dispatch_probe.py, our candidates called as dispatch calls them, same run
      (benchmarks/results/dispatch_h200.json);
  [O] benchmarks/op_overhead.py, host and GPU time per op call (BENCHMARKS.md).
  [P]'s forward / backward ms:

  | shape (causal)                     | cudnn         | fa3   | triton        | flash         | efficient     |
  | Llama B2 N4096 Hq16/Hkv8 D128      | 0.255 / 0.798 | 0.206 | 0.369 / 1.408 | 0.528 / 1.448 | (GQA refused) |
  | GPT-2 B4 N2048 H16 D64             | 0.102 / 0.313 | 0.092 | 0.129 / 0.547 | 0.158 / 0.446 | 0.338 / -     |
  | B16 N1024 H16 D128                 | 0.156 / 0.554 | 0.143 | 0.250 / 0.867 | 0.283 / 0.844 | 0.494 / -     |
  | decode B32 Hq32/Hkv8 Nk4096 D128   | 0.133         | 0.139 | 0.587         | 0.206         | (GQA refused) |

* cuDNN first in both directions by default: fastest backward at every shape in [P] and [A]
  (e.g. [A] D128 N4096 non-causal backward 526 vs FA2 289 vs mem-efficient 136 TFLOP/s), fastest
  forward for decode [P] and at N = 1024 in [A] (all 6 configurations, e.g. D128 causal 422 vs FA3 233).
* FA3 moves ahead of cuDNN for the forward once Nq and Nk reach `FA3_FROM_TOKENS` = 2048: [A] FA3
  led in all 12 configurations from N = 4096 (5-29%), [P] led by 24% at the Llama shape and 11% at
  the GPT-2 shape (N = 2048). At N = 1024 the two sources disagree ([A] cuDNN 6/6, [P] FA3 +9% at
  B16 D128), so cuDNN keeps 1k; FA_COMPILE_TUNE=1 settles a given shape by measuring it.
* Our Triton family ahead of FA2 for the forward (Llama 0.369 vs 0.528, GPT-2 0.129 vs 0.158,
  1k 0.250 vs 0.283 ms) but behind it for decode (0.587 vs 0.206 ms: no split-KV), hence the
  `flash` promotion below `DECODE_MAX_Q`; behind FA2 for the backward (GPT-2 0.547 vs 0.446 ms,
  a tie at the other two shapes).
* 2026-12-01 re-run of [P] with the Gluon forward and backward (ms, forward / backward):
  | Llama B2 N4096 Hq16/Hkv8 D128      | 0.254 / 0.798 | 0.208 | 0.274 / 1.002 | 0.513 / 1.439 |
  | GPT-2 B4 N2048 H16 D64             | 0.103 / 0.313 | 0.093 | 0.132 / 0.382 | 0.160 / 0.446 |
  | B16 N1024 H16 D128                 | 0.155 / 0.557 | 0.141 | 0.525 / 0.689 | 0.279 / 0.846 |
  | decode B32 Hq32/Hkv8 Nk4096 D128   | 0.133         | 0.138 | 0.416         | 0.205         |
  Our backward now leads FA2 at all three shapes when its Gluon kernel applies (the promotion below;
  cuDNN stays first); on other GPUs the `tl` pair keeps its place behind FA2. Our forward at B16 N1024
  fell behind FA2 (0.525 vs 0.279 ms; 0.250 with the `tl` forward on 11-29), not yet explained, so the
  forward order is unchanged (ours still leads FA2 at the other two prefill shapes).
* Our split-KV decode kernel ("decode", fa_compile/kernels/decode.py) just ahead of our tiled family, for the calls
  with run-time positions (q_pos) and 1..16 query tokens: a static-cache decode step (q_pos, padding as
  a key bias), which no peer takes. It packs a GQA group's rows so each K/V tile is read once, ends each
  sequence's keys at its largest position + 1 and splits what remains so that small batches fill the
  GPU, where the tiled kernel runs one program per (query tile, head) over the keys in sequence. Without
  q_pos it stays out: those calls go to the peers or to our tiled family, which the compile-time lowering
  launches without a run-time dispatch, and the split-KV kernel is not yet measured against them. Calls
  with kv_lens beside a bias (a data mask's key limit read at run time, patterns/key_limit.py) on a cache
  over 2048 keys go to it ahead of cuDNN, which would read every key (promotion below; H200 2026-12-01,
  one HF eager decode step, B8, 32/8 heads, d128, 16384 slots of which 4096 valid, CUDA-graph replay:
  0.053 ms against 0.125 for the SDPA code under Inductor, benchmarks/key_limit.py).
* mem-efficient last before the reference (slowest everywhere; forward only, see sdpa.py).
* FA4: not installed on the lent H200, no measurement; after FA3 and opt-in only.
* The reference path is last and takes everything.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from . import common
from .fa3 import FA3
from .fa4 import FA4
from .sdpa import CUDNN, EFFICIENT, FLASH

# Base order (first = preferred) of the peers; dispatch inserts "decode", "triton" and "reference" by name.
FORWARD_ORDER = ("cudnn", "fa3", "fa4", "decode", "triton", "flash", "efficient", "reference")
BACKWARD_ORDER = ("cudnn", "fa3", "fa4", "flash", "triton", "efficient", "reference")

FA3_FROM_TOKENS = 2048
DECODE_MAX_Q = 64


@dataclass(frozen=True)
class Promotion:
    """Move `name` just ahead of `ahead_of` when `when(args)` holds; `evidence` says why."""

    name: str
    ahead_of: str
    when: Callable
    evidence: str
    direction: str = "forward"


def _long_prefill(args) -> bool:
    nq, nk = common.static_int(args.q.shape[2]), common.static_int(args.k.shape[2])
    return nq is not None and nk is not None and min(nq, nk) >= FA3_FROM_TOKENS


def _decode(args) -> bool:
    nq = common.static_int(args.q.shape[2])
    return nq is not None and nq <= DECODE_MAX_Q


def _key_lengths(args) -> bool:
    return args.kv_lens is not None


def _limited_decode(args) -> bool:
    """A decode step over a long cache with key lengths beside a bias (patterns/key_limit.py's limit)."""
    nq, nk = common.static_int(args.q.shape[2]), common.static_int(args.k.shape[2])
    return (nq is not None and nq <= 16 and nk is not None and nk > 2048
            and args.kv_lens is not None and args.bias is not None)


def _gluon_backward(args) -> bool:
    """Our Triton family's backward runs its Gluon kernel (fa_compile/kernels/gluon_bwd.py) for these inputs."""
    cap = common.device_capability(args.q.device)
    if cap is None:
        return False
    from ..kernels.triton_family import gluon_backward_applies  # noqa: PLC0415

    return gluon_backward_applies(args, cap)


PROMOTIONS = (
    Promotion("fa3", "cudnn", _long_prefill,
              "FA3 forward led cuDNN from N = 2048: [A] 12/12 configurations at N >= 4096, [P] +24% Llama, +11% GPT-2"),
    Promotion("fa3", "cudnn", _key_lengths,
              "kv_lens: FA3 takes them natively (seqused_k), cuDNN through a bias built per call; static-cache "
              "decode (B2, 16/8 heads, 320 keys, d128): cuDNN 337 us of host time per call [O]"),
    Promotion("decode", "cudnn", _limited_decode,
              "decode with kv_lens and a bias: cuDNN folds both into one bias per call and reads every key, the "
              "split-KV kernel stops at kv_lens: B8, 32/8 heads, d128, 4096 of 16384 slots valid, 0.053 ms vs "
              "0.125 for SDPA code under Inductor (benchmarks/key_limit.py, H200)"),
    Promotion("flash", "triton", _decode,
              "decode (Nq = 1, 4096 keys, GQA 32/8): FA2 0.206 ms vs our Triton 0.587 ms [P]"),
    Promotion("triton", "flash", _gluon_backward,
              "backward with our Gluon kernel on Hopper [P 2026-12-01]: Llama 1.002 vs FA2 1.439 ms, GPT-2 0.382 vs "
              "0.446, B16 N1024 0.689 vs 0.846 (cuDNN first at all three: 0.798, 0.313, 0.557)",
              direction="backward"),
)


def peer_candidates() -> list:
    """The peers this install has code for (each says itself whether its library is importable)."""
    return [CUDNN, FA3, FA4, FLASH, EFFICIENT]


TRITON_IMPORT_ERROR: list = []


def triton_candidate():
    """Our Triton family (`fa_compile/kernels/triton_family.py`), or None when it or triton is missing."""
    try:
        from ..kernels.triton_family import TRITON  # noqa: PLC0415
    except Exception as e:
        TRITON_IMPORT_ERROR[:] = [f"{type(e).__name__}: {str(e)[:160]}"]
        return None
    return TRITON


def decode_candidate():
    """Our split-KV decode kernel for decode-shaped calls (`fa_compile/kernels/decode.py`), or None without triton."""
    try:
        from ..kernels.decode import DECODE  # noqa: PLC0415
    except Exception:
        return None
    return DECODE


def has_backward(cand) -> bool:
    hb = getattr(cand, "has_backward", None)
    return True if hb is None else bool(hb())
