"""FP8 attention accuracy: relative L2 error and cosine similarity of the output against an fp32 reference.

Inputs (bf16, [B, H, N, d] with d 128 or --d; the reference is fp32 attention on the same bf16 values):
- gaussian: q, k, v ~ N(0, 1);
- k_offset: the same with a K offset shared by every token (a per-channel vector of std 8);
- outliers: as real LLM activations, a few q / k channels x20..50, a large K offset shared by every
  token (a per-channel vector of std 8) and V with a mean per channel and two channels x20.
Rows: our bf16 forward, ours FP8 as plain cast (per-block scales, no smoothing), + K smoothing,
+ Q smoothing, K smoothing + Hadamard (the default), the same with int8 Q.Kᵀ (qk_int8) and with a
one-level P.V accumulation (two_level=False: what it costs on the GPU), the FA3-style
method on our kernel (e4m3 cast of q / k / v with unit descales), and FA3's own FP8 (plain cast) when
`flash_attn_interface` imports.

  python benchmarks/fp8_accuracy.py [--emulate] [--n N] [--out DIR]

--emulate runs ours through the exact emulation (fp8_reference) on the CPU, so it runs without a GPU;
the bf16 row is then the fp32 softmax with P rounded to bf16 against the row max (what the bf16 kernels'
P.V sees), and the FA3 row is absent. `kernel_rows(device, emulate)` returns the rows (for reports that add
end-to-end rows). Writes fp8_accuracy.json to --out (default $OUT or /tmp).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

from fa_compile.kernels import reference as ref
from fa_compile.kernels.fp8 import FP8, fp8_forward, fp8_reference

KINDS = ("gaussian", "k_offset", "outliers")
VARIANTS = {
    "fp8 plain cast (block scales)": dict(smooth_k=False, hadamard=False),
    "fp8 + K smoothing": dict(hadamard=False),
    "fp8 + K + Q smoothing": dict(smooth_q=True, hadamard=False),
    "fp8 + K smoothing + Hadamard (default)": dict(hadamard=True),
    "int8 Q.K + K smoothing + Hadamard": dict(hadamard=True, qk_int8=True),
    # the same as the default in the emulation (exact sums); on the GPU, P.V in one FP8 wgmma chain
    "default, one-level P.V accumulation": dict(hadamard=True, two_level=False),
}


def make_inputs(kind: str, b: int, h: int, n: int, d: int, device, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, h, n, d, generator=g) for _ in range(3))
    if kind == "k_offset":
        k = k + 8.0 * torch.randn(1, h, 1, d, generator=g)
    if kind == "outliers":
        ch = torch.randperm(d, generator=g)[:4]
        mult = torch.tensor([20.0, 30.0, 40.0, 50.0])
        q[..., ch] *= mult
        k[..., ch] *= mult
        k = k + 8.0 * torch.randn(1, h, 1, d, generator=g)
        v = v + 2.0 * torch.randn(1, h, 1, d, generator=g)
        v[..., ch[:2]] *= 20.0
    return tuple(t.to(device=device, dtype=torch.bfloat16) for t in (q, k, v))


def metrics(out, want) -> dict:
    o, w = out.double().flatten(), want.double().flatten()  # (an fp32 cosine of long vectors can exceed 1)
    return {"rel_l2": float((o - w).norm() / w.norm()), "cos": float(torch.dot(o, w) / (o.norm() * w.norm()))}


def bf16_emulated(q, k, v, scale: float, causal: bool):
    """fp32 scores, P = exp(s - rowmax) rounded to bf16, fp32 P.V, normalised by the fp32 row sum."""
    s = ref.scores_reference(q.float(), k.float(), scale=scale, causal=causal)
    p = torch.exp(s - s.amax(-1, keepdim=True))
    out = p.to(torch.bfloat16).float() @ v.float() / p.sum(-1, keepdim=True)
    return out.to(torch.bfloat16)


def kernel_rows(device, emulate: bool, n: int = 4096, d: int = 128, b: int = 1, h: int = 8,
                causal: bool = False) -> list[dict]:
    """Rows {inputs, method, rel_l2, cos} for the Gaussian and outlier inputs."""
    rows = []
    scale = d ** -0.5
    fa3 = None
    if not emulate:
        try:
            import flash_attn_interface as fa3
        except Exception:
            fa3 = None
    for kind in KINDS:
        q, k, v = make_inputs(kind, b, h, n, d, device)
        want, _ = ref.attention_reference(q.float(), k.float(), v.float(), scale=scale, causal=causal)

        def add(method, out):
            rows.append({"inputs": kind, "method": method, **metrics(out, want)})
            print(rows[-1], flush=True)

        if emulate:
            add("bf16 (emulated)", bf16_emulated(q, k, v, scale, causal))
        else:
            from fa_compile.kernels import triton_family as tf
            from fa_compile.kernels.triton_testing import Case

            add("bf16 (ours)", tf.attention_forward(Case(q=q, k=k, v=v, scale=scale, causal=causal))[0])
        run = fp8_reference if emulate else fp8_forward
        for method, kw in VARIANTS.items():
            add(method + (" (emulated)" if emulate else ""), run(q, k, v, scale, causal=causal, **kw)[0])
        q8, k8, v8 = (t.to(FP8) for t in (q, k, v))
        add("FA3-style cast, unit descales, our kernel" + (" (emulated)" if emulate else ""),
            run(q8, k8, v8, scale, causal=causal)[0])
        if fa3 is not None:
            try:
                ds = torch.ones(b, h, device=device, dtype=torch.float32)
                o = fa3.flash_attn_func(*(t.transpose(1, 2) for t in (q8, k8, v8)), causal=causal, q_descale=ds,
                                        k_descale=ds, v_descale=ds)
                add("FA3 FP8 plain cast", (o[0] if isinstance(o, tuple) else o).transpose(1, 2))
            except Exception as e:
                rows.append({"inputs": kind, "method": "FA3 FP8 plain cast", "err": f"{type(e).__name__}: {e}"[:160]})
    return rows


def print_table(rows: list[dict]) -> None:
    print(f"{'inputs':>9} | {'method':<52} | {'rel L2':>8} | {'cosine':>9}")
    for r in rows:
        if "err" in r:
            print(f"{r['inputs']:>9} | {r['method']:<52} | {r['err']}")
        else:
            print(f"{r['inputs']:>9} | {r['method']:<52} | {r['rel_l2']:8.4f} | {r['cos']:9.6f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--emulate", action="store_true", help="ours through fp8_reference on the CPU")
    ap.add_argument("--n", type=int, default=None, help="sequence length (default 4096; 1024 with --emulate)")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--d", type=int, default=128, help="head dim")
    ap.add_argument("--no-llama", action="store_true", help="skip the end-to-end Llama rows (benchmarks/fp8_llama.py)")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    a = ap.parse_args()
    if not a.emulate and not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU (or --emulate)")
    device = "cpu" if a.emulate else "cuda"
    n = a.n or (1024 if a.emulate else 4096)
    t0 = time.time()
    rows = kernel_rows(device, a.emulate, n=n, d=a.d, causal=a.causal)
    print_table(rows)
    res = {"device": "cpu (emulated)" if a.emulate else torch.cuda.get_device_name(), "N": n, "d": a.d,
           "causal": a.causal, "rows": rows}
    if not a.emulate and not a.no_llama:  # end to end: logits and cross-entropy of a small Llama with FP8 attention
        import importlib.util

        spec = importlib.util.spec_from_file_location(
            "fp8_llama", os.path.join(os.path.dirname(os.path.abspath(__file__)), "fp8_llama.py"))
        llama = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(llama)
        res["llama"] = llama.model_rows(device)
        for r in res["llama"]:
            print(f"llama | {r['variant']:<26} | rel L2 logits {r['rel_l2']:.3e} | cosine {r['cosine']:.6f} | "
                  f"CE {r['ce']:.4f} ({r['d_ce']:+.2e}) | fp8 sites {r.get('fp8_sites', '-')}")
    res["seconds"] = round(time.time() - t0, 1)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "fp8_accuracy.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(f"wrote {os.path.join(a.out, 'fp8_accuracy.json')}")


if __name__ == "__main__":
    main()
