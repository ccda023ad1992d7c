"""What a rewrite must keep besides values: writes into tensors the caller sees, and gradient flow.

A site's nodes (the Q·Kᵀ product, the scores chain, the softmax, the probabilities chain, the P·V
product, and the views / casts / scalings of q, k, v the op reads through) are replaced by one op
placed where the P·V product was. That is exact for values; it is not for
- writes: `torch.matmul(p, v, out=buf)` fills `buf` (kept: the op's result is copied into it), an
  in-place op of the chain that writes into a tensor outside it (`bias += s`) or an `out=` inside
  the chain cannot be kept (refused); an in-place update of the result (`o += x`) must not write into
  the op's output, which autograd saved (the result is cloned first);
- grad-mode regions: a node under `torch.no_grad()` cuts the gradient of everything that reaches
  the P·V product through it, so the op's inputs that entered before a cut are detached
  (`GradFlow`); "entered" counts every node eager computes between the tensor the rewrite reads
  (which may lie before a GQA repeat or a batch regroup) and the contraction; other state changes (autocast, inference_mode) between the nodes are refused
  (regions.Regions.grad_cut).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.fx as fx

from .aliasing import written_args
from .canonicalize import is_inplace, kind, tensor_of
from .emit import example_value
from .regions import Regions

_THROUGH = ("transpose", "permute", "reshape", "unsqueeze", "getitem", "expand", "identity", "cast")


def out_target(node: fx.Node) -> Optional[Any]:
    """The `out=` tensor a call writes its result into (None when it has none)."""
    return node.kwargs.get("out") if node.op == "call_function" else None


def path_to(top: fx.Node, base: fx.Node, limit: int = 64) -> Optional[list]:
    """The nodes from `top` down to (not including) `base`, following each node's tensor input;
    None when the walk does not reach `base` (the nodes a View folded away between them)."""
    out, n = [], top
    for _ in range(limit):
        if n is base:
            return out
        out.append(n)
        ins = [a for a in n.args if isinstance(a, fx.Node) and tensor_of(a) is not None]
        if not ins:
            return None
        n = n.args[0] if n.args and n.args[0] in ins else ins[0]
    return None


def chain_write(nodes: list, own: set, keep_out: Optional[fx.Node] = None) -> Optional[str]:
    """Why the site's nodes write into memory that outlives the site (None when they do not):
    an `out=` argument (except on `keep_out`, whose write the rewrite keeps) or an in-place write
    (aliasing.written_args) whose destination is not itself one of the site's own nodes."""
    for n in nodes:
        out = out_target(n)
        if n is not keep_out and out is not None:
            return f"{n.name} writes its result into an out= tensor"
        outside = [dst for dst in written_args(n) if dst is not out and dst not in own]
        if outside:
            return f"{n.name} writes in place into {outside[0].name}, which outlives the attention"
    return None


def private_storage(dst: Any, pos: dict, after: int, limit: int = 4096) -> Optional[set]:
    """The nodes whose values share the memory of `dst`, which a node writes into, when that memory was
    allocated in the graph after position `after` (so no value read before then can be a view of it); None
    when that cannot be shown. The set is closed over views, in-place results and any op of unknown aliasing
    that reads a member as its first argument; an op that allocates its result (arithmetic, a contraction,
    a gather with a member as its index) starts new memory and is not in it."""
    from .functionalize import is_fresh

    base = dst
    for _ in range(64):
        if not isinstance(base, fx.Node) or base.op not in ("call_function", "call_method"):
            return None
        if is_fresh(base):
            break
        if not (is_inplace(base) or kind(base) in _THROUGH) or not base.args:
            return None
        base = base.args[0]
    else:
        return None
    if pos.get(base, -1) <= after:
        return None
    members, frontier = {base}, [base]
    while frontier:
        n = frontier.pop()
        for u in n.users:
            if u in members or u.op == "output":
                continue
            val = example_value(u)
            if isinstance(val, (tuple, list)):
                aliasing = True  # split / unbind / broadcast_tensors: views of every input
            elif not isinstance(val, torch.Tensor):
                aliasing = False  # a shape, a number, setitem's None
            else:
                aliasing = bool(u.args) and u.args[0] is n and not is_fresh(u)
            if aliasing:
                if len(members) >= limit:
                    return None
                members.add(u)
                frontier.append(u)
    return members


@dataclass
class GradFlow:
    """Which of the op's inputs eager differentiates through the site. An input that entered the
    chain at a node from which a node under no_grad lies on the way to the P·V product gets no
    gradient in eager, so the rewrite detaches it."""

    detach_q: bool = False
    detach_k: bool = False
    detach_v: bool = False
    detach_entries: set = field(default_factory=set)  # term / factor tensors entering before a cut


def read_path(path: list, base: fx.Node) -> list:
    """Eager's nodes from the contraction operand down to `base`, the node the rewrite reads, with
    `base` itself when it is a computation: the rewrite may read past it (a regroup reads
    `x.reshape(B*H, N, D)` back as `x`), and a `base` run under no_grad cuts the gradient of all
    before it. A placeholder or attribute computes nothing, so its grad mode cuts nothing."""
    return path + [base] if base.op in ("call_function", "call_method", "call_module") else list(path)


def _cut_below(regions: Regions, node: fx.Node, depth: int = 16) -> bool:
    """Does a node of `node`'s chain of one-tensor ops (itself, then its input, ...) run under
    no_grad, or detach? Then nothing before it gets a gradient through `node`, whichever of them
    the rewrite reads (the mask analysis reads a term through its views: `bias.reshape(B*H, N, N)`
    as `bias`)."""
    n = node
    for _ in range(depth):
        if n.op not in ("call_function", "call_method", "call_module"):
            return False
        grad = regions.of(n).grad
        if grad is None:
            raise ValueError(f"{n.name} runs under a grad mode not known at compile time")
        if not grad or n.target in ("detach", torch.detach):
            return True
        ins = [a for a in n.all_input_nodes if tensor_of(a) is not None]
        if len(ins) != 1:
            return False
        n = ins[0]
    return False


def grad_flow(regions: Regions, chain: list, q_path: list, k_path: list, v_path: list,
              entries: list) -> GradFlow:
    """chain: the site's nodes from the Q·Kᵀ product to the P·V product, in order; *_path: the nodes
    q, k, v were read through (`read_path`); entries: (tensor node, chain node where it enters).
    Raises ValueError when one tensor enters on both sides of a cut (no single detach is exact) or
    a node q, k, v are read through runs under a grad mode not known at compile time."""
    flow = GradFlow()
    o_node = chain[-1]
    if not regions.of(o_node).grad:
        return flow  # the op runs without grad, as eager's P·V product did: nothing to detach
    if any(regions.of(n).grad is None for n in q_path + k_path + v_path):
        raise ValueError("q, k or v is read through a grad-mode change whose mode is not known at compile time")
    pos = {n: i for i, n in enumerate(chain)}
    live_from = len(chain)  # chain[i:] all run with grad for i >= live_from
    while live_from > 0 and regions.of(chain[live_from - 1]).grad:
        live_from -= 1
    flow.detach_q = live_from > 0 or not regions.all_grad(q_path)
    flow.detach_k = live_from > 0 or not regions.all_grad(k_path)
    flow.detach_v = not regions.all_grad(v_path)
    verdict: dict = {}
    for t, at in entries:
        if not isinstance(t, fx.Node):
            continue
        cut = pos[at] < live_from or _cut_below(regions, t)
        if verdict.setdefault(t, cut) != cut:
            raise ValueError(f"{t.name} enters the scores on both sides of a grad-mode change")
        if cut:
            flow.detach_entries.add(t)
    return flow
