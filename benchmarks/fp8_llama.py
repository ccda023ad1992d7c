"""End to end: what FP8 attention changes in a small Llama built from its config (random weights).

The same bf16 model (eager attention code) compiled with backend="fa3" and with
`fa_compile.backend(fp8=True)`, against the model in fp32 (plain eager math) as the reference, on fixed
random tokens: relative L2 error and cosine of the logits, and the cross-entropy of the next token
with its change. Inference (no grad), which is where FP8 applies.

    python benchmarks/fp8_llama.py            # the device run (d128, B2 x 4096, 4 layers)
    python benchmarks/fp8_llama.py --smoke    # tiny, on CPU (FP8 refused there: checks the script)
Prints a table; writes fp8_llama.json to $OUT (or .).
"""
from __future__ import annotations

import argparse
import json
import os

import torch
import torch.nn.functional as F

FULL = dict(B=2, N=4096, cfg=dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=4, num_attention_heads=16,
                                  num_key_value_heads=8, vocab_size=32000, max_position_embeddings=8192))
SMOKE = dict(B=1, N=64, cfg=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, vocab_size=256, max_position_embeddings=128))


def _errors(got: torch.Tensor, want: torch.Tensor) -> dict:
    g, w = got.float().flatten(), want.float().flatten()
    return {"rel_l2": float((g - w).norm() / w.norm()), "cosine": float(F.cosine_similarity(g, w, dim=0))}


def model_rows(device: str, smoke: bool = False) -> list[dict]:
    import transformers

    import fa_compile

    spec = SMOKE if smoke else FULL
    cfg = transformers.LlamaConfig(**spec["cfg"], attn_implementation="eager")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to(device).eval()
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (spec["B"], spec["N"]), generator=gen).to(device)
    targets = ids[:, 1:].flatten()

    def ce(logits: torch.Tensor) -> float:
        return float(F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), targets))

    with torch.no_grad():
        want = model.float()(ids).logits.float()  # fp32 eager math: the reference
        ce_ref = ce(want)
        model = model.to(torch.bfloat16)
        rows = [{"variant": "fp32 eager (reference)", "rel_l2": 0.0, "cosine": 1.0, "ce": ce_ref, "d_ce": 0.0}]
        variants = [("bf16, backend fa3", fa_compile.backend()), ("fp8, backend(fp8=True)", fa_compile.backend(fp8=True))]
        for name, be in variants:
            torch._dynamo.reset()
            got = torch.compile(model, backend=be)(ids).logits.float()
            loss = ce(got)
            rep = fa_compile.explain(model, ids, fp8="fp8" in name)
            used = sum(1 for r in rep.rewritten if r.fp8 == "used")
            rows.append({"variant": name, **_errors(got, want), "ce": loss, "d_ce": loss - ce_ref,
                         "fp8_sites": f"{used}/{len(rep.rows)}",
                         "fp8_refusals": sorted({r.fp8 for r in rep.rewritten if r.fp8 and r.fp8 != "used"})})
            del got
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true")
    a = ap.parse_args()
    device = "cpu" if a.smoke or not torch.cuda.is_available() else "cuda"
    rows = model_rows(device, smoke=a.smoke)
    print(f"{'variant':<26} {'rel L2 logits':>14} {'cosine':>10} {'CE':>9} {'dCE':>10}  fp8 sites")
    for r in rows:
        print(f"{r['variant']:<26} {r['rel_l2']:>14.3e} {r['cosine']:>10.6f} {r['ce']:>9.4f} {r['d_ce']:>+10.2e}  "
              f"{r.get('fp8_sites', '')} {'; '.join(r.get('fp8_refusals', []))}")
    out = os.environ.get("OUT", ".")
    with open(os.path.join(out, "fp8_llama.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                   "torch": torch.__version__, "shape": {k: v for k, v in (SMOKE if a.smoke else FULL).items()},
                   "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
