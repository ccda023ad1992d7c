"""One value per step for what every layer recomputes the same way: a decode step's key limit
(fa3::key_limit) and the sites' index arguments (kv_lens, q_pos, segment ids, masks).

A model's layers share one mask and one cache_position, and each rewritten site derives its kv_lens or
key limit from them with its own copy of the same ops. After AOTAutograd an inference graph gets no CSE
(the partitioner runs one for training only), so Inductor computed each copy in a kernel of its own, every
layer and step (over a 16384-key cache, a ~3 us key-limit kernel per layer on the H200). `share` keeps the
first of each set of equal values.

Two values are equal when they are the same op (pure: functional, not seeded random, not `empty`) of
equal arguments, down to the graph's inputs and the nodes that are not such ops. Views and casts that
change nothing (a full slice, a view to the same shape) are looked through.

Sharing one node is not enough for Inductor: it hands a user Triton kernel each input with the exact strides
it was traced with, and copies an input it has not realized yet for that kernel alone, fusing the copy into
the value's own arithmetic. So a kv_lens computed from cache_position was still recomputed by one launch per
layer (a Llama decode step on the H200: eight two-element kernels per step). `materialize_lengths` writes
such a kv_lens once, with the `fa3_decode::materialize` kernel, into a buffer every site reads.
"""
from __future__ import annotations

import os
from typing import Any

import torch
import torch.fx as fx

from ..key_limit_op import KEY_LIMIT
from ..patterns.shapes import known_eq
from . import site_args, splice

# The op arguments shared by name: index tensors and masks, never q / k / v / dout (model values: equal
# ones are rare and computing the key of their cone would walk the whole model) nor the dropout seed.
SHARED_ARGS = ("bias", "kv_lens", "q_pos", "q_seg", "k_seg")
_MAX_DEPTH = 64  # cones deeper than this are not compared (a node past it is its own key)
_NOT_PURE = frozenset({"aten::empty", "aten::empty_strided", "aten::empty_like", "aten::new_empty",
                       "aten::new_empty_strided", "aten::empty_permuted"})
_VIEWS = frozenset({
    torch.ops.aten.slice.Tensor, torch.ops.aten.view.default, torch.ops.aten.reshape.default,
    torch.ops.aten.expand.default, torch.ops.aten.alias.default, torch.ops.aten.clone.default,
    torch.ops.aten._to_copy.default, torch.ops.prims.convert_element_type.default,
    torch.ops.aten.squeeze.dim, torch.ops.aten.squeeze.dims, torch.ops.aten.squeeze.default,
})


def _pure(node: fx.Node) -> bool:
    t = node.target
    if node.op != "call_function" or not isinstance(t, torch._ops.OpOverload):
        return False
    schema = t._schema
    if schema.is_mutable or schema.name in _NOT_PURE:
        return False
    tags = set(t.tags)
    return torch.Tag.nondeterministic_seeded not in tags and torch.Tag.nondeterministic_bitwise not in tags


def _same_tensor(x: Any, y: fx.Node) -> bool:
    """Whether view/cast `y` of `x` is `x` itself (same dtype, device, sizes, strides and offset)."""
    xv, yv = (n.meta.get("val") if isinstance(n, fx.Node) else None for n in (x, y))
    if not (isinstance(xv, torch.Tensor) and isinstance(yv, torch.Tensor)):
        return False
    if xv.dtype != yv.dtype or xv.device != yv.device or xv.dim() != yv.dim():
        return False
    pairs = [*zip(xv.shape, yv.shape), *zip(xv.stride(), yv.stride()), (xv.storage_offset(), yv.storage_offset())]
    return all(known_eq(a, b) for a, b in pairs)  # symbolic sizes: only where provably equal (no guard)


class _Keys:
    def __init__(self) -> None:
        self.memo: dict[fx.Node, Any] = {}

    def of(self, a: Any, depth: int = 0) -> Any:
        """A hashable key equal for two arguments that are the same value (TypeError where there is none)."""
        if isinstance(a, fx.Node):
            if a in self.memo:
                return self.memo[a]
            key: Any = a
            if depth < _MAX_DEPTH and _pure(a):
                if a.target in _VIEWS and a.args and _same_tensor(a.args[0], a):
                    key = self.of(a.args[0], depth + 1)
                else:
                    key = (a.target, self.of(a.args, depth + 1), self.of(tuple(sorted(a.kwargs.items())), depth + 1))
            self.memo[a] = key
            return key
        if isinstance(a, (list, tuple)):
            return tuple(self.of(x, depth + 1) for x in a)
        if isinstance(a, (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout,
                          torch.memory_format)):
            return (type(a), a)  # 1, 1.0 and True are not the same argument
        raise TypeError(f"no key for {type(a).__name__}")


def _candidates(graph: fx.Graph) -> list[fx.Node]:
    out: dict[fx.Node, None] = {}  # ordered, without repeats
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        if node.target is KEY_LIMIT:
            out[node] = None
        elif node.target in (site_args.FORWARD, site_args.BACKWARD):
            schema = node.target._schema
            for i, arg in enumerate(schema.arguments):
                if arg.name not in SHARED_ARGS:
                    continue
                a = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
                if isinstance(a, fx.Node) and a.op == "call_function":
                    out[a] = None
    return list(out)


def share(graph: fx.Graph) -> int:
    """Replace each candidate value that equals an earlier node of the graph by that node; returns how many."""
    candidates = _candidates(graph)
    if len(candidates) < 2:
        return 0  # nothing to compare (most graphs: no decode site, or one layer)
    keys = _Keys()
    order = {n: i for i, n in enumerate(graph.nodes)}
    first: dict = {}
    replaced = 0
    for node in sorted(candidates, key=order.__getitem__):
        try:
            key = keys.of(node)
            hash(key)
        except TypeError:
            continue
        if key is node:
            continue  # not a pure op: nothing to compare
        if any(u.op == "output" for u in node.users):
            continue  # two outputs would become one tensor (a caller may write one of them)
        kept = first.setdefault(key, node)
        if kept is not node:  # `kept` comes first, so it precedes every use of `node`
            node.replace_all_uses_with(kept)
            graph.erase_node(node)
            replaced += 1
    return replaced


MATERIALIZE_DEVICES = ("cuda",)  # where sites become Triton launches (tests add "cpu" under the interpreter)


def _can_materialize(val: Any) -> bool:
    from ..kernels import decode_ops
    from ..kernels.triton_family import device_reasons, triton_available

    return (isinstance(val, torch.Tensor) and val.dim() == 1 and isinstance(val.shape[0], int)
            and val.dtype in decode_ops.MATERIALIZE_DTYPES and val.device.type in MATERIALIZE_DEVICES
            and triton_available() and os.environ.get("FA_COMPILE_TRITON_LOWER", "auto") != "0"
            and not device_reasons(val.device))


def materialize_lengths(graph: fx.Graph) -> int:
    """Give each kv_lens computed in the graph and read by two or more sites one `fa3_decode::materialize` copy,
    inserted before the first of them, which all of them read instead; returns how many were made. Only the
    sites' uses move. Graph inputs are left alone (Inductor takes them as they are)."""
    from torch._subclasses.functional_tensor import dispatch_functionalize

    from ..kernels import decode_ops

    order: dict = {}  # node -> position, built when a first value has two readers
    made = 0
    for node in _candidates(graph):
        if node.target is KEY_LIMIT or not _can_materialize(node.meta.get("val")):
            continue
        sites = [u for u in node.users if u.op == "call_function" and u.target in
                 (site_args.FORWARD, site_args.BACKWARD) and site_args.bound(u)["kv_lens"] is node]
        if len(sites) < 2:
            continue  # one reader: Inductor's copy for it is fused into the value's own kernel anyway
        order = order or {n: i for i, n in enumerate(graph.nodes)}
        sites.sort(key=order.__getitem__)
        try:
            copy = splice.insert_value(graph, sites[0], dispatch_functionalize(decode_ops.materialize), [node])
        except Exception:  # the sites keep computing their own (equal) copies: slower, never different
            continue
        for u in sites:
            u.replace_input_with(node, copy)  # (another argument that is the same node holds the same values)
        made += 1
    return made
