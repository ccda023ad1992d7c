"""Emit one `torch.ops.fa3.attention` call into an FX graph, with its FakeTensor metadata.

Every recognizer ends here, so the op's calling convention lives in one place. The op is looked up
by name: `patterns/` never imports the front door that registers it (the front door imports this
package and registers the op before any pass runs).
"""
from __future__ import annotations

import math
import operator
from typing import Any, Optional, Union

import torch
import torch.fx as fx

DROPOUT_SEED_HIGH = 2**31 - 1


def fa3_attention_op():
    return torch.ops.fa3.attention.default


def op_accepts(argument: str) -> bool:
    """Whether fa3.attention's schema has `argument` (the run-time mask structure: q_pos, q_seg, k_seg)."""
    try:
        return any(a.name == argument for a in fa3_attention_op()._schema.arguments)
    except (AttributeError, RuntimeError):
        return False


def example_value(node: Any) -> Any:
    """The FakeTensor (or SymInt, or Python value) a Dynamo node produces; plain values pass through."""
    if isinstance(node, fx.Node):
        return node.meta.get("example_value", node.meta.get("val"))
    return node


def inside_vmap(node: Any) -> Optional[str]:
    """Why a site inside torch.vmap is left alone, or None. (torch.func.grad / vjp / jvp leave the whole graph
    alone: pipeline.functorch_transform.) Its values are vmap's batched tensors, which run only inside vmap's own
    trace: the pass cannot compute the fused op's example values from them."""
    v = example_value(node)
    if isinstance(v, torch.Tensor) and torch._C._functorch.is_functorch_wrapped_tensor(v):
        return ("inside torch.vmap: the pass cannot run the fused op on vmap's batched values outside its trace, "
                "so the site stays eager code")
    return None


def _fake_mode(values: list):
    from torch._guards import detect_fake_mode
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    # The values' own mode first: on torch 2.13 the backend's graph carries example values of a fresh
    # fake mode while TracingContext still holds Dynamo's, and detect_fake_mode prefers the latter.
    for v in values:
        if isinstance(v, FakeTensor):
            return v.fake_mode
        if is_traceable_wrapper_subclass(v):  # a DTensor: the mode of the fake tensors it wraps
            inner = [getattr(v, name) for name in v.__tensor_flatten__()[0]]
            mode = _fake_mode(inner)
            if mode is not None:
                return mode
    return detect_fake_mode([v for v in values if isinstance(v, torch.Tensor)])


def _size_arithmetic(node: fx.Node, flat: list) -> bool:
    """`node` is Python integer arithmetic (operator.add, mul, ...) on ints and SymInts, at least one symbolic."""
    import operator

    return (node.op == "call_function" and getattr(node.target, "__module__", None) in ("_operator", "operator")
            and any(isinstance(a, torch.SymInt) for a in flat)
            and all(isinstance(a, (int, torch.SymInt)) and not isinstance(a, bool) for a in flat)
            and node.target in (operator.add, operator.sub, operator.mul, operator.neg, operator.floordiv))


def set_example_value(node: fx.Node) -> None:
    """Run the node's target on its inputs' example values under their fake mode (no-op without one)."""
    args = fx.node.map_arg(node.args, example_value)
    kwargs = fx.node.map_arg(node.kwargs, example_value)
    flat = [a for a in torch.utils._pytree.tree_leaves((args, kwargs))]
    mode = _fake_mode(flat)
    if mode is None:
        if _size_arithmetic(node, flat):  # sizes computed from SymInts (a mask's offset): no tensor, no fake mode
            node.meta["example_value"] = node.target(*args, **kwargs)
        return
    with mode:
        if node.op == "call_function":
            val = node.target(*args, **kwargs)
        elif node.op == "call_method":
            val = getattr(args[0], node.target)(*args[1:], **kwargs)
        else:
            return
    node.meta["example_value"] = val


def example_values_or_undo(graph: fx.Graph, made: list) -> bool:
    """Give the new nodes `made` (in order) their example values; where one cannot be computed, remove them all
    and say so (an edit that would not trace is not made)."""
    try:
        for n in made:
            set_example_value(n)
    except Exception:
        for n in reversed(made):
            graph.erase_node(n)
        return False
    return True


def call(graph: fx.Graph, target: Any, *args: Any, method: bool = False, **kwargs: Any) -> fx.Node:
    """Insert a call (at the graph's current insertion point) and give it an example value."""
    node = graph.call_method(target, args, kwargs) if method else graph.call_function(target, args, kwargs)
    set_example_value(node)
    return node


# The MaskSpec.empty_rows values emit_attention reproduces exactly (everything but "unknown").
EMPTY_ROWS_KEPT = ("impossible", "zero", "nan", "mean_v", "mean_v_add", "mean_v_add_tied")
# Eager's fully masked rows weigh every key alike there: the fix-ups give the mean of V, or with dropout eager's
# dropped uniform weights times V (fa_compile/dropped_rows.py)
EMPTY_ROWS_UNIFORM = ("mean_v", "mean_v_add", "mean_v_add_tied")
# "fill" is kept too, but only by callers that pass MaskSpec.fill along: it is not in the tuple above,
# so a caller that forwards empty_rows alone falls back to its exact bias instead.


def _runs_without_grad(graph: fx.Graph) -> bool:
    """Whether the whole graph runs with grad mode off (compiled under no_grad, no grad-mode region inside): its ops
    are then recorded for no backward, whatever their inputs' requires_grad (a parameter keeps the flag)."""
    return not torch.is_grad_enabled() and not any(
        n.op == "call_function" and n.target is torch._C._set_grad_enabled for n in graph.nodes)


def emit_attention(
    graph: fx.Graph,
    q: fx.Node,
    k: fx.Node,
    v: fx.Node,
    *,
    scale: Union[float, fx.Node],
    causal: bool = False,
    diag_offset: Union[int, fx.Node] = 0,
    window_left: int = -1,
    window_right: int = -1,
    bias: Optional[fx.Node] = None,
    kv_lens: Optional[fx.Node] = None,
    softcap: float = 0.0,
    dropout_p: float = 0.0,
    kernel: Optional[str] = None,
    empty_rows: str = "impossible",
    fill: Optional[float] = None,
    sinks: Optional[fx.Node] = None,
    q_pos: Optional[fx.Node] = None,
    q_seg: Optional[fx.Node] = None,
    k_seg: Optional[fx.Node] = None,
    filled: Optional[fx.Node] = None,
    clamp_tied: bool = False,
    swap_axes: bool = True,
    nan_grads: str = "v",
) -> tuple[fx.Node, fx.Node]:
    """Insert fa3.attention on q [B, Hq, Nq, D], k/v [B, Hkv, Nk, D]; return (out node, op call node).

    empty_rows (see MaskSpec) keeps eager's value on rows where every key is masked, which the op
    itself returns as 0 with lse = -inf: "nan", "mean_v" and "mean_v_add" add an exact fix-up on those
    rows, "impossible" and "zero" add nothing; "unknown" is refused (the caller must not rewrite).
    "mean_v_add" also keeps eager's gradient of q and k on those rows (see `_uniform_row_grad`), through
    the softcap too; "mean_v_add_tied" half of it: the scores were clamped by max(s, finfo.min) after the
    mask, and an absorbed score ties the clamp, where torch.maximum splits its gradient in two.
    With dropout, eager drops some of those uniform weights: the "mean_v" kinds then add
    fa3.dropped_uniform_rows (fa_compile/dropped_rows.py), eager's value and gradients under the site's seed.
    "fill" (with `fill` = c, finite) keeps eager's value where every masked score was replaced by c,
    on every row; the masked keys are those the structure, kv_lens and a bool bias exclude. A mask
    constant along queries (key padding) becomes eager's own arithmetic (`_fill_masked_keys`); a band
    or query-dependent mask gets the masked keys' share from the op's lse (`_finite_fill`). Dropout is kept by
    the first form and refused with a ValueError by the second (it cannot drop the masked weights as eager does).

    sinks ([Hq] logits in the denominator, patterns/sinks.py): a fully masked row then attends to the
    sink alone, so eager's value there is 0 (its -inf, finfo.min or clamped keys get weight 0 beside a
    finite sink), the op's own; a head whose sink is -inf has no sink, and its fully masked rows get the
    fix-ups of `empty_rows` (the op's lse stays -inf there). "fill" is refused with a ValueError (the
    filled keys keep a share).

    q_pos ([Nq] / [B, Nq]: query i admits keys j <= q_pos[b, i]) and q_seg / k_seg (same ids only) are
    run-time structure, ANDed with the rest; the fix-ups above build their keep-mask from them too.

    filled (bool, broadcasting to [B, Hq, Nq, Nk]): entries of the float `bias` that hold a fill c <= -1e30
    which eager wrote over the scores (where / masked_fill) before later 0-or-c' masks (c' <= 0) were
    added; eager gives those scores no gradient, the op does. On a row that admits any other entry their
    weight is exactly 0 (the row's lse >= -1e29 > c), so the gradients differ only on rows whose lse is
    below -1e29 (every score absorbed, uniform weights); there fa3::filled_scores_grad, value 0, removes
    the op's gradient through those entries (`_remove_filled_grad`). Needs no structure arguments besides
    the bias, no dropout and no sinks (ValueError otherwise).

    clamp_tied: eager clamped the scores by max(s, finfo.min) after adding the float `bias`. On a row whose
    every score the bias absorbed (lse below -1e29) each score then ties the clamp, and torch.maximum passes
    each of two equal operands half the gradient: half of the op's gradient to q and k is removed there
    (`_remove_filled_grad` with every finite entry and weight 0.5). Same conditions as `filled`.

    nan_grads (empty_rows "nan"): which of eager's gradients the NaN rows turn into NaN, put back by
    fa3.nan_row_grad where a gradient is recorded: "v" (the masks are fills, which cut the row's gradient to the
    scores: every value of the head), "qkv" (additive -inf masks pass it on: also the row's query and every key of
    the head), "mixed" (both kinds: which scores a fill cut is not known here; V's alone, the README's known
    difference). A float bias's gradient on those rows stays the op's (finite): whether eager's NaN reaches it depends
    on whether a fill comes after it, which the op's one bias no longer holds (the README's known difference).

    swap_axes: with one K/V head and more heads than queries (past 16), and no structure that tells the axes
    apart, the op runs with heads and queries swapped (`_swaps_heads_and_queries`); False keeps the frame (the
    fix-ups that read the op's lse in the caller's frame pass it).

    Call inside `graph.inserting_before(...)` at a point where q, k, v, bias, kv_lens are defined.
    A scale held in a tensor node (learned temperature, 0-d tensor) is folded into q so the op's
    scale stays a Python float.
    """
    # structure that tells the query axis from the head axis: a diagonal or window, run-time positions or segments,
    # per-head sinks, and the filled / clamped-score fix-ups (which read the op's lse in the caller's frame)
    axes_told_apart = (causal or window_left >= 0 or window_right >= 0 or clamp_tied
                       or any(x is not None for x in (sinks, q_pos, q_seg, k_seg, filled)))
    if swap_axes and not axes_told_apart and _swaps_heads_and_queries(q, k, bias):
        # One K/V head for all: out[b, h, i] depends on (h, i) only through q[b, h, i] and the bias, so the two axes
        # may trade places. Many heads of few queries each (tokens folded into the head axis, as the multi-query
        # bmm spelling gives) become few heads of many queries: the kernels' query tiles fill.
        if bias is not None:
            while example_value(bias).dim() < 4:
                bias = call(graph, torch.unsqueeze, bias, 0)
            bias = call(graph, torch.transpose, bias, 1, 2)
        out, node = emit_attention(
            graph, call(graph, torch.transpose, q, 1, 2), k, v, scale=scale, diag_offset=diag_offset, bias=bias,
            kv_lens=kv_lens, softcap=softcap, dropout_p=dropout_p, kernel=kernel, empty_rows=empty_rows, fill=fill,
            swap_axes=False, nan_grads=nan_grads)
        note_fixup(node, "heads and queries swapped (one K/V head, more heads than queries)")
        return call(graph, torch.transpose, out, 1, 2), node
    if filled is not None and needs_qk_grad(q, k):
        if bias is None or example_value(bias).dtype == torch.bool or dropout_p > 0 or sinks is not None or causal \
                or window_left >= 0 or window_right >= 0 or kv_lens is not None \
                or any(x is not None for x in (q_pos, q_seg, k_seg)):
            raise ValueError("filled: eager's cut gradient of filled scores is kept for a float bias alone "
                             "(no structure arguments, dropout or sinks)")
        out, node = emit_attention(graph, q, k, v, scale=scale, bias=bias, softcap=softcap, kernel=kernel,
                                   empty_rows=empty_rows, fill=fill, swap_axes=False, nan_grads=nan_grads)
        note_fixup(node, "filled scores' gradient removed (fa3.filled_scores_grad)")
        return _remove_filled_grad(graph, out, node, filled), node
    nan_rows_grad = empty_rows == "nan" and not _runs_without_grad(graph) and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in map(example_value, (q, k, v)))
    if nan_rows_grad and nan_grads not in ("v", "qkv", "mixed"):
        raise ValueError(f"nan_grads: 'v', 'qkv' or 'mixed', got {nan_grads!r}")
    if clamp_tied and needs_qk_grad(q, k) and bias is not None and example_value(bias).dtype != torch.bool:
        if filled is not None or dropout_p > 0 or sinks is not None or causal or window_left >= 0 \
                or window_right >= 0 or kv_lens is not None or any(x is not None for x in (q_pos, q_seg, k_seg)):
            raise ValueError("clamp_tied: eager's halved gradient of tied scores is kept for a float bias alone "
                             "(no structure arguments, fill, dropout or sinks)")
        out, node = emit_attention(graph, q, k, v, scale=scale, bias=bias, softcap=softcap, kernel=kernel,
                                   empty_rows=empty_rows, fill=fill, swap_axes=False, nan_grads=nan_grads)
        note_fixup(node, "half the gradient of scores tied with the clamp max(s, finfo.min) (fa3.filled_scores_grad)")
        return _remove_filled_grad(graph, out, node, call(graph, torch.isfinite, bias), weight=0.5), node
    if isinstance(scale, fx.Node):
        q = call(graph, torch.mul, q, scale)
        scale = 1.0
    seed = None
    if dropout_p > 0:
        dev = example_value(q).device
        seed = graph.call_function(torch.randint, (0, DROPOUT_SEED_HIGH, ()), dict(dtype=torch.int64, device=dev))
        mode = _fake_mode([example_value(q)])  # randint has no tensor input to take the fake mode from
        if mode is not None:
            with mode:
                seed.meta["example_value"] = torch.randint(0, DROPOUT_SEED_HIGH, (), dtype=torch.int64, device=dev)
    if sinks is not None and empty_rows == "fill":
        raise ValueError("empty_rows: 'fill' with sinks (the filled keys share the row with the sink)")
    # With sinks the op's lse on a fully masked row is the row's sink: a finite sink takes the row (eager's 0, the
    # op's), and a sink of -inf leaves lse at -inf, where eager's row is that of a mask without sinks (uniform under
    # a finite fill, NaN under -inf): the fix-ups below, keyed on lse = -inf, then apply as they are.
    if kv_lens is not None and _one_for_all(kv_lens, q):  # one length for every batch row (decode)
        kv_lens = call(graph, "expand", kv_lens, size_arg(graph, q, 0), method=True)
    runtime = dict(q_pos=q_pos, q_seg=q_seg, k_seg=k_seg)
    from . import key_limit  # decode over a long cache: cut the keys past the bias's last admissible one

    limited = key_limit.applies(q, k, bias, empty_rows=empty_rows, dropout_p=dropout_p)
    if limited:
        kv_lens = key_limit.limit_keys(graph, q, k, v, bias, kv_lens, causal=causal, diag_offset=diag_offset,
                                       window_left=window_left, window_right=window_right, **runtime)
    if empty_rows == "fill":
        if fill is None or not math.isfinite(fill):
            raise ValueError(f"fill: empty_rows 'fill' needs the finite fill value, got {fill!r}")
        if fill_keeps_dropout(causal, window_left, window_right, bias, kv_lens, **runtime):
            # the op now computes eager's own softmax over every key, and drops its weights as eager does
            k, bias = _fill_masked_keys(graph, q, k, bias, kv_lens, fill)
            kv_lens, empty_rows = None, "impossible"
        elif dropout_p > 0:
            raise ValueError("empty_rows: 'fill' cannot keep eager's dropout of the masked keys' weights where the "
                             "masked keys vary along queries")
    extra: tuple = (sinks,) if sinks is not None else ()
    if any(x is not None for x in runtime.values()):
        extra = (sinks, q_pos, q_seg, k_seg)
    node = call(
        graph, fa3_attention_op(), q, k, v, float(scale), bool(causal), diag_offset, int(window_left),
        int(window_right), bias, kv_lens, float(softcap), float(dropout_p), seed, kernel, *extra,
    )
    if any(isinstance(t, torch.Tensor) and t.requires_grad for t in map(example_value, (q, k, v, bias, sinks))) \
            and not _runs_without_grad(graph):
        # The op saves its inputs for the backward, and a copy would not help: AOTAutograd saves a mutated
        # graph input rather than a copy of it and replays the write before the backward (torch 2.11 and
        # 2.13: `c = m.clone(); y = q * c; m.mul_(2)` gives q the gradient of the new m).
        from .aliasing import written_in_place

        written = [name for name, x in (("q", q), ("k", k), ("v", v), ("bias", bias), ("kv_lens", kv_lens),
                                        ("sinks", sinks), *runtime.items())
                   if isinstance(x, fx.Node) and written_in_place(x, after=node)]
        if written:
            graph.erase_node(node)
            raise ValueError(f"{', '.join(written)}: written in place later in the graph, while the op would "
                             "save it for the backward")
    if limited:
        note_fixup(node, "key limit read from the mask at run time")
    out = call(graph, operator.getitem, node, 0)
    nk = example_value(k).shape[2]
    if empty_rows in ("impossible", "zero") or (isinstance(nk, int) and nk == 0):
        return out, node  # no keys at all: eager's softmax row is empty and P.V is 0, the op's value
    if empty_rows == "fill":
        lse = call(graph, operator.getitem, node, 1)
        res = _finite_fill(graph, q, v, out, lse, fill, causal=causal, diag_offset=diag_offset,
                           window_left=window_left, window_right=window_right, bias=bias, kv_lens=kv_lens,
                           **runtime)
        return res, node
    if empty_rows not in EMPTY_ROWS_KEPT:
        raise ValueError(f"empty_rows: cannot keep eager's value on fully masked rows for {empty_rows!r}")
    lse = call(graph, operator.getitem, node, 1)
    empty = call(graph, torch.unsqueeze, call(graph, torch.isneginf, lse), -1)
    if empty_rows == "nan":
        fill = call(graph, torch.full_like, out, float("nan"))
        if nan_rows_grad:
            note_fixup(node, "eager's NaN gradients of fully masked rows (fa3.nan_row_grad)")
            grad = call(graph, torch.ops.fa3.nan_row_grad.default, q, k, v, empty, nan_grads == "qkv")
            fill = call(graph, torch.add, fill, call(graph, "to", grad, example_value(out).dtype, method=True))
    elif dropout_p > 0:
        # eager drops some of the uniform weights: the same bits in the fill and its gradients (fa_compile/dropped_rows)
        qk_grad = 0.0
        if empty_rows in ("mean_v_add", "mean_v_add_tied") and needs_qk_grad(q, k):
            qk_grad = 1.0 if empty_rows == "mean_v_add" else 0.5
        note_fixup(node, "fully masked rows: eager's uniform weights with dropout (fa3.dropped_uniform_rows)")
        fill = call(graph, torch.ops.fa3.dropped_uniform_rows.default, q, k, v, lse, seed, float(dropout_p),
                    float(scale), float(softcap), qk_grad)
        fill = call(graph, "to", fill, example_value(out).dtype, method=True)
    else:
        # eager's softmax over a row of equal scores: the uniform average of V over all keys.
        hq, hkv = example_value(q).shape[1], example_value(v).shape[1]
        fill = call(graph, torch.mean, v, dim=2, keepdim=True)
        if hq != hkv:
            fill = call(graph, torch.repeat_interleave, fill, hq // hkv, dim=1)
        if empty_rows in ("mean_v_add", "mean_v_add_tied") and needs_qk_grad(q, k):
            note_fixup(node, "exact gradient of fully masked rows (fa3.uniform_row_grad)")
            grad = _uniform_row_grad(graph, q, k, v, float(scale), float(softcap))
            if empty_rows == "mean_v_add_tied":  # value 0 either way; the product halves its gradient
                grad = call(graph, torch.mul, grad, 0.5)
            fill = call(graph, torch.add, fill, grad)
        fill = call(graph, "to", fill, example_value(out).dtype, method=True)
    return call(graph, torch.where, empty, fill, out), node


SWAP_MIN_QUERIES = 16  # decode-shaped sites (up to 16 queries) keep their axes where the decode kernel packs the heads
DECODE_PACKED_ROWS = 128  # heads x queries the decode kernel packs per K/V head (kernels/decode.py's MAX_ROWS; a
# test ties the two)


def _swaps_heads_and_queries(q: fx.Node, k: fx.Node, bias: Optional[fx.Node]) -> bool:
    """One K/V head, static head and query counts with more heads than queries, and a bias (if any) of at most 4
    dims; the caller has checked that no structure tells the two axes apart. A decode-shaped site (up to 16
    queries) keeps its axes while the decode kernel packs all its rows into one tile (heads x queries up to
    DECODE_PACKED_ROWS); past that no kernel reads the one K/V head once for every head, so the axes trade places."""
    tq, tk = example_value(q), example_value(k)
    if not (isinstance(tq, torch.Tensor) and isinstance(tk, torch.Tensor)) or tq.dim() != 4 or tk.dim() != 4:
        return False
    hq, nq, hkv = tq.shape[1], tq.shape[2], tk.shape[1]
    if not all(type(n) is int for n in (hq, nq, hkv)) or hkv != 1 or not hq > nq:
        return False
    if nq <= SWAP_MIN_QUERIES and hq * nq <= DECODE_PACKED_ROWS:
        return False
    return bias is None or example_value(bias).dim() <= 4


FIXUPS = "fa_compile_fixups"  # node.meta key: what emit added around the op call, for explain()


def note_fixup(node: fx.Node, what: str) -> None:
    node.meta.setdefault(FIXUPS, []).append(what)


# A row whose lse is at least this admits an entry whose weight dwarfs a filled one (<= -1e30) to 0.
FILLED_ROWS_LSE = -1e29


def _remove_filled_grad(graph: fx.Graph, out: fx.Node, node: fx.Node, filled: fx.Node, weight: float = 1.0) -> fx.Node:
    """out + 0 whose gradient removes, on the rows with lse < FILLED_ROWS_LSE, `weight` times the op's gradient
    through the `filled` entries of its bias (see emit_attention's `filled` and `clamp_tied`). The correction
    reads the op's own arguments (q after any folded scale, k, v, bias, softcap)."""
    q, k, v, scale, bias, softcap = node.args[0], node.args[1], node.args[2], node.args[3], node.args[8], node.args[10]
    lse = call(graph, operator.getitem, node, 1)
    rows = call(graph, torch.logical_and, call(graph, operator.lt, lse, FILLED_ROWS_LSE),
                call(graph, torch.isfinite, lse))
    zero = call(graph, torch.ops.fa3.filled_scores_grad.default, q, k, v, bias, filled, float(scale), float(softcap))
    zero = call(graph, torch.where, call(graph, torch.unsqueeze, rows, -1), zero, 0.0)
    if weight != 1.0:
        zero = call(graph, torch.mul, zero, weight)
    if example_value(zero).dtype != example_value(out).dtype:
        zero = call(graph, "to", zero, example_value(out).dtype, method=True)
    return call(graph, torch.add, out, zero)


def needs_qk_grad(q: Any, k: Any) -> bool:
    """Whether q or k (nodes or example values) require a gradient in the traced graph."""
    return any(isinstance(t, torch.Tensor) and t.requires_grad for t in (example_value(q), example_value(k)))


def _uniform_row_grad(graph: fx.Graph, q: fx.Node, k: fx.Node, v: fx.Node, scale: float,
                      softcap: float = 0.0) -> fx.Node:
    """A zero [B, Hq, Nq, Dv] whose gradient is what eager gives q and k from a fully masked row whose
    scores all absorbed one additive mask value (s + finfo.min == finfo.min): the forward is uniform
    but the addition passes the gradient, so eager's backward is softmax's at P = 1/Nk:
    ds_j = (dO . v_j - dO . mean(v)) / Nk, then through the softcap's tanh' of each raw score when there
    is one. fa3::uniform_row_grad computes it (in fp32) in its backward from q, k, v alone, which
    fa3::attention saves anyway: spelled out in the graph, the partitioner kept its fp32 intermediates
    (q and k sized) alive per layer for backward."""
    if softcap:
        return call(graph, torch.ops.fa3.uniform_row_grad.default, q, k, v, float(scale), float(softcap))
    return call(graph, torch.ops.fa3.uniform_row_grad.default, q, k, v, float(scale))


def size_arg(graph: fx.Graph, t: fx.Node, dim: int) -> Any:
    """t's size along dim as a graph argument: the int, or a `size` call for a symbolic size."""
    s = example_value(t).shape[dim]
    return s if isinstance(s, int) else call(graph, "size", t, dim, method=True)


def _arange(graph: fx.Graph, t: fx.Node, dim: int) -> fx.Node:
    """arange(t.shape[dim]) on t's device; no tensor input to take the fake mode from: t's (see _fake_mode)."""
    tv = example_value(t)
    n = graph.call_function(torch.arange, (size_arg(graph, t, dim),), dict(device=tv.device))
    mode = _fake_mode([tv])
    if mode is not None:
        with mode:
            n.meta["example_value"] = torch.arange(tv.shape[dim], device=tv.device)
    return n


def _one_for_all(kv_lens: fx.Node, q: fx.Node) -> bool:
    """kv_lens holds one length, [1], while q's batch is not known to be 1."""
    n, b = example_value(kv_lens).shape[0], example_value(q).shape[0]
    return isinstance(n, int) and n == 1 and not (isinstance(b, int) and b == 1)


def _rows(graph: fx.Graph, t: fx.Node) -> fx.Node:
    """An [N] / [B, N] index vector as [B or 1, N]."""
    return call(graph, torch.unsqueeze, t, 0) if example_value(t).dim() == 1 else t


def _keep_mask(graph: fx.Graph, q: fx.Node, v: fx.Node, *, causal: bool, diag_offset: Union[int, fx.Node],
               window_left: int, window_right: int, bias: Optional[fx.Node], kv_lens: Optional[fx.Node],
               q_pos: Optional[fx.Node] = None, q_seg: Optional[fx.Node] = None, k_seg: Optional[fx.Node] = None,
               ) -> Optional[fx.Node]:
    """The op's admissible keys as a 4-d bool broadcasting to [B, Hq, Nq, Nk] (None: every key)."""
    keep: Optional[fx.Node] = None
    runtime = []
    if q_pos is not None:  # j <= q_pos[b, i]: [B or 1, 1, Nq, Nk]
        j = _arange(graph, v, 2)
        runtime.append(call(graph, operator.le, call(graph, torch.unsqueeze, j, 0),
                            call(graph, torch.unsqueeze, _rows(graph, q_pos), -1)))
    if q_seg is not None:  # q_seg[b, i] == k_seg[b, j]
        runtime.append(call(graph, operator.eq, call(graph, torch.unsqueeze, _rows(graph, q_seg), -1),
                            call(graph, torch.unsqueeze, _rows(graph, k_seg), 1)))
    for r in runtime:
        r = call(graph, torch.unsqueeze, r, 1)
        keep = r if keep is None else call(graph, torch.logical_and, keep, r)
    if causal or window_left >= 0 or window_right >= 0:
        i, j = _arange(graph, q, 2), _arange(graph, v, 2)
        d = call(graph, operator.sub, call(graph, torch.unsqueeze, j, 0), call(graph, torch.unsqueeze, i, 1))
        if not (isinstance(diag_offset, int) and diag_offset == 0):
            d = call(graph, operator.sub, d, diag_offset)  # d = j - i - diag_offset, as the op measures it
        parts = []
        if causal:
            parts.append(call(graph, operator.le, d, 0))
        if window_left >= 0:
            parts.append(call(graph, operator.ge, d, -window_left))
        if window_right >= 0:
            parts.append(call(graph, operator.le, d, window_right))
        for x in parts:
            keep = x if keep is None else call(graph, torch.logical_and, keep, x)
    if kv_lens is not None:
        j = _arange(graph, v, 2)
        kl = call(graph, operator.lt, call(graph, torch.unsqueeze, j, 0), call(graph, torch.unsqueeze, kv_lens, 1))
        kl = call(graph, torch.unsqueeze, call(graph, torch.unsqueeze, kl, 1), 1)  # [B, 1, 1, Nk]
        keep = kl if keep is None else call(graph, torch.logical_and, keep, kl)
    if bias is not None and example_value(bias).dtype == torch.bool:
        keep = bias if keep is None else call(graph, torch.logical_and, keep, bias)
    if keep is not None:
        while example_value(keep).dim() < 4:
            keep = call(graph, torch.unsqueeze, keep, 0)
    return keep


def _key_shaped(causal: bool, window_left: int, window_right: int, bias: Optional[fx.Node],
                kv_lens: Optional[fx.Node]) -> bool:
    """The masked keys are the same for every query and head: key lengths and/or a bool [.., 1, 1, Nk] mask."""
    if causal or window_left >= 0 or window_right >= 0:
        return False
    if bias is None:
        return kv_lens is not None
    bv = example_value(bias)
    if bv.dtype != torch.bool:
        return kv_lens is not None  # a float bias with key lengths: the lengths are the mask
    shape = (1,) * (4 - bv.dim()) + tuple(bv.shape)
    return shape[1] == 1 and shape[2] == 1


def fill_keeps_dropout(causal: bool, window_left: int, window_right: int, bias: Optional[fx.Node],
                       kv_lens: Optional[fx.Node], q_pos: Optional[fx.Node] = None, q_seg: Optional[fx.Node] = None,
                       k_seg: Optional[fx.Node] = None) -> bool:
    """Whether emit gives a finite fill (empty_rows "fill") eager's own softmax over every key
    (`_fill_masked_keys`: the same masked keys for every query and head, no run-time structure), which then keeps
    eager's dropout too: the op drops the masked keys' weights as eager does."""
    return _key_shaped(causal, window_left, window_right, bias, kv_lens) and all(
        x is None for x in (q_pos, q_seg, k_seg))


def _fill_masked_keys(graph: fx.Graph, q: fx.Node, k: fx.Node, bias: Optional[fx.Node],
                      kv_lens: Optional[fx.Node], c: float) -> tuple[fx.Node, fx.Node]:
    """(k', bias') such that the op's scores are eager's: a masked key's row of K zeroed (its score is
    scale * 0, softcap(0) = 0) plus the float bias c there, the other keys' bias unchanged. The softmax
    is then eager's own, exact on every row; the gradient of K and of a float bias at masked keys is 0
    (where), as eager's masked constants get none. Costs one [B, Hkv, Nk, D] where and a key bias."""
    float_bias = bias if bias is not None and example_value(bias).dtype != torch.bool else None
    keep = _keep_mask(graph, q, k, causal=False, diag_offset=0, window_left=-1, window_right=-1,
                      bias=None if float_bias is not None else bias, kv_lens=kv_lens)  # [Bm, 1, 1, Nk]
    k2 = call(graph, torch.where, call(graph, torch.transpose, keep, -2, -1), k, 0.0)
    dt = example_value(q).dtype  # c is a value of the scores' dtype (the analysis cast it)
    if float_bias is not None:
        b2 = call(graph, torch.where, keep, float_bias, float(c))
    else:
        b2 = call(graph, "to", call(graph, torch.where, keep, 0.0, float(c)), dt, method=True)
    return k2, b2


def _band_masked_sums(graph: fx.Graph, q: fx.Node, v: fx.Node, *, causal: bool, diag_offset: Union[int, fx.Node],
                      window_left: int, window_right: int, kv_lens: Optional[fx.Node],
                      q_pos: Optional[fx.Node] = None) -> tuple[fx.Node, fx.Node]:
    """(n [Bm, 1, Nq, 1], masked sum of V [B, Hkv, Nq, Dv]), both in V's accumulation dtype, when row i
    admits the keys lo_i <= j < hi_i (causal / window around diag_offset, j < kv_lens[b], j <= q_pos[b, i]):
    from a prefix sum of V in fp64, so that total - (prefix[hi] - prefix[lo]) loses nothing to cancellation."""
    vv = example_value(v)
    acc = torch.promote_types(vv.dtype, torch.float32)
    nk = size_arg(graph, v, 2)
    i = _arange(graph, q, 2)
    base = i if isinstance(diag_offset, int) and diag_offset == 0 else call(graph, operator.add, i, diag_offset)
    lo: Any = call(graph, torch.zeros_like, i)
    hi: Any = call(graph, torch.full_like, i, nk)
    if causal:
        hi = call(graph, torch.minimum, hi, call(graph, operator.add, base, 1))
    if window_right >= 0:
        hi = call(graph, torch.minimum, hi, call(graph, operator.add, base, window_right + 1))
    if window_left >= 0:
        lo = call(graph, torch.maximum, lo, call(graph, operator.sub, base, window_left))
    hi = call(graph, torch.unsqueeze, hi, 0)  # [1, Nq]
    lo = call(graph, torch.unsqueeze, lo, 0)
    if kv_lens is not None:
        lens = call(graph, torch.unsqueeze, call(graph, "to", kv_lens, torch.int64, method=True), 1)  # [B, 1]
        hi = call(graph, torch.minimum, hi, lens)
    if q_pos is not None:  # [B or 1, Nq]
        limit = call(graph, operator.add, call(graph, "to", _rows(graph, q_pos), torch.int64, method=True), 1)
        hi = call(graph, torch.minimum, call(graph, torch.clamp, limit, -1, nk), hi)
    lo = call(graph, torch.clamp, lo, 0, nk)
    hi = call(graph, torch.maximum, call(graph, torch.clamp, hi, 0, nk), lo)  # an empty interval: hi = lo
    lo4 = call(graph, torch.unsqueeze, call(graph, torch.unsqueeze, lo, 1), -1)  # [Bm, 1, Nq, 1]
    hi4 = call(graph, torch.unsqueeze, call(graph, torch.unsqueeze, hi, 1), -1)
    v64 = call(graph, "to", v, torch.float64, method=True)
    prefix = call(graph, torch.cumsum, v64, 2)
    zero = call(graph, torch.zeros_like, call(graph, torch.narrow, prefix, 2, 0, 1))
    prefix = call(graph, torch.cat, [zero, prefix], 2)  # prefix[j] = sum of v[:j] (F.pad specializes sizes)
    total = call(graph, torch.sum, v64, 2, keepdim=True)
    sizes = (size_arg(graph, v, 0), size_arg(graph, v, 1), size_arg(graph, q, 2), size_arg(graph, v, 3))

    def at(idx: fx.Node) -> fx.Node:  # prefix[..., idx, :] (take_along_dim's broadcast specializes sizes)
        return call(graph, torch.gather, prefix, 2, call(graph, "expand", idx, *sizes, method=True))

    inside = call(graph, operator.sub, at(hi4), at(lo4))
    vsum = call(graph, "to", call(graph, operator.sub, total, inside), acc, method=True)
    n = call(graph, "to", call(graph, operator.sub, nk, call(graph, operator.sub, hi4, lo4)), acc, method=True)
    return n, vsum


def _finite_fill(graph: fx.Graph, q: fx.Node, v: fx.Node, out: fx.Node, lse: fx.Node, c: float, *, causal: bool,
                 diag_offset: Union[int, fx.Node], window_left: int, window_right: int, bias: Optional[fx.Node],
                 kv_lens: Optional[fx.Node], q_pos: Optional[fx.Node] = None, q_seg: Optional[fx.Node] = None,
                 k_seg: Optional[fx.Node] = None) -> fx.Node:
    """Eager's result when every masked score was replaced by the finite c, from the op's (out, lse) over
    the admissible keys. With n masked keys in a row and Vm their mean value, eager's softmax gives
    them the weight n e^c against e^lse, so exactly
        O = sig * out + (1 - sig) * Vm,   sig = sigmoid(lse - c - log n)
    (a fully masked row: lse = -inf, O = mean of V; n = 0: sig = 1). In fp32 sig is exactly 1 wherever
    the fill is negligible, so those rows keep the op's out bit for bit. Gradients are eager's: masked
    scores get none (they are constants), V at masked keys gets its share through Vm, and q, k get the
    admissible scores' share through out and lse (fa3.attention differentiates its lse).

    Precision: lse is fp32, rounded to half an ulp of |lse| (about |c| on the rows where the fill
    matters), so the masked keys' share there has a relative error up to ulp(|c|) / 2: 2.4e-4 at
    c = -1e4 (below fp16 / bf16 output rounding), 32 (e^32) at c = -1e9, where eager's own fp32
    scores are rounded to 64. Rows where the fill is negligible are exact.

    n and the masked sum of V: for a band (with key lengths or not) the admissible keys of a row are
    one interval, so both come from prefix sums of V (fp64, no cancellation), O(Nk Dv) per batch and
    head (q_pos bounds the interval too); a query-dependent bool mask or segment ids take one
    [.., Nq, Nk] x [Nk, Dv] product, O(Nq Nk Dv)."""
    qv, vv = example_value(q), example_value(v)
    hq, hkv = qv.shape[1], vv.shape[1]
    acc = torch.promote_types(qv.dtype, torch.float32)
    hm = 1
    if (bias is None or example_value(bias).dtype != torch.bool) and q_seg is None:
        n, vsum = _band_masked_sums(graph, q, v, causal=causal, diag_offset=diag_offset, window_left=window_left,
                                    window_right=window_right, kv_lens=kv_lens, q_pos=q_pos)
    else:
        keep = _keep_mask(graph, q, v, causal=causal, diag_offset=diag_offset, window_left=window_left,
                          window_right=window_right,
                          bias=bias if bias is not None and example_value(bias).dtype == torch.bool else None,
                          kv_lens=kv_lens, q_pos=q_pos, q_seg=q_seg, k_seg=k_seg)
        masked = call(graph, "to", call(graph, torch.logical_not, keep), acc, method=True)
        mv = example_value(masked)
        if mv.shape[-1] == 1 and vv.shape[2] != 1:  # a mask constant along the keys (whole query rows): per key
            masked = call(graph, "expand", masked, *([-1] * (mv.dim() - 1)), size_arg(graph, v, 2), method=True)
        n = call(graph, torch.sum, masked, -1, keepdim=True)  # [Bm, Hm, Qm, 1]
        vf = call(graph, "to", v, acc, method=True)
        hm = example_value(masked).shape[1]
        if hq != hkv and hm != 1:  # a per-head mask: each q head reads its kv head
            vf = call(graph, torch.repeat_interleave, vf, hq // hkv, dim=1)
        vsum = call(graph, torch.matmul, masked, vf)  # [B, Hm or Hkv, Qm, Dv]
    if hq != hkv and hm == 1:
        vsum = call(graph, torch.repeat_interleave, vsum, hq // hkv, dim=1)
    vm = call(graph, torch.div, vsum, call(graph, torch.clamp, n, min=1.0))
    x = call(graph, operator.sub, call(graph, torch.unsqueeze, lse, -1), call(graph, torch.log, n))
    sig = call(graph, torch.sigmoid, call(graph, operator.sub, x, float(c)))
    admitted = call(graph, torch.mul, sig, call(graph, "to", out, acc, method=True))
    res = call(graph, torch.add, admitted, call(graph, torch.mul, call(graph, torch.rsub, sig, 1.0), vm))
    return call(graph, "to", res, example_value(out).dtype, method=True)
