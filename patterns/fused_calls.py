"""Fused attention calls already in the graph (F.scaled_dot_product_attention, MHA, encoder layer).

Each call seen yields one SiteReport: rewritten to fa3.attention (plus the exact glue around it),
or left untouched with the reason.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from .fused_common import report
from .fused_encoder import is_encoder_layer, rewrite_encoder_layer
from .fused_mha import is_mha, is_native_mha, rewrite_mha, rewrite_native_mha
from .fused_sdpa import is_sdpa, rewrite_sdpa
from .regions import Regions
from .site import PassOptions, SiteReport


def rewrite_fused_calls(gm: fx.GraphModule, options: PassOptions) -> list[SiteReport]:
    reports: list[SiteReport] = []
    graph = gm.graph
    # Dynamo's example values live in a fake mode other than the one its TracingContext hands the
    # backend (torch 2.13), and detect_fake_mode prefers the latter: hide the context so the glue's
    # example values are computed in the mode of the tensors they read.
    cache: dict = {}
    regions = Regions(gm)
    with torch._guards.tracing(None):
        for node in list(graph.nodes):
            _visit(graph, node, options, reports, cache, regions)
    return reports


def _visit(graph: fx.Graph, node: fx.Node, options: PassOptions, reports: list, cache: dict,
           regions: Regions) -> None:
    if node.op != "call_function":
        return
    if is_sdpa(node):
        reports.append(rewrite_sdpa(graph, node, options, cache))
    elif is_mha(node):
        reports.append(rewrite_mha(graph, node, options, cache, autocast=regions.of(node).autocast_on))
    elif is_native_mha(node):
        reports.append(rewrite_native_mha(graph, node, options, cache))
    elif is_encoder_layer(node):
        if regions.of(node).autocast_on is not False:
            # the fused layer's autocast kernel casts its inputs, which its fake kernel does not say
            reports.append(report("encoder-layer", node, reason="the fused encoder layer runs under autocast, "
                                  "whose dtypes for it the graph does not record"))
            return
        reports.append(rewrite_encoder_layer(graph, node, options, cache))
