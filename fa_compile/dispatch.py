"""Run-time choice of the kernel behind `torch.ops.fa3.attention`.

Each candidate declares what it supports through `not_supported_reasons(args)`; dispatch walks a
priority list and takes the first with no reasons. Forward and backward are chosen separately:
every kernel's lse means the same thing ([B, Hq, Nq] fp32, natural log, -inf on an empty row; with sinks
the lse includes the sink, which is then an empty row's lse), so a
forward-only kernel (the PyPI FA3 build) is followed by the best backward that takes the inputs.

The order is `candidates.FORWARD_ORDER` / `BACKWARD_ORDER` (each position rests on a measurement
written there), shape rules (`candidates.PROMOTIONS`), and, with FA_COMPILE_TUNE=1 or
`tuning.enable()`, the winner measured for the shape bucket on this GPU (`tuning.py`).

The user's settings are reasons like any other: `torch.use_deterministic_algorithms(True)` refuses
non-deterministic backward kernels, `torch.get_float32_matmul_precision() == "highest"` refuses
TF32 kernels for fp32 inputs, an enclosing `sdpa_kernel([...])` refuses the SDPA backends it
disables (and `sdpa_kernel([SDPBackend.MATH])` alone, a request for plain math, leaves only the
reference), and a forced kernel (`fa_compile.backend(kernel=...)`, baked into each call's
force_kernel, or FA_COMPILE_KERNEL) is used or named in a clear error.

When nothing fits, the error lists every candidate's reasons. The reference path accepts every
valid input, so that error means the inputs themselves are invalid.
"""
from __future__ import annotations

import collections
import dataclasses
import warnings
from dataclasses import dataclass, field
from typing import Optional, Protocol

import torch
from torch import Tensor

from . import candidates as _cands
from . import config
from . import tuning
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
    sinks: Optional[Tensor] = None  # [Hq] per-head logits in the softmax denominator (ops.py)
    q_pos: Optional[Tensor] = None  # int [Nq] / [B, Nq]: query i admits keys j <= q_pos[b, i] (ops.py)
    q_seg: Optional[Tensor] = None  # int [Nq] / [B, Nq] with k_seg [Nk] / [B, Nk]: keys of the same id only
    k_seg: Optional[Tensor] = None
    # A forward whose out and lse a backward reads (a training graph's forward): kernels are chosen as for any
    # forward; lowerings that pay off only at inference read it (lowering/decomposed.py's small scores).
    saved_for_backward: bool = False

    def mask_kwargs(self) -> dict:
        """The semantic arguments shared by the reference forward and backward."""
        return dict(
            scale=self.scale, causal=self.causal, diag_offset=self.diag_offset, window_left=self.window_left,
            window_right=self.window_right, bias=self.bias, kv_lens=self.kv_lens, softcap=self.softcap,
            dropout_p=self.dropout_p, dropout_seed=self.dropout_seed, sinks=self.sinks, q_pos=self.q_pos,
            q_seg=self.q_seg, k_seg=self.k_seg,
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
    never_reads_past_kv_lens: bool = True  # the reference zeroes K and V there itself

    def not_supported_reasons(self, args: AttentionArgs) -> list[str]:
        return []

    def forward(self, args: AttentionArgs) -> tuple[Tensor, Tensor]:
        return _ref.attention_reference(args.q, args.k, args.v, **args.mask_kwargs())

    def backward(self, args, dout, out, lse):
        return _ref.attention_backward_reference(
            dout, args.q, args.k, args.v, bias_requires_grad=args.bias_requires_grad, out=out, **args.mask_kwargs()
        )


@dataclass
class Registry:
    """Candidates in priority order (first = preferred); the reference is always last."""

    forward: list = field(default_factory=list)
    backward: list = field(default_factory=list)


_REFERENCE = ReferenceCandidate()
_REGISTRY = Registry(forward=[_REFERENCE], backward=[_REFERENCE])
_VERSION = [0]  # bumped by register / unregister (part of the memo key of `_choose`)


def register(candidate, *, forward: bool = True, backward: bool = True, before: str = "reference") -> None:
    """Insert `candidate` ahead of the one named `before` (default: just ahead of the reference)."""
    _VERSION[0] += 1
    for lst, want in ((_REGISTRY.forward, forward), (_REGISTRY.backward, backward)):
        if not want:
            continue
        lst[:] = [c for c in lst if c.name != candidate.name]
        idx = next((i for i, c in enumerate(lst) if c.name == before), len(lst))
        lst.insert(idx, candidate)


def unregister(name: str) -> None:
    _VERSION[0] += 1
    for lst in (_REGISTRY.forward, _REGISTRY.backward):
        lst[:] = [c for c in lst if c.name != name or c.name == "reference"]


def candidates(direction: str = "forward") -> list:
    return list(_REGISTRY.forward if direction == "forward" else _REGISTRY.backward)


def _install_defaults() -> None:
    """Register the peers and our Triton family in the measured base order (candidates/__init__.py)."""
    triton = _cands.triton_candidate()
    by_name = {c.name: c for c in _cands.peer_candidates()}
    if triton is not None:
        by_name[getattr(triton, "name", "triton")] = triton
    dec = _cands.decode_candidate()
    if dec is not None:
        by_name[dec.name] = dec
    for direction, order in (("forward", _cands.FORWARD_ORDER), ("backward", _cands.BACKWARD_ORDER)):
        for name in order:
            cand = by_name.get(name)
            if cand is None or (direction == "backward" and not _cands.has_backward(cand)):
                continue
            register(cand, forward=direction == "forward", backward=direction == "backward")


def ordered(args: AttentionArgs, direction: str = "forward") -> list:
    """The registry's order for these inputs: shape rules applied (candidates.PROMOTIONS)."""
    lst = candidates(direction)
    for rule in _cands.PROMOTIONS:
        if rule.direction != direction:
            continue
        names = [c.name for c in lst]
        if rule.name not in names or rule.ahead_of not in names:
            continue
        i, j = names.index(rule.name), names.index(rule.ahead_of)
        if i < j:
            continue
        try:
            hit = rule.when(args)
        except Exception:
            hit = False
        if hit:
            lst.insert(j, lst.pop(i))
    return lst


def forced_kernel(forced: Optional[str]) -> Optional[str]:
    return forced or config.env("FA_COMPILE_KERNEL") or None


class NoKernelError(RuntimeError):
    pass


def _math_only() -> bool:
    """sdpa_kernel([SDPBackend.MATH]) (every fused SDPA backend off, math on): the user asks for plain math."""
    b = torch.backends.cuda
    return b.math_sdp_enabled() and not (b.flash_sdp_enabled() or b.cudnn_sdp_enabled() or b.mem_efficient_sdp_enabled())


def _reasons(cand, args: AttentionArgs, forced: bool) -> list[str]:
    reasons = list(cand.not_supported_reasons(args))
    if cand.name != "reference" and _math_only():
        reasons.insert(0, "an enclosing sdpa_kernel() enables only SDPBackend.MATH, i.e. plain math (the reference path)")
    opt = getattr(cand, "opt_in_reason", None)
    if not forced and opt is not None:
        why = opt()
        if why:
            reasons.insert(0, why)
    return reasons


def _is_fake(t: Tensor) -> bool:
    # Hot path (every op call): a plain tensor or parameter is real; only subclasses need the full test.
    if type(t) is torch.Tensor or type(t) is torch.nn.Parameter:
        return t.device.type == "meta"
    from torch._subclasses.fake_tensor import is_fake

    return t.device.type == "meta" or is_fake(t)


_KNOWN: dict = {}  # registry version -> the names (checked on every call that names a kernel)


def known_kernels() -> list[str]:
    """Every kernel name a caller may force (either direction)."""
    key = (_VERSION[0], id(_REGISTRY))
    names = _KNOWN.get(key)
    if names is None:
        _KNOWN.clear()
        names = _KNOWN[key] = sorted({c.name for c in candidates("forward") + candidates("backward")})
    return names


def check_kernel_name(forced: str, source: str, what: str = "kernel") -> None:
    """A ValueError naming `source` (the argument the caller used) unless `forced` names a kernel."""
    if not isinstance(forced, str):
        raise TypeError(f"{source}: expected a kernel name (str) or None, got {type(forced).__name__}")
    known = known_kernels()
    if forced in known:
        return
    if forced == "triton" and _cands.TRITON_IMPORT_ERROR:
        raise ValueError(f"{source}: kernel 'triton' is not available here (fa_compile/kernels/triton_family.py: "
                         f"{_cands.TRITON_IMPORT_ERROR[0]}); known: {', '.join(known)}")
    via = " (fa_compile.backend(kernel=...) passes its kernel as every call's force_kernel)" if source == _FORCE_SOURCE else ""
    raise ValueError(f"{source}: unknown {what} {forced!r}; known: {', '.join(known)}{via}")


def _forced_candidate(cands: list, args: AttentionArgs, forced: str, source: str, direction: str):
    """The forced candidate, or None for a backward whose forced kernel is forward-only."""
    match = [c for c in cands if c.name == forced]
    if not match:
        check_kernel_name(forced, source, f"{direction} kernel")
        return None  # a kernel of the other direction only (forward-only): chosen from the saved lse as usual
    reasons = _reasons(match[0], args, forced=True)
    if reasons:
        raise NoKernelError(f"{source}: the forced {direction} kernel {forced!r} cannot take these inputs: " + "; ".join(reasons))
    return match[0]


# The op's argument; fa_compile.attention(kernel=) checks the name itself, fa_compile.backend(kernel=)
# bakes it into each call's force_kernel.
_FORCE_SOURCE = "force_kernel"


def renamed_force_error(err: Exception, name: str) -> Optional[Exception]:
    """`err`, an error the op raised about its force_kernel argument, as the same type naming `name` (the argument
    a Python wrapper took and passed as force_kernel); None for any other error."""
    prefix = f"{_FORCE_SOURCE}: "
    msg = str(err.args[0]) if len(err.args) == 1 and isinstance(err.args[0], str) else ""
    if not msg.startswith(prefix) or type(err) not in (NoKernelError, ValueError):
        return None
    return type(err)(f"{name}: {msg[len(prefix):]}")


def zero_size(args: AttentionArgs) -> Optional[str]:
    """The zero-size dimension of these inputs, or None. Such inputs never reach a fused kernel: the
    reference computes them exactly, as eager does (no keys: out 0, lse -inf; head dim 0: scores 0,
    so out is the mean of V over the admissible keys; anything else empty: an empty result), and
    its cost is that of the output."""
    q, k, v = args.q, args.k, args.v
    dims = (("batch", q.shape[0]), ("heads", q.shape[1]), ("queries", q.shape[2]), ("keys", k.shape[2]),
            ("head dim", q.shape[3]), ("V head dim", v.shape[3]))
    for name, n in dims:
        if isinstance(n, int):
            if n == 0:
                return f"{name} = 0"
        elif _cands.common.static_int(n) == 0:
            return f"{name} = 0"
    return None


def _select(cands: list, args: AttentionArgs, forced: Optional[str], direction: str, *, allow_tune: bool = True):
    source = _FORCE_SOURCE if forced else "FA_COMPILE_KERNEL"
    forced = forced_kernel(forced)
    if forced is not None:
        chosen = _forced_candidate(cands, args, forced, source, direction)
        if chosen is not None:
            return chosen
    refusals, eligible = [], []
    for c in cands:
        reasons = _reasons(c, args, forced=False)
        if not reasons:
            eligible.append(c)
            if not tuning.enabled():
                break
        else:
            refusals.append(f"{c.name}: " + "; ".join(reasons))
    if not eligible:
        raise NoKernelError(f"no {direction} kernel takes these inputs:\n  " + "\n  ".join(refusals))
    # The reference is never timed: it only wins where nothing else is eligible.
    timed = [c for c in eligible if c.name != "reference"]
    if len(timed) > 1 and tuning.enabled():
        real = allow_tune and not _is_fake(args.q) and args.q.device.type == "cuda"
        name = tuning.choose(args, direction, timed, measure=real, bwd_inputs=_backward_inputs)
        for c in timed:
            if c.name == name:
                return c
    return eligible[0]


def _backward_inputs(args: AttentionArgs):
    """(dout, out, lse) for timing backward candidates: the chosen forward on these inputs."""
    fargs = _for_direction(args, "forward")
    out, lse = _select(ordered(fargs, "forward"), fargs, None, "forward", allow_tune=False).forward(fargs)
    gen = torch.Generator(device=args.q.device).manual_seed(0)
    dout = torch.randn(out.shape, dtype=out.dtype, device=out.device, generator=gen)
    return dout, out, lse


@dataclass
class _Chosen:
    """The selected candidate; if it raises at run time (a limit its reasons missed), the next
    eligible candidate runs instead, with a warning, unless the kernel was forced."""

    cand: object
    rest: list
    forced: bool
    direction: str

    @property
    def name(self) -> str:
        return self.cand.name

    def not_supported_reasons(self, args):
        return self.cand.not_supported_reasons(args)

    def _run(self, method: str, args, *extra):
        try:
            return getattr(self.cand, method)(_within_kv_lens(self.cand, args), *extra)
        except Exception as e:
            if self.forced or _is_fake(args.q):
                raise
            for nxt in self.rest:
                if nxt is self.cand or _reasons(nxt, args, forced=False):
                    continue
                _warn_once(self.cand.name, self.direction, e, nxt.name)
                return getattr(nxt, method)(_within_kv_lens(nxt, args), *extra)
            raise

    def forward(self, args):
        return self._run("forward", args)

    def backward(self, args, dout, out, lse):
        return self._run("backward", args, dout, out, lse)


def _within_kv_lens(cand, args: AttentionArgs) -> AttentionArgs:
    """The op never reads keys or values past kv_lens[b]: a cache's unused slots may hold anything, NaN
    included. Our Triton, Gluon and decode kernels never load them, FA3 takes the lengths as seqused_k and the
    reference zeroes them itself (`never_reads_past_kv_lens`); the SDPA backends mask those keys' scores but still
    multiply their values by a probability of 0, so they get K and V with those rows zeroed (copies). The
    gradients there are 0 either way."""
    if args.kv_lens is None or getattr(cand, "never_reads_past_kv_lens", False):
        return args
    return dataclasses.replace(args, k=_ref.zero_past_kv_lens(args.k, args.kv_lens),
                               v=_ref.zero_past_kv_lens(args.v, args.kv_lens))


_WARNED: set = set()


def _warn_once(name: str, direction: str, err: Exception, nxt: str) -> None:
    key = (name, direction, type(err).__name__, str(err)[:80])
    if key in _WARNED:
        return
    _WARNED.add(key)
    warnings.warn(f"fa_compile: {direction} kernel {name!r} failed ({type(err).__name__}: {str(err)[:200]}); "
                  f"running {nxt!r} instead", RuntimeWarning, stacklevel=3)


def _for_direction(args: AttentionArgs, direction: str) -> AttentionArgs:
    """A forward kernel is judged as a forward: the backward that may follow is chosen on its own
    (forward-only kernels are simply absent from the backward list)."""
    if direction == "forward" and args.needs_backward:
        return dataclasses.replace(args, needs_backward=False, bias_requires_grad=False, saved_for_backward=True)
    return args


# How often each kernel was chosen, {(direction, name): calls}; benchmarks read and clear it.
STATS: collections.Counter = collections.Counter()


_MEMO: dict = {}
_MEMO_MAX = 4096


def _meta(t: Optional[Tensor]):
    if t is None:
        return None
    return (t.shape, t.stride(), t.dtype, t.device, t.requires_grad)


def _settings() -> tuple:
    """The user's settings that reasons and order read; cheap, since every op call builds it."""
    b = torch.backends.cuda
    return (
        config.env("FA_COMPILE_KERNEL"), config.env("FA_COMPILE_FA4"), config.env("FA_COMPILE_FA3_SINKS"), tuning.enabled(),
        torch.are_deterministic_algorithms_enabled(), torch.get_float32_matmul_precision(),
        b.flash_sdp_enabled(), b.cudnn_sdp_enabled(), b.mem_efficient_sdp_enabled(), b.math_sdp_enabled(),
        _VERSION[0], id(_REGISTRY),
    )


def _memo_key(args: AttentionArgs, forced: Optional[str], direction: str):
    """Everything the reasons, the order and `validate` read (metadata, scalar facts and settings,
    never data): a hit means equal inputs were validated and chosen for before."""
    return (
        direction, forced, _settings(),
        _meta(args.q), _meta(args.k), _meta(args.v), _meta(args.bias), _meta(args.kv_lens), _meta(args.dropout_seed),
        _meta(args.sinks), _meta(args.q_pos), _meta(args.q_seg), _meta(args.k_seg),
        bool(args.causal), int(args.diag_offset), args.window_left, args.window_right, args.softcap > 0,
        args.dropout_p > 0, args.needs_backward, args.bias_requires_grad,
    )


def _choose(args: AttentionArgs, forced: Optional[str], direction: str, validate=None) -> _Chosen:
    """The choice for these inputs, memoised on real tensors (decode calls it once per layer and
    token, so a hit costs one key and one lookup). `validate(args)` (the op's tensor checks, which
    read metadata only) runs on a miss only: a hit means equal metadata passed it before."""
    args = _for_direction(args, direction)
    key = None if _is_fake(args.q) else _memo_key(args, forced, direction)
    hit = _MEMO.get(key) if key is not None else None
    if hit is None:
        if validate is not None:
            validate(args)
        if zero_size(args) is not None:
            # The trivial exact path, whichever kernel was asked for (a misspelt name still errors).
            if forced_kernel(forced) is not None:
                check_kernel_name(forced_kernel(forced), _FORCE_SOURCE if forced else "FA_COMPILE_KERNEL")
            hit = _Chosen(_REFERENCE, [], True, direction)
        else:
            cands = ordered(args, direction)
            cand = _select(cands, args, forced, direction)
            is_forced = forced_kernel(forced) is not None and cand.name == forced_kernel(forced)
            rest = cands[cands.index(cand) + 1:] if cand in cands else []
            hit = _Chosen(cand, rest, is_forced, direction)
        if key is not None:
            if len(_MEMO) >= _MEMO_MAX:
                _MEMO.clear()
            _MEMO[key] = hit
    STATS[(direction, hit.cand.name)] += 1
    return hit


def select_forward(args: AttentionArgs, forced: Optional[str] = None, validate=None):
    return _choose(args, forced, "forward", validate)


def select_backward(args: AttentionArgs, forced: Optional[str] = None, validate=None):
    return _choose(args, forced, "backward", validate)


def explain_choice(args: AttentionArgs, forced: Optional[str] = None, direction: str = "forward") -> tuple[str, list[tuple[str, list[str]]]]:
    """(chosen name, [(name, reasons)] for the candidates ahead of it that refused).

    Never measures (explain() runs at compile time on fake tensors); a cached tuning winner counts.
    """
    args = _for_direction(args, direction)
    empty = zero_size(args)
    if empty is not None:
        return "reference", [("every kernel", [f"{empty}: the exact trivial path (the reference) runs instead"])]
    cands = ordered(args, direction)
    try:
        chosen = _select(cands, args, forced, direction, allow_tune=False).name
    except (NoKernelError, ValueError) as e:
        return f"none ({e})", [(c.name, _reasons(c, args, forced=False)) for c in cands if _reasons(c, args, forced=False)]
    refused = []
    for c in cands:
        if c.name == chosen:
            break
        reasons = _reasons(c, args, forced=False)
        if reasons:
            refused.append((c.name, reasons))
        elif tuning.enabled():
            refused.append((c.name, ["eligible, but slower for this shape bucket (tuning cache)"]))
    return chosen, refused


_install_defaults()
