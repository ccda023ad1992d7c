"""Which kernel an fa3 node runs, and whether that kernel can be lowered into the graph.

The kernel is dispatch's own choice (`dispatch.explain_choice`: the same candidates, order, shape
promotions, forced kernel, user settings and cached tuning winner the run-time path reads), made on
the node's FakeTensors. Lowering it is a second question answered by the kernel's lowering
(`LOWERINGS`), whose reasons say what its graph form cannot express exactly.
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from typing import Optional, Protocol

import torch

from .. import dispatch, tuning


class Lowering(Protocol):
    # True when the lowered call runs the very kernel dispatch chose (so a forced kernel is honoured);
    # False for a different exact kernel (the reference math lowered to a fused one).
    same_kernel: bool

    def target(self, direction: str) -> str: ...

    def reasons(self, args: dispatch.AttentionArgs, direction: str) -> list[str]: ...


@dataclass
class Decision:
    """direction: "forward" / "backward"; kernel: dispatch's choice; target: the op the node became,
    or None when the node keeps `torch.ops.fa3.*` (run-time dispatch), with `reason`."""

    direction: str
    kernel: str
    target: Optional[str] = None
    reason: str = ""
    refused: list = field(default_factory=list)
    folded: str = ""  # an output fix-up the lowered kernel computes itself (lowering/empty_rows.py)
    keys: str = ""  # KEYS_CUT_TEXT where the kernel reads keys only up to a key-padding mask's limit (key_limit.py)
    backward_note: str = ""  # how a lowered backward computes its gradients, where its lowering says (backward_note)
    instead_of: str = ""  # why the kernel's own lowering refused the site, where a fallback lowering took it

    @property
    def lowered(self) -> bool:
        return self.target is not None

    def __str__(self) -> str:
        if self.lowered:
            notes = "; ".join(n for n in (self.folded, self.keys, self.backward_note, self.instead_of) if n)
            return f"{self.kernel} -> {self.target}" + (f" ({notes})" if notes else "")
        return f"{self.kernel} (fa3 op, run-time dispatch: {self.reason})"


LOWERINGS: dict[tuple[str, str], Lowering] = {}
# {(device type, kernel): the name in LOWERINGS of a lowering that takes the kernel's sites its own refuses}
FALLBACKS: dict[tuple[str, str], str] = {}
KEYS_CUT_TEXT = "keys read up to each sequence's last unmasked one"


def register(device_type: str, kernel: str, lowering: Lowering, fallback_for: Optional[str] = None) -> None:
    """`fallback_for`: `lowering` also takes the sites of that kernel its own lowering refuses (registered under
    `kernel`, a name of its own, as graph_pass looks the decision's kernel up)."""
    LOWERINGS[(device_type, kernel)] = lowering
    if fallback_for is not None:
        FALLBACKS[(device_type, fallback_for)] = kernel


def group_count(args: dispatch.AttentionArgs) -> Optional[int]:
    """Hq / Hkv as an int, without a guard: from the heads' ints, or from a ratio the shape environment knows as a
    constant (one symbol for both: 1); None where it is known only as a symbol."""
    hkv = args.k.shape[1]
    if isinstance(hkv, int) and hkv == 0:
        return 1  # no key/value heads (nor query heads): nothing to group; the kernels refuse the zero size
    g = args.q.shape[1] // hkv
    if isinstance(g, int):
        return g
    v = g.node.maybe_as_int() if isinstance(g, torch.SymInt) else None
    return None if v is None else int(v)


def _symbolic(x) -> bool:
    return isinstance(x, torch.SymInt) and x.node.maybe_as_int() is None


def bottom_right(args: dispatch.AttentionArgs) -> bool:
    """Whether the site's diagonal offset is provably Nk - Nq (a symbolic offset a traced lowering can compute from
    its own inputs' sizes; any other symbolic offset would be a SymInt the trace does not hold)."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return bool(statically_known_true(args.diag_offset == args.k.shape[2] - args.q.shape[2]))


def upper_bound(n) -> Optional[int]:
    """A static size, or a symbolic one's upper bound where it has a finite one (None otherwise)."""
    if not _symbolic(n):
        return int(n)
    try:
        from torch.fx.experimental.symbolic_shapes import has_free_symbols

        if has_free_symbols(n):
            upper = n.node.shape_env.bound_sympy(n.node.expr).upper
            return int(upper) if upper.is_finite else None
    except Exception:
        return None
    return None


def decode_step_gate(what: str, switch: str, devices: tuple, args: dispatch.AttentionArgs, direction: str) -> list[str]:
    """The refusals both decode-step lowerings share (the kernel's, lowering/decode.py, and the math's,
    lowering/decomposed.py): their environment switch, their devices, inference only."""
    if os.environ.get(switch, "1") == "0":
        return [f"{what} is off ({switch}=0)"]
    if args.q.device.type not in devices:
        return [f"{what} is lowered on {' and '.join(d.upper() for d in devices)} only"]
    if direction != "forward" or args.needs_backward:
        return [f"{what} is for inference (no gradient)"]
    if args.saved_for_backward:
        # The backward recomputes the scores in its own kernel's arithmetic and exponentiates them against this
        # lse: a lse from other arithmetic is off by the scores' rounding, which grows with their size (fp32 on
        # CPU, scores near 1e4: dV 1e-3 off, where aten's own pair is exact to 2e-7).
        return [f"{what} is for inference: a training graph's forward keeps the kernel whose backward reads "
                "its lse"]
    return []


def dynamic_dims(args: dispatch.AttentionArgs) -> list[str]:
    names = []
    for tname, t in (("q", args.q), ("k", args.k), ("v", args.v)):
        names += [f"{tname}.shape[{i}]" for i, s in enumerate(t.shape) if _symbolic(s)]
    if _symbolic(args.diag_offset):
        names.append("diag_offset")
    return names


def data_dependent_sizes(args: dispatch.AttentionArgs) -> list[str]:
    """The inputs' sizes and strides that hold an unbacked symbol (a length read with `.item()`)."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    names = []
    for tname in ("q", "k", "v", "bias", "kv_lens"):
        t = getattr(args, tname)
        if isinstance(t, torch.Tensor) and (free_unbacked_symbols(t.shape) or free_unbacked_symbols(t.stride())):
            names.append(tname)
    return names


def _real_like(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    if t is None:
        return None
    real = torch.empty_strided(tuple(int(s) for s in t.shape), tuple(int(s) for s in t.stride()), dtype=t.dtype,
                               device=t.device)
    if t.dtype.is_floating_point:
        real.normal_()
    elif t.dtype == torch.bool:
        real.fill_(True)
    else:
        real.fill_(int(t.shape[0]) if t.dim() else 0)
    return real


def _tuned_kernel(args: dispatch.AttentionArgs, forced: Optional[str], direction: str) -> Optional[str]:
    """With tuning on, static shapes and a CUDA device: time the eligible candidates on real
    tensors of the node's shapes and strides once (dispatch caches the winner per bucket)."""
    if not tuning.enabled() or args.q.device.type != "cuda" or not torch.cuda.is_available() or dynamic_dims(args):
        return None
    if dispatch.forced_kernel(forced) is not None:
        return None
    import dataclasses

    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        real = dataclasses.replace(args, **{n: _real_like(getattr(args, n)) for n in ("q", "k", "v", "bias", "kv_lens",
                                                                                        "dropout_seed", "sinks",
                                                                                        "q_pos", "q_seg", "k_seg")})
        real = dispatch._for_direction(real, direction)
        return dispatch._select(dispatch.ordered(real, direction), real, forced, direction).name


# An inference site whose output carries emit's empty-row fix-up (a key-padding mask that may leave a
# sequence with no key) on a kernel that cannot write that value itself (cuDNN): the fix-up reads V and
# passes over the output once more per layer, and cuDNN's additive mask needs a NaN-key guard, where our
# Triton forward excludes masked keys and writes those rows itself (lowering/empty_rows.py). Measured on
# the H200, bf16, whole 8-layer BERT forwards, half the batch half padded (benchmarks/encoder_kernels.py,
# 2026-12-03), ms with Triton / cuDNN: B32 x 512 d64 9.685 / 10.148 (again 10.042 / 10.435); B64 x 128 d64
# 3.301 / 3.594; B32 x 512 d128 9.793 / 10.256. Up to FILL_PREFERRED_SCORES and FILL_PREFERRED_HEAD_DIM,
# the measured range; beyond, dispatch's choice stands.
FILL_PREFERRED = "triton"
FILL_PREFERRED_SCORES = 512 * 512
FILL_PREFERRED_HEAD_DIM = 128
FILL_PREFERRED_ARCH = 9  # compute capability major: Hopper, where it was measured


def _filling_kernel(args: dispatch.AttentionArgs, name: str, forced: Optional[str], direction: str,
                    empty_fix: Optional[str]) -> Optional[str]:
    """FILL_PREFERRED instead of dispatch's `name` for such a site, or None where the rule does not apply:
    a kernel forced, a tuning winner, an enclosing sdpa_kernel() that narrows the SDPA backends (the user
    steers the choice), a kernel that fills the rows itself already, a GPU other than the measured one (Hopper),
    dynamic sizes, run-time positions or segment ids, sizes beyond the measured range, or FILL_PREFERRED
    refused by dispatch's reasons or by its lowering's. Called after the decode-step kernels have declined the site."""
    if empty_fix is None or direction != "forward" or args.needs_backward or args.q.device.type != "cuda":
        return None
    if dispatch.forced_kernel(forced) is not None or tuning.enabled() or name == FILL_PREFERRED:
        return None
    if getattr(LOWERINGS.get(("cuda", name)), "fills_empty_rows", False):
        return None
    b = torch.backends.cuda
    if not (b.cudnn_sdp_enabled() and b.flash_sdp_enabled() and b.mem_efficient_sdp_enabled()):
        return None
    from ..candidates.common import device_capability

    cap = device_capability(args.q.device)
    if cap is None or cap[0] != FILL_PREFERRED_ARCH:  # measured on Hopper only
        return None
    if dynamic_dims(args) or any(getattr(args, n, None) is not None for n in ("q_pos", "q_seg", "k_seg")):
        return None  # (measured without run-time positions or segment ids)
    nq, nk = int(args.q.shape[2]), int(args.k.shape[2])
    if nq * nk > FILL_PREFERRED_SCORES or max(int(args.q.shape[3]), int(args.v.shape[3])) > FILL_PREFERRED_HEAD_DIM:
        return None
    if dispatch.explain_choice(args, FILL_PREFERRED, direction)[0] != FILL_PREFERRED:
        return None
    lowering = LOWERINGS.get(("cuda", FILL_PREFERRED))
    if lowering is None or lowering.reasons(args, direction):
        return None
    return FILL_PREFERRED


def decide(args: dispatch.AttentionArgs, forced: Optional[str], direction: str, measure: bool = True,
           empty_fix: Optional[str] = None) -> Decision:
    """The kernel for these (fake) arguments and the lowering that takes it, or why the op stays.
    With tuning on, `measure` times the candidates on real tensors of these shapes (explain() never does).
    `empty_fix` ("nan" / "mean_v"): the site's output carries emit's empty-row fix-up, which a kernel that
    writes those rows itself takes (see `_filling_kernel`)."""
    unbacked = data_dependent_sizes(args)
    if unbacked:
        # Inductor cannot lay out a lowered kernel's outputs (or the conventions' copies) whose sizes it cannot
        # bound at compile time: a backward lowered there fails the compile with GuardOnDataDependentSymNode.
        return Decision(direction, "none", reason=f"data-dependent sizes ({', '.join(unbacked)}): the op keeps its "
                        "run-time dispatch")
    if group_count(args) is None:
        # The lowerings take the group Hq / Hkv as an int: from two unrelated symbols it would need a guard, which
        # fails the compile where the dims were marked dynamic (mark_dynamic, export's Dim).
        return Decision(direction, "none", reason="the query and key/value head counts are unrelated symbols: the "
                        "op keeps its run-time dispatch (a lowering would specialize them)")
    try:
        tuned = _tuned_kernel(args, forced, direction) if measure else None
    except Exception:  # a measurement that fails leaves the static order
        tuned = None
    name, refused = dispatch.explain_choice(args, forced, direction)
    if tuned is not None and not name.startswith("none"):
        name = tuned
    if name.startswith("none"):
        return Decision(direction, "none", reason=name, refused=refused)
    if dispatch.forced_kernel(forced) is None:
        from .decode import DECODE_LOWERING
        from .decomposed import DECODE_MATH

        if not DECODE_LOWERING.step_reasons(args, direction):  # a decode step: one fused launch (two with splits)
            refused = [r for r in refused if r[0] != "decode"]  # (its run-time order rule does not apply here)
            return Decision(direction, "decode", target=DECODE_LOWERING.target(direction), refused=refused)
        if not DECODE_MATH.reasons(args, direction):  # what the kernel refuses: its math, fused by Inductor
            return Decision(direction, "decode_math", target=DECODE_MATH.target(direction), refused=refused)
    try:  # after the decode step's own kernels, which write those rows themselves
        filling = _filling_kernel(args, name, forced, direction, empty_fix)
    except Exception:  # the rule is an optimisation: dispatch's choice stands
        filling = None
    if filling is not None:
        why = (f"{FILL_PREFERRED} writes the rows that admit no key itself (no fix-up after the kernel), "
               "measured faster for short inference sites")
        refused = [(name, [why])] + [r for r in refused if r[0] != filling]
        return Decision(direction, filling, target=LOWERINGS[("cuda", filling)].target(direction), refused=refused)
    if args.sinks is not None and not getattr(LOWERINGS.get((args.q.device.type, name)), "takes_sinks", False):
        # Only the lowered Triton ops take the sinks (the CPU flash op and the SDPA ops have none): the op
        # and its run-time dispatch keep the site.
        return Decision(direction, name, reason=f"attention sinks: the lowering of kernel {name!r} does not take "
                        "them; the op keeps its run-time dispatch", refused=refused)
    if (args.q_pos is not None or args.q_seg is not None) and not getattr(
            LOWERINGS.get((args.q.device.type, name)), "takes_structure", False):
        # Only the decode kernel's lowering, the lowered Triton ops and the reference math take run-time positions
        # (the SDPA ops and the CPU flash op have none): the op and its run-time dispatch keep the site, unless the
        # kernel's fallback lowering takes it.
        why = [f"q_pos / segment ids: the lowering of kernel {name!r} does not take them"]
        fb = _fallback(args, name, forced, direction, why, refused)
        if fb is not None:
            return fb
        return Decision(direction, name, reason=why[0] + "; the op keeps its run-time dispatch", refused=refused)
    dyn = dynamic_dims(args)
    if dyn and args.q.device.type != "cpu":
        # On CUDA the order reads sizes (FA3 from 2048 tokens, FA2 for decode, head-dim limits): a
        # choice made on one size would be wrong for another, so the run-time dispatch keeps it.
        return Decision(direction, name, reason=f"the choice reads sizes that are dynamic here ({', '.join(dyn)})",
                        refused=refused)
    lowering = LOWERINGS.get((args.q.device.type, name))
    if lowering is None:
        return Decision(direction, name, reason=f"no compile-time lowering of kernel {name!r} on "
                        f"{args.q.device.type}", refused=refused)
    if not lowering.same_kernel and dispatch.forced_kernel(forced) == name:
        return Decision(direction, name, reason=f"kernel {name!r} is forced: it runs as it is", refused=refused)
    why = lowering.reasons(args, direction)
    if why:
        fb = _fallback(args, name, forced, direction, why, refused)
        if fb is not None:
            return fb
        return Decision(direction, name, reason="; ".join(why), refused=refused)
    site_target = getattr(lowering, "target_for", None)  # a lowering whose op depends on the site
    target = site_target(args, direction) if site_target is not None else lowering.target(direction)
    return Decision(direction, name, target=target, refused=refused)


def _fallback(args: dispatch.AttentionArgs, name: str, forced: Optional[str], direction: str, why: list[str],
              refused: list) -> Optional[Decision]:
    """The decision of the lowering registered as kernel `name`'s fallback (FALLBACKS) where it takes a site that
    `name`'s own lowering refuses for `why`; None where there is none, it refuses too, or `name` is forced."""
    fallback = FALLBACKS.get((args.q.device.type, name))
    low = LOWERINGS.get((args.q.device.type, fallback)) if fallback is not None else None
    if low is None or dispatch.forced_kernel(forced) == name or low.reasons(args, direction):
        return None
    if (args.q_pos is not None or args.q_seg is not None) and not getattr(low, "takes_structure", False):
        return None
    if args.sinks is not None and not getattr(low, "takes_sinks", False):
        return None
    return Decision(direction, fallback, target=low.target(direction), refused=refused,
                    instead_of="instead of the kernel's lowering: " + "; ".join(why))


def describe(args: dispatch.AttentionArgs, forced: Optional[str] = None, empty_fix: Optional[str] = None,
             grad_fix: Optional[str] = None) -> str:
    """What the lowering makes of a site, forward (and backward when `args.needs_backward`), e.g.
    "forward reference -> aten._scaled_dot_product_flash_attention_for_cpu"; for explain(). `empty_fix` as
    for `decide`; `grad_fix` the fix-up's backward a training graph holds (`emitted_grad_fix`)."""
    from . import cpu_flash, decode, decomposed, empty_rows_backward, fa3, sdpa, triton  # noqa: F401

    parts = []
    fix = None if args.needs_backward else empty_fix  # a training graph saves the lse: the choice ignores the fix-up
    with contextlib.suppress(Exception):
        d = decide(dispatch._for_direction(args, "forward"), forced, "forward", False,
                   empty_fix=None if fix == "dropped" else fix)
        low = LOWERINGS.get((args.q.device.type, d.kernel))
        if d.lowered and empty_fix is not None and getattr(low, "fills_empty_rows", False) and (
                fix is not None or (empty_fix in ("mean_v", "dropped") and getattr(low, "fills_saved_empty_rows",
                                                                                   False))) \
                and (empty_fix != "dropped" or getattr(low, "fills_dropped_rows", False)):
            d.folded = folded_text(empty_fix)
        _note_keys(d, low, dispatch._for_direction(args, "forward"))
        parts.append("forward " + str(d))
    if args.needs_backward:
        with contextlib.suppress(Exception):
            d = decide(args, forced, "backward", False)
            low = LOWERINGS.get((args.q.device.type, d.kernel))
            if d.lowered and grad_fix is not None and getattr(low, "folds_empty_row_grads", False):
                folds = grad_fix != "dropped" or getattr(low, "folds_dropped_rows", False)
                d.folded = empty_rows_backward.folded_text(grad_fix if folds else "none")
            _note_keys(d, LOWERINGS.get((args.q.device.type, d.kernel)), args)
            note_backward(d, LOWERINGS.get((args.q.device.type, d.kernel)), args)
            parts.append("backward " + str(d))
    return "; ".join(parts)


def _note_keys(d: Decision, low: Optional[Lowering], args: dispatch.AttentionArgs) -> None:
    """d.keys where the lowering would give the site its key-padding mask's limit (graph_pass, key_limit.py)."""
    from . import key_limit

    if d.lowered and getattr(low, "cuts_padded_keys", False) and key_limit.cuts_keys(args, low.key_tile(args, d.direction)):
        d.keys = KEYS_CUT_TEXT


def note_backward(d: Decision, low: Optional[Lowering], args: dispatch.AttentionArgs) -> None:
    """d.backward_note from the lowering (e.g. the Triton family's dQ summed inside its dK/dV kernel)."""
    if d.lowered and d.direction == "backward" and hasattr(low, "backward_note"):
        d.backward_note = low.backward_note(args)


def explain_lines(rows: list) -> str:
    """For explain(): one line per group of sites with the same lowering, e.g.
    "lowered at sites 0, 1: forward reference -> aten._scaled_dot_product_flash_attention_for_cpu; ..."."""
    from ..report import _args_of_call

    groups: dict = {}
    for i, row in enumerate(rows):
        site = row.site
        if not site.rewritten or site.call is None:
            continue
        args = _args_of_call(site.call)
        if args is None:
            continue
        forced = site.call.args[13] if len(site.call.args) > 13 else None
        groups.setdefault(describe(args, forced, emitted_fix(site.call), emitted_grad_fix(site.call)), []).append(i)
    out = []
    for text, sites in groups.items():
        if text:
            out.append(f"lowered at site{'s' if len(sites) > 1 else ''} {', '.join(map(str, sites))}: {text}")
    return "\n".join(out)


def folded_text(kind: str) -> str:
    """Decision.folded for a kernel that writes emit's empty-row fix-up ("nan" / "mean_v" / "dropped") itself."""
    what = {"nan": "NaN", "mean_v": "mean of V", "dropped": "dropped uniform weights times V"}[kind]
    return f"empty rows: {what} written by the kernel"


def _emitted_fill(call) -> Optional[list]:
    """The fill of emit's empty-row fix-up after the op call `call` (the pre-AOTAutograd form:
    `where(isneginf(lse)[..., None], fill, out)`), as the chain from the `where`'s argument through
    `.to(dtype)` and `+` a zero-valued gradient term to the fill itself; None without a fix-up."""
    import operator

    if getattr(call, "target", None) is not torch.ops.fa3.attention.default:  # (FP8 and paged calls: no such rule)
        return None
    lse = [u for u in call.users if u.target is operator.getitem and u.args[1] == 1]
    for test in (u for n in lse for u in n.users if u.target is torch.isneginf):
        for where in (w for cond in test.users for w in cond.users if w.target is torch.where):
            chain = [where.args[1]]
            while getattr(chain[-1], "target", None) in ("to", torch.add):
                chain.append(chain[-1].args[0])
            return chain
    return None


def emitted_fix(call) -> Optional[str]:
    """"nan" / "mean_v" / "dropped" when emit put its empty-row fix-up after the op call `call` (a NaN full_like, a
    mean of V, fa3.dropped_uniform_rows); else None. explain() reads it before AOTAutograd, the lowering (empty_rows.find_fixup) after."""
    chain = _emitted_fill(call)
    if chain is None:
        return None
    if _dropped(chain):
        return "dropped"
    return "nan" if getattr(chain[-1], "target", None) is torch.full_like else "mean_v"


def _dropped(chain: list) -> bool:
    return getattr(chain[-1], "target", None) is torch.ops.fa3.dropped_uniform_rows.default


def emitted_grad_fix(call) -> Optional[str]:
    """The backward of emit's empty-row fix-up after `call`, as empty_rows_backward names it: "none" (NaN fill:
    the `where` on dO only), "dropped" (fa3.dropped_uniform_rows), "uniform" (mean of V plus fa3::uniform_row_grad: q / k need their gradient),
    "mean_v" (the mean alone); None without a fix-up."""
    chain = _emitted_fill(call)
    if chain is None:
        return None
    if getattr(chain[-1], "target", None) is torch.full_like:
        return "none"
    if _dropped(chain):
        return "dropped"
    uniform = torch.ops.fa3.uniform_row_grad.default
    adds = (n for n in chain if getattr(n, "target", None) is torch.add)
    return "uniform" if any(getattr(a, "target", None) is uniform for n in adds for a in n.args) else "mean_v"
