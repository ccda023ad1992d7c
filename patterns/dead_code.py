"""Dead pure nodes, removed before the sites are analysed.

Code that keeps a copy or a view of the scores for an optional result the caller never reads
(`qk = scores.clone()`, a view stored in a named tuple that is dropped) leaves a node without users
in the Dynamo graph; to the site finder it would be a second use of the scores. A node whose result
nobody reads is no use when computing it has no effect besides its result: it writes into no tensor
(no in-place op, no `out=`), draws no random numbers, changes no global state and raises on no value
(a tensor index may be out of range). Purity is proven from a list of operations known to be pure,
never assumed of an unknown call.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx
import torch.nn.functional as F

from .aliasing import writes
from .canonicalize import kind, tensor_of

# canonical kinds (canonicalize.kind) that compute a value and nothing else; dropout draws random numbers
_PURE_KINDS = {"softmax", "matmul", "einsum", "baddbmm", "linear", "mul", "div", "add", "sub", "masked_fill",
               "where", "tanh", "transpose", "permute", "reshape", "unsqueeze", "expand", "identity", "cast",
               "getitem"}  # not repeat_interleave: a tensor of repeats raises on a negative value
_PURE_METHODS = {"size", "dim", "numel", "detach", "t", "flatten", "unflatten", "squeeze", "narrow", "select",
                 "chunk", "split", "exp", "log", "neg", "abs", "sqrt", "rsqrt", "sigmoid", "sum", "mean", "amax",
                 "amin", "tril", "triu", "log_softmax", "eq", "ne", "lt", "le", "gt", "ge", "logical_not",
                 "logical_and", "logical_or", "bool", "int", "long", "float", "half", "bfloat16", "double",
                 "to", "type_as", "view_as", "reshape_as", "expand_as", "broadcast_to", "new_ones", "new_zeros",
                 "new_full"}
_PURE_FUNCTIONS = {torch.ones_like, torch.zeros_like, torch.full_like, torch.ones, torch.zeros, torch.full,
                   torch.arange, torch.tril, torch.triu, torch.exp, torch.log, torch.flatten, torch.squeeze,
                   torch.cat, torch.stack, torch.sum, torch.amax, torch.log_softmax, F.log_softmax,
                   torch.chunk, torch.split, torch.narrow, torch.select, torch.broadcast_to,
                   operator.neg, operator.eq, operator.ne, operator.lt, operator.le, operator.gt, operator.ge,
                   operator.and_, operator.or_, operator.xor, operator.invert, operator.not_, operator.pow}
# not floordiv / mod / an integer div: an integer division by zero raises


def _tensor_index(node: fx.Node) -> bool:
    """x[i] with a tensor among the indices: it raises when an index is out of range."""
    found: list = []
    fx.node.map_arg(node.args[1:], lambda a: found.append(a) if tensor_of(a) is not None else None)
    return bool(found)


def is_pure(node: fx.Node) -> bool:
    """Computing `node` has no effect besides its result (see the module docstring)."""
    if node.op not in ("call_function", "call_method") or node.is_impure() or writes(node):
        return False
    if "out" in node.kwargs:
        return False
    if node.target is operator.getitem and _tensor_index(node):
        return False
    k = kind(node)
    if k == "div":
        t = tensor_of(node)
        return t is not None and t.dtype.is_floating_point
    if k in _PURE_KINDS:
        return True
    if node.op == "call_method":
        return node.target in _PURE_METHODS
    try:
        return node.target in _PURE_FUNCTIONS
    except TypeError:  # an unhashable target
        return False


def remove_dead_pure_nodes(gm: fx.GraphModule) -> bool:
    """Erase every node without users that `is_pure` proves pure (then its inputs in turn); True if any."""
    graph = gm.graph
    changed = False
    for node in reversed(list(graph.nodes)):
        if not node.users and is_pure(node):
            graph.erase_node(node)
            changed = True
    return changed
