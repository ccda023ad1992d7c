"""Where a model's time goes under each variant (device run): GPU busy time against wall time,
host time per attention call, device-to-host syncs, and the top CUDA kernels.

    python benchmarks/profile_model.py --model gpt2            # forward, B x N of models.py (also bert, vit)
    python benchmarks/profile_model.py --model llama --decode  # one-token decode steps, static cache
    python benchmarks/profile_model.py --model bert --train    # training steps (forward, loss, backward)
A forward whose GPU busy time is well under its wall time is host-bound (or stalls on syncs:
the sync rows say which).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from models import FULL, backend_for, build, inputs  # noqa: E402

_SYNC_WORDS = ("Synchronize", "Memcpy", "item", "nonzero", "_local_scalar_dense")


def _decode_step(model, b: int, prompt: int):
    """A callable running one decode step of a static cache of `prompt` + 64 positions."""
    from transformers import StaticCache

    cache = StaticCache(config=model.config, max_cache_len=prompt + 64)
    ids = torch.randint(0, model.config.vocab_size, (b, prompt), device="cuda")
    model(input_ids=ids, past_key_values=cache, cache_position=torch.arange(prompt, device="cuda"), use_cache=True)
    tok = ids[:, -1:]
    pos = torch.tensor([prompt], device="cuda")
    return lambda: model(input_ids=tok, past_key_values=cache, cache_position=pos, use_cache=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gpt2")
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--decode", action="store_true", help="profile one-token decode steps (B2, prompt 256)")
    ap.add_argument("--mode", default=None, help="torch.compile mode for both variants")
    ap.add_argument("--train", action="store_true", help="profile training steps (dropout on, backward)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/profile_model.py: needs a CUDA GPU (it times CUDA kernels) and none is visible here")
    spec = FULL[args.model]
    for label, attn, backend in (("eager+fa3", "eager", "fa3"), ("sdpa+inductor", "sdpa", "inductor")):
        torch._dynamo.reset()
        model = build(args.model, attn, spec["cfg"], "cuda", torch.bfloat16)
        model.train(args.train)
        be = backend_for(backend, "inductor")
        if args.mode and backend == "fa3":
            import fa_compile

            be, mode = fa_compile.backend("inductor", mode=args.mode), None
        else:
            mode = args.mode
        with torch.set_grad_enabled(args.train):
            if args.train:
                f = torch.compile(model, backend=be, mode=mode)
                kw = inputs(args.model, model, spec, "cuda", torch.bfloat16)[1]

                def fn():
                    f(**kw).loss.backward()
                    for p in model.parameters():
                        p.grad = None
            elif args.decode:
                model.forward = torch.compile(model.forward, backend=be, mode=mode, dynamic=False)
                fn = _decode_step(model, 2, 256)
            else:
                f = torch.compile(model, backend=be, mode=mode)
                kw = inputs(args.model, model, spec, "cuda", torch.bfloat16)[0]
                fn = lambda: f(**kw)  # noqa: E731
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(args.iters):
                fn()
            torch.cuda.synchronize()
            wall = (time.perf_counter() - t0) / args.iters * 1e3
            acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            with torch.profiler.profile(activities=acts) as prof:
                for _ in range(args.iters):
                    fn()
                torch.cuda.synchronize()
        events = prof.key_averages()
        gpu_us = sum(e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
        what = "train step" if args.train else "decode step" if args.decode else "forward"
        print(f"\n== {args.model} {label}: {what} wall {wall:.3f} ms (unprofiled), GPU busy "
              f"{gpu_us / args.iters / 1e3:.3f} ms per {what}")
        for e in events:
            if e.key.startswith("fa3::") or any(w in e.key for w in _SYNC_WORDS):
                print(f"   {e.key[:60]:60s} calls {e.count // args.iters:5d}/{what}  host {e.cpu_time_total / max(e.count, 1):8.1f} us/call")
        print(events.table(sort_by="cuda_time_total", row_limit=args.top, max_name_column_width=70))
        del model
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
