"""The graph pass: canonicalize -> tentative edits -> find sites -> rewrite, on a Dynamo GraphModule, in place.

A refusal never fails the compile: every site is rewritten in a transaction of its own (a failure
inside it rolls its edits back and becomes that site's Miss), and should anything escape a step,
the graph is restored to what it was before the pass and every site reports why it was left as
the user wrote it. When no site is rewritten, the canonicalization's edits are undone too: a graph
the pass does not fuse is handed on as Dynamo traced it.
"""
from __future__ import annotations

import copy
from typing import Callable, Optional

import torch
import torch.fx as fx

from .aliasing import writes
from .canonicalize import canonicalize
from .concat_keys import fold_concat_keys
from .einsum_groups import fold_einsum_groups
from .fused_calls import rewrite_fused_calls
from .find_sites import rewrite_softmax_sites
from .late_normalised import fold_late_normalised
from .paged import rewrite_paged_caches
from .site import PassOptions, SiteReport
from .split_rows import fold_split_rows
from .subgraphs import rewrite_nested
from .tentative import undo_unused
from .transposed_pv import fold_transposed_pv


class GraphRecord:
    """The graph as the pass found it, to put back in place should a step fail: every node with the
    call, inputs and example value it had (references only, so taking it costs one walk over the nodes).
    Restoring keeps the original node objects (Dynamo keeps state on placeholders), re-creates the
    ones the pass erased and removes every node it added."""

    def __init__(self, graph: fx.Graph):
        self.graph = graph
        self.nodes = [(n, n.args, n.kwargs, n.meta.get("example_value")) for n in graph.nodes]
        # a canonicalize step may call another function with other arguments (aten_spellings)
        self.calls = {n: (n.op, n.target) for n in graph.nodes}

    def original(self) -> fx.Graph:
        """A new graph equal to the one the pass found (new nodes, same names and metadata)."""
        old = self.graph
        graph = fx.Graph(owning_module=old.owning_module, tracer_cls=old._tracer_cls)
        graph._codegen = copy.deepcopy(old._codegen)
        env: dict = {}
        for n, args, kwargs, val in self.nodes:
            m = graph.create_node(*self.calls[n], fx.node.map_arg(args, env.__getitem__),
                                  fx.node.map_arg(kwargs, env.__getitem__), name=n.name, type_expr=n.type)
            m.meta = dict(n.meta)
            if val is not None:
                m.meta["example_value"] = val
            env[n] = m
        return graph

    def restore(self) -> None:
        graph = self.graph
        env: dict = {}
        look = lambda a: env.get(a, a)  # noqa: E731
        cursor = None
        for n, args, kwargs, val in self.nodes:
            args, kwargs = fx.node.map_arg(args, look), fx.node.map_arg(kwargs, look)
            if getattr(n, "_erased", False):
                with graph.inserting_after(cursor) if cursor is not None else graph.inserting_before(None):
                    m = graph.create_node(*self.calls[n], args, kwargs, name=n.name, type_expr=n.type)
                m.meta = n.meta
                env[n] = m
                cursor = m
                continue
            n.op, n.target = self.calls[n]
            n.args, n.kwargs = args, kwargs
            if val is not None:
                n.meta["example_value"] = val
            cursor = n
        kept = {env.get(n, n) for n, *_ in self.nodes}
        for n in reversed(list(graph.nodes)):
            if n not in kept:
                graph.erase_node(n)


def remove_unread(graph: fx.Graph, impure: Callable[[fx.Node], bool]) -> bool:
    """Erase the nodes of `graph` that nothing reads and `impure` does not keep, users before producers (so a chain
    left unread goes whole); placeholders and the output stay. The bodies of the graph's submodules are not
    touched. True when a node was erased."""
    changed = False
    for n in reversed(list(graph.nodes)):
        if n.op in ("placeholder", "output") or n.users or impure(n):
            continue
        graph.erase_node(n)
        changed = True
    return changed


def _finish(gm: fx.GraphModule, reports: list[SiteReport], unread: set) -> None:
    if any(r.rewritten for r in reports):
        # Only what the rewrites left unread goes. fx's default purity test treats call_method in-place ops
        # (`y.add_(1)`, no users) as dead, and so are nodes the traced program kept unread for their effect
        # (`unread`: torch.vmap's _vmap_increment_nesting / _vmap_decrement_nesting, whose removal
        # unbalances the batch levels AOTAutograd replays).
        # This graph's nodes only: fx's eliminate_dead_code also sweeps the bodies of higher-order ops it reaches
        # through get_attr (autograd.Function's forward and backward, checkpointed regions) with the default
        # test, which would drop their in-place ops (`grad.scatter_add_(...)` in a custom backward).
        remove_unread(gm.graph, lambda n: n.is_impure() or writes(n) or n in unread)
        gm.graph.lint()
        gm.recompile()


STEPS: tuple[tuple[str, Callable[[fx.GraphModule, PassOptions], list[SiteReport]]], ...] = (
    ("fused calls", rewrite_fused_calls),
    ("softmax sites", rewrite_softmax_sites),
)


def rewrite_attention(gm: fx.GraphModule, options: Optional[PassOptions] = None) -> list[SiteReport]:
    """Rewrite every provable attention site of `gm` and of the higher-order-op bodies it calls
    (checkpoint, wrap, cond, ...: see subgraphs.py) to fa3.attention; report every site seen."""
    # The example values the pass computes run ops with autograd on fake tensors; saved-tensor hooks of the
    # caller's context (non-reentrant checkpointing counts saves, and a compile inside it happens at the
    # first call) must not see those saves: the innermost hooks apply, so identity hooks hide the caller's.
    with torch.autograd.graph.saved_tensors_hooks(_same, _same):
        return rewrite_nested(gm, options or PassOptions(), rewrite_graph)


def _same(t):
    return t


def functorch_transform(gm: fx.GraphModule) -> Optional[str]:
    """The name of a differentiating torch.func transform that runs inside the graph (torch.func.grad / vjp / jvp
    traced by Dynamo: `torch._C._functorch._grad_increment_nesting` or `_jvp_increment_nesting` opens its level), or
    None. (A vmap level is not one: the op's batching falls back to a loop, and attention beside a vmap is common.)"""
    for n in gm.graph.nodes:
        name = getattr(n.target, "__name__", "") if n.op == "call_function" else ""
        if name in ("_grad_increment_nesting", "_jvp_increment_nesting"):
            return name[1:].split("_")[0]
    return None


def rewrite_graph(gm: fx.GraphModule, options: PassOptions) -> list[SiteReport]:
    """The pass on the nodes of one graph (the bodies it calls through get_attr are not entered)."""
    transform = functorch_transform(gm)
    if transform is not None:  # the op's autograd has no functorch rules (grad's levels, jvp's tangents, vmap)
        return [SiteReport(form="pass", rewritten=False,
                           reason=f"a torch.func transform ({transform}) runs inside the graph, and fa3.attention "
                                  "has no functorch rule: the graph is left as traced")]
    record = GraphRecord(gm.graph)
    reports: list[SiteReport] = []
    unread = {n for n in gm.graph.nodes if not n.users and n.op not in ("placeholder", "output")}
    step = "canonicalize"
    try:
        canonicalized = canonicalize(gm)
        step = "tentative edits"
        # undone below where no rewrite took them
        tentative = (fold_split_rows(gm) + fold_transposed_pv(gm) + fold_concat_keys(gm) + fold_einsum_groups(gm)
                     + fold_late_normalised(gm))
        canonicalized = canonicalized or bool(tentative)
        for step, run in STEPS:
            reports += run(gm, options)
        step = "paged caches"
        rewrite_paged_caches(gm, reports, options)  # the rewritten sites whose K/V are gathered pages
        step = "finish"
        undo_unused(gm, tentative)
        if canonicalized and not any(r.rewritten for r in reports):
            record.restore()
            gm.recompile()
        _finish(gm, reports, unread)
    except Exception as e:  # a failure no site's own guard caught: give the user back their graph
        record.restore()
        gm.recompile()
        msg = str(e).splitlines()[0] if str(e) else ""
        why = f"the pass failed in its {step} step ({type(e).__name__}: {msg}); the graph is left as traced"
        for r in reports:
            r.rewritten, r.call = False, None
            r.reason = why if r.reason is None else r.reason
        reports.append(SiteReport(form="pass", rewritten=False, reason=why))
    return reports
