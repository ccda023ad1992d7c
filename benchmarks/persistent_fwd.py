"""The Gluon forward with one program per SM walking the tiles (persistent) against one program per tile, beside
our pointer kernel and cuDNN in the same run (H200 / Hopper only).

Every row first checks that each persistent variant writes the same bits as the one-tile-per-program kernel into
NaN-poisoned outputs (the same tiles with the same math, only scheduled differently), and the error of the latter
against fp32 SDPA; then times every variant in alternating rounds (`do_bench` medians; the median of the rounds).
Under a causal mask the persistent variants run only where the table makes programs persistent (up to
GLUON_PERSISTENT_UNEVEN_BLOCKS query blocks per (batch, head)); --uneven lifts that limit.
Shapes: a padded encoder (B32 x 512, 16 heads, d64, half the batch with 256 keys: key lengths and a bool key mask,
as the lowering hands a Hugging Face BERT's sites to the kernel) and the FA3 paper's grid (16k tokens, hidden
2048) at N 1k, 2k and 16k, d64 / d128 / d256, causal and not.

    python benchmarks/persistent_fwd.py [--quick] [--uneven] [--only NAME] [--rounds 3] [--out FILE.json]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
from pathlib import Path
from unittest import mock

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

os.environ["FA_COMPILE_GLUON"] = "1"  # a Gluon build failure raises here instead of falling back quietly

from fa_compile.kernels import triton_family as tf  # noqa: E402
from fa_compile.kernels.triton_family import BlockConfig as C  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernel_peers import Args, bench, bshd  # noqa: E402

# Persistent variants per head-dim block besides the table's tile: (label, config).
EXTRA = {128: [("persistent s2", C(128, 128, 4, 2, pingpong=True, persistent=True))],
         256: [("persistent s2", C(128, 64, 4, 2, persistent=True))]}


def shapes(quick: bool) -> list[dict]:
    rows = [dict(name="encoder B32 x 512 d64, key padding", b=32, h=16, n=512, d=64, causal=False, padded=True)]
    for d in (64, 128, 256):
        for n in ((2048, 16384) if quick else (1024, 2048, 16384)):
            for causal in (False, True):
                rows.append(dict(name=f"d{d} N{n}{' causal' if causal else ''}", b=16384 // n, h=2048 // d, n=n, d=d,
                                 causal=causal, padded=False))
    return rows


def _args(row: dict) -> tuple[Args, dict]:
    b, h, n, d = row["b"], row["h"], row["n"], row["d"]
    q, k, v = bshd(b, h, n, d), bshd(b, h, n, d), bshd(b, h, n, d)
    kw: dict = {}
    if row["padded"]:
        lens = torch.full((b,), n, device="cuda", dtype=torch.int32)
        lens[b // 2:] = n // 2
        kw["kv_lens"] = lens
        kw["bias"] = (torch.arange(n, device="cuda")[None, :] < lens[:, None]).view(b, 1, 1, n)
    return Args(q, k, v, causal=row["causal"], **kw), kw


def _kind(row: dict) -> str:
    return "fwd_gluon_rowbias" if row["padded"] else "fwd_gluon"


def _run_gluon(a: Args, row: dict, cfg: C, out=None, lse=None):
    key = (_kind(row), row["d"])
    tf.CONFIG_OVERRIDE[key] = cfg
    try:
        return tf.attention_forward(a, out, lse)
    finally:
        tf.CONFIG_OVERRIDE.pop(key, None)


def _run_pointer(a: Args):
    with mock.patch.dict(os.environ, FA_COMPILE_GLUON="0", FA_COMPILE_TRITON_TMA="0"):  # as the lowering launches
        return tf.attention_forward(a)


def _reference(a: Args, kw: dict) -> torch.Tensor:
    mask = kw.get("bias")
    return F.scaled_dot_product_attention(a.q.float(), a.k.float(), a.v.float(), attn_mask=mask, is_causal=a.causal)


def _poisoned(a: Args):
    b, h, n, d = a.q.shape
    out = torch.full((b, n, h, d), float("nan"), device="cuda", dtype=a.q.dtype).transpose(1, 2)
    return out, torch.full((b, h, n), float("nan"), device="cuda")


def run_row(row: dict, rounds: int) -> dict:
    a, kw = _args(row)
    d = row["d"]
    table = tf._gluon_config(None, d, row["padded"])[1]
    variants = [("gluon, one tile per program", dataclasses.replace(table, persistent=False))]
    if not row["causal"] or row["n"] <= tf.GLUON_PERSISTENT_UNEVEN_BLOCKS * 128:  # (else one program per tile)
        variants += [(f"persistent s{table.num_stages}", table)] if table.persistent else []
        variants += EXTRA.get(d, [])
    default = variants[0][1]
    ref = _reference(a, kw)
    base_out, base_lse = _poisoned(a)
    _run_gluon(a, row, default, base_out, base_lse)
    err = float((base_out.float() - ref).norm() / ref.norm())
    same = {}
    for label, cfg in variants[1:]:
        out, lse = _poisoned(a)
        _run_gluon(a, row, cfg, out, lse)
        same[label] = bool(torch.equal(out, base_out) and torch.equal(lse, base_lse))
    fns = {label: (lambda cfg=cfg: _run_gluon(a, row, cfg)) for label, cfg in variants}
    fns["pointer kernel"] = lambda: _run_pointer(a)
    mask = kw.get("bias")

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(a.q, a.k, a.v, attn_mask=mask, is_causal=a.causal)

    fns["cuDNN"] = cudnn
    for fn in fns.values():
        fn()
    runs: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            runs[k].append(bench(fn))
    ms = {k: statistics.median(v) for k, v in runs.items()}
    flops = 4 * row["b"] * row["h"] * row["n"] * row["n"] * d / (2 if row["causal"] else 1)
    return dict(row, err=err, same_bits=same, ms=ms, runs=runs,
                tflops={k: round(flops / t / 1e9, 1) for k, t in ms.items()})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="N 2k and 16k only")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--only", default=None, help="rows whose name contains this")
    ap.add_argument("--uneven", action="store_true", help="persistent programs under a causal mask at every length")
    ap.add_argument("--out", default=None)
    opt = ap.parse_args()
    if opt.uneven:
        tf.GLUON_PERSISTENT_UNEVEN_BLOCKS = 1 << 30
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        raise SystemExit("benchmarks/persistent_fwd.py: needs a Hopper GPU")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, bf16, BSHD; ms (TFLOP/s); ratio to cuDNN")
    results = []
    for row in shapes(opt.quick):
        if opt.only and opt.only not in row["name"]:
            continue
        r = run_row(row, opt.rounds)
        results.append(r)
        cud = r["ms"]["cuDNN"]
        cells = "  ".join(f"{k}: {t:.3f} ({r['tflops'][k]}, {t / cud:.3f}x)" for k, t in r["ms"].items())
        print(f"{row['name']:<36} err {r['err']:.1e} same bits {r['same_bits']}\n    {cells}", flush=True)
        if opt.out:
            json.dump(results, open(opt.out, "w"), indent=1)


if __name__ == "__main__":
    main()
