"""Paged KV caches: attention whose K and V are gathered from a pool of pages through a block table
becomes one `fa3.paged_attention` call that reads the pages in place, with no gathered copy.

Runs after the sites are rewritten, on each emitted `fa3.attention` call: its k and v are traced
back, view by view, to a gather of a pool,
    pool[table]                              advanced indexing, table int [B, M]
    pool.index_select(0, table.flatten())    (or .view(-1) / .reshape(-1))
    pool.gather(0, table.flatten()[:, None, None, None].expand(-1, *pool.shape[1:]))
and the views after it (view / reshape / flatten / unsqueeze / squeeze, transpose / permute, a slice
[:L] of the key axis, contiguous / clone) must take element [b, h, j, d] of the op's k to
pool[table[b, j // page], j % page, h, d] for a pool (blocks, page, Hkv, D) ("bshd", vLLM / FA3) or
pool[table[b, j // page], h, j % page, d] for (blocks, Hkv, page, D) ("bhsd"): that is proven by
following each dimension's factors (batch, page index, slot, head, head dim) through every view.
The op takes both layouts as they are stored (strides): the pool is never copied or permuted.

fa3.attention's masks map to the op's cache_seqlens / causal:
    no mask             cache_seqlens = L (the gathered length)
    kv_lens             cache_seqlens = clamp(kv_lens, 0, L), exactly fa3.attention's key padding
    causal, offset d    cache_seqlens = Nq + d with 0 <= Nq + d <= L, causal: query i then sees
                        keys j <= d + i, fa3.attention's j - i <= d (and every key past it is beyond)
    one query token     its keys are a prefix whatever the masks: cache_seqlens = clamp(min(kv_lens,
                        d + 1, q_pos + 1), 0, L) over those given, no causality
anything else (a residual bias, windows, softcap, dropout, sinks, segments, per-query positions or
causality together with key lengths for several tokens, a forced kernel the paged op lacks) keeps the gathered copy
and the fa3.attention call, and the site's report says why. fa3.attention's own fix-ups of fully
masked rows read only its lse, which the paged op computes with the same convention (-inf on a row
with no key, out 0); one that reads the gathered V (eager's mean over every gathered key) is another
user of the copy, which keeps it.

The rewrite is made only when the gathered copy and each view of it has no reader but the next
step towards the attention (a copy the graph also returns or reads elsewhere stays, and so does the
ordinary rewrite), and when nothing between the gather and the attention writes into memory of the
pool or the table (the op reads them where the attention was, the copy was taken at the gather).
Advanced indexing wraps negative table entries (pool[-1] is the last block) while the paged op does
not, so the table is passed as where(table < 0, table + blocks, table) (once per table for the
sites after it); index_select and gather reject negative indices, as the op does.

Sizes may be symbolic: lengths, the batch and the pool's block count are read from the table's and
the pool's sizes at run time; equalities (K and V pools of one block count, the gathered length as
the table's capacity) must be provable without a new guard. The front door may veto a call
(PassOptions.paged_check: on a GPU, inputs no fused paged kernel takes keep the gathered attention).
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.fx as fx

from .aliasing import writes
from .canonicalize import comes_before, is_inplace, kind, tensor_of
from .emit import call, example_value, size_arg
from .shapes import known_eq, known_one, prod
from .site import PassOptions, SiteReport

# kernels the paged op has (a kernel forced for every site by the front door must be one of them)
PAGED_KERNELS = ("triton", "fa3", "reference")


class NotPaged(Exception):
    """The attention keeps its gathered K/V; the message says why."""


def paged_op() -> Optional[Any]:
    """torch.ops.fa3.paged_attention (registered by the front door), or None when it is not."""
    try:
        return torch.ops.fa3.paged_attention.default
    except (AttributeError, RuntimeError):
        return None


# ------------------------------------------------------------------------------------ dimension roles
# The gathered tensor's dims are tracked as lists of factors (major first), each a role of the gather:
# "b" / "m" the table's rows / columns, "p1" / "p2" the pool's dims 1 and 2, "d" its last dim. A factor
# of size 1 carries no index, so it is dropped: views may then insert or remove size-1 dims freely.


@dataclass
class _Dim:
    factors: list  # roles, major first
    limit: Any = None  # a slice [:limit] of this dim (only of the key positions [m, slot])


@dataclass
class Gather:
    """A K or V input of fa3.attention proven to be the paged gather of `pool` through `table`."""

    pool: fx.Node
    table: fx.Node  # int [B, M]
    spelling: str  # "index", "index_select", "gather"
    layout: str = "bshd"
    length: Any = None  # the keys the attention sees (int or SymInt)
    nodes: list = field(default_factory=list)  # the gather and its views, attention input last
    stop: Any = None  # the end of a slice [:stop] of the key positions (int or SymInt node), or None

    def page(self) -> Any:
        pool = tensor_of(self.pool)
        return pool.shape[1] if self.layout == "bshd" else pool.shape[2]


def _sizes(roles: dict, factors: list) -> Any:
    return prod(roles[f] for f in factors)


def _reshape(dims: list, out_shape: tuple, roles: dict) -> list:
    """Regroup the factors of `dims` (in order) into the sizes of `out_shape`; NotPaged if a size
    does not fall on factor boundaries."""
    if any(d.limit is not None for d in dims):
        raise NotPaged("the gathered keys are sliced and then reshaped")
    flat = [f for d in dims for f in d.factors]
    out: list = []
    for s in out_shape:
        take: list = []
        while not known_eq(_sizes(roles, take), s):
            if not flat:
                raise NotPaged(f"a view of the gathered cache regroups it across pages or heads (size {s})")
            take.append(flat.pop(0))
        out.append(_Dim(take))
    if flat:
        raise NotPaged("a view of the gathered cache drops part of it")
    return out


def _slice_dim(d: _Dim, sl: Any, size: Any) -> _Dim:
    """dims[i][sl] for a Python slice: the full range, or [0:L] of the key positions."""
    if not isinstance(sl, slice):
        raise NotPaged(f"the gathered cache is indexed with {sl!r}")
    start, stop, step = sl.start, sl.stop, sl.step
    if start not in (None, 0) or step not in (None, 1):
        raise NotPaged("the gathered cache is sliced with a start or a step")
    if stop is None or (isinstance(stop, int) and isinstance(size, int) and stop >= size):
        return d
    val = example_value(stop) if isinstance(stop, fx.Node) else stop
    if not isinstance(val, (int, torch.SymInt)) or (isinstance(val, int) and val < 0):
        raise NotPaged(f"the gathered cache is sliced to {val!r}")
    if not d.factors or d.factors[0] != "m" or d.limit is not None:
        raise NotPaged("the gathered cache is sliced along an axis other than its key positions")
    return _Dim(d.factors, stop)


def _follow(node: fx.Node, dims: list, roles: dict) -> Optional[list]:
    """The dims of `node` (a view of its first argument, whose dims are `dims`), or None when node is
    not a view this module follows."""
    t, src = tensor_of(node), tensor_of(node.args[0]) if node.args else None
    if t is None or src is None or t.dtype != src.dtype or t.device != src.device:
        return None  # a cast or a reinterpreting view(dtype) changes what the op would read
    k = kind(node)
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
    if k in ("identity", "cast"):
        return dims if tuple(t.shape) == tuple(src.shape) else None
    if k == "transpose":
        a, b = (node.args[1:3] if len(node.args) >= 3 else (node.kwargs.get("dim0"), node.kwargs.get("dim1")))
        if not (isinstance(a, int) and isinstance(b, int)):
            return None
        out = list(dims)
        a, b = a % len(out), b % len(out)
        out[a], out[b] = out[b], out[a]
        return out
    if k == "permute":
        perm = node.args[1] if len(node.args) == 2 and isinstance(node.args[1], (list, tuple)) else node.args[1:]
        perm = node.kwargs.get("dims", perm)
        if not all(isinstance(p, int) for p in perm) or len(perm) != len(dims):
            return None
        return [dims[p % len(dims)] for p in perm]
    if k in ("reshape", "unsqueeze") or name in ("flatten", "unflatten", "squeeze"):
        if not known_eq(t.numel(), src.numel()):
            return None
        return _reshape(dims, tuple(t.shape), roles)
    if k == "getitem":
        idx = node.args[1]
        idx = idx if isinstance(idx, tuple) else (idx,)
        if any(x is Ellipsis for x in idx):
            e = idx.index(Ellipsis)
            idx = idx[:e] + (slice(None),) * (len(dims) - len(idx) + 1) + idx[e + 1:]
        if any(x is None for x in idx) or len(idx) > len(dims):
            return None
        out = [_slice_dim(d, sl, src.shape[i]) for i, (d, sl) in enumerate(zip(dims, idx))]
        return out + dims[len(idx):]
    if name == "narrow":
        dim, start, length = (list(node.args[1:4]) + [None] * 3)[:3]
        if not isinstance(dim, int) or start != 0:
            return None
        dim = dim % len(dims)
        out = list(dims)
        out[dim] = _slice_dim(dims[dim], slice(None, length), src.shape[dim])
        return out
    return None


def _int_source(x: Any) -> Any:
    """x without the widening casts to int64 in front of it (they keep every index's value; a
    narrowing one may not, so it stays)."""
    while isinstance(x, fx.Node) and x.op == "call_method" and x.target in ("long", "to") and x.args:
        src, t = tensor_of(x.args[0]), tensor_of(x)
        if src is None or t is None or src.dtype not in _INDEX_DTYPES or t.dtype != torch.int64 or \
                src.device != t.device or tuple(src.shape) != tuple(t.shape):
            break
        x = x.args[0]
    return x


_INDEX_DTYPES = (torch.int32, torch.int64)


def _flat_table(idx: Any) -> Optional[fx.Node]:
    """The 2-d table whose row-major flattening `idx` is (flatten / view(-1) / reshape(-1)), or None."""
    idx = _int_source(idx)
    t = tensor_of(idx)
    if t is None or t.dim() != 1 or not isinstance(idx, fx.Node) or not idx.args:
        return None
    src = idx.args[0]
    st = tensor_of(src)
    name = idx.target if idx.op == "call_method" else getattr(idx.target, "__name__", "")
    if st is None or st.dim() != 2 or name not in ("flatten", "view", "reshape", "ravel"):
        return None
    return _int_source(src)


def _gather_root(node: fx.Node) -> Optional[tuple[str, fx.Node, fx.Node, list]]:
    """(spelling, pool, table [B, M], dims) when node gathers whole pages of a 4-d pool."""
    if node.op not in ("call_function", "call_method"):
        return None
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
    pool = node.args[0] if node.args else None
    pt = tensor_of(pool)
    if pt is None or pt.dim() != 4:
        return None
    base = [_Dim(["p1"]), _Dim(["p2"]), _Dim(["d"])]
    if node.op == "call_function" and node.target is operator.getitem:
        idx = node.args[1]
        it = tensor_of(idx)
        if it is None or it.dtype not in _INDEX_DTYPES or it.dim() != 2:
            return None
        return "index", pool, _int_source(idx), [_Dim(["b"]), _Dim(["m"])] + base
    if name == "index_select":
        dim, idx = (node.args[1:3] if len(node.args) >= 3 else (node.kwargs.get("dim"), node.kwargs.get("index")))
        table = _flat_table(idx)
        if dim not in (0, -4) or table is None or tensor_of(idx).dtype not in (torch.int32, torch.int64):
            return None
        return "index_select", pool, table, [_Dim(["b", "m"])] + base
    if name == "gather":
        dim, idx = (node.args[1:3] if len(node.args) >= 3 else (node.kwargs.get("dim"), node.kwargs.get("index")))
        if dim not in (0, -4) or node.kwargs.get("sparse_grad"):
            return None
        # index = rows.view(N, 1, 1, 1).expand(N, *pool.shape[1:]): whole pages, rows the flat table
        if kind(idx) != "expand" or tuple(tensor_of(idx).shape[1:]) != tuple(pt.shape[1:]):
            return None
        rows = idx.args[0]
        if tensor_of(rows) is None or tensor_of(rows).dim() != 4 or \
                not known_eq(tensor_of(rows).shape[0], tensor_of(idx).shape[0]):
            return None  # the expand may only broadcast the size-1 dims, never repeat a row
        while tensor_of(rows) is not None and tensor_of(rows).dim() > 1:
            rt = tensor_of(rows)
            if not all(known_one(s) for s in rt.shape[1:]) or not isinstance(rows, fx.Node) or not rows.args:
                return None
            if not (kind(rows) in ("reshape", "unsqueeze") or _adds_unit_dims(rows)):
                return None
            rows = rows.args[0]
        table = _flat_table(rows)
        if table is None or tensor_of(idx).dtype != torch.int64:
            return None
        return "gather", pool, table, [_Dim(["b", "m"])] + base
    return None


def _adds_unit_dims(n: fx.Node) -> bool:
    """x[:, None, None, None]: a getitem of full slices and Nones only."""
    if n.target is not operator.getitem or len(n.args) != 2:
        return False
    idx = n.args[1] if isinstance(n.args[1], tuple) else (n.args[1],)
    full = slice(None, None, None)
    return all(i is None or i == full for i in idx)


def find_gather(x: fx.Node, limit: int = 24) -> Optional[fx.Node]:
    """The gather of pages that x is computed from through at most `limit` one-input steps, or None."""
    n: Any = x
    for _ in range(limit):
        if not isinstance(n, fx.Node) or n.op not in ("call_function", "call_method"):
            return None
        if _gather_root(n) is not None:
            return n
        n = n.args[0] if n.args else None
    return None


def trace_gather(x: fx.Node, consumer: fx.Node) -> Gather:
    """Prove that x (fa3.attention's k or v, [B, Hkv, L, D]) is a paged gather read only on its way
    to `consumer`; NotPaged with the reason otherwise."""
    root = find_gather(x)
    if root is None:
        raise NotPaged("not a gather of pages")
    chain = [x]
    while chain[-1] is not root:
        chain.append(chain[-1].args[0])
    chain.reverse()  # root first
    spelling, pool, table, dims = _gather_root(root)
    pt, tt = tensor_of(pool), tensor_of(table)
    roles = {"b": tt.shape[0], "m": tt.shape[1], "p1": pt.shape[1], "p2": pt.shape[2], "d": pt.shape[3]}
    dims = [_Dim([f for f in d.factors if not known_one(roles[f])]) for d in dims]
    for n in chain[1:]:
        nxt = _follow(n, dims, roles)
        if nxt is None:
            what = n.target if n.op == "call_method" else getattr(n.target, "__name__", n.target)
            raise NotPaged(f"{n.name} ({what}) "
                           "between the gather and the attention is not a view")
        dims = nxt
    for prev, n in zip(chain, chain[1:] + [consumer]):
        others = [u for u in prev.users if u is not n and _live(u) and not _nan_grad_term(u)]
        if others:
            raise NotPaged(f"the gathered copy {prev.name} is also read by {others[0].name}")
    if len(dims) != 4:
        raise NotPaged("the gathered cache is not 4-d at the attention")
    b, h, pos, d = dims
    want_b = [] if known_one(roles["b"]) else ["b"]
    want_d = [] if known_one(roles["d"]) else ["d"]
    if b.factors != want_b or d.factors != want_d or b.limit is not None or h.limit is not None:
        raise NotPaged("the gathered cache's batch or head dim does not map to the table's rows or the pool's last dim")
    if pos.factors[:1] != ["m"] and not known_one(roles["m"]):
        raise NotPaged("the gathered key positions do not run over the table's pages")
    slot = [f for f in pos.factors if f != "m"]
    if len(slot) > 1 or len(h.factors) > 1 or any(f not in ("p1", "p2") for f in slot + h.factors):
        raise NotPaged("the gathered key positions mix pages and heads")
    if slot:
        layout = "bshd" if slot[0] == "p1" else "bhsd"
        if h.factors and h.factors[0] != ("p2" if layout == "bshd" else "p1"):
            raise NotPaged("the gathered heads are not the pool's head dim")
    elif h.factors:
        layout = "bshd" if h.factors[0] == "p2" else "bhsd"  # page size 1
    else:
        layout = "bshd"  # page size 1 and one head: both layouts are the same
    cap = roles["m"] * (roles["p1"] if layout == "bshd" else roles["p2"])
    length = tensor_of(x).shape[2]
    if pos.limit is None and not known_eq(length, cap):
        raise NotPaged("the gathered key length is not the table's capacity")
    return Gather(pool, table, spelling, layout, length, chain, pos.limit)


def _nan_grad_term(n: fx.Node) -> bool:
    """fa3.nan_row_grad as emit adds it to a site's NaN fill (`fill + grad.to(dtype)`): its value is 0, it reads K/V
    only for their gradients' shapes, and the paged rewrite drops it (`_drop_nan_grad_terms`)."""
    if n.op != "call_function" or n.target is not torch.ops.fa3.nan_row_grad.default or len(n.users) != 1:
        return False
    cast = next(iter(n.users))
    if cast.op != "call_method" or cast.target != "to" or len(cast.users) != 1:
        return False
    add = next(iter(cast.users))
    return add.op == "call_function" and add.target in (torch.add, operator.add) and len(add.args) == 2 \
        and add.args[1] is cast


def _drop_nan_grad_terms(graph: fx.Graph, readers: list) -> None:
    """Remove the fa3.nan_row_grad terms of `readers` (the gathered K/V): the paged op reads the pool in place, and
    eager's NaN gradients of a fully masked row would have to reach the pool's pages through the gather, which is
    gone. Those rows keep the op's finite gradients (the README's known difference); their value is unchanged."""
    for g in {u for r in readers for u in r.users if _nan_grad_term(u)}:
        cast = next(iter(g.users))
        add = next(iter(cast.users))
        add.replace_all_uses_with(add.args[0])
        for n in (add, cast, g):
            graph.erase_node(n)


def _live(n: fx.Node, depth: int = 0) -> bool:
    """Whether n's value is used: the site rewrite leaves the user's dead nodes (its own k.transpose)
    to the pass's final dead-code removal, so a reader that nothing reads does not count."""
    if n.op == "output" or n.is_impure() or writes(n) or depth > 32:
        return True
    return any(_live(u, depth + 1) for u in n.users)


# ------------------------------------------------------------------------------------------ mutation
def _storage(x: Any) -> Any:
    t = tensor_of(x)
    if t is None:
        return None
    try:
        from torch.multiprocessing.reductions import StorageWeakRef

        return StorageWeakRef(t.untyped_storage())
    except Exception:
        return None


def _writes(n: fx.Node) -> list:
    """The tensor arguments n may write into: an in-place op's self, out=, an op schema's mutable args."""
    out = []
    if is_inplace(n) and n.args:
        out.append(n.args[0])
    if n.op == "call_function" and "out" in n.kwargs:
        out += [a for a in torch.utils._pytree.tree_leaves(n.kwargs["out"]) if isinstance(a, fx.Node)]
    if n.op == "call_module":  # opaque: it may write into any tensor it is given
        out += [a for a in torch.utils._pytree.tree_leaves((n.args, n.kwargs)) if isinstance(a, fx.Node)]
    target = n.target
    schemas = []
    if isinstance(target, torch._ops.OpOverload):
        schemas = [target._schema]
    elif isinstance(target, torch._ops.OpOverloadPacket):
        schemas = [getattr(target, o)._schema for o in target.overloads()]
    for s in schemas:
        if any(a.alias_info is not None and a.alias_info.is_write for a in s.arguments):
            out += [a for a in torch.utils._pytree.tree_leaves((n.args, n.kwargs)) if isinstance(a, fx.Node)]
    return [w for w in out if tensor_of(w) is not None]


def _index_chain(g: "Gather", table: Any, depth: int = 8) -> list:
    """The nodes between `table` and the gather's first node along the index argument's first-argument chain (the
    casts and flattenings `_int_source` / `_flat_table` looked through)."""
    out: list = []
    for x in g.nodes[0].all_input_nodes:
        path: list = []
        for _ in range(depth):
            if x is table:
                out += path
                break
            if not isinstance(x, fx.Node) or x.op not in ("call_function", "call_method") or not x.args:
                break
            path.append(x)
            x = x.args[0]
    return out


def _written_between(graph: fx.Graph, first: fx.Node, last: fx.Node, tensors: list) -> Optional[str]:
    """The name of a node after `first` and before `last` that writes into a storage of `tensors`."""
    stores = [_storage(t) for t in tensors]
    if any(s is None for s in stores):
        return "a node (the storages of the pool and the table are unknown)"
    inside = False
    for n in graph.nodes:
        if n is first:
            inside = True
            continue
        if n is last:
            return None
        if inside and any(_storage(w) in stores or _storage(w) is None for w in _writes(n)):
            return n.name
    return None


# ----------------------------------------------------------------------------------------- the rewrite
def _args_of(att: fx.Node) -> dict:
    names = [a.name for a in att.target._schema.arguments]
    vals = {a.name: a.default_value if a.has_default_value() else None for a in att.target._schema.arguments}
    vals.update(zip(names, att.args))
    vals.update(att.kwargs)
    return vals


def _describe(g: Gather) -> str:
    dims = "(blocks, page, Hkv, D)" if g.layout == "bshd" else "(blocks, Hkv, page, D)"
    t = tensor_of(g.table)
    return (f"paged: pool {dims} page {g.page()}, table {str(t.dtype).replace('torch.', '')} "
            f"[{t.shape[0]}, {t.shape[1]}] (read in place; the {g.spelling} gather removed)")


def _seqlens(graph: fx.Graph, a: dict, g: Gather, nq: Any) -> tuple[fx.Node, bool]:
    """(cache_seqlens node, causal) equal to fa3.attention's masks a (NotPaged when they are not these)."""
    for name, why in (("bias", "a mask that is not key lengths or causality (a bias)"), ("sinks", "attention sinks"),
                      ("q_seg", "segment ids (packed sequences)")):
        if a.get(name) is not None:
            raise NotPaged(f"{why}: the paged op has no such argument")
    if a["window_left"] != -1 or a["window_right"] != -1:
        raise NotPaged("a sliding window: the paged op has none")
    if a["softcap"]:
        raise NotPaged("a softcap: the paged op has none")
    if a["dropout_p"]:
        raise NotPaged("dropout: the paged op has none")
    if known_one(nq):
        return _one_token_lengths(graph, a, g), False
    L = g.length
    if a.get("q_pos") is not None:
        # q_pos[i] = x + i, the same for every sequence: causality at offset x (as a diagonal offset)
        x = _arange_offset(a["q_pos"], nq)
        if x is None or a["causal"] or a["kv_lens"] is not None:
            raise NotPaged("per-query key limits (q_pos) for several new tokens, not proven to be consecutive "
                           "positions shared by every sequence: the paged op has no such argument")
        a = dict(a, causal=True, diag_offset=x)
    if a["causal"]:
        if a["kv_lens"] is not None:
            raise NotPaged("causality together with key lengths for several new tokens: the paged op aligns "
                           "causality to each sequence's length, this mask aligns it to the gathered length")
        end = nq + a["diag_offset"] if isinstance(a["diag_offset"], int) and isinstance(nq, int) else None
        if not isinstance(end, int) or not isinstance(L, int) or not 0 <= end <= L:
            d = a["diag_offset"]
            d = example_value(d) if isinstance(d, fx.Node) else d
            if not known_eq(d, L - nq):
                raise NotPaged(f"causal diagonal offset {d} is not provably within the gathered length")
            end = L
        return _full_lengths(graph, g, end), True
    if a["kv_lens"] is None:
        return _full_lengths(graph, g, L), False
    return _clamped(graph, g, _int64(graph, a["kv_lens"])), False


def _arange_offset(n: Any, nq: Any) -> Any:
    """x (an int or SymInt) when node n holds x + arange(nq) in order (any shape of nq elements, so
    [Nq] or [1, Nq]: the same for every sequence); None when that is not proven."""
    for _ in range(16):
        t = tensor_of(n)
        if t is None or t.dtype not in _INDEX_DTYPES or not known_eq(t.numel(), nq):
            return None
        name = n.target if n.op == "call_method" else getattr(n.target, "__name__", "")
        if n.op == "call_function" and n.target is torch.arange:
            ends = [example_value(x) for x in n.args]
            if n.kwargs.get("step", 1) != 1 or len(ends) > 2 or (len(ends) == 2 and not ends):
                return None
            if len(ends) == 2 and n.kwargs.get("step") is None:
                return ends[0] if known_eq(ends[1] - ends[0], nq) else None
            return 0 if len(ends) == 1 and known_eq(ends[0], nq) else None
        if name in ("add", "sub", "__add__", "__sub__", "__radd__") or n.target in (operator.add, operator.sub):
            a, b = n.args[0], n.args[1] if len(n.args) > 1 else None
            if n.kwargs or b is None:
                return None
            va, vb = (example_value(x) if isinstance(x, fx.Node) else x for x in (a, b))
            scalar = lambda v: isinstance(v, (int, torch.SymInt)) and not isinstance(v, bool)  # noqa: E731
            sub = name in ("sub", "__sub__") or n.target is operator.sub
            if scalar(vb):
                x = _arange_offset(a, nq)
                return None if x is None else (x - vb if sub else x + vb)
            if scalar(va) and not sub:
                x = _arange_offset(b, nq)
                return None if x is None else x + va
            return None
        if n.op != "call_method" and n.target is not operator.getitem and name not in ("reshape", "unsqueeze",
                                                                                           "squeeze", "flatten"):
            return None
        src = n.args[0] if n.args else None
        st = tensor_of(src)
        if st is None or st.dtype not in _INDEX_DTYPES or not known_eq(st.numel(), nq):
            return None  # casts and views that keep all nq values in order (and nothing narrower)
        if n.target is operator.getitem:
            idx = n.args[1] if isinstance(n.args[1], tuple) else (n.args[1],)
            if not all(i is None or i == slice(None, None, None) or (i == 0 and not isinstance(i, bool)) for i in idx):
                return None
        elif n.op == "call_method" and name not in ("to", "long", "int", "view", "reshape", "unsqueeze", "squeeze",
                                                     "flatten", "contiguous", "clone"):
            return None
        if name in ("to", "int") and t.dtype == torch.int32 and st.dtype == torch.int64:
            return None  # a narrowing cast may change values
        n = src
    return None


def _one_token_lengths(graph: fx.Graph, a: dict, g: Gather) -> fx.Node:
    """One query token: its admissible keys are the prefix j < min(L, kv_lens[b], diag_offset + 1,
    q_pos[b] + 1), whichever apply; the paged op's cache_seqlens is that end, with no causality."""
    L = g.length
    ends = []
    if a["kv_lens"] is not None:
        ends.append(_int64(graph, a["kv_lens"]))
    if a.get("q_pos") is not None:  # [1], [B], [1, 1] or [B, 1]: the flattening broadcasts over the batch
        qp = call(graph, torch.reshape, _int64(graph, a["q_pos"]), (-1,))
        ends.append(call(graph, operator.add, call(graph, torch.clamp, qp, -1, _length_node(graph, g, L)), 1))
    if a["causal"]:
        d = a["diag_offset"]
        if not isinstance(d, int):
            if not known_eq(example_value(d), L - 1):
                raise NotPaged(f"causal diagonal offset {example_value(d)} is not provably L - 1")
            d = None  # every key: nothing to limit
        if d is not None:
            if not ends:
                ends.append(_full_lengths(graph, g, L))
            ends[0] = call(graph, torch.clamp, ends[0], max=d + 1)
    if not ends:
        return _full_lengths(graph, g, L)
    end = ends[0]
    for e in ends[1:]:
        end = call(graph, torch.minimum, end, e)
    b = tensor_of(g.table).shape[0]
    if not known_eq(tensor_of(end).shape[0], b):
        end = call(graph, "expand", end, size_arg(graph, g.table, 0), method=True)
    return _clamped(graph, g, end)


def _int64(graph: fx.Graph, x: fx.Node) -> fx.Node:
    """x as int32 / int64 (the dtypes the op takes), any other integer dtype widened to int64."""
    return x if tensor_of(x).dtype in _INDEX_DTYPES else call(graph, "to", x, torch.int64, method=True)


def _clamped(graph: fx.Graph, g: Gather, lens: fx.Node) -> fx.Node:
    """lens clamped to [0, L], as fa3.attention reads key lengths (and the paged op needs them)."""
    return call(graph, torch.clamp, lens, 0, _length_node(graph, g, g.length))


def _length_node(graph: fx.Graph, g: Gather, n: Any) -> Any:
    """n (the gathered length L, or a length derived from it) as an int or a graph node."""
    if isinstance(n, int):
        return n
    if n is g.length or known_eq(n, g.length):
        if g.stop is not None and known_eq(example_value(g.stop), g.length):
            return g.stop
        page = size_arg(graph, g.pool, 1 if g.layout == "bshd" else 2)
        cap = call(graph, operator.mul, size_arg(graph, g.table, 1), page)
        if known_eq(example_value(cap), g.length):
            return cap
    raise NotPaged(f"the gathered length {n} is symbolic and not provably the table's capacity or the slice's end")


def _full_lengths(graph: fx.Graph, g: Gather, n: Any) -> fx.Node:
    """int32 [B] filled with n, on the table's device."""
    n = _length_node(graph, g, n)
    return call(graph, "new_full", g.table, (size_arg(graph, g.table, 0),), n, dtype=torch.int32, method=True)


def _table_arg(graph: fx.Graph, g: Gather, att: fx.Node, wrapped: dict) -> fx.Node:
    """The table the op reads: advanced indexing's wrap of negative entries made explicit, computed once
    per table for every site after it that nothing writes the table before."""
    if g.spelling != "index":
        return g.table
    earlier = wrapped.get(g.table)
    if earlier is not None and comes_before(graph, earlier, att) and \
            _written_between(graph, earlier, att, [g.table]) is None:
        return earlier
    blocks = size_arg(graph, g.pool, 0)
    neg = call(graph, operator.lt, g.table, 0)
    node = call(graph, torch.where, neg, call(graph, operator.add, g.table, blocks), g.table)
    wrapped[g.table] = node
    return node


def _rewrite_one(gm: fx.GraphModule, att: fx.Node, rep: SiteReport, options: PassOptions, wrapped: dict) -> bool:
    """Replace fa3.attention `att` with the paged op when its K and V are paged gathers; False (and
    rep.cache says why) when they are gathers that must stay; False silently when they are not gathers."""
    a = _args_of(att)
    k, v, q = a["k"], a["v"], a["q"]
    if find_gather(k) is None and find_gather(v) is None:
        return False
    graph = gm.graph
    marker = att.prev  # everything inserted lies between it and att: a refusal erases it
    try:
        op = paged_op()
        if op is None:
            raise NotPaged("the paged op is not registered")
        gk, gv = trace_gather(k, att), trace_gather(v, att)
        if gk.table is not gv.table:
            raise NotPaged("K and V are gathered through different tables")
        if gk.layout != gv.layout or not known_eq(gk.page(), gv.page()) or not known_eq(gk.length, gv.length):
            raise NotPaged("K and V pools differ in layout, page size or gathered length")
        if gk.nodes[0] is gv.nodes[0]:
            raise NotPaged("K and V are read from one gathered copy")
        if not known_eq(tensor_of(gk.pool).shape[0], tensor_of(gv.pool).shape[0]):
            raise NotPaged("the K and V pools hold different numbers of blocks")
        forced = a.get("force_kernel")
        if forced is not None and forced not in PAGED_KERNELS:
            raise NotPaged(f"the kernel {forced!r} is forced and the paged op has no such kernel")
        for g in (gk, gv):
            if tensor_of(g.pool).dtype != tensor_of(q).dtype:
                raise NotPaged("the pool's dtype differs from q's")
        order = {n: i for i, n in enumerate(graph.nodes)}
        # the op reads the table itself at the attention: the casts and flattenings between it and the gathers
        # (a widening cast is a copy) must see no write from where they read it on, nor their results
        chain = _index_chain(gk, gk.table) + _index_chain(gv, gk.table)
        first = min([gk.nodes[0], gv.nodes[0], *chain], key=order.__getitem__)
        who = _written_between(graph, first, att, [gk.pool, gv.pool, gk.table, *chain])
        if who is not None:
            raise NotPaged(f"{who} may write into the pool or the table between the gather and the attention")
        getitems = list(att.users)
        if any(u.target is not operator.getitem or u.args[1] not in (0, 1) for u in getitems):
            raise NotPaged("the attention's result is read other than as (out, lse)")
        with graph.inserting_before(att):
            seqlens, causal = _seqlens(graph, a, gk, tensor_of(q).shape[2])
            table = _table_arg(graph, gk, att, wrapped)
            qt = call(graph, torch.transpose, q, 1, 2)  # [B, Nq, Hq, D], a view
            node = call(graph, op, qt, gk.pool, gv.pool, seqlens, table, None, scale=float(a["scale"]),
                        causal=causal, layout=gk.layout, force_kernel=forced)
            out = call(graph, torch.transpose, call(graph, operator.getitem, node, 0), 1, 2)
            lse = call(graph, operator.getitem, node, 1)
        why = options.paged_check(node) if options.paged_check is not None else None
        if why:
            raise NotPaged(why)
    except Exception as e:  # NotPaged, or a fake run that rejected the call: the gathered attention stays
        made = []
        n = marker.next
        while n is not att:
            made.append(n)
            n = n.next
        for n in reversed(made):
            graph.erase_node(n)
        for key in [t for t, n in wrapped.items() if n in made]:
            del wrapped[key]
        why = str(e) if isinstance(e, NotPaged) else f"the paged rewrite failed: {type(e).__name__}: {str(e)[:200]}"
        rep.cache = f"gathered K/V kept: {why}"
        return False
    for u in getitems:
        u.replace_all_uses_with(out if u.args[1] == 0 else lse)
        graph.erase_node(u)
    graph.erase_node(att)
    _drop_nan_grad_terms(graph, [k, v])
    for n in reversed(gk.nodes + gv.nodes):
        if not n.users:
            graph.erase_node(n)
    rep.call = node
    rep.cache = _describe(gk)
    rep.form = f"{rep.form}, paged cache"
    return True


def rewrite_paged_caches(gm: fx.GraphModule, reports: list, options: Optional[PassOptions] = None) -> None:
    """Turn the rewritten sites of `reports` whose K/V are paged gathers into fa3.paged_attention."""
    att_op = torch.ops.fa3.attention.default
    wrapped: dict = {}  # table node -> its wrapped copy, shared by the sites after it
    for rep in reports:
        node = rep.call
        if not rep.rewritten or not isinstance(node, fx.Node) or node.target is not att_op or \
                node.graph is not gm.graph:
            continue
        try:
            _rewrite_one(gm, node, rep, options or PassOptions(), wrapped)
        except Exception as e:  # before any edit: the gathered attention stays as rewritten
            rep.cache = f"gathered K/V kept: not analysed: {type(e).__name__}: {str(e)[:200]}"
