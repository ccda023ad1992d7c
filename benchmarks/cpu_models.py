"""CPU model benchmark: small Hugging Face decoders, encoders and a vision model, eager attention code
under fa3 against the same models' SDPA code under Inductor, forward (no grad) and one training step;
with --generate, greedy generate() tokens/s with a static cache.

Variants, measured in one run and in turn (each timing round runs every variant once, so drift on
a shared machine touches all alike):
  eager+fa3           attn_implementation="eager" under torch.compile(backend="fa3")
  eager+fa3-nolower   the same with fa_compile.backend(lower=False): the fa3 op and its run-time dispatch
  sdpa+inductor       attn_implementation="sdpa" under torch.compile(backend="inductor")
  eager+inductor      attn_implementation="eager" under plain Inductor (not run unless --variants names it)
  eager+fa3-off       eager+fa3 compiled with one lowering switched off (--switch, e.g. FA_COMPILE_DECODE_MATH;
                      not run unless --variants names it)
Models (random weights, fp32, base models without a language-model head):
  gpt2  4 layers, hidden 256, 4 heads, B4 x 256 tokens (causal)
  bert  4 layers, hidden 256, 4 heads, B8 x 128 tokens, the last 64 tokens of half the batch padded
  llama 4 layers, hidden 256, 4 / 2 heads (GQA), B4 x 256 tokens (causal, rotary)
  vit   4 layers, hidden 256, 4 heads, B8 images of 64 x 64 in 8 x 8 patches (65 tokens)
  --generate: Llama (or --gen-model gpt2) as above with a language-model head, B2, prompt 64, 32 new tokens
  (--gen-batch, --gen-prompt, --gen-new), static cache (--gen-cache: its capacity), `model.forward` compiled
  with the variant's backend (the README's recipe)

    python benchmarks/cpu_models.py [--rounds 5] [--reps 5] [--models gpt2,bert,llama,vit] [--threads 1]
                                    [--generate [--gen-model llama] [--gen-batch 2] [--gen-prompt 64]
                                    [--gen-new 32] [--gen-cache N]] [--json out.json]
Prints median ms per variant and the ratio to sdpa+inductor (lower is better).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Callable

import torch

SPECS = {
    "gpt2": dict(B=4, N=256, cfg=dict(n_embd=256, n_layer=4, n_head=4, vocab_size=1024, n_positions=512)),
    "bert": dict(B=8, N=128, cfg=dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, intermediate_size=1024,
                                      vocab_size=1024, max_position_embeddings=512)),
    "llama": dict(B=4, N=256, cfg=dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                                       num_key_value_heads=2, vocab_size=1024, max_position_embeddings=512)),
    "vit": dict(B=8, N=65, cfg=dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, intermediate_size=1024,
                                    image_size=64, patch_size=8)),
}
GENERATE = dict(B=2, prompt=64, new=32, model="llama")
VARIANTS = ("eager+fa3", "eager+fa3-nolower", "sdpa+inductor")
OPTIONAL_VARIANTS = ("eager+inductor", "eager+fa3-off")
SWITCH = {"name": "FA_COMPILE_DECODE_MATH"}  # the lowering eager+fa3-off compiles without (--switch)


def build(kind: str, attn: str):
    import transformers as tf

    torch.manual_seed(0)
    cfg = SPECS[kind]["cfg"]
    if kind == "gpt2":
        return tf.GPT2Model(tf.GPT2Config(**cfg, attn_implementation=attn))
    if kind == "llama":
        return tf.LlamaModel(tf.LlamaConfig(**cfg, attn_implementation=attn))
    if kind == "vit":
        return tf.ViTModel(tf.ViTConfig(**cfg, attn_implementation=attn), add_pooling_layer=False)
    return tf.BertModel(tf.BertConfig(**cfg, attn_implementation=attn), add_pooling_layer=False)


def inputs(kind: str) -> dict:
    spec = SPECS[kind]
    g = torch.Generator().manual_seed(1)
    if kind == "vit":
        size = spec["cfg"]["image_size"]
        return dict(pixel_values=torch.randn(spec["B"], 3, size, size, generator=g))
    ids = torch.randint(0, 1024, (spec["B"], spec["N"]), generator=g)
    if kind in ("gpt2", "llama"):
        return dict(input_ids=ids)
    mask = torch.ones_like(ids)
    mask[: spec["B"] // 2, spec["N"] // 2:] = 0
    return dict(input_ids=ids, attention_mask=mask)


def backend(variant: str):
    import fa_compile

    if variant in ("eager+fa3", "eager+fa3-off"):
        return fa_compile.backend()
    if variant == "eager+fa3-nolower":
        return fa_compile.backend(lower=False)
    return "inductor"


def step_fns(kind: str, variant: str) -> tuple[Callable, Callable]:
    attn = "sdpa" if variant.startswith("sdpa") else "eager"
    model = build(kind, attn).eval()  # inference: no dropout
    fwd_model = torch.compile(model, backend=backend(variant))
    kw = inputs(kind)

    def forward():
        with torch.no_grad():
            return fwd_model(**kw).last_hidden_state

    train_model = build(kind, attn).train()
    for m in train_model.modules():  # dropout off: a deterministic step, same work for every variant
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    compiled_train = torch.compile(train_model, backend=backend(variant))

    def train():
        out = compiled_train(**kw).last_hidden_state
        out.float().pow(2).mean().backward()
        return out

    return forward, train


def generate_fn(variant: str) -> Callable:
    """Greedy generate() with a static cache, `model.forward` compiled with the variant's backend."""
    import transformers as tf

    attn = "sdpa" if variant.startswith("sdpa") else "eager"
    torch.manual_seed(0)
    kind = GENERATE["model"]
    config_cls, model_cls = {"llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
                             "gpt2": (tf.GPT2Config, tf.GPT2LMHeadModel)}[kind]
    cfg = config_cls(**SPECS[kind]["cfg"], attn_implementation=attn, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = model_cls(cfg).eval()
    model.forward = torch.compile(model.forward, backend=backend(variant))
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 1024, (GENERATE["B"], GENERATE["prompt"]), generator=g)

    cache = None
    if GENERATE.get("cache"):  # one StaticCache of that capacity, reset before each call (its buffers stay put)
        cache = tf.StaticCache(config=model.config, max_cache_len=GENERATE["cache"])

    def run():
        kw = dict(cache_implementation="static") if cache is None else dict(past_key_values=cache)
        if cache is not None:
            cache.reset()
        with torch.no_grad():
            return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=GENERATE["new"],
                                  min_new_tokens=GENERATE["new"], do_sample=False, **kw)

    return run


def _switched(variant: str):
    """eager+fa3-off compiles (its first calls) with SWITCH's lowering off; the pass's cache key reads it."""
    import os
    from unittest import mock

    return mock.patch.dict(os.environ, {SWITCH["name"]: "0"} if variant == "eager+fa3-off" else {})


def generate_main(variants: list, rounds: int) -> dict:
    fns = {v: generate_fn(v) for v in variants}
    outs = {}
    for v, fn in fns.items():
        with _switched(v):
            outs[v] = (fn(), fn())[1]  # compile, warm up
    ref = outs.get("sdpa+inductor", next(iter(outs.values())))
    times: dict = {v: [] for v in variants}
    for _ in range(rounds):
        for v in variants:
            t0 = time.perf_counter()
            fns[v]()
            times[v].append(GENERATE["B"] * GENERATE["new"] / (time.perf_counter() - t0))
    med = {v: statistics.median(ts) for v, ts in times.items()}
    print(f"generate: {GENERATE['model']} (as above), B{GENERATE['B']}, prompt {GENERATE['prompt']}, "
          f"{GENERATE['new']} new, "
          f"static cache of {GENERATE.get('cache') or GENERATE['prompt'] + GENERATE['new']}, {rounds} rounds, "
          "median tokens/s (higher is better)")
    for v in variants:
        same = "same tokens as sdpa+inductor" if torch.equal(outs[v], ref) else "TOKENS DIFFER from sdpa+inductor"
        ratio = f"  ratio to sdpa+inductor: {med[v] / med['sdpa+inductor']:.2f}x" if "sdpa+inductor" in med else ""
        print(f"  {v:18s} {med[v]:8.1f} tokens/s{ratio}  ({same})")
    return dict(tokens_per_s=med, all=times)


def timed(fn: Callable, reps: int) -> float:
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) * 1e3 / reps


def _frames_compiled() -> int:
    """Graphs Dynamo has compiled in this process (a recompile adds one)."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="gpt2,bert")
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help=f"of {', '.join(VARIANTS + OPTIONAL_VARIANTS)}")
    ap.add_argument("--switch", default=SWITCH["name"], choices=("FA_COMPILE_DECODE_MATH", "FA_COMPILE_REFERENCE_MATH"),
                    help="the lowering eager+fa3-off is compiled without")
    ap.add_argument("--rounds", type=int, default=5, help="timing rounds (each times every variant in turn)")
    ap.add_argument("--reps", type=int, default=5, help="calls per timing")
    ap.add_argument("--json", default=None)
    ap.add_argument("--generate", action="store_true", help="also time generate() (static cache)")
    ap.add_argument("--gen-model", default=GENERATE["model"], choices=("llama", "gpt2"), help="generate(): model")
    ap.add_argument("--gen-batch", type=int, default=GENERATE["B"], help="generate(): batch")
    ap.add_argument("--gen-prompt", type=int, default=GENERATE["prompt"], help="generate(): prompt tokens")
    ap.add_argument("--gen-new", type=int, default=GENERATE["new"], help="generate(): new tokens")
    ap.add_argument("--gen-cache", type=int, default=None, help="generate(): a StaticCache of this capacity (default: "
                    "prompt + new, generate()'s own)")
    ap.add_argument("--threads", type=int, default=None,
                    help="intra-op threads (torch.set_num_threads); 1 on a loaded machine, where each OpenMP "
                         "barrier of a parallel kernel waits for a descheduled thread")
    args = ap.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    GENERATE.update(model=args.gen_model, B=args.gen_batch, prompt=args.gen_prompt, new=args.gen_new,
                    cache=args.gen_cache)
    variants = args.variants.split(",")
    unknown = sorted(set(variants) - set(VARIANTS + OPTIONAL_VARIANTS))
    if unknown:
        ap.error(f"--variants: unknown {unknown}; choose from {', '.join(VARIANTS + OPTIONAL_VARIANTS)}")
    SWITCH["name"] = args.switch
    from fa_compile.lowering import records

    results = {}
    for kind in filter(None, args.models.split(",")):
        # One reset per model, none between its variants: all variants share Hugging Face's forward
        # wrapper (one code object, one Dynamo cache), and a reset there would drop the earlier
        # variants' compiled entries, so their first timed call would recompile.
        torch._dynamo.reset()
        fns = {}
        for v in variants:
            fwd, train = step_fns(kind, v)
            with _switched(v):
                fwd(), fwd(), train(), train()  # compile and warm up
            fns[v] = (fwd, train)
        for fwd, train in fns.values():  # every variant's entry is found again after the others compiled
            fwd(), train()
        compiled = _frames_compiled()
        times = {v: {"forward": [], "train": []} for v in variants}
        for _ in range(args.rounds):
            for v in variants:
                times[v]["forward"].append(timed(fns[v][0], args.reps))
                times[v]["train"].append(timed(fns[v][1], max(1, args.reps // 2)))
        if _frames_compiled() != compiled:
            print(f"  WARNING: {kind}: Dynamo compiled {_frames_compiled() - compiled} frame(s) while timing "
                  f"(recompiles: the times include compilation)")
        med = {v: {p: statistics.median(ts) for p, ts in d.items()} for v, d in times.items()}
        results[kind] = dict(median_ms=med, all_ms=times)
        lowered = [str(r.decision) for r in records()]
        print(f"  lowering decisions so far: {sorted(set(lowered))}")
        base = med.get("sdpa+inductor")
        print(f"{kind}: {SPECS[kind]['B']} x {SPECS[kind]['N']}, {args.rounds} rounds x {args.reps} calls, median ms")
        for v in variants:
            ratios = "" if base is None else "  ratio to sdpa+inductor: " + " / ".join(
                f"{med[v][p] / base[p]:.2f}x" for p in ("forward", "train"))
            print(f"  {v:18s} forward {med[v]['forward']:8.2f}  train step {med[v]['train']:8.2f}{ratios}")
    if args.generate:
        torch._dynamo.reset()
        results["generate"] = generate_main(variants, args.rounds)
    if args.json:
        meta = dict(torch=torch.__version__, threads=torch.get_num_threads(), date=time.strftime("%Y-%m-%d"))
        with open(args.json, "w") as f:
            json.dump(dict(meta=meta, results=results), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
