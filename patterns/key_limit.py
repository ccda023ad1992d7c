"""A per-batch key limit read at run time from a data mask: decode over a long static cache reads only
the part that any query can see.

A static KV cache ([B, Hkv, Lmax, D], e.g. Hugging Face's StaticCache) is often attended with a mask
built outside the graph (generate()'s 4-d `attention_mask`), so no key limit can be proven from the
graph: the op would read all Lmax slots of K and V. But where the bias masks a key with a value that
absorbs every score, that key's weight is exactly 0, so the keys past the last admissible one of each
batch row can be cut with kv_lens, computed from the bias by one reduction (Inductor fuses it):

    kv_lens[b] = 1 + max{ j : bias[b, h, i, j] admissible for some head h and query i }   (0: none)

Admissible: a bool bias's True; a float bias's value above T (NaN counts as admissible), where
T = patterns.masks.ABSORB_LIMIT (-1e30; fp16, which cannot hold it: finfo(fp16).min, i.e. -65504 or
-inf). Why the result is unchanged:
  - bool bias: the op masks the keys it cuts already (False), in every row of that batch row, so it
    computes the same out, lse and gradients; rows with no admissible key stay the op's empty rows,
    and emit's fix-ups for them (mean of V over all keys, NaN, ...) read their own key set.
  - float bias (added to the scores, as eager does): a cut key's bias is <= T in every row, so in a
    row that also admits a key with bias >= T / 2 its weight is exp(<= T / 2 + 2 max|s|) = 0 exactly
    for any plausible score (|s| < 1e29 in fp32 / bf16 / fp64 biases; < 16000 for fp16, whose
    finfo.min absorbs that little: the same known limit as its fill in patterns/masks). A batch row
    with some row lacking such a key (e.g. a left-padded query whose keys all carry finfo.min: eager
    weighs them uniformly over the whole cache) keeps every key: kv_lens = Nk there. "Admits" is the
    site's own structure (causal, window, kv_lens, q_pos, segments: emit._keep_mask), so a row whose
    only good keys the structure forbids is caught too.
A kv_lens already present (key padding or a proven decode position) is combined by minimum.

A mask of one row per sequence ([B, 1, 1, Nk], generate()'s) gets the limit as one op, fa3::key_limit
(fa_compile/key_limit_op.py), which the lowering runs as one Triton kernel on CUDA and as these graph ops
elsewhere. Other masks get the graph ops.

Where: decode-shaped sites only (Nq <= MAX_QUERIES, static Nk > MIN_KEYS), without dropout and
without a finite fill (emit's "fill" path counts kv_lens's keys as filled ones, which hold weight).
  - Prefill sites are left alone here: their bias is [Nq, Nk], so the reduction is a second pass over it,
    and on the GPU the kernels that lead for prefill take fewer masks: FA3 none with a bias, cuDNN
    builds one additive bias from bias + kv_lens per call and still reads every key. Where the lowering
    sends a site to our Triton kernels, which cut key tiles at kv_lens, it adds the limit of a key-padding
    mask itself (fa_compile/lowering/key_limit.py `for_site`).
  - Short caches (Nk <= MIN_KEYS, e.g. generate()'s default cache of prompt + new tokens) are
    host-bound: on CUDA the decode-step math lowering runs them over the whole cache as graph ops,
    which a limit would not shorten, and the reduction would be one more launch per layer.
On the GPU, dispatch sends decode-shaped calls with kv_lens and a bias to the split-KV decode kernel
(fa_compile/kernels/decode.py), which ends each sequence's reads at its kv_lens.
"""
from __future__ import annotations

import operator
from typing import Optional, Union

import torch
import torch.fx as fx

from .emit import _arange, _keep_mask, call, example_value, size_arg
from .masks.combine import ABSORB_LIMIT

MAX_QUERIES = 16  # decode and speculative steps: the split-KV decode kernel's 1..16 query tokens
MIN_KEYS = 2048  # longer caches only (see above)


def absorb_threshold(dtype: torch.dtype) -> float:
    """T: a float bias value <= T gives its key weight 0 beside any key of bias >= T / 2."""
    if dtype == torch.float16:
        return float(torch.finfo(torch.float16).min)
    return ABSORB_LIMIT


def applies(q: fx.Node, k: fx.Node, bias: Optional[fx.Node], *, empty_rows: str, dropout_p: float) -> bool:
    """Whether a site gets the run-time key limit (see the module docstring)."""
    if bias is None or empty_rows == "fill" or dropout_p > 0:
        return False
    qv, kv, bv = example_value(q), example_value(k), example_value(bias)
    if not all(isinstance(t, torch.Tensor) for t in (qv, kv, bv)):
        return False
    nq, nk = qv.shape[2], kv.shape[2]
    if not (isinstance(nq, int) and isinstance(nk, int)) or nq > MAX_QUERIES or nk <= MIN_KEYS:
        return False
    if bv.dim() == 0 or bv.dim() > 4 or not isinstance(bv.shape[-1], int) or bv.shape[-1] != nk:
        return False  # a bias constant along the keys has nothing to cut
    return bv.dtype == torch.bool or bv.dtype.is_floating_point


def _as_4d(graph: fx.Graph, t: fx.Node) -> fx.Node:
    while example_value(t).dim() < 4:
        t = call(graph, torch.unsqueeze, t, 0)
    return t


def limit_keys(graph: fx.Graph, q: fx.Node, k: fx.Node, v: fx.Node, bias: fx.Node, kv_lens: Optional[fx.Node], *,
               causal: bool, diag_offset: Union[int, fx.Node], window_left: int, window_right: int,
               q_pos: Optional[fx.Node] = None, q_seg: Optional[fx.Node] = None,
               k_seg: Optional[fx.Node] = None) -> fx.Node:
    """The op's kv_lens [B] int32 with the bias's key limit (call where `applies` holds, inside the
    site's insertion point): 1 + the last admissible key of each batch row, min the given kv_lens."""
    b4 = _as_4d(graph, bias)
    bv = example_value(b4)
    nk = example_value(k).shape[2]
    j1 = call(graph, operator.add, _arange(graph, k, 2), 1)  # [Nk]: 1 + j
    keep = None
    if bv.dtype != torch.bool:
        keep = _keep_mask(graph, q, v, causal=causal, diag_offset=diag_offset, window_left=window_left,
                          window_right=window_right, bias=None, kv_lens=kv_lens, q_pos=q_pos, q_seg=q_seg,
                          k_seg=k_seg)
    # generate()'s mask of one query, [B, 1, 1, Nk]: both reductions below then run over the same [B, Nk],
    # which Inductor computes in one kernel (reduced over dims 1 and 2 first, they were two kernels)
    rows_of_one = keep is None and all(isinstance(n, int) and n == 1 for n in bv.shape[1:3])
    if rows_of_one:
        b4 = call(graph, operator.getitem, b4, (slice(None), 0, 0))
        # one op (fa_compile/key_limit_op.py), which the lowering runs as one kernel on CUDA
        absorb = 0.0 if bv.dtype == torch.bool else absorb_threshold(bv.dtype)
        limit = call(graph, torch.ops.fa3.key_limit.default, b4, absorb)  # [Bm] int32
        return _finish(graph, q, limit, kv_lens, nk)
    if bv.dtype == torch.bool:
        admissible = b4
    else:
        t = absorb_threshold(bv.dtype)
        admissible = call(graph, torch.logical_not, call(graph, operator.le, b4, t))  # NaN stays
    # [Bm, Nk]: some head and query admits key j
    seen = admissible if rows_of_one else call(graph, torch.any, admissible, (1, 2))
    limit = call(graph, torch.amax, call(graph, torch.where, seen, j1, 0), -1)  # [Bm] int64, 0: none
    if bv.dtype != torch.bool:
        good = call(graph, operator.ge, b4, absorb_threshold(bv.dtype) / 2)
        if keep is not None:
            good = call(graph, torch.logical_and, good, keep)
        rows_good = call(graph, torch.any, good, -1)  # [Bx] or [Bx, Hx, Nqx]
        every_row = rows_good if rows_of_one else call(graph, torch.all, rows_good, (1, 2))  # [Bx]
        limit = call(graph, torch.where, every_row, limit, nk)
    return _finish(graph, q, limit, kv_lens, nk)


def _finish(graph: fx.Graph, q: fx.Node, limit: fx.Node, kv_lens: Optional[fx.Node], nk: int) -> fx.Node:
    """The limit [Bm] (int64, or key_limit's int32 in [0, Nk]) as the op's kv_lens: combined with the given
    kv_lens by minimum (in int64: a given length may not fit int32), in [0, Nk], [B], int32 (what FA3's
    seqused_k takes)."""
    if kv_lens is not None:
        limit = call(graph, torch.minimum, limit, call(graph, "to", kv_lens, torch.int64, method=True))
    if example_value(limit).dtype != torch.int32:
        # exact (the op clamps kv_lens to [0, Nk]) and safe for int32 when a given length was out of range
        limit = call(graph, "clamp", limit, 0, nk, method=True)
    b = example_value(q).shape[0]
    n = example_value(limit).shape[0]
    if isinstance(n, int) and n == 1 and not (isinstance(b, int) and b == 1):
        limit = call(graph, "expand", limit, size_arg(graph, q, 0), method=True)
    if example_value(limit).dtype != torch.int32:
        limit = call(graph, "to", limit, torch.int32, method=True)
    return limit
