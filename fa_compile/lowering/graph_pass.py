"""The lowering as an Inductor post-grad pass (a CustomGraphPass, so the FX graph cache keys on it)."""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import operator
import os
import warnings
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch
import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from .. import dispatch
from . import choice, empty_rows, empty_rows_backward, key_limit, share, site_args, splice

_RECORDS: list = []
_CAPTURE: list = []  # lists that `capture_graphs()` fills with the lowered graphs' code
_WARNED: set = set()


@dataclass
class Record:
    node: str
    decision: choice.Decision


def records() -> list:
    """Every lowering decision of this process, oldest first (Record(node, decision))."""
    return list(_RECORDS)


@contextlib.contextmanager
def capture_graphs() -> Iterator[list]:
    """Collect the code of every graph the pass lowers (after lowering) while active."""
    got: list = []
    _CAPTURE.append(got)
    try:
        yield got
    finally:
        _CAPTURE.remove(got)


def _load_lowerings() -> None:
    from . import cpu_flash, decode, decomposed, fa3, sdpa, triton  # noqa: F401  (each registers itself)


def _warn_once(node: fx.Node, decision: choice.Decision, err: Exception) -> None:
    key = (decision.direction, decision.kernel, type(err).__name__)
    if key in _WARNED:
        return
    _WARNED.add(key)
    warnings.warn(f"fa_compile: lowering the {decision.direction} of {node.name} to {decision.target} failed "
                  f"({type(err).__name__}: {str(err)[:200]}); it keeps torch.ops.fa3 and its run-time dispatch",
                  RuntimeWarning, stacklevel=2)


def _restrides_saved_out(node: fx.Node, where: fx.Node) -> bool:
    """Whether folding the fix-up `where` into a training forward would give the out it saves for the backward other
    strides than the backward graph was traced with, at symbolic sizes. The folded kernel writes out in the
    `where`'s strides; AOTAutograd then restrides the backward's saved input with the compiled forward's strides as
    numbers, and a dimension marked dynamic is specialized in the backward's compile (a ConstraintViolationError
    under mark_dynamic, a recompile per length under dynamic=True). At static sizes those numbers are the strides."""
    natural, val = node.meta["val"][0], where.meta.get("val")
    if not isinstance(val, torch.Tensor) or all(isinstance(d, int) for d in natural.shape):
        return False
    return not splice.strides_match(val, natural)


def _lse_read(node: fx.Node) -> bool:
    """Whether any node reads the op's lse (output 1): a training graph returns it for the backward."""
    return any(u.target is operator.getitem and u.args[1] == 1 and u.users for u in node.users)


def _lower_node(graph: fx.Graph, node: fx.Node, limits: dict) -> Optional[choice.Decision]:
    args = site_args.attention_args(node)
    if args is None:
        return None
    backward = node.target is site_args.BACKWARD
    direction = "backward" if backward else "forward"
    b = site_args.bound(node)
    # emit's fix-up of rows with no admissible key, when it is all that reads the op's outputs: a kernel that
    # writes those rows itself takes it (and the choice may prefer such a kernel: choice._filling_kernel)
    drop = dict(seed=b["dropout_seed"], dropout_p=b["dropout_p"])  # a fix-up of dropped uniform rows (dropped_rows)
    fixup = None if backward else empty_rows.find_fixup(node, b["v"], **drop)
    decision = choice.decide(args, site_args.forced(node), direction,
                             empty_fix=fixup[0] if fixup and fixup[0] != "dropped" else None)
    if not decision.lowered:
        return decision
    lowering = choice.LOWERINGS[(args.q.device.type, decision.kernel)]
    if getattr(lowering, "cuts_padded_keys", False) and key_limit.cuts_keys(args, lowering.key_tile(args, direction)):
        kv_lens = key_limit.for_site(graph, node, b["bias"], args, limits)  # shared by the graph's sites
        if kv_lens is not None:
            args = dataclasses.replace(args, kv_lens=kv_lens.meta["val"])
            b = dict(b, kv_lens=kv_lens)
            decision.keys = choice.KEYS_CUT_TEXT
    if backward:
        choice.note_backward(decision, lowering, args)
    names = ["dout", "q", "k", "v", "out", "lse"] if backward else ["q", "k", "v"]
    names += [n for n in ("bias", "kv_lens") if b[n] is not None]
    if getattr(lowering, "takes_dropout_seed", False) and b["dropout_seed"] is not None:
        names.append("dropout_seed")  # last, after bias and kv_lens
    if getattr(lowering, "takes_sinks", False) and b["sinks"] is not None:
        names.append("sinks")  # after the seed
    if getattr(lowering, "takes_structure", False):
        names += [n for n in ("sinks", "q_pos", "q_seg", "k_seg") if b[n] is not None and n not in names]
    if not getattr(lowering, "fills_empty_rows", False):
        fixup = None
    elif fixup is None and not backward and getattr(lowering, "fills_saved_empty_rows", False):
        # a training graph also returns the op's out and lse for the backward, which reads no empty row's out
        fixup = empty_rows.find_fixup(node, b["v"], saved=True, **drop)
        if fixup is not None and _restrides_saved_out(node, fixup[1]):
            fixup = None
    if fixup is not None and fixup[0] == "dropped" and not getattr(lowering, "fills_dropped_rows", False):
        fixup = None
    want = None
    drops: list = []  # copies the kernel's own strides make no-ops (splice.droppable_clones)
    if fixup is not None:  # out: what the `where` gave, in its strides or in the kernel's own
        natural = node.meta["val"][0]
        drops = splice.droppable_clones(fixup[1], natural) or []
        want = [natural if drops else fixup[1].meta["val"], node.meta["val"][1]]
    bfix = plan = None
    if backward and getattr(lowering, "folds_empty_row_grads", False):
        # the fix-up's backward around the node: dout is its incoming gradient, its adds are the node's outputs
        bfix = empty_rows_backward.find_backward_fixup(node, b, choice.group_count(args))
        if bfix is not None and bfix.kind == "dropped" and not getattr(lowering, "folds_dropped_rows", False):
            bfix = empty_rows_backward.BackwardFixup("none", bfix.dout)  # the `where` on dO alone
        plan = None if bfix is None else empty_rows_backward.output_plan(bfix, list(node.meta["val"]))
        if plan is None:
            bfix = None
    inputs = [b[n] for n in names]
    if bfix is not None:
        inputs[0] = bfix.dout
        want, strides, bdrops = plan
        drops += bdrops
    try:
        if bfix is not None:
            more = {"qk_grad": bfix.qk_grad} if bfix.kind == "dropped" else {}
            fn = lowering.backward_fn(args, empty_grad=bfix.kind, out_strides=strides, **more)
        elif backward:
            fn = lowering.backward_fn(args)
        elif fixup is None and getattr(lowering, "skips_unread_lse", False) and not _lse_read(node):
            fn = lowering.forward_fn(args, lse_read=False)
        elif fixup is None:
            fn = lowering.forward_fn(args)
        else:
            fn = lowering.forward_fn(args, empty_fill=fixup[0], out_strides=tuple(want[0].stride()))
        new = splice.replace_node(graph, node, fn, inputs, want)
    except Exception as e:
        _warn_once(node, decision, e)
        return choice.Decision(direction, decision.kernel, reason=f"lowering failed: {type(e).__name__}: {str(e)[:120]}")
    if bfix is not None:  # each add of the fix-up's term now reads the kernel's gradient, which includes it
        for i, add in bfix.adds.items():
            add.replace_all_uses_with(new[i])
        decision.folded = empty_rows_backward.folded_text(bfix.kind)
    if fixup is not None:  # the `where` now reads the kernel's out, which already holds its value
        kind, where = fixup
        where.replace_all_uses_with(new[0])
        decision.folded = choice.folded_text(kind)
    splice.drop_clones(drops)
    return decision


_UNIFORM_ROW_GRAD = torch.ops.fa3.uniform_row_grad.default
_ZERO_VALUED = (_UNIFORM_ROW_GRAD, torch.ops.fa3.filled_scores_grad.default,  # value 0, the gradient is the point
                torch.ops.fa3.nan_row_grad.default)


def _zeros_for(graph: fx.Graph, node: fx.Node) -> None:
    """fa3::uniform_row_grad after AOTAutograd: its backward is already graph arithmetic, and its value is
    zeros, which Inductor makes without the op's run-time call (~100 us of host time per layer)."""
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor) or not all(isinstance(d, int) for d in val.shape):
        return  # symbolic sizes: the op stays (it is exact either way)
    with graph.inserting_before(node):
        # aten.full, not aten.zeros: Inductor has both a fallback and a decomposition for zeros and
        # refuses to lower it after its decompositions have run.
        z = graph.call_function(torch.ops.aten.full.default, (list(val.shape), 0),
                                dict(dtype=val.dtype, device=val.device, pin_memory=False))
    z.meta.update(node.meta)
    node.replace_all_uses_with(z)
    graph.erase_node(node)


_UNIFORM_ROW_GRAD_BACKWARD = torch.ops.fa3.uniform_row_grad_backward.default


def _uniform_terms(graph: fx.Graph, node: fx.Node) -> None:
    """fa3::uniform_row_grad_backward without a softcap off the CPU, left over where no lowered backward took
    it (empty_rows_backward.py): its sync-free terms as graph arithmetic, which Inductor fuses (the op would
    be a run-time call per layer), computing only the outputs that are read."""
    from ..row_fixups import _terms_dtype, _uniform_grads
    from . import conventions

    dg, q, k, v, scale = node.args[:5]
    softcap = node.args[5] if len(node.args) > 5 else node.kwargs.get("softcap", 0.0)
    qv = q.meta.get("val") if isinstance(q, fx.Node) else None
    if softcap != 0 or not isinstance(qv, torch.Tensor) or qv.device.type == "cpu":
        return
    read = {u.args[1] for u in node.users if u.op == "call_function" and u.target is operator.getitem and u.users}

    def terms(dg, q, k, v):
        dq, dk = _uniform_grads(dg, q, k, v, scale, _terms_dtype(q), 0 in read, 1 in read)
        return (torch.zeros_like(q) if dq is None else conventions.dense_like(dq, q),
                torch.zeros_like(k) if dk is None else conventions.dense_like(dk, k))

    splice.replace_node(graph, node, terms, [dg, q, k, v])


def lower_graph(graph: fx.Graph) -> list[choice.Decision]:
    """Lower every fa3.attention / fa3.attention_backward node of `graph` in place."""
    _load_lowerings()
    out = []
    limits: dict = {}  # key-padding mask -> its key limit, built for the sites whose kernel cuts keys there
    try:  # one kv_lens / key limit per step, not one per layer; each replacement leaves a valid graph
        share.share(graph)
        share.materialize_lengths(graph)
    except Exception as e:  # never a failed compile: the copies are equal, computing each is only slower
        warnings.warn(f"fa_compile: sharing equal values failed ({type(e).__name__}: {str(e)[:200]}); "
                      "each site keeps its own", RuntimeWarning, stacklevel=2)
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target in _ZERO_VALUED:
            _zeros_for(graph, node)
            continue
        if key_limit.is_key_limit(node):
            key_limit.lower(graph, node)
            continue
        if node.op != "call_function" or node.target not in (site_args.FORWARD, site_args.BACKWARD):
            continue
        name = node.name
        decision = _lower_node(graph, node, limits)
        if decision is not None:
            out.append(decision)
            _RECORDS.append(Record(name, decision))
            torch._dynamo.utils.counters["fa_compile"]["lowered" if decision.lowered else "kept_op"] += 1
    key_limit.lower_inserted(graph, limits)
    if any(d.lowered for d in out):
        graph.eliminate_dead_code()
    for node in [n for n in graph.nodes if n.op == "call_function" and n.target is _UNIFORM_ROW_GRAD_BACKWARD]:
        try:
            _uniform_terms(graph, node)
        except Exception as e:  # the op stays: exact, a run-time call
            warnings.warn(f"fa_compile: writing {node.name} as graph arithmetic failed ({type(e).__name__}: "
                          f"{str(e)[:200]}); it stays an op", RuntimeWarning, stacklevel=2)
    if any(d.lowered for d in out):
        graph.eliminate_dead_code()
        graph.lint()
    if _CAPTURE:
        code = graph.python_code("self").src
        for got in _CAPTURE:
            got.append(code)
    return out


_FILES = None


def _source_hash() -> str:
    global _FILES
    if _FILES is None:
        here = os.path.dirname(os.path.abspath(__file__))
        parent = os.path.dirname(here)
        _FILES = tuple(sorted(os.path.join(here, f) for f in os.listdir(here) if f.endswith(".py"))) + tuple(
            os.path.join(parent, f) for f in ("dispatch.py", "ops.py", "row_fixups.py", "cpu_flash_op.py", "key_limit_op.py",
                                             "tuning.py", "config.py"))
        cands = os.path.join(parent, "candidates")
        _FILES += tuple(sorted(os.path.join(cands, f) for f in os.listdir(cands) if f.endswith(".py")))
        from .. import kernels  # the kernels' op wrappers, traced into the lowered graphs

        kdir = os.path.dirname(os.path.abspath(kernels.__file__))
        # and what dispatch's choice reads there (the Triton family's and the reference's refusals)
        _FILES += tuple(os.path.join(kdir, f) for f in ("decode.py", "decode_ops.py", "decode_triton.py", "triton_ops.py",
                                                         "triton_family.py", "triton_fwd.py", "triton_bwd.py",
                                                         "triton_empty_rows_bwd.py", "triton_common.py",
                                                         "reference.py"))
    return get_hash_for_files(_FILES).hex()


def _settings_key() -> tuple:
    """What the choice reads besides the graph: settings, forced kernel, tuning, devices."""
    devs = ()
    if torch.cuda.is_available():
        devs = tuple(torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count()))
    from . import triton

    return (dispatch._settings()[:-1], devs, torch.__version__, triton.settings_key(),
            os.environ.get("FA_COMPILE_DECODE_MATH", "1"), os.environ.get("FA_COMPILE_DECODE_KERNEL", "1"),
            os.environ.get("FA_COMPILE_REFERENCE_MATH", "1"))


def chained_uuid(chained: Any) -> tuple[bool, Any]:
    """(keyed, uuid) of a user's pass chained after one of ours: (True, None) without one; (False, None)
    when it has no uuid, so ours returns None too and Inductor does not cache, as it does for that pass."""
    if chained is None:
        return True, None
    uuid = getattr(chained, "uuid", None)
    value = uuid() if callable(uuid) else None
    return value is not None, value


class LoweringPass(CustomGraphPass):
    """Lower fa3 nodes, then run `chained` (a pass the user had installed), if any."""

    def __init__(self, chained: Any = None, tune: Optional[bool] = None):
        self.chained = chained
        self.tune = tune  # fa_compile.backend(tune=True): tuning on for this backend's graphs only
        self.lowered = 0  # fa3 nodes this pass object replaced (all graphs it ran on)

    def __call__(self, graph: fx.Graph) -> None:
        from .. import config, ops, tuning

        if not config.killed() and ops._CP_HOOK is None:  # under context_parallel the op runs the ring
            with tuning.scoped(self.tune):
                self.lowered += sum(d.lowered for d in lower_graph(graph))
        if self.chained is not None:
            self.chained(graph)

    def uuid(self) -> Optional[Any]:
        keyed, chained = chained_uuid(self.chained)
        if not keyed:
            return None
        from .. import config, ops, tuning
        from ..kernels import gluon_ops  # noqa: F401  (fa3_gluon::bwd, which Inductor's cached code may call)

        with tuning.scoped(self.tune):
            key = repr((_source_hash(), _settings_key(), config.killed(), chained, ops._CP_HOOK is None))
        return hashlib.sha256(key.encode()).hexdigest()
