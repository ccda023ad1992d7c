"""Measured kernel choice per shape bucket (opt-in, like Inductor's max-autotune).

With FA_COMPILE_TUNE=1 (or `enable()`), the first call of a shape bucket on a CUDA device times
every eligible candidate a few times and keeps the fastest; the winner is cached in memory and on
disk (FA_COMPILE_CACHE_DIR, default ~/.cache/fa_compile/tuning.json) under a key naming the GPU,
its capability and the torch / CUDA / cuDNN / FA3 versions, so another machine or an upgrade
measures again. Never measures on fake tensors, while a CUDA graph is being captured, or for a
forced kernel; without a measurement the static order stands.

A bucket: direction, dtype, head dims, GQA group, causal/window/bias/kv_lens/softcap flags and the
powers of two above Nq and Nk (and B*Hq, coarsely), so a model's few shapes cost a few timings.
"""
from __future__ import annotations

import contextlib
import functools
import math
import threading
from typing import Callable, Optional

import torch

from . import config
from .kernels import tuning_cache

_ENABLED: Optional[bool] = None  # None: read FA_COMPILE_TUNE
_MEM: dict = {}
_LOCK = threading.Lock()


def enable(on: Optional[bool] = True) -> None:
    """Turn tuning on or off for this process (overrides FA_COMPILE_TUNE; None restores it): the kernel
    choice here and our kernels' first-call tile choice (fa_compile/kernels/tile_tuning.py)."""
    global _ENABLED
    _ENABLED = on
    from .kernels import tile_tuning

    tile_tuning.ENABLED = on


_SCOPED = threading.local()  # `scoped(on)`: a setting for one compile (one backend), innermost wins


@contextlib.contextmanager
def scoped(on: Optional[bool]):
    """Tuning on / off inside the block only (None: no change); `fa_compile.backend(tune=True)` wraps
    its compile-time choices in it, so one backend's setting does not leak into the process."""
    prev = getattr(_SCOPED, "on", None)
    if on is not None:
        _SCOPED.on = on
    try:
        yield
    finally:
        _SCOPED.on = prev


def enabled() -> bool:
    on = getattr(_SCOPED, "on", None)
    if on is not None:
        return on
    if _ENABLED is not None:
        return _ENABLED
    return config.flag_on("FA_COMPILE_TUNE")


def cache_path() -> str:
    return tuning_cache.cache_file("tuning.json")


def _pow2(n) -> int:
    try:
        n = int(n)
    except Exception:
        return -1
    return 1 if n <= 1 else 1 << math.ceil(math.log2(n))


def bucket(args, direction: str) -> str:
    q, k, v = args.q, args.k, args.v
    b, hq, nq, d = q.shape
    hkv, nk, dv = k.shape[1], k.shape[2], v.shape[3]
    flags = "".join(ch for ch, on in (
        ("c", args.causal), ("w", args.window_left >= 0 or args.window_right >= 0), ("b", args.bias is not None),
        ("l", args.kv_lens is not None), ("s", args.softcap > 0), ("g", args.bias_requires_grad)) if on)
    return (f"{direction}|{str(q.dtype).replace('torch.', '')}|d{int(d)}/{int(dv)}|g{int(hq) // max(int(hkv), 1)}"
            f"|nq{_pow2(nq)}|nk{_pow2(nk)}|bh{_pow2(int(b) * int(hq))}|{flags or '-'}")


def device_key(device: torch.device) -> str:
    return _device_key(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _device_key(index: int) -> str:
    device = torch.device("cuda", index)
    try:
        import flash_attn_interface  # noqa: F401,PLC0415
        from importlib.metadata import version  # noqa: PLC0415

        fa3 = version("tokenspeed-fa3")
    except Exception:
        fa3 = "none"
    name = torch.cuda.get_device_name(device)
    cap = torch.cuda.get_device_capability(device)
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return f"{name}|sm{cap[0]}{cap[1]}|torch{torch.__version__}|cuda{torch.version.cuda}|cudnn{cudnn}|fa3-{fa3}"


def _load() -> dict:
    return tuning_cache.load(cache_path())


def _store(dev: str, key: str, name: str) -> None:
    tuning_cache.store(cache_path(), dev, key, name)


def cached(args, direction: str) -> Optional[str]:
    if args.q.device.type != "cuda" or not torch.cuda.is_available():
        return None
    dev, key = device_key(args.q.device), bucket(args, direction)
    if (dev, key) in _MEM:
        return _MEM[(dev, key)]
    name = _load().get(dev, {}).get(key)
    if name is not None:
        _MEM[(dev, key)] = name
    return name


def _time(fn: Callable, reps: int = 5) -> float:
    return tuning_cache.time_ms(fn, reps)


def measure(args, direction: str, eligible: list, bwd_inputs: Optional[Callable] = None) -> dict:
    """Median milliseconds per eligible candidate (inf for one that fails)."""
    result = {}
    extra = bwd_inputs(args) if direction == "backward" and bwd_inputs is not None else ()
    for cand in eligible:
        run = (lambda c=cand: c.forward(args)) if direction == "forward" else (lambda c=cand: c.backward(args, *extra))
        try:
            result[cand.name] = _time(run)
        except Exception:
            result[cand.name] = math.inf
    return result


def choose(args, direction: str, eligible: list, *, measure: bool, bwd_inputs: Optional[Callable] = None) -> str:
    """The cached winner for the bucket among `eligible`, measuring once when allowed."""
    names = [c.name for c in eligible]
    hit = cached(args, direction)
    if hit in names:
        return hit
    if not measure or torch.cuda.is_current_stream_capturing():
        return names[0]
    with _LOCK:
        times = globals()["measure"](args, direction, eligible, bwd_inputs)
    best = min(names, key=lambda n: (times.get(n, math.inf), names.index(n)))
    if math.isinf(times.get(best, math.inf)):
        return names[0]
    dev, key = device_key(args.q.device), bucket(args, direction)
    _MEM[(dev, key)] = best
    _store(dev, key, best)
    return best
