"""Graph edits made for the site finder's sake and undone where no rewrite used them.

Some spellings read as attention only after an edit that is exact but not free when nothing fuses it (a
broadcast `matmul` copies its shared operand). Such an edit records the nodes it made, the product among them
that a rewrite replaces, and how to rebuild the form it replaced; after the rewrites, `undo_unused` rebuilds
that form wherever the product is still read.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

import torch
import torch.fx as fx

from .aliasing import writes
from .canonicalize import SCORE_STEPS, arg, is_inplace, kind, tensor_of
from .emit import set_example_value
from .regions import Regions
from .shapes import known_eq

@dataclass
class Edit:
    made: list  # the nodes the edit inserted, in order; the last stands for the node it replaced
    product: fx.Node  # the product a rewrite takes (then unread, or erased)
    rebuild: Callable[[fx.Graph], list]  # inserts the replaced form at the graph's insertion point; its nodes
    inputs: list = field(default_factory=list)  # the nodes `rebuild` reads


def live(node: fx.Node) -> bool:
    """Some chain of readers of node reaches the graph's output or an op with an effect (a rewrite leaves the
    nodes it replaced unread, for the dead-code pass)."""
    seen, todo = set(), list(node.users)
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "output" or n.is_impure() or writes(n):
            return True
        todo.extend(n.users)
    return False


def undo_unused(gm: fx.GraphModule, edits: list[Edit]) -> bool:
    """Put back the replaced form of every edit whose product no rewrite took; True when any was."""
    graph = gm.graph
    undone = False
    for edit in reversed(edits):
        last = edit.made[-1]
        if getattr(edit.product, "_erased", False) or not live(edit.product):
            continue
        if any(getattr(n, "_erased", False) for n in edit.inputs):  # (another rewrite replaced them: keep the edit,
            continue  # which computes the same values)
        grad = bool(tensor_of(last) is not None and tensor_of(last).requires_grad)
        with graph.inserting_before(last), torch.set_grad_enabled(grad):
            new = edit.rebuild(graph)
            for n in new:
                set_example_value(n)
        last.replace_all_uses_with(new[-1])
        for n in reversed(edit.made):
            if not n.users:
                graph.erase_node(n)
        undone = True
    return undone


def commit(graph: fx.Graph, made: list, old: fx.Node, dead: tuple = ()) -> bool:
    """Give the new nodes example values and put the last in place of `old` when it computes a tensor of the
    same shape, dtype and grad requirement, then erase `old` and the nodes `dead` (in order: each unread once the
    ones before it are gone); otherwise remove the new nodes."""
    was = tensor_of(old)
    try:
        # under the grad mode `old` ran in (a no_grad region's result needs no grad whatever its inputs need)
        with torch.set_grad_enabled(bool(was is not None and was.requires_grad)):
            for n in made:
                set_example_value(n)
        new = tensor_of(made[-1])
        ok = (new is not None and was is not None and new.dim() == was.dim()
              and all(known_eq(p, q) for p, q in zip(new.shape, was.shape))
              and new.dtype == was.dtype and new.requires_grad == was.requires_grad)
    except Exception:
        ok = False
    if not ok:
        for n in reversed(made):
            graph.erase_node(n)
        return False
    old.replace_all_uses_with(made[-1])
    for n in (old, *dead):
        graph.erase_node(n)
    return True


class LazyRegions:
    """`Regions(gm)`, built on the first question: most graphs offer no candidate for these edits, and the walk
    over every node would run on every compile."""

    def __init__(self, gm: fx.GraphModule):
        self.gm, self._regions = gm, None

    def of(self, node: fx.Node):
        if self._regions is None:
            self._regions = Regions(self.gm)
        return self._regions.of(node)


def attempt(edit_fn: Callable, gm: fx.GraphModule, node: fx.Node, regions: LazyRegions) -> Optional[Edit]:
    """An edit, or None where a spelling this code did not foresee raises before the graph changed (the
    edits touch the graph only once `commit` has checked the new nodes)."""
    try:
        return edit_fn(gm, node, regions)
    except Exception:
        return None


def attempt_each(gm: fx.GraphModule, node_kinds: Union[str, tuple], edit_fn: Callable) -> list[Edit]:
    """`attempt` at every node of `node_kinds` (one kind or several) that an earlier edit did not remove; the edits
    made (`edit_fn` gives one Edit, a list of them, or None)."""
    kinds = (node_kinds,) if isinstance(node_kinds, str) else node_kinds
    regions = LazyRegions(gm)
    edits: list[Edit] = []
    for node in list(gm.graph.nodes):
        if getattr(node, "_erased", False) or kind(node) not in kinds:
            continue
        made = attempt(edit_fn, gm, node, regions)
        if isinstance(made, Edit):
            edits.append(made)
        elif made:
            edits += made
    return edits


def fold_each(gm: fx.GraphModule, node_kind: str, fold_fn: Callable) -> bool:
    """A lasting edit `fold_fn(gm, node, regions) -> bool` at every node of `node_kind` that an earlier edit did not
    remove; True when any was made. A spelling the edit did not foresee raises before the graph changed (edits touch
    it only once `commit` has checked the new nodes) and is left as written."""
    regions = LazyRegions(gm)
    changed = False
    for node in list(gm.graph.nodes):
        if getattr(node, "_erased", False) or kind(node) != node_kind:
            continue
        try:
            changed = fold_fn(gm, node, regions) or changed
        except Exception:
            continue
    return changed


def leads_to(node: fx.Node, is_product: Callable[[fx.Node], bool], depth: int = 12) -> bool:
    """node is a product (`is_product`) or reaches one through the operand of its own shape of score steps."""
    n = node
    for _ in range(depth):
        if is_product(n):
            return True
        if kind(n) not in SCORE_STEPS:
            return False
        nxt = [a for a in n.args if isinstance(a, fx.Node) and tensor_of(a) is not None
               and tensor_of(a).shape == tensor_of(n).shape]
        if not nxt:
            return False
        n = nxt[0]
    return False


def score_chain(x: fx.Node, is_product: Callable[[fx.Node], bool]) -> Optional[tuple[list, fx.Node]]:
    """(steps, product): the softmax input x back to a product through score steps (nearest the softmax first), each
    node read by the next alone, not written in place, the chain's operand of each step of x's shape; None where the
    chain is not that."""
    t = tensor_of(x)
    steps: list = []
    cur = x
    for _ in range(12):
        if len(cur.users) != 1 or is_inplace(cur):
            return None
        if is_product(cur):
            return steps, cur
        if kind(cur) not in SCORE_STEPS or not cur.args or cur.kwargs.get("out") is not None:
            return None
        chain = [a for a in cur.args if isinstance(a, fx.Node) and tensor_of(a) is not None
                 and tensor_of(a).shape == t.shape and leads_to(a, is_product)]
        if len(chain) != 1:
            return None
        steps.append(cur)
        cur = chain[0]
    return None


def rebuild_steps(graph: fx.Graph, steps: list, product: fx.Node, cur: fx.Node, operand: Callable[[Any], Any],
                  new: Callable) -> fx.Node:
    """The score steps rebuilt on `cur` (the new product) by `new(op, target, *args, **kwargs)`, each before its
    original (it reads its operands where eager did), every other operand mapped by `operand`; the last new step."""
    chain_nodes = {product}
    for step in reversed(steps):
        with graph.inserting_before(step):
            args = [cur if (isinstance(a, fx.Node) and a in chain_nodes) else operand(a) for a in step.args]
            kwargs = {key: operand(val) for key, val in step.kwargs.items()}
            cur = new(step.op, step.target, *args, **kwargs)
        chain_nodes.add(step)
    return cur


def swaps_last_two(node: Any) -> bool:
    """node is a (functional) transpose of its input's last two axes, a permute that only swaps those, or `.t()` of
    a 2-D tensor."""
    if isinstance(node, fx.Node) and node.op in ("call_method", "call_function") \
            and node.target in ("t", torch.t, torch.Tensor.t) and len(node.args) == 1 and not node.kwargs:
        t = tensor_of(node.args[0])
        return t is not None and t.dim() == 2
    if isinstance(node, fx.Node) and kind(node) == "permute" and node.args and not is_inplace(node):
        t = tensor_of(node.args[0])
        if len(node.args) > 2:  # x.permute(0, 2, 1)
            dims = node.args[1:]
        else:  # x.permute((0, 2, 1)), torch.permute(x, dims=...)
            dims = node.args[1] if len(node.args) == 2 else node.kwargs.get("dims")
        if t is None or t.dim() < 2 or not isinstance(dims, (list, tuple)) or len(dims) != t.dim() \
                or not all(isinstance(d, int) for d in dims):
            return False
        r = t.dim()
        return [d % r for d in dims] == [*range(r - 2), r - 1, r - 2]
    if not isinstance(node, fx.Node) or kind(node) != "transpose" or is_inplace(node) or not node.args:
        return False
    t = tensor_of(node.args[0])
    d0, d1 = arg(node, 1, "dim0"), arg(node, 2, "dim1")
    if t is None or t.dim() < 2 or not (isinstance(d0, int) and isinstance(d1, int)):
        return False
    return {d0 % t.dim(), d1 % t.dim()} == {t.dim() - 2, t.dim() - 1}
