"""Where a model's forward time goes under each variant: top CUDA kernels by total time (device run).

    python benchmarks/profile_model.py --model gpt2
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from models import FULL, build, backend_for  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gpt2")
    ap.add_argument("--top", type=int, default=12)
    args = ap.parse_args()
    spec = FULL[args.model]
    ids = torch.randint(0, 30000, (spec["B"], spec["N"]), device="cuda")
    for label, attn, backend in (("eager+fa3", "eager", "fa3"), ("sdpa+inductor", "sdpa", "inductor")):
        torch._dynamo.reset()
        model = build(args.model, attn, spec["cfg"], "cuda", torch.bfloat16).eval()
        f = torch.compile(model, backend=backend_for(backend, "inductor"))
        with torch.no_grad():
            for _ in range(3):
                f(input_ids=ids)
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    f(input_ids=ids)
                torch.cuda.synchronize()
        print(f"\n== {args.model} {label}: top CUDA kernels over 5 forwards")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.top, max_name_column_width=70))
        del model, f
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
