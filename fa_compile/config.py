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


_WARNED_VALUES: set = set()


def flag_on(name: str) -> bool:
    """An on/off switch: 1 / true / yes / on. Any other value but 0 / false / no / off (or unset) reads as off, with
    one warning naming the switch (FA_COMPILE_TUNE=maybe must not be ignored silently)."""
    value = _flag(name)
    if value in _TRUE:
        return True
    if value and value not in _FALSE and (name, value) not in _WARNED_VALUES:
        _WARNED_VALUES.add((name, value))
        import warnings

        warnings.warn(f"{name}={env(name)!r} is not recognised and is read as off: use 1 (also true, yes, on) to "
                      f"turn it on, or 0 (also false, no, off)", RuntimeWarning, stacklevel=3)
    return False


def fa_compile_flag() -> str:
    """FA_COMPILE, lower-cased; an unrecognised value is treated as unset, with one warning naming
    the valid ones (a typo such as FA_COMPILE=2 must not be silently ignored)."""
    value = _flag("FA_COMPILE")
    if value and value not in _TRUE and value not in _FALSE and ("FA_COMPILE", value) not in _WARNED_VALUES:
        _WARNED_VALUES.add(("FA_COMPILE", value))
        import warnings

        warnings.warn(f"FA_COMPILE={env('FA_COMPILE')!r} is not recognised and is ignored: use 1 (also true, yes, on) "
                      f"to rewrite attention under a plain torch.compile, 0 (also false, no, off) to turn fa-compile "
                      f"off everywhere, or leave it unset", RuntimeWarning, stacklevel=3)
    return value


def opt_in() -> bool:
    """FA_COMPILE=1: apply the rewrite to torch.compile's default (Inductor) backend too."""
    return fa_compile_flag() in _TRUE


def killed() -> bool:
    """FA_COMPILE=0: no rewrite anywhere, backend="fa3" included (a kill switch)."""
    return fa_compile_flag() in _FALSE


def log_enabled() -> bool:
    return flag_on("FA_COMPILE_LOG")


def fp8_requested() -> bool:
    """FA_COMPILE_FP8=1: FP8 attention for every eligible inference site (opt-in; changes results)."""
    return flag_on("FA_COMPILE_FP8")
