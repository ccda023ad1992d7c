"""GPU µs of the lowered decode op (`fa3_decode::fwd`, partial pass and combine) per split count (device run).

For each shape: the op's time per call in CUDA-graph replay (`triton.testing.do_bench_cudagraph`, so launch
host time is excluded) at 1, 2, 4 and 8 splits and at the count the launcher's planner picks
(`fa_compile/kernels/decode.py` plan_splits), and each count's max |difference| from the 1-split output. The
GPU time a split saves is what it must beat: in a graph launched without CUDA graphs each extra split count
costs one more launch (the combine) of host time (`benchmarks/launch_host.py`).

    python benchmarks/decode_splits.py
"""
from __future__ import annotations

import torch

# (B, Hq, Hkv, D, cache slots, valid keys per sequence)
SHAPES = [
    (2, 16, 8, 128, 320, 300), (2, 16, 8, 128, 512, 300), (2, 16, 8, 128, 1024, 600), (2, 16, 8, 128, 2048, 1500),
    (2, 16, 8, 128, 4096, 3000), (4, 16, 16, 64, 512, 300), (4, 16, 16, 64, 1024, 600), (4, 16, 16, 64, 2048, 1500),
    (8, 16, 8, 128, 16384, 4224), (8, 16, 8, 128, 16384, 16000), (1, 32, 8, 128, 8192, 8000),
    (32, 32, 8, 128, 4096, 4000),
]


def main() -> None:
    if not torch.cuda.is_available():
        print("decode_splits.py times CUDA kernels: no CUDA GPU here, nothing measured")
        return
    from triton.testing import do_bench_cudagraph

    from fa_compile.kernels import decode, decode_ops

    torch.manual_seed(0)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; µs per call (CUDA-graph replay), "
          "max |difference from 1 split|")
    for b, hq, hkv, d, cap, valid in SHAPES:
        q = torch.randn(b, hq, 1, d, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(b, hkv, cap, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        lens = torch.full((b,), valid, device="cuda", dtype=torch.int32)
        bn = decode.pick_block_n(d, None)
        planned = decode.plan_splits(0, b, hkv, cap, q.device, bn)
        ref = None
        cells = []
        for s in sorted({1, 2, 4, 8, planned}):
            if s > -(-cap // bn):
                continue

            def fn(s: int = s):
                return decode_ops.fwd(q, k, v, None, lens, None, d ** -0.5, False, 0, s, bn, 0)

            out = fn()[0]
            ref = out if ref is None else ref
            err = (out.float() - ref.float()).abs().max().item()
            cells.append(f"{s}: {do_bench_cudagraph(fn, rep=30) * 1e3:.2f} ({err:.1e})")
        print(f"B{b} Hq{hq}/Hkv{hkv} d{d}, {cap} slots, {valid} valid, planned {planned} | " + ", ".join(cells),
              flush=True)


if __name__ == "__main__":
    main()
