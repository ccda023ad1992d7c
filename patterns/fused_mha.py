"""nn.MultiheadAttention -> its projections + one fa3.attention, matching the functional's math.

Dynamo hands the module over as one `F.multi_head_attention_forward` call (the module has already
transposed batch_first inputs to [L, B, E]). Its two paths differ where it matters:
- need_weights=True: softmax(baddbmm(mask, q * sqrt(1/Dh), k^T)) -> dropout -> bmm. is_causal is
  ignored (the mask is used), and a row whose keys are all masked gives NaN (empty_rows "nan").
  The averaged weights need the probabilities: rewritten only when that output is unused.
- need_weights=False: SDPA(q, k, v, mask, dropout, is_causal); is_causal replaces the mask only
  without a key_padding_mask; a fully masked row gives 0 (empty_rows "zero").
Both: bool masks mean True = masked out (converted to -inf), key_padding_mask [B, S] is added to
attn_mask ([L, S] or [B*H, L, S]); bias_k / bias_v append one key (masks padded with 0), as does
add_zero_attn; dropout only when training.

`torch._native_multi_head_attention` (the module's inference fast path, and the attention inside
`torch._transformer_encoder_layer_fwd`) is handled here too: its mask is converted to bool
(any nonzero value masks, whatever the float) and a fully masked row gives NaN.
"""
from __future__ import annotations

import inspect
import operator
from typing import Any, Optional

import torch
import torch.fx as fx
import torch.nn.functional as F

from .fused_common import (
    Builder, Refuse, check_scalars, const, emit_attention, guarded_rewrite, options_allow_dropout, shape_of, static_int,
    structured_mask, tensor_value,
)
from .site import PassOptions, SiteReport

MHA_TARGET = F.multi_head_attention_forward
_MHA_SIG = inspect.signature(F.multi_head_attention_forward)
NATIVE_MHA_TARGET = torch._native_multi_head_attention
_NATIVE_ARGS = ("query", "key", "value", "embed_dim", "num_head", "qkv_weight", "qkv_bias", "proj_weight",
                "proj_bias", "mask", "need_weights", "average_attn_weights", "mask_type")
_NATIVE_DEFAULTS = {"mask": None, "need_weights": True, "average_attn_weights": True, "mask_type": None}


def is_mha(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is MHA_TARGET


def is_native_mha(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is NATIVE_MHA_TARGET


def _split_outputs(node: fx.Node, weights_needed: bool) -> tuple[list, list]:
    """getitem users of the (output, weights) tuple; refuse when the weights are used."""
    outs, weights = [], []
    for user in node.users:
        if user.op == "call_function" and user.target is operator.getitem and user.args[1] in (0, 1):
            (outs if user.args[1] == 0 else weights).append(user)
        else:
            raise Refuse("the (output, weights) tuple is used as a whole, so the weights may be read")
    if any(w.users for w in weights):
        if weights_needed:
            raise Refuse("need_weights=True and the returned attention weights are used: they need the "
                         "probabilities, which the fused kernel never materializes")
        raise Refuse("the weights output (None) is used")
    return outs, weights


def _finish(b: Builder, node: fx.Node, outs: list, weights: list, new_out: fx.Node) -> None:
    for o in outs:
        b.replace(o, new_out)
    for w in weights:
        b.erase(w)
    b.erase(node)


def _linear(b: Builder, x: fx.Node, w: fx.Node, bias: Any) -> fx.Node:
    return b.f(torch._C._nn.linear, x, w, bias)


def _rows(b: Builder, t: Any, i: int, n: int) -> Any:
    """Rows [i*n, (i+1)*n) of a packed weight or bias (a view)."""
    return None if t is None else b.f(torch.narrow, t, 0, i * n, n)


def _heads(b: Builder, t: fx.Node, heads: int, head_dim: int, order: tuple) -> fx.Node:
    """Split the last dim into (heads, head_dim) and permute to [B, H, N, Dh] (a view)."""
    return b.m("permute", b.m("unflatten", t, -1, (heads, head_dim)), *order)


def _mask_kind(val: torch.Tensor, name: str) -> bool:
    """True for a bool mask, False for a float one; anything else is refused (eager raises)."""
    if val.dtype == torch.bool:
        return True
    if val.dtype.is_floating_point:
        return False
    raise Refuse(f"{name} dtype {val.dtype} is neither bool nor floating")


def _combine_masks(b: Builder, masks: list, q_dtype: torch.dtype) -> tuple[Optional[fx.Node], str]:
    """MHA masks (bool: True = masked out; float: additive) -> the op's bias, and its report kind.

    All bool: one keep-mask. Otherwise eager's arithmetic: bools become 0 / -inf in the query's
    dtype and everything is summed (x + -inf = -inf, so both forms mask the same entries).
    """
    if not masks:
        return None, "none"
    if all(is_bool for _, is_bool in masks):
        masked = masks[0][0]
        for m, _ in masks[1:]:
            masked = b.f(torch.logical_or, masked, m)
        return b.f(torch.logical_not, masked), "bool-mask"
    total = None
    for m, is_bool in masks:
        if is_bool:
            m = b.m("masked_fill", b.f(torch.zeros_like, m, dtype=q_dtype), m, float("-inf"))
        total = m if total is None else b.f(operator.add, total, m)
    return total, "bias"


def rewrite_mha(graph: fx.Graph, node: fx.Node, options: PassOptions, cache: Optional[dict] = None,
                autocast: Optional[bool] = False) -> SiteReport:
    """`autocast`: whether the call runs under autocast (regions.State.autocast_on; None: not known)."""
    return guarded_rewrite("mha", graph, node,
                           lambda b, rep: _rewrite_mha(b, node, options, rep, {} if cache is None else cache, autocast))


def _autocast_dtype(node: fx.Node, query: torch.Tensor, autocast: Optional[bool]) -> Optional[torch.dtype]:
    """The dtype the functional computes in under autocast (its output's, where that differs from the query's), or
    None. Its linears, SDPA / baddbmm and bmm all run in that dtype on inputs cast to it (attn_mask included); the
    rewrite makes those casts explicit, as the graph's example values do not apply autocast."""
    val = getattr(node, "meta", {}).get("example_value")
    out = val[0] if isinstance(val, (tuple, list)) and val else None
    if not isinstance(out, torch.Tensor):
        return None
    if autocast is not True:
        if out.dtype != query.dtype:
            raise Refuse(f"the call's output is {out.dtype} where its query is {query.dtype}, outside a known "
                         "autocast region")
        return None
    if not (out.dtype.is_floating_point and query.dtype.is_floating_point):
        raise Refuse(f"the call's output is {out.dtype} where its query is {query.dtype}")
    # also where the query is in that dtype already: the weights may not be (bf16 activations, fp32 weights)
    return out.dtype


def _rewrite_mha(b: Builder, node: fx.Node, options: PassOptions, rep: SiteReport, cache: dict,
                 autocast: Optional[bool] = False) -> None:
    try:
        bound = _MHA_SIG.bind(*node.args, **node.kwargs)
    except TypeError as e:
        raise Refuse(f"multi_head_attention_forward arguments do not bind: {e}") from None
    bound.apply_defaults()
    a = bound.arguments
    need_weights = bool(const(a["need_weights"], "need_weights"))
    outs, weights = _split_outputs(node, need_weights)
    for name in ("static_k", "static_v"):
        if a[name] is not None:
            raise Refuse(f"{name} is given (precomputed keys/values replace the projection)")
    training = bool(const(a["training"], "training"))
    dropout_p = float(const(a["dropout_p"], "dropout_p")) if training else 0.0
    check_scalars(dropout_p)
    options_allow_dropout(options, dropout_p)
    is_causal = bool(const(a["is_causal"], "is_causal"))
    add_zero_attn = bool(const(a["add_zero_attn"], "add_zero_attn"))
    separate = bool(const(a["use_separate_proj_weight"], "use_separate_proj_weight"))
    embed_dim = static_int(const(a["embed_dim_to_check"], "embed_dim_to_check"), "embed_dim")
    heads = static_int(const(a["num_heads"], "num_heads"), "num_heads")
    head_dim = embed_dim // heads
    if head_dim * heads != embed_dim:
        raise Refuse(f"embed_dim {embed_dim} is not divisible by num_heads {heads}")
    query, key, value = a["query"], a["key"], a["value"]
    kpm, attn_mask = a["key_padding_mask"], a["attn_mask"]
    bias_k, bias_v = a["bias_k"], a["bias_v"]
    qv = tensor_value(query, "query")
    kv, vv = tensor_value(key, "key"), tensor_value(value, "value")
    rep.dtype = str(qv.dtype).replace("torch.", "")
    cast_to = _autocast_dtype(node, qv, autocast)
    if cast_to is not None:
        rep.dtype = str(cast_to).replace("torch.", "")

        def cast(t: Any) -> Any:
            return b.m("to", t, cast_to) if isinstance(t, fx.Node) else t

        casts = {t: cast(t) for t in dict.fromkeys((query, key, value))}  # one cast per distinct input
        query, key, value = casts[query], casts[key], casts[value]
        for name in ("in_proj_weight", "in_proj_bias", "q_proj_weight", "k_proj_weight", "v_proj_weight",
                     "out_proj_weight", "out_proj_bias", "bias_k", "bias_v"):
            a[name] = cast(a[name])
        bias_k, bias_v = a["bias_k"], a["bias_v"]
    if qv.dim() not in (2, 3) or kv.dim() != qv.dim() or vv.dim() != qv.dim():
        raise Refuse(f"query/key/value ranks {qv.dim()}/{kv.dim()}/{vv.dim()}: expected all 3 (or all 2, unbatched)")
    if is_causal and attn_mask is None:
        raise Refuse("is_causal=True without attn_mask (the functional raises)")
    if (bias_k is None) != (bias_v is None):
        raise Refuse("only one of bias_k, bias_v is given (the functional raises)")
    for name, t in (("attn_mask", attn_mask), ("key_padding_mask", kpm), ("bias_k", bias_k)):
        if t is not None and not isinstance(t, fx.Node):
            raise Refuse(f"{name} is a constant {type(t).__name__}, not a tensor")

    unbatched = qv.dim() == 2
    if unbatched:
        # one unsqueeze per distinct input, so self-attention keeps its packed projection
        batched = {t: None for t in (query, key, value)}
        for t in batched:
            batched[t] = b.m("unsqueeze", t, 1)
        query, key, value = batched[query], batched[key], batched[value]
        if kpm is not None:
            kpm = b.m("unsqueeze", kpm, 0)
    batch = b.size(query, 1)

    # In-projection, as _in_projection_packed / _in_projection compute it.
    in_w, in_b = a["in_proj_weight"], a["in_proj_bias"]
    if not separate:
        if in_w is None:
            raise Refuse("in_proj_weight is None without use_separate_proj_weight")
        if query is key and key is value:
            packed = _linear(b, query, in_w, in_b)
            qp, kp, vp = (b.f(torch.narrow, packed, -1, i * embed_dim, embed_dim) for i in range(3))
        else:
            qp, kp, vp = (_linear(b, x, _rows(b, in_w, i, embed_dim), _rows(b, in_b, i, embed_dim))
                          for i, x in enumerate((query, key, value)))
    else:
        ws = (a["q_proj_weight"], a["k_proj_weight"], a["v_proj_weight"])
        if any(w is None for w in ws):
            raise Refuse("use_separate_proj_weight with a missing q/k/v_proj_weight")
        qp, kp, vp = (_linear(b, x, w, _rows(b, in_b, i, embed_dim))
                      for i, (x, w) in enumerate(zip((query, key, value), ws)))

    # Masks in [B, H, L, S] broadcast form; True / -inf = masked out.
    masks: list = []
    if attn_mask is not None:
        mv = tensor_value(attn_mask, "attn_mask")
        is_bool = _mask_kind(mv, "attn_mask")
        if mv.dim() == 3:
            attn_mask = b.m("unflatten", attn_mask, 0, (-1, heads))
        elif mv.dim() != 2:
            raise Refuse(f"attn_mask has {mv.dim()} dims (the functional takes 2 or 3)")
        masks.append([attn_mask, is_bool])
    if kpm is not None:
        is_bool = _mask_kind(tensor_value(kpm, "key_padding_mask"), "key_padding_mask")
        masks.append([b.m("unsqueeze", b.m("unsqueeze", kpm, 1), 1), is_bool])
    causal = False
    if not need_weights and is_causal and kpm is None:
        masks, causal = [], True  # the functional hands is_causal to SDPA and drops attn_mask

    extra_keys = (1 if bias_k is not None else 0) + (1 if add_zero_attn else 0)
    if bias_k is not None:
        kp = b.f(torch.cat, [kp, b.m("expand", bias_k, -1, batch, -1)])
        vp = b.f(torch.cat, [vp, b.m("expand", bias_v, -1, batch, -1)])
    q4 = _heads(b, qp, heads, head_dim, (1, 2, 0, 3))
    k4 = _heads(b, kp, heads, head_dim, (1, 2, 0, 3))
    v4 = _heads(b, vp, heads, head_dim, (1, 2, 0, 3))
    if add_zero_attn:
        k4 = b.f(torch.cat, [k4, b.f(torch.zeros_like, b.f(torch.narrow, k4, 2, 0, 1))], dim=2)
        v4 = b.f(torch.cat, [v4, b.f(torch.zeros_like, b.f(torch.narrow, v4, 2, 0, 1))], dim=2)
    for m in masks:
        for _ in range(extra_keys):
            m[0] = b.f(F.pad, m[0], (0, 1))

    bias, kind = _combine_masks(b, masks, qv.dtype)  # the functional's masks: the query's dtype (_canonical_mask)
    if cast_to is not None and kind == "bias":
        bias = b.m("to", bias, cast_to)  # SDPA's and baddbmm's autocast casts the summed float mask
    if need_weights:
        scale = (1.0 / float(head_dim)) ** 0.5  # q * math.sqrt(1.0 / float(E)), as the functional
        empty_rows = "nan" if bias is not None else "impossible"  # softmax of an all -inf row
    else:
        scale = 1.0 / float(head_dim) ** 0.5
        empty_rows = "zero" if bias is not None else "impossible"  # SDPA's value on such a row
    mask_args = dict(causal=causal, diag_offset=0, bias=bias, empty_rows=empty_rows)
    rep.mask = "causal" if causal else kind
    if masks and not extra_keys:  # prove structure (causal masks built in the graph, ...) when possible
        terms = [("fill", m, float("-inf")) if is_bool else ("add", m, None) for m, is_bool in masks]
        mask_args, rep.mask = structured_mask(
            b, node, terms, tensor_value(q4, "q"), tensor_value(k4, "k"), sdpa=not need_weights,
            fallback=mask_args, fallback_kind=kind, cache=cache, dropout_p=dropout_p)
    if need_weights and mask_args.get("empty_rows") == "nan":
        # the functional adds every mask to the scores as a float mask (baddbmm), bool ones included: a row they
        # mask entirely passes its NaN gradient on to q and k as well
        mask_args = dict(mask_args, nan_grads="qkv")
    rep.q_shape, rep.k_shape, rep.v_shape = (shape_of(tensor_value(t, n)) for t, n in ((q4, "q"), (k4, "k"), (v4, "v")))
    rep.scale, rep.dropout_p = scale, dropout_p

    out4, call = emit_attention(
        b, q4, k4, v4, scale=scale, dropout_p=dropout_p, kernel=options.kernel, **mask_args,
    )
    out = b.m("flatten", b.m("permute", out4, 2, 0, 1, 3), 2)  # [L, B, E]
    out = _linear(b, out, a["out_proj_weight"], a["out_proj_bias"])
    if unbatched:
        out = b.m("squeeze", out, 1)
    _finish(b, node, outs, weights, out)
    rep.rewritten, rep.call = True, call
    cache.update(b.pending_cache)


# ---------------------------------------------------------------------------------------------
# torch._native_multi_head_attention (batch first) and the attention of the encoder-layer fast path


def native_attention(
    b: Builder, query: fx.Node, key: fx.Node, value: fx.Node, embed_dim: int, heads: int, qkv_w: fx.Node,
    qkv_b: fx.Node, proj_w: fx.Node, proj_b: fx.Node, mask: Any, mask_type: Any, options: PassOptions,
    rep: SiteReport, anchor: fx.Node, cache: dict,
) -> tuple[fx.Node, fx.Node]:
    """Native MHA on [B, T, E] inputs, need_weights=False: (output [B, T, E], the fa3 call)."""
    head_dim = embed_dim // heads
    if head_dim * heads != embed_dim:
        raise Refuse(f"embed_dim {embed_dim} is not divisible by num_heads {heads}")
    qv = tensor_value(query, "query")
    if qv.dim() != 3 or qv.is_nested:
        raise Refuse(f"query is {'nested' if qv.is_nested else f'{qv.dim()}-D'}; the decomposition needs a 3-D tensor")
    if query is key and key is value:
        packed = _linear(b, query, qkv_w, qkv_b)
        qp, kp, vp = (b.f(torch.narrow, packed, -1, i * embed_dim, embed_dim) for i in range(3))
    else:
        qp, kp, vp = (_linear(b, x, _rows(b, qkv_w, i, embed_dim), _rows(b, qkv_b, i, embed_dim))
                      for i, x in enumerate((query, key, value)))
    q4, k4, v4 = (_heads(b, t, heads, head_dim, (0, 2, 1, 3)) for t in (qp, kp, vp))
    mask_args: dict = dict(bias=None, empty_rows="impossible")
    if mask is not None:
        mv = tensor_value(mask, "mask")
        # masked_softmax converts the mask to bool: any nonzero entry masks, whatever its value.
        masked = mask if mv.dtype == torch.bool else b.f(torch.ne, mask, 0)
        mtype = const(mask_type, "mask_type")
        if mv.dim() == 2 and mtype == 1:
            masked = b.m("unsqueeze", b.m("unsqueeze", masked, 1), 1)  # key padding [B, T] -> [B, 1, 1, T]
        elif not (mv.dim() == 4 or (mv.dim() == 2 and mtype == 0)):  # [B, H, T, T] or [T, T] broadcast as is
            raise Refuse(f"a {mv.dim()}-D mask with mask_type={mtype}")
        # the masked softmax gives NaN on a row whose keys are all masked
        mask_args = dict(bias=b.f(torch.logical_not, masked), empty_rows="nan")
        mask_args, rep.mask = structured_mask(
            b, anchor, [("fill", masked, float("-inf"))], tensor_value(q4, "q"), tensor_value(k4, "k"), sdpa=False,
            fallback=mask_args, fallback_kind="bool-mask", cache=cache)
    scale = 1.0 / float(head_dim) ** 0.5
    rep.q_shape, rep.k_shape, rep.v_shape = (shape_of(tensor_value(t, n)) for t, n in ((q4, "q"), (k4, "k"), (v4, "v")))
    rep.dtype, rep.scale = str(qv.dtype).replace("torch.", ""), scale
    out4, call = emit_attention(b, q4, k4, v4, scale=scale, kernel=options.kernel, **mask_args)
    out = b.m("flatten", b.m("transpose", out4, 1, 2), 2)  # [B, T, E]: free, the op stores BSHD
    return _linear(b, out, proj_w, proj_b), call


def rewrite_native_mha(graph: fx.Graph, node: fx.Node, options: PassOptions,
                       cache: Optional[dict] = None) -> SiteReport:
    return guarded_rewrite("native-mha", graph, node, lambda b, rep: _rewrite_native(b, graph, node, options, rep, cache))


def _rewrite_native(b: Builder, graph: fx.Graph, node: fx.Node, options: PassOptions, rep: SiteReport,
                    cache: Optional[dict]) -> None:
    if len(node.args) > len(_NATIVE_ARGS):
        raise Refuse("unexpected positional arguments to _native_multi_head_attention")
    a = dict(_NATIVE_DEFAULTS)
    a.update(zip(_NATIVE_ARGS, node.args))
    a.update(node.kwargs)
    need_weights = bool(const(a["need_weights"], "need_weights"))
    outs, weights = _split_outputs(node, need_weights)
    embed_dim = static_int(const(a["embed_dim"], "embed_dim"), "embed_dim")
    heads = static_int(const(a["num_head"], "num_head"), "num_head")
    out, call = native_attention(
        b, a["query"], a["key"], a["value"], embed_dim, heads, a["qkv_weight"], a["qkv_bias"],
        a["proj_weight"], a["proj_bias"], a["mask"], a["mask_type"], options, rep, node,
        {} if cache is None else cache,
    )
    _finish(b, node, outs, weights, out)
    rep.rewritten, rep.call = True, call
    if cache is not None:
        cache.update(b.pending_cache)
