"""What the pass reports for every softmax (or fused attention call) it looks at."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional


@dataclass
class SiteReport:
    """One attention site: rewritten (reason None) or missed (reason says why).

    `form` names how the model spelled it ("matmul-softmax-matmul", "sdpa", "mha", ...);
    `mask` the proven mask kind ("none", "causal", "causal-bottom-right", "window", "key-padding",
    "query-positions", "segments", "bias", "bool-mask", combinations joined by '+'); `call` is the
    emitted fa3.attention node (for the front door to ask dispatch which kernel these inputs would get).
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
    cache: str = ""  # "paged: ..." (`call` is fa3.paged_attention, reading a pool in place), or why gathered K/V stay
    fp8: str = ""  # with FP8 asked for: "used" (`call` is fa3.attention_fp8) or "not used: why"; else ""
    call: Any = field(default=None, repr=False)


@dataclass
class PassOptions:
    """Options of the rewrite that the front door sets."""

    kernel: Optional[str] = None  # baked into each emitted call as the forced kernel
    allow_training_dropout: bool = True
    # an emitted fa3.paged_attention node -> why its inputs would get no fused kernel (None: they would);
    # a reason keeps the gathered K/V and fa3.attention
    paged_check: Optional[Callable[[Any], Optional[str]]] = None


@dataclass
class MaskTerm:
    """How a mask enters the scores, as the site finder found it (input to mask analysis).

    op "add":    scores + tensor                 (float additive; either operand order)
    op "fill":   scores.masked_fill(tensor, fill) (tensor True = masked out)
    op "where":  torch.where(tensor, scores, fill) (tensor True = keep)
    op "bool":   a boolean keep-mask given directly (SDPA's attn_mask of dtype bool)
    fill is the Python value filled in (-inf, finfo(dtype).min, any number) or None for "add".
    dtype is the dtype eager applies the term in (the result of the add / fill), where it may differ from
    the softmax input's (fp16 scores masked, then cast to fp32): None means the softmax input's.
    """

    op: str
    tensor: Any  # fx.Node (or a Python scalar for "add" of a constant)
    fill: Optional[float] = None
    dtype: Optional[Any] = None


@dataclass
class MaskSpec:
    """What the mask of one site is, proven from how the graph builds it (output of mask analysis).

    Structure (causal with diag_offset, window, kv_lens) is passed to the op as arguments; whatever
    is not proven structural stays in `bias` (a float additive or bool keep-mask fx.Node that
    broadcasts to [B, H, Nq, Nk]). Several terms of one site are combined by the site finder.

    empty_rows says what eager computes on a row in which every key is masked, so the rewrite can
    keep it exactly: "impossible" (proven that no row is empty), "nan" (eager gives NaN: -inf fills),
    "mean_v" (eager gives the uniform average of V over all keys: finfo.min-style fills that make
    every score of the row equal, with no gradient to those scores: masked_fill / where), "mean_v_add"
    (the same value, from one additive mask that absorbed every score of the row, s + c == c: the
    addition passes the gradient, so eager's q and k get softmax's gradient at uniform probabilities
    from that row), "zero" (eager gives 0, e.g. SDPA), "fill" (masked scores are replaced by the finite
    `fill`, which admissible scores below it do not outweigh: emit adds the masked keys' exact
    share on every row, fully masked ones included), or "unknown" (refuse if
    structure was extracted; passing the untouched mask as bias keeps eager's own arithmetic).
    """

    kind: str = "none"
    causal: bool = False
    diag_offset: Any = 0  # int, or an fx.Node / SymInt expression such as Nk - Nq
    window_left: int = -1
    window_right: int = -1
    kv_lens: Any = None  # fx.Node producing int [B]
    q_pos: Any = None  # fx.Node producing int [Nq] / [B, Nq]: query i admits keys j <= q_pos[b, i]
    q_seg: Any = None  # with k_seg, fx.Nodes producing int [Nq] / [B, Nq] and [Nk] / [B, Nk]: same ids only
    k_seg: Any = None
    bias: Any = None  # fx.Node producing the residual float/bool mask
    empty_rows: str = "impossible"
    # empty_rows "nan": which of eager's gradients the NaN rows make NaN (emit_attention's nan_grads): "v" (fills
    # only), "qkv" (additive -inf masks only), "mixed"
    nan_grads: str = "v"
    fill: Optional[float] = None  # empty_rows "fill": the finite value eager writes over every masked score
    # proven that every row admits a key and no fill lies above 0 (empty_rows may still say what a fill gives)
    rows_admit: bool = False
    # bool node: scores a fill (<= -1e30) replaced before an additive mask, passed inside `bias`; eager
    # gives them no gradient, so emit removes the op's (emit_attention's `filled`)
    filled: Any = None
