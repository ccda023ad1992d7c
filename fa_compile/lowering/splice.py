"""Trace a replacement function on a node's FakeTensors and put its graph in place of the node."""
from __future__ import annotations

import operator
from typing import Callable, Optional, Sequence

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import statically_known_true


class SpliceError(RuntimeError):
    pass


def _fake_mode(vals: Sequence):
    from torch._guards import detect_fake_mode

    mode = detect_fake_mode(list(vals))
    if mode is None:
        raise SpliceError("the node's inputs carry no FakeTensors")
    return mode


def strides_match(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal strides wherever they matter (a dimension of size 1 may have any stride, and a tensor with
    no elements any strides at all: they address no memory)."""
    if got.dim() != want.dim() or got.dtype != want.dtype:
        return False
    if any(statically_known_true(size == 0) for size in want.shape):
        return all(statically_known_true(x == y) for x, y in zip(got.shape, want.shape))
    for size, a, b in zip(want.shape, got.stride(), want.stride()):
        if statically_known_true(size <= 1):
            continue
        if not statically_known_true(a == b):
            return False
    return all(statically_known_true(x == y) for x, y in zip(got.shape, want.shape))


def replace_node(graph: fx.Graph, node: fx.Node, fn: Callable, inputs: Sequence[fx.Node],
                 want: Optional[Sequence[torch.Tensor]] = None) -> list[fx.Node]:
    """Replace `node` (a multi-output op used through getitem) by `fn(*inputs)` traced with make_fx.

    `fn` returns one tensor per output of the node, each with the node's own output sizes, strides
    and dtype (checked: a mismatch raises SpliceError and leaves the graph untouched), so every user
    sees exactly the tensors it was traced with. `want` replaces the node's outputs in that check where
    the caller rewires some users itself (a fix-up the replacement computes).
    """
    outs = node.meta.get("val") if want is None else want
    if not isinstance(outs, (tuple, list)):
        raise SpliceError("the node has no output FakeTensors")
    users = list(node.users)
    if any(u.op != "call_function" or u.target is not operator.getitem for u in users):
        raise SpliceError("an output is used other than through getitem")
    new = _copy_traced(graph, node, fn, inputs, outs)
    for u in users:
        u.replace_all_uses_with(new[u.args[1]])
        graph.erase_node(u)
    graph.erase_node(node)
    return new


def replace_value(graph: fx.Graph, node: fx.Node, fn: Callable, inputs: Sequence[fx.Node]) -> fx.Node:
    """Replace `node` (an op with one tensor output) by `fn(*inputs)`, traced and checked as `replace_node`."""
    want = node.meta.get("val")
    if not isinstance(want, torch.Tensor):
        raise SpliceError("the node has no output FakeTensor")
    new = _copy_traced(graph, node, lambda *a: (fn(*a),), inputs, [want])[0]
    node.replace_all_uses_with(new)
    graph.erase_node(node)
    return new


def insert_value(graph: fx.Graph, before: fx.Node, fn: Callable, inputs: Sequence[fx.Node]) -> fx.Node:
    """A new value `fn(*inputs)` (one tensor), traced as `replace_node` and copied in before `before`."""
    return _copy_traced(graph, before, lambda *a: (fn(*a),), inputs, None)[0]


def _copy_traced(graph: fx.Graph, node: fx.Node, fn: Callable, inputs: Sequence[fx.Node],
                 outs: Optional[Sequence[torch.Tensor]]) -> list[fx.Node]:
    """`fn(*inputs)` (returning a tuple) traced on the inputs' FakeTensors and copied in before `node`, after
    checking each result's sizes, strides and dtype against `outs` (None: a new value, nothing to check
    against); the graph is untouched on a mismatch."""
    vals = [n.meta["val"] for n in inputs]
    from torch._inductor.decomposition import select_decomp_table

    # Traced with Inductor's decompositions: the post-grad graph holds only ops Inductor lowers.
    with _fake_mode(vals):
        sub = make_fx(fn, decomposition_table=select_decomp_table(), tracing_mode="real")(*vals)
    _binary_sym_ops(sub.graph)
    placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
    results = next(n for n in sub.graph.nodes if n.op == "output").args[0]
    if outs is not None and len(results) != len(outs):
        raise SpliceError(f"the replacement returns {len(results)} values, the node {len(outs)}")
    for i, (r, want) in enumerate(zip(results, outs or ())):
        got = r.meta.get("val") if isinstance(r, fx.Node) else None
        if not isinstance(got, torch.Tensor) or not strides_match(got, want):
            have = None if not isinstance(got, torch.Tensor) else (tuple(got.shape), got.stride(), got.dtype)
            raise SpliceError(f"output {i}: replacement gives {have}, the node "
                              f"{(tuple(want.shape), want.stride(), want.dtype)}")
    with graph.inserting_before(node):
        new = graph.graph_copy(sub.graph, dict(zip(placeholders, inputs)))
    return list(new)


_NARY = (operator.mul, operator.add)


def _binary_sym_ops(graph: fx.Graph) -> None:
    """make_fx writes a size expression such as 4*Max(1, s0)*Max(1, s1) (a stride under symbolic sizes) as one
    `operator.mul` node of three arguments, which Inductor's fake-tensor update then calls and fails on: such
    nodes become chains of two-argument calls."""
    for n in list(graph.nodes):
        if n.op != "call_function" or n.target not in _NARY or len(n.args) <= 2 or n.kwargs:
            continue
        with graph.inserting_before(n):
            acc = n.args[0]
            for a in n.args[1:-1]:
                acc = graph.call_function(n.target, (acc, a))
        n.args = (acc, n.args[-1])


def droppable_clones(node: fx.Node, val: torch.Tensor) -> Optional[list[tuple[fx.Node, fx.Node, torch.Tensor]]]:
    """[(permute, clone, the permute's new value)] when `node`'s value is to be replaced by one with `val`'s
    strides, every use of `node` is permute -> clone(contiguous_format), and the permute of `val` is already
    contiguous: the head transpose before a projection (`attn.transpose(1, 2).contiguous()`, or its
    backward), which AOTAutograd traced as a copy because the value it replaces was [B, H, N, D]-contiguous.
    With `val`'s strides each clone copies a contiguous tensor, and `drop_clones` removes it. None otherwise
    (static sizes only; a clone the graph returns stays: an output must not alias another value)."""
    if not all(isinstance(s, int) for s in val.shape) or not node.users:
        return None
    found = []
    for p in node.users:
        if p.op != "call_function" or p.target is not torch.ops.aten.permute.default or p.args[0] is not node \
                or not p.users:
            return None
        pv = val.permute(list(p.args[1]))
        if not pv.is_contiguous():
            return None
        for c in p.users:
            if c.op != "call_function" or c.target is not torch.ops.aten.clone.default \
                    or c.kwargs.get("memory_format") is not torch.contiguous_format \
                    or any(u.op == "output" for u in c.users):
                return None
            found.append((p, c, pv))
    return found


def drop_clones(found: Sequence[tuple[fx.Node, fx.Node, torch.Tensor]]) -> None:
    """After the replacement (see droppable_clones): each permute takes its new value, its clone's users read it."""
    for permute, clone, val in found:
        permute.meta["val"] = val
        clone.replace_all_uses_with(permute)
