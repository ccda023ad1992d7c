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


def _warn_unrecognised(name: str, value: str, advice: str) -> None:
    """One warning per switch and value for a value that reads as neither on nor off (FA_COMPILE_TUNE=maybe or
    FA_COMPILE=2 must not be ignored silently)."""
    if value and value not in _TRUE and value not in _FALSE and (name, value) not in _WARNED_VALUES:
        _WARNED_VALUES.add((name, value))
        import warnings

        warnings.warn(f"{name}={env(name)!r} is not recognised and {advice}", RuntimeWarning, stacklevel=4)


def flag_on(name: str) -> bool:
    """An on/off switch: 1 / true / yes / on. Any other value but 0 / false / no / off (or unset) reads as off, with
    one warning naming the switch."""
    value = _flag(name)
    _warn_unrecognised(name, value, "is read as off: use 1 (also true, yes, on) to turn it on, or 0 (also false, "
                                    "no, off)")
    return value in _TRUE


def fa_compile_flag() -> str:
    """FA_COMPILE, lower-cased; an unrecognised value is treated as unset, with one warning naming the valid ones."""
    value = _flag("FA_COMPILE")
    _warn_unrecognised("FA_COMPILE", value, "is ignored: use 1 (also true, yes, on) to rewrite attention under a "
                                            "plain torch.compile, 0 (also false, no, off) to turn fa-compile off "
                                            "everywhere, or leave it unset")
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
