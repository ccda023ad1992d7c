"""`python -m fa_compile`: what this machine can run, and which kernel a given shape would get.

    python -m fa_compile                                          # versions, devices, kernels
    python -m fa_compile --shape 2,16,1024,128 --dtype bf16 --causal [--kv-heads 4] [--kv-len 4096] [--backward]

The kernel choice is dispatch's own (the same call explain() makes), asked on tensors of that shape on
the chosen device (`--device`, default cuda when available); every kernel ahead of it says why it
refused. Exit status 0, or 2 for a bad argument.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import platform
import sys
from typing import Optional, Sequence

# What each kernel takes, as its candidate checks it (fa_compile/candidates/, fa_compile/kernels/triton_family.py).
SUPPORTS = {
    "cudnn": "SDPA's cuDNN kernel: CUDA sm80+, fp16/bf16, head dim <= 256 (multiple of 8), float bias; fwd + bwd",
    "fa3": "FlashAttention 3 (flash_attn_interface): Hopper sm90, fp16/bf16, head dims of its build, softcap, "
           "key lengths; fwd (+ bwd when the build has it)",
    "fa4": "FlashAttention 4 (flash_attn.cute): sm90+, fp16/bf16, head dim <= 128; opt-in FA_COMPILE_FA4=1",
    "triton": "our Triton family: CUDA sm80+ (Gluon warp-specialized kernels on Hopper), fp16/bf16 (fp32 with "
              "TF32), head dim <= 256, every mask, softcap, dropout; CPU only under TRITON_INTERPRET=1",
    "flash": "SDPA's FlashAttention 2 kernel: CUDA sm80+, fp16/bf16, head dim <= 256, no bias; fwd + bwd",
    "efficient": "SDPA's memory-efficient kernel: CUDA sm50+, fp16/bf16 (fp32 with TF32); forward only",
    "reference": "the reference math in PyTorch: any device, any float dtype, every feature (the test oracle)",
}
DTYPES = {"fp16": "float16", "float16": "float16", "bf16": "bfloat16", "bfloat16": "bfloat16",
          "fp32": "float32", "float32": "float32", "fp64": "float64", "float64": "float64"}
PACKAGES = ("torch", "triton", "transformers", "tokenspeed-fa3", "flash-attn", "flash-attn-4", "fa-compile")


def _version(dist: str) -> Optional[str]:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _shape(text: str) -> tuple:
    try:
        dims = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shape: expected B,H,N,D as four integers, got {text!r}") from None
    if len(dims) != 4 or any(d <= 0 for d in dims):
        raise argparse.ArgumentTypeError(f"--shape: expected B,H,N,D as four positive integers, got {text!r}")
    return dims


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m fa_compile", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", type=_shape, help="B,H,N,D of q (k and v: --kv-heads, --kv-len)")
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES), help="q/k/v dtype (default bf16)")
    p.add_argument("--causal", action="store_true", help="causal mask (bottom-right when --kv-len > N)")
    p.add_argument("--kv-heads", type=int, help="K/V heads (GQA; default: H)")
    p.add_argument("--kv-len", type=int, help="number of keys (default: N)")
    p.add_argument("--backward", action="store_true", help="also the backward kernel (training)")
    p.add_argument("--device", help="cuda or cpu (default: cuda when available)")
    return p


def environment() -> list[str]:
    import torch

    lines = [f"fa-compile {_version('fa-compile') or '(not installed)'}, Python {platform.python_version()}, "
             f"{platform.system()} {platform.machine()}"]
    for name in PACKAGES[:-1]:
        v = _version(name)
        if v is None and importlib.util.find_spec(name.replace("-", "_")) is None:
            continue
        lines.append(f"  {name:<22} {v or 'importable'}")
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            cap = torch.cuda.get_device_capability(i)
            lines.append(f"  cuda:{i} {torch.cuda.get_device_name(i)} (sm{cap[0]}{cap[1]}), CUDA {torch.version.cuda}")
    elif getattr(torch.version, "hip", None):
        lines.append(f"  ROCm {torch.version.hip}: no GPU visible")
    else:
        lines.append("  no CUDA GPU visible: the reference runs (Triton's kernels under TRITON_INTERPRET=1 only)")
    return lines


def kernels(device: str) -> list[str]:
    from . import dispatch
    from .candidates import TRITON_IMPORT_ERROR

    import torch

    # One small probe per kernel: available means it has no installation or device refusal here.
    q = torch.zeros(1, 1, 128, 64, dtype=torch.bfloat16 if device == "cuda" else torch.float32, device=device)
    probe = dispatch.AttentionArgs(q=q, k=q, v=q, scale=0.125)
    lines = [f"kernels, in dispatch's base order (probed with a small {str(q.dtype).replace('torch.', '')} "
             f"input on {device}):"]
    names = [c.name for c in dispatch.candidates("forward")]
    if "triton" not in names:
        names.insert(names.index("reference"), "triton")
    for name in names:
        cand = next((c for c in dispatch.candidates("forward") if c.name == name), None)
        if cand is None:
            why = f"not importable ({TRITON_IMPORT_ERROR[0]})" if TRITON_IMPORT_ERROR else "not registered"
        else:
            reasons = cand.not_supported_reasons(probe)
            why = "available" if not reasons else "not here: " + "; ".join(reasons)
        lines.append(f"  {name:<10} {why}")
        lines.append(f"  {'':<10} {SUPPORTS.get(name, '')}")
    return lines


def choice(args: argparse.Namespace, device: str) -> list[str]:
    from . import dispatch

    import torch

    b, h, n, d = args.shape
    hkv = h if args.kv_heads is None else args.kv_heads  # (0 is refused below, not read as the default)
    nk = n if args.kv_len is None else args.kv_len
    if hkv <= 0 or h % hkv:
        raise SystemExit(_usage_error(f"--kv-heads: must divide H={h}, got {hkv}"))
    if nk <= 0:
        raise SystemExit(_usage_error(f"--kv-len: must be positive, got {nk}"))
    dtype = getattr(torch, DTYPES[args.dtype])
    with torch.device("meta"):  # shapes only: no memory, and candidates read no data
        q = torch.empty(b, h, n, d, dtype=dtype)
        kv = torch.empty(b, hkv, nk, d, dtype=dtype)
    if device != "meta":  # candidates look at the device: fake tensors on it, still without memory
        from torch._subclasses.fake_tensor import FakeTensorMode

        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            q = mode.from_tensor(torch.empty(0)).new_empty((b, h, n, d), dtype=dtype, device=device)
            kv = mode.from_tensor(torch.empty(0)).new_empty((b, hkv, nk, d), dtype=dtype, device=device)
    a = dispatch.AttentionArgs(q=q, k=kv, v=kv, scale=d ** -0.5, causal=args.causal, diag_offset=nk - n,
                               needs_backward=args.backward)
    lines = [f"q {b}x{h}x{n}x{d}, k/v {b}x{hkv}x{nk}x{d}, {DTYPES[args.dtype]}, "
             f"{'causal' if args.causal else 'no mask'}, on {device}:"]
    for direction in ("forward", "backward") if args.backward else ("forward",):
        chosen, refused = dispatch.explain_choice(a, None, direction)
        lines.append(f"  {direction}: {chosen}")
        lines += [f"    {name} passed over: {'; '.join(reasons)}" for name, reasons in refused]
    return lines


def _usage_error(msg: str) -> int:
    parser().print_usage(sys.stderr)
    print(f"python -m fa_compile: error: {msg}", file=sys.stderr)
    return 2


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parser().parse_args(argv)
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cuda", "cpu"):
        return _usage_error(f"--device: must be cuda or cpu, got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        return _usage_error("--device: cuda, but no CUDA GPU is visible")
    if args.shape is None:  # options that describe a shape mean nothing without one: say so, not ignore them
        given = [f for f, v in (("--kv-heads", args.kv_heads), ("--kv-len", args.kv_len), ("--causal", args.causal),
                                ("--backward", args.backward)) if v]
        if given:
            return _usage_error(f"{', '.join(given)}: describe the shape given by --shape, which is missing")
    print("\n".join(environment()))
    print("\n".join(kernels(device)))
    if args.shape is not None:
        print("\n".join(choice(args, device)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
