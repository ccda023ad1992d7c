"""Run-time choice of the kernel behind `torch.ops.fa3.attention`.

Each candidate declares what it supports through `not_supported_reasons(args)`; dispatch walks a
priority list and takes the first with no reasons. When nothing fits, the error lists every
candidate's reasons. The reference path accepts every valid input, so that error means the inputs
themselves are invalid (the op's argument checks name the argument first).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable, Optional, Protocol

import torch
from torch import Tensor

from .kernels import reference as _ref


@dataclass
class AttentionArgs:
    """Everything a kernel needs to decide and to run; tensors are the op's inputs as given."""

    q: Tensor
    k: Tensor
    v: Tensor
    scale: float
    causal: bool = False
    diag_offset: int = 0
    window_left: int = -1
    window_right: int = -1
    bias: Optional[Tensor] = None
    kv_lens: Optional[Tensor] = None
    softcap: float = 0.0
    dropout_p: float = 0.0
    dropout_seed: Optional[Tensor] = None
    needs_backward: bool = False
    bias_requires_grad: bool = False

    def mask_kwargs(self) -> dict:
        """The semantic arguments shared by the reference forward and backward."""
        return dict(
            scale=self.scale, causal=self.causal, diag_offset=self.diag_offset, window_left=self.window_left,
            window_right=self.window_right, bias=self.bias, kv_lens=self.kv_lens, softcap=self.softcap,
            dropout_p=self.dropout_p, dropout_seed=self.dropout_seed,
        )


class Candidate(Protocol):
    name: str

    def not_supported_reasons(self, args: AttentionArgs) -> list[str]: ...

    def forward(self, args: AttentionArgs) -> tuple[Tensor, Tensor]: ...

    def backward(self, args: AttentionArgs, dout: Tensor, out: Tensor, lse: Tensor) -> tuple[Tensor, Tensor, Tensor, Optional[Tensor]]: ...


@dataclass
class ReferenceCandidate:
    """Plain torch math, fp32 accumulation: any device, every feature; the fallback and the oracle."""

    name: str = "reference"

    def not_supported_reasons(self, args: AttentionArgs) -> list[str]:
        return []

    def forward(self, args: AttentionArgs) -> tuple[Tensor, Tensor]:
        return _ref.attention_reference(args.q, args.k, args.v, **args.mask_kwargs())

    def backward(self, args, dout, out, lse):
        return _ref.attention_backward_reference(
            dout, args.q, args.k, args.v, bias_requires_grad=args.bias_requires_grad, **args.mask_kwargs()
        )


@dataclass
class Registry:
    """Candidates in priority order (first = preferred); the reference is always last."""

    forward: list = field(default_factory=list)
    backward: list = field(default_factory=list)


_REGISTRY = Registry(forward=[ReferenceCandidate()], backward=[ReferenceCandidate()])


def register(candidate, *, forward: bool = True, backward: bool = True, before: str = "reference") -> None:
    """Insert `candidate` ahead of the one named `before` (default: just ahead of the reference)."""
    for lst, want in ((_REGISTRY.forward, forward), (_REGISTRY.backward, backward)):
        if not want:
            continue
        lst[:] = [c for c in lst if c.name != candidate.name]
        idx = next((i for i, c in enumerate(lst) if c.name == before), len(lst))
        lst.insert(idx, candidate)


def candidates(direction: str = "forward") -> list:
    return list(_REGISTRY.forward if direction == "forward" else _REGISTRY.backward)


def forced_kernel(forced: Optional[str]) -> Optional[str]:
    return forced or os.environ.get("FA_COMPILE_KERNEL") or None


class NoKernelError(RuntimeError):
    pass


def _select(cands: list, args: AttentionArgs, forced: Optional[str], direction: str):
    forced = forced_kernel(forced)
    if forced is not None:
        names = [c.name for c in cands]
        match = [c for c in cands if c.name == forced]
        if not match:
            raise ValueError(f"kernel: unknown {direction} kernel {forced!r}; known: {', '.join(names)}")
        reasons = match[0].not_supported_reasons(args)
        if reasons:
            raise NoKernelError(f"kernel: the forced {direction} kernel {forced!r} cannot take these inputs: " + "; ".join(reasons))
        return match[0]
    refusals = []
    for c in cands:
        reasons = c.not_supported_reasons(args)
        if not reasons:
            return c
        refusals.append(f"{c.name}: " + "; ".join(reasons))
    raise NoKernelError(f"no {direction} kernel takes these inputs:\n  " + "\n  ".join(refusals))


def select_forward(args: AttentionArgs, forced: Optional[str] = None):
    return _select(_REGISTRY.forward, args, forced, "forward")


def select_backward(args: AttentionArgs, forced: Optional[str] = None):
    return _select(_REGISTRY.backward, args, forced, "backward")


def explain_choice(args: AttentionArgs, forced: Optional[str] = None, direction: str = "forward") -> tuple[str, list[tuple[str, list[str]]]]:
    """(chosen name, [(name, reasons)] for the candidates ahead of it that refused)."""
    cands = _REGISTRY.forward if direction == "forward" else _REGISTRY.backward
    try:
        chosen = _select(cands, args, forced, direction).name
    except (NoKernelError, ValueError) as e:
        chosen = f"none ({e})"
    refused = []
    for c in cands:
        if c.name == chosen:
            break
        refused.append((c.name, c.not_supported_reasons(args)))
    return chosen, refused
