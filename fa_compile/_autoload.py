"""Opt-in without code changes. torch calls `autoload()` at the end of `import torch` (its
`torch.backends` entry-point group, meant for out-of-tree extensions). With FA_COMPILE unset this
returns after one environment lookup; with FA_COMPILE=1 it chains our pass into Inductor's
`pre_grad_custom_pass`, which sees the Dynamo graph of every `torch.compile(model)` that uses the
default backend, whatever its mode. Importing this module imports the package, whose __init__ also
puts the import hook of `fa_compile.hf` in place (standard library only: attn_implementation="fa3"
registers when transformers' modeling code loads). TORCH_DEVICE_BACKEND_AUTOLOAD=0 disables all such hooks."""
from __future__ import annotations

import os


def autoload() -> None:
    value = os.environ.get("FA_COMPILE", "").strip().lower()
    if value not in ("1", "true", "yes", "on"):
        if value not in ("", "0", "false", "no", "off"):
            from .config import fa_compile_flag

            fa_compile_flag()  # an unrecognised value: one warning naming the valid ones
        return
    try:
        from .compiler import install_inductor_pass

        install_inductor_pass()
    except Exception as e:  # never break `import torch` for the user: warn and stay out of the way
        import warnings

        warnings.warn(f"FA_COMPILE=1 but fa-compile could not install its pass: {type(e).__name__}: {e}")
