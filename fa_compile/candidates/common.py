"""What every peer candidate asks of the inputs and of the user's settings.

Everything here reads only dtype / device / shape / strides / requires_grad, never data, so the
reasons also work on FakeTensors (explain() asks them at compile time). Shapes may be SymInts
there; `static_int` reads a concrete value or None, and callers refuse when a fact cannot be known.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from ..kernels.reference import absorbing_bias_refusal

NEG_INF = float("-inf")


def static_int(x) -> Optional[int]:
    """A Python int for an int or a SymInt with a known value; None when only a symbol is known."""
    if isinstance(x, int):
        return x
    if isinstance(x, torch.SymInt):
        node = x.node
        maybe = getattr(node, "maybe_as_int", None)
        val = maybe() if maybe is not None else None
        if val is not None:
            return int(val)
        try:  # a hint exists (a real run or a fake tensor of a dynamic graph): specialising is fine here
            return int(node.hint) if getattr(node, "hint", None) is not None else None
        except Exception:
            return None
    try:
        return int(x)
    except Exception:
        return None


def device_capability(device: torch.device) -> Optional[tuple[int, int]]:
    """(major, minor) of a CUDA device, or None when no CUDA runtime can say (CPU-only builds)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability(device)


def shapes(args) -> tuple:
    """(B, Hq, Hkv, Nq, Nk, D, Dv) as ints or None where symbolic."""
    q, k, v = args.q, args.k, args.v
    return tuple(static_int(s) for s in (q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2], q.shape[3], v.shape[3]))


def known_true(cond) -> bool:
    """A condition on sizes that holds for every size the graph may run at: a bool, or a SymBool decided from the
    symbols alone. Never from a dynamic size's hint (the sizes of the call that compiled it): a mask bound that
    admits every key at that length may cut keys at the next (a window dropped, silently, in a graph compiled with
    dynamic=True and reused at other lengths, or read back from Inductor's cache). Adds no guard."""
    if isinstance(cond, bool):
        return cond
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    try:
        return bool(statically_known_true(cond))
    except Exception:  # noqa: BLE001 - not decidable: not known
        return False


def causal_vacuous(args) -> bool:
    """True when the causal bound admits every key of every row, at every size: j - i <= Nk - 1 <= diag_offset."""
    return known_true(args.diag_offset >= args.k.shape[2] - 1)


def window_vacuous(args) -> tuple[bool, bool]:
    """(left, right) window bounds that admit every key anyway, at every size (or are unbounded)."""
    nq, nk, off = args.q.shape[2], args.k.shape[2], args.diag_offset
    left = args.window_left < 0 or known_true(args.window_left >= nq - 1 + off)
    right = args.window_right < 0 or known_true(args.window_right >= nk - 1 - off)
    return left, right


def effective_causal(args) -> bool:
    return bool(args.causal) and not causal_vacuous(args)


def has_window(args) -> bool:
    left, right = window_vacuous(args)
    return not (left and right)


def may_have_empty_rows(args) -> bool:
    """Rows with no admissible key are possible (bias, kv_lens, or a diagonal left of column 0)."""
    if args.bias is not None or args.kv_lens is not None:
        return True
    if getattr(args, "q_pos", None) is not None or getattr(args, "q_seg", None) is not None:
        return True
    if effective_causal(args) and not known_true(args.diag_offset >= 0):
        return True
    if has_window(args):
        return True
    return False


def cuda_reasons(args, what: str, min_cap: tuple[int, int], max_cap: Optional[tuple[int, int]] = None) -> list[str]:
    """Device and capability checks shared by the CUDA peers."""
    if args.q.device.type != "cuda":
        return [f"{what} runs on CUDA only, inputs are on {args.q.device.type}"]
    cap = device_capability(args.q.device)
    if cap is None:
        return [f"{what}: no CUDA runtime to read the device capability"]
    if cap < min_cap or (max_cap is not None and cap > max_cap):
        rng = f"sm{min_cap[0]}{min_cap[1]}" + (f"..sm{max_cap[0]}{max_cap[1]}" if max_cap else "+")
        return [f"{what} needs {rng}, device is sm{cap[0]}{cap[1]}"]
    return []


def dtype_reasons(args, what: str, allowed: tuple, tf32_fp32: bool = False) -> list[str]:
    """Input dtype; fp32 only where the kernel's TF32 arithmetic is what the user allows."""
    dt = args.q.dtype
    if dt == torch.float32 and tf32_fp32:
        if torch.get_float32_matmul_precision() == "highest":
            return [f"{what} computes fp32 inputs with TF32 tensor cores, but torch.get_float32_matmul_precision() is 'highest'"]
        return []
    if dt not in allowed:
        names = ", ".join(str(d).replace("torch.", "") for d in allowed)
        return [f"{what} takes {names}, not {str(dt).replace('torch.', '')}"]
    return []


def head_dim_reasons(args, what: str, *, multiple: int, max_dim: int, same_dv: bool, allowed: Optional[tuple] = None) -> list[str]:
    d, dv = static_int(args.q.shape[3]), static_int(args.v.shape[3])
    if d is None or dv is None:
        return [f"{what}: head dim is symbolic"]
    out = []
    if same_dv and d != dv:
        out.append(f"{what} needs the V head dim ({dv}) equal to the QK head dim ({d})")
    for name, x in (("head dim", d), ("V head dim", dv)):
        if x % multiple or x > max_dim or x == 0:
            out.append(f"{what} takes a {name} that is a multiple of {multiple} up to {max_dim}, got {x}")
        elif allowed is not None and x not in allowed:
            out.append(f"{what} (this build) takes a {name} in {allowed}, got {x}")
    return out


def common_feature_reasons(args, what: str, *, softcap: bool = False, dropout: bool = False,
                           sinks: bool = False) -> list[str]:
    out = []
    if getattr(args, "sinks", None) is not None and not sinks:
        out.append(f"{what} has no attention sinks (a per-head logit in the softmax denominator)")
    out += position_segment_reasons(args, what)
    if args.softcap > 0 and not softcap:
        out.append(f"{what} has no softcap")
    if args.dropout_p > 0 and not dropout:
        out.append(f"{what} cannot draw the op's dropout mask (the counter hash of fa_compile/kernels/dropout_hash.py)")
    nk = static_int(args.k.shape[2])
    if nk == 0:
        out.append(f"{what}: no keys (Nk = 0)")
    return out


def position_segment_reasons(args, what: str) -> list[str]:
    """No peer takes the op's run-time structure: q_pos (a per-query key limit read at run time) would
    need a dense bias built per call, and segment ids of any order have no varlen form (cu_seqlens
    needs sorted, contiguous segments, which nothing proves of ids given at run time). Our Triton family
    and the reference take both."""
    out = []
    if getattr(args, "q_pos", None) is not None:
        out.append(f"{what} takes no run-time query positions (q_pos); a dense bias per call would read every key")
    if getattr(args, "q_seg", None) is not None:
        out.append(f"{what} takes no segment ids (q_seg / k_seg): its varlen form needs sorted, contiguous "
                   "sequences, which ids given at run time are not proven to be")
    return out


def deterministic_reasons(args, what: str, deterministic_backward: bool) -> list[str]:
    if args.needs_backward and not deterministic_backward and torch.are_deterministic_algorithms_enabled():
        return [f"{what} backward is not deterministic (accumulates with atomics) and torch.use_deterministic_algorithms(True) is set"]
    return []


def last_dim_contiguous(x: Tensor) -> Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def finish_forward(out: Tensor, lse: Tensor, maybe_empty: bool, sinks: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """The op's lse convention: fp32 natural log, -inf (and out = 0) on a row with no admissible key;
    with sinks, such a row's lse is its head's sink (the row attends to the sink alone).

    Kernels mark an empty row differently (+inf in FA2 / mem-efficient, -inf, or 0 with out 0), so a
    row whose lse is not finite is normalised here; only done when empty rows are possible at all.
    """
    lse = lse.to(torch.float32)
    if maybe_empty:
        empty = torch.isinf(lse)
        if sinks is None:
            lse = lse.masked_fill(empty, NEG_INF)
        else:
            lse = torch.where(empty, sinks.to(torch.float32).view(1, -1, 1).expand_as(lse), lse)
        out = out.masked_fill(empty.unsqueeze(-1), 0)
    return out, lse


def lse_for_backward(lse: Tensor) -> Tensor:
    """Flash-style backward kernels compute P = exp(S - lse): an empty row needs lse = +inf for P = 0."""
    return lse.to(torch.float32).masked_fill(torch.isneginf(lse), math.inf)


def reduce_to_bias_shape(grad: Tensor, bias: Tensor) -> Tensor:
    """Sum a [B, H, Nq, Nk] gradient back over the dimensions `bias` broadcast along."""
    lead = grad.dim() - bias.dim()
    if lead:
        grad = grad.sum(dim=tuple(range(lead)))
    dims = tuple(i for i, n in enumerate(bias.shape) if n == 1 and grad.shape[i] != 1)
    return (grad.sum(dim=dims, keepdim=True) if dims else grad).to(bias.dtype)
