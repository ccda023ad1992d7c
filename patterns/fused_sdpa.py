"""`F.scaled_dot_product_attention` -> fa3.attention, with every argument of SDPA.

SDPA's semantics kept exactly:
- attn_mask: bool (True = attend) or float (added to the scores), broadcasting to [..., L, S].
  masks.analyze_mask turns what it proves (causal, window, key lengths) into the op's arguments;
  the rest stays the op's bias, which is SDPA's own arithmetic.
- dropout_p is applied whatever the module's training flag (the caller passes 0 in eval).
- is_causal: top-left alignment (diag_offset 0). With an explicit attn_mask as well, SDPA's result
  depends on the backend (the CPU flash kernel combines both, the math backend raises): refused.
- scale None -> 1/sqrt(E). enable_gqa: Hq a multiple of Hkv (native GQA, no repeated K/V);
  without it, K/V heads of 1 broadcast (MQA) and batch dims of 1 broadcast (an expand view).
- A row with no admissible key: SDPA returns 0 there (torch 2.13 CPU flash and math, and the math
  backend's _safe_softmax since 2.5), which is what the op returns: empty_rows "zero".
- Inputs of any rank [..., L, E]: 3-D gets a head dim of 1, more than 4 dims fold the leading
  dims into the batch; both are views (refused if the fold would copy).
"""
from __future__ import annotations

from typing import Any, Optional

import torch
import torch.fx as fx

from . import emit
from .aliasing import escapes, may_be_view_of, written_in_place
from .fused_common import (
    Builder, Refuse, check_scalars, const, default_scale, emit_attention, guarded_rewrite, options_allow_dropout,
    runtime_scale, same_size, shape_of, structured_mask, tensor_value,
)
from .layout import eager_layout, fresh_copy_kwargs
from .site import PassOptions, SiteReport

SDPA_TARGETS = (torch._C._nn.scaled_dot_product_attention, torch.nn.functional.scaled_dot_product_attention)
_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_SDPA_DEFAULTS = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}


def is_sdpa(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in SDPA_TARGETS


def sdpa_args(node: fx.Node) -> dict:
    if len(node.args) > len(_SDPA_ARGS):
        raise Refuse(f"unexpected positional arguments to scaled_dot_product_attention: {len(node.args)}")
    bound = dict(_SDPA_DEFAULTS)
    bound.update(zip(_SDPA_ARGS, node.args))
    for key, val in node.kwargs.items():
        if key not in _SDPA_ARGS:
            raise Refuse(f"unknown argument {key!r} to scaled_dot_product_attention")
        bound[key] = val
    return bound


def _to_4d(b: Builder, t: fx.Node, nd: int, name: str, heads_first: bool = False) -> fx.Node:
    """[..., N, E] -> [B, H, N, E]: a view, or for leading dims that no view folds (NesT's and Hiera's
    `permute(3, 0, 4, 1, 2, 5)` of a fused QKV projection) a copy, which `flatten` makes then; autograd takes
    the gradient back through it as through any reshape. `heads_first`: a 3-D input's leading dim is its heads
    (SDPA's enable_gqa groups dim -3)."""
    if nd == 4:
        return t
    if nd == 3:
        return b.m("unsqueeze", t, 0 if heads_first else 1)
    if nd == 2:
        return b.m("unsqueeze", b.m("unsqueeze", t, 0), 0)
    return b.m("flatten", t, 0, nd - 4)


def _gqa(hq: Any, hkv: Any, enable_gqa: bool, repeat_removed: bool) -> str:
    """How query heads share K/V heads (op semantics: head h reads kv head h // (Hq // Hkv))."""
    how = "repeat_kv removed" if repeat_removed else "enable_gqa" if enable_gqa else "broadcast"
    if isinstance(hkv, int) and hkv == 1:
        return f"Hq={hq}/Hkv=1 ({how})"  # MQA: a K/V head of 1 broadcasts, with or without enable_gqa
    if not (enable_gqa or repeat_removed):
        raise Refuse(f"query heads {hq} vs key/value heads {hkv}: needs enable_gqa=True")
    if isinstance(hq, int) and isinstance(hkv, int):
        divides = hq % hkv == 0
    else:  # dynamic head counts: SDPA's own checks left guards that make this provable, or we refuse
        from torch.fx.experimental.symbolic_shapes import statically_known_true

        divides = bool(statically_known_true(hq % hkv == 0))
    if not divides:
        raise Refuse(f"query heads {hq} are not provably a multiple of key/value heads {hkv}")
    return f"Hq={hq}/Hkv={hkv} ({how})"


def _unrepeat_kv(k4: fx.Node, v4: fx.Node, hq: Any) -> tuple[fx.Node, fx.Node, bool]:
    """K/V repeated on the head axis before SDPA (repeat_kv's expand + reshape, repeat_interleave):
    read the un-repeated tensors instead (native GQA, no repeated copy in memory)."""
    try:
        from .gqa import unrepeat
        from .layout import View
    except ImportError:
        return k4, v4, False
    bases = []
    for t in (k4, v4):
        val = tensor_value(t, "key/value")
        try:
            view = unrepeat(View(t, (0, 1, 2, 3), val.dtype), 1)
        except Exception:
            return k4, v4, False
        base = example_value_of(view.node)
        if view.node is t or view.perm != (0, 1, 2, 3) or view.bcast_axes or base is None or base.dim() != 4:
            return k4, v4, False
        bases.append((view.node, base))
    (kb, kv), (vb, vv) = bases
    if not same_size(kv.shape[1], vv.shape[1]):
        return k4, v4, False
    try:
        _gqa(hq, kv.shape[1], False, True)
    except Refuse:
        return k4, v4, False
    return kb, vb, True


def example_value_of(node: Any) -> Optional[torch.Tensor]:
    val = emit.example_value(node)
    return val if isinstance(val, torch.Tensor) else None


def _expand_batch(b: Builder, t: fx.Node, batch: Any, name: str) -> fx.Node:
    """Broadcast a batch dim of 1 to the query's batch (an expand view, no copy)."""
    tb = tensor_value(t, name).shape[0]
    if same_size(tb, batch):
        return t
    if isinstance(tb, int) and tb == 1:
        return b.m("expand", t, batch, -1, -1, -1)
    raise Refuse(f"{name}: batch {tb} does not broadcast to the query's batch {batch}")


def rewrite_sdpa(graph: fx.Graph, node: fx.Node, options: PassOptions, cache: Optional[dict] = None) -> SiteReport:
    """cache: mask analyses shared by the SDPA sites of one graph (models reuse one mask per layer)."""
    return guarded_rewrite("sdpa", graph, node,
                           lambda b, rep: _rewrite(b, node, options, rep, {} if cache is None else cache))


def _rewrite(b: Builder, node: fx.Node, options: PassOptions, rep: SiteReport, cache: dict) -> None:
    a = sdpa_args(node)
    q, k, v, mask = a["query"], a["key"], a["value"], a["attn_mask"]
    qv, kv, vv = tensor_value(q, "query"), tensor_value(k, "key"), tensor_value(v, "value")
    rep.q_shape, rep.k_shape, rep.v_shape = shape_of(qv), shape_of(kv), shape_of(vv)
    rep.dtype = str(qv.dtype).replace("torch.", "")
    dropout_p = float(const(a["dropout_p"], "dropout_p"))
    is_causal = bool(const(a["is_causal"], "is_causal"))
    enable_gqa = bool(const(a["enable_gqa"], "enable_gqa"))
    scale = a["scale"]
    rep.dropout_p = dropout_p
    options_allow_dropout(options, dropout_p)
    if isinstance(mask, fx.Node) and is_causal:
        raise Refuse("attn_mask together with is_causal=True: SDPA's result depends on the backend "
                     "(the CPU flash kernel applies both, the math backend raises)")
    if mask is not None and not isinstance(mask, fx.Node):
        raise Refuse(f"attn_mask is a constant {type(mask).__name__}, not a tensor")
    nd = qv.dim()
    if kv.dim() != nd or vv.dim() != nd:
        raise Refuse(f"query, key, value ranks differ ({nd}, {kv.dim()}, {vv.dim()})")
    if nd > 4 and not all(same_size(x, y) and same_size(x, z)
                          for x, y, z in zip(qv.shape[:-3], kv.shape[:-3], vv.shape[:-3])):
        raise Refuse(f"{nd}-D inputs whose leading dims broadcast ({rep.q_shape}, {rep.k_shape}, {rep.v_shape})")
    head_dim = qv.shape[-1]
    if not same_size(kv.shape[-1], head_dim):
        raise Refuse(f"key head dim {kv.shape[-1]} differs from the query's {head_dim}")
    if scale is None:
        scale = default_scale(b, q, head_dim)
    elif isinstance(scale, fx.Node):
        scale = runtime_scale(scale)
    else:
        scale = float(scale)
    rep.scale = scale if isinstance(scale, float) else f"{scale.name} (run time)"
    check_scalars(dropout_p, scale)

    # 3-D inputs under enable_gqa with fewer key than query heads: SDPA groups their leading dim (dim -3)
    heads_first = nd == 3 and enable_gqa and not same_size(qv.shape[0], kv.shape[0])
    q4, k4, v4 = (_to_4d(b, t, nd, n, heads_first) for t, n in ((q, "query"), (k, "key"), (v, "value")))
    q4v = tensor_value(q4, "query")
    batch, hq = q4v.shape[0], q4v.shape[1]
    k4, v4, repeat_removed = _unrepeat_kv(k4, v4, hq)
    k4v, v4v = tensor_value(k4, "key"), tensor_value(v4, "value")
    hk, hv = k4v.shape[1], v4v.shape[1]
    if not same_size(hk, hv) and (isinstance(hk, int) and hk == 1 or isinstance(hv, int) and hv == 1):
        # one of K / V has one head and broadcasts, as SDPA broadcasts it: a stride-0 view to the other's count
        if isinstance(hk, int) and hk == 1:
            k4 = b.m("expand", k4, -1, hv, -1, -1)
        else:
            v4 = b.m("expand", v4, -1, hk, -1, -1)
        k4v, v4v = tensor_value(k4, "key"), tensor_value(v4, "value")
    if not same_size(k4v.shape[1], v4v.shape[1]):
        raise Refuse(f"key and value head counts differ ({k4v.shape[1]} vs {v4v.shape[1]})")
    hkv = k4v.shape[1]
    if not same_size(hq, hkv):
        rep.gqa = _gqa(hq, hkv, enable_gqa, repeat_removed)
    k4 = _expand_batch(b, k4, batch, "key")
    v4 = _expand_batch(b, v4, batch, "value")
    out_dtype = tensor_value(node, "output").dtype
    if out_dtype != qv.dtype:
        # autocast: SDPA ran on its floating inputs cast to the region's dtype, the mask included
        q4, k4, v4 = (b.m("to", t, out_dtype) for t in (q4, k4, v4))
        rep.dtype = str(out_dtype).replace("torch.", "")
        if isinstance(mask, fx.Node) and tensor_value(mask, "attn_mask").dtype.is_floating_point:
            mask = b.m("to", mask, out_dtype)

    mask_args: dict = dict(causal=is_causal, diag_offset=0, bias=None, empty_rows="impossible")
    if mask is not None:
        mv = tensor_value(mask, "attn_mask")
        if mv.dtype != torch.bool and not mv.dtype.is_floating_point:
            raise Refuse(f"attn_mask dtype {mv.dtype} is neither bool nor floating")
        bias = mask
        if nd == 3 and mv.dim() == 3:
            bias = b.m("unsqueeze", mask, 0 if heads_first else 1)
        elif nd > 4 and mv.dim() > 3:
            raise Refuse(f"a {mv.dim()}-D attn_mask with {nd}-D inputs (would need a copy to fold)")
        elif mv.dim() > 4:
            raise Refuse(f"a {mv.dim()}-D attn_mask with {nd}-D inputs")
        mask_args, rep.mask = _mask_structure(b, node, bias, mv.dtype, q4v, k4v, cache, dropout_p)
    elif is_causal:
        rep.mask = "causal"

    out4, call = emit_attention(b, q4, k4, v4, scale=scale, dropout_p=dropout_p, kernel=options.kernel, **mask_args)
    b.nodes.append(out4)
    out = out4
    if nd == 3:
        out = b.m("squeeze", out4, 0 if heads_first else 1)
    elif nd == 2:
        out = b.m("squeeze", b.m("squeeze", out4, 0), 0)
    elif nd > 4:
        lead = [b.size(q, i) for i in range(nd - 3)]
        out = b.m("unflatten", out4, 0, tuple(lead))
    ov = example_value_of(node)
    if written_in_place(node):
        # `o += x` must not write into the op's output, which autograd saved; with eager's strides (layout.eager_layout)
        layout = eager_layout(ov, tensor_value(out, "output")) if ov is not None else None
        if layout is None:
            raise Refuse("the output is written in place and eager's layout of it is neither contiguous nor the op's")
        out = b.m("clone", out, **layout)
    elif ov is not None and ov.requires_grad and escapes(node) and may_be_view_of(out, call):
        # nor the caller's after the call: a copy Inductor keeps (find_sites/rewrite.py)
        copy = fresh_copy_kwargs(tensor_value(out, "output"))
        out = b.m("clone", out, **copy) if copy is not None else b.m("mul", out, 1.0)
    b.replace(node, out)
    rep.rewritten, rep.call = True, call
    cache.update(b.pending_cache)


def _mask_structure(b: Builder, node: fx.Node, bias: fx.Node, dtype: torch.dtype, q4v: torch.Tensor,
                    k4v: torch.Tensor, cache: dict, dropout_p: float) -> tuple[dict, str]:
    """attn_mask -> the op's mask arguments: structure proven by masks.analyze_mask (causal, window,
    key lengths), else the mask itself as the bias, which is SDPA's own arithmetic (exact)."""
    fallback = dict(causal=False, diag_offset=0, bias=bias, empty_rows="zero")  # SDPA: 0 on empty rows
    kind = "bool-mask" if dtype == torch.bool else "bias"
    term = ("bool", bias, None) if dtype == torch.bool else ("add", bias, None)
    return structured_mask(b, node, [term], q4v, k4v, sdpa=True, fallback=fallback, fallback_kind=kind, cache=cache,
                           dropout_p=dropout_p)
