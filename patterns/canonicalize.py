"""Surface spellings -> one small op vocabulary, as a *view* over the Dynamo graph.

Dynamo hands over torch IR in many spellings of the same operation (`torch.matmul`, `operator.matmul`,
`Tensor.matmul`, `x @ y`; `F.softmax`, `torch.softmax`, `x.softmax`; `.float()`, `.to(dtype)`, `.type_as`,
...). Rewriting every node into one canonical spelling would cost a pass over the whole graph on every
recompile and risk touching code that is not attention, so spellings are left as they are: `kind(node)`
names the canonical operation a node performs and the accessors below read its arguments whatever the
spelling. Adding a spelling is one table entry here. The few edits made to the graph (`canonicalize`) each
change what the graph means to the analysis, not what it computes.
"""
from __future__ import annotations

import math
import operator
from typing import Any, Optional

import torch
import torch.fx as fx
import torch.nn.functional as F

from .aliasing import is_inplace, written_in_place
from .emit import example_value


def canonicalize(gm: fx.GraphModule) -> bool:
    """The graph edits made before analysis, each proven to keep every value and gradient (see aten_spellings.py,
    view_attributes.py, identity_views.py, functionalize.py, slice_update.py, reshaped_terms.py, key_major.py,
    query_axis.py and dead_code.py): ATen overloads called by name become the torch functions they are, metadata
    checks that hold are dropped, transposes spelled as attributes (`x.mT`) become `x.transpose(a, b)`, view chains
    (expands included) that give back a tensor's layout become the tensor, in-place updates of tensors
    nothing else aliases become their functional op, terms added to a slice of the scores and written back become
    zero-padded terms of the scores, terms added to a reshaped view of a tensor that is viewed back become terms of
    that tensor, key-major scores normalised over dim -2 become query-major ones, single-query scores written
    without a query axis gain one, and nodes whose result nobody reads and whose computation changes nothing else
    are removed. Every other spelling is read through `kind` and the accessors below. True when the graph changed
    (the pass puts it back when no site is rewritten)."""
    from .aten_spellings import spell_aten_ops
    from .dead_code import remove_dead_pure_nodes
    from .functionalize import functionalize_inplace
    from .identity_views import drop_identity_views
    from .key_major import fold_key_major_scores
    from .query_axis import fold_query_axis
    from .reshaped_terms import fold_reshaped_terms
    from .slice_update import fold_slice_updates
    from .view_attributes import spell_view_attributes

    changed = spell_aten_ops(gm)
    changed = spell_view_attributes(gm) or changed
    changed = drop_identity_views(gm) or changed
    changed = functionalize_inplace(gm) or changed
    changed = fold_slice_updates(gm) or changed
    changed = fold_reshaped_terms(gm) or changed
    changed = fold_key_major_scores(gm) or changed
    changed = fold_query_axis(gm) or changed
    return remove_dead_pure_nodes(gm) or changed


def _fn_table() -> dict:
    t: dict = {}

    def put(k: str, *targets: Any) -> None:
        for x in targets:
            if x is not None:
                t[x] = k

    g = lambda mod, name: getattr(mod, name, None)  # noqa: E731  (absent in some torch versions)
    put("softmax", F.softmax, torch.softmax, torch.Tensor.softmax, g(torch.special, "softmax"))
    put("matmul", operator.matmul, torch.matmul, torch.Tensor.matmul, torch.bmm, torch.Tensor.bmm, torch.mm,
        torch.Tensor.mm)
    put("einsum", torch.einsum, g(torch.functional, "einsum"))
    put("linear", F.linear)  # F.linear(x, w, b) = x @ wᵀ (+ b): one contraction
    put("baddbmm", torch.baddbmm, torch.Tensor.baddbmm)
    put("mul", operator.mul, torch.mul, torch.multiply, torch.Tensor.mul, operator.imul)
    put("div", operator.truediv, torch.div, torch.divide, torch.true_divide, torch.Tensor.div, operator.itruediv)
    put("add", operator.add, torch.add, torch.Tensor.add, operator.iadd)
    put("sub", operator.sub, torch.sub, torch.subtract, torch.Tensor.sub, operator.isub)
    put("masked_fill", torch.masked_fill, torch.Tensor.masked_fill)
    put("where", torch.where)
    put("tanh", torch.tanh, torch.Tensor.tanh, F.tanh)
    put("dropout", F.dropout, torch.dropout)
    put("transpose", torch.transpose, torch.swapaxes, torch.swapdims, torch.Tensor.transpose)
    put("permute", torch.permute, torch.Tensor.permute)
    put("reshape", torch.reshape, torch.Tensor.reshape, torch.Tensor.view)
    put("unsqueeze", torch.unsqueeze, torch.Tensor.unsqueeze)
    put("expand", torch.Tensor.expand)
    put("repeat_interleave", torch.repeat_interleave, torch.Tensor.repeat_interleave)
    put("identity", torch.clone, torch.Tensor.clone, torch.Tensor.contiguous)
    put("getitem", operator.getitem)
    return t


_METHODS = {
    "softmax": "softmax", "matmul": "matmul", "bmm": "matmul", "mm": "matmul", "__matmul__": "matmul",
    "einsum": "einsum",
    "baddbmm": "baddbmm", "mul": "mul", "multiply": "mul", "__mul__": "mul", "__rmul__": "mul", "mul_": "mul",
    "div": "div", "divide": "div", "true_divide": "div", "__truediv__": "div", "div_": "div",
    "add": "add", "__add__": "add", "__radd__": "add", "add_": "add", "sub": "sub", "__sub__": "sub",
    "masked_fill": "masked_fill", "masked_fill_": "masked_fill", "tanh": "tanh",
    "transpose": "transpose", "swapaxes": "transpose", "swapdims": "transpose", "permute": "permute",
    "view": "reshape", "reshape": "reshape", "unsqueeze": "unsqueeze", "expand": "expand",
    "repeat_interleave": "repeat_interleave", "contiguous": "identity", "clone": "identity",
    "float": "cast", "half": "cast", "bfloat16": "cast", "double": "cast", "to": "cast", "type": "cast",
    "type_as": "cast", "dropout": "dropout",
}

_LOG_SOFTMAX_FNS = tuple(f for f in (F.log_softmax, torch.log_softmax, torch.Tensor.log_softmax,
                                     getattr(torch.special, "log_softmax", None)) if f is not None)
_EXP_FNS = (torch.exp, torch.Tensor.exp)


def _is_log_softmax(node: Any) -> bool:
    if not isinstance(node, fx.Node):
        return False
    if node.op == "call_method":
        return node.target == "log_softmax"
    return node.op == "call_function" and node.target in _LOG_SOFTMAX_FNS


def log_softmax_of(node: Any) -> Optional[fx.Node]:
    """L when `node` is exp(L) for L = log_softmax(x): softmax(x), spelled through the log-probabilities
    (exp(x - max - log Σ exp(x - max)) is softmax's own formula). L may have other readers: the site
    finder refuses those, as it does a second reader of the probabilities."""
    if not _is_exp(node) or not _is_log_softmax(node.args[0]):
        return None
    return node.args[0]


def _is_exp(node: Any) -> bool:
    """node is exp(x) of one tensor argument, any spelling."""
    if not isinstance(node, fx.Node) or len(node.args) != 1 or node.kwargs:
        return False
    return (node.op == "call_method" and node.target == "exp") or \
        (node.op == "call_function" and node.target in _EXP_FNS)


_SUB_FNS = (operator.sub, torch.sub, torch.subtract, torch.Tensor.sub)


def _is_sub(y: Any) -> bool:
    """y is a - b (two arguments, no alpha), any spelling."""
    return isinstance(y, fx.Node) and len(y.args) == 2 and not y.kwargs and (
        (y.op == "call_method" and y.target in ("sub", "__sub__")) or (y.op == "call_function" and y.target in _SUB_FNS))


_LOGSUMEXP_FNS = (torch.logsumexp, torch.Tensor.logsumexp)


def exp_lse_of(node: Any) -> Optional[tuple[fx.Node, fx.Node]]:
    """(D, L) when `node` is exp(D), D = x - L, L = logsumexp(x, -1, keepdim=True): softmax(x) through its
    log-normaliser (Reformer). logsumexp subtracts the row max itself, so the exp overflows nowhere softmax does not.
    D and L may have other readers: the site finder refuses those."""
    if not _is_exp(node) or not _is_sub(node.args[0]):
        return None
    d = node.args[0]
    x, lse = d.args
    if not isinstance(lse, fx.Node) or not lse.args or lse.args[0] is not x or tensor_of(x) is None or not (
            (lse.op == "call_method" and lse.target == "logsumexp") or
            (lse.op == "call_function" and lse.target in _LOGSUMEXP_FNS)):
        return None
    dim, keep = arg(lse, 1, "dim"), arg(lse, 2, "keepdim", False)
    if isinstance(dim, (list, tuple)) and len(dim) == 1:
        dim = dim[0]
    nd = tensor_of(x).dim()
    if not isinstance(dim, int) or nd == 0 or dim % nd != nd - 1 or keep is not True or len(lse.args) > 3:
        return None
    return d, lse


def _is_detach(n: Any) -> bool:
    return isinstance(n, fx.Node) and ((n.op == "call_method" and n.target == "detach") or (
        n.op == "call_function" and n.target in (torch.detach, torch.Tensor.detach)))


def row_max_of(m: Any, s: Any) -> Optional[fx.Node]:
    """The max/amax node when m is s.amax(-1, keepdim=True) or s.max(-1, keepdim=True)[0], detached or not, before
    or after the reduction (softmax is invariant to the shift: the gradients through it cancel either way)."""
    while _is_detach(m):
        m = m.args[0]
    if not isinstance(m, fx.Node) or tensor_of(s) is None:
        return None
    if m.target is operator.getitem and m.args[1] == 0:
        m = m.args[0]
        names = ("max",)
    else:
        names = ("amax",)
    name = m.target if m.op == "call_method" else getattr(m.target, "__name__", "")
    if name not in names or not m.args or not (m.args[0] is s or (_is_detach(m.args[0]) and m.args[0].args[0] is s)):
        return None
    dim, keep = arg(m, 1, "dim"), arg(m, 2, "keepdim", False)
    nd = tensor_of(s).dim()
    if isinstance(dim, (list, tuple)) and len(dim) == 1:
        dim = dim[0]
    if not isinstance(dim, int) or dim % nd != nd - 1 or keep is not True:
        return None
    return m


_DIV_FNS = (operator.truediv, torch.div, torch.divide, torch.true_divide, torch.Tensor.div)
_SUM_FNS = (torch.sum, torch.Tensor.sum)


def _is_last_dim_sum(node: Any, x: fx.Node) -> bool:
    """node is x.sum(-1, keepdim=True) (any spelling of the last dim, no dtype)."""
    if not isinstance(node, fx.Node) or not node.args or node.args[0] is not x or "dtype" in node.kwargs:
        return False
    if not ((node.op == "call_method" and node.target == "sum") or
            (node.op == "call_function" and node.target in _SUM_FNS)):
        return False
    dim, keep = arg(node, 1, "dim"), arg(node, 2, "keepdim", False)
    if isinstance(dim, (list, tuple)) and len(dim) == 1:
        dim = dim[0]
    t = tensor_of(x)
    return t is not None and isinstance(dim, int) and dim % max(t.dim(), 1) == t.dim() - 1 and keep is True


def exp_sum_of(node: Any) -> Optional[tuple[fx.Node, fx.Node]]:
    """(E, S) when `node` is E / S with E = exp(s - rowmax(s)) and S = E.sum(-1, keepdim=True): softmax(s)
    written out with its own formula. Only with the row max subtracted: there eager's exp cannot overflow,
    as softmax's cannot; exp(s) / Σ exp(s) overflows where softmax does not, so it is not read as one.
    E and S may have other readers: the site finder refuses those."""
    if not isinstance(node, fx.Node) or len(node.args) != 2 or node.kwargs:
        return None
    is_div = (node.op == "call_method" and node.target in ("div", "__truediv__")) or \
        (node.op == "call_function" and node.target in _DIV_FNS)
    e, den = node.args
    if not is_div or not stable_exp_sum(e, den):
        return None
    return e, den


def stable_exp_sum(e: Any, den: Any) -> bool:
    """e is exp(s - rowmax(s)) and den is e.sum(-1, keepdim=True): softmax's numerator and denominator."""
    if not isinstance(e, fx.Node) or not _is_last_dim_sum(den, e) or not _is_exp(e):
        return False
    y = e.args[0]
    return _is_sub(y) and row_max_of(y.args[1], y.args[0]) is not None


_FUNCTIONS: Optional[dict] = None


def kind(node: Any) -> Optional[str]:
    """The canonical operation of a node, or None when it is none of the vocabulary."""
    global _FUNCTIONS
    if not isinstance(node, fx.Node):
        return None
    if node.op == "call_method":
        k = _METHODS.get(node.target)
        if k is None and (log_softmax_of(node) is not None or exp_lse_of(node) is not None):
            k = "softmax"
    elif node.op == "call_function":
        if _FUNCTIONS is None:
            _FUNCTIONS = _fn_table()
        try:
            k = _FUNCTIONS.get(node.target)
        except TypeError:  # unhashable target
            k = None
        if k is None and (log_softmax_of(node) is not None or exp_lse_of(node) is not None):
            k = "softmax"
    else:
        return None
    if k == "cast" and not _is_dtype_cast(node):
        return None
    if k == "div" and node.kwargs.get("rounding_mode") is not None:
        return None  # floor / trunc division: a step of its own (gradient 0), not a scale
    if k == "div" and exp_sum_of(node) is not None:
        k = "softmax"
    return k


# Steps an attention's scores take between Q·Kᵀ and the softmax, and its probabilities between the softmax and P·V,
# as the graph edits before the site finder follow them (the finder itself reads each step's role).
SCORE_STEPS = ("add", "sub", "mul", "div", "masked_fill", "where", "cast", "tanh")
PROB_STEPS = ("dropout", "cast", "identity")


def reaches_softmax(node: fx.Node, kinds: tuple, forward: bool, depth: int = 8) -> bool:
    """Forward: node's readers lead, one reader each, through steps of `kinds` to a softmax. Backward: node is a
    softmax, or a step of `kinds` whose first input is one, or comes from one so."""
    n = node
    if forward:
        for _ in range(depth):
            if len(n.users) != 1:
                return False
            n = next(iter(n.users))
            if kind(n) == "softmax":
                return True
            if kind(n) not in kinds or is_inplace(n):
                return False
        return False
    for _ in range(depth):
        if kind(n) == "softmax":
            return True
        if kind(n) not in kinds or is_inplace(n) or not n.args or not isinstance(n.args[0], fx.Node):
            return False
        n = n.args[0]
    return False


def two_operand_einsum(node: Any) -> Optional[tuple[str, str, str, fx.Node, fx.Node]]:
    """(x, y, z, a, b) of `torch.einsum("x,y->z", a, b)` (operands given apart or as one list) with an explicit output,
    no ellipsis, no repeated letter within a subscript and a letter for every dim of each operand; else None."""
    if kind(node) != "einsum" or node.kwargs or len(node.args) not in (2, 3) or not isinstance(node.args[0], str):
        return None
    ops = node.args[1:] if len(node.args) == 3 else node.args[1]
    if not isinstance(ops, (list, tuple)) or len(ops) != 2 or not all(isinstance(o, fx.Node) for o in ops):
        return None
    eq = node.args[0].replace(" ", "")
    if "..." in eq or "->" not in eq or eq.count(",") != 1:
        return None
    lhs, z = eq.split("->")
    x, y = lhs.split(",")
    a, b = ops
    ta, tb = tensor_of(a), tensor_of(b)
    if ta is None or tb is None or len(x) != ta.dim() or len(y) != tb.dim():
        return None
    if any(len(set(sub)) != len(sub) for sub in (x, y, z)):
        return None
    return x, y, z, a, b


def comes_before(graph: fx.Graph, a: fx.Node, b: fx.Node) -> bool:
    """a stands before b in the graph's order (False when neither or only b is found first)."""
    for n in graph.nodes:
        if n is a:
            return True
        if n is b:
            return False
    return False


def arg(node: fx.Node, index: int, name: str, default: Any = None) -> Any:
    """Argument `index` (positional) or `name` (keyword); methods count `self` as index 0."""
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(name, default)


def tensor_of(x: Any) -> Optional[torch.Tensor]:
    v = example_value(x) if isinstance(x, fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


def _is_dtype_cast(node: fx.Node) -> bool:
    """A `.to`/`.type`/`.float`-style call that only changes the floating dtype (same shape, same device)."""
    if not node.args or not isinstance(node.args[0], fx.Node):
        return False
    src, out = tensor_of(node.args[0]), tensor_of(node)
    if src is None or out is None:
        return False
    if not (src.dtype.is_floating_point and out.dtype.is_floating_point):
        return False
    if src.device != out.device or src.dim() != out.dim():
        return False
    return node.kwargs.get("memory_format") is None and not node.kwargs.get("copy", False)


def softmax_args(node: fx.Node) -> tuple[fx.Node, Optional[int], Optional[torch.dtype]]:
    """(input, dim normalised to >= 0 or None when it cannot be read, dtype argument); for exp of a
    log_softmax, those of the log_softmax; for exp(y) / Σ exp(y), (y, its last dim, None); for exp(x - logsumexp(x)),
    (x, its last dim, None)."""
    es = exp_sum_of(node)
    if es is not None:
        y = es[0].args[0]
        return y, tensor_of(y).dim() - 1, None
    el = exp_lse_of(node)
    if el is not None:
        x = el[1].args[0]
        return x, tensor_of(x).dim() - 1, None
    node = log_softmax_of(node) or node
    x = node.args[0]
    dim = arg(node, 1, "dim")
    dtype = node.kwargs.get("dtype")
    functional = node.target in (F.softmax, F.log_softmax)  # F.*(input, dim, _stacklevel, dtype)
    if functional and len(node.args) > 3:
        dtype = node.args[3]
    elif not functional and len(node.args) > 2:
        dtype = node.args[2]
    t = tensor_of(x)
    if t is None:
        return x, None, dtype
    nd = t.dim()
    if dim is None:  # F.softmax's legacy implicit dim
        dim = 0 if nd in (0, 1, 3) else 1
    if not isinstance(dim, int):
        return x, None, dtype
    return x, dim % max(nd, 1), dtype


_PLAIN_SOFTMAX = (F.softmax, torch.softmax, torch.Tensor.softmax, "softmax")


def plain_softmax_args(node: fx.Node) -> Optional[tuple[fx.Node, Optional[int], Optional[torch.dtype]]]:
    """softmax_args of a softmax called as such (not one spelled by its formula or through log_softmax); else None."""
    if node.target not in _PLAIN_SOFTMAX or exp_sum_of(node) is not None or log_softmax_of(node) is not None:
        return None
    return softmax_args(node)


_META_FUNCTIONS = (torch.ones_like, torch.zeros_like, torch.full_like, torch.empty_like)
_META_METHODS = ("new_ones", "new_zeros", "new_full", "new_empty", "size", "dim", "numel", "ndimension",
                 "nelement", "get_device")
_META_ATTRS = ("shape", "dtype", "device", "ndim", "is_cuda", "layout")


_SHAPE_OF_OTHER = ("expand_as", "reshape_as", "view_as")


def reads_only_metadata(user: fx.Node, node: fx.Node) -> bool:
    """Does `user` read only `node`'s shape / dtype / device, never its values? (`torch.ones_like(s)`,
    `s.new_full(...)`, `s.size(-1)`, `x.to(s)`, `x.type_as(s)`, `m.expand_as(s)`): such a use is not a use of the
    values."""
    if user.op not in ("call_function", "call_method"):
        return False
    first = user.args[0] if user.args else None
    if kind(user) == "cast" and first is not node:
        return True  # `x.type_as(s)` / `x.to(s)`: s gives the dtype only
    if user.op == "call_method" and user.target in _SHAPE_OF_OTHER and len(user.args) == 2 and not user.kwargs \
            and user.args[1] is node and first is not node:
        return True  # `m.expand_as(s)` / `b.reshape_as(s)`: s gives the shape only
    elsewhere: list = []
    fx.node.map_arg((user.args[1:], user.kwargs), lambda a: elsewhere.append(a) if a is node else None)
    if first is not node or elsewhere:
        return False
    if user.op == "call_method":
        return user.target in _META_METHODS
    if user.target is getattr:
        return len(user.args) == 2 and user.args[1] in _META_ATTRS
    return user.target in _META_FUNCTIONS or getattr(user.target, "__name__", "") == "sym_size"


def dropout_args(node: fx.Node) -> tuple[fx.Node, Any, Any]:
    """(input, p, training) of F.dropout(input, p=0.5, training=True, inplace=False) / torch.dropout(input, p, train)."""
    if node.target is torch.dropout:
        return first_input(node), arg(node, 1, "p", 0.5), arg(node, 2, "train", True)
    return first_input(node), arg(node, 1, "p", 0.5), arg(node, 2, "training", True)


def first_input(node: fx.Node) -> Any:
    """The first argument, positional or given as `input=` (`F.dropout(input=p)`); None without one."""
    return node.args[0] if node.args else node.kwargs.get("input")


_CONST_MAKERS = (torch.tensor, torch.scalar_tensor, torch.as_tensor)


def constant_value(x: Any) -> Optional[float]:
    """A Python number that `x` is (a literal, or a node building a 0-d tensor of a literal that nothing writes in
    place), else None. A tensor's
    number is the value it holds in its dtype: `torch.tensor(1/3, dtype=torch.bfloat16)` is 0.333984375, and
    `torch.tensor(-1e9, dtype=torch.float16)` is -inf, as eager computes with them."""
    if isinstance(x, bool):
        return None
    if isinstance(x, (int, float)):
        return float(x)
    if isinstance(x, fx.Node) and x.op == "call_function":
        lit = None
        if x.target in _CONST_MAKERS and x.args and isinstance(x.args[0], (int, float)) and not isinstance(x.args[0], bool):
            lit = x.args[0]
        elif x.target in (torch.full,) and len(x.args) >= 2 and x.args[0] in ((), []) and isinstance(x.args[1], (int, float)) \
                and not isinstance(x.args[1], bool):
            lit = x.args[1]
        if lit is not None and not written_in_place(x):  # `c = torch.tensor(-1e4); c.fill_(3.0)` holds 3
            return _held(lit, tensor_of(x))
    return None


def _held(lit: float, t: Optional[torch.Tensor]) -> Optional[float]:
    """`lit` as a tensor like `t` holds it (its dtype's rounding, overflow to inf); None for a dtype that holds no
    real number like it (bool, complex) or a tensor not known."""
    if t is None or t.dtype == torch.bool or t.dtype.is_complex:
        return None
    try:
        return float(torch.tensor(lit, dtype=t.dtype))
    except (RuntimeError, OverflowError, TypeError):
        return None


def is_finite_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def is_symbolic_scalar(x: Any) -> bool:
    """A node producing a SymInt / SymFloat (e.g. `math.sqrt(q.size(-1))` under dynamic shapes)."""
    if not isinstance(x, fx.Node):
        return False
    v = example_value(x)
    return isinstance(v, (torch.SymInt, torch.SymFloat, int, float)) and not isinstance(v, bool)
