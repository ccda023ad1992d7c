"""Emitting a plan as a MaskSpec: structure arguments, key lengths and the residual bias as graph nodes."""
from __future__ import annotations

import operator
from typing import Any, Optional, Union

import torch
import torch.fx as fx

from ..aliasing import writes_into, written_between, written_in_place
from ..emit import call, example_value
from ..site import MaskSpec
from .symbolic import Size, _as_int, _dtype, _is_one, _same, _shape
from .values import _Fail, _QPos

# The largest float that fp16 rounds to its finfo.min (-65504) or below: the midpoint with -65472 (ties go to -65472,
# the even mantissa), so exactly the values strictly below it.
FP16_ROUNDS_TO_MIN = -65488.0
# The values fp16 rounds to -inf: from the midpoint of 65504 and 2**16 (a tie goes to 2**16, the even mantissa) down.
FP16_OVERFLOWS = -65520.0


class _Emitter:
    def __init__(self, gm: fx.GraphModule, insert_before: fx.Node):
        self.gm, self.at = gm, insert_before
        self.order = {n: i for i, n in enumerate(gm.graph.nodes)}
        self.made: list = []

    def call(self, target, *args, **kwargs) -> fx.Node:
        with self.gm.graph.inserting_before(self.at):
            n = call(self.gm.graph, target, *args, **kwargs)
        self.made.append(n)
        return n

    def rollback(self) -> None:
        for n in reversed(self.made):
            if not n.users:
                self.gm.graph.erase_node(n)
        self.made.clear()

    def call_after(self, n: fx.Node, target, *args, **kwargs) -> fx.Node:
        """A call placed right after n (after the placeholders when n is one): it reads n's value where
        the mask read it, before any later in-place write into n's storage (a cache offset's add_)."""
        at = n
        if n.op == "placeholder":
            at = next(x for x in self.gm.graph.nodes if x.op != "placeholder").prev
        with self.gm.graph.inserting_after(at):
            node = call(self.gm.graph, target, *args, **kwargs)
        self.made.append(node)
        return node

    def before(self, n: fx.Node) -> bool:
        return self.order.get(n, 1 << 60) < self.order.get(self.at, -1)

    def sym(self, v: Size) -> Union[int, fx.Node]:
        """An int, or a node computing the SymInt v from nodes already in the graph."""
        iv = _as_int(v)
        if iv is not None:
            return iv
        expr = v.node.expr
        by_expr = {}
        for n in self.gm.graph.nodes:
            ev = example_value(n)
            if isinstance(ev, torch.SymInt) and self.before(n):
                by_expr.setdefault(ev.node.expr, n)
        if expr in by_expr:
            return by_expr[expr]
        import sympy

        out: Any = None
        for term, coef in expr.as_coefficients_dict().items():
            if term == 1:
                piece: Any = int(coef)
            else:
                if term not in by_expr or not float(coef).is_integer():
                    raise _Fail(f"no node computes {term}")
                piece = by_expr[term] if coef == 1 else self.call(operator.mul, by_expr[term], int(coef))
            out = piece if out is None else self.call(operator.add, out, piece)
        if out is None or isinstance(sympy.sympify(expr), sympy.Integer):
            raise _Fail(f"cannot build {expr}")
        return out


def _read_at_site(em: "_Emitter", node: fx.Node, what: str) -> None:
    """The op reads `node` at the site, where eager read it at the mask's own ops: the two see one value only where
    nothing writes node's memory in place between its first reader and the site (a mask negated or turned into a
    bias, then updated before the attention: eager's bias holds the old values, node the new ones). A write
    before every reader is seen by both; one after the site matters to a backward only (emit.py refuses those)."""
    if not em.before(node):
        raise _Fail(f"{what} {node.name} is computed after the site")
    readers = [u for u in node.users if not writes_into(u, node)]  # (`m[a:b] = 0` builds m, reads nothing)
    # (a node without readers was made by an earlier edit of the pass: its value is the one where it stands)
    first = min(readers, key=lambda n: em.order.get(n, 1 << 60), default=node)
    if written_between(node, first, em.at):
        raise _Fail(f"{what} {node.name} is modified in place after it is read, before the site")


def _emit_vector(em: "_Emitter", node: fx.Node, own_axis: int, own_b: Optional[int]) -> fx.Node:
    """node, varying only along its dims own_axis (N) and own_b (the batch, or None), as the op's [N] or
    [B, N] int64 vector: a fresh copy taken right where the mask read node."""
    if not em.before(node):
        raise _Fail(f"{node.name} is computed after the site")
    if written_in_place(node):
        raise _Fail(f"{node.name} is written in place")
    shape = _shape(node)
    keep = {own_axis + len(shape)} | ({own_b + len(shape)} if own_b is not None else set())
    if any(not _is_one(s) for d, s in enumerate(shape) if d not in keep):
        raise _Fail(f"{node.name} of shape {tuple(shape)} varies along another axis")
    out = node
    if len(keep) < len(shape):
        out = em.call_after(node, operator.getitem, node, tuple(slice(None) if d in keep else 0
                                                                for d in range(len(shape))))
    if own_b is not None and own_b > own_axis:  # the batch after N among node's own dims
        out = em.call_after(out, torch.transpose, out, 0, 1)
    # int64 keeps every value (and any offset added to it) exact; a fresh tensor, never a view of node
    return em.call_after(out, "to", out, torch.int64, copy=True, method=True)


def _emit_positions(em: "_Emitter", qp: _QPos) -> fx.Node:
    """The op's q_pos: key j admitted for query i when j <= q_pos[b, i]."""
    if qp.rows:
        if not em.before(qp.node):
            raise _Fail(f"{qp.node.name} is computed after the site")
        if written_in_place(qp.node):
            raise _Fail(f"{qp.node.name} is written in place")
        p = em.call_after(qp.node, "to", qp.node, torch.int64, copy=True, method=True)
        if qp.wrap is not None:  # buffer[pos] reads row pos + rows for -rows <= pos < 0
            p = em.call_after(p, torch.remainder, p, qp.wrap)
    else:
        p = _emit_vector(em, qp.node, qp.own_q, qp.own_b)
    if qp.add:  # positions only meet key indices in [0, Nk): bounded first, so that no int64 position wraps
        p = em.call_after(p, "clamp", p, -2**32, 2**32, method=True)
        p = em.call_after(p, operator.add, p, qp.add)
    return p


def _emit_spec(em: "_Emitter", plan: dict, batch, q_len, k_len, bias_rank: int = 4) -> MaskSpec:
    lo, hi, lens = plan["lo"], plan["hi"], plan["lens"]
    kinds = []
    spec = MaskSpec(empty_rows=plan["empty"], fill=plan.get("fill"), rows_admit=bool(plan.get("rows_admit")),
                    nan_grads=plan.get("nan_grads", "v"))
    # band lo <= j - i <= hi  ->  op: d = j - i - diag_offset; causal d <= 0; window_left: d >= -wl
    if hi is not None:
        spec.causal = True
        if lo is not None:
            width = _as_int(hi - lo)
            if width is None:
                raise _Fail("window width is symbolic")
            if width < 0:
                raise _Fail("band admits no key")
            spec.window_left = width
        spec.diag_offset = em.sym(hi)
        if lo is not None:
            kinds.append("window")
        elif _as_int(hi) == 0:
            kinds.append("causal")
        elif _same(hi, k_len - q_len):
            kinds.append("causal-bottom-right")
        else:
            kinds.append("causal-offset")
    elif lo is not None:
        spec.diag_offset = em.sym(lo)
        spec.window_left = 0
        kinds.append("window")
    if lens is not None:
        node, _, add = lens
        if not em.before(node):
            raise _Fail("key lengths are computed after the site")
        if written_in_place(node):  # the op reads them at the site (and its backward later), eager at the mask
            raise _Fail(f"key lengths {node.name} are written in place")
        kv = em.call(torch.reshape, node, (-1,))
        if add or _dtype(kv) != torch.int32:
            # int32 is what FA3 (seqused_k) takes; converting here lets Inductor fuse it into the
            # lengths' own arithmetic instead of a kernel launch per call (decode is host-bound).
            # Widened, offset and clamped first so that no length wraps (int8 lengths, 255 + 1 in uint8): every
            # value keeps its meaning (<= 0: no keys, >= Nk: every key).
            if _dtype(kv) != torch.int64:
                kv = em.call("to", kv, torch.int64, method=True)
            if add:  # int64 lengths near the dtype's end ("no limit") would wrap: bounded first
                kv = em.call(operator.add, em.call("clamp", kv, -2**32, 2**32, method=True), add)
            kv = em.call("clamp", kv, 0, 2**31 - 1, method=True)
            kv = em.call("to", kv, torch.int32, method=True)
        spec.kv_lens = kv
        kinds.append("key-padding")
    if plan.get("qpos") is not None:
        spec.q_pos = _emit_positions(em, plan["qpos"])
        kinds.append("query-positions")
    if plan.get("seg") is not None:
        spec.q_seg, spec.k_seg = (_emit_vector(em, ids.node, ids.own_axis, ids.own_b) for ids in plan["seg"])
        kinds.append("segments")
    bool_bias = None
    for node, neg in dict.fromkeys(plan["data"]):
        _read_at_site(em, node, "mask")
        if _dtype(node) != torch.bool:  # a 0/1 or 0-or-c float factor (analyzer._rebased): nonzero is True
            f = em.call(torch.eq if neg else torch.ne, node, 0)
        else:
            f = em.call(torch.logical_not, node) if neg else node
        bool_bias = f if bool_bias is None else em.call(torch.logical_and, bool_bias, f)
    float_bias = half_sum = None
    for node in plan["extras"]:
        if isinstance(node, tuple) and node[0] == "to":  # ("to", bool node, dtype): a bool added as 0/1
            _, m, dt = node
            _read_at_site(em, m, "mask")
            node = em.call("to", m, dt, method=True)
        elif isinstance(node, tuple) and node[0] == "absorb16":  # an fp16 mask eager adds in fp16 (combine.py)
            _, m = node
            _read_at_site(em, m, "mask")
            # summed in fp16 as eager sums them (two terms of -4e4 overflow to -inf there), converted below
            half_sum = m if half_sum is None else em.call(operator.add, half_sum, m)
            continue
        elif isinstance(node, tuple):  # ("where", bool node, c, masked_when_true, dtype): a fill as an additive float
            _, m, c, masked_when_true, dt = node
            _read_at_site(em, m, "mask")
            if dt == torch.float64:  # c exactly as eager's fp64 scores hold it (torch.where of two numbers is fp32)
                filled = m if masked_when_true else em.call(torch.logical_not, m)
                node = em.call("masked_fill", em.call(torch.zeros_like, m, dtype=dt), filled, c, method=True)
            else:
                node = em.call(torch.where, m, c, 0.0) if masked_when_true else em.call(torch.where, m, 0.0, c)
        else:
            _read_at_site(em, node, "mask")
        float_bias = node if float_bias is None else em.call(operator.add, float_bias, node)
    if half_sum is not None:
        # the sum <= finfo(fp16).min as eager's fp16 value of it is, also where Inductor fuses the sum that makes it
        # without rounding it to fp16 first: a value below -65488 (halfway to -65472) rounds to -65504 or -inf
        # (compared in fp32: a number compared with an fp16 tensor is rounded to fp16 first, -65520 to -inf)
        wide = em.call("float", half_sum, method=True)
        low = em.call(operator.lt, wide, FP16_ROUNDS_TO_MIN)
        shift = em.call(torch.where, low, float(torch.finfo(torch.float32).min), 0.0)  # fp32; the gradient of m: 1
        node = em.call(operator.add, wide, shift)
        # and -inf where eager's fp16 value overflows (two terms of -4e4), which a fused fp32 sum does not
        node = em.call(torch.where, em.call(operator.le, wide, FP16_OVERFLOWS), float("-inf"), node)
        float_bias = node if float_bias is None else em.call(operator.add, float_bias, node)
    if bool_bias is not None and float_bias is not None:
        spec.bias = em.call(torch.where, bool_bias, float_bias, float("-inf"))
        kinds += ["bool-mask", "bias"]
    elif bool_bias is not None:
        spec.bias = bool_bias
        kinds.append("bool-mask")
    elif float_bias is not None:
        spec.bias = float_bias
        kinds.append("bias")
    if spec.bias is not None and len(_shape(spec.bias) or ()) > bias_rank:
        raise _Fail(f"residual mask has more than {bias_rank} dims")
    if plan.get("filled") is not None:
        node, when_true = plan["filled"]
        _read_at_site(em, node, "mask")
        if spec.bias is None or _dtype(spec.bias) == torch.bool:
            raise _Fail("filled scores without the float bias that holds them")
        spec.filled = node if when_true else em.call(torch.logical_not, node)
    spec.kind = "+".join(kinds) if kinds else "none"
    if spec.kind == "none":
        spec.empty_rows, spec.fill = "impossible", None
    return spec
