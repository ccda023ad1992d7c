"""Hand-written attention: from each softmax, walk back to Q·Kᵀ and forward to P·V, then rewrite.

For every softmax node (any spelling, see canonicalize.py):
  back     the softmax input must be  mask-terms( softcap( scale( Q·Kᵀ ) ) )  with casts anywhere:
           scale = Python numbers, SymInt/SymFloat, 0-d tensors or tensors constant along the key
           axis (folded into q); softcap = tanh(s / c) * c; mask terms (+ m, m +, masked_fill,
           where, a 0/1 multiplicative mask s * m + (1 - m) * c, baddbmm's / F.linear's added input)
           go to masks.analyze_mask. Q·Kᵀ is any contraction (layout.contraction) whose axes are
           read from the op itself, so k is whatever view the graph contracts with. A read of only
           the scores' shape or dtype (`torch.ones_like(s)`) is not a use of their values.
  forward  the probabilities reach exactly one P·V contraction through casts and dropout only, and
           nothing else reads them (output_attentions, or a graph break after the softmax, keeps the
           site as it is; the reason says which).
  rewrite  q, k, v as the op's [B, H, N, D] views (transposes folded, repeat_kv / repeat_interleave /
           expand removed for native GQA, lossless upcasts dropped), one fa3.attention call, glue so
           every consumer of the P·V result sees the same shape and dtype; dead nodes go.
  effects  writes into caller tensors are kept (`out=` of the P·V product: the result is copied into
           it) or refused; a site spanning grad-mode regions gets eager's gradient flow (the op's
           inputs that entered before a no_grad node are detached); see effects.py and regions.py.
Everything is decided before the graph is touched; a refusal, or any failure while rewriting,
leaves the graph as it was.
"""
from .probs import Probs, walk_probs
from .rewrite import rewrite_softmax_sites
from .scores import Miss, Scores, _row_max_of, walk_scores  # noqa: F401  (_row_max_of: sinks.py reads it)

__all__ = ["Miss", "Probs", "Scores", "rewrite_softmax_sites", "walk_probs", "walk_scores"]
