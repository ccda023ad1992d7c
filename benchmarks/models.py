"""Whole-model benchmark: Hugging Face Llama (GQA), GPT-2, BERT (padding on half the batch) and ViT
from configs, random weights.

Variants per model, measured in one run (peers beside us, never against stored numbers):
  eager+fa3        attn_implementation="eager" under torch.compile(backend="fa3")
  eager+inductor   the same code under torch.compile(backend="inductor")
  sdpa+inductor    attn_implementation="sdpa" under torch.compile(backend="inductor")
Figures: forward latency (no grad), one training step (forward + loss + backward), peak memory
of the training step, compile time (first forward, first training step), generate() tokens/s with
a static KV cache (greedy, the model's forward compiled with the variant's backend; decoders only), the number of
attention sites rewritten / missed (fa_compile counters) and the kernels dispatch chose.

    python benchmarks/models.py                 # the device run: bf16, the shapes in BENCHMARKS.md
    python benchmarks/models.py --smoke         # tiny models on CPU, aot_eager, checks the script
Prints a table with ratios to sdpa+inductor; writes models.json and models.png to $OUT (or .).
Every variant runs in its own try/except; a time budget skips what would not fit (reported).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
import traceback
from typing import Callable, Optional

import torch

VARIANTS = (("eager+fa3", "eager", "fa3"), ("eager+inductor", "eager", "inductor"), ("sdpa+inductor", "sdpa", "inductor"))

FULL = {
    "llama": dict(B=2, N=4096, cfg=dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=8, num_attention_heads=16,
                                        num_key_value_heads=8, vocab_size=32000, max_position_embeddings=8192)),
    "gpt2": dict(B=4, N=2048, cfg=dict(n_embd=1024, n_layer=8, n_head=16, vocab_size=50257, n_positions=4096)),
    # encoder: the last half of the tokens of half the batch are padding (attention_mask 0)
    "bert": dict(B=32, N=512, cfg=dict(hidden_size=1024, num_hidden_layers=8, num_attention_heads=16,
                                       intermediate_size=4096, vocab_size=30522, max_position_embeddings=512)),
    # ViT-L-like: 224 / 16 = 14 x 14 patches + the class token = 197 tokens
    "vit": dict(B=64, N=197, cfg=dict(hidden_size=1024, num_hidden_layers=8, num_attention_heads=16,
                                      intermediate_size=4096, image_size=224, patch_size=16, num_labels=1000)),
}
SMOKE = {
    "llama": dict(B=1, N=32, cfg=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=256, max_position_embeddings=128)),
    "gpt2": dict(B=1, N=32, cfg=dict(n_embd=64, n_layer=2, n_head=4, vocab_size=256, n_positions=128)),
    "bert": dict(B=2, N=32, cfg=dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                                     vocab_size=256, max_position_embeddings=128)),
    "vit": dict(B=2, N=17, cfg=dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                                    image_size=32, patch_size=8, num_labels=10)),
}
DECODERS = ("llama", "gpt2")


def build(kind: str, attn: str, cfg: dict, device: str, dtype: torch.dtype):
    import transformers as tf

    config_cls, model_cls = {"llama": ("LlamaConfig", "AutoModelForCausalLM"),
                             "gpt2": ("GPT2Config", "AutoModelForCausalLM"),
                             "bert": ("BertConfig", "AutoModelForMaskedLM"),
                             "vit": ("ViTConfig", "AutoModelForImageClassification")}[kind]
    config = getattr(tf, config_cls)(**cfg)
    torch.manual_seed(0)
    model = getattr(tf, model_cls).from_config(config, attn_implementation=attn)
    return model.to(device=device, dtype=dtype)


def inputs(kind: str, model, spec: dict, device: str, dtype: torch.dtype) -> tuple[dict, dict]:
    """(forward kwargs, training-step kwargs: the forward's plus labels), the same for every variant."""
    b, n = spec["B"], spec["N"]
    gen = torch.Generator(device="cpu").manual_seed(1)
    if kind == "vit":
        size = model.config.image_size
        pixels = torch.randn((b, 3, size, size), generator=gen).to(device=device, dtype=dtype)
        labels = torch.randint(0, model.config.num_labels, (b,), generator=gen).to(device)
        return dict(pixel_values=pixels), dict(pixel_values=pixels, labels=labels)
    ids = torch.randint(0, model.config.vocab_size, (b, n), generator=gen).to(device)
    if kind == "bert":
        mask = torch.ones_like(ids)
        mask[: b // 2, n // 2:] = 0
        fwd = dict(input_ids=ids, attention_mask=mask)
        return fwd, dict(fwd, labels=ids)
    return dict(input_ids=ids), dict(input_ids=ids, labels=ids, use_cache=False)


def backend_for(name: str, inner: str, mode: Optional[str] = None):
    """'fa3' -> fa_compile's backend with the chosen inner compiler; 'inductor' -> `inner` itself."""
    if name == "fa3":
        import fa_compile

        return fa_compile.backend(inner, mode=mode)
    return inner


def compile_with(fn, name: str, args, **kw):
    """torch.compile(fn) for a variant; --mode goes to Inductor in every variant alike."""
    if name == "fa3":
        return torch.compile(fn, backend=backend_for(name, args.inner, args.mode), **kw)
    return torch.compile(fn, backend=args.inner, mode=args.mode, **kw)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def bench(fn: Callable, device: str, reps: int) -> float:
    """Median milliseconds of `reps` calls after two warm-up calls (CUDA events on the GPU)."""
    fn()
    fn()
    times = []
    for _ in range(reps):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


class Budget:
    def __init__(self, seconds: float):
        self.end = time.time() + seconds

    def left(self) -> float:
        return self.end - time.time()


def fa_counters() -> dict:
    from torch._dynamo.utils import counters

    return {k: int(v) for k, v in counters["fa_compile"].items()}


def kernel_stats() -> dict:
    from fa_compile import dispatch

    return {f"{d}:{n}": c for (d, n), c in sorted(dispatch.STATS.items())}


def reset_stats() -> None:
    from torch._dynamo.utils import counters

    from fa_compile import dispatch

    counters.clear()
    dispatch.STATS.clear()


def explain_text(model, kw: dict) -> str:
    import fa_compile

    try:
        return str(fa_compile.explain(model, **kw))
    except Exception as e:
        return f"explain failed: {type(e).__name__}: {str(e)[:300]}"


def run_variant(kind: str, label: str, attn: str, backend: str, spec: dict, args, budget: Budget) -> dict:
    device, dtype = args.device, args.dtype
    b, n = spec["B"], spec["N"]
    row: dict = {"model": kind, "variant": label, "B": b, "N": n}
    model = None
    try:
        torch._dynamo.reset()
        reset_stats()
        model = build(kind, attn, spec["cfg"], device, dtype)
        fwd_kw, train_kw = inputs(kind, model, spec, device, dtype)
        compiled = compile_with(model, backend, args)

        model.eval()
        with torch.no_grad():
            t0 = time.time()
            compiled(**fwd_kw)
            sync(device)
            row["compile_fwd_s"] = round(time.time() - t0, 1)
            row["fwd_ms"] = round(bench(lambda: compiled(**fwd_kw), device, args.reps), 3)
        if budget.left() < args.reserve_s:
            row["train"] = "skipped: time budget"
        else:
            model.train()
            if device == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()

            def step():
                out = compiled(**train_kw)
                out.loss.backward()
                for p in model.parameters():
                    p.grad = None

            t0 = time.time()
            step()
            sync(device)
            row["compile_train_s"] = round(time.time() - t0, 1)
            row["train_ms"] = round(bench(step, device, max(args.reps // 2, 3)), 3)
            if device == "cuda":
                row["peak_GB"] = round(torch.cuda.max_memory_allocated() / 1e9, 2)
        if backend == "fa3":
            c = fa_counters()
            row["sites_rewritten"] = c.get("sites_rewritten", 0)
            row["sites_missed"] = c.get("sites_missed", 0)
            row["graphs"] = c.get("graphs", 0)
            row["kernels"] = kernel_stats()
            if args.explain:
                model.eval()
                torch._dynamo.reset()
                row["explain"] = explain_text(model, {k: v[:1] for k, v in fwd_kw.items()})
    except Exception as e:
        row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
        if args.verbose:
            traceback.print_exc()
    finally:
        del model
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    print(json.dumps(row), flush=True)
    return row


def run_generate(kind: str, label: str, attn: str, backend: str, spec: dict, args) -> dict:
    """Greedy generate() with a static cache; the model's forward compiled with the variant's backend."""
    device, dtype = args.device, args.dtype
    b, prompt, new = args.gen_batch or spec["B"], args.prompt, args.new_tokens
    row: dict = {"model": kind, "variant": label, "B": b, "prompt": prompt, "new_tokens": new}
    model = None
    try:
        torch._dynamo.reset()
        reset_stats()
        cfg = dict(spec["cfg"])
        model = build(kind, attn, cfg, device, dtype).eval()
        model.forward = compile_with(model.forward, backend, args, dynamic=False)
        gen = torch.Generator(device="cpu").manual_seed(2)
        ids = torch.randint(0, model.config.vocab_size, (b, prompt), generator=gen).to(device)
        kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, cache_implementation="static",
                  disable_compile=True, pad_token_id=0)
        if args.max_cache_len:  # a static cache longer than prompt + new (its valid part a fraction of it)
            from transformers import StaticCache

            kw.pop("cache_implementation")
            row["max_cache_len"] = args.max_cache_len

            def fresh() -> dict:
                return dict(kw, past_key_values=StaticCache(config=model.config, max_cache_len=args.max_cache_len))
        else:
            def fresh() -> dict:
                return kw
        with torch.no_grad():
            t0 = time.time()
            model.generate(ids, **fresh())
            sync(device)
            row["compile_s"] = round(time.time() - t0, 1)
            rates = []
            for _ in range(args.gen_reps):  # the median of a few runs: a host-bound loop is noisy
                t0 = time.time()
                out = model.generate(ids, **fresh())
                sync(device)
                rates.append(b * (out.shape[1] - prompt) / (time.time() - t0))
        row["tokens_per_s"] = round(statistics.median(rates), 1)
        row["tokens_per_s_runs"] = [round(r, 1) for r in rates]
        if backend == "fa3":
            row["sites_rewritten"] = fa_counters().get("sites_rewritten", 0)
            row["kernels"] = kernel_stats()
    except Exception as e:
        row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
        if args.verbose:
            traceback.print_exc()
    finally:
        del model
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    print(json.dumps(row), flush=True)
    return row


def ratio(x, base) -> str:
    if not isinstance(x, (int, float)) or not isinstance(base, (int, float)) or not base:
        return "-"
    return f"{x / base:.2f}x"


def table(rows: list, gens: list) -> str:
    head = "| model | variant | fwd ms | vs sdpa | train ms | vs sdpa | peak GB | vs sdpa | compile s (fwd / train) | gen tok/s | vs sdpa | sites (rewritten / missed) | error |"
    lines = [head, "|" + " --- |" * (head.count("|") - 1)]
    gen_by = {(g["model"], g["variant"]): g for g in gens}
    seen = {(r["model"], r["variant"]) for r in rows}
    rows = rows + [dict(model=g["model"], variant=g["variant"]) for g in gens if (g["model"], g["variant"]) not in seen]
    for r in rows:
        base = next((x for x in rows if x["model"] == r["model"] and x["variant"] == "sdpa+inductor"), {})
        g = gen_by.get((r["model"], r["variant"]), {})
        gb = gen_by.get((r["model"], "sdpa+inductor"), {})
        sites = f"{r['sites_rewritten']} / {r['sites_missed']}" if "sites_rewritten" in r else "-"
        skipped = r.get("train") if isinstance(r.get("train"), str) else ""
        err = r.get("error") or g.get("error") or skipped or ""
        lines.append("| " + " | ".join(str(x) for x in (
            r["model"], r["variant"], r.get("fwd_ms", "-"), ratio(r.get("fwd_ms"), base.get("fwd_ms")),
            r.get("train_ms", "-"), ratio(r.get("train_ms"), base.get("train_ms")),
            r.get("peak_GB", "-"), ratio(r.get("peak_GB"), base.get("peak_GB")),
            f"{r.get('compile_fwd_s', '-')} / {r.get('compile_train_s', '-')}",
            g.get("tokens_per_s", "-"), ratio(g.get("tokens_per_s"), gb.get("tokens_per_s")), sites,
            (err or "")[:80].replace("|", "/"))) + " |")
    return "\n".join(lines)


def chart(rows: list, gens: list, path: str) -> Optional[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:
        return f"no chart: {type(e).__name__}"
    metrics = (("fwd_ms", "forward ms", rows), ("train_ms", "training step ms", rows), ("peak_GB", "peak GB (train)", rows),
               ("tokens_per_s", "generate tokens/s", gens))
    models = sorted({r["model"] for r in rows})
    labels = [v[0] for v in VARIANTS]
    fig, axes = plt.subplots(len(models), len(metrics), figsize=(4 * len(metrics), 3.2 * len(models)), squeeze=False)
    for i, m in enumerate(models):
        for j, (key, title, src) in enumerate(metrics):
            ax = axes[i][j]
            vals = [next((r.get(key) for r in src if r["model"] == m and r["variant"] == lab), None) for lab in labels]
            vals = [v if isinstance(v, (int, float)) else 0 for v in vals]
            ax.bar(range(len(labels)), vals, color=["#d62728", "#7f7f7f", "#1f77b4"])
            base = vals[labels.index("sdpa+inductor")] if "sdpa+inductor" in labels else 0
            for x, val in enumerate(vals):
                if val and base:
                    ax.text(x, val, f"{val / base:.2f}x", ha="center", va="bottom", fontsize=8)
            ax.set_xticks(range(len(labels)), labels, rotation=15, fontsize=8)
            ax.set_title(f"{m}: {title}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny models on CPU (fp32, aot_eager) to check the script")
    ap.add_argument("--models", default="llama,gpt2")
    ap.add_argument("--variants", default=",".join(v[0] for v in VARIANTS))
    ap.add_argument("--inner", default=None, help="inner compiler for every variant (default inductor; smoke: aot_eager)")
    ap.add_argument("--mode", default=None, help="torch.compile mode for every variant (e.g. reduce-overhead)")
    ap.add_argument("--budget-s", type=float, default=420.0, help="skip phases that would not fit (default 7 min)")
    ap.add_argument("--reserve-s", type=float, default=45.0, help="time a phase needs to be started")
    ap.add_argument("--reps", type=int, default=10, help="timed calls per figure (training step: half)")
    ap.add_argument("--prompt", type=int, default=None)
    ap.add_argument("--new-tokens", type=int, default=None)
    ap.add_argument("--gen-reps", type=int, default=3, help="timed generate() runs (median reported)")
    ap.add_argument("--gen-batch", type=int, default=None, help="generate() batch (default: the model's B)")
    ap.add_argument("--max-cache-len", type=int, default=None,
                    help="generate(): a StaticCache of this length instead of prompt + new tokens")
    ap.add_argument("--no-generate", action="store_true")
    ap.add_argument("--generate-only", action="store_true", help="skip forward / training, measure generate() only")
    ap.add_argument("--explain", action="store_true", help="also print fa_compile.explain() for the fa3 variant")
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args(argv)
    args.device = "cpu" if args.smoke or not torch.cuda.is_available() else "cuda"
    args.dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    args.inner = args.inner or ("aot_eager" if args.smoke else "inductor")
    args.prompt = args.prompt or (8 if args.smoke else 256)
    args.new_tokens = args.new_tokens or (4 if args.smoke else 64)
    if args.smoke:
        args.reps = min(args.reps, 3)
    specs = SMOKE if args.smoke else FULL
    out_dir = os.environ.get("OUT", ".")
    budget = Budget(args.budget_s)
    env = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
           "dtype": str(args.dtype), "inner": args.inner, "mode": args.mode}
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except Exception as e:
        print(f"transformers missing: {e}", file=sys.stderr)
        return 1
    print(json.dumps(env), flush=True)

    wanted = [v for v in VARIANTS if v[0] in args.variants.split(",")]
    rows, gens = [], []
    for kind in ([] if args.generate_only else args.models.split(",")):
        for label, attn, backend in wanted:
            if budget.left() < args.reserve_s:
                rows.append({"model": kind, "variant": label, "error": "skipped: time budget"})
                continue
            rows.append(run_variant(kind, label, attn, backend, specs[kind], args, budget))
    if not args.no_generate:
        # ours and the SDPA peer first: with a tight budget that comparison matters most
        gen_order = sorted(wanted, key=lambda v: {"eager+fa3": 0, "sdpa+inductor": 1}.get(v[0], 2))
        for kind in [m for m in args.models.split(",") if m in DECODERS]:
            for label, attn, backend in gen_order:
                if budget.left() < args.reserve_s:
                    gens.append({"model": kind, "variant": label, "error": "skipped: time budget"})
                    continue
                gens.append(run_generate(kind, label, attn, backend, specs[kind], args))

    text = table(rows, gens)
    print("\n" + text, flush=True)
    for r in rows:
        if r.get("explain"):
            print(f"\n{r['model']} {r['variant']} explain():\n{r['explain']}")
    res = {"env": env, "rows": rows, "generate": gens, "table": text}
    with open(os.path.join(out_dir, "models.json"), "w") as f:
        json.dump(res, f, indent=1)
    try:
        print(chart(rows, gens, os.path.join(out_dir, "models.png")), flush=True)
    except Exception as e:
        print(f"no chart: {type(e).__name__}: {e}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
