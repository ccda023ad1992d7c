"""`python -m fa_compile`: versions, kernels with their availability, and the kernel a shape would get."""
from __future__ import annotations

import subprocess
import sys

import torch


def info(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fa_compile", *args], capture_output=True, text=True, timeout=300)


def test_lists_versions_and_every_kernel_and_the_choice_for_a_shape():
    out = info("--shape", "2,16,1024,128", "--dtype", "bf16", "--causal", "--backward")
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert f"torch                  {torch.__version__}" in text
    for name in ("cudnn", "fa3", "fa4", "triton", "flash", "efficient", "reference"):
        assert f"\n  {name} " in text
    assert "q 2x16x1024x128, k/v 2x16x1024x128, bfloat16, causal" in text
    if not torch.cuda.is_available():  # on CPU every fused kernel refuses, and each says why
        assert "  forward: reference" in text and "  backward: reference" in text
        assert "cudnn passed over: cuDNN (SDPA) runs on CUDA only" in text


def test_bad_arguments_exit_2_naming_the_argument():
    out = info("--shape", "2,16,1024")
    assert out.returncode == 2 and "--shape: expected B,H,N,D" in out.stderr
    out = info("--shape", "2,16,1024,128", "--kv-heads", "5")
    assert out.returncode == 2 and "--kv-heads: must divide H=16" in out.stderr
    out = info("--shape", "2,16,1024,128", "--kv-heads", "0")  # was read as "not given"
    assert out.returncode == 2 and "--kv-heads: must divide H=16, got 0" in out.stderr
    out = info("--shape", "2,16,1024,128", "--kv-len", "0")
    assert out.returncode == 2 and "--kv-len: must be positive, got 0" in out.stderr
    out = info("--kv-heads", "4", "--causal")  # was ignored without a shape
    assert out.returncode == 2 and "--kv-heads, --causal: describe the shape given by --shape" in out.stderr
