"""First-call tile tuning for our kernels: opt-in with FA_COMPILE_TUNE=1, the switch that also times
the kernel choice (fa_compile/tuning.py).

Tiles are static per (kernel, head-dim block, causal, bias kind, capability) from the H200 runs in
benchmarks/results/kernels.md. With tuning on, the first call of such a key on a CUDA device times the
pruned candidate list triton_family gives (the measured default and its one or two runners-up: a few
compiles of a few seconds each, once per key and machine), then caches the fastest in memory and on
disk (tiles.json beside tuning.json) under a key naming the GPU and the torch / Triton versions.
Every candidate writes the full outputs, so the caller simply runs the winner afterwards.
"""
from __future__ import annotations

import functools
import math
import os
import threading
from typing import Callable, Optional, Sequence, TypeVar

import torch

from . import tuning_cache

C = TypeVar("C")
ENABLED: Optional[bool] = None  # None: read FA_COMPILE_TUNE (fa_compile.tuning.enable() sets this too)
_MEM: dict = {}
_LOCK = threading.Lock()


def enabled() -> bool:
    if ENABLED is not None:
        return ENABLED
    return os.environ.get("FA_COMPILE_TUNE", "0").strip().lower() in ("1", "true", "yes", "on")


def cache_path() -> str:
    return tuning_cache.cache_file("tiles.json")


@functools.lru_cache(maxsize=None)
def _device_key(index: int) -> str:
    import triton

    cap = torch.cuda.get_device_capability(index)
    return f"{torch.cuda.get_device_name(index)}|sm{cap[0]}{cap[1]}|torch{torch.__version__}|triton{triton.__version__}"


def _time_ms(run: Callable[[], None]) -> float:
    return tuning_cache.time_ms(run, reps=3)


def choose(key: str, device: torch.device, candidates: Sequence[C], run: Callable[[C], None],
           encode: Callable[[C], list], decode: Callable[[list], C],
           timer: Callable[[Callable[[], None]], float] = _time_ms) -> C:
    """The cached or measured fastest of `candidates` for `key` (the first one when tuning is off,
    there is nothing to choose, the device is not CUDA or a CUDA graph is being captured).
    A candidate whose run raises (out of resources, a compile error) is skipped."""
    if len(candidates) < 2 or not enabled() or device.type != "cuda":
        return candidates[0]
    dev = _device_key(device.index if device.index is not None else torch.cuda.current_device())
    hit = _MEM.get((dev, key))
    if hit is None:
        stored = tuning_cache.load(cache_path()).get(dev, {}).get(key)
        if stored is not None:
            hit = _MEM[(dev, key)] = decode(stored)
    if hit is not None and hit in candidates:
        return hit
    if torch.cuda.is_current_stream_capturing():
        return candidates[0]
    with _LOCK:
        times = []
        for c in candidates:
            try:
                times.append(timer(lambda c=c: run(c)))
            except Exception:
                times.append(math.inf)
    best = min(range(len(candidates)), key=lambda i: (times[i], i))
    if math.isinf(times[best]):
        return candidates[0]
    _MEM[(dev, key)] = candidates[best]
    tuning_cache.store(cache_path(), dev, key, encode(candidates[best]))
    return candidates[best]
