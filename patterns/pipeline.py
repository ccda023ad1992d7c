"""The graph pass: canonicalize -> find sites -> rewrite, on a Dynamo GraphModule, in place."""
from __future__ import annotations

from typing import Optional

import torch.fx as fx

from .canonicalize import canonicalize, is_inplace
from .fused_calls import rewrite_fused_calls
from .find_sites import rewrite_softmax_sites
from .site import PassOptions, SiteReport


def rewrite_attention(gm: fx.GraphModule, options: Optional[PassOptions] = None) -> list[SiteReport]:
    """Rewrite every provable attention site of `gm` to fa3.attention; report every site seen."""
    options = options or PassOptions()
    canonicalize(gm)
    reports = rewrite_fused_calls(gm, options)
    reports += rewrite_softmax_sites(gm, options)
    if any(r.rewritten for r in reports):
        # fx's default purity test treats call_method in-place ops (`y.add_(1)`, no users) as dead
        gm.graph.eliminate_dead_code(is_impure_node=lambda n: n.is_impure() or is_inplace(n))
        gm.graph.lint()
        gm.recompile()
    return reports
