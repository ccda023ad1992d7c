"""Terms added to a reshaped view of the scores, read as terms of the scores themselves.

VitDet adds its decomposed relative-position bias to a 5-D view of the scores and views the sum back:

    s = (q * scale) @ kᵀ                                              # [B·H, N, N]
    s = (s.view(B·H, qh, qw, kh, kw) + rel_h[..., None] + rel_w[..., None, :]).view(B·H, N, N)

An elementwise sum commutes with a reshape that keeps the element order: element i of the result is
x[i] + t1[i] + t2[i] in either shape, where tj is the term broadcast to the view's shape and read in
row-major order. So the same graph is

    s = s + rel_h[..., None].expand(B·H, qh, qw, kh, kw).reshape(B·H, N, N) + ...

with the additions in the same order (the same rounding) and the same dtype promotion, and the scores are
then an ordinary Q·Kᵀ plus terms for the site finder. The edit is made only where it is exact:
- x is viewed to a shape of as many elements, every step is an add or a subtraction of x's chain and one
  other term (a tensor or a number) that keeps that shape, and the last step is viewed back to x's shape;
- each step is read by the next one only (no one else sees the intermediate views);
- every shape is static (the expand and reshape need plain sizes), and the whole chain runs in the same
  grad mode / autocast state as x;
- x is a product (scaled by numbers or not) and the result reaches a softmax through elementwise steps:
  attention scores, where the site finder needs the edit, and nowhere else in a model.
"""
from __future__ import annotations

import math
from typing import Any, Optional

import torch
import torch.fx as fx

from .canonicalize import SCORE_STEPS, is_inplace, kind, reaches_softmax, tensor_of
from .emit import example_values_or_undo
from .layout import contraction
from .regions import Regions

_STEPS = ("add", "sub")


def _static(shape: Any) -> Optional[list]:
    return list(shape) if all(type(d) is int for d in shape) else None


def _chain(out: fx.Node) -> Optional[tuple[fx.Node, list]]:
    """(x, [(step node, index of the chain's argument in its args)] innermost first) for
    `out = (x.view(S) ± t1 ± t2 ...).view(x.shape)`, or None."""
    t_out = tensor_of(out)
    if t_out is None or not out.args or not isinstance(out.args[0], fx.Node):
        return None
    shape_out = _static(t_out.shape)
    cur = out.args[0]
    t_mid = tensor_of(cur)
    if shape_out is None or t_mid is None or _static(t_mid.shape) is None:
        return None
    shape_mid = list(t_mid.shape)
    steps: list = []
    while kind(cur) in _STEPS and not is_inplace(cur) and not cur.kwargs and len(cur.args) == 2:
        if len(cur.users) != 1:
            return None
        links = [i for i, a in enumerate(cur.args)
                 if isinstance(a, fx.Node) and tensor_of(a) is not None and list(tensor_of(a).shape) == shape_mid]
        if len(links) != 1:  # both operands of the view's shape: which is the chain cannot be told
            return None
        other = cur.args[1 - links[0]]
        if isinstance(other, fx.Node) and tensor_of(other) is None:
            return None
        if not isinstance(other, (fx.Node, int, float)) or isinstance(other, bool):
            return None
        if list(tensor_of(cur).shape) != shape_mid:
            return None
        steps.append((cur, links[0]))
        cur = cur.args[links[0]]
    if not steps or kind(cur) != "reshape" or len(cur.users) != 1 or is_inplace(cur):
        return None
    x = cur.args[0] if cur.args else None
    t_x = tensor_of(x) if isinstance(x, fx.Node) else None
    if t_x is None or _static(t_x.shape) != shape_out or math.prod(shape_mid) != math.prod(shape_out):
        return None
    return x, list(reversed(steps))


def _scores_like(x: fx.Node, out: fx.Node, depth: int = 8) -> bool:
    """x is a product (Q·Kᵀ, possibly scaled by numbers) and `out` reaches a softmax through single-reader
    elementwise steps: the edit is made for attention scores only, not for every reshaped sum of a model (it
    materializes the broadcast terms at the scores' size)."""
    n = x
    for _ in range(depth):
        if contraction(n) is not None or kind(n) == "einsum":
            break
        if kind(n) not in ("mul", "div") or not n.args or not isinstance(n.args[0], fx.Node) or \
                any(isinstance(a, fx.Node) for a in n.args[1:]):
            return False
        n = n.args[0]
    else:
        return False
    return reaches_softmax(out, SCORE_STEPS, forward=True, depth=depth)


def fold_reshaped_terms(gm: fx.GraphModule) -> bool:
    """Apply the edit of the module docstring wherever it is exact; True when any was made."""
    graph = gm.graph
    regions: Optional[Regions] = None
    changed = False
    for out in list(graph.nodes):
        if kind(out) != "reshape" or is_inplace(out):
            continue
        found = _chain(out)
        if found is None:
            continue
        x, steps = found
        if not _scores_like(x, out):
            continue
        regions = regions or Regions(gm)
        if any(regions.of(n) != regions.of(x) for n, _ in steps) or regions.of(out) != regions.of(x):
            continue
        shape_mid = list(tensor_of(steps[0][0]).shape)
        shape_out = list(tensor_of(out).shape)
        made: list = []
        cur = x
        with graph.inserting_before(out):
            for step, link in steps:
                other = step.args[1 - link]
                if isinstance(other, fx.Node):
                    wide = graph.call_method("expand", (other, *shape_mid))
                    other = graph.call_method("reshape", (wide, *shape_out))
                    made += [wide, other]
                args = [None, None]
                args[link], args[1 - link] = cur, other
                cur = graph.create_node(step.op, step.target, tuple(args), {})
                made.append(cur)
        if not example_values_or_undo(graph, made):
            continue
        old, new = tensor_of(out), tensor_of(cur)
        if new is None or old is None or list(new.shape) != list(old.shape) or new.dtype != old.dtype or \
                new.requires_grad != old.requires_grad:
            for n in reversed(made):
                graph.erase_node(n)
            continue
        out.replace_all_uses_with(cur)
        for n in [out] + [s for s, _ in reversed(steps)]:
            graph.erase_node(n)
        changed = True
    return changed
