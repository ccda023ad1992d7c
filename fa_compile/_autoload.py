"""Opt-in without code changes. torch calls `autoload()` at the end of `import torch` (its
`torch.backends` entry-point group, meant for out-of-tree extensions). With FA_COMPILE unset this
returns after one environment lookup; with FA_COMPILE=1 it chains our pass into Inductor's
`pre_grad_custom_pass`, which sees the Dynamo graph of every `torch.compile(model)` that uses the
default backend, whatever its mode. TORCH_DEVICE_BACKEND_AUTOLOAD=0 disables all such hooks."""
from __future__ import annotations

import os


def autoload() -> None:
    if os.environ.get("FA_COMPILE", "").strip().lower() not in ("1", "true", "yes", "on"):
        return
    try:
        from .compiler import install_inductor_pass

        install_inductor_pass()
    except Exception as e:  # never break `import torch` for the user: warn and stay out of the way
        import warnings

        warnings.warn(f"FA_COMPILE=1 but fa-compile could not install its pass: {type(e).__name__}: {e}")
