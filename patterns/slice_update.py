"""Terms added to a slice of the scores and written back, read as zero-padded terms of the scores.

MViTv2 adds its relative-position bias to the spatial block of the scores only (the class token's row and
column keep theirs), by writing the sum back into that slice:

    s = (q * scale) @ kᵀ                                                  # [B, H, 1 + N, 1 + N]
    s[:, :, 1:, 1:] += rel_pos                                             # torchvision
    s[:, :, 1:, 1:] = (s[:, :, 1:, 1:].view(B, H, t, h, w, t, h, w)        # timm
                       + rel_h[..., None] + rel_w[..., None, :]).view(B, H, N, N)

Element (i, j) of the updated scores is s + t1 + t2 (in that order) inside the slice and s outside it, which
is exactly s + pad(t1) + pad(t2) where pad(t) is the term, broadcast to the slice (read in row-major order
through the view, as reshaped_terms.py does) and zero-padded to the scores' shape: x + 0 is x for every x,
-0 and NaN aside (-0 + 0 is +0, which no softmax tells apart). The scores are then an ordinary Q·Kᵀ plus a
float bias for the site finder. The edit is made only where it is exact:
- the scores are a fresh tensor (functionalize.py's `owns_storage`) that nothing reads between the slice
  read and the write back but the chain, and that after it reaches a softmax through elementwise steps;
- the index is basic slices (step 1, static bounds) and the same in the read and the write;
- every step is an add (either side) or a subtraction of a term from the chain, read by the next step only,
  in place or not; each term is a tensor of the scores' dtype that broadcasts to the step's shape, so no
  step promotes (the write back would cast the sum to the scores' dtype) and the in-place form is the
  functional one;
- a view of the slice is viewed back to the slice's shape; every shape is static; the whole chain runs in
  the grad mode / autocast state of the scores.
"""
from __future__ import annotations

import operator
from typing import Any, Optional

import torch
import torch.fx as fx
import torch.nn.functional as F

from .canonicalize import SCORE_STEPS, is_inplace, kind, reaches_softmax, reads_only_metadata, tensor_of
from .emit import example_values_or_undo
from .functionalize import owns_storage
from .regions import Regions

_SUB_TARGETS = (operator.sub, operator.isub, torch.sub, torch.Tensor.sub, torch.Tensor.sub_)


def _bounds(idx: Any, shape: list) -> Optional[list[tuple[int, int]]]:
    """[(start, stop)] per dim of `shape` for an index of basic slices (step 1), or None."""
    parts = list(idx) if isinstance(idx, tuple) else [idx]
    if len(parts) > len(shape) or not all(isinstance(p, slice) for p in parts):
        return None
    out = []
    for d, n in enumerate(shape):
        p = parts[d] if d < len(parts) else slice(None)
        if not all(b is None or (type(b) is int) for b in (p.start, p.stop, p.step)):
            return None
        lo, hi, step = p.indices(n)
        if step != 1 or hi <= lo:
            return None
        out.append((lo, hi))
    return out


def _static(shape: Any) -> Optional[list]:
    return list(shape) if all(type(d) is int for d in shape) else None


def _is_sub(node: fx.Node) -> bool:
    return node.target in _SUB_TARGETS or (node.op == "call_method" and node.target in ("sub", "sub_", "__sub__"))


def _only_user(node: fx.Node) -> Optional[fx.Node]:
    return next(iter(node.users)) if len(node.users) == 1 else None


def _chain(read: fx.Node, write: fx.Node, dtype: torch.dtype) -> Optional[tuple[Optional[list], list, list]]:
    """(the view's shape or None, [(step, term)], every node after `read` up to the value written) for
    `write`'s value computed from the slice `read` by `[view] ± t1 ± t2 ... [view back]`, each node read by the
    next only; None when it is not that."""
    shape_slice = _static(tensor_of(read).shape)
    cur, mid = read, None
    nxt = _only_user(cur)
    if nxt is not None and kind(nxt) == "reshape" and not is_inplace(nxt) and nxt is not write:
        t_mid = tensor_of(nxt)
        if t_mid is None or _static(t_mid.shape) is None:
            return None
        cur, mid = nxt, list(t_mid.shape)
    nodes = [cur] if mid is not None else []
    shape_now = mid if mid is not None else shape_slice
    steps: list = []
    while True:
        nxt = _only_user(cur)
        if nxt is None or nxt is write or kind(nxt) not in ("add", "sub") or nxt.kwargs or len(nxt.args) != 2:
            break
        link = [i for i, a in enumerate(nxt.args) if a is cur]
        if len(link) != 1 or (_is_sub(nxt) and link[0] != 0):
            return None  # `t - s`: the slice's sign flips, which zero padding does not keep outside it
        if is_inplace(nxt) and link[0] != 0:
            return None  # `t += s[...]` writes the term, which the edit would drop
        term = nxt.args[1 - link[0]]
        t_term, t_step = tensor_of(term) if isinstance(term, fx.Node) else None, tensor_of(nxt)
        if t_term is None or t_step is None or t_term.dtype != dtype or t_step.dtype != dtype or \
                list(t_step.shape) != shape_now:
            return None
        steps.append((nxt, term))
        nodes.append(nxt)
        cur = nxt
    if mid is not None:
        back = _only_user(cur)
        if back is None or kind(back) != "reshape" or is_inplace(back) or \
                _static(tensor_of(back).shape) != shape_slice:
            return None
        cur = back
        nodes.append(back)
    if not steps or cur is not write.args[2] or len(cur.users) != 1:
        return None
    return mid, steps, nodes


def fold_slice_updates(gm: fx.GraphModule) -> bool:
    """Apply the edit of the module docstring wherever it is exact; True when any was made."""
    graph = gm.graph
    writes = [n for n in graph.nodes if n.op == "call_function" and n.target is operator.setitem and
              len(n.args) == 3 and not n.kwargs]
    if not writes:  # (most graphs: no walk over positions and regions)
        return False
    pos = {n: i for i, n in enumerate(graph.nodes)}
    regions: Optional[Regions] = None
    changed = False
    for write in writes:
        x, idx, _ = write.args
        t_x = tensor_of(x) if isinstance(x, fx.Node) else None
        shape = _static(t_x.shape) if t_x is not None else None
        if shape is None or not owns_storage(x):
            continue
        bounds = _bounds(idx, shape)
        reads = [u for u in x.users if kind(u) == "getitem" and len(u.args) == 2 and u.args[1] == idx and
                 pos[u] < pos[write]]
        if bounds is None or len(reads) != 1:
            continue
        read = reads[0]
        before = [u for u in x.users if pos[u] < pos[write] and u is not read and not reads_only_metadata(u, x)]
        later = [u for u in x.users if pos[u] > pos[write]]
        if before or len(later) != 1 or kind(later[0]) not in SCORE_STEPS + ("softmax",) or is_inplace(later[0]):
            continue
        if kind(later[0]) != "softmax" and not reaches_softmax(later[0], SCORE_STEPS, forward=True):
            continue
        found = _chain(read, write, t_x.dtype)
        if found is None:
            continue
        mid, steps, nodes = found
        regions = regions or Regions(gm)
        if any(regions.of(n) != regions.of(x) for n in [read, *nodes, write]):
            continue
        shape_slice = list(tensor_of(read).shape)
        pads: list[int] = []
        for (lo, hi), n in reversed(list(zip(bounds, shape))):
            pads += [lo, n - hi]
        made: list = []
        cur = x
        with graph.inserting_before(write):
            for step, term in steps:
                if mid is not None:
                    wide = graph.call_method("expand", (term, *mid))
                    full = graph.call_method("reshape", (wide, *shape_slice))
                    made += [wide, full]
                else:
                    full = graph.call_method("expand", (term, *shape_slice))
                    made.append(full)
                padded = graph.call_function(F.pad, (full, pads))
                cur = graph.call_function(operator.sub if _is_sub(step) else operator.add, (cur, padded))
                made += [padded, cur]
        if not example_values_or_undo(graph, made):
            continue
        new = tensor_of(cur)
        if new is None or list(new.shape) != shape or new.dtype != t_x.dtype or \
                new.requires_grad != (t_x.requires_grad or any(tensor_of(t).requires_grad for _, t in steps)):
            for n in reversed(made):
                graph.erase_node(n)
            continue
        later[0].replace_input_with(x, cur)
        graph.erase_node(write)
        for n in reversed(nodes):
            graph.erase_node(n)
        graph.erase_node(read)
        changed = True
        pos = {n: i for i, n in enumerate(graph.nodes)}
    return changed

