"""The global state each node of a Dynamo graph runs under: grad mode, inference mode, autocast.

Dynamo keeps `with torch.no_grad():`, `torch.set_grad_enabled(...)`, `torch.enable_grad()` as
`torch._C._set_grad_enabled(flag)` nodes, `torch.inference_mode()` as `_enter_inference_mode` /
`_exit_inference_mode` and `torch.autocast(...)` as `_enter_autocast` / `_exit_autocast`, in program
order. A rewrite that moves work from one node to another (the fused op sits where the P·V product
was) must know whether the two ran under the same state. The state before the first marker is the
ambient one the graph is compiled (and guarded) for.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import torch
import torch.fx as fx


@dataclass(frozen=True)
class State:
    """grad: True / False, None when a marker set it to something not read at compile time.
    autocast_on: whether autocast is enabled. autocast, inference, other: region ids (two nodes' ids
    differ exactly when a marker of that kind lies between them)."""

    grad: Optional[bool]
    autocast_on: Optional[bool] = False  # None: an autocast region whose enabled flag is not a constant
    autocast: int = 0
    inference: int = 0
    other: int = 0


def _name(node: fx.Node) -> str:
    t = node.target
    return t if isinstance(t, str) else getattr(t, "__name__", "")


_AUTOCAST = ("_enter_autocast", "_exit_autocast", "_set_autocast_enabled")
_INFERENCE = ("_enter_inference_mode", "_exit_inference_mode")


def _is_state_marker(node: fx.Node) -> bool:
    """A call that changes global state for the nodes after it (and produces no tensor)."""
    if node.op != "call_function":
        return False
    mod = getattr(node.target, "__module__", "") or ""
    name = _name(node)
    return (mod.startswith("torch") or mod == "") and name.startswith(("_enter_", "_exit_", "_set_")) and \
        not isinstance(node.meta.get("example_value"), torch.Tensor)


class Regions:
    """State of every node of `gm`, computed once per graph."""

    def __init__(self, gm: fx.GraphModule):
        self.state: dict = {}
        self.markers = 0
        ambient = any(torch.is_autocast_enabled(d) for d in ("cpu", "cuda"))
        self.initial = st = State(torch.is_grad_enabled(), ambient)
        autocast_stack: list = [ambient]
        for n in gm.graph.nodes:
            if _is_state_marker(n):
                self.markers += 1
                name = _name(n)
                if n.target is torch._C._set_grad_enabled:
                    flag = n.args[0] if n.args else None
                    st = replace(st, grad=flag if isinstance(flag, bool) else None)
                elif name in _AUTOCAST:
                    if name == "_enter_autocast":
                        flag = n.args[2] if len(n.args) > 2 else n.kwargs.get("enabled", True)
                        autocast_stack.append(flag if isinstance(flag, bool) else None)
                    elif name == "_exit_autocast" and len(autocast_stack) > 1:
                        autocast_stack.pop()
                    else:
                        autocast_stack[-1] = None
                    st = replace(st, autocast_on=autocast_stack[-1], autocast=st.autocast + 1)
                elif name in _INFERENCE:
                    st = replace(st, inference=st.inference + 1)
                else:
                    st = replace(st, other=st.other + 1)
            self.state[n] = st

    def of(self, node: fx.Node) -> State:
        """A node inserted since (an earlier site's glue) runs under the state of the place it was
        inserted at: that of the nearest original node before it (markers are all original)."""
        n = node
        while n not in self.state and n.op != "root":
            n = n.prev
        st = self.state.get(n, self.initial)
        self.state[node] = st
        return st

    def grad_cut(self, nodes: list) -> Optional[str]:
        """None when every node of `nodes` runs with the same inference-mode and other state, and with autocast
        flags known at compile time, else the reason the work cannot move between them."""
        states = [self.of(n) for n in nodes]
        first = states[0]
        # Across autocast regions whose flags are constants, each node's example value carries the dtype it computed
        # in under its own region, and the site finder compares those (the fused op sits in the P·V product's
        # region and computes in that product's dtype, where its autocast kernel leaves q, k and v as they are).
        if any(s.autocast != first.autocast for s in states) and any(s.autocast_on is None for s in states):
            return "the attention spans an autocast region whose enabled flag is not known at compile time"
        if any(s.inference != first.inference for s in states):
            return "the attention spans an inference_mode region boundary"
        if any(s.other != first.other for s in states):
            return "the attention spans a change of global state"
        if len({s.grad for s in states}) > 1 and any(s.grad is None for s in states):
            return "the attention spans a grad-mode change whose mode is not known at compile time"
        return None

    def all_grad(self, nodes: list) -> bool:
        """Every node runs with grad enabled (so a gradient flows through the chain they form)."""
        return all(self.of(n).grad for n in nodes)

    def carries_grad(self, node: fx.Node, memo: Optional[dict] = None) -> Optional[bool]:
        """Whether eager's value of `node` carries a gradient (None: a grad mode not known at compile time). Read
        from the graph, not the example values: Dynamo's values of views made under no_grad still say
        requires_grad. A leaf carries one when it requires grad; `.detach()` never does; any other node when it
        runs with grad enabled and one of its tensor inputs carries one."""
        memo = {} if memo is None else memo
        stack = [(node, False)]
        while stack:  # post-order without recursion (mask chains can be long): every input before its user
            n, inputs_done = stack.pop()
            if inputs_done:
                memo[n] = self._carries(n, memo)
            elif n not in memo:
                memo[n] = None  # being visited
                stack.append((n, True))
                stack += [(a, False) for a in n.all_input_nodes if a not in memo]
        return memo[node]

    def _carries(self, n: fx.Node, memo: dict) -> Optional[bool]:
        v = n.meta.get("example_value", n.meta.get("val"))
        if n.op in ("placeholder", "get_attr"):
            return isinstance(v, torch.Tensor) and v.requires_grad
        if not isinstance(v, torch.Tensor) or _name(n) == "detach":
            return False
        ins = [memo.get(a) for a in n.all_input_nodes]
        grad = self.of(n).grad
        if not any(ins):
            return None if None in ins else False
        return grad if grad is not None else None
