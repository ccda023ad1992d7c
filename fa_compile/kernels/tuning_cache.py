"""The on-disk cache and the CUDA-event timer shared by the two measured choices: which kernel
(fa_compile/tuning.py) and which tile shape of our kernels (tile_tuning.py)."""
from __future__ import annotations

import json
import os
from typing import Callable

import torch


def cache_file(name: str) -> str:
    root = os.environ.get("FA_COMPILE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "fa_compile")
    return os.path.join(root, name)


def load(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except Exception:
        return {}


def store(path: str, dev: str, key: str, value) -> None:
    """data[dev][key] = value, written atomically (a concurrent reader sees the old file or the new one)."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        data = load(path)
        data.setdefault(dev, {})[key] = value
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only home: the in-memory caches still hold


def time_ms(run: Callable[[], None], reps: int) -> float:
    """Median milliseconds of `reps` timed calls after one warm-up call (compiles, plans, allocates)."""
    run()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]
