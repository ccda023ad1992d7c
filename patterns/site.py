"""What the pass reports for every softmax (or fused attention call) it looks at."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass
class SiteReport:
    """One attention site: rewritten (reason None) or missed (reason says why).

    `form` names how the model spelled it ("matmul-softmax-matmul", "sdpa", "mha", ...);
    `mask` the proven mask kind ("none", "causal", "causal-bottom-right", "window", "key-padding",
    "bias", "bool-mask", combinations joined by '+'); `call` is the emitted fa3.attention node (for
    the front door to ask dispatch which kernel these inputs would get).
    """

    form: str
    rewritten: bool
    reason: Optional[str] = None
    where: str = ""  # the source node name, and the user's source line when Dynamo recorded it
    q_shape: Optional[tuple] = None
    k_shape: Optional[tuple] = None
    v_shape: Optional[tuple] = None
    dtype: Optional[str] = None
    mask: str = "none"
    gqa: Optional[str] = None  # e.g. "Hq=16/Hkv=4 (repeat_kv removed)"
    softcap: float = 0.0
    dropout_p: float = 0.0
    scale: Any = None
    call: Any = field(default=None, repr=False)


@dataclass
class PassOptions:
    """Options of the rewrite that the front door sets."""

    kernel: Optional[str] = None  # baked into each emitted call as the forced kernel
    allow_training_dropout: bool = True
