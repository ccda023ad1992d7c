"""fa-compile: a torch.compile backend that runs every attention in a model as one fused kernel.

    torch.compile(model, backend="fa3")                 # registered by entry point, no import needed
    torch.compile(model, backend=fa_compile.backend(inner="aot_eager", kernel="reference"))
    print(fa_compile.explain(model, *example_inputs))   # what was rewritten, what was not and why
    out = fa_compile.attention(q, k, v, causal=True)    # the fused op, called directly
    torch.compile(model, backend=fa_compile.backend(fp8=True))  # FP8 attention at inference sites (opt-in)
    AutoModel.from_config(cfg, attn_implementation="fa3")  # Hugging Face: the op, no compile needed

Public names (`__all__`):
    backend       a configured torch.compile backend (inner compiler, forced kernel, Inductor mode)
    fa3           the backend registered as "fa3" (`backend()` with its defaults)
    explain       trace a model once and report every attention site, rewritten or missed and why
    ExplainReport the report `explain` returns (`.rows`, `.rewritten`, `.missed`, `str()`)
    attention     fused attention with FlashAttention-style arguments
    paged_attention  decode attention against a contiguous or paged KV cache, read in place
                  (FA3 flash_attn_with_kvcache conventions; registers torch.ops.fa3.paged_attention)
    context_parallel  shard the sequence across a device mesh: every fa3.attention inside runs ring
                  attention over the shards, forward and backward (fa_compile/distributed/)
    context_parallel_unshard  gather sequence shards made under context_parallel back in order
    __version__

Environment: FA_COMPILE=1 applies the rewrite to a plain `torch.compile(model)`; FA_COMPILE=0 turns
it off everywhere; FA_COMPILE_LOG=1 prints the site table at compile time; FA_COMPILE_KERNEL=name
forces a kernel; FA_COMPILE_TUNE=1 times the eligible kernels per shape bucket and caches the winner.
FA_COMPILE_FP8=1 runs every eligible inference site in FP8 (as backend(fp8=True)).
`python -m fa_compile` lists the kernels this machine can run.

The package is imported at `import torch` (entry point group `torch.backends`) only to read
FA_COMPILE, so importing it must stay cheap: everything below loads on first use, and the Hugging
Face registration (`fa_compile.hf`) imports nothing of transformers until transformers is imported.
"""
from __future__ import annotations

import importlib
from typing import Any

from . import hf as _hf
from .distributed import sharding as _sharding

__version__ = "0.1.0"

_LAZY = {
    "backend": ("compiler", "backend"),
    "fa3": ("compiler", "fa3"),
    "explain": ("report", "explain"),
    "ExplainReport": ("report", "ExplainReport"),
    "attention": ("api", "attention"),
    "paged_attention": ("paged", "paged_attention"),
    "context_parallel": ("distributed.context", "context_parallel"),
    "context_parallel_unshard": ("distributed.context", "context_parallel_unshard"),
}

__all__ = [*_LAZY, "__version__"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        mod, attr = _LAZY[name]
        value = getattr(importlib.import_module(f"{__name__}.{mod}"), attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'fa_compile' has no attribute {name!r}")


def __dir__() -> list:
    return sorted(set(globals()) | set(__all__))


_hf.install()  # attn_implementation="fa3" for transformers, registered when (or once) it is imported
_sharding.install()  # DTensor sharding rules of the fa3 ops, registered once DTensor and the ops are imported
