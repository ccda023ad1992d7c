"""Split-KV decode attention in Triton (flash-decoding): the partial pass and the log-sum-exp combine.

Grid of the partial pass: (splits, B * Hkv). One program owns one KV head of one sequence and one
split of its valid keys, and computes all G = Hq / Hkv query heads x Nq query tokens of that group as
the rows of one tile (GQA packing: each K/V tile is loaded once for the whole group). Row r is query
head hk * G + r // Nq, token r % Nq. Keys are read in place through the page table (one table entry
per key position, so any page size and any tile start work); no gathered copy is made.

Each sequence splits its own valid range [start, end) into `splits` equal chunks (rounded up to
BLOCK_N), so short sequences get short chunks and a split past the end of a sequence does no work.
When the page size is a multiple of BLOCK_N, a tile lies within one page and reads one table entry.
With one split the pass writes the final out / lse; otherwise partial results (normalised out, row max
and row sum per split) go to fp32 workspaces that the combine kernel reduces. Scores, row maxima and lse are in
natural-log units (exp2 takes the difference times log2 e), so an additive finfo.min bias stays finite as
in the reference: a row whose every key carries it is uniform over them, not empty, and its lse is exact.

For `torch.ops.fa3.attention` (decode-shaped calls, fa_compile/kernels/decode.py attention_decode) the pass also
takes the op's run-time positions (HAS_QPOS: token i admits keys j <= q_pos[b, i], and the valid range
ends at max over the tokens of q_pos + 1, so the splits divide what is valid, not the capacity), its
diagonal (DIAG_CAUSAL: j <= i + diag_offset) and a bias of any broadcast (BIAS_KIND 1 float, 2 bool keep-
mask; strides per batch, query head, token and key, 0 on broadcast dims), and writes eager's value on rows
that admit no key itself (EMPTY_FILL: NaN, or the mean of V over the whole cache) where the compile-time
lowering found the op's empty-row fix-up after it (fa_compile/lowering/empty_rows.py).
"""
from __future__ import annotations

import triton
import triton.language as tl

from .triton_common import mean_v


@triton.jit
def decode_partial_kernel(
    Q, K, V, SEQLENS, LEFTPAD, TABLE, O, LSE, OPART, LPART, SPART,
    stride_qb, stride_qn, stride_qh, stride_qd,
    stride_kblk, stride_ktok, stride_kh, stride_kd,
    stride_vblk, stride_vtok, stride_vh, stride_vd,
    stride_tb, stride_tp,
    stride_ob, stride_on, stride_oh,
    Hkv, G, Nq, D, DV, capacity, num_splits, sm_scale,
    PAGE: tl.constexpr, PAGED: tl.constexpr, PAGE_TILES: tl.constexpr, HAS_LEFTPAD: tl.constexpr, IS_CAUSAL: tl.constexpr,
    SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    QPOS=None, stride_pb=0, stride_pm=0, HAS_QPOS: tl.constexpr = False,
    diag_offset=0, DIAG_CAUSAL: tl.constexpr = False,
    BIAS=None, stride_bb=0, stride_bh=0, stride_bm=0, stride_bn=0, BIAS_KIND: tl.constexpr = 0,
    HAS_SEQLENS: tl.constexpr = True, EMPTY_FILL: tl.constexpr = 0,
):
    # Inductor's launcher types float arguments fp64; the math is fp32 (a dot's accumulator must stay fp32).
    sm_scale = tl.cast(sm_scale, tl.float32)
    split = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // Hkv
    hk = bh % Hkv

    offs_m = tl.arange(0, BLOCK_M)
    rows = G * Nq
    head = hk * G + offs_m // Nq
    tok = offs_m % Nq
    row_ok = offs_m < rows
    # Valid keys [start, end), clamped to the cache's capacity so that no read leaves it.
    seq_end = b * 0 + capacity  # without lengths (the op's form without kv_lens): every key exists
    if HAS_SEQLENS:
        seq_end = tl.minimum(tl.maximum(tl.load(SEQLENS + b).to(tl.int32), 0), capacity)
    end = seq_end
    if HAS_QPOS:  # no token of this sequence admits a key past its largest position
        qp = tl.load(QPOS + b.to(tl.int64) * stride_pb + tok.to(tl.int64) * stride_pm, mask=row_ok, other=-1)
        qp = tl.minimum(tl.maximum(qp, -1), capacity).to(tl.int32)
        end = tl.minimum(end, tl.maximum(tl.max(qp, 0) + 1, 0))
    if DIAG_CAUSAL:  # token i admits keys j <= i + diag_offset
        end = tl.minimum(end, tl.maximum(Nq - 1 + diag_offset + 1, 0))
    start = end * 0
    if HAS_LEFTPAD:
        start = tl.minimum(tl.maximum(tl.load(LEFTPAD + b).to(tl.int32), 0), end)
    # Tiles start at multiples of BLOCK_N (keys before `start` masked), so with PAGE_TILES (the page a
    # multiple of the tile) a tile lies inside one page: one table entry per tile.
    base = start // BLOCK_N * BLOCK_N
    chunk = tl.cdiv(tl.cdiv(end - base, num_splits), BLOCK_N) * BLOCK_N
    lo = base + split * chunk
    hi = tl.minimum(lo + chunk, end)

    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q_ptrs = (Q + b.to(tl.int64) * stride_qb + tok[:, None].to(tl.int64) * stride_qn
              + head[:, None].to(tl.int64) * stride_qh + offs_d[None, :] * stride_qd)
    q = tl.load(q_ptrs, mask=row_ok[:, None] & (offs_d[None, :] < D), other=0.0)
    # Causal, bottom-right within the valid keys: token i sits at position seq_end - Nq + i.
    row_lim = seq_end - Nq + tok
    if not IS_CAUSAL:
        row_lim = row_lim * 0 + end
    if HAS_QPOS:
        row_lim = tl.minimum(row_lim, qp)
    if DIAG_CAUSAL:
        row_lim = tl.minimum(row_lim, tok + diag_offset)
    bias_row = BIAS
    if BIAS_KIND != 0:
        bias_row = BIAS + b.to(tl.int64) * stride_bb + head.to(tl.int64) * stride_bh + tok.to(tl.int64) * stride_bm

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    k_head = hk.to(tl.int64) * stride_kh
    v_head = hk.to(tl.int64) * stride_vh
    for s0 in range(lo, hi, BLOCK_N):
        pos = s0 + tl.arange(0, BLOCK_N)
        ok = (pos < hi) & (pos >= start)
        if PAGE_TILES:
            pg = (b * 0 + s0) // PAGE  # (a tensor under the interpreter too, where s0 is an int)
            blk = tl.load(TABLE + b.to(tl.int64) * stride_tb + pg.to(tl.int64) * stride_tp).to(tl.int64)
            blk = blk + pos.to(tl.int64) * 0
            slot = (s0 % PAGE + tl.arange(0, BLOCK_N)).to(tl.int64)
        elif PAGED:
            blk = tl.load(TABLE + b.to(tl.int64) * stride_tb + (pos // PAGE).to(tl.int64) * stride_tp,
                          mask=ok, other=0).to(tl.int64)
            slot = (pos % PAGE).to(tl.int64)
        else:
            blk = b.to(tl.int64) + pos.to(tl.int64) * 0
            slot = pos.to(tl.int64)
        k_ptrs = (K + blk[None, :] * stride_kblk + slot[None, :] * stride_ktok + k_head
                  + offs_d[:, None] * stride_kd)
        k = tl.load(k_ptrs, mask=ok[None, :] & (offs_d[:, None] < D), other=0.0)
        qk = tl.dot(q, k)
        admit = ok[None, :] & (pos[None, :] <= row_lim[:, None])
        s = qk * sm_scale
        if BIAS_KIND != 0:
            bv = tl.load(bias_row[:, None] + pos[None, :].to(tl.int64) * stride_bn, mask=row_ok[:, None] & admit,
                         other=0)
            if BIAS_KIND == 1:  # additive; a finfo.min fill stays finite, as in the reference
                s = s + bv.to(tl.float32)
            else:
                admit = admit & (bv != 0)
        s = tl.where(admit, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing admissible yet: exp2 stays 0
        p = tl.math.exp2((s - m_use[:, None]) * 1.4426950408889634)
        alpha = tl.math.exp2((m_i - m_use) * 1.4426950408889634)
        l_i = l_i * alpha + tl.sum(p, 1)
        v_ptrs = (V + blk[:, None] * stride_vblk + slot[:, None] * stride_vtok + v_head
                  + offs_dv[None, :] * stride_vd)
        v = tl.load(v_ptrs, mask=ok[:, None] & (offs_dv[None, :] < DV), other=0.0)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_new

    empty = l_i == 0.0
    out = acc * tl.where(empty, 0.0, 1.0 / tl.where(empty, 1.0, l_i))[:, None]
    lse = tl.where(empty, float("-inf"), m_i + tl.math.log2(tl.where(empty, 1.0, l_i)) * 0.6931471805599453)
    # Rows that admit no key (with splits the combine does this): EMPTY_FILL 0 keeps the op's 0, 1 writes
    # NaN (eager's softmax over -inf fills), 2 the mean of V over the whole cache (over equal finite fills).
    if not SPLIT and EMPTY_FILL == 1:
        out = tl.where(empty[:, None], float("nan"), out)
    if not SPLIT and EMPTY_FILL == 2:
        any_empty = tl.max((empty & row_ok).to(tl.int32), 0) > 0
        vmean = mean_v(any_empty, V + b.to(tl.int64) * stride_vblk + v_head, stride_vtok, stride_vd, capacity, DV,
                        BLOCK_N, BLOCK_DV)
        out = tl.where(empty[:, None], vmean[None, :], out)
    if SPLIT:
        # Workspaces [B * Hkv, splits, G * Nq, DV] and two of [B * Hkv, splits, G * Nq], row r as above.
        prow = (bh.to(tl.int64) * num_splits + split) * rows + offs_m
        tl.store(OPART + prow[:, None] * DV + offs_dv[None, :], out,
                 mask=row_ok[:, None] & (offs_dv[None, :] < DV))
        tl.store(LPART + prow, m_i, mask=row_ok)  # the split's row max and sum, not their lse: an
        tl.store(SPART + prow, l_i, mask=row_ok)  # lse near finfo.min would round the sum away
    else:
        o_ptrs = (O + b.to(tl.int64) * stride_ob + tok[:, None].to(tl.int64) * stride_on
                  + head[:, None].to(tl.int64) * stride_oh + offs_dv[None, :])
        tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=row_ok[:, None] & (offs_dv[None, :] < DV))
        lse_ptrs = LSE + (b.to(tl.int64) * Hkv * G + head) * Nq + tok
        tl.store(lse_ptrs, lse, mask=row_ok)


@triton.jit
def decode_combine_kernel(
    OPART, LPART, SPART, O, LSE,
    stride_ob, stride_on, stride_oh,
    Hkv, G, Nq, DV, num_splits,
    BLOCK_S: tl.constexpr, BLOCK_DV: tl.constexpr,
    V=None, stride_vb=0, stride_vtok=0, stride_vh=0, stride_vd=0, capacity=0,
    EMPTY_FILL: tl.constexpr = 0, BLOCK_N: tl.constexpr = 64,
):
    """One program per (batch, kv head, packed row): out = sum_s w_s o_s / sum_s w_s, w_s = l_s e^(m_s - max).
    With EMPTY_FILL (as in the partial pass; contiguous caches only) V, its strides ([B, Nk, Hkv, D] order)
    and `capacity` give the fill of a row that admits no key."""
    pid = tl.program_id(0)
    rows = G * Nq
    bh = pid // rows
    r = pid % rows
    b = bh // Hkv
    hk = bh % Hkv
    head = hk * G + r // Nq
    tok = r % Nq
    offs_s = tl.arange(0, BLOCK_S)
    offs_dv = tl.arange(0, BLOCK_DV)
    s_ok = offs_s < num_splits
    prow = (bh.to(tl.int64) * num_splits + offs_s) * rows + r
    m_s = tl.load(LPART + prow, mask=s_ok, other=float("-inf"))
    l_s = tl.load(SPART + prow, mask=s_ok, other=0.0)
    # issued with the two loads above, before their first use: one round trip to memory, not two
    o_s = tl.load(OPART + prow[:, None] * DV + offs_dv[None, :], mask=s_ok[:, None] & (offs_dv[None, :] < DV),
                  other=0.0)
    m = tl.max(m_s, 0)
    m_use = tl.where(m == float("-inf"), 0.0, m)
    w = l_s * tl.math.exp2((m_s - m_use) * 1.4426950408889634)  # an empty split (m -inf, l 0) weighs 0
    total = tl.sum(w, 0)
    o_s = tl.where(w[:, None] > 0.0, o_s, 0.0)
    empty = total == 0.0
    out = tl.sum(o_s * w[:, None], 0) * tl.where(empty, 0.0, 1.0 / tl.where(empty, 1.0, total))
    lse = tl.where(empty, float("-inf"), m_use + tl.math.log2(tl.where(empty, 1.0, total)) * 0.6931471805599453)
    if EMPTY_FILL == 1:
        out = tl.where(empty, float("nan"), out)
    if EMPTY_FILL == 2:
        out = tl.where(empty, mean_v(empty, V + b.to(tl.int64) * stride_vb + hk.to(tl.int64) * stride_vh,
                                      stride_vtok, stride_vd, capacity, DV, BLOCK_N, BLOCK_DV), out)
    o_ptrs = O + b.to(tl.int64) * stride_ob + tok.to(tl.int64) * stride_on + head.to(tl.int64) * stride_oh + offs_dv
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=offs_dv < DV)
    tl.store(LSE + (b.to(tl.int64) * Hkv * G + head) * Nq + tok, lse)


@triton.jit
def key_limit_kernel(BIAS, OUT, stride_bb, stride_bn, nk, absorb, good, IS_BOOL: tl.constexpr, BLOCK: tl.constexpr):
    """fa_compile/key_limit_op.py's fa3::key_limit, one program per row of bias [Bm, Nk]: 1 + the last
    admissible key (bool: True; float: not <= absorb, NaN admissible), a float row without a value >= good
    keeps all nk keys. One block covers a whole row up to BLOCK keys, so a row is one load wave."""
    b = tl.program_id(0)
    row = BIAS + b.to(tl.int64) * stride_bb
    last = tl.zeros([BLOCK], tl.int32)
    seen = tl.zeros([BLOCK], tl.int32)
    absorb = tl.cast(absorb, tl.float32)  # Inductor's launcher types float arguments fp64
    good = tl.cast(good, tl.float32)
    for s0 in range(0, nk, BLOCK):
        j = s0 + tl.arange(0, BLOCK)
        ok = j < nk
        x = tl.load(row + j.to(tl.int64) * stride_bn, mask=ok, other=0)
        if IS_BOOL:
            admissible = (x != 0) & ok
        else:
            xf = x.to(tl.float32)
            admissible = (~(xf <= absorb)) & ok  # NaN is admissible
            seen = tl.maximum(seen, ((xf >= good) & ok).to(tl.int32))
        last = tl.maximum(last, tl.where(admissible, j + 1, 0))
    limit = tl.max(last, 0)
    if not IS_BOOL:
        limit = tl.where(tl.max(seen, 0) > 0, limit, nk)
    tl.store(OUT + b, limit.to(tl.int32))


@triton.jit
def copy_1d_kernel(X, OUT, stride_x, n, BLOCK: tl.constexpr):
    """OUT[i] = X[i * stride_x] for i < n: a 1-d tensor (a stride-0 expand included) as a dense buffer."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < n
    tl.store(OUT + i, tl.load(X + i.to(tl.int64) * stride_x, mask=ok), mask=ok)
