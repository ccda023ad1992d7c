"""fa-compile: a torch.compile backend that runs every attention in a model as one fused kernel.

    torch.compile(model, backend="fa3")                 # registered by entry point, no import needed
    torch.compile(model, backend=fa_compile.backend(inner="aot_eager", kernel="reference"))
    print(fa_compile.explain(model, *example_inputs))   # what was rewritten, what was not and why

Environment: FA_COMPILE=1 applies the rewrite to a plain `torch.compile(model)`; FA_COMPILE=0 turns
it off everywhere; FA_COMPILE_LOG=1 prints the site table at compile time; FA_COMPILE_KERNEL=name
forces a kernel; FA_COMPILE_TUNE=1 times the eligible kernels per shape bucket and caches the winner.

The package is imported at `import torch` (entry point group `torch.backends`) only to read
FA_COMPILE, so importing it must stay cheap: everything below loads on first use.
"""
from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "backend": ("compiler", "backend"),
    "fa3": ("compiler", "fa3"),
    "explain": ("report", "explain"),
    "ExplainReport": ("report", "ExplainReport"),
    "attention": ("api", "attention"),
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        mod, attr = _LAZY[name]
        value = getattr(importlib.import_module(f"{__name__}.{mod}"), attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'fa_compile' has no attribute {name!r}")


__all__ = list(_LAZY)
