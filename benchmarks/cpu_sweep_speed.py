"""Forward time on CPU of the model sweep's architectures (benchmarks/model_sweep.py: tiny Hugging Face configs,
batch 2, 8 tokens, the padded inputs where the sweep has them), where host time is most of a call: the eager
attention code under `backend="fa3"`, the same with one lowering switched off at compile time (`--switch`, by
default FA_COMPILE_REFERENCE_MATH=0: sites aten's CPU flash kernel refuses keep the op and its run-time Python
reference; FA_COMPILE_DECODE_MATH=0: decode-sized sites, these 8-token forwards included, go to aten's CPU flash
kernel instead of the decode-step math), and the model's SDPA code under Inductor. Each model's variants are
timed in alternating rounds (median of `--reps` calls per round; the median over rounds). Lower is better. The fa3 variants' largest
difference from the eager model's output is printed (SDPA's code differs from it on the padded rows).

    python benchmarks/cpu_sweep_speed.py [--models gemma3_text,cohere2,...] [--rounds 5] [--reps 20]
                                         [--switch FA_COMPILE_DECODE_MATH]
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
import warnings
from pathlib import Path
from unittest import mock

import torch

import fa_compile

sys.path.insert(0, str(Path(__file__).resolve().parent))
import model_sweep as ms  # noqa: E402


def _median_ms(fn, reps: int) -> float:
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e3


def _first(o) -> torch.Tensor:
    return o[0] if isinstance(o, tuple) else o.last_hidden_state


def run(name: str, rounds: int, reps: int, switch: str = "FA_COMPILE_REFERENCE_MATH") -> dict:
    case = ms.MODELS[name]()
    torch._dynamo.reset()  # three compiled copies of one model's code per model: never near the recompile limit
    torch.manual_seed(0)
    eager = case.build().eval()
    sdpa = copy.deepcopy(eager)
    sdpa.set_attn_implementation("sdpa")
    inp = (case.padded or case.inputs)()
    # Each variant has a backend of its own: Dynamo reuses a compiled frame across copies of one model (their
    # parameters are inputs) but not across backends, so the second fa3 variant compiles afresh.
    off = f"fa3, {switch}=0"
    variants = {"fa3": torch.compile(copy.deepcopy(eager), backend="fa3"),
                off: torch.compile(copy.deepcopy(eager), backend=fa_compile.backend()),
                "SDPA + Inductor": torch.compile(sdpa)}
    with torch.no_grad():
        want = _first(eager(**inp))
        diff = {}
        for label, m in variants.items():  # the first call compiles, with the switch as the label says
            with mock.patch.dict(os.environ, {switch: "0"} if label == off else {}):
                diff[label] = float((_first(m(**inp)) - want).abs().max())
            for _ in range(3):
                m(**inp)
        times: dict[str, list[float]] = {k: [] for k in variants}
        for _ in range(rounds):
            for label, m in variants.items():
                times[label].append(_median_ms(lambda: m(**inp), reps))
    return {"ms": {k: statistics.median(v) for k, v in times.items()}, "max_diff": diff}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default=",".join(ms.MODELS))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--switch", default="FA_COMPILE_REFERENCE_MATH", choices=("FA_COMPILE_REFERENCE_MATH",
                                                                              "FA_COMPILE_DECODE_MATH"))
    opt = ap.parse_args()
    warnings.filterwarnings("ignore")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, fp32; ms per forward (median), ratio to SDPA")
    for name in opt.models.split(","):
        try:
            r = run(name, opt.rounds, opt.reps, opt.switch)
        except Exception as e:  # a model whose SDPA code does not exist in this transformers release
            print(f"{name:<18} skipped: {type(e).__name__}: {str(e)[:100]}", flush=True)
            continue
        base = r["ms"]["SDPA + Inductor"]
        cells = "  ".join(f"{k} {t:.3f} ({t / base:.2f}x)" for k, t in r["ms"].items())
        diffs = ", ".join(f"{d:.1e}" for k, d in r["max_diff"].items() if k.startswith("fa3"))
        print(f"{name:<18} {cells}  fa3's max |diff| vs eager {diffs}", flush=True)


if __name__ == "__main__":
    main()
