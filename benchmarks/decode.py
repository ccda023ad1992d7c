"""Decode benchmark: attention of one new token per sequence against long KV caches, paged and
contiguous, as achieved bandwidth of the K/V bytes a step must read, all peers in ONE run.

Rows (the issue's shapes): 32 q / 8 kv heads, head dim 128, bf16, every sequence at full length:
B32 x 4k page 16, B8 x 32k page 64, B128 x 2k page 16. Columns:
    copy        a device-to-device copy of as many bytes as the K/V cache (read + write counted)
    cudnn       SDPA (cuDNN backend, GQA) on the contiguous [B, Hkv, L, D] view of a BSHD cache
    fa3         FA3's flash_attn_with_kvcache on the contiguous cache (cache_seqlens)
    fa3_paged   the same with page_table over a shuffled pool of pages
    gather_sdpa the pool gathered through the table into a contiguous copy, then SDPA (default backend)
    ours        fa_compile.paged_attention(..., page_table) (the Triton split-KV kernel), and
    ours_contig the same on the contiguous cache (no table)
TB/s = K and V bytes needed (2 * B * L * Hkv * D * 2) / time; ratios are against the copy.
Each implementation is checked against the fp32 reference first (max abs error printed).
Times: triton.testing.do_bench_cudagraph (host launch cost excluded; do_bench where capture fails).

Run on a GPU machine:  python benchmarks/decode.py [--nq 1] [--out DIR]   (about a minute)
Prints the table and writes decode.json to --out (default $OUT or /tmp).
`--sweep` instead times our kernel alone over launch configurations (keys per tile, warps, pipeline
stages, splits) on the same shapes plus a static cache with a quarter of its slots valid, and writes
decode-sweep.json: what `fa_compile/kernels/decode.py`'s choices are pinned from.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import fa_compile
from fa_compile.kernels import decode
from fa_compile.kernels.decode_reference import paged_attention_reference

SHAPES = [  # (batch, length, page)
    (32, 4096, 16),
    (8, 32768, 64),
    (128, 2048, 16),
]
HQ, HKV, D = 32, 8, 128


def bench(fn: Callable[[], object]) -> tuple[float, str]:
    """(median ms, method)."""
    from triton.testing import do_bench, do_bench_cudagraph

    fn()
    torch.cuda.synchronize()
    try:
        return do_bench_cudagraph(fn, rep=100, return_mode="median"), "graph"
    except Exception:
        torch.cuda.synchronize()
        return do_bench(fn, warmup=25, rep=100, return_mode="median"), "stream"


def fa3_module():
    try:
        import flash_attn_interface  # noqa: PLC0415

        return flash_attn_interface
    except Exception as e:
        print(f"FA3 not importable: {type(e).__name__}: {str(e)[:120]}", file=sys.stderr)
        return None


def make_inputs(b: int, n: int, page: int, nq: int, dtype=torch.bfloat16, seed: int = 0, dev: str = "cuda") -> dict:
    """A contiguous BSHD cache and the same keys as a shuffled pool of pages with its table."""
    g = torch.Generator(device=dev).manual_seed(seed)
    q = torch.randn(b, nq, HQ, D, device=dev, dtype=dtype, generator=g)
    k = torch.randn(b, n, HKV, D, device=dev, dtype=dtype, generator=g)
    v = torch.randn(b, n, HKV, D, device=dev, dtype=dtype, generator=g)
    pages = n // page
    perm = torch.randperm(b * pages, device=dev, generator=g)
    table = perm.view(b, pages).to(torch.int32)
    kp = torch.empty(b * pages, page, HKV, D, device=dev, dtype=dtype)
    vp = torch.empty_like(kp)
    kp[table.long().view(-1)] = k.view(b * pages, page, HKV, D)
    vp[table.long().view(-1)] = v.view(b * pages, page, HKV, D)
    seqlens = torch.full((b,), n, device=dev, dtype=torch.int32)
    return dict(q=q, k=k, v=v, kp=kp, vp=vp, table=table, seqlens=seqlens)


def implementations(x: dict, fa3) -> dict[str, Callable[[], torch.Tensor]]:
    q, k, v, kp, vp, table, seqlens = (x[n] for n in ("q", "k", "v", "kp", "vp", "table", "seqlens"))
    b, nq = q.shape[0], q.shape[1]
    n = k.shape[1]
    scale = D ** -0.5
    causal = nq > 1
    fns: dict[str, Callable[[], torch.Tensor]] = {}
    qh = q.transpose(1, 2)  # [B, Hq, Nq, D] view

    # Bottom-right causal for Nq > 1: a boolean mask built once, outside the timed calls.
    mask = None
    if causal:
        i = torch.arange(nq, device=q.device).view(-1, 1)
        mask = torch.arange(n, device=q.device).view(1, -1) <= n - nq + i

    def sdpa(kk, vv):
        kh, vh = kk.transpose(1, 2), vv.transpose(1, 2)  # [B, Hkv, L, D] views of BSHD storage
        return F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=True)

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return sdpa(k, v)

    def gather_sdpa():
        return sdpa(kp[table.long()].view(b, n, HKV, D), vp[table.long()].view(b, n, HKV, D))

    fns["cudnn"] = cudnn
    if fa3 is not None:
        fns["fa3"] = lambda: fa3.flash_attn_with_kvcache(q, k, v, cache_seqlens=seqlens, softmax_scale=scale,
                                                         causal=causal)
        fns["fa3_paged"] = lambda: fa3.flash_attn_with_kvcache(q, kp, vp, cache_seqlens=seqlens, page_table=table,
                                                               softmax_scale=scale, causal=causal)
    fns["gather_sdpa"] = gather_sdpa
    fns["ours"] = lambda: fa_compile.paged_attention(q, kp, vp, seqlens, table, softmax_scale=scale, causal=causal,
                                                     kernel="triton")
    fns["ours_contig"] = lambda: fa_compile.paged_attention(q, k, v, seqlens, softmax_scale=scale, causal=causal,
                                                            kernel="triton")
    return fns


def as_bshd(res, q: torch.Tensor) -> torch.Tensor:
    out = res[0] if isinstance(res, (tuple, list)) else res
    if out.shape != q.shape:  # SDPA: [B, Hq, Nq, D]
        out = out.transpose(1, 2)
    return out


def run_shape(b: int, n: int, page: int, nq: int, fa3) -> dict:
    x = make_inputs(b, n, page, nq)
    kv_bytes = 2 * b * n * HKV * D * x["k"].element_size()
    row: dict = dict(batch=b, length=n, page=page, nq=nq, kv_bytes=kv_bytes,
                     splits=decode.plan_splits(0, b, HKV, n, x["q"].device, decode.pick_block_n(128, page)))
    src = torch.empty(kv_bytes // 2, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    ms, _ = bench(lambda: dst.copy_(src))
    row["copy_tbps"] = 2 * kv_bytes / (ms * 1e-3) / 1e12
    del src, dst
    ref_out, _ = paged_attention_reference(x["q"].float(), x["kp"].float(), x["vp"].float(), x["seqlens"], x["table"],
                                           scale=D ** -0.5, causal=nq > 1)
    for name, fn in implementations(x, fa3).items():
        try:
            err = (as_bshd(fn(), x["q"]).float() - ref_out).abs().max().item()
            ms, how = bench(fn)
        except Exception as e:  # a peer that cannot run this shape: recorded, not fatal
            row[f"{name}_error"] = f"{type(e).__name__}: {str(e)[:160]}"
            continue
        row[f"{name}_ms"] = ms
        row[f"{name}_tbps"] = kv_bytes / (ms * 1e-3) / 1e12
        row[f"{name}_err"] = err
        row[f"{name}_timing"] = how
    del x
    torch.cuda.empty_cache()
    return row


COLS = ["cudnn", "fa3", "fa3_paged", "gather_sdpa", "ours", "ours_contig"]


def print_table(rows: list[dict]) -> None:
    head = f"{'shape':<22}{'splits':>7}{'copy':>8}" + "".join(f"{c:>13}" for c in COLS)
    print(head)
    for r in rows:
        line = f"B{r['batch']} x {r['length']} p{r['page']} nq{r['nq']:<3}".ljust(22) + f"{r['splits']:>7}"
        line += f"{r['copy_tbps']:>8.2f}"
        for c in COLS:
            line += f"{r[c + '_tbps']:>13.2f}" if f"{c}_tbps" in r else f"{'n/a':>13}"
        print(line)
    print("\nratio to copy / ours vs peers (TB/s over TB/s); max abs error vs fp32 reference")
    for r in rows:
        parts = [f"{c} {r[c + '_tbps'] / r['copy_tbps']:.2f}" for c in COLS if f"{c}_tbps" in r]
        if "ours_tbps" in r:
            for peer in ("fa3_paged", "cudnn", "gather_sdpa"):
                if f"{peer}_tbps" in r:
                    parts.append(f"ours/{peer} {r['ours_tbps'] / r[peer + '_tbps']:.2f}")
        errs = ", ".join(f"{c} {r[c + '_err']:.1e}" for c in COLS if f"{c}_err" in r)
        print(f"B{r['batch']} x {r['length']}: " + "; ".join(parts) + f"\n    err: {errs}")
        for c in COLS:
            if f"{c}_error" in r:
                print(f"    {c}: {r[c + '_error']}")


SWEEP_CASES = [  # (batch, valid length, capacity, page or None)
    (32, 4096, 4096, 16),
    (8, 32768, 32768, 64),
    (128, 2048, 2048, 16),
    (8, 4096, 16384, None),  # a static cache four times longer than its valid part
]


def sweep(nq: int, rep: int = 40, only: Optional[list[int]] = None, out: Optional[str] = None) -> list[dict]:
    """Our kernel alone over (block_n, warps, stages, splits); the default choice timed alongside."""
    from triton.testing import do_bench_cudagraph

    results = []
    orig_opts = decode.launch_options
    cases = SWEEP_CASES if only is None else [SWEEP_CASES[i] for i in only]
    for b, valid, cap, page in cases:
        x = make_inputs(b, cap, page or 16, nq)
        q = x["q"]
        kk, vv, table = (x["kp"], x["vp"], x["table"]) if page else (x["k"], x["v"], None)
        lens = torch.full((b,), valid, device="cuda", dtype=torch.int32)
        kv_bytes = 2 * b * valid * HKV * D * 2
        ref, _ = paged_attention_reference(q.float(), x["kp"].float(), x["vp"].float(), lens, x["table"],
                                           scale=D ** -0.5, causal=nq > 1)
        default_bn = decode.pick_block_n(128, page)
        s0 = decode.plan_splits(0, b, HKV, cap, q.device, default_bn)
        configs = [(None, None, None, 0)]
        for bn, w, st in ((32, 2, 2), (64, 2, 2), (64, 4, 2), (64, 4, 3), (128, 4, 3)):
            for sp in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32):
                configs.append((bn, w, st, sp))
        case = dict(batch=b, valid=valid, capacity=cap, page=page, nq=nq, default_splits=s0, default_block_n=default_bn,
                    runs=[])
        for bn, w, st, sp in configs:
            if bn is not None:
                decode.launch_options = lambda *_a, w=w, st=st: (dict(num_warps=w, num_stages=st), dict(num_warps=4))
            try:
                fn = lambda: decode.paged_decode(q, kk, vv, lens, table, scale=D ** -0.5, causal=nq > 1,
                                                 num_splits=sp, block_n=bn)
                err = (fn()[0].float() - ref).abs().max().item()
                ms = do_bench_cudagraph(fn, rep=rep, return_mode="median")
                case["runs"].append(dict(block_n=bn, warps=w, stages=st, splits=sp, ms=ms, err=err,
                                         tbps=kv_bytes / (ms * 1e-3) / 1e12))
            except Exception as e:
                case["runs"].append(dict(block_n=bn, warps=w, stages=st, splits=sp, error=f"{type(e).__name__}: {str(e)[:100]}"))
            finally:
                decode.launch_options = orig_opts
            r = case["runs"][-1]
            print(f"  B{b} {valid}/{cap} p{page} bn {bn} w {w} st {st} sp {sp}: "
                  + (f"{r['tbps']:.2f} TB/s {r['ms'] * 1e3:.1f} us err {r['err']:.1e}" if "ms" in r else r["error"]),
                  flush=True)
        ok = sorted((r for r in case["runs"] if "ms" in r and r["err"] < 2e-2), key=lambda r: r["ms"])
        dflt = case["runs"][0]
        print(f"B{b} valid {valid} / {cap} page {page}: default (bn {default_bn}, splits {s0}) "
              f"{dflt.get('tbps', float('nan')):.2f} TB/s; best:")
        for r in ok[:6]:
            print(f"    bn {r['block_n']} warps {r['warps']} stages {r['stages']} splits {r['splits']}: "
                  f"{r['tbps']:.2f} TB/s ({r['ms'] * 1e3:.1f} us, err {r['err']:.1e})")
        bad = [r for r in case["runs"] if "error" in r or r.get("err", 0) >= 2e-2]
        if bad:
            print(f"    {len(bad)} configs failed or were wrong, e.g. {bad[0]}")
        results.append(case)
        if out:  # after every case, so a run cut short keeps what it measured
            with open(os.path.join(out, "decode-sweep.json"), "w") as f:
                json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, cases=results), f, indent=1)
        del x
        torch.cuda.empty_cache()
    return results


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--nq", type=int, default=1, help="query tokens per sequence (1: plain decode)")
    p.add_argument("--sweep", action="store_true", help="time our kernel over launch configurations instead")
    p.add_argument("--cases", default="", help="with --sweep: indices into SWEEP_CASES, comma-separated")
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    a = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    if a.sweep:
        os.makedirs(a.out, exist_ok=True)
        sweep(a.nq, only=[int(i) for i in a.cases.split(",")] if a.cases else None, out=a.out)
        return
    fa3 = fa3_module()
    t0 = time.time()
    rows = []
    for b, n, page in SHAPES:
        rows.append(run_shape(b, n, page, a.nq, fa3))
        print(f"done B{b} x {n} ({time.time() - t0:.0f}s)", file=sys.stderr)
    print(f"{torch.cuda.get_device_name()}, bf16, {HQ} q / {HKV} kv heads, d{D}; TB/s of the K/V bytes read")
    print_table(rows)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "decode.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
