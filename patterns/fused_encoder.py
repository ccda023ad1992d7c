"""`torch._transformer_encoder_layer_fwd` (nn.TransformerEncoderLayer's inference fast path) ->
layer norms, projections, one fa3.attention, feed-forward, residuals.

What the fused op computes (aten transformer_encoder_layer_forward), kept op for op:
    x = src;  if norm_first: x = layer_norm_1(x)
    x = native_mha(x, x, x, mask, mask_type, need_weights=False) + src
    if not norm_first: x = layer_norm_1(x)
    r = x;    if norm_first: x = layer_norm_2(x)
    x = addmm(b2, _addmm_activation(b1, x, W1^T, use_gelu), W2^T) + r
    if not norm_first: x = layer_norm_2(x)
The feed-forward stays `torch._addmm_activation`, the very op the fast path runs: its GELU is exact
on CPU and the tanh approximation on CUDA, so the decomposition keeps each device's numbers.
The attention mask is read as the fast path reads it (nonzero = masked; NaN on fully masked rows),
see fused_mha.native_attention. Training never reaches this op (the module takes the
multi_head_attention_forward path then, handled in fused_mha).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.fx as fx
import torch.nn.functional as F

from .fused_common import Builder, Refuse, const, guarded_rewrite, static_int, tensor_value
from .fused_mha import native_attention
from .site import PassOptions, SiteReport

ENCODER_LAYER_TARGET = torch._transformer_encoder_layer_fwd
_ARGS = ("src", "embed_dim", "num_heads", "qkv_weight", "qkv_bias", "proj_weight", "proj_bias", "use_gelu",
         "norm_first", "eps", "norm_weight_1", "norm_bias_1", "norm_weight_2", "norm_bias_2", "ffn_weight_1",
         "ffn_bias_1", "ffn_weight_2", "ffn_bias_2", "mask", "mask_type")


def is_encoder_layer(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is ENCODER_LAYER_TARGET


def rewrite_encoder_layer(graph: fx.Graph, node: fx.Node, options: PassOptions,
                          cache: Optional[dict] = None) -> SiteReport:
    return guarded_rewrite("encoder-layer", graph, node,
                           lambda b, rep: _rewrite(b, node, options, rep, {} if cache is None else cache))


def _rewrite(b: Builder, node: fx.Node, options: PassOptions, rep: SiteReport, cache: dict) -> None:
    if len(node.args) > len(_ARGS):
        raise Refuse("unexpected positional arguments to _transformer_encoder_layer_fwd")
    a = {"mask": None, "mask_type": None}
    a.update(zip(_ARGS, node.args))
    a.update(node.kwargs)
    missing = [n for n in _ARGS if n not in a]
    if missing:
        raise Refuse(f"_transformer_encoder_layer_fwd without {', '.join(missing)}")
    src = a["src"]
    sv = tensor_value(src, "src")
    if sv.is_nested or sv.dim() != 3:
        raise Refuse("src is a nested tensor" if sv.is_nested else f"src is {sv.dim()}-D, expected [B, T, E]")
    if sv.numel() == 0:
        raise Refuse("src is empty (the fused op returns a copy of it)")
    embed_dim = static_int(const(a["embed_dim"], "embed_dim"), "embed_dim")
    heads = static_int(const(a["num_heads"], "num_heads"), "num_heads")
    use_gelu = bool(const(a["use_gelu"], "use_gelu"))
    norm_first = bool(const(a["norm_first"], "norm_first"))
    eps = a["eps"]  # a float, or a SymFloat node (dynamic=True wraps Python floats): layer_norm takes both
    if not isinstance(eps, fx.Node):
        eps = float(eps)

    def norm(x: fx.Node, i: int) -> fx.Node:
        return b.f(F.layer_norm, x, (embed_dim,), a[f"norm_weight_{i}"], a[f"norm_bias_{i}"], eps)

    x = norm(src, 1) if norm_first else src
    attn, call = native_attention(
        b, x, x, x, embed_dim, heads, a["qkv_weight"], a["qkv_bias"], a["proj_weight"], a["proj_bias"],
        a["mask"], a["mask_type"], options, rep, node, cache,
    )
    x = b.f(torch.add, attn, src)
    if not norm_first:
        x = norm(x, 1)
    residual = x
    if norm_first:
        x = norm(x, 2)
    h = b.f(torch._addmm_activation, a["ffn_bias_1"], b.m("flatten", x, 0, 1), b.m("t", a["ffn_weight_1"]),
            use_gelu=use_gelu)
    h = b.f(torch.addmm, a["ffn_bias_2"], h, b.m("t", a["ffn_weight_2"]))
    x = b.f(torch.add, b.m("view_as", h, residual), residual)
    if not norm_first:
        x = norm(x, 2)
    b.replace(node, x)
    rep.rewritten, rep.call = True, call
    cache.update(b.pending_cache)
