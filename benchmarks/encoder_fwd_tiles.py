"""Forward tiles of our Triton pointer kernel at short encoder shapes, launched as the compile-time lowering
launches it: a one-layer encoder (the widths of benchmarks/encoder_kernels.py) compiled with backend="fa3" once per
tile (triton_family.CONFIG_OVERRIDE, read while the graph is lowered; Dynamo and Inductor's caches reset between
tiles), its attention kernel's GPU µs per forward from the profiler, beside the kernel of the same model's SDPA code
under Inductor (cuDNN at these shapes), in one process. Each tile's output is compared with the first tile's (the
same math in another order: bf16 rounding apart).

    python benchmarks/encoder_fwd_tiles.py [--models bert,bert-base,bert-d128,vit] [--calls 20]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import models as M  # noqa: E402
from encoder_kernels import SPECS  # noqa: E402
from kernel_diff import cuda_kernels  # noqa: E402

# (block_m, block_n, num_warps, num_stages); the family's table entry is timed first whatever this lists.
TILES = {
    64: [(128, 64, 4, 3), (128, 64, 4, 2), (128, 128, 8, 2), (128, 128, 4, 2), (64, 64, 4, 2), (64, 64, 4, 3),
         (64, 128, 4, 2), (128, 32, 4, 3), (128, 64, 8, 3), (64, 32, 4, 3)],
    128: [(64, 64, 4, 3), (64, 64, 4, 2), (128, 64, 8, 2), (128, 128, 8, 2), (64, 128, 4, 2), (64, 32, 4, 3),
          (128, 64, 4, 2)],
}
ATTENTION = ("attn_", "sdpa", "flash", "fmha")


def attention_us(fn, calls: int) -> tuple[float, list[str]]:
    """(GPU µs per call of fn in kernels named as attention kernels, their names); with none, the call's kernels
    are printed."""
    kernels = cuda_kernels(fn, calls)
    hits = {name: t for name, (t, _) in kernels.items() if any(w in name for w in ATTENTION)}
    if not hits:
        top = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:6]
        print("  no attention kernel found among: " + "; ".join(f"{n[:70]} {t:.1f} us" for n, (t, _) in top))
    return sum(hits.values()), sorted(n[:60] for n in hits)


def one_layer(spec: dict) -> dict:
    cfg = dict(spec["cfg"], num_hidden_layers=1)
    return dict(spec, cfg=cfg)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="bert,bert-base,bert-d128,vit")
    ap.add_argument("--calls", type=int, default=20)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/encoder_fwd_tiles.py: needs a CUDA GPU and none is visible here")
    import fa_compile
    from torch._inductor import config as inductor_config
    from fa_compile.kernels import triton_family as tf

    torch._dynamo.config.recompile_limit = 64
    rows = []
    for key in args.models.split(","):
        spec = one_layer(SPECS[key])
        kind = key.split("-")[0]
        cfg = spec["cfg"]
        d = cfg["hidden_size"] // cfg["num_attention_heads"]
        block = tf._pow2(d)
        default = tf.pick_config("fwd", block, False, torch.cuda.get_device_capability())
        tiles = [(default.block_m, default.block_n, default.num_warps, default.num_stages)]
        tiles += [t for t in TILES[block] if t != tiles[0]]
        with torch.no_grad():
            sdpa_model = M.build(kind, "sdpa", cfg, "cuda", torch.bfloat16).eval()
            kw, _ = M.inputs(kind, sdpa_model, spec, "cuda", torch.bfloat16)
            f = torch.compile(sdpa_model, dynamic=False)
            peer, _ = attention_us(lambda: f(**kw), args.calls)
            print(f"{key} (B{spec['B']} x {spec['N']}, d{d}): SDPA's kernel in its code + Inductor {peer:.1f} us",
                  flush=True)
            model = M.build(kind, "eager", cfg, "cuda", torch.bfloat16).eval()
            first = None
            for t in tiles:
                tf.CONFIG_OVERRIDE.clear()
                tf.CONFIG_OVERRIDE[("fwd", block)] = tf.BlockConfig(*t)
                tf.CONFIG_OVERRIDE[("fwd_bias", block)] = tf.BlockConfig(*t)
                torch._dynamo.reset()
                try:
                    with inductor_config.patch(fx_graph_cache=False):
                        g = torch.compile(model, backend=fa_compile.backend(), dynamic=False)
                        out = g(**kw)[0].float()
                    us, names = attention_us(lambda: g(**kw), args.calls)
                except Exception as e:  # a tile that does not build is reported, not fatal
                    print(f"  {t}: failed: {type(e).__name__}: {str(e)[:160]}", flush=True)
                    continue
                if not any("attn_fwd_kernel" in n for n in names):  # the lowering chose another kernel: no tile
                    print(f"  {t}: the lowering ran {names}, not the pointer forward; stopping this shape", flush=True)
                    break
                if first is None:
                    first = out
                diff = float((out - first).abs().nan_to_num(float("inf")).max())
                ratio = round(us / peer, 3) if peer > 0 else None
                rows.append(dict(model=key, B=spec["B"], N=spec["N"], d=d, tile=list(t), us=round(us, 1),
                                 sdpa_us=round(peer, 1), vs_sdpa=ratio, max_abs_vs_first=diff))
                print(f"  {t}: {us:7.1f} us  ({ratio}x SDPA's kernel; max |out - first tile's| {diff:.3g})",
                      flush=True)
            tf.CONFIG_OVERRIDE.clear()
    out_dir = os.environ.get("OUT")
    if out_dir:
        with open(os.path.join(out_dir, "encoder_fwd_tiles.json"), "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
