"""Attention inside higher-order-op subgraphs: the bodies Dynamo keeps as get_attr GraphModules.

`torch.utils.checkpoint(fn, ..., use_reentrant=False)` (Hugging Face's gradient checkpointing) traces
`fn` into a body called by `torch.ops.higher_order.tag_activation_checkpoint`; `torch.cond` keeps two
branch bodies, `wrap`, `invoke_subgraph`, `while_loop`, `map` ... one or more. The pass walks every such
body, recursively, and:

  rewrites in place  the bodies of HOPs whose semantics are proven to allow it (REWRITABLE): the body is
                     called as a plain function of its operands (checkpoint also calls it again in the
                     backward to recompute it, so it must stay a pure function of them), and AOTAutograd
                     inlines or traces it with our op's autograd formula. A rewrite keeps the body's
                     signature: the same placeholders and outputs of the same number, shapes, strides and
                     dtypes (checked; otherwise the body is put back and each site says why).
  reports only       every site inside any other HOP (torch.cond's branches must agree on their outputs'
                     metadata; while_loop / map / scan bodies are re-traced by their own rules): the site
                     is analysed on a scratch copy and reported as a Miss naming the HOP.

Each subgraph site's `where` names the HOPs it sits in. Bodies run under the global state of their
call in the enclosing graph: a grad-mode set there is the body's ambient grad mode; an autocast,
inference_mode or other state region around the call is not modelled, so its sites are reported, as
are a checkpoint called under no_grad, a shared body called under both grad modes, and training
dropout inside a checkpoint (its recompute would not replay the fused op's dropout seed under every
inner compiler). Should the inner compiler still reject a rewritten body, the front door puts the
bodies back as traced (undo_subgraph_rewrites) and compiles again.
"""
from __future__ import annotations

import copy
import dataclasses
import weakref
from typing import Callable, Optional

import torch
import torch.fx as fx

from .regions import Regions
from .shapes import known_eq
from .site import PassOptions, SiteReport

# HOP name -> how explain() names it to the user.
_DISPLAY = {
    "tag_activation_checkpoint": "torch.utils.checkpoint",
    "wrap_activation_checkpoint": "torch.utils.checkpoint",
    "wrap": "a wrapped region (wrap)",
    "invoke_subgraph": "a nested compile region (invoke_subgraph)",
    "cond": "torch.cond",
    "while_loop": "torch.while_loop",
    "map_impl": "torch.map",
    "scan": "torch.scan",
    "associative_scan": "torch.associative_scan",
    "flex_attention": "flex_attention",
}

# HOPs whose body is a plain function of its operands, run once per call (and, for checkpoint, once more
# in the backward with the same operands), whose AOTAutograd handling traces the body with our op inside.
CHECKPOINTS = frozenset({"tag_activation_checkpoint", "wrap_activation_checkpoint"})
REWRITABLE = CHECKPOINTS | {"wrap", "invoke_subgraph"}

# Why a site inside a HOP outside REWRITABLE is left as traced.
_NOT_PROVEN = {
    "cond": "both branches must return outputs of the same metadata and torch.cond traces its own backward "
            "through them; a rewrite there is not proven to keep either",
    "": "rewriting inside this higher-order op is not proven to keep its semantics",
}

_DONE = "fa_compile_subgraph_rewritten"
# body -> (GraphRecord before the rewrite, HOP name, the body's reports). Kept beside the body, not in its meta: the
# record's nodes refer back to each other, and Inductor's cache key pickles the bodies' meta (a cyclic object there
# logged a traceback and bypassed the AOTAutograd cache).
_UNDO: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()

GraphRewrite = Callable[[fx.GraphModule, PassOptions], "list[SiteReport]"]


def hop_name(node: fx.Node) -> Optional[str]:
    """The name of the higher-order op `node` calls (None for anything else)."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.HigherOrderOperator):
        return None
    return node.target.name()


def display(name: str) -> str:
    return _DISPLAY.get(name, f"torch.ops.higher_order.{name}")


def subgraph_modules(gm: fx.GraphModule, node: fx.Node) -> list[fx.GraphModule]:
    """The GraphModules a HOP call reads through get_attr arguments (in argument order, each once)."""
    out: list = []
    for a in torch.utils._pytree.tree_leaves((node.args, node.kwargs)):
        if isinstance(a, fx.Node) and a.op == "get_attr":
            mod = gm
            try:
                for part in str(a.target).split("."):
                    mod = getattr(mod, part)
            except AttributeError:
                continue
            if isinstance(mod, fx.GraphModule) and all(mod is not m for m in out):
                out.append(mod)
    return out


@dataclasses.dataclass
class _Call:
    """One HOP call of a graph: its name, bodies, and the state it runs under (a reason when not modelled)."""

    name: str
    bodies: list
    grad: Optional[bool]
    state_miss: Optional[str]


def _calls(gm: fx.GraphModule) -> list[_Call]:
    hops = [(n, hop_name(n)) for n in gm.graph.nodes]
    hops = [(n, h) for n, h in hops if h is not None]
    if not hops:
        return []
    regions = Regions(gm)
    calls = []
    for n, name in hops:
        bodies = subgraph_modules(gm, n)
        if not bodies:
            continue
        st, init = regions.of(n), regions.initial
        miss = None
        if st.autocast_on != init.autocast_on:
            miss = "it is called in an autocast region of the enclosing graph"
        elif st.inference != init.inference:
            miss = "it is called in or after an inference_mode region of the enclosing graph"
        elif st.other != init.other:
            miss = "it is called after a change of global state in the enclosing graph"
        elif st.grad is None:
            miss = "it is called under a grad mode not known at compile time"
        elif name in CHECKPOINTS and not st.grad:
            # nothing to recompute without grad; AOTAutograd's partitioner was seen to reject our op in
            # a checkpoint body under no_grad followed by one with grad
            miss = "it is called under no_grad, where checkpointing has no backward to recompute for"
        calls.append(_Call(name, bodies, st.grad, miss))
    return calls


def _signature(gm: fx.GraphModule) -> tuple[list, list]:
    """(placeholders, the example values of the outputs) of a body."""
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    vals = [a.meta.get("example_value") if isinstance(a, fx.Node) else a
            for a in torch.utils._pytree.tree_leaves(out.args)]
    return phs, vals


def _same_value(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.dtype == b.dtype and a.device == b.device and a.dim() == b.dim() and \
            all(known_eq(x, y) for x, y in zip(a.shape, b.shape)) and \
            all(known_eq(x, y) for x, y in zip(a.stride(), b.stride()))
    return type(a) is type(b) and not isinstance(a, torch.Tensor)


def _signature_kept(before: tuple[list, list], after: tuple[list, list]) -> Optional[str]:
    """None when the body still takes the same inputs and returns outputs of the same layout, else what changed."""
    if len(before[0]) != len(after[0]) or any(a is not b for a, b in zip(*(before[0], after[0]))):
        return "its inputs"
    if len(before[1]) != len(after[1]):
        return "the number of its outputs"
    for i, (a, b) in enumerate(zip(before[1], after[1])):
        if not _same_value(a, b):
            return f"the shape, strides or dtype of its output {i}"
    return None


def _located(reports: list[SiteReport], chain: list[str]) -> list[SiteReport]:
    inside = " inside ".join(reversed(chain))
    for r in reports:
        r.where = f"{r.where} (inside {inside})" if r.where else f"inside {inside}"
    return reports


def _body_options(options: PassOptions, name: str) -> PassOptions:
    # checkpoint runs the body again in the backward: a dropout seed drawn inside it must be the
    # forward's, which the recompute does not promise for a fresh draw; eager's dropout is kept there
    if name in CHECKPOINTS:
        return dataclasses.replace(options, allow_training_dropout=False)
    return options


# how find_sites / fused_common word the refusal that allow_training_dropout=False causes
_DROPOUT_OFF = ("disabled by the options", "told not to rewrite training dropout")


def _reasons_for(reports: list[SiteReport], name: str) -> None:
    for r in reports:
        if r.reason and any(m in r.reason for m in _DROPOUT_OFF) and name in CHECKPOINTS:
            r.reason = ("dropout on the probabilities inside torch.utils.checkpoint: the recompute in the "
                        "backward would draw a new dropout mask for the fused op; left as written")


def _scratch(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of a body to analyse without touching it (nodes and meta dicts copied, values shared)."""
    return fx.GraphModule(gm, copy.deepcopy(gm.graph))


def _blocked(reports: list[SiteReport], why: str) -> list[SiteReport]:
    for r in reports:
        if r.rewritten:
            r.rewritten, r.call, r.reason = False, None, why
        else:
            r.reason = f"{r.reason} ({why})"
    return reports


def _rewrite_body(body: fx.GraphModule, options: PassOptions, rewrite_graph: GraphRewrite, name: str) -> list[SiteReport]:
    """`rewrite_graph` on one body in place, put back (its sites Misses) should it change the body's signature."""
    from .pipeline import GraphRecord

    record, before = GraphRecord(body.graph), _signature(body)
    reports = rewrite_graph(body, options)
    _reasons_for(reports, name)
    if not any(r.rewritten for r in reports):
        return reports
    try:
        changed = _signature_kept(before, _signature(body))
    except Exception as e:  # cannot tell: treat as changed
        changed = f"something it could not compare ({type(e).__name__})"
    if changed is None:
        _UNDO[body] = (record, name, reports)
        return reports
    record.restore()
    body.recompile()
    return _blocked(reports, f"inside {display(name)}: not rewritten (the rewrite would change {changed})")


def rewrite_nested(gm: fx.GraphModule, options: PassOptions, rewrite_graph: GraphRewrite) -> list[SiteReport]:
    """`rewrite_graph` on `gm`, then on every HOP body it calls, recursively; the reports of all."""
    calls = _calls(gm)  # before the rewrite: the state markers are the graph's own
    return rewrite_graph(gm, options) + _bodies(gm, calls, options, rewrite_graph, [], None)


def _bodies(gm: fx.GraphModule, calls: list[_Call], options: PassOptions, rewrite_graph: GraphRewrite,
            chain: list[str], blocked: Optional[str]) -> list[SiteReport]:
    """The reports of the bodies of `calls`. blocked: the reason nothing below may be rewritten (a HOP
    around it is not known to allow it): each body is then analysed on a scratch copy, its sites Misses."""
    reports: list = []
    seen: set = set()
    modes: dict = {}  # a body shared by several calls (invoke_subgraph) is rewritten for all of them
    for call in calls:
        for body in call.bodies:
            modes.setdefault(id(body), set()).add(call.grad)
    for call in calls:
        here = chain + [display(call.name)]
        why = blocked
        if why is None and any(len(modes[id(b)]) > 1 for b in call.bodies):
            why = f"inside {display(call.name)}: not rewritten (its body is called with grad enabled and disabled)"
        if why is None and call.name not in REWRITABLE:
            why = f"inside {display(call.name)}: not rewritten ({_NOT_PROVEN.get(call.name, _NOT_PROVEN[''])})"
        if why is None and call.state_miss:
            why = f"inside {display(call.name)}: not rewritten ({call.state_miss})"
        opts = _body_options(options, call.name)
        for body in call.bodies:
            if id(body) in seen or (why is None and body.meta.get(_DONE)):
                continue  # a body shared by several calls (invoke_subgraph) is rewritten / reported once
            seen.add(id(body))
            try:
                target = body if why is None else _scratch(body)
                inner = _calls(target)
                with torch.set_grad_enabled(bool(call.grad)):
                    if why is None:
                        own = _rewrite_body(target, opts, rewrite_graph, call.name)
                        body.meta[_DONE] = True
                    else:
                        own = rewrite_graph(target, opts)
                        _reasons_for(own, call.name)
                        own = _blocked(own, why)
                    reports += _located(own, here)
                    reports += _bodies(target, inner, opts, rewrite_graph, here, why)
            except Exception as e:  # never fail the compile: the body as it stands, the failure reported
                msg = str(e).splitlines()[0] if str(e) else ""
                reports.append(SiteReport(form="pass", rewritten=False, where=f"inside {' inside '.join(reversed(here))}",
                                          reason=f"the pass failed walking a body of {display(call.name)} "
                                                 f"({type(e).__name__}: {msg}); its sites are left as traced"))
    return reports


def undo_subgraph_rewrites(gm: fx.GraphModule, error: Exception) -> bool:
    """Put every body of `gm` rewritten in place back as traced, its sites Misses naming `error` (the inner
    compiler rejected the graph with our op inside a HOP body). True when there was one to put back."""
    undone = False
    for body in [m for m in gm.modules() if isinstance(m, fx.GraphModule) and m is not gm]:
        entry = _UNDO.pop(body, None)
        if entry is None:
            continue
        record, name, reports = entry
        record.restore()
        body.recompile()
        msg = str(error).strip().splitlines()[0] if str(error).strip() else ""
        _blocked([r for r in reports if r.rewritten],
                 f"inside {display(name)}: not rewritten (the inner compiler rejected the rewritten body: "
                 f"{type(error).__name__}: {msg[:200]})")
        undone = True
    return undone
