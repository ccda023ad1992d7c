"""ATen operator overloads called by name (`torch.ops.aten.softmax.int(x, -1)`), read as the torch functions
they are.

A graph Dynamo traces from a `torch.export`-ed program (`ep.module()`), or from code that calls `torch.ops.aten`
directly, holds `call_function` nodes whose targets are `OpOverload`s: `aten.matmul.default`,
`aten.transpose.int`, `aten.scaled_dot_product_attention.default`. `canonicalize.kind` and every walker name the
torch-level spellings, so such a graph had no site. Each overload in `_TABLE` is replaced by the public function
that resolves to that same overload for the node's arguments: the node computes the same kernel on the same
arguments, so values, gradients and aliasing are unchanged. The table pairs an overload with its function only
where the positional arguments and the keyword names agree (the first argument, `self` in the schema, is always
passed by position here; a node that names it is left alone). Overloads whose torch-level function would choose
another overload (`_unsafe_view`) are not in the table; two that the core ATen IR of `run_decompositions()` keeps
are read with their arguments changed: `aten._softmax(x, dim, False)` is `torch.softmax(x, dim)`, and
`aten._to_copy(x, dtype=d)` into another dtype is `x.to(d)`.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Union

import torch
import torch.fx as fx
import torch.nn.functional as F

from .emit import example_value


def _table() -> dict[Any, Union[Callable, str]]:
    """overload -> the torch function, or the name of the Tensor method (a string) it is called as."""
    aten = torch.ops.aten
    t: dict[Any, Union[Callable, str]] = {}

    def put(fn: Union[Callable, str], packet: Any, *overloads: str, max_args: int = 0) -> None:
        for name in overloads:
            ov = getattr(packet, name, None)
            if ov is not None:
                t[ov] = fn
                if max_args:
                    _MAX_ARGS[ov] = max_args

    # the torch function of the overload's own name
    same = {"default": ("matmul", "bmm", "baddbmm", "exp", "logsumexp", "tanh", "dropout", "permute", "reshape",
                        "unsqueeze", "clone", "tril", "triu", "full", "zeros", "ones", "ones_like", "zeros_like",
                        "full_like", "scaled_dot_product_attention"),
            "int": ("softmax", "log_softmax", "transpose")}
    for overload, names in same.items():
        for name in names:
            put(getattr(torch, name, None) or getattr(F, name), getattr(aten, name), overload)
    for name in ("logical_not", "logical_and", "logical_or", "bitwise_not", "bitwise_and", "bitwise_or", "neg",
                 "abs", "minimum", "maximum"):
        put(getattr(torch, name), getattr(aten, name), "default", "Tensor")
    for cmp in ("lt", "le", "gt", "ge", "eq", "ne"):
        put(getattr(torch, cmp), getattr(aten, cmp), "Tensor", "Scalar")
    put(F.linear, aten.linear, "default")
    put(torch.mul, aten.mul, "Tensor", "Scalar")
    put(torch.div, aten.div, "Tensor", "Scalar", "Tensor_mode", "Scalar_mode")
    # add.Scalar(self, other, alpha) takes alpha by position, torch.add by keyword only (three positional
    # arguments there are a deprecated signature of another meaning): two at most
    put(torch.add, aten.add, "Tensor", "Scalar", max_args=2)
    put(torch.sub, aten.sub, "Tensor", "Scalar", max_args=2)
    put(torch.rsub, aten.rsub, "Tensor", "Scalar", max_args=2)
    put(torch.masked_fill, aten.masked_fill, "Scalar", "Tensor")
    put(torch.where, aten.where, "self", "ScalarSelf", "ScalarOther", "Scalar")
    put(torch.repeat_interleave, aten.repeat_interleave, "self_int", "self_Tensor")
    put(torch.arange, aten.arange, "default", "start", "start_step")
    put(torch.scalar_tensor, aten.scalar_tensor, "default")  # a decomposed masked_fill's fill value
    put(torch.cat, aten.cat, "default")  # a sink column (sinks.py)
    put("new_zeros", aten.new_zeros, "default")
    put("view", aten.view, "default")
    put("expand", aten.expand, "default")
    put("to", aten.to, "dtype", max_args=4)  # Tensor.to takes memory_format by keyword only
    put("type_as", aten.type_as, "default")
    put(torch.clone, aten.lift_fresh_copy, "default")  # torch.export's copy of a constant made in the code
    for name in ("expand_as", "view_as", "reshape_as"):  # they read the other tensor's shape only
        put(name, getattr(aten, name), "default")
    # a softmax written out (row max, exp, row sum)
    put(torch.amax, aten.amax, "default")
    put(torch.max, aten.max, "dim")  # (values, indices), read by getitem as torch.max's namedtuple is
    put(torch.sum, aten.sum, "dim_IntList")
    # a safe softmax's test for rows of -inf scores (find_sites/empty_row_test.py)
    put(torch.any, aten.any, "dim")
    put(torch.all, aten.all, "dim")
    put(torch.isneginf, aten.isneginf, "default")
    put(torch.einsum, aten.einsum, "default")  # (equation, [operands]), as torch.einsum also takes them
    # in-place updates torch.export keeps (`s.masked_fill_(m, c)`, `s /= d`, `s += b`); add_/sub_.Scalar take
    # alpha by position, the methods by keyword only
    put("masked_fill_", aten.masked_fill_, "Scalar", "Tensor")
    put("mul_", aten.mul_, "Tensor", "Scalar")
    put("div_", aten.div_, "Tensor", "Scalar")
    put("add_", aten.add_, "Tensor", "Scalar", max_args=2)
    put("sub_", aten.sub_, "Tensor", "Scalar", max_args=2)
    return t


_TABLE: Optional[dict] = None
_MAX_ARGS: dict = {}  # overload -> the most positional arguments its function reads as the overload does


def _function_for(node: fx.Node) -> Optional[Union[Callable, str]]:
    global _TABLE
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return None
    if _TABLE is None:
        _TABLE = _table()
    fn = _TABLE.get(node.target)
    if fn is None or "self" in node.kwargs or len(node.args) > _MAX_ARGS.get(node.target, len(node.args)):
        return None
    if node.target is torch.ops.aten.expand.default and node.kwargs.get("implicit"):
        return None
    if node.target is torch.ops.aten.einsum.default and node.kwargs:  # `path=`: torch.einsum takes none
        return None
    return fn


_ASSERT_METADATA = getattr(getattr(torch.ops.aten, "_assert_tensor_metadata", None), "default", None)


def _holds(node: fx.Node) -> bool:
    """`node` is `aten._assert_tensor_metadata(x, size, stride, dtype, device=, layout=)` (torch.export puts one
    before each `.to()`) and x's example value has that metadata. Dynamo's guards fix the dtype, device and layout
    of every input, and an intermediate's follow from them, so the check holds on every call that runs this
    graph: it reads nothing and is dropped (it would otherwise be a second reader of the probabilities)."""
    if node.op != "call_function" or node.target is not _ASSERT_METADATA:
        return False
    if node.users or not node.args or not isinstance(node.args[0], fx.Node):
        return False
    t = example_value(node.args[0])
    if not isinstance(t, torch.Tensor):
        return False
    names = ("size", "stride", "dtype")
    given = {**{n: a for n, a in zip(names, node.args[1:])}, **node.kwargs}
    want = {"size": tuple(t.shape), "stride": tuple(t.stride()), "dtype": t.dtype, "device": t.device,
            "layout": t.layout}
    for name, value in given.items():
        if value is None:
            continue
        if name not in want:
            return False
        have = want[name]
        if name in ("size", "stride"):
            value = tuple(value)
            if any(isinstance(x, torch.SymInt) for x in (*value, *have)):
                return False
        elif name == "device":
            value = torch.device(value)
        if value != have:
            return False
    return True


def _internal_softmax(node: fx.Node) -> Optional[Callable]:
    """torch.softmax / log_softmax for `aten._softmax(x, dim, False)` / `aten._log_softmax(x, dim, False)`, the core
    ATen ops `run_decompositions()` leaves: `torch.softmax(x, dim)` without a dtype calls exactly that overload
    (half_to_float False keeps x's dtype). A True half_to_float (a half input, fp32 out) is left as it is."""
    if node.op != "call_function" or node.kwargs or len(node.args) != 3 or node.args[2] is not False:
        return None
    aten = torch.ops.aten
    return {aten._softmax.default: torch.softmax, aten._log_softmax.default: torch.log_softmax}.get(node.target)


_TO_COPY = getattr(getattr(torch.ops.aten, "_to_copy", None), "default", None)


def _dtype_copy(node: fx.Node) -> bool:
    """`aten._to_copy(x, dtype=d)` (the core ATen IR's `.to(d)` / `.float()`, which also names x's strided layout and
    device) into another dtype than x's: exactly `x.to(d)`, which copies too there (a `.to` into x's own dtype would
    return x itself, so that one is left)."""
    if node.op != "call_function" or node.target is not _TO_COPY or len(node.args) != 1:
        return False
    kw = node.kwargs
    if "dtype" not in kw or set(kw) - {"dtype", "layout", "device"} or not isinstance(kw["dtype"], torch.dtype):
        return False
    t = example_value(node.args[0]) if isinstance(node.args[0], fx.Node) else None
    if not isinstance(t, torch.Tensor) or t.dtype == kw["dtype"] or kw.get("layout") not in (None, torch.strided):
        return False
    return kw.get("device") is None or torch.device(kw["device"]) == t.device  # the export names x's own


_DETACH_ = getattr(getattr(torch.ops.aten, "detach_", None), "default", None)


def _idle_detach(node: fx.Node) -> bool:
    """`aten.detach_(x)` of an x that needs no gradient (torch.export detaches each constant tensor the code makes,
    `torch.tensor(2.0)`): it returns x and changes nothing, values or autograd, so its readers may read x."""
    if node.op != "call_function" or node.target is not _DETACH_ or len(node.args) != 1 or node.kwargs:
        return False
    x = node.args[0]
    t = example_value(x) if isinstance(x, fx.Node) else None
    return isinstance(t, torch.Tensor) and not t.requires_grad


def spell_aten_ops(gm: fx.GraphModule) -> bool:
    """Give every overload of `_TABLE` its torch-level function or Tensor method as the node's target, and drop the
    metadata checks that hold (`_holds`); True when the graph changed."""
    changed = False
    for node in list(gm.graph.nodes):
        if _holds(node):
            gm.graph.erase_node(node)
            changed = True
            continue
        if _idle_detach(node):
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
            changed = True
            continue
        if _dtype_copy(node):
            node.op, node.target = "call_method", "to"
            node.args, node.kwargs = (node.args[0], node.kwargs["dtype"]), {}
            changed = True
            continue
        internal = _internal_softmax(node)
        if internal is not None:
            node.target, node.args = internal, node.args[:2]
            changed = True
            continue
        fn = _function_for(node)
        if isinstance(fn, str):
            node.op, node.target = "call_method", fn
        elif fn is not None:
            node.target = fn
        changed = changed or fn is not None
    if changed:
        gm.recompile()
    return changed
