"""Triton building blocks shared by the fused attention forward and backward kernels.

Everything here works in the log2 domain: scores are multiplied by log2(e) once, so the softmax
uses exp2 (one MUFU op) and the log-sum-exp is converted back to natural log only on store.

The score tile helper is written against broadcastable `rows` / `cols` index tensors, so one
definition serves the forward and dQ kernels (rows down, [BM, 1] x [1, BN]) and the dK/dV kernel
(which works on the transposed tile, [1, BM] x [BN, 1]).

Run-time structure (the op's q_pos and q_seg / k_seg): `row_positions` and `segment_ids` load a
tile's values, `position_segment_ok` is their elementwise mask (ANDed into every tile, off-band ones
too). Whole tiles are skipped by narrowing the loops, never by a branch inside them (one costs the
forward ~4 KB of register spills on sm90): the key loop ends at max(q_pos) + 1, `key_tile_range` and
`query_tile_range` scan the ids (and positions) once per program for the first and last tile that can
hold an admitted pair (`ids_overlap`: an id within the other tile's [min, max]). Sorted ids (packed
sequences) then cost the diagonal blocks only; unsorted ids stay exact, masked inside that span.
"""
from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


@triton.jit
def program_ids(n_inner, REVERSE: tl.constexpr):
    """(inner, outer) ids in a 1-D grid of n_inner * n_outer programs, inner fastest: the launch order of a
    2-D (inner, outer) grid without CUDA's 65535 cap on the second axis, which B·H exceeds for windowed
    vision attention (batch x windows x heads). REVERSE runs the inner ids backwards (causal: long rows first)."""
    pid = tl.program_id(0)
    inner = pid % n_inner
    if REVERSE:
        inner = n_inner - 1 - inner
    return inner, pid // n_inner


@triton.jit
def grouped_program_ids(n_inner, n_groups, REVERSE: tl.constexpr):
    """(inner, outer) ids in a 1-D grid of n_inner * n_outer programs, the outer ids split into n_groups
    contiguous groups of balanced sizes (1 <= n_groups <= n_outer), launched group by group with the inner id
    slowest inside a group: REVERSE as in program_ids. Where the work per program depends on the inner id
    (causal: the longest rows or key columns first), the long programs of a group start together and the short
    ones fill in behind them, instead of each (batch, head)'s long program starting only when the (batch, head)
    before it is done; a small group keeps the rows read by programs running together few (L2).
    n_groups = n_outer is program_ids' order."""
    return grouped_tile_ids(tl.program_id(0), tl.num_programs(0), n_inner, n_groups, REVERSE)


@triton.jit
def grouped_tile_ids(t, n_tiles, n_inner, n_groups, REVERSE: tl.constexpr):
    """grouped_program_ids of tile t of n_tiles: the same order for a persistent program that walks tiles."""
    n_outer = n_tiles // n_inner
    base = tl.maximum(n_outer // n_groups, 1)
    extra = n_outer - base * n_groups  # the first `extra` groups hold base + 1 outer ids
    big = extra * (base + 1) * n_inner  # tiles of those groups
    in_big = t < big
    size = tl.where(in_big, base + 1, base)
    g = tl.where(in_big, t // ((base + 1) * n_inner), (t - big) // (base * n_inner))
    first_outer = tl.where(in_big, g * (base + 1), extra * (base + 1) + g * base)
    rest = tl.where(in_big, t - g * (base + 1) * n_inner, t - big - g * base * n_inner)
    inner = rest // size
    if REVERSE:
        inner = n_inner - 1 - inner
    return inner, first_outer + rest % size


@triton.jit
def _hash32_tail(x):
    """lowbias32 after its first xor-shift."""
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    x = x ^ (x >> 16)
    return x


@triton.jit
def hash32(x):
    """Wellons' lowbias32 on uint32 (wrapping multiply, logical shifts): the same bits as dropout_hash.hash32."""
    return _hash32_tail(x ^ (x >> 16))


@triton.jit
def dropout_row_hash(seed, bh, Nq, rows):
    """Per-row part of the dropout hash, r = hash32(seed ^ hash32(row)) with row = (b * H + h) * Nq + i, returned as
    r ^ (r >> 16): the share of lowbias32's first xor-shift that dropout_keep takes from the row."""
    row = (bh.to(tl.int64) * Nq + rows).to(tl.uint32)
    r = hash32(seed ^ hash32(row))
    return r ^ (r >> 16)


@triton.jit
def dropout_keep(row_part, cols, threshold):
    """keep = hash32(r ^ col) >= threshold, compared as uint32 (threshold < 2**32: one unsigned compare per element;
    the launcher passes it as int32 or int64, whose low 32 bits hold it either way). A logical shift distributes
    over xor, so hash32's first step (r ^ c) ^ ((r ^ c) >> 16) is the row's part (dropout_row_hash) xor the column's
    c ^ (c >> 16), a vector: each element pays one xor there instead of three."""
    c = cols.to(tl.uint32)
    x = _hash32_tail(row_part ^ (c ^ (c >> 16)))
    return x >= tl.cast(threshold, tl.uint32)


@triton.jit
def tanh_f32(x):
    # tanh through exp: portable between the GPU and the interpreter; saturates correctly at +-inf.
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def load_bias_tile(bias_ptr, rows, cols, stride_bm, stride_bn, Nq, Nk, MASK: tl.constexpr, BIAS_KIND: tl.constexpr):
    """The bias (or uint8 keep-mask) values of a score tile, as stored."""
    # Clamped indices: padded rows/cols read a valid element instead of needing a load mask.
    # Off-band blocks (MASK False) lie inside [0, Nk) by construction, so their columns stay
    # unclamped: the compiler can then prove them contiguous and vectorize the bias loads.
    if MASK:
        c = tl.minimum(cols, Nk - 1).to(tl.int64)
    else:
        c = cols.to(tl.int64)
    if BIAS_KIND >= 3:
        # Constant along query rows (stride 0, e.g. a key-padding mask [B, 1, 1, Nk]): one load
        # per key, broadcast over the tile, instead of one per (row, key).
        bv = tl.load(bias_ptr + c * stride_bn)
    else:
        r = tl.minimum(rows, Nq - 1).to(tl.int64)
        bv = tl.load(bias_ptr + r * stride_bm + c * stride_bn)
    return bv


@triton.jit
def score_tile(
    qk, rows, cols, qk_scale, softcap, cap_scale,
    bias_ptr, stride_bm, stride_bn, Nq, Nk, n_lim, diag_offset, window_left, window_right,
    IS_CAUSAL: tl.constexpr, HAS_WL: tl.constexpr, HAS_WR: tl.constexpr, MASK: tl.constexpr,
    BIAS_KIND: tl.constexpr, SOFTCAP: tl.constexpr,
):
    """Scores in log2 units with softcap, bias and (when MASK) the structural masks; also tanh for softcap's derivative.

    qk: raw dot products (fp32). BIAS_KIND: 0 none, 1 additive float, 2 bool keep-mask (uint8);
    3 and 4 are 1 and 2 for a bias whose query-row stride is 0.
    """
    if SOFTCAP:
        t = tanh_f32(qk * cap_scale)  # cap_scale = scale / softcap
        s = t * (softcap * 1.4426950408889634)
    else:
        t = qk
        s = qk * qk_scale  # qk_scale = scale * log2(e)
    if BIAS_KIND != 0:
        bv = load_bias_tile(bias_ptr, rows, cols, stride_bm, stride_bn, Nq, Nk, MASK, BIAS_KIND)
        if BIAS_KIND % 2 == 1:
            # A finfo.min-style fill times log2(e) overflows to -inf: that key is masked (eager's exp
            # underflows to 0 there too); a row of nothing else reads as empty (lse = -inf, out = 0).
            s = s + bv.to(tl.float32) * 1.4426950408889634
        else:
            s = tl.where(bv != 0, s, float("-inf"))
    if MASK:
        ok = structural_ok(rows, cols, n_lim, diag_offset, window_left, window_right, IS_CAUSAL, HAS_WL, HAS_WR)
        s = tl.where(ok, s, float("-inf"))
    return s, t


@triton.jit
def row_positions(base, stride_pm, rows, Nq, Nk):
    """q_pos of query `rows` (base: one batch entry's positions) as int32 clamped to [-1, Nk] (-1, no
    key, on rows past Nq): the clamp keeps int64 positions exact (>= Nk admits every key either way)."""
    qp = tl.load(base + rows.to(tl.int64) * stride_pm, mask=rows < Nq, other=-1)
    return tl.minimum(tl.maximum(qp, -1), Nk).to(tl.int32)


@triton.jit
def segment_ids(base, stride_sn, idx, n, first):
    """Segment ids at positions `idx` (base: one batch entry's ids); positions past `n` read the id at
    `first` (< n), so that a tile's min / max cover its real positions only."""
    ids = tl.load(base + idx.to(tl.int64) * stride_sn, mask=idx < n, other=0)
    return tl.where(idx < n, ids, tl.load(base + first * stride_sn))  # (first: an int or a scalar tensor)


@triton.jit
def ids_overlap(ids, valid, lo, hi):
    """Whether any valid id lies in [lo, hi]: a tile without one has no admitted pair (exact for
    ids in any order; sorted ids leave only the tiles that straddle the diagonal blocks)."""
    return tl.sum(((ids >= lo) & (ids <= hi) & valid).to(tl.int32), 0) > 0


@triton.jit
def key_tile_range(kseg_base, stride_ksn, Nk, n_lim, q_lo, q_hi, lo, hi, BLOCK_N: tl.constexpr):
    """[first, last): the span of the key tiles in [lo, hi) (multiples of BLOCK_N) holding an id in
    [q_lo, q_hi] among keys < n_lim; first >= last when there is none."""
    first = hi
    last = lo
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        ks = segment_ids(kseg_base, stride_ksn, offs_n, Nk, start_n)
        hit = ids_overlap(ks, offs_n < n_lim, q_lo, q_hi)
        first = tl.where(hit, tl.minimum(first, start_n), first)
        last = tl.where(hit, start_n + BLOCK_N, last)
    return first, last


@triton.jit
def query_tile_range(
    qpos_base, stride_pm, qseg_base, stride_qsm, Nq, Nk, n0, k_lo, k_hi, lo, hi,
    BLOCK_M: tl.constexpr, HAS_QPOS: tl.constexpr, HAS_SEG: tl.constexpr,
):
    """[first, last): the span of the query tiles in [lo, hi) that can reach the key tile at n0: some row's
    position >= n0 (HAS_QPOS) and some row's id in the key tile's [k_lo, k_hi] (HAS_SEG)."""
    first = hi
    last = lo
    for start_m in range(lo, hi, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        go = n0 >= 0
        if HAS_QPOS:
            go = go & (tl.max(row_positions(qpos_base, stride_pm, offs_m, Nq, Nk), 0) >= n0)
        if HAS_SEG:
            go = go & ids_overlap(segment_ids(qseg_base, stride_qsm, offs_m, Nq, start_m), offs_m < Nq, k_lo, k_hi)
        first = tl.where(go, tl.minimum(first, start_m), first)
        last = tl.where(go, start_m + BLOCK_M, last)
    return first, last


@triton.jit
def position_segment_ok(rows_pos, cols, row_ids, col_ids, HAS_QPOS: tl.constexpr, HAS_SEG: tl.constexpr):
    """Admission by q_pos (cols <= rows_pos) and segments (row_ids == col_ids); broadcastable operands."""
    ok = cols >= 0
    if HAS_QPOS:
        ok = ok & (cols <= rows_pos)
    if HAS_SEG:
        ok = ok & (row_ids == col_ids)
    return ok


@triton.jit
def softmax_step(
    qk, m_i, rows, cols, qk_scale, softcap, cap_scale,
    bias_ptr, stride_bm, stride_bn, Nq, Nk, n_lim, diag_offset, window_left, window_right,
    IS_CAUSAL: tl.constexpr, HAS_WL: tl.constexpr, HAS_WR: tl.constexpr, MASK: tl.constexpr,
    BIAS_KIND: tl.constexpr, SOFTCAP: tl.constexpr, PLAIN: tl.constexpr, BIAS_FMA: tl.constexpr = False,
    extra_ok=None, HAS_EXTRA: tl.constexpr = False,
):
    """One online-softmax step of the forward on a Q·Kᵀ tile: (p, new row max, rescale of the old sums).

    Shared by the pointer and TMA forwards. PLAIN (no bias / softcap, scale > 0): the row max scales
    with qk, so the scale folds into one FMA inside exp2's argument instead of a multiply of the tile.
    BIAS_FMA (a float bias, no softcap, scale > 0): the same with s = qk * scale + bias in natural
    units (one FMA), log2(e) applied inside exp2's FMA; two ALU ops per score instead of four.
    HAS_EXTRA: `extra_ok` (position_segment_ok) masks the scores as well.
    """
    if PLAIN:
        if MASK:
            ok = structural_ok(rows, cols, n_lim, diag_offset, window_left, window_right, IS_CAUSAL, HAS_WL, HAS_WR)
            qk = tl.where(ok, qk, float("-inf"))
        if HAS_EXTRA:
            qk = tl.where(extra_ok, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(qk * qk_scale - m_use[:, None])
    elif BIAS_FMA:
        bv = load_bias_tile(bias_ptr, rows, cols, stride_bm, stride_bn, Nq, Nk, MASK, BIAS_KIND)
        # A finfo.min-style fill stays finite here and overflows to -inf inside exp2's argument and
        # in the row max (both times log2(e)), exactly as in score_tile.
        s = qk * (qk_scale * 0.6931471805599453) + bv.to(tl.float32)
        if MASK:
            ok = structural_ok(rows, cols, n_lim, diag_offset, window_left, window_right, IS_CAUSAL, HAS_WL, HAS_WR)
            s = tl.where(ok, s, float("-inf"))
        if HAS_EXTRA:
            s = tl.where(extra_ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1) * 1.4426950408889634)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s * 1.4426950408889634 - m_use[:, None])
    else:
        s, _t = score_tile(
            qk, rows, cols, qk_scale, softcap, cap_scale, bias_ptr, stride_bm, stride_bn, Nq, Nk, n_lim,
            diag_offset, window_left, window_right, IS_CAUSAL, HAS_WL, HAS_WR, MASK, BIAS_KIND, SOFTCAP,
        )
        if HAS_EXTRA:
            s = tl.where(extra_ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_use[:, None])
    # A row with nothing admissible yet keeps m = -inf; subtracting 0 keeps exp2 at 0, not NaN.
    alpha = tl.math.exp2(m_i - m_use)
    return p, m_new, alpha


@triton.jit
def structural_ok(
    rows, cols, n_lim, diag_offset, window_left, window_right,
    IS_CAUSAL: tl.constexpr, HAS_WL: tl.constexpr, HAS_WR: tl.constexpr,
):
    """Admissible (row, col) pairs under causal / window / key-limit structure."""
    d = cols - rows - diag_offset
    ok = cols < n_lim
    if IS_CAUSAL:
        ok = ok & (d <= 0)
    if HAS_WL:
        ok = ok & (d >= -window_left)
    if HAS_WR:
        ok = ok & (d <= window_right)
    return ok


@triton.jit
def add_sink(acc, l_i, m_i, SINKS, h):
    """The head's sink logit joins the row state as one more score with no value: max and denominator
    (m_i in log2 units, scale * log2(e) folded in; the sink is a natural-log logit). A row with no
    admissible key ends with l_i = exp2(0) at m_i = sink: out 0 and lse = the sink."""
    sink = tl.load(SINKS + h).to(tl.float32) * 1.4426950408889634
    m_s = tl.maximum(m_i, sink)
    m_use = tl.where(m_s == float("-inf"), 0.0, m_s)
    alpha = tl.math.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.math.exp2(sink - m_use)
    return acc * alpha[:, None], l_i, m_s


@triton.jit
def key_limit(KVLENS, b, Nk, HAS_KVLEN: tl.constexpr):
    """Keys of batch b that exist: Nk, or its key-padding length clamped to [0, Nk]."""
    n_lim = Nk
    if HAS_KVLEN:
        n_lim = tl.maximum(tl.minimum(tl.load(KVLENS + b).to(tl.int32), Nk), 0)
    return n_lim


@triton.jit
def kv_block_range(
    m0, Nq, n_lim, diag_offset, window_left, window_right,
    IS_CAUSAL: tl.constexpr, HAS_WL: tl.constexpr, HAS_WR: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """For query rows [m0, m0 + BLOCK_M): key-block bounds (lo, full_lo, full_hi, hi), multiples of BLOCK_N.

    Blocks in [lo, full_lo) and [full_hi, hi) need the structural mask; [full_lo, full_hi) are fully
    admissible for every row (off-band), so their loop runs without any masking. Blocks outside
    [lo, hi) are fully masked and skipped.
    """
    zero = m0 * 0
    m_last = tl.minimum(m0 + BLOCK_M, Nq) - 1
    hi = zero + n_lim
    lo = zero
    full_lo_raw = zero
    full_hi_raw = zero + n_lim
    if IS_CAUSAL:
        hi = tl.minimum(hi, m_last + diag_offset + 1)
        full_hi_raw = tl.minimum(full_hi_raw, m0 + diag_offset + 1)
    if HAS_WR:
        hi = tl.minimum(hi, m_last + diag_offset + window_right + 1)
        full_hi_raw = tl.minimum(full_hi_raw, m0 + diag_offset + window_right + 1)
    if HAS_WL:
        lo = tl.maximum(lo, m0 + diag_offset - window_left)
        full_lo_raw = tl.maximum(full_lo_raw, m0 + BLOCK_M - 1 + diag_offset - window_left)
    hi = tl.maximum(hi, 0)
    hi_blk = (hi + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    lo = tl.minimum(tl.maximum(lo, 0) // BLOCK_N * BLOCK_N, hi_blk)
    full_lo = (tl.maximum(full_lo_raw, 0) + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    full_lo = tl.minimum(tl.maximum(full_lo, lo), hi_blk)
    full_hi = tl.maximum(full_hi_raw, 0) // BLOCK_N * BLOCK_N
    full_hi = tl.minimum(tl.maximum(full_hi, full_lo), hi_blk)
    return lo, full_lo, full_hi, hi_blk


@triton.jit
def q_block_range(
    n0, Nq, n_lim, diag_offset, window_left, window_right,
    IS_CAUSAL: tl.constexpr, HAS_WL: tl.constexpr, HAS_WR: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """For key columns [n0, n0 + BLOCK_N): query-block bounds (lo, full_lo, full_hi, hi), multiples of BLOCK_M.

    Same meaning as kv_block_range with rows and columns swapped. A key block that crosses the
    key limit (Nk or kv_lens) is masked for every query block; one past it has no rows at all.
    """
    zero = n0 * 0
    n_last = n0 + BLOCK_N - 1
    lo = zero
    hi = zero + Nq
    full_lo_raw = zero
    full_hi_raw = zero + Nq + BLOCK_M  # rows past Nq are harmless without masking (lse = +inf there)
    if IS_CAUSAL:
        lo = tl.maximum(lo, n0 - diag_offset)
        full_lo_raw = tl.maximum(full_lo_raw, n_last - diag_offset)
    if HAS_WR:
        lo = tl.maximum(lo, n0 - diag_offset - window_right)
        full_lo_raw = tl.maximum(full_lo_raw, n_last - diag_offset - window_right)
    if HAS_WL:
        hi = tl.minimum(hi, n_last - diag_offset + window_left + 1)
        full_hi_raw = tl.minimum(full_hi_raw, n0 - diag_offset + window_left + 1)
    hi = tl.where(n0 >= n_lim, 0, tl.maximum(hi, 0))
    hi_blk = (hi + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    lo = tl.minimum(tl.maximum(lo, 0) // BLOCK_M * BLOCK_M, hi_blk)
    full_lo = (tl.maximum(full_lo_raw, 0) + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    full_lo = tl.minimum(tl.maximum(full_lo, lo), hi_blk)
    full_hi = tl.maximum(full_hi_raw, 0) // BLOCK_M * BLOCK_M
    full_hi = tl.where(n_last >= n_lim, 0, full_hi)
    full_hi = tl.minimum(tl.maximum(full_hi, full_lo), hi_blk)
    return lo, full_lo, full_hi, hi_blk


@triton.jit
def mean_v(any_empty, V_HEAD, stride_vtok, stride_vd, capacity, DV, BLOCK_N: tl.constexpr, BLOCK_DV: tl.constexpr):
    """[BLOCK_DV] fp32: the mean of V over all `capacity` keys of one head (keys `stride_vtok` apart), eager's
    softmax-weighted sum over a row of equal finite fills; read only when `any_empty` (zero trips else)."""
    offs_dv = tl.arange(0, BLOCK_DV)
    n_fill = tl.where(any_empty, capacity, 0)
    vsum = tl.zeros([BLOCK_DV], tl.float32)
    for f0 in range(0, n_fill, BLOCK_N):
        pos = f0 + tl.arange(0, BLOCK_N)
        vt = tl.load(V_HEAD + pos[:, None].to(tl.int64) * stride_vtok + offs_dv[None, :] * stride_vd,
                     mask=(pos[:, None] < capacity) & (offs_dv[None, :] < DV), other=0.0)
        vsum += tl.sum(vt.to(tl.float32), 0)
    return vsum / tl.maximum(capacity, 1).to(tl.float32)
