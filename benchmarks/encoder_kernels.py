"""Encoder forwards (no grad) under fa3, the attention kernel left to the compile-time choice or forced, beside
the same model's SDPA code under Inductor, in one process: which kernel a padded encoder's inference should run.

A key-padding mask built from `attention_mask` (Hugging Face's finfo.min) may leave a sequence with no key
at all, so each fa3 site carries an exact fix-up for such rows (the mean of V). cuDNN's lowering keeps
that fix-up as graph ops (a read of V and a pass over the output per layer) and adds a guard against NaN
keys under its additive mask; our Triton forward writes those rows itself and excludes masked keys
(lowering/empty_rows.py). Every variant is compiled first; the timed forwards are then interleaved round
by round (CUDA events, median of `--reps` calls per round, median over rounds).

    python benchmarks/encoder_kernels.py [--rounds 5] [--reps 10] [--models bert,bert-base,bert-d128,vit]
    python benchmarks/encoder_kernels.py --smoke     # tiny models on CPU (aot_eager) to check the script
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import models as M  # noqa: E402  (the same model builders and inputs as benchmarks/models.py)

SPECS = {
    "bert": M.FULL["bert"],  # hidden 1024, 16 heads, 8 layers, B32 x 512, half the batch half padded
    "bert-base": dict(B=64, N=128, cfg=dict(hidden_size=768, num_hidden_layers=8, num_attention_heads=12,
                                            intermediate_size=3072, vocab_size=30522, max_position_embeddings=512)),
    "bert-d128": dict(B=32, N=512, cfg=dict(M.FULL["bert"]["cfg"], num_attention_heads=8)),  # head dim 128
    "vit": M.FULL["vit"],
}
SMOKE = {"bert": M.SMOKE["bert"], "bert-base": M.SMOKE["bert"], "bert-d128": M.SMOKE["bert"], "vit": M.SMOKE["vit"]}
KERNELS = ("default", "triton", "cudnn")  # default: the lowering's own choice


def lowered_lines(model, kw: dict, kernel) -> list[str]:
    import fa_compile

    try:
        with torch.no_grad():  # as the timed forwards: the lowering's choice differs for training graphs
            text = str(fa_compile.explain(model, kernel=None if kernel == "default" else kernel, **kw))
    except Exception as e:
        return [f"explain failed: {type(e).__name__}: {str(e)[:200]}"]
    return sorted({line.split(": ", 1)[1] for line in text.splitlines() if line.startswith("lowered at site")})


def run(key: str, spec: dict, args) -> list[dict]:
    import fa_compile

    kind = key.split("-")[0]  # the builder: "bert-base" is a BERT

    dev = "cpu" if args.smoke else "cuda"
    dtype = torch.float32 if args.smoke else torch.bfloat16
    inner = "aot_eager" if args.smoke else "inductor"
    eager_model = M.build(kind, "eager", spec["cfg"], dev, dtype).eval()
    sdpa_model = M.build(kind, "sdpa", spec["cfg"], dev, dtype).eval()
    kw, _ = M.inputs(kind, eager_model, spec, dev, dtype)
    if args.empty_sequence and "attention_mask" in kw:
        kw = dict(kw, attention_mask=kw["attention_mask"].clone())
        kw["attention_mask"][0] = 0  # one sequence with every token padded
    torch._dynamo.config.recompile_limit = 64  # every variant is a compile of the same forward code
    variants = {}
    for k in KERNELS:
        be = fa_compile.backend(inner, kernel=None if k == "default" else k)
        own = copy.deepcopy(eager_model)
        variants[f"fa3 {k}"] = (torch.compile(own, backend=be, dynamic=False), own, k)
    variants["sdpa+inductor"] = (torch.compile(sdpa_model, backend=inner, dynamic=False), sdpa_model, None)
    with torch.no_grad():
        ref = eager_model(**kw)[0].float()
        outs, rows = {}, []
        for label, (fn, _, _) in variants.items():
            t0 = time.time()
            try:
                outs[label] = fn(**kw)[0].float()
                M.sync(dev)
                print(f"{kind} {label}: compiled in {time.time() - t0:.1f} s", flush=True)
            except Exception as e:  # a forced kernel that refuses the site fails at its first call
                print(f"{kind} {label}: failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
        times = {label: [] for label in outs}
        for _ in range(args.rounds):
            for label in outs:
                fn = variants[label][0]
                times[label].append(M.bench(lambda: fn(**kw), dev, args.reps))
    base = statistics.median(times["sdpa+inductor"]) if "sdpa+inductor" in times else None
    for label, ts in times.items():
        med = statistics.median(ts)
        out = outs[label]
        kernel = variants[label][2]
        row = dict(model=key, B=spec["B"], N=spec["N"], variant=label, ms=med, rounds=ts,
                   vs_sdpa=(med / base) if base else None,
                   max_abs_vs_eager=float((out - ref).abs().nan_to_num(float("inf")).max()),
                   nan_rows_match=bool(torch.equal(out.isnan(), ref.isnan())),
                   lowered=lowered_lines(eager_model, kw, kernel) if kernel else [])
        rows.append(row)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="bert,bert-base,bert-d128,vit")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--empty-sequence", action="store_true", help="pad every token of the first sequence")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--json", default=None, help="write the rows here")
    args = ap.parse_args(argv)
    specs = SMOKE if args.smoke else SPECS
    rows = []
    for key in args.models.split(","):
        rows += run(key, specs[key], args)
    print("\n| model | B x N | variant | forward ms | vs SDPA + Inductor | max abs vs eager | lowered (forward) |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        ratio = f"{r['vs_sdpa']:.3f}x" if r["vs_sdpa"] else "-"
        print(f"| {r['model']} | {r['B']} x {r['N']} | {r['variant']} | {r['ms']:.3f} | {ratio} | "
              f"{r['max_abs_vs_eager']:.3g} | {'; '.join(r['lowered'])} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(torch=torch.__version__, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
