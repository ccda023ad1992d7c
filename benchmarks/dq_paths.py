"""Two ways for our Triton-language backward to compute dQ, beside SDPA's backward, in ONE process (CUDA):

- "pair": the dK/dV kernel, then a dQ kernel of its own, which computes the scores, P, dP and the dropout mask a
  second time (the default: deterministic);
- "fused": the dK/dV kernel also adds each key tile's share of dQ into a zeroed fp32 buffer by atomics, then one
  scaled cast (`FA_COMPILE_FUSED_DQ=1`), timed for several dK/dV tiles;
- SDPA: its default backend's forward + backward minus its forward (`do_bench`).

Ours are the `fa3_triton::bwd` op called eagerly with the family's tiles (`pick_config`), timed with CUDA graphs
(`do_bench_cudagraph`, ms; "tflops_pair" counts every key, padded ones too). The fused gradients are compared with
the pair's (max |difference| / max |pair|).
bf16, q / k / v as BSHD storage viewed as [B, H, N, D]; key padding is a bool [B, 1, 1, N] mask (the last half of
the keys of half the batch) with its key limit as kv_lens, as the lowering passes it.

    python benchmarks/dq_paths.py [SHAPE-SUBSTRING ...] [--few] [--out F.json]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F

TILES = [(64, 64, 4, 2), (64, 128, 4, 2), (64, 128, 8, 2), (32, 128, 4, 2), (128, 128, 8, 2), (64, 128, 8, 3),
         (128, 64, 8, 2), (32, 64, 4, 2)]
FEW = [(64, 64, 4, 2), (64, 128, 8, 3)]


def shape(name, b, hq, hkv, n, d, causal=False, pad=False, drop=0.0) -> dict:
    return dict(name=name, b=b, hq=hq, hkv=hkv, n=n, d=d, causal=causal, pad=pad, drop=drop)


SHAPES = [
    shape("bert d64 pad drop0.1", 32, 16, 16, 512, 64, pad=True, drop=0.1),
    shape("bert d64 pad", 32, 16, 16, 512, 64, pad=True),
    shape("bert d64 nopad drop0.1", 32, 16, 16, 512, 64, drop=0.1),
    shape("d64 N1024 causal", 16, 16, 16, 1024, 64, causal=True),
    shape("d128 N1024 causal", 8, 16, 16, 1024, 128, causal=True),
    shape("gqa32/8 d128 N1024 causal", 4, 32, 8, 1024, 128, causal=True),
    shape("d128 N512 pad drop0.1", 32, 16, 16, 512, 128, pad=True, drop=0.1),
]


def measure(s: dict, tiles: list) -> dict:
    import triton
    from triton.testing import do_bench_cudagraph

    from fa_compile.kernels import triton_family as tf
    from fa_compile.kernels import triton_ops as to

    dev, dt = "cuda", torch.bfloat16
    cap = torch.cuda.get_device_capability()
    torch.manual_seed(0)
    b, hq, hkv, n, d = s["b"], s["hq"], s["hkv"], s["n"], s["d"]
    q = torch.randn(b, n, hq, d, device=dev, dtype=dt).transpose(1, 2)
    k = torch.randn(b, n, hkv, d, device=dev, dtype=dt).transpose(1, 2)
    v = torch.randn(b, n, hkv, d, device=dev, dtype=dt).transpose(1, 2)
    dout = torch.randn(b, n, hq, d, device=dev, dtype=dt).transpose(1, 2)
    bias = kvl = None
    if s["pad"]:
        keep = torch.ones(b, n, dtype=torch.bool, device=dev)
        keep[b // 2:, n // 2:] = False
        bias = keep[:, None, None, :]
        kvl = keep.int().sum(-1).int()
    seed = torch.tensor([1234], device=dev, dtype=torch.int64)
    scale = d ** -0.5
    block = tf._pow2(d)
    tile = lambda c: [c.block_m, c.block_n, c.num_warps, c.num_stages]  # noqa: E731
    fwd_tile = tile(tf.pick_config("fwd", block, s["causal"], cap, 4 if s["pad"] else 0))
    out, lse = to.fwd(q, k, v, bias, kvl, seed, scale, s["causal"], 0, -1, -1, 0.0, s["drop"], fwd_tile)
    pk, pq = tile(tf.pick_config("dkdv", block, s["causal"], cap)), tile(tf.pick_config("dq", block, s["causal"], cap))

    def call(kc, fused):
        return to.bwd(dout, q, k, v, out, lse, bias, kvl, seed, scale, s["causal"], 0, -1, -1, 0.0, s["drop"],
                      False, kc, pq, 0, fused)

    ref = call(pk, False)
    res: dict = {"shape": s["name"], "pair": do_bench_cudagraph(lambda: call(pk, False), rep=200)}
    qs, ks, vs = (t.detach().clone().requires_grad_() for t in (q, k, v))

    def sdpa_fwd():
        return F.scaled_dot_product_attention(qs, ks, vs, attn_mask=bias, dropout_p=s["drop"], is_causal=s["causal"],
                                              enable_gqa=hq != hkv)

    def sdpa_both():
        qs.grad = ks.grad = vs.grad = None
        sdpa_fwd().backward(dout)

    try:
        res["sdpa_bwd"] = triton.testing.do_bench(sdpa_both, rep=200) - triton.testing.do_bench(sdpa_fwd, rep=200)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            sdpa_both()
            torch.cuda.synchronize()
        res["sdpa_kernels"] = sorted({e.name[:60] for e in prof.events()
                                      if any(w in e.name.lower() for w in ("attention", "fmha", "cudnn"))})[:4]
    except Exception as e:  # the peer refuses these inputs
        res["sdpa_bwd"], res["sdpa_err"] = float("nan"), str(e)[:100]
    for c in map(list, tiles):
        try:
            got = call(c, True)
            err = max(((a.float() - g.float()).abs().max() / a.float().abs().max().clamp_min(1e-6)).item()
                      for a, g in zip(ref[:3], got[:3]))
            finite = bool(all(torch.isfinite(g).all() for g in got[:3]))
            res[f"fused{tuple(c)}"] = (do_bench_cudagraph(lambda: call(c, True), rep=200), err, finite)
        except Exception as e:  # a tile that does not fit (shared memory)
            res[f"fused{tuple(c)}"] = ("err", str(e)[:120])
    flops = 4 * b * hq * n * n * d * 2.5 / (2 if s["causal"] else 1)  # backward: 2.5x the forward's, every key
    res["tflops_pair"] = flops / res["pair"] / 1e9
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("only", nargs="*", help="substrings of the shape names to run (all by default)")
    ap.add_argument("--few", action="store_true", help=f"fused with the tiles {FEW} only")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = []
    for s in SHAPES:
        if args.only and not any(o in s["name"] for o in args.only):
            continue
        rows.append(measure(s, FEW if args.few else TILES))
        print(rows[-1], flush=True)
    print("\nshape | pair ms | sdpa bwd ms | best fused ms (tile) | best/pair | best/sdpa")
    for r in rows:
        fused = {k: v for k, v in r.items() if k.startswith("fused") and isinstance(v[0], float)}
        best = min(fused, key=lambda k: fused[k][0]) if fused else None
        bt = fused[best][0] if best else float("nan")
        print(f"{r['shape']} | {r['pair']:.3f} | {r['sdpa_bwd']:.3f} | {bt:.3f} {best} | {bt / r['pair']:.3f} | "
              f"{bt / r['sdpa_bwd']:.3f}")
    if args.out:
        Path(args.out).write_text(json.dumps(dict(rows=rows, torch=torch.__version__,
                                                  gpu=torch.cuda.get_device_name()), indent=1))


if __name__ == "__main__":
    main()
