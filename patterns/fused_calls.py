"""Fused attention calls already in the graph (F.scaled_dot_product_attention, MHA, encoder layer)."""
from __future__ import annotations

import torch.fx as fx

from .site import PassOptions, SiteReport


def rewrite_fused_calls(gm: fx.GraphModule, options: PassOptions) -> list[SiteReport]:
    return []
