"""Emit one `torch.ops.fa3.attention` call into an FX graph, with its FakeTensor metadata.

Every recognizer ends here, so the op's calling convention lives in one place. The op is looked up
by name: `patterns/` never imports the front door that registers it (the front door imports this
package and registers the op before any pass runs).
"""
from __future__ import annotations

import operator
from typing import Any, Optional, Union

import torch
import torch.fx as fx

DROPOUT_SEED_HIGH = 2**31 - 1


def fa3_attention_op():
    return torch.ops.fa3.attention.default


def example_value(node: Any) -> Any:
    """The FakeTensor (or SymInt, or Python value) a Dynamo node produces; plain values pass through."""
    if isinstance(node, fx.Node):
        return node.meta.get("example_value", node.meta.get("val"))
    return node


def _fake_mode(values: list):
    from torch._guards import detect_fake_mode
    from torch._subclasses.fake_tensor import FakeTensor

    # The values' own mode first: on torch 2.13 the backend's graph carries example values of a fresh
    # fake mode while TracingContext still holds Dynamo's, and detect_fake_mode prefers the latter.
    for v in values:
        if isinstance(v, FakeTensor):
            return v.fake_mode
    return detect_fake_mode([v for v in values if isinstance(v, torch.Tensor)])


def set_example_value(node: fx.Node) -> None:
    """Run the node's target on its inputs' example values under their fake mode (no-op without one)."""
    args = fx.node.map_arg(node.args, example_value)
    kwargs = fx.node.map_arg(node.kwargs, example_value)
    flat = [a for a in torch.utils._pytree.tree_leaves((args, kwargs))]
    mode = _fake_mode(flat)
    if mode is None:
        return
    with mode:
        if node.op == "call_function":
            val = node.target(*args, **kwargs)
        elif node.op == "call_method":
            val = getattr(args[0], node.target)(*args[1:], **kwargs)
        else:
            return
    node.meta["example_value"] = val


def call(graph: fx.Graph, target: Any, *args: Any, method: bool = False, **kwargs: Any) -> fx.Node:
    """Insert a call (at the graph's current insertion point) and give it an example value."""
    node = graph.call_method(target, args, kwargs) if method else graph.call_function(target, args, kwargs)
    set_example_value(node)
    return node


# The MaskSpec.empty_rows values emit_attention reproduces exactly (everything but "unknown").
EMPTY_ROWS_KEPT = ("impossible", "zero", "nan", "mean_v", "mean_v_add")


def emit_attention(
    graph: fx.Graph,
    q: fx.Node,
    k: fx.Node,
    v: fx.Node,
    *,
    scale: Union[float, fx.Node],
    causal: bool = False,
    diag_offset: Union[int, fx.Node] = 0,
    window_left: int = -1,
    window_right: int = -1,
    bias: Optional[fx.Node] = None,
    kv_lens: Optional[fx.Node] = None,
    softcap: float = 0.0,
    dropout_p: float = 0.0,
    kernel: Optional[str] = None,
    empty_rows: str = "impossible",
) -> tuple[fx.Node, fx.Node]:
    """Insert fa3.attention on q [B, Hq, Nq, D], k/v [B, Hkv, Nk, D]; return (out node, op call node).

    empty_rows (see MaskSpec) keeps eager's value on rows where every key is masked, which the op
    itself returns as 0 with lse = -inf: "nan", "mean_v" and "mean_v_add" add an exact fix-up on those
    rows, "impossible" and "zero" add nothing; "unknown" is refused (the caller must not rewrite).
    "mean_v_add" also keeps eager's gradient of q and k on those rows (see `_uniform_row_grad`); it
    cannot with a softcap (tanh' of every score of the row), so the caller refuses that when q or k
    needs a gradient.

    Call inside `graph.inserting_before(...)` at a point where q, k, v, bias, kv_lens are defined.
    A scale held in a tensor node (learned temperature, 0-d tensor) is folded into q so the op's
    scale stays a Python float.
    """
    if isinstance(scale, fx.Node):
        q = call(graph, torch.mul, q, scale)
        scale = 1.0
    seed = None
    if dropout_p > 0:
        dev = example_value(q).device
        seed = graph.call_function(torch.randint, (0, DROPOUT_SEED_HIGH, ()), dict(dtype=torch.int64, device=dev))
        mode = _fake_mode([example_value(q)])  # randint has no tensor input to take the fake mode from
        if mode is not None:
            with mode:
                seed.meta["example_value"] = torch.randint(0, DROPOUT_SEED_HIGH, (), dtype=torch.int64, device=dev)
    node = call(
        graph, fa3_attention_op(), q, k, v, float(scale), bool(causal), diag_offset, int(window_left),
        int(window_right), bias, kv_lens, float(softcap), float(dropout_p), seed, kernel,
    )
    out = call(graph, operator.getitem, node, 0)
    if empty_rows in ("impossible", "zero"):
        return out, node
    if empty_rows not in EMPTY_ROWS_KEPT:
        raise ValueError(f"empty_rows: cannot keep eager's value on fully masked rows for {empty_rows!r}")
    lse = call(graph, operator.getitem, node, 1)
    empty = call(graph, torch.unsqueeze, call(graph, torch.isneginf, lse), -1)
    if empty_rows == "nan":
        fill = call(graph, torch.full_like, out, float("nan"))
    else:
        # eager's softmax over a row of equal scores: the uniform average of V over all keys.
        hq, hkv = example_value(q).shape[1], example_value(v).shape[1]
        fill = call(graph, torch.mean, v, dim=2, keepdim=True)
        if hq != hkv:
            fill = call(graph, torch.repeat_interleave, fill, hq // hkv, dim=1)
        if empty_rows == "mean_v_add" and needs_qk_grad(q, k):
            if softcap:
                raise ValueError("empty_rows: 'mean_v_add' cannot keep eager's gradient through a softcap")
            fill = call(graph, torch.add, fill, _uniform_row_grad(graph, q, k, v, float(scale)))
        fill = call(graph, "to", fill, example_value(out).dtype, method=True)
    return call(graph, torch.where, empty, fill, out), node


def needs_qk_grad(q: Any, k: Any) -> bool:
    """Whether q or k (nodes or example values) require a gradient in the traced graph."""
    return any(isinstance(t, torch.Tensor) and t.requires_grad for t in (example_value(q), example_value(k)))


def _uniform_row_grad(graph: fx.Graph, q: fx.Node, k: fx.Node, v: fx.Node, scale: float) -> fx.Node:
    """A zero [B, Hq, Nq, Dv] whose gradient is what eager gives q and k from a fully masked row whose
    scores all absorbed one additive mask value (s + finfo.min == finfo.min): the forward is uniform
    but the addition passes the gradient, so eager's backward is softmax's at P = 1/Nk:
    ds_j = (dO . v_j - dO . mean(v)) / Nk. fa3::uniform_row_grad computes it (in fp32) in its backward
    from q, k, v alone, which fa3::attention saves anyway: spelled out in the graph, the partitioner
    kept its fp32 intermediates (q and k sized) alive per layer for backward."""
    return call(graph, torch.ops.fa3.uniform_row_grad.default, q, k, v, float(scale))
