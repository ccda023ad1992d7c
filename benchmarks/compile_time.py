"""Compile-time cost of the fa3 pass: a 12-layer GPT-2-size graph (Hugging Face
GPT2Config n_layer=12, n_embd=768, n_head=12, random weights) with attn_implementation "eager" and
"sdpa", compiled with backend="inductor" and with backend="fa3" (inner Inductor).

    python benchmarks/compile_time.py [--reps 2] [--seq 128] [--train] [--layers 12]

For each configuration it reports the compile time (first call minus a steady-state call, median of
--reps fresh compiles with Inductor's caches off), the pass's own time (fa_compile.compiler.run_pass)
and the number of attention sites rewritten. The goal: the pass adds at most 10% to Inductor's
compile time. CPU is fine; this is a benchmark, not a test.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

# Inductor's on-disk caches would turn every repetition after the first into a cache hit.
os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "0")
os.environ.setdefault("TORCHINDUCTOR_AUTOGRAD_CACHE", "0")
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="fa_compile_bench_"))

import torch  # noqa: E402

import fa_compile  # noqa: E402
import fa_compile.compiler as compiler  # noqa: E402


class PassTimer:
    """Wraps fa_compile.compiler.run_pass (looked up at call time by the backend) to time it."""

    def __init__(self):
        self.seconds = 0.0
        self.rewritten = 0
        self.sites = 0
        self._orig = compiler.run_pass

    def __enter__(self):
        def timed(gm, *args, **kwargs):  # (run_pass's own arguments, whatever they are)
            t0 = time.perf_counter()
            reports = self._orig(gm, *args, **kwargs)
            self.seconds += time.perf_counter() - t0
            self.sites += len(reports)
            self.rewritten += sum(r.rewritten for r in reports)
            return reports

        compiler.run_pass = timed
        return self

    def __exit__(self, *exc):
        compiler.run_pass = self._orig


def build(attn: str, layers: int, seq: int):
    import transformers

    cfg = transformers.GPT2Config(n_layer=layers, n_embd=768, n_head=12, n_positions=max(1024, seq),
                                  attn_implementation=attn, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    ids = torch.randint(0, cfg.vocab_size, (1, seq), generator=torch.Generator().manual_seed(0))
    return model, ids


def run_once(model, ids, train: bool):
    if train:
        model(input_ids=ids).logits.float().sum().backward()
    else:
        with torch.no_grad():
            model(input_ids=ids)


def compile_once(model, ids, backend: str, train: bool) -> tuple[float, float, PassTimer]:
    """(compile seconds, steady-state call seconds, pass timer) of one fresh compile."""
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend)
    with PassTimer() as timer:
        t0 = time.perf_counter()
        run_once(compiled, ids, train)
        first = time.perf_counter() - t0
    t0 = time.perf_counter()
    run_once(compiled, ids, train)
    again = time.perf_counter() - t0
    return first - again, again, timer


def measure(attn: str, args) -> list[dict]:
    """Inductor and fa3 compiled alternately (paired), so load drifting on the machine hits both."""
    model, ids = build(attn, args.layers, args.seq)
    model.train(args.train)
    runs: dict = {"inductor": [], "fa3": []}
    for _ in range(args.reps):
        for backend in ("inductor", "fa3"):
            runs[backend].append(compile_once(model, ids, backend, args.train))
    rows = []
    for backend, rs in runs.items():
        rows.append(dict(attn=attn, backend=backend, compile=statistics.median(r[0] for r in rs),
                         steady=statistics.median(r[1] for r in rs), pass_s=statistics.median(r[2].seconds for r in rs),
                         rewritten=rs[-1][2].rewritten, sites=rs[-1][2].sites, all=[round(r[0], 2) for r in rs]))
    base, ours = rows
    ours["overhead"] = statistics.median((o[0] - b[0]) / b[0] for o, b in zip(runs["fa3"], runs["inductor"]))
    ours["pass_frac"] = ours["pass_s"] / base["compile"]
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--train", action="store_true", help="compile forward + backward (default: inference)")
    p.add_argument("--attn", nargs="+", default=["eager", "sdpa"])
    args = p.parse_args(argv)
    import transformers

    torch.set_num_threads(max(1, torch.get_num_threads()))
    # Warm up the compiler stack (imports, first-use initialisation) so that no row pays for it.
    for attn in args.attn:
        warm, wids = build(attn, 1, 16)
        warm.train(args.train)
        for backend in ("inductor", "fa3"):
            compile_once(warm, wids, backend, args.train)

    print(f"torch {torch.__version__}, transformers {transformers.__version__}, fa_compile {fa_compile.__version__}, "
          f"python {sys.version.split()[0]}, {torch.get_num_threads()} threads; GPT-2 n_layer={args.layers} "
          f"n_embd=768 n_head=12, batch 1 x seq {args.seq}, fp32 CPU, "
          f"{'forward+backward' if args.train else 'inference (no_grad)'}, median of {args.reps} compiles")
    rows = []
    for attn in args.attn:
        rows += measure(attn, args)
    head = ("attn", "backend", "compile s", "each compile s", "runs s", "pass s", "pass / inductor",
            "total vs inductor", "sites rewritten")
    lines = [head]
    for r in rows:
        lines.append((r["attn"], r["backend"], f"{r['compile']:.2f}", " ".join(f"{c:.1f}" for c in r["all"]),
                      f"{r['steady']:.3f}",
                      f"{r['pass_s']:.3f}" if r["backend"] == "fa3" else "-",
                      f"{100 * r['pass_frac']:.2f}%" if "pass_frac" in r else "-",
                      f"{100 * r['overhead']:+.1f}%" if "overhead" in r else "-",
                      f"{r['rewritten']}/{r['sites']}" if r["backend"] == "fa3" else "-"))
    widths = [max(len(l[i]) for l in lines) for i in range(len(head))]
    for i, l in enumerate(lines):
        print("  ".join(c.rjust(w) if j > 1 else c.ljust(w) for j, (c, w) in enumerate(zip(l, widths))))
        if i == 0:
            print("  ".join("-" * w for w in widths))
    print("compile s: first call minus a steady-state call (median); runs s: a steady-state call; pass s: "
          "fa_compile.compiler.run_pass (canonicalize + fused calls + softmax sites + DCE); total vs inductor: "
          "median of the paired relative differences (machine noise included)")


if __name__ == "__main__":
    main()
