"""Which nodes share memory and which write into it: the one reading of aliasing that every pass uses.

A rewrite may read a tensor at another place than eager did, or save it for the backward; both are exact only
when nothing writes into that memory in between. "Written" is answered over the tensor's whole alias class (the
base it is a view of and every view of that base), and every answer errs towards "written": an op whose result
may share its input's memory counts as a view, an op that may write counts as a write, and a class too large to
walk is taken as written.
"""
from __future__ import annotations

import inspect
import operator
import weakref
from typing import Any, Callable, Optional

import torch
import torch.fx as fx

from .emit import example_value

_CALLS = ("call_function", "call_method")

_OPERATOR_INPLACE = (operator.setitem, operator.iadd, operator.isub, operator.imul, operator.itruediv,
                     operator.iand, operator.ior, operator.ixor, operator.ifloordiv, operator.imod, operator.ipow,
                     operator.ilshift, operator.irshift, operator.imatmul)
# The same updates spelled as Tensor methods (their names end in "__", which the trailing-underscore rule skips).
_DUNDER_INPLACE = frozenset({"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__iand__",
                             "__ior__", "__ixor__", "__ifloordiv__", "__imod__", "__ipow__", "__ilshift__",
                             "__irshift__", "__imatmul__"})

# Ops whose result may share memory with their first argument: views, and calls that return their input unchanged
# when nothing is to be done (contiguous, to, type, float, long, ...). Everything else allocates its result.
MAY_ALIAS = frozenset({
    "view", "reshape", "view_as", "reshape_as", "transpose", "swapaxes", "swapdims", "permute", "movedim", "moveaxis",
    "t", "adjoint", "expand", "expand_as", "broadcast_to", "squeeze", "unsqueeze", "flatten", "unflatten", "ravel",
    "narrow", "select", "slice", "chunk", "split", "split_with_sizes", "tensor_split", "unbind", "hsplit", "vsplit",
    "dsplit", "diagonal", "as_strided", "unfold", "detach", "alias", "contiguous", "to", "type", "type_as", "float",
    "double", "half", "bfloat16", "long", "int", "short", "char", "byte", "bool", "cpu", "cuda", "real", "imag",
    "view_as_real", "view_as_complex", "conj", "_conj", "resolve_conj", "resolve_neg", "positive", "getitem",
    "getattr", "T", "mT", "H", "mH", "align_as", "align_to", "rename", "refine_names", "_unsafe_view",
    "_reshape_alias", "lift_fresh", "atleast_1d", "atleast_2d", "atleast_3d", "broadcast_tensors", "meshgrid",
    # ... and calls that return their input itself in some cases: dropout of p 0 or in eval, a sum to the size the
    # tensor has, a dense tensor made dense; unsafe_split / unsafe_chunk are views; `t.data` (Dynamo's
    # _get_data_attr) is t's memory
    "dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout", "feature_dropout", "feature_alpha_dropout",
    "unsafe_split", "unsafe_chunk", "unsafe_split_with_sizes", "sum_to_size", "to_dense", "_get_data_attr",
    # torch.as_tensor / torch.asarray of a tensor, and unary + (operator.pos), return the tensor itself; so do
    # conj_physical of a real tensor and cartesian_prod of one tensor; numpy_T / matrix_H are views
    "as_tensor", "asarray", "pos", "conj_physical", "cartesian_prod", "numpy_T", "matrix_H",
})
# Of those, the ops that may return a view of any of their tensor arguments, not only of the first.
_ALIAS_EVERY_ARG = frozenset({"atleast_1d", "atleast_2d", "atleast_3d", "broadcast_tensors", "meshgrid"})


def op_name(node: fx.Node) -> str:
    """The operation's bare name, whatever the spelling: a method name, a function's `__name__`, an aten
    overload's or packet's schema name (`torch.ops.aten.add_.Tensor` -> "add_"); the node's op otherwise."""
    if node.op == "call_method":
        return str(node.target)
    if node.op != "call_function":
        return node.op
    t = node.target
    if isinstance(t, torch._ops.OpOverload):
        return t._schema.name.split("::")[-1]
    if isinstance(t, torch._ops.OpOverloadPacket):
        return t._qualified_op_name.split("::")[-1]
    return getattr(t, "__name__", str(t))


def _maybe_tensor(x: Any) -> bool:
    """False only when `x` is known not to be a tensor (a SymInt, a number): `n += 1` on those writes nothing."""
    if not isinstance(x, fx.Node):
        return False
    v = example_value(x)
    return v is None or isinstance(v, torch.Tensor)


def is_inplace(node: fx.Node) -> bool:
    """An op that writes into its first argument (`x.add_(1)`, `operator.setitem`, `torch.Tensor.mul_`,
    `torch.ops.aten.add_.Tensor`)."""
    if node.op not in _CALLS:
        return False
    if node.op == "call_function" and node.target in _OPERATOR_INPLACE:
        return bool(node.args) and _maybe_tensor(node.args[0])
    if node.op == "call_function" and getattr(node.target, "__module__", None) in ("_operator", "operator"):
        return False  # operator.and_ / or_ / not_ are functional despite the underscore
    name = op_name(node)
    if name in _DUNDER_INPLACE:
        return bool(node.args) and _maybe_tensor(node.args[0])
    return name.endswith("_") and not name.endswith("__")


def may_alias(node: fx.Node) -> bool:
    """Whether `node`'s result may share memory with an argument (see MAY_ALIAS; an einsum of one operand may
    return a view of it)."""
    if node.op not in _CALLS:
        return False
    name = op_name(node)
    if name == "einsum":
        return len([a for a in _einsum_operands(node) if _maybe_tensor(a)]) == 1
    return name in MAY_ALIAS


def _einsum_operands(node: fx.Node) -> list:
    ops = list(node.args[1:])
    if len(ops) == 1 and isinstance(ops[0], (list, tuple)):
        ops = list(ops[0])
    return ops


def _may_hold_tensor(node: fx.Node) -> bool:
    """False only when `node`'s value is known to hold no tensor (a shape, a size): such a value shares no memory."""
    v = example_value(node)
    return v is None or isinstance(v, torch.Tensor) or \
        (isinstance(v, (list, tuple)) and any(isinstance(x, torch.Tensor) for x in v))


def _first_arg(node: fx.Node) -> Any:
    return node.args[0] if node.args else node.kwargs.get("input", node.kwargs.get("self"))


def _nodes_in(x: Any) -> list:
    """`x` itself when it is a node, the nodes of a list / tuple `x`."""
    if isinstance(x, (list, tuple)):
        return [a for a in x if isinstance(a, fx.Node)]
    return [x] if isinstance(x, fx.Node) else []


_INPLACE_SIG: dict = {}  # target -> its signature when it has an `inplace` parameter, else False


def _inplace_flag(u: fx.Node) -> bool:
    """`F.relu(x, inplace=True)`-style calls: the `inplace` argument, by keyword or position."""
    if u.kwargs.get("inplace") is True:
        return True
    if u.op != "call_function" or not any(a is True for a in u.args):
        return False
    try:
        sig = _INPLACE_SIG.get(u.target)
    except TypeError:  # unhashable target
        return False
    if sig is None:
        try:
            sig = inspect.signature(u.target)
            sig = sig if "inplace" in sig.parameters else False
        except (TypeError, ValueError):
            sig = False
        _INPLACE_SIG[u.target] = sig
    if sig is False:
        return False
    try:
        return sig.bind(*u.args, **u.kwargs).arguments.get("inplace") is True
    except TypeError:
        return False


def _schema_written(u: fx.Node) -> list:
    """The nodes an aten op's schema marks as written (for a packet: in any of its overloads)."""
    t = u.target
    if isinstance(t, torch._ops.OpOverload):
        schemas = [t._schema]
    elif isinstance(t, torch._ops.OpOverloadPacket):
        schemas = [getattr(t, o)._schema for o in t.overloads()]
    else:
        return []
    found: list = []
    for s in schemas:
        for i, a in enumerate(s.arguments):
            if a.alias_info is not None and a.alias_info.is_write:
                found += _nodes_in(u.args[i] if i < len(u.args) and not a.kwarg_only else u.kwargs.get(a.name))
    return found


def written_args(node: fx.Node) -> list:
    """The nodes `node` may write into: the first argument of an in-place op (`x.add_(1)`, `operator.setitem`,
    every tensor of a `_foreach_*_` op's list, `inplace=True`), an argument an aten schema writes, `out=`."""
    if node.op not in _CALLS:
        return []
    found: list = []
    if is_inplace(node) or _inplace_flag(node):
        found += _nodes_in(_first_arg(node))
    return found + _schema_written(node) + _nodes_in(node.kwargs.get("out"))


def writes(node: fx.Node) -> bool:
    """Does `node` write into any tensor (see written_args)?"""
    return is_inplace(node) or bool(written_args(node))


def writes_into(user: fx.Node, node: fx.Node) -> bool:
    """Does `user` write into the memory of its argument `node` (see written_args)?"""
    return any(a is node for a in written_args(user))


def _alias_inputs(node: fx.Node) -> list:
    """The nodes whose memory `node`'s result may share: the first argument of a view (every tensor argument of
    broadcast_tensors-like ops), what a write wrote into (`x.add_(1)` is x, `torch.mul(a, 2, out=b)` is b)."""
    if not may_alias(node):
        return written_args(node)
    if op_name(node) == "einsum":
        return [a for a in _einsum_operands(node) if isinstance(a, fx.Node)]
    if op_name(node) in _ALIAS_EVERY_ARG:
        found: list = []
        fx.node.map_arg(node.args, found.append)
        return found
    return _nodes_in(_first_arg(node))


def _bases(node: fx.Node, limit: int) -> Optional[list]:
    """The tensors whose memory `node` may be a view of (None past `limit` nodes), with every graph input that shares
    memory with an input among them (`f(lens, lens.view(-1))`, a buffer registered as a slice of another)."""
    up = _views_up(node, limit)
    if up is None:
        return None
    bases = [n for n in up if not _alias_inputs(n)]
    if any(b.op in ("placeholder", "get_attr") for b in bases):
        bases += [n for n in _storage_siblings(bases) if n not in bases]
    return bases


def _input_storage(node: fx.Node) -> Any:
    """The storage of a graph input's value (a placeholder's example value, a module attribute), or None."""
    val: Any = None
    if node.op == "placeholder":
        val = example_value(node)
    elif node.op == "get_attr":
        val = node.graph.owning_module
        for part in str(node.target).split("."):
            val = getattr(val, part, None)
    if not isinstance(val, torch.Tensor) or val.is_sparse or val.layout != torch.strided:
        return None
    try:
        from torch.multiprocessing.reductions import StorageWeakRef

        return StorageWeakRef(val.untyped_storage())
    except Exception:  # noqa: BLE001 - a tensor without storage (a subclass): no sibling is known
        return None


_INPUT_STORAGES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _input_storages(graph: fx.Graph) -> dict:
    """{graph input node: its storage} for the graph's placeholders and attributes, made once per graph size."""
    size = len(graph.nodes)
    got = _INPUT_STORAGES.get(graph)
    if got is None or got[0] != size:
        table = {}
        for n in graph.nodes:
            if n.op in ("placeholder", "get_attr"):
                key = _input_storage(n)
                if key is not None:
                    table[n] = key
        got = (size, table)
        _INPUT_STORAGES[graph] = got
    return got[1]


def _storage_siblings(bases: list) -> list:
    """The graph inputs other than `bases` whose memory is that of an input among them (Dynamo's fake inputs keep
    the callers' aliasing, so two inputs that share memory share one storage)."""
    table = _input_storages(bases[0].graph)
    keys = [table[b] for b in bases if b in table]
    if not keys:
        return []
    return [n for n, k in table.items() if n not in bases and any(k == key for key in keys)]


def _class_written(bases: list, limit: int, counts: Callable[[fx.Node], bool]) -> bool:
    """Whether a write that `counts` into the memory of `bases` or any view of them stands in the graph (True as
    well past `limit` nodes): down through every view (a view in any argument position, the wider reading)."""
    seen, todo = set(bases), list(bases)
    while todo:
        n = todo.pop()
        if len(seen) > limit or (is_inplace(n) and counts(n)):
            return True
        for u in n.users:
            if writes_into(u, n) and counts(u):
                return True
            if u not in seen and may_alias(u) and _may_hold_tensor(u):
                seen.add(u)
                todo.append(u)
    return False


def _stands_after(after: fx.Node, inclusive: bool) -> Callable[[fx.Node], bool]:
    """write -> whether it stands after `after` (or is `after`, with `inclusive`); the nodes before are listed
    once, when a first write is asked about."""
    earlier: Optional[set] = None

    def test(write: fx.Node) -> bool:
        nonlocal earlier
        if earlier is None:
            earlier = set()
            for n in after.graph.nodes:
                if n is after:
                    if not inclusive:
                        earlier.add(n)
                    break
                earlier.add(n)
        return write not in earlier

    return test


def written_in_place(node: fx.Node, limit: int = 4096, after: Optional[fx.Node] = None) -> bool:
    """Is the memory of `node`'s value written in place anywhere in the graph: through `node`, the tensors it is
    a view of, or any view of those? True as well when more than `limit` nodes would have to be walked. With
    `after`, writes that stand before it into memory the graph allocated itself (no input's, no module
    attribute's) do not count: they made the value a reader at `after` sees (a mask built by writing slices
    of a `torch.full`), and functionalization gives that reader the finished value."""
    bases = _bases(node, limit)
    if bases is None:
        return True
    own = after is not None and all(b.op in ("call_function", "call_method") for b in bases)
    return _class_written(bases, limit, _stands_after(after, inclusive=True) if own else lambda w: True)


def written_after(node: fx.Node, after: fx.Node, limit: int = 4096) -> bool:
    """Is the memory of `node`'s value (its whole alias class, as written_in_place reads it) written by a node that
    stands after `after` in the graph, or past `limit` nodes? A copy made at `after` holds the values its source had
    there: a later write into either makes the two differ, an earlier one does not."""
    bases = _bases(node, limit)
    return bases is None or _class_written(bases, limit, _stands_after(after, inclusive=False))


def written_between(node: fx.Node, start: fx.Node, end: fx.Node, limit: int = 4096) -> bool:
    """Is the memory of `node`'s value (its whole alias class) written by a node that stands after `start` and
    before `end` in the graph, or past `limit` nodes? What a reader at `start` and one at `end` see differs only so."""
    bases = _bases(node, limit)
    return bases is None or _class_written(bases, limit, _stands_between(start, end))


def _stands_between(start: fx.Node, end: fx.Node) -> Callable[[fx.Node], bool]:
    """write -> whether it stands after `start` and before `end`; the nodes between are listed once, when a first
    write is asked about."""
    between: Optional[set] = None

    def test(write: fx.Node) -> bool:
        nonlocal between
        if between is None:
            between, n = set(), start.next
            while n is not end and n.op != "root":
                between.add(n)
                n = n.next
        return write in between

    return test


def copy_parted(copy: fx.Node, src: fx.Node) -> bool:
    """Whether a copy of `src` made at `copy` may hold other values than `src` where either is read: the copy is
    written in place anywhere (eager reads the written copy: `k = k.clone(); k[..., :2] = rotated`), or `src` is
    written after the copy was made."""
    return written_after(copy, copy) or written_after(src, copy)


# Deterministic ops without effects whose result is fixed by their arguments: two nodes of one of them with equal
# arguments hold equal values (`~causal` spelled twice). Random or effectful ops are not here.
_PURE = frozenset((
    "invert", "__invert__", "logical_not", "bitwise_not", "logical_and", "logical_or", "bitwise_and", "bitwise_or",
    "__and__", "__or__", "eq", "ne", "lt", "le", "gt", "ge", "__eq__", "__ne__", "__lt__", "__le__", "__gt__",
    "__ge__", "tril", "triu", "bool", "to", "float", "long", "int", "unsqueeze", "view", "reshape", "expand",
    "getitem", "sub", "add", "neg", "abs", "arange", "ones", "zeros", "full", "ones_like", "zeros_like",
))


def same_value(a: Any, b: Any, depth: int = 6) -> bool:
    """Whether nodes `a` and `b` hold equal values wherever they are read: the same node, or two computations of
    one pure op (_PURE) on equal arguments (compared the same way, `depth` levels up), neither written in place."""
    if a is b:
        return True
    if not isinstance(a, fx.Node) or not isinstance(b, fx.Node):
        return type(a) is type(b) and not isinstance(a, torch.Tensor) and a == b
    if depth <= 0 or a.op != b.op or a.op not in ("call_function", "call_method") or a.target != b.target:
        return False
    if op_name(a) not in _PURE or len(a.args) != len(b.args) or a.kwargs.keys() != b.kwargs.keys():
        return False
    if written_in_place(a) or written_in_place(b):
        return False

    def equal(x: Any, y: Any) -> bool:
        if isinstance(x, (tuple, list)) and isinstance(y, (tuple, list)):
            return len(x) == len(y) and all(equal(p, q) for p, q in zip(x, y))
        if isinstance(x, slice) and isinstance(y, slice):
            return equal((x.start, x.stop, x.step), (y.start, y.stop, y.step))
        return same_value(x, y, depth - 1)

    if not (equal(a.args, b.args) and all(equal(a.kwargs[k], b.kwargs[k]) for k in a.kwargs)):
        return False
    # the same inputs, read at two places: equal only where nothing writes them in between (`m.float()`, then
    # `m.fill_(1)`, then `m.float()` again)
    first, second = (a, b) if _precedes(a, b) else (b, a)
    inputs: list = []
    fx.node.map_arg((a.args, a.kwargs), inputs.append)
    return not any(written_between(x, first, second) for x in inputs)


def _precedes(a: fx.Node, b: fx.Node, limit: int = 1 << 16) -> bool:
    """Whether `a` stands before `b` in their graph."""
    n = a.next
    for _ in range(limit):
        if n is b:
            return True
        if n.op == "root":
            return False
        n = n.next
    return False


def escapes(node: fx.Node, limit: int = 4096) -> bool:
    """Whether `node`'s memory may leave the graph: `node` itself or a view of it (an in-place op's result is its
    input) is a graph output. The caller may then write into it (`o += x` after the call, or in the next graph after
    a graph break); True as well when more than `limit` nodes would have to be walked."""
    seen, todo = {node}, [node]
    while todo:
        n = todo.pop()
        for u in n.users:
            if u.op == "output":
                return True
            if u not in seen and (may_alias(u) or is_inplace(u)) and _may_hold_tensor(u):
                if len(seen) > limit:
                    return True
                seen.add(u)
                todo.append(u)
    return False


def _views_up(node: fx.Node, limit: int) -> Optional[list]:
    """`node` and every node whose memory it may share, up through views and what in-place ops wrote into (in the
    order reached); None when more than `limit` nodes would have to be walked."""
    seen, order, todo = set(), [], [node]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        order.append(n)
        if len(seen) > limit:
            return None
        todo.extend(_alias_inputs(n))
    return order


def may_be_view_of(node: fx.Node, base: fx.Node, limit: int = 256) -> bool:
    """Whether `node`'s value may share memory with `base`'s (see _views_up); True as well past `limit` nodes."""
    up = _views_up(node, limit)
    return up is None or base in up
