"""Scores of key blocks concatenated for one softmax, read as one attention over the concatenated keys.

PEGASUS-X's local attention lets each block of queries attend to the global tokens and to its own block, by
scoring the two key sets apart, normalising them together and applying the two slices of the probabilities to
their values apart:

    s = torch.cat([einsum("BHNKF,BHGF->BHNKG", q, k_glob), einsum("BHNKF,BHNXF->BHNKX", q, k_loc)], -1)
    p = softmax(s + mask, -1)
    o = einsum("BHNKG,BHGF->BHNKF", p[..., :G], v_glob) + einsum("BHNKX,BHNXF->BHNKF", p[..., G:], v_loc)

Each score is the dot product of a query row and a key row, wherever the key comes from; each output element
is the sum over all keys of probability times value, split in two sums. So with the key blocks laid out alike
(every batch letter of the queries', a block that lacks one broadcast over it) and concatenated,

    s = einsum("BHNKF,BHNYF->BHNKY", q, cat([k_glob broadcast over N, k_loc], -2))
    o = einsum("BHNKY,BHNYF->BHNKF", p, cat([v_glob broadcast over N, v_loc], -2))

(of several query letters that no block has, the one nearest the key axis stays the query rows and the others are
batch letters too) computes the same dot products and the same sum in another order: a result differs by
rounding at most. The
site finder then reads one attention. The edits are made only where that holds:
- two-operand einsums without "...", each letter once per operand; every score block has the same query operand
  and the same output letters up to its key letter, which is last; one contracted letter; no letter summed over
  one operand only; the blocks' batch sizes equal the queries' (a block only lacks a letter, never has size 1);
- the concatenation is over the last dim, and the scores reach a softmax over it through single-reader
  elementwise steps; the probabilities (through dropout / casts) are read only by one slice of the last dim per
  block, at its offset, each read by one einsum with the block's values (the key letter the one contracted,
  one value letter), whose results are summed and read nowhere else;
- every node in the same grad mode / autocast state, one dtype throughout.
The edits are tentative (tentative.py): where no rewrite takes the site, the blocks are put back as written.
"""
from __future__ import annotations

import operator
import string
from typing import Any, Optional

import torch
import torch.fx as fx

from .canonicalize import PROB_STEPS, SCORE_STEPS, arg, first_input, is_inplace, kind, tensor_of
from .aliasing import writes
from .emit import set_example_value
from .shapes import known_eq
from .tentative import Edit, LazyRegions, attempt_each, commit

_CATS = tuple(f for f in (torch.cat, getattr(torch, "concat", None), getattr(torch, "concatenate", None)) if f)
_ADDS = (operator.add, torch.add, torch.Tensor.add)


def _einsum(node: Any) -> Optional[tuple[list[str], str, list[fx.Node]]]:
    """([letters of each operand], output letters, operands) of a plain two-operand einsum, or None."""
    if not isinstance(node, fx.Node) or kind(node) != "einsum" or node.kwargs or is_inplace(node):
        return None
    args = list(node.args)
    if not args or not isinstance(args[0], str):
        return None
    ops = args[1:]
    if len(ops) == 1 and isinstance(ops[0], (list, tuple)):
        ops = list(ops[0])
    eq = args[0].replace(" ", "")
    if len(ops) != 2 or "->" not in eq or "." in eq or not all(isinstance(o, fx.Node) for o in ops):
        return None
    lhs, out = eq.split("->")
    parts = lhs.split(",")
    if len(parts) != 2 or any(len(set(p)) != len(p) for p in parts + [out]):
        return None
    if any(tensor_of(o) is None or tensor_of(o).dim() != len(p) for o, p in zip(ops, parts)):
        return None
    return parts, out, list(ops)


def _is_cat(node: Any) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in _CATS and not is_inplace(node)


def _cat_before(node: fx.Node, depth: int = 8) -> Optional[fx.Node]:
    """The concatenation the scores `node` come from through single-reader elementwise steps, or None."""
    if _is_cat(node):
        return node
    if depth == 0 or kind(node) not in SCORE_STEPS or is_inplace(node) or len(node.users) != 1:
        return None
    t = tensor_of(node)
    found = [c for a in node.args if isinstance(a, fx.Node) and tensor_of(a) is not None and t is not None
             and list(tensor_of(a).shape) == list(t.shape) for c in [_cat_before(a, depth - 1)] if c is not None]
    return found[0] if len(found) == 1 else None


def _sizes(node: fx.Node, letters: str) -> dict:
    return dict(zip(letters, tensor_of(node).shape))


def _laid_out(graph: fx.Graph, node: fx.Node, letters: str, batch: list, tail: str, sizes: dict,
              made: list) -> fx.Node:
    """`node` (its dims named by `letters`) as [batch..., *tail], a batch letter it lacks broadcast."""
    have = [c for c in batch if c in letters] + list(tail)
    perm = [letters.index(c) for c in have]
    cur = node
    if perm != list(range(len(perm))):
        cur = graph.call_method("permute", (node, *perm))
        made.append(cur)
    lacks = [j for j, c in enumerate(batch) if c not in letters]
    for j in lacks:
        cur = graph.call_method("unsqueeze", (cur, j))
        made.append(cur)
    if lacks:
        cur = graph.call_method("expand", (cur, *[sizes[c] for c in batch], -1, -1))
        made.append(cur)
    return cur


def _score_blocks(cat: fx.Node) -> Optional[dict]:
    """The score blocks of `cat` read as described in the module docstring, or None."""
    blocks = cat.args[0] if cat.args else cat.kwargs.get("tensors")
    dim = arg(cat, 1, "dim", 0)
    t_cat = tensor_of(cat)
    if not isinstance(blocks, (list, tuple)) or len(blocks) < 2 or t_cat is None or not isinstance(dim, int) or \
            dim % t_cat.dim() != t_cat.dim() - 1:
        return None
    parsed = [_einsum(b) for b in blocks]
    if any(p is None for p in parsed) or any(len(b.users) != 1 for b in blocks):
        return None
    commons = [i for i in (0, 1) if all(p[2][i] is parsed[0][2][i] for p in parsed)]
    if len(commons) != 1:
        return None
    qi = commons[0]
    q, x = parsed[0][2][qi], parsed[0][0][qi]
    keys, pattern, c_letter = [], None, None
    for (letters, z, ops), block in zip(parsed, blocks):
        if letters[qi] != x:
            return None
        y, k = letters[1 - qi], ops[1 - qi]
        c, n = (set(x) & set(y)) - set(z), (set(y) & set(z)) - set(x)
        if len(c) != 1 or len(n) != 1:
            return None
        (c,), (n,) = c, n
        if z[-1] != n or not set(x) - {c} <= set(z) or not set(z) <= set(x) | {n} or \
                not set(y) - {c, n} <= set(x) & set(z):
            return None
        qs, ks = _sizes(q, x), _sizes(k, y)
        if any(not known_eq(ks[ch], qs[ch]) for ch in y if ch != n) or type(ks[n]) is not int:
            return None  # the same batch and feature sizes (nothing broadcasts); static block lengths
        zp = z.replace(n, "#")
        if pattern not in (None, zp) or c_letter not in (None, c) or tensor_of(k).dtype != tensor_of(q).dtype:
            return None
        pattern, c_letter = zp, c
        keys.append((k, y, n, ks[n]))
    # one query row letter (the one nearest the key axis among those no block has); every other letter of the
    # scores is a batch letter of the concatenated keys, broadcast where a block lacks it
    rows = [ch for ch in pattern if ch != "#" and not any(ch in y for _, y, _, _ in keys)]
    if not rows:
        return None
    kb = [ch for ch in pattern if ch not in ("#", rows[-1])]
    return dict(q=q, x=x, keys=keys, pattern=pattern, c=c_letter, kb=kb, qi=qi, blocks=list(blocks))


def _probs_after(softmax: fx.Node) -> fx.Node:
    p = softmax
    for _ in range(4):
        if len(p.users) != 1:
            return p
        u = next(iter(p.users))
        if kind(u) not in PROB_STEPS or is_inplace(u) or first_input(u) is not p:
            return p
        p = u
    return p


def _last_slice(node: fx.Node, rank: int, total: int) -> Optional[tuple[int, int]]:
    """(lo, hi) for `p[:, :, lo:hi]` or `p[..., lo:hi]` (every other dim whole), or None."""
    if kind(node) != "getitem" or len(node.args) != 2 or is_inplace(node):
        return None
    idx = node.args[1]
    parts = list(idx) if isinstance(idx, tuple) else [idx]
    if parts.count(Ellipsis) == 1:
        at = parts.index(Ellipsis)
        parts[at:at + 1] = [slice(None)] * (rank - len(parts) + 1)
    if len(parts) != rank or not all(isinstance(s, slice) for s in parts):
        return None
    if any((s.start, s.stop, s.step) != (None, None, None) for s in parts[:-1]):
        return None
    s = parts[-1]
    if not all(b is None or type(b) is int for b in (s.start, s.stop, s.step)):
        return None
    lo, hi, step = s.indices(total)
    return (lo, hi) if step == 1 and hi > lo else None


def _sum_tree(node: fx.Node, leaves: list, top: bool) -> Optional[tuple[Any, list]]:
    """(the add tree over `leaves` as nested pairs of leaf indices, its add nodes top first) when `node` sums each
    leaf once and every add below the top is read by its parent only; or None."""
    if node in leaves:
        return leaves.index(node), []
    if not (node.op == "call_function" and node.target in _ADDS or node.op == "call_method" and
            node.target in ("add", "__add__")) or node.kwargs or len(node.args) != 2:
        return None
    if not top and len(node.users) != 1:
        return None
    parts = [_sum_tree(a, leaves, False) if isinstance(a, fx.Node) else None for a in node.args]
    if parts[0] is None or parts[1] is None:
        return None
    return (parts[0][0], parts[1][0]), [node] + parts[0][1] + parts[1][1]


def _tree_leaves(tree: Any) -> list:
    return [tree] if isinstance(tree, int) else _tree_leaves(tree[0]) + _tree_leaves(tree[1])


def _value_blocks(p: fx.Node, info: dict) -> Optional[tuple[fx.Node, list, str, Any, list]]:
    """(the sum replaced, [(V, letters with the block's letters renamed to the scores', slice, product)] per block,
    output letters renamed alike, the sum as a tree of block indices, its add nodes), or None."""
    t_p = tensor_of(p)
    rank, total = t_p.dim(), t_p.shape[-1]
    if type(total) is not int:
        return None
    offsets, at = [], 0
    for _, _, _, size in info["keys"]:
        offsets.append((at, at + size))
        at += size
    if at != total or len(p.users) != len(offsets):
        return None
    by_slice = {}
    for u in p.users:
        lohi = _last_slice(u, rank, total)
        if lohi is None or lohi in by_slice or lohi not in offsets or len(u.users) != 1:
            return None
        by_slice[lohi] = u
    pattern = info["pattern"]
    values, outs, products = [], set(), []
    for lohi in offsets:
        sl = by_slice[lohi]
        pv = next(iter(sl.users))
        parsed = _einsum(pv)
        if parsed is None or len(pv.users) != 1 or sum(o is sl for o in parsed[2]) != 1:
            return None
        letters, o, ops = parsed
        pi = ops.index(sl)
        pl, vl, v = letters[pi], letters[1 - pi], ops[1 - pi]
        kp = pl[-1]
        f = (set(vl) & set(o)) - set(pl)
        if len(pl) != len(pattern) or (set(pl) & set(vl)) - set(o) != {kp} or len(f) != 1 or \
                not set(vl) - {kp} - f <= set(pl) & set(o) or not set(pl) - {kp} <= set(o) or \
                not set(o) <= set(pl) | f:
            return None
        rename = dict(zip(pl, pattern))
        rename[next(iter(f))] = "@"
        vr, orr = "".join(rename[ch] for ch in vl), "".join(rename[ch] for ch in o)
        if not set(vr) - {"#", "@"} <= set(info["kb"]):
            return None
        ps, vs = _sizes(sl, pl), _sizes(v, vl)
        if any(not known_eq(vs[ch], ps[ch]) for ch in vl if ch in pl) or tensor_of(v).dtype != t_p.dtype:
            return None
        values.append((v, vr, sl, pv))
        outs.add(orr)
        products.append(pv)
    if len(outs) != 1:
        return None
    top = next(iter(products[0].users))
    for _ in range(len(products)):
        found = _sum_tree(top, products, True)
        if found is not None and sorted(_tree_leaves(found[0])) == list(range(len(products))):
            return top, values, next(iter(outs)), found[0], found[1]
        if len(top.users) != 1:
            return None
        top = next(iter(top.users))
    return None


def _written_between(graph: fx.Graph, firsts: list, last: fx.Node) -> bool:
    """Whether a node from the earliest of `firsts` up to `last` writes into a tensor (aliasing.writes)."""
    first = set(firsts)
    seen = False
    for n in graph.nodes:
        seen = seen or n in first
        if n is last:
            return False
        if seen and writes(n):
            return True
    return False


def _fresh(used: str, n: int) -> list[str]:
    return [c for c in string.ascii_letters if c not in used][:n]


def _concat_keys(gm: fx.GraphModule, softmax: fx.Node, regions: LazyRegions) -> Optional[list[Edit]]:
    graph = gm.graph
    dim = arg(softmax, 1, "dim")
    t_s = tensor_of(softmax)
    if t_s is None or not isinstance(dim, int) or dim % t_s.dim() != t_s.dim() - 1 or \
            not isinstance(softmax.args[0], fx.Node):
        return None
    cat = _cat_before(softmax.args[0])
    info = _score_blocks(cat) if cat is not None and len(cat.users) == 1 else None
    if info is None:
        return None
    p = _probs_after(softmax)
    found = _value_blocks(p, info)
    if found is None:
        return None
    top, values, out_letters, tree, adds = found
    nodes = [cat, *info["blocks"], softmax, p, top] + [n for v in values for n in v[2:]]
    if len({regions.of(n) for n in nodes}) != 1:
        return None
    # The new products stand at the concatenation and at the sum (and so would the blocks put back): their reads
    # of q, the keys, the probabilities and the values move there, past any write in between.
    if _written_between(graph, info["blocks"], cat) or _written_between(graph, [v[2] for v in values], top):
        return None
    kb, c, x, pattern = info["kb"], info["c"], info["x"], info["pattern"]
    N, F = _fresh(x + pattern + out_letters, 2)
    qsizes = _sizes(info["q"], x)
    # scores: one einsum against the concatenated keys, in the concatenation's place
    made: list = []
    with graph.inserting_before(cat):
        laid = [_laid_out(graph, k, y.replace(n, N), kb, N + c, qsizes, made) for k, y, n, _ in info["keys"]]
        k_cat = graph.call_function(torch.cat, (laid, len(kb)))
        ops = [info["q"], k_cat] if info["qi"] == 0 else [k_cat, info["q"]]
        sides = [x, "".join(kb) + N + c] if info["qi"] == 0 else ["".join(kb) + N + c, x]
        scores = graph.call_function(torch.einsum, (f"{sides[0]},{sides[1]}->{pattern.replace('#', N)}", *ops))
        made += [k_cat, scores]
    blocks = info["blocks"]
    old_eqs = [(b.args, dict(b.kwargs)) for b in blocks]
    cat_args, cat_kwargs = cat.args, dict(cat.kwargs)
    if not commit(graph, made, cat, dead=tuple(blocks)):
        return None

    def rebuild_scores(graph: fx.Graph) -> list:  # the blocks' einsums and their concatenation, as written
        new = [graph.call_function(torch.einsum, a, k) for a, k in old_eqs]
        for n in new:
            set_example_value(n)
        return new + [graph.call_function(cat.target, (new, *cat_args[1:]), cat_kwargs)]

    edits = [Edit(made, scores, rebuild_scores, inputs=[info["q"]] + [k for k, _, _, _ in info["keys"]])]
    # values: one einsum of all the probabilities with the concatenated values, in the sum's place
    psizes = dict(zip(pattern.replace("#", N), tensor_of(p).shape))
    made2: list = []
    with graph.inserting_before(top):
        laid = [_laid_out(graph, v, vr.replace("#", N).replace("@", F), kb, N + F, psizes, made2)
                for v, vr, _, _ in values]
        v_cat = graph.call_function(torch.cat, (laid, len(kb)))
        out = graph.call_function(torch.einsum, (
            f"{pattern.replace('#', N)},{''.join(kb) + N + F}->{out_letters.replace('#', N).replace('@', F)}",
            p, v_cat))
        made2 += [v_cat, out]
    products = [(v[2].args, v[3].args, dict(v[3].kwargs), v[2]) for v in values]
    if not commit(graph, made2, top, dead=(*adds[1:], *[v[3] for v in values], *[v[2] for v in values])):
        return edits

    def rebuild_values(graph: fx.Graph) -> list:  # the slices, their products and the sum, as written
        new: list = []
        outs = []
        for s_args, pv_args, pv_kwargs, sl in products:
            s = graph.call_function(operator.getitem, s_args)
            set_example_value(s)
            pv = graph.call_function(torch.einsum, tuple(s if a is sl else a for a in pv_args), pv_kwargs)
            set_example_value(pv)
            new += [s, pv]
            outs.append(pv)

        def add(t: Any) -> fx.Node:
            if isinstance(t, int):
                return outs[t]
            node = graph.call_function(operator.add, (add(t[0]), add(t[1])))
            new.append(node)
            return node

        add(tree)
        return new

    edits.append(Edit(made2, out, rebuild_values, inputs=[p] + [v for v, _, _, _ in values]))
    return edits


def fold_concat_keys(gm: fx.GraphModule) -> list[Edit]:
    """Apply the edits of the module docstring wherever they hold; the edits made."""
    return attempt_each(gm, "softmax", _concat_keys)
