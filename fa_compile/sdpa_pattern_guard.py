"""Inductor's own attention fusion, kept to softmaxes over the last dim while this backend compiles.

Inductor's joint-graph patterns (torch/_inductor/fx_passes/fuse_attention.py) replace matmul-softmax-matmul
chains by SDPA, but match the softmax whatever its dim: `(q @ k.mT).softmax(dim=-2) @ v` becomes attention
over the keys, a wrong result, under plain `torch.compile` as well. The pass refuses such a site (softmax over
another axis than the keys), and a refused site must run as written; so while this backend's Inductor compiles a
graph, every pattern's parameter check (`_sfdp_params_check`, which all of them call) also requires each softmax
and softmax reduction of the match to be over its input's last dim, and a divisor of the scores to be nonzero
(the replacement computes its reciprocal: a division by zero failed the compile). Other compiles in the process
are untouched, except under FA_COMPILE=1, which opts every compile into the pass and so into this check too
(`install`).
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

_aten = torch.ops.aten
_SOFTMAX = (_aten._softmax.default, _aten.softmax.int, _aten._safe_softmax.default)
_REDUCTIONS = (_aten.amax.default, _aten.sum.dim_IntList, _aten.logsumexp.default)
_DIVISORS = ("inv_scale", "inv_scale_factor")  # the patterns' names for a number the scores are divided by


def _last_dim_only(node: Any) -> bool:
    """Whether a softmax or row reduction `node` of a match reduces its input's last dim (and only that)."""
    x = node.args[0] if node.args else None
    val = getattr(x, "meta", {}).get("val")
    if not isinstance(val, torch.Tensor):
        return False
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    dims = [dims] if isinstance(dims, int) else list(dims or [])
    rank = max(val.dim(), 1)
    return len(dims) == 1 and isinstance(dims[0], int) and dims[0] % rank == rank - 1


def softmax_on_last_dim(match: Any) -> bool:
    """Whether every softmax (and softmax reduction) among `match.nodes` is over the last dim, and no divisor of
    the scores is 0 (the replacements compute 1 / inv_scale: a ZeroDivisionError that failed the compile)."""
    for node in getattr(match, "nodes", ()):
        if node.op == "call_function" and (node.target in _SOFTMAX or node.target in _REDUCTIONS):
            if not _last_dim_only(node):
                return False
    kwargs = getattr(match, "kwargs", {})
    return not any(isinstance(kwargs.get(n), (int, float)) and kwargs[n] == 0 for n in _DIVISORS)


def _wrap() -> Optional[tuple[Any, Any]]:
    """Wrap fuse_attention's check with softmax_on_last_dim: (module, original check), or None when it is wrapped
    already or this torch has no such check."""
    try:
        from torch._inductor.fx_passes import fuse_attention
    except ImportError:  # pragma: no cover (every supported torch has it)
        return None
    original = getattr(fuse_attention, "_sfdp_params_check", None)
    if original is None or getattr(original, "fa_compile_wrapped", False):
        return None

    def checked(match: Any) -> bool:
        return softmax_on_last_dim(match) and original(match)

    checked.fa_compile_wrapped = True  # type: ignore[attr-defined]
    fuse_attention._sfdp_params_check = checked
    return fuse_attention, original


@contextlib.contextmanager
def softmax_dim_checked() -> Iterator[None]:
    """While active, Inductor's attention patterns match only softmaxes over the last dim (see the module's
    docstring)."""
    wrapped = _wrap()
    try:
        yield
    finally:
        if wrapped is not None:
            wrapped[0]._sfdp_params_check = wrapped[1]


def install() -> None:
    """The check for every compile in the process (FA_COMPILE=1, where the pass runs inside torch's own backend)."""
    _wrap()


class CheckedPatternsKey(CustomGraphPass):
    """Inductor's joint-graph pre-pass slot, holding the user's pass (run as it was) and a key: Inductor's caches key
    on it, so graphs compiled under `softmax_dim_checked` never share a cache entry with plain Inductor's, whose
    patterns matched without the check."""

    def __init__(self, chained: Any = None):
        self.chained = chained

    def __call__(self, graph: torch.fx.Graph) -> None:
        if self.chained is not None:
            self.chained(graph)

    def uuid(self) -> Optional[Any]:
        from .lowering.graph_pass import chained_uuid

        keyed, chained = chained_uuid(self.chained)
        return repr((get_hash_for_files((__file__,)).hex(), chained)) if keyed else None


def keyed(current: Any) -> Any:
    """The joint-graph pre-pass to compile with: `current` (the user's, or None) inside the key; a list of passes
    (which newer torch takes there) with the key appended."""
    if isinstance(current, (list, tuple)):
        return current if any(isinstance(p, CheckedPatternsKey) for p in current) else [*current, CheckedPatternsKey()]
    return current if isinstance(current, CheckedPatternsKey) else CheckedPatternsKey(current)
