"""Hand-written attention: from each softmax, walk back to Q.K^T and forward to P.V."""
from __future__ import annotations

import torch.fx as fx

from .site import PassOptions, SiteReport


def rewrite_softmax_sites(gm: fx.GraphModule, options: PassOptions) -> list[SiteReport]:
    return []
