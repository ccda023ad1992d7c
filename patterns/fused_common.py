"""Shared plumbing of the fused-call rewrites (SDPA, MultiheadAttention, encoder layer).

A rewrite inserts many glue nodes before it knows it can finish (a view that turns out to need a
copy, a value with no FakeTensor); `Builder` records what it inserted, which users it pointed at
the new result, and which nodes are to go, so a refusal -- or any exception inside the rewrite --
takes it all back and leaves the graph exactly as it was. Nodes are erased only once the rewrite
has finished.
"""
from __future__ import annotations

import contextlib
import contextvars
import math
import operator
from typing import Any, Callable, Iterator, Optional

import torch
import torch.fx as fx

from . import emit
from .emit import example_value
from .site import PassOptions, SiteReport


class Refuse(Exception):
    """A site cannot be rewritten; the message is the reason shown in explain()."""


class Builder:
    """Insert glue nodes with example values; undo them all on refusal."""

    def __init__(self, graph: fx.Graph):
        self.graph = graph
        self.nodes: list[fx.Node] = []
        self._before = set(graph.nodes)  # rollback also removes what emit.* inserted on our behalf
        self.pending_cache: dict = {}  # results worth sharing with later sites, kept only on success
        self.repointed: list[tuple[fx.Node, Any]] = []  # (user, its example value before) of replaced nodes
        self.doomed: list[fx.Node] = []  # erased when the rewrite succeeds

    def _add(self, node: fx.Node, what: str) -> fx.Node:
        self.nodes.append(node)  # tracked before the fake run, so rollback removes it on failure
        try:
            emit.set_example_value(node)
        except Exception as e:  # the fake run rejected it: this rewrite does not apply here
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise Refuse(f"{what} on the site's tensors failed: {first}") from e
        if "example_value" not in node.meta:
            raise Refuse(f"no FakeTensor for the inserted {what} (not a Dynamo graph?)")
        return node

    def f(self, target: Any, *args: Any, **kwargs: Any) -> fx.Node:
        """call_function node."""
        return self._add(self.graph.call_function(target, args, kwargs), getattr(target, "__name__", str(target)))

    def m(self, name: str, obj: Any, *args: Any, **kwargs: Any) -> fx.Node:
        """call_method node."""
        return self._add(self.graph.call_method(name, (obj, *args), kwargs), f".{name}()")

    def size(self, t: fx.Node, dim: int) -> Any:
        """t.size(dim): a Python int when static, else a node carrying the SymInt."""
        s = example_value(t).shape[dim]
        return s if isinstance(s, int) else self.m("size", t, dim)

    def replace(self, old: fx.Node, new: fx.Node) -> None:
        """Point old's users at new (see `replace_output`) and erase old once the rewrite succeeds. A result the
        caller gets back (or a `.view` downstream needs) contiguous where eager's was, and ours is not (the op
        stores out BSHD), is made contiguous first: the caller may `.view` it."""
        from .find_sites.build import needs_contiguous  # noqa: PLC0415  (find_sites imports this module)

        nv = example_value(new)
        if isinstance(nv, torch.Tensor) and needs_contiguous(old, nv):
            new = self.m("contiguous", new)
        for user in old.users:
            self.repointed.append((user, old, user.meta.get("example_value")))
        replace_output(self.graph, old, new)
        self.doomed.append(old)

    def erase(self, node: fx.Node) -> None:
        self.doomed.append(node)

    def commit(self) -> None:
        for n in self.doomed:
            if not n.users:
                self.graph.erase_node(n)
        self.doomed.clear()

    def rollback(self) -> None:
        # a repointed user had only original inputs: whatever new node it reads now stands for `old`
        for user, old, val in reversed(self.repointed):
            for a in list(user.all_input_nodes):
                if a not in self._before:
                    user.replace_input_with(a, old)
            if val is not None:
                user.meta["example_value"] = val
        for n in reversed(list(self.graph.nodes)):
            if n not in self._before:
                self.graph.erase_node(n)
        self.nodes.clear()
        self.repointed.clear()
        self.doomed.clear()


def tensor_value(node: Any, name: str) -> torch.Tensor:
    val = example_value(node)
    if not isinstance(val, torch.Tensor):
        raise Refuse(f"{name} has no FakeTensor example value (not a Dynamo graph?)")
    return val


def static_int(value: Any, what: str) -> int:
    if isinstance(value, torch.SymInt):
        raise Refuse(f"{what} is dynamic ({value}); the op needs it at compile time")
    return int(value)


# Inside Inductor (the FA_COMPILE=1 route) no backend can ask Dynamo to trace again with its floats specialized: there
# a symbolic float argument is specialized where it is read, with a guard on its value, which Dynamo installs with
# the compiled graph (a new value recompiles). `specializing_floats` turns that on.
_SPECIALIZE_FLOATS: contextvars.ContextVar = contextvars.ContextVar("fa_compile_specialize_floats", default=False)


@contextlib.contextmanager
def specializing_floats() -> Iterator[None]:
    token = _SPECIALIZE_FLOATS.set(True)
    try:
        yield
    finally:
        _SPECIALIZE_FLOATS.reset(token)


def const(value: Any, name: str) -> Any:
    """A Python constant argument; a graph value (computed at run time) is refused."""
    if isinstance(value, fx.Node):
        ev = example_value(value)
        if isinstance(ev, (bool, int, float)) and not isinstance(ev, torch.SymInt):
            return ev
        if isinstance(ev, torch.SymFloat) and _SPECIALIZE_FLOATS.get():
            from torch.fx.experimental.symbolic_shapes import guard_float

            with contextlib.suppress(Exception):  # (a value with no hint: refused below)
                return guard_float(ev)
        if isinstance(ev, torch.SymFloat):
            raise Refuse(f"{name} is a symbolic float ({value.name}: dynamic=True makes Python floats graph inputs); "
                         "the op needs a constant (torch._dynamo.config.specialize_float=True, or mark_dynamic "
                         "instead of dynamic=True)")
        raise Refuse(f"{name} is computed at run time ({value.name}); it must be a Python constant")
    return value


def same_size(a: Any, b: Any) -> bool:
    """a == b for ints or SymInts, without adding a guard (unknown counts as different)."""
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return bool(statically_known_true(a == b))


def shape_of(val: Any) -> Optional[tuple]:
    if not isinstance(val, torch.Tensor):
        return None
    return tuple(int(s) if isinstance(s, int) else str(s) for s in val.shape)


def where(node: fx.Node) -> str:
    """The node's module path (or name) and the user's source line, when Dynamo recorded it."""
    from .source_location import location

    return location(node)


def report(form: str, node: fx.Node, **fields: Any) -> SiteReport:
    return SiteReport(form=form, rewritten=fields.pop("rewritten", False), where=where(node), **fields)


def guarded_rewrite(form: str, graph: fx.Graph, node: fx.Node, body: Callable[[Builder, SiteReport], None]) -> SiteReport:
    """Run `body(builder, report)` before `node`, then erase what it replaced. A Refuse -- or any
    other exception: a refusal never fails the compile -- rolls back every edit and says why."""
    rep = report(form, node)
    why = emit.inside_vmap(node)
    if why is not None:
        rep.reason = why
        return rep
    b = Builder(graph)
    try:
        with graph.inserting_before(node):
            body(b, rep)
        b.commit()
    except Exception as e:
        b.rollback()
        if isinstance(e, Refuse):
            why = str(e)
        else:
            first = str(e).splitlines()[0] if str(e) else ""
            why = f"rewrite failed: {type(e).__name__}: {first}"
        rep.rewritten, rep.reason, rep.call = False, why, None
    return rep


def replace_output(graph: fx.Graph, old: fx.Node, new: fx.Node) -> None:
    """Point old's users at new; a user `.view(...)` that needs old's strides gets a contiguous copy.

    The op's output is stored BSHD (free for the usual transpose + reshape); a few models call
    `.view` directly on SDPA's (contiguous) result, which those strides may not allow.
    A result of another shape or dtype than eager's (an autocast region, say) is refused.
    """
    ov, nv = example_value(old), example_value(new)
    if isinstance(ov, torch.Tensor) and isinstance(nv, torch.Tensor):
        if ov.dtype != nv.dtype:
            raise Refuse(f"the rewrite computes a {nv.dtype} result where eager's is {ov.dtype} (autocast?)")
        if ov.dim() != nv.dim() or not all(same_size(a, b) for a, b in zip(ov.shape, nv.shape)):
            raise Refuse(f"the rewrite's result has shape {tuple(nv.shape)}, eager's {tuple(ov.shape)}")
    old.replace_all_uses_with(new)
    for user in list(new.users):
        if not ((user.op == "call_method" and user.target == "view") or user.target is torch.Tensor.view):
            continue
        try:
            emit.set_example_value(user)
        except Exception:
            with graph.inserting_before(user):
                cont = emit.call(graph, "contiguous", new, method=True)
            user.replace_input_with(new, cont)
            emit.set_example_value(user)


def default_scale(b: "Builder", t: fx.Node, head_dim: Any) -> Any:
    """1/sqrt(head dim): a float, or (head dim symbolic under dynamic=True) a SymFloat node that
    emit_attention folds into q."""
    if isinstance(head_dim, int):
        # Head dim 0: the scores are an empty sum, 0 at any scale (eager gives the mean of V).
        return 1.0 / math.sqrt(head_dim) if head_dim else 1.0
    d = b.size(t, -1)
    node = b.graph.call_function(operator.pow, (d, -0.5))
    b.nodes.append(node)
    node.meta["example_value"] = head_dim ** -0.5  # SymInt ** float: a SymFloat, no fake mode needed
    return node


def runtime_scale(node: fx.Node) -> Any:
    """A scale held by a graph value: a Python number (folded), or a SymFloat / 0-d tensor node."""
    ev = example_value(node)
    if isinstance(ev, (int, float)) and not isinstance(ev, bool):
        return float(ev)
    if isinstance(ev, (torch.SymFloat, torch.SymInt)):
        return node
    if isinstance(ev, torch.Tensor) and ev.dim() == 0 and ev.dtype.is_floating_point:
        return node
    raise Refuse(f"scale {node.name} is neither a number nor a 0-d float tensor")


def check_scalars(dropout_p: float, scale: Any = None) -> None:
    """Refuse scalar arguments the op rejects, where eager computes something (zeros for p = 1, NaN
    for a NaN scale): the call stays as written and eager's semantics with it."""
    if not (0.0 <= dropout_p < 1.0):
        raise Refuse(f"dropout_p={dropout_p} is outside [0, 1)")
    if isinstance(scale, float) and not math.isfinite(scale):
        raise Refuse(f"scale={scale} is not finite")


def options_allow_dropout(options: PassOptions, dropout_p: float) -> None:
    if dropout_p > 0 and not options.allow_training_dropout:
        raise Refuse(f"dropout_p={dropout_p} on the probabilities and the pass was told not to rewrite "
                     "training dropout")


def emit_attention(b: Builder, q: fx.Node, k: fx.Node, v: fx.Node, **kwargs: Any):
    """emit.emit_attention into the builder's graph (the one way to emit the op)."""
    return emit.emit_attention(b.graph, q, k, v, **kwargs)


_SPEC_FIELDS = ("causal", "diag_offset", "window_left", "window_right", "kv_lens", "bias", "empty_rows", "q_pos",
               "q_seg", "k_seg", "nan_grads")


def structured_mask(b: Builder, node: fx.Node, terms: list, q4v: torch.Tensor, k4v: torch.Tensor, *, sdpa: bool,
                    fallback: dict, fallback_kind: str, cache: dict, dropout_p: float = 0.0) -> tuple[dict, str]:
    """The op's mask arguments for masks entering the scores as `terms` [(op, tensor node, fill)]:
    what masks.analyze_mask proves (causal / window / key lengths + residual bias), else `fallback`
    (the masks combined into one bias, eager's own arithmetic). Analyses are shared through `cache`
    by the sites of one graph (models reuse one mask in every layer). With dropout, the fully masked rows of a
    finfo.min mask get eager's dropped uniform weights (emit: fa3.dropped_uniform_rows)."""
    try:
        from .masks import analyze_mask
        from .site import MaskSpec, MaskTerm
    except ImportError:  # mask analysis not available: the bias is exact
        return fallback, fallback_kind
    key = (tuple((op, t, fill) for op, t, fill in terms), tuple(map(str, q4v.shape)), str(k4v.shape[2]),
           q4v.dtype, sdpa)
    spec = cache.get(key)
    if spec is None:
        try:
            # SDPA's kernels add the mask to fp32 scores, whatever the inputs' dtype (fp16's finfo.min absorbs
            # nothing there, where an fp16 sum would): its terms are read as applied in fp32 or wider; the other
            # calls (need_weights=True's baddbmm) add it in q's dtype
            applied = torch.promote_types(q4v.dtype, torch.float32) if sdpa else q4v.dtype
            spec = analyze_mask(b.graph.owning_module, [MaskTerm(op, t, fill, applied) for op, t, fill in terms],
                                batch=q4v.shape[0], q_heads=q4v.shape[1], q_len=q4v.shape[2], k_len=k4v.shape[2],
                                scores_dtype=q4v.dtype, insert_before=node, sdpa=sdpa)
        except Exception as e:  # analysis is an optimisation: never let it break an exact rewrite
            spec = f"mask analysis failed: {type(e).__name__}: {e}"
        if isinstance(spec, MaskSpec):
            b.pending_cache[key] = spec
    if not isinstance(spec, MaskSpec) or spec.empty_rows not in emit.EMPTY_ROWS_KEPT:
        return fallback, fallback_kind
    fields = {f: getattr(spec, f) for f in _SPEC_FIELDS}
    # The analysis reads values through `.detach()` and no_grad regions, so the residual bias it returns may be a
    # tensor upstream of a gradient cut. A mask that carries no gradient gives the op a detached bias; one that
    # carries one, with a cut among the ancestors of any term, keeps eager's own arithmetic (the fallback).
    residual = fields.get("bias")
    if isinstance(residual, fx.Node) and isinstance(example_value(residual), torch.Tensor) and \
            example_value(residual).requires_grad:
        from .regions import Regions

        regions = cache.get("regions")
        if regions is None:
            regions = cache["regions"] = Regions(b.graph.owning_module)
        memo: dict = {}
        carries = [regions.carries_grad(t, memo) if isinstance(t, fx.Node) else False for _, t, _ in terms]
        if None in carries:
            return fallback, fallback_kind
        if not any(carries):
            fields["bias"] = b.m("detach", residual)
        elif any(c is False and any(memo.get(a) for a in n.all_input_nodes) for n, c in memo.items()):
            # a cut among the ancestors of any term (`memo` holds them all): the analysis may have read through it
            return fallback, fallback_kind
    return fields, spec.kind
