"""Environment switches, read when used (never cached, so tests and users can flip them)."""
from __future__ import annotations

import os

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


# os.environ.get costs microseconds (it re-encodes the key); the per-call dispatch reads a few
# switches, so on POSIX read CPython's underlying bytes mapping, which os.environ keeps current.
_ENV_BYTES = getattr(os.environ, "_data", None) if os.name == "posix" else None
_ENCODED: dict[str, bytes] = {}


def env(name: str) -> str | None:
    """os.environ.get(name), cheaply (the dispatch hot path)."""
    if _ENV_BYTES is None:
        return os.environ.get(name)
    key = _ENCODED.get(name)
    if key is None:
        key = _ENCODED[name] = name.encode()
    raw = _ENV_BYTES.get(key)
    return None if raw is None else raw.decode(errors="surrogateescape")


def _flag(name: str) -> str:
    return (env(name) or "").strip().lower()


def flag_on(name: str) -> bool:
    return _flag(name) in _TRUE


def opt_in() -> bool:
    """FA_COMPILE=1: apply the rewrite to torch.compile's default (Inductor) backend too."""
    return _flag("FA_COMPILE") in _TRUE


def killed() -> bool:
    """FA_COMPILE=0: no rewrite anywhere, backend="fa3" included (a kill switch)."""
    return _flag("FA_COMPILE") in _FALSE


def log_enabled() -> bool:
    return _flag("FA_COMPILE_LOG") in _TRUE
