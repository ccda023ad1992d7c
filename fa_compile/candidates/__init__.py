"""The kernel candidates behind `torch.ops.fa3.attention` and the order dispatch tries them in.

The order is measured, not guessed. Evidence: `shared/anchors/h200-2026-11-29.json` (one H200,
torch 2.11.0+cu130, cuDNN 9.19, bf16, medians of triton.testing.do_bench, B*N = 16k tokens,
H*D = 2048; TFLOP/s, higher is better):

* cuDNN ahead of FA2 ahead of mem-efficient, forward and backward: cuDNN led at every measured
  head dim (64/128/256), length (1k/4k/16k) and causal setting; e.g. D128 N4096 non-causal
  forward 619 / 341 / 171, backward 526 / 289 / 136.
* FA3 (tokenspeed-fa3) vs cuDNN forward, same run: at N = 1024 cuDNN led in all 6 configurations
  (D128 causal 422 vs 233, D128 non-causal 567 vs 511); from N = 4096 FA3 led in all 12 by
  5-29% (D128 N4096 674 vs 610 non-causal, 619 vs 522 causal; D256 N4096 causal 723 vs 559).
  Hence `FA3_FROM_TOKENS`: FA3 moves ahead of cuDNN when both Nq and Nk reach 4096.
* Decode (Nq = 1, GQA 32/8, D128, 2k-32k keys): cuDNN 3.97-4.21 TB/s, FA3 paged 3.61-4.02,
  FA2 2.5-4.2: cuDNN stays first (the FA3 rule needs Nq >= 4096).
* Our Triton family: no measurement in the anchors; it sits after FA2 and before mem-efficient
  until one exists (FA_COMPILE_TUNE=1 measures it per shape bucket on the device).
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

# Base order (first = preferred) of the peers; dispatch inserts "triton" and "reference" by name.
FORWARD_ORDER = ("cudnn", "fa3", "fa4", "flash", "triton", "efficient", "reference")
BACKWARD_ORDER = ("cudnn", "fa3", "fa4", "flash", "triton", "efficient", "reference")

FA3_FROM_TOKENS = 4096


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


PROMOTIONS = (
    Promotion("fa3", "cudnn", _long_prefill,
              "H200 anchors: FA3 forward led cuDNN by 5-29% at N >= 4096 in all 12 configurations, trailed at N = 1024"),
)


def peer_candidates() -> list:
    """The peers this install has code for (each says itself whether its library is importable)."""
    return [CUDNN, FA3, FA4, FLASH, EFFICIENT]


def triton_candidate():
    """Our Triton family (`kernels/triton_family.py`), or None when it or triton is missing."""
    try:
        from ..kernels.triton_family import TRITON  # noqa: PLC0415
    except Exception:
        return None
    return TRITON


def has_backward(cand) -> bool:
    hb = getattr(cand, "has_backward", None)
    return True if hb is None else bool(hb())
