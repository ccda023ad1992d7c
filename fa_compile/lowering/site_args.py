"""The arguments of an fa3 node as dispatch sees them, read from the nodes' FakeTensors."""
from __future__ import annotations

import operator
from typing import Any, Optional

import torch
import torch.fx as fx

from .. import dispatch, ops  # noqa: F401  (ops registers torch.ops.fa3)

FORWARD = torch.ops.fa3.attention.default
BACKWARD = torch.ops.fa3.attention_backward.default


def _value(a: Any) -> Any:
    if isinstance(a, fx.Node):
        return a.meta.get("val", a.meta.get("example_value"))
    return a


def bound(node: fx.Node) -> dict:
    """{argument name: node or constant} for every schema argument, defaults filled in."""
    schema = node.target._schema
    out = {}
    for i, arg in enumerate(schema.arguments):
        if i < len(node.args):
            out[arg.name] = node.args[i]
        elif arg.name in node.kwargs:
            out[arg.name] = node.kwargs[arg.name]
        else:
            out[arg.name] = arg.default_value if arg.has_default_value() else None
    return out


_FIELDS = ("q", "k", "v", "scale", "causal", "diag_offset", "window_left", "window_right", "bias", "kv_lens",
           "softcap", "dropout_p", "dropout_seed", "sinks", "q_pos", "q_seg", "k_seg")


def attention_args(node: fx.Node) -> Optional[dispatch.AttentionArgs]:
    """AttentionArgs of the node's fake values (None when a tensor input carries no fake value)."""
    b = bound(node)
    kw = {name: _value(b[name]) for name in _FIELDS}
    for name in ("q", "k", "v"):
        if not isinstance(kw[name], torch.Tensor):
            return None
    for name in ("bias", "kv_lens", "dropout_seed", "sinks", "q_pos", "q_seg", "k_seg"):
        if b[name] is not None and not isinstance(kw[name], torch.Tensor):
            return None
    if node.target is BACKWARD:
        kw["needs_backward"] = True
        kw["bias_requires_grad"] = bool(b["bias_requires_grad"]) and b["bias"] is not None
    else:
        kw["saved_for_backward"] = returns_lse(node)
    return dispatch.AttentionArgs(**kw)


_VIEWS = (torch.ops.aten.view.default, torch.ops.aten.reshape.default, torch.ops.aten.alias.default,
          torch.ops.aten.permute.default, torch.ops.aten.transpose.int)


def returns_lse(node: fx.Node) -> bool:
    """Whether the graph returns the forward node's lse (directly or as a view): a training graph's forward,
    which saves it for the backward. An inference graph never does (no user code reads the op's lse)."""
    lse = [u for u in node.users if u.target is operator.getitem and u.args[1] == 1]
    while lse:
        n = lse.pop()
        for u in n.users:
            if u.op == "output":
                return True
            if u.target in _VIEWS:
                lse.append(u)
    return False


def forced(node: fx.Node) -> Optional[str]:
    return bound(node)["force_kernel"]
