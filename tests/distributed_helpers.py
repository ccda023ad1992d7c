"""Run a function on N gloo ranks (CPU processes) and collect what each returns.

    results = run_ranks(world_size=2, fn=my_module_level_fn, args=(...))   # [rank 0's, rank 1's, ...]

`fn(rank, world_size, *args)` must be defined at module level (the ranks are spawned processes that
import it); the process group (gloo, over a FileStore in a fresh temporary directory, so no port is
raced for) is initialised before it runs and destroyed after. Spawning costs seconds, so one call
should run many cases and return their results (picklable: floats, strings, small tensors). The
first rank to raise fails the call with that rank's traceback; a rank that hangs fails it after
`timeout` seconds, with every rank killed.
"""
from __future__ import annotations

import os
import queue as queue_mod
import tempfile
import time
import traceback
from typing import Any, Callable, Sequence

import torch.multiprocessing as mp


def _worker(fn: Callable, rank: int, world_size: int, store_path: str, args: Sequence[Any], results) -> None:
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)  # the ranks share the machine's few cores
        dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world_size)
        try:
            value = fn(rank, world_size, *args)
        finally:
            dist.destroy_process_group()
        results.put((rank, True, value))
    except BaseException:  # noqa: BLE001  (reported to the parent, which fails the test)
        results.put((rank, False, traceback.format_exc()))


def run_ranks(world_size: int, fn: Callable, args: Sequence[Any] = (), timeout: float = 240.0) -> list:
    """[fn's return value on rank 0, rank 1, ...], or an AssertionError with the first failure."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_worker, args=(fn, r, world_size, store, tuple(args), results), daemon=True)
                 for r in range(world_size)]
        for p in procs:
            p.start()
        got: dict = {}
        deadline = time.monotonic() + timeout
        try:
            while len(got) < world_size:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"ranks {sorted(set(range(world_size)) - set(got))} of {world_size} "
                                         f"did not finish within {timeout:.0f} s")
                try:
                    rank, ok, value = results.get(timeout=min(left, 1.0))
                except queue_mod.Empty:
                    dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in got]
                    if dead:
                        raise AssertionError(f"rank {dead[0]} exited with code {procs[dead[0]].exitcode} "
                                             "without a result") from None
                    continue
                if not ok:
                    raise AssertionError(f"rank {rank} of {world_size} failed:\n{value}")
                got[rank] = value
        finally:
            for p in procs:
                p.join(timeout=5 if len(got) == world_size else 0.1)
                if p.is_alive():
                    p.kill()
                    p.join()
    return [got[r] for r in range(world_size)]
