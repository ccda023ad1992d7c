"""Environment switches, read when used (never cached, so tests and users can flip them)."""
from __future__ import annotations

import os

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def _flag(name: str) -> str:
    return os.environ.get(name, "").strip().lower()


def opt_in() -> bool:
    """FA_COMPILE=1: apply the rewrite to torch.compile's default (Inductor) backend too."""
    return _flag("FA_COMPILE") in _TRUE


def killed() -> bool:
    """FA_COMPILE=0: no rewrite anywhere, backend="fa3" included (a kill switch)."""
    return _flag("FA_COMPILE") in _FALSE


def log_enabled() -> bool:
    return _flag("FA_COMPILE_LOG") in _TRUE
