"""Where the time of a `generate()` step goes, per variant, in ONE run: wall time per new token, the host
time spent inside the compiled forward (enqueueing its kernels), the host time outside it (transformers'
loop: mask building, logits processing, stopping checks, cache bookkeeping), the GPU's busy time and the
kernel launches per step. Every variant stays compiled side by side and the timed `generate()` calls are
interleaved round by round, so a shared host's drift falls on all of them alike.

A decode step whose GPU time is well under its wall time is host-bound: there the attention kernel's speed
cannot show, and the bound on what a faster forward can give is (wall of the peer) / (time outside the
forward), printed as "bound".

    python benchmarks/generate_steps.py --model llama --batch 2 --prompt 256 --new 64
    python benchmarks/generate_steps.py --model gpt2 --batch 4 --prompt 256 --new 64
    python benchmarks/generate_steps.py --model llama --batch 8 --prompt 4096 --new 128 --max-cache-len 16384
    python benchmarks/generate_steps.py --model gpt2 --batch 4 --dynamic-cache   # generate()'s default cache
    python benchmarks/generate_steps.py --fa3-env FA_COMPILE_DECODE_KERNEL=0 ...   # one more fa3 variant
    python benchmarks/generate_steps.py --hf-compile ...   # transformers' own compile of the decode steps
    python benchmarks/generate_steps.py --variants eager+fa3,sdpa+inductor,free-attention,free-attention-and-write
    python benchmarks/generate_steps.py --smoke     # tiny models on CPU, to check the script

Two variants are bounds, not results (their tokens are meaningless): "free-attention" is the model with an attention
that launches nothing (it returns the queries; transformers builds no mask for an attention it does not know) under
Inductor, so its tokens/s is what any attention implementation could reach at most with the rest of the step
unchanged; "free-attention-and-write" also skips the decode steps' cache writes, the bound for a kernel that would
append the new keys and values itself (as FA3's `flash_attn_with_kvcache` does).

--hf-compile leaves the compiling to `generate()` itself, as a user of a static cache gets it: transformers
runs the prefill eagerly and compiles the decode step with its `CompileConfig` (Inductor, mode
"reduce-overhead": CUDA graphs). The fa3 variant passes `CompileConfig(backend=fa_compile.backend())`, which
is what `FA_COMPILE=1` gives such a user without any code change. The forward's host time is not split out
there (the compiled call is transformers' own); "decode tokens/s" counts the tokens after the first one over
the time from the first token's logits to the end, in every mode.
"""
from __future__ import annotations

import argparse
import cProfile
import json
import math
import os
import pstats
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from models import FULL, SMOKE, backend_for, build  # noqa: E402

FREE = "free_attention"

VARIANTS = (("eager+fa3", "eager", "fa3"), ("sdpa+inductor", "sdpa", "inductor"), ("eager+inductor", "eager", "inductor"))
BOUNDS = (("free-attention", FREE, "inductor"), ("free-attention-and-write", FREE, "inductor"))


def register_free_attention() -> None:
    """Registers FREE with transformers: an attention that launches nothing ([B, N, H, D] as its attention
    functions return: the queries, transposed), for which transformers builds no mask."""
    from transformers import AttentionInterface

    def free(module, query, key, value, attention_mask, **kw):
        return query.transpose(1, 2), None

    AttentionInterface.register(FREE, free)


def skip_decode_writes(cache) -> None:
    """Makes each layer of a StaticCache return its buffers without writing a single new token (the decode
    steps); the prefill still fills the cache."""
    for layer in cache.layers:
        def update(key_states, value_states, *a, _orig=layer.update, _layer=layer, **kw):
            if key_states.shape[-2] > 1 or not getattr(_layer, "is_initialized", True):
                return _orig(key_states, value_states, *a, **kw)
            return _layer.keys, _layer.values

        layer.update = update


class FirstTokenClock:
    """A logits processor that notes when the prefill's logits exist (one synchronization per generate()):
    the decode steps are what follows."""

    def __init__(self, device: str):
        self.device, self.t = device, None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.t is None:
            _sync(self.device)
            self.t = time.perf_counter()
        return scores


class TimedForward:
    """Wraps a compiled forward: host seconds of each call (prefill = the first of a generate())."""

    def __init__(self, fn: Callable):
        self.fn = fn
        self.calls: list[float] = []

    def __call__(self, *args: Any, **kw: Any) -> Any:
        t0 = time.perf_counter()
        out = self.fn(*args, **kw)
        self.calls.append(time.perf_counter() - t0)
        return out


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _gpu_per_step(run: Callable, steps: int) -> tuple[float, float, list]:
    """(GPU busy µs, kernel launches, [(launches, µs, kernel)] most launched first) per decode step over
    one generate(): the prefill's share included."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    busy, launches, table = 0.0, 0, []
    for e in prof.key_averages():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.self_device_time_total > 0:
            busy += e.self_device_time_total
            launches += e.count
            table.append((round(e.count / steps, 2), round(e.self_device_time_total / steps, 1), e.key[:90]))
    return busy / steps, launches / steps, sorted(table, reverse=True)


def _paired(results: dict, label: str, key: str) -> Optional[float]:
    """Median over rounds of (SDPA's time / this variant's time) in the same round; None without SDPA's variant."""
    base = results.get("sdpa+inductor")
    if base is None:
        return None
    ratios = sorted(b / t for b, t in zip(base[key], results[label][key]))
    return round(ratios[len(ratios) // 2], 3)


def main(argv: Optional[list] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--max-cache-len", type=int, default=None, help="a StaticCache this long (default prompt + new)")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved timed generate() calls per variant")
    ap.add_argument("--variants", default=",".join(v[0] for v in VARIANTS))
    ap.add_argument("--cprofile", action="store_true", help="also print the top host functions of one generate() "
                    "per variant (Python profiler: slows the run it profiles, which is not timed)")
    ap.add_argument("--dynamic-cache", action="store_true", help="generate()'s default DynamicCache (it grows every "
                    "step: Dynamo recompiles once with a symbolic length) instead of a static cache")
    ap.add_argument("--fa3-env", action="append", default=[], metavar="NAME=VALUE",
                    help="one more eager+fa3 variant compiled with this environment variable set (repeatable)")
    ap.add_argument("--kernels", type=int, default=0, metavar="N",
                    help="also list each variant's N most launched CUDA kernels per step")
    ap.add_argument("--hf-compile", action="store_true", help="let generate() compile its decode steps itself "
                    "(transformers' CompileConfig, mode reduce-overhead); see the docstring")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args(argv)
    device = "cpu" if args.smoke or not torch.cuda.is_available() else "cuda"
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    if args.smoke:
        args.batch, args.prompt, args.new, args.rounds = 1, 8, 4, 2
    spec = (SMOKE if args.smoke else FULL)[args.model]
    inner = "aot_eager" if args.smoke else "inductor"
    import transformers

    env = {"torch": torch.__version__, "transformers": transformers.__version__, "device":
           torch.cuda.get_device_name() if device == "cuda" else "cpu", "model": args.model, "batch": args.batch,
           "prompt": args.prompt, "new": args.new, "max_cache_len": args.max_cache_len, "hf_compile": args.hf_compile}
    print(json.dumps(env), flush=True)
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 16)

    gen = torch.Generator(device="cpu").manual_seed(2)
    ids = torch.randint(0, spec["cfg"].get("vocab_size", 32000), (args.batch, args.prompt), generator=gen).to(device)
    runs: dict[str, Callable] = {}
    timers: dict[str, Optional[TimedForward]] = {}
    outs: dict[str, torch.Tensor] = {}
    wanted = [(label, attn, backend, {}) for label, attn, backend in VARIANTS + BOUNDS
              if label in args.variants.split(",")]
    if any(attn == FREE for _, attn, _, _ in wanted):
        register_free_attention()
    if args.dynamic_cache and any(label == "free-attention-and-write" for label, *_ in wanted):
        raise SystemExit("generate_steps.py: free-attention-and-write skips a StaticCache's writes; not with "
                         "--dynamic-cache")
    for kv in args.fa3_env:
        name, _, value = kv.partition("=")
        wanted.append((f"eager+fa3[{kv}]", "eager", "fa3", {name: value}))
    kernel_tables: dict[str, list] = {}
    clocks: dict[str, FirstTokenClock] = {}
    for label, attn, backend, env_vars in wanted:
        model = build(args.model, attn, dict(spec["cfg"]), device, dtype).eval()
        be = backend_for(backend, inner)
        clock = FirstTokenClock(device)
        from transformers import LogitsProcessorList, StaticCache

        kw = dict(max_new_tokens=args.new, min_new_tokens=args.new, do_sample=False, pad_token_id=0,
                  logits_processor=LogitsProcessorList([clock]))
        if args.hf_compile:
            from transformers import CompileConfig

            # transformers' default is (Inductor, "reduce-overhead"); the aot_eager smoke run takes no mode
            cc = CompileConfig(backend=be, mode=None if args.smoke else "reduce-overhead")
            cc._compile_all_devices = args.smoke
            kw["compile_config"] = cc
            timer = None  # transformers compiles its own call, which is not timed here
        else:
            kw["disable_compile"] = True
            timer = TimedForward(torch.compile(model.forward, backend=be, dynamic=None if args.dynamic_cache else False))
            model.forward = timer
        # One cache per variant, reset before each generate(): its buffers keep their addresses, as CUDA graphs
        # and the static addresses transformers marks on them need.
        cache = None
        if not args.dynamic_cache:
            cache = StaticCache(config=model.config, max_cache_len=args.max_cache_len or args.prompt + args.new)
            if label == "free-attention-and-write":
                skip_decode_writes(cache)

        def run(model=model, kw=kw, cache=cache, clock=clock) -> torch.Tensor:
            extra: dict = {}
            if cache is not None:
                cache.reset()
                extra = dict(past_key_values=cache)
            clock.t = None
            with torch.no_grad():
                return model.generate(ids, **kw, **extra)

        t0 = time.time()
        saved = {n: os.environ.get(n) for n in env_vars}
        os.environ.update(env_vars)  # read when the graphs are compiled, i.e. in these first calls
        try:
            outs[label] = run()  # compiles prefill and decode
            run()
            _sync(device)
        finally:
            for n, old in saved.items():
                if old is None:
                    os.environ.pop(n, None)
                else:
                    os.environ[n] = old
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        print(f"{label}: compiled and warmed in {time.time() - t0:.1f} s ({graphs} graphs compiled so far)", flush=True)
        runs[label], timers[label], clocks[label] = run, timer, clock

    results: dict[str, dict] = {k: dict(wall=[], fwd=[], prefill=[], calls=[], decode=[]) for k in runs}
    env["variants"] = list(runs)
    for _ in range(args.rounds):
        for label, run in runs.items():
            timer = timers[label]
            if timer is not None:
                timer.calls.clear()
            _sync(device)
            t0 = time.perf_counter()
            run()
            _sync(device)
            t1 = time.perf_counter()
            results[label]["wall"].append(t1 - t0)
            results[label]["decode"].append(t1 - clocks[label].t)
            if timer is None:  # --hf-compile
                results[label]["prefill"].append(float("nan"))
                results[label]["fwd"].append(float("nan"))
                results[label]["calls"].append(args.new - 1)
            else:
                results[label]["prefill"].append(timer.calls[0])
                results[label]["fwd"].append(sum(timer.calls[1:]))
                results[label]["calls"].append(len(timer.calls) - 1)  # decode steps: the first token is prefill's
    steps = args.new
    rows = []
    for label, r in results.items():
        i = sorted(range(len(r["wall"])), key=lambda j: r["wall"][j])[len(r["wall"]) // 2]  # the median run
        wall, fwd, pre, n = r["wall"][i], r["fwd"][i], r["prefill"][i], max(r["calls"][i], 1)
        dec = sorted(r["decode"])[len(r["decode"]) // 2]
        row = dict(variant=label, tokens_per_s=round(args.batch * steps / wall, 1),
                   tokens_per_s_runs=[round(args.batch * steps / w, 1) for w in r["wall"]],
                   decode_tokens_per_s=round(args.batch * (steps - 1) / dec, 1),
                   decode_tokens_per_s_runs=[round(args.batch * (steps - 1) / d, 1) for d in r["decode"]],
                   # The host drifts between rounds, and a round times every variant back to back: the median of
                   # each round's ratio to SDPA's is steadier than the ratio of the medians.
                   paired_vs_sdpa=_paired(results, label, "wall"),
                   ms_per_step=round((wall - pre) / n * 1e3, 3),  # setup and the last sync fall in "outside"
                   forward_host_ms_per_step=round(fwd / n * 1e3, 3), prefill_host_ms=round(pre * 1e3, 2))
        if args.hf_compile:  # the prefill's forward is eager here: the steps are timed from the first token on
            row["ms_per_step"] = round(dec / (steps - 1) * 1e3, 3)
        row["outside_ms_per_step"] = round(row["ms_per_step"] - row["forward_host_ms_per_step"], 3)
        if device == "cuda":
            busy, launches, kernel_tables[label] = _gpu_per_step(runs[label], n)
            row["gpu_us_per_step"], row["launches_per_step"] = round(busy, 1), round(launches, 1)
        rows.append(row)
        print(json.dumps(row), flush=True)
    bounds = {label for label, _, _ in BOUNDS}  # their tokens are meaningless
    same = {k: bool(torch.equal(v, next(iter(outs.values())))) for k, v in outs.items() if k not in bounds}
    print(json.dumps({"greedy_tokens_equal_to_first_variant": same}), flush=True)

    base = next((r for r in rows if r["variant"] == "sdpa+inductor"), None)
    head = ("| variant | tokens/s | vs sdpa | vs sdpa, paired by round | decode tokens/s | vs sdpa | ms / step | in forward (host) | outside forward | GPU busy / step | "
            "launches / step | bound |")
    lines = [head, "|" + " --- |" * (head.count("|") - 1)]
    for r in rows:
        vs = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x" if base else "-"
        vs_dec = f"{r['decode_tokens_per_s'] / base['decode_tokens_per_s']:.2f}x" if base else "-"
        # A forward that cost nothing: the step would be the time outside it (or the GPU's, if larger).
        outside = 0.0 if math.isnan(r["outside_ms_per_step"]) else r["outside_ms_per_step"]  # nan: --hf-compile
        floor = max(outside, r.get("gpu_us_per_step", 0) / 1e3)
        bound = f"{base['ms_per_step'] / floor:.2f}x" if base and floor > 0 else "-"
        paired = "-" if r["paired_vs_sdpa"] is None else f"{r['paired_vs_sdpa']:.2f}x"
        lines.append(f"| {r['variant']} | {r['tokens_per_s']} | {vs} | {paired} | {r['decode_tokens_per_s']} | {vs_dec} | "
                     f"{r['ms_per_step']} | "
                     f"{r['forward_host_ms_per_step']} | {r['outside_ms_per_step']} | "
                     f"{r.get('gpu_us_per_step', '-')} us | {r.get('launches_per_step', '-')} | {bound} |")
    text = "\n".join(lines)
    print("\n" + text, flush=True)

    for label, table in kernel_tables.items():
        if args.kernels:
            print(f"\n{label}: most launched kernels (launches / step, GPU us / step, name)")
            for row in table[:args.kernels]:
                print(f"  {row[0]:7.2f} {row[1]:8.1f}  {row[2]}")
    if args.cprofile:
        for label, run in runs.items():
            prof = cProfile.Profile()
            prof.enable()
            run()
            _sync(device)
            prof.disable()
            print(f"\n{label}: top host functions of one generate() by own time", flush=True)
            pstats.Stats(prof).sort_stats("tottime").print_stats(18)
    out_dir = os.environ.get("OUT")
    if out_dir:
        with open(os.path.join(out_dir, f"generate_steps-{args.model}-b{args.batch}-p{args.prompt}.json"), "w") as f:
            json.dump(dict(env=env, rows=rows, table=text), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
