"""Mask structure analysis: prove what a site's mask is from how the graph builds it.

Modules, in dependency order: symbolic (sizes and conditions proven for every size), values (the
abstract values), concrete (node helpers, concrete evaluation and classification), analyzer (the
abstract interpreter over a mask subgraph), zero_one (a float mask proven to hold only 0 and 1), combine (terms to one plan with eager's semantics on
fully masked rows), spec (the plan emitted as a MaskSpec), analyze (the entry point).

    analyze_mask(gm: fx.GraphModule, terms: list[MaskTerm], *, batch, q_heads, q_len, k_len,
                 scores_dtype: torch.dtype, insert_before: fx.Node, sdpa: bool = False) -> MaskSpec | str

`terms` are the ways a mask enters the scores, in the order eager applies them (see MaskTerm); a
"fill"/"where" fill may be a Python number or a node of a 0-d constant (torch.full([], finfo.min)).
batch / q_heads / q_len / k_len are the site's sizes (ints or SymInts from the example values);
new nodes (kv_lens reshape, residual bias, symbolic diag offset) are inserted before `insert_before`
with `emit.call`, so they carry example values. `sdpa=True` says the softmax is SDPA's (rows whose
every score is -inf give 0 there); a "bool" term implies it. A returned string is the reason the site
must be left alone. The returned MaskSpec's fields map one to one onto emit_attention's arguments.

How a proof works. Each node of the mask subgraph gets an abstract value (`_Lin`: integer index
arithmetic a*i + b*j + c on the query/key axes; `_Keep`: a keep-mask that is a conjunction of a band
lo <= j - i <= hi, a key-length bound j < lens[b] and opaque bool factors; `_Two`: a float mask equal
to 0 where a `_Keep` holds and c elsewhere; `_Konst`: a tensor filled with one number; `_Opaque`:
anything else). SiteReport kinds produced: "causal" (diag_offset 0), "causal-bottom-right"
(Nk - Nq), "causal-offset" (any other), "window", "key-padding" (kv_lens), "query-positions" (q_pos),
"segments" (q_seg / k_seg), "bool-mask" / "bias" (residual), joined by '+'. Two techniques produce them:
  (a) symbolic rules over arange / comparisons / tril / triu / where / masked_fill / logical ops and
      shape-only ops; these hold for every size, so they serve dynamic shapes;
  (b) concrete evaluation: a node that depends on no graph input except module buffers and whose
      shapes are all static ints is evaluated with real tensors and its value classified (band, 0/c).
      Static-shape guards make that a proof for every call the graph admits. Never used when any
      shape in the subgraph is symbolic. Module buffers (not parameters) are read at compile time and
      treated as constants only where the caller checks them on every call (patterns/constants.py:
      Dynamo does not guard their contents; fa_compile/constant_guard.py runs the traced graph once one
      changed); elsewhere they are data like any input.
  (c) run-time structure, read from tensors the op takes as they are (when its schema has q_pos /
      q_seg / k_seg): key positions compared with an integer tensor P that varies along the query axis
      (`kv_arange <= cache_position[:, None]`, HF's `q_arange + cache offset`; `<`, `>=`, `>` mirrored)
      are q_pos = P (a P varying along one axis is a key length until the mask meets the scores, where
      that axis proves to be the queries or the batch); a constant lower-triangular buffer indexed by
      a 1-d P (gpt-fast's `causal_mask[None, None, input_pos]`) is q_pos = P mod rows; an equality of
      integer tensors varying one along queries and one along keys is q_seg / k_seg (any ids). HF's
      packed sequences compare positions gathered per token, P[b, j] <= P[b, i], next to ids
      cumsum(diff(P) != 1): within such a run P steps by one, so the comparison is the band j <= i
      (values._within_runs). P is copied for the op (int64) where the mask read it, and refused when it
      or a tensor sharing its storage is written in place. A window relative to P has no op form and
      stays a bool mask.
Whatever depends on data stays a residual bias, as the smallest node that the graph already has
(e.g. the [B, 1, 1, Nk] padding mask, never its expansion to N x N). Conditions on symbolic sizes are
decided by statically_known_true or by being one of Dynamo's own guards (a slice start Nk - Nq of a
bottom-right causal buffer is guarded >= 0), never by adding a guard.

Masked values. The op masks with -inf. A fill c (masked_fill / where) is negligible when c is -inf,
c <= ABSORB_LIMIT (fp32 / bf16 finfo.min: e^(c - m) == 0 for every score m > -1e22) or fp16's finfo.min
on fp16 scores; such a mask is passed as structure and costs nothing. Any other finite fill (-1e4,
Megatron's fp16 -10000, -1e9, even -10 or +1e9) keeps its exact meaning on every row, including rows
whose admissible scores all lie below c (eager then weighs the masked keys): the spec says empty_rows
"fill" with MaskSpec.fill = c, and emit adds the masked keys' share from the op's lse (see
emit._finite_fill), outputs and gradients. That needs every masked score to be c: one fill value,
only fills and wheres masking, after every other term, and no data mask together with a float bias;
other mixes are refused. An additive 0-or-c mask is structure only when s + c == c (c -inf or
<= ABSORB_LIMIT, or fp16 finfo.min on fp16); a finite c that keeps s in s + c (fp32 -1e9, -1e4,
HF's old (1 - m) * -10000) is passed untouched as the op's float bias, which is eager's arithmetic
(a [B, 1, 1, Nk] key mask stays that small). On a row where every key is masked eager computes:
  -inf fills: NaN (SDPA: 0)                              -> empty_rows "nan" ("zero")
  one negligible finite fill c: masked_fill / where set every entry to c    -> empty_rows "mean_v"
  an additive 0-or-c mask: s + c, uniform only where it rounds to c (c <= ABSORB_LIMIT, e.g. fp32 or
  bf16 finfo.min; fp16 finfo.min for |s| <= 16)                -> empty_rows "mean_v_add" (the
  addition passes the gradient to the absorbed scores: eager's backward is softmax's at uniform P).
Negligible fills of one value c applied after every other term (s + bias, then masked_fill) overwrite
it: a fully masked row is all c -> empty_rows "mean_v", the bias passed as the op's. That needs the bias
to stay far above c on kept keys (combine._moderate: a constant evaluated, or built from products and
learned parameters, as plausible as the scores); a float mask from the inputs may hold finfo.min or -inf
there, where eager weighs the filled keys too, and is refused. Likewise an additive 0-or-c term whose
float parts are not proven moderate is passed whole as the op's bias, not as structure.
Mixes whose fully masked rows eager computes differently (negligible fills of different values, a
fill and a separate additive float mask added after it) are refused unless proven to have no empty row, or
unless every fill is -inf, or <= ABSORB_LIMIT (fp32/bf16 finfo.min) and the very first term:
then every term is passed as one additive float bias (fill -> where(T, c, 0)), which is eager's
arithmetic (legacy GPT-2: where(causal, s, finfo.min) + (1 - m) * finfo.min), at the cost of an
N x N bias (in the scores' dtype for fp64, so c stays exact; refused where c, or c plus later mask
values, is finite beyond fp32's range: such a row's lse would not fit the op's fp32 lse). Eager's fill
cuts the filled scores' gradient, the bias does not: that differs only on rows where the filled
entries keep a weight (every score absorbed, e.g. GPT-Neo's local layer on a query whose window keys
are all padding but an earlier key is not). In a training graph it stays exact when a later 0-or-c'
mask covers every filled entry with c + c' = -inf (weight 0 on both sides), or, when every later term
is a 0-or-c' mask (c' <= 0) or a -inf fill, through MaskSpec.filled: emit removes the op's gradient
through the filled entries on the rows whose lse is below -1e29 (fa3::filled_scores_grad). A later
float bias of any other kind is refused.
An additive float mask that is not proven to be 0-or-c is passed untouched as the op's float bias;
the op adds it in fp32, which is eager's own arithmetic (exact for fp32 scores). Known limit: with
fp16 scores and such an untouched fp16 mask of huge negative values (e.g. BERT's
`(1 - m) * finfo(fp16).min` on data m), a row where every key carries that value is uniform in eager
(s + c rounds to c for |s| <= 16) but softmax(s) in the op, which adds in fp32; every other row matches.
"""
from .analyze import analyze_mask
from .combine import ABSORB_LIMIT, adds_bias_only
from .concrete import CONCRETE_MAX_NUMEL, _band_of
from .symbolic import _sym_true
from .values import _Keep
from .zero_one import zero_one

__all__ = ["analyze_mask", "ABSORB_LIMIT", "adds_bias_only", "CONCRETE_MAX_NUMEL", "zero_one"]
