"""Short sequences across Hugging Face families: eager attention code under fa3 against the same model's SDPA code
under Inductor, on the shapes where host time per call and short kernels decide (encoders, vision, decoder prefill).

Every family is built from a config (random weights, no downloads) twice from the same seed: with
attn_implementation="eager" under `torch.compile(backend="fa3")` and with "sdpa" under plain Inductor (families
without an SDPA implementation compare against their eager code under Inductor; the table says which). The timed
calls are interleaved round by round: each round times every variant (median of `--reps` calls), and the figure
is the median over rounds. Outputs are compared with eager's (max abs difference, reported).

    python benchmarks/short_sweep.py                       # every family, forward (no grad), bf16 on the GPU
    python benchmarks/short_sweep.py --only bert,vit --train  # also one training step per call
    python benchmarks/short_sweep.py --only vit --profile  # and each variant's CUDA kernels per forward
    python benchmarks/short_sweep.py --smoke               # tiny configs on CPU (fp32): checks the script
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import traceback
from dataclasses import dataclass, field
from typing import Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernel_diff import cuda_kernels  # noqa: E402
from models import bench  # noqa: E402

# Encoders: B32 x 256, the last half of half the batch padded; hidden 768, 12 heads (d64), 4 layers.
ENC = dict(hidden_size=768, num_hidden_layers=4, num_attention_heads=12, intermediate_size=3072)
# Vision: B32, 224 / 16 -> 197 tokens (196 + class token).
VIS = dict(hidden_size=768, num_hidden_layers=4, num_attention_heads=12, intermediate_size=3072, image_size=224,
           patch_size=16)
# Decoders: B8 x 256 prefill, causal; hidden 1024, 16 query heads over 4 key/value heads (d64), 4 layers.
DEC = dict(hidden_size=1024, num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=4,
           intermediate_size=2816, vocab_size=32000, max_position_embeddings=2048, pad_token_id=0)
SMOKE_SIZES = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)


@dataclass
class Family:
    config: str
    model: str
    kind: str  # "text" (input_ids + a padded attention_mask), "vision" (pixel_values), "causal" (input_ids)
    cfg: dict = field(default_factory=dict)


FAMILIES: dict[str, Family] = {
    "bert": Family("BertConfig", "BertModel", "text", ENC),
    "roberta": Family("RobertaConfig", "RobertaModel", "text", dict(ENC, max_position_embeddings=514)),
    "electra": Family("ElectraConfig", "ElectraModel", "text", dict(ENC, embedding_size=768)),
    "distilbert": Family("DistilBertConfig", "DistilBertModel", "text",
                         dict(dim=768, n_layers=4, n_heads=12, hidden_dim=3072)),
    "albert": Family("AlbertConfig", "AlbertModel", "text", dict(ENC, embedding_size=128)),
    "xlm_roberta": Family("XLMRobertaConfig", "XLMRobertaModel", "text", dict(ENC, max_position_embeddings=514)),
    "vit": Family("ViTConfig", "ViTModel", "vision", VIS),
    "deit": Family("DeiTConfig", "DeiTModel", "vision", VIS),
    "dinov2": Family("Dinov2Config", "Dinov2Model", "vision", dict(VIS, mlp_ratio=4)),
    "clip_vision": Family("CLIPVisionConfig", "CLIPVisionModel", "vision", VIS),
    "siglip_vision": Family("SiglipVisionConfig", "SiglipVisionModel", "vision", VIS),
    "llama": Family("LlamaConfig", "LlamaModel", "causal", DEC),
    "mistral": Family("MistralConfig", "MistralModel", "causal", DEC),
    "qwen2": Family("Qwen2Config", "Qwen2Model", "causal", DEC),
    "gemma": Family("GemmaConfig", "GemmaModel", "causal", dict(DEC, head_dim=64)),
    "phi3": Family("Phi3Config", "Phi3Model", "causal", DEC),
    "starcoder2": Family("Starcoder2Config", "Starcoder2Model", "causal", DEC),
    "gpt2": Family("GPT2Config", "GPT2Model", "causal", dict(n_embd=1024, n_layer=4, n_head=16, vocab_size=32000)),
    "gpt_neox": Family("GPTNeoXConfig", "GPTNeoXModel", "causal",
                       dict(hidden_size=1024, num_hidden_layers=4, num_attention_heads=16, intermediate_size=4096,
                            vocab_size=32000)),
    "opt": Family("OPTConfig", "OPTModel", "causal",
                  dict(hidden_size=1024, num_hidden_layers=4, num_attention_heads=16, ffn_dim=4096, vocab_size=32000,
                       word_embed_proj_dim=1024)),
}


def _smoke_cfg(fam: Family) -> dict:
    """The family's own keys, shrunk: every size key the family uses becomes a tiny one."""
    tiny = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "intermediate_size": 64, "n_embd": 32, "n_layer": 2, "n_head": 4, "dim": 32, "n_layers": 2,
            "n_heads": 4, "hidden_dim": 64, "ffn_dim": 64, "word_embed_proj_dim": 32, "embedding_size": 32,
            "vocab_size": 128, "image_size": 32, "patch_size": 8, "head_dim": 8}
    cfg = {k: tiny.get(k, v) for k, v in fam.cfg.items()}
    if fam.kind == "causal":  # special token ids inside the tiny vocabulary
        cfg.update(pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return cfg


def build(fam: Family, attn: str, cfg: dict, device: str, dtype: torch.dtype):
    import transformers as tf

    config = getattr(tf, fam.config)(**cfg)
    torch.manual_seed(0)
    model = getattr(tf, fam.model)._from_config(config, attn_implementation=attn)
    return model.to(device=device, dtype=dtype).eval()


def inputs(fam: Family, model, b: int, n: int, device: str, dtype: torch.dtype) -> dict:
    gen = torch.Generator(device="cpu").manual_seed(1)
    if fam.kind == "vision":
        size = model.config.image_size
        return dict(pixel_values=torch.randn((b, 3, size, size), generator=gen).to(device=device, dtype=dtype))
    ids = torch.randint(3, model.config.vocab_size, (b, n), generator=gen).to(device)
    if fam.kind == "text":
        mask = torch.ones_like(ids)
        mask[: b // 2, n // 2:] = 0
        return dict(input_ids=ids, attention_mask=mask)
    return dict(input_ids=ids)


def first_tensor(out) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    return out[0] if isinstance(out, (tuple, list)) else out.last_hidden_state


def show_kernels(name: str, what: str, variants: dict[str, Callable]) -> None:
    for k, f in variants.items():
        tab = cuda_kernels(f, 5)
        total = sum(t for t, _ in tab.values())
        print(f"--- {name} {what}, {k}: {total:.1f} GPU us per call; kernels other than GEMMs:", flush=True)
        for key, (t, calls) in sorted(tab.items(), key=lambda x: -x[1][0]):
            if "nvjet" not in key and "gemm" not in key:
                print(f"   {t:9.1f} us  x{calls:3d}  {key[:100]}", flush=True)


def show_host(name: str, what: str, variants: dict[str, Callable], calls: int = 5) -> None:
    """Where each variant's host time goes: the profiler's CPU events by self time, per call."""
    for k, f in variants.items():
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(calls):
                f()
            torch.cuda.synchronize()
        evs = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
        total = sum(e.self_cpu_time_total for e in evs) / calls
        print(f"--- {name} {what}, {k}: {total:.0f} host us per call (self time); the largest:", flush=True)
        for e in evs[:25]:
            print(f"   {e.self_cpu_time_total / calls:9.1f} us  x{e.count // calls:4d}  {e.key[:100]}", flush=True)


def sweep_one(name: str, fam: Family, args) -> dict:
    from torch._dynamo.utils import counters

    import fa_compile

    device, dtype = args.device, args.dtype
    cfg = _smoke_cfg(fam) if args.smoke else dict(fam.cfg)
    b, n = args.batch or (32 if fam.kind != "causal" else 8), args.seq
    row: dict = {"family": name, "B": b, "N": n if fam.kind != "vision" else "image"}
    inner = "aot_eager" if args.smoke else "inductor"
    try:
        torch._dynamo.reset()
        counters.clear()
        eager = build(fam, "eager", cfg, device, dtype)
        try:
            peer_model, row["peer"] = build(fam, "sdpa", cfg, device, dtype), "sdpa+inductor"
        except (ValueError, ImportError) as e:  # no SDPA implementation in this family
            peer_model, row["peer"] = build(fam, "eager", cfg, device, dtype), "eager+inductor"
            row["peer_note"] = str(e)[:120]
        kw = inputs(fam, eager, b, n, device, dtype)
        ours = torch.compile(eager, backend=fa_compile.backend(inner))
        peer = torch.compile(peer_model, backend=inner)
        with torch.no_grad():
            ref = first_tensor(eager(**kw)).float()
            got = first_tensor(ours(**kw)).float()
            row["max_abs_vs_eager"] = float((got - ref).abs().max())
            row["sites"] = f"{int(counters['fa_compile']['sites_rewritten'])} rewritten / " \
                           f"{int(counters['fa_compile']['sites_missed'])} missed"
            first_tensor(peer(**kw))
            variants = {"fa3": lambda: ours(**kw), "peer": lambda: peer(**kw)}
            for f in variants.values():  # warm-up
                f()
                f()
            per = {k: [] for k in variants}
            for _ in range(args.rounds):
                for k, f in variants.items():
                    per[k].append(bench(f, device, args.reps))
        row["fwd_ms"] = {k: round(statistics.median(v), 3) for k, v in per.items()}
        row["fwd_ratio"] = round(row["fwd_ms"]["fa3"] / row["fwd_ms"]["peer"], 3)
        if args.profile:
            with torch.no_grad():
                show_kernels(name, "forward", variants)
        if args.train:
            for m in (eager, peer_model):
                m.train()
            steps = {}
            for k, (m, f) in {"fa3": (eager, ours), "peer": (peer_model, peer)}.items():
                def step(m=m, f=f):
                    first_tensor(f(**kw)).float().square().mean().backward()
                    for p in m.parameters():
                        p.grad = None
                step()
                step()
                steps[k] = step
            per = {k: [] for k in steps}
            for _ in range(args.rounds):
                for k, f in steps.items():
                    per[k].append(bench(f, device, max(args.reps // 2, 2)))
            row["train_ms"] = {k: round(statistics.median(v), 3) for k, v in per.items()}
            row["train_ratio"] = round(row["train_ms"]["fa3"] / row["train_ms"]["peer"], 3)
            if args.profile:
                show_kernels(name, "training step", steps)
            if args.host_profile:
                show_host(name, "training step", steps)
    except Exception as e:
        row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        if args.verbose:
            traceback.print_exc()
    finally:
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    print(json.dumps(row), flush=True)
    return row


def table(rows: list[dict]) -> str:
    lines = ["| family | B × N | peer | sites | max abs vs eager | forward ms: fa3 / peer | ratio "
             "| train ms: fa3 / peer | ratio |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['family']} | {r['B']} × {r['N']} | {r.get('peer', '-')} "
                         f"| error: {r['error'][:80]} | | | | | |")
            continue
        f, t = r["fwd_ms"], r.get("train_ms")
        tr = f"{t['fa3']} / {t['peer']} | {r['train_ratio']:.3f}×" if t else "- | -"
        lines.append(f"| {r['family']} | {r['B']} × {r['N']} | {r['peer']} | {r['sites']} "
                     f"| {r['max_abs_vs_eager']:.3g} "
                     f"| {f['fa3']} / {f['peer']} | {r['fwd_ratio']:.3f}× | {tr} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="", help="comma-separated family names (default: every family)")
    ap.add_argument("--train", action="store_true", help="also time one training step")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--profile", action="store_true", help="list each variant's CUDA kernels per forward")
    ap.add_argument("--host-profile", action="store_true", help="list each training step's host time by event")
    ap.add_argument("--smoke", action="store_true", help="tiny configs, CPU, fp32, aot_eager: checks the script")
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args()
    names = [s for s in args.only.split(",") if s] or list(FAMILIES)
    unknown = [s for s in names if s not in FAMILIES]
    if unknown:
        raise SystemExit(f"--only: unknown families {unknown}; known: {sorted(FAMILIES)}")
    if args.smoke:
        args.device, args.dtype, args.rounds, args.reps, args.profile = "cpu", torch.float32, 1, 1, False
        args.host_profile = False
        args.batch, args.seq = args.batch or 2, min(args.seq, 16)
    else:
        if not torch.cuda.is_available():
            raise SystemExit("benchmarks/short_sweep.py: times CUDA models; use --smoke on a machine without a GPU")
        args.device, args.dtype = "cuda", torch.bfloat16
    import transformers

    env = {"torch": torch.__version__, "transformers": transformers.__version__,
           "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu"}
    print(json.dumps(env), flush=True)
    rows = [sweep_one(name, FAMILIES[name], args) for name in names]
    print()
    print(table(rows))
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "short_sweep.json"), "w") as f:
            json.dump({"env": env, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
