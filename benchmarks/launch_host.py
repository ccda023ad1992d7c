"""Host µs per kernel launch inside Inductor's generated code of a compiled decode step (device run).

A decode step of a small model is host-bound: the GPU waits for the host to enqueue each kernel. This
script compiles one step of a Hugging Face decoder (static cache, one new token per sequence) per variant,
then times every Triton kernel's `.run(...)` call in Inductor's code: its median in the step (each launch
wrapped by a timer, 200 steps) and in a tight loop of the same arguments (300 calls). Extern calls
(cuBLAS GEMMs, cuDNN attention) are not `.run` calls and are not listed.

Variants: "fa3" (eager attention code under backend="fa3": the decode kernel lowered at compile time),
"fa3-1split" (the same with the decode kernel's split count forced to 1: no combine launch), "free" (an
attention that launches nothing, under Inductor: what the rest of the step costs) and "sdpa" (the model's
SDPA code under Inductor).

    python benchmarks/launch_host.py --model gpt2 --variants fa3,fa3-1split,free,sdpa
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from generate_steps import FREE, register_free_attention  # noqa: E402
from models import FULL, backend_for, build  # noqa: E402


@contextlib.contextmanager
def one_split() -> Iterator[None]:
    """The decode kernel's planner returns one split while a graph compiles (the choice is made then)."""
    from fa_compile.kernels import decode

    orig = decode.choose_num_splits
    decode.choose_num_splits = lambda *a, **k: 1
    try:
        yield
    finally:
        decode.choose_num_splits = orig


def compiled_step(model: str, variant: str, batch: int, prompt: int, cache_len: int) -> Any:
    """A no-grad callable running one compiled decode step at position `prompt` (compiled and warmed)."""
    from transformers import StaticCache

    attn = {"sdpa": "sdpa", "free": FREE}.get(variant, "eager")
    backend = "inductor" if variant in ("sdpa", "free") else "fa3"
    spec = FULL[model]
    m = build(model, attn, dict(spec["cfg"]), "cuda", torch.bfloat16).eval()
    ids = torch.randint(0, spec["cfg"].get("vocab_size", 32000), (batch, prompt), device="cuda",
                        generator=torch.Generator(device="cuda").manual_seed(2))
    cache = StaticCache(config=m.config, max_cache_len=cache_len)
    with torch.no_grad():
        m(input_ids=ids, past_key_values=cache, cache_position=torch.arange(prompt, device="cuda"), use_cache=True)
    f = torch.compile(m.forward, backend=backend_for(backend, "inductor"), dynamic=False)
    pos = torch.tensor([prompt], device="cuda")
    tok = ids[:, :1].contiguous()

    def step() -> Any:
        for layer in cache.layers:  # transformers >= 5.2x: a StaticLayer writes at its own counter
            if hasattr(layer, "cumulative_length"):
                layer.cumulative_length.fill_(prompt)
        with torch.no_grad():
            return f(input_ids=tok, past_key_values=cache, cache_position=pos, use_cache=True)

    with one_split() if variant == "fa3-1split" else contextlib.nullcontext():
        for _ in range(3):
            step()
    torch.cuda.synchronize()
    return step


def launches(step: Any, steps: int = 200, loop: int = 300) -> list[tuple[str, float, float, float, int]]:
    """(kernel, launches per step, median µs in the step, µs per call in a tight loop, arguments) per kernel."""
    from torch._inductor.runtime import triton_heuristics as th

    times: dict[str, list[int]] = collections.defaultdict(list)
    seen: dict[str, tuple] = {}
    orig = th.CachingAutotuner.run

    def timed(self: Any, *args: Any, stream: Any, **kw: Any) -> Any:
        t0 = time.perf_counter_ns()
        r = orig(self, *args, stream=stream, **kw)
        times[self.fn.__name__].append(time.perf_counter_ns() - t0)
        seen.setdefault(self.fn.__name__, (self, args, stream))
        return r

    th.CachingAutotuner.run = timed
    try:
        for _ in range(steps):
            step()
    finally:
        th.CachingAutotuner.run = orig
    torch.cuda.synchronize()
    rows = []
    for name, ts in sorted(times.items(), key=lambda kv: -sum(kv[1])):
        self, args, stream = seen[name]
        t0 = time.perf_counter_ns()
        for _ in range(loop):
            orig(self, *args, stream=stream)
        t1 = time.perf_counter_ns()
        torch.cuda.synchronize()
        rows.append((name, len(ts) / steps, statistics.median(ts) / 1e3, (t1 - t0) / loop / 1e3, len(args)))
    return rows


def host_per_step(steps: dict[str, Any], rounds: int = 5, calls: int = 50) -> dict[str, float]:
    """Median over interleaved rounds of the host µs per step (enqueue time; a host-bound step's wall time)."""
    res: dict[str, list[float]] = {v: [] for v in steps}
    for _ in range(rounds):
        for v, step in steps.items():
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(calls):
                step()
            res[v].append((time.perf_counter() - t0) / calls * 1e6)
            torch.cuda.synchronize()
    return {v: statistics.median(r) for v, r in res.items()}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt2", choices=sorted(FULL))
    ap.add_argument("--variants", default="fa3,fa3-1split,free,sdpa")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--cache", type=int, default=512, help="the static cache's length (sets the decode splits)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("launch_host.py times CUDA launches: no CUDA GPU here, nothing measured")
        return
    torch._inductor.config.fx_graph_cache = False  # fa3-1split compiles the same graph with another plan
    register_free_attention()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {args.model} B{args.batch}, "
          f"position {args.prompt}, cache {args.cache}")
    steps = {v: compiled_step(args.model, v, args.batch, args.prompt, args.cache) for v in args.variants.split(",")}
    for v, us in host_per_step(steps).items():
        print(f"{v}: host µs per step {us:.1f}")
    for v, step in steps.items():
        print(f"== {v}: kernel | launches per step | median µs per launch in the step | tight loop µs | arguments")
        for name, n, med, tight, nargs in launches(step):
            print(f"  {name[:64]:64s} {n:5.1f} {med:7.2f} {tight:7.2f} {nargs:3d}")


if __name__ == "__main__":
    main()
