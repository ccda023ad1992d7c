"""Surface spellings -> one small op vocabulary, as a *view* over the Dynamo graph.

Dynamo hands over torch IR in many spellings of the same operation (`torch.matmul`, `operator.matmul`,
`Tensor.matmul`, `x @ y`; `F.softmax`, `torch.softmax`, `x.softmax`; `.float()`, `.to(dtype)`, `.type_as`,
...). Rewriting every node into one canonical spelling would cost a pass over the whole graph on every
recompile and risk touching code that is not attention, so the graph is left as it is: `kind(node)`
names the canonical operation a node performs and the accessors below read its arguments whatever the
spelling. Adding a spelling is one table entry here.
"""
from __future__ import annotations

import math
import operator
from typing import Any, Optional

import torch
import torch.fx as fx
import torch.nn.functional as F

from .emit import example_value


def canonicalize(gm: fx.GraphModule) -> None:
    """Nothing to rewrite: the site finder reads spellings through `kind` and the accessors below."""
    return None


def _fn_table() -> dict:
    t: dict = {}

    def put(k: str, *targets: Any) -> None:
        for x in targets:
            if x is not None:
                t[x] = k

    g = lambda mod, name: getattr(mod, name, None)  # noqa: E731  (absent in some torch versions)
    put("softmax", F.softmax, torch.softmax, torch.Tensor.softmax, g(torch.special, "softmax"))
    put("matmul", operator.matmul, torch.matmul, torch.Tensor.matmul, torch.bmm, torch.Tensor.bmm)
    put("einsum", torch.einsum, g(torch.functional, "einsum"))
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
    "softmax": "softmax", "matmul": "matmul", "bmm": "matmul", "__matmul__": "matmul", "einsum": "einsum",
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

_FUNCTIONS: Optional[dict] = None


def kind(node: Any) -> Optional[str]:
    """The canonical operation of a node, or None when it is none of the vocabulary."""
    global _FUNCTIONS
    if not isinstance(node, fx.Node):
        return None
    if node.op == "call_method":
        k = _METHODS.get(node.target)
    elif node.op == "call_function":
        if _FUNCTIONS is None:
            _FUNCTIONS = _fn_table()
        try:
            k = _FUNCTIONS.get(node.target)
        except TypeError:  # unhashable target
            k = None
    else:
        return None
    if k == "cast" and not _is_dtype_cast(node):
        return None
    return k


_OPERATOR_INPLACE = (operator.setitem, operator.iadd, operator.isub, operator.imul, operator.itruediv,
                     operator.iand, operator.ior, operator.ixor, operator.ifloordiv, operator.imod, operator.ipow)


def is_inplace(node: fx.Node) -> bool:
    """An op that writes into its first argument (`x.add_(1)`, `operator.setitem`, `torch.Tensor.mul_`)."""
    if node.op not in ("call_method", "call_function"):
        return False
    if node.target in _OPERATOR_INPLACE:  # in place on tensors only (`n += 1` on a SymInt is not)
        return bool(node.args) and tensor_of(node.args[0]) is not None
    if node.op == "call_function" and getattr(node.target, "__module__", None) in ("_operator", "operator"):
        return False  # operator.and_ / or_ / not_ are functional despite the underscore
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
    return isinstance(name, str) and name.endswith("_") and not name.endswith("__")


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
    """(input, dim normalised to >= 0 or None when it cannot be read, dtype argument)."""
    x = node.args[0]
    dim = arg(node, 1, "dim")
    dtype = node.kwargs.get("dtype")
    if node.target is F.softmax and len(node.args) > 3:
        dtype = node.args[3]
    elif node.target is not F.softmax and len(node.args) > 2:
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


def dropout_args(node: fx.Node) -> tuple[fx.Node, Any, Any]:
    """(input, p, training) of F.dropout(input, p=0.5, training=True, inplace=False) / torch.dropout(input, p, train)."""
    if node.target is torch.dropout:
        return node.args[0], arg(node, 1, "p", 0.5), arg(node, 2, "train", True)
    return node.args[0], arg(node, 1, "p", 0.5), arg(node, 2, "training", True)


_CONST_MAKERS = (torch.tensor, torch.scalar_tensor, torch.as_tensor)


def constant_value(x: Any) -> Optional[float]:
    """A Python number that `x` is (a literal, or a node building a 0-d tensor of a literal), else None."""
    if isinstance(x, bool):
        return None
    if isinstance(x, (int, float)):
        return float(x)
    if isinstance(x, fx.Node) and x.op == "call_function":
        if x.target in _CONST_MAKERS and x.args and isinstance(x.args[0], (int, float)) and not isinstance(x.args[0], bool):
            return float(x.args[0])
        if x.target in (torch.full,) and len(x.args) >= 2 and x.args[0] in ((), []) and isinstance(x.args[1], (int, float)):
            return float(x.args[1])
    return None


def is_finite_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def is_symbolic_scalar(x: Any) -> bool:
    """A node producing a SymInt / SymFloat (e.g. `math.sqrt(q.size(-1))` under dynamic shapes)."""
    if not isinstance(x, fx.Node):
        return False
    v = example_value(x)
    return isinstance(v, (torch.SymInt, torch.SymFloat, int, float)) and not isinstance(v, bool)
