"""Hopper forward written in Gluon: FA3's schedule, which plain Triton 3.6 cannot express.

A program owns 128 query rows and runs three partitions (`gl.warp_specialize`):
- a producer warp moves Q, then K and V tile by tile, by TMA into a ring of STAGES shared-memory
  slots; each slot has a "full" mbarrier (TMA bytes landed) and an "empty" one (both consumers done);
- two consumer warpgroups own 64 rows each and share every K/V tile, so K/V cross shared memory
  once per 128 rows. Each issues its two wgmma per key block asynchronously in FA3's
  intra-warpgroup order

      S_j = Q·K_jᵀ, O += P_{j-1}·V_{j-1} (both async)  ->  wait S_j  ->  softmax(S_j)  ->  wait O

  so the exp2 work of block j overlaps P·V of block j-1, and (PINGPONG) the two warpgroups take
  turns issuing, so one's softmax runs while the other's products hold the tensor cores.
Registers are rebalanced with setmaxnreg: 240 per consumer thread, 24 for the producer.
Persistent (PERSISTENT): one program per SM walks tiles p, p + P, ... in the launch order; every partition
derives a tile's coordinates from its index (_tile), the K/V ring's slots and phases run on across tiles, and
the producer loads the next tile's first K/V blocks and then its Q (once the consumers free Q's slot) while
the consumers finish the previous tile. With SEP_O the output has a shared tile of its own, so its TMA store
runs behind the next tile; without it O is staged in Q's slot and the next Q waits for that store. Without
PERSISTENT each program runs one tile as straight-line code (no tile state is carried around a loop).

Measured on H200 (benchmarks/results/kernels.md): a one-warpgroup version of the same loop was no
faster than the `tl` kernel (529 vs 522 TFLOP/s at d128); the 128-row warp-specialized program is
what pays (618, 640 with ping-pong).

Scope: the structural masks (causal in any alignment, sliding window, key-padding lengths, ragged
Nq / Nk), GQA, any [B, H, N, D] strides TMA accepts, fp16 / bf16, head-dim blocks 64..256 (zero-
filled by TMA past D), positive scale; a float bias tile [B|1, H|1, Nq, Nk] by TMA (HAS_BIAS), or a
bias constant along query rows (ROW_BIAS: an HF key-padding mask [B, 1, 1, Nk], float or bool) read
as one [BLOCK_N] vector per key block. Other biases, softcap and dropout run on the `tl` kernels.
Values past a key length are never used: TMA loads whole tiles, so the consumers zero the rows of the key tile
that straddles it (zero_rows_from) before its P·V. Causal programs launch in groups of heads, longest rows first
(grouped_program_ids). Gluon has no interpreter: this kernel is tested on the GPU only, against the same reference.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma, warpgroup_mma
from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma_wait

from .triton_common import grouped_tile_ids, key_limit, kv_block_range

LN2 = gl.constexpr(0.6931471805599453)
LOG2E = gl.constexpr(1.4426950408889634)
# Triton 3.6 names the TMA copies async_copy_global_to_shared / async_copy_shared_to_global; later
# releases renamed them async_load / async_store (and made the old names raise).
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
_tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global


# A barrier over the calling partition's warps: Triton 3.6 names it thread_barrier, later releases barrier.
_partition_barrier = getattr(gl, "thread_barrier", None) or gl.barrier

# Helpers of the tl kernels, re-wrapped for Gluon (they use scalar tl builtins only): key-block bounds
# (blocks in [full_lo, full_hi) need no mask, blocks outside [lo, hi) are skipped), a batch's key count
# (kv_lens) and a tile's (query block, batch x head) ids in the launch order.
_kv_range = gluon.jit(kv_block_range.fn)
_key_limit = gluon.jit(key_limit.fn)
_grouped_ids = gluon.jit(grouped_tile_ids.fn)


@gluon.jit
def _batch_inner_ids(t, n_tiles, n_m, Hq, REVERSE: gl.constexpr):
    """(query block, b·Hq + h) of tile t with the batch index fastest: the programs that read the same rows of a
    bias shared across the batch run in the same wave, so those rows cross DRAM about once instead of once per
    batch element; the query blocks of one (b, h) still run together and share its K/V in L2."""
    n_b = n_tiles // (n_m * Hq)
    rest = t // n_b
    m = rest % n_m
    if REVERSE:
        m = n_m - 1 - m
    return m, (t % n_b) * Hq + rest // n_m


@gluon.jit
def _tile(t, n_tiles, Hq, G, Nq, Nk, KVLENS, n_groups, diag_offset, window_left, window_right,
          BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, IS_CAUSAL: gl.constexpr, HAS_WL: gl.constexpr,
          HAS_WR: gl.constexpr, HAS_KVLEN: gl.constexpr, REVERSE_M: gl.constexpr, BATCH_INNER: gl.constexpr):
    """Tile t's (b, h, kv head, b·Hq + h, first row, key limit, first key, key blocks): every partition
    computes them itself, so none waits on another for them."""
    n_m = (Nq + BLOCK_M - 1) // BLOCK_M
    if BATCH_INNER:
        pid_m, bh = _batch_inner_ids(t, n_tiles, n_m, Hq, REVERSE_M)
    else:
        pid_m, bh = _grouped_ids(t, n_tiles, n_m, n_groups, REVERSE_M)
    b = bh // Hq
    h = bh % Hq
    m0 = pid_m * BLOCK_M
    n_lim = _key_limit(KVLENS, b, Nk, HAS_KVLEN)
    lo, _full_lo, _full_hi, hi = _kv_range(m0, Nq, n_lim, diag_offset, window_left, window_right,
                                           IS_CAUSAL, HAS_WL, HAS_WR, BLOCK_M, BLOCK_N)
    return b, h, h // G, bh, m0, n_lim, lo, (hi - lo) // BLOCK_N


@gluon.jit
def zero_rows_from(buf, first, ROWS: gl.constexpr, COLS: gl.constexpr, NUM_WARPS: gl.constexpr):
    """Zero rows [first, ROWS) of a [ROWS, COLS] shared tile, 32 rows at a time (registers stay few), by the
    calling partition's NUM_WARPS warps. For the key tile that straddles a sequence's length: TMA loads
    whole tiles, and a non-finite key or value past the length times a probability of 0 is NaN. The caller
    fences (fence_async_shared) and synchronizes its warps before a wgmma reads the tile."""
    CHUNK: gl.constexpr = 32
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [NUM_WARPS, 1], [1, 0])
    for c in gl.static_range(ROWS // CHUNK):
        part = buf.slice(c * CHUNK, CHUNK)
        x = part.load(layout)
        r = c * CHUNK + gl.arange(0, CHUNK, layout=gl.SliceLayout(1, layout))
        part.store(gl.where(gl.expand_dims(r < first, 1), x, gl.zeros_like(x)))


@gluon.jit
def _masked_scores(s, rows, start_n, cols0, n_lim, diag_offset, window_left, window_right,
                   IS_CAUSAL: gl.constexpr, HAS_WL: gl.constexpr, HAS_WR: gl.constexpr):
    cols = start_n + cols0
    r = gl.expand_dims(rows, 1)
    c = gl.expand_dims(cols, 0)
    keep = c < n_lim
    if IS_CAUSAL:
        keep = keep & (c <= r + diag_offset)
    if HAS_WR:
        keep = keep & (c <= r + diag_offset + window_right)
    if HAS_WL:
        keep = keep & (c >= r + diag_offset - window_left)
    return gl.where(keep, s, float("-inf"))


@gluon.jit
def _finish_scores(s, qk_scale, bt, kb, rows, start_n, cols0, n_lim, full_lo, full_hi, diag_offset, window_left,
                   window_right, IS_CAUSAL: gl.constexpr, HAS_WL: gl.constexpr, HAS_WR: gl.constexpr,
                   HAS_BIAS: gl.constexpr, ROW_BIAS: gl.constexpr):
    """(scores, scale still to apply) of key block start_n, out of its Q·Kᵀ: the bias tile `bt` or key vector
    `kb` added, and the structural mask where the block is not admissible for every row of this warpgroup."""
    s, scale = _add_bias(s, qk_scale, bt, HAS_BIAS)
    if ROW_BIAS != 0:
        s, scale = _add_row_bias(s, scale, kb, ROW_BIAS)
    if (start_n < full_lo) | (start_n >= full_hi):
        s = _masked_scores(s, rows, start_n, cols0, n_lim, diag_offset, window_left, window_right,
                           IS_CAUSAL, HAS_WL, HAS_WR)
    return s, scale


@gluon.jit
def _softmax_update(s, m_i, l_i, qk_scale):
    """Online softmax in log2 units, scale folded into one FMA; rows with no admissible key yet keep m = -inf."""
    m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
    m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
    p = gl.exp2(s * qk_scale - gl.expand_dims(m_use, 1))
    alpha = gl.exp2(m_i - m_use)
    l_i = l_i * alpha + gl.sum(p, 1)
    return p, m_new, l_i, alpha


@gluon.jit
def _take_turn(my_turn, turn_phase, PINGPONG: gl.constexpr):
    """Ping-pong: wait until the other warpgroup has issued its previous wgmma; returns the next phase."""
    if PINGPONG:
        mbarrier.wait(my_turn, turn_phase ^ 1)
        turn_phase ^= 1
    return turn_phase


@gluon.jit
def _pass_turn(their_turn, PINGPONG: gl.constexpr):
    if PINGPONG:
        mbarrier.arrive(their_turn)


@gluon.jit
def _load_bias(b_smem, b_full, b_empty, slot, phase, s_layout: gl.constexpr, WG_M: gl.constexpr,
               BLOCK_N: gl.constexpr, FIRST: gl.constexpr):
    """This warpgroup's [WG_M, BLOCK_N] bias tile of the slot, in the score layout (ldmatrix), slot released.
    Called between the Q·Kᵀ issue and its wait, so the shared-memory latency hides behind the product."""
    mbarrier.wait(b_full.index(slot), phase)
    bt = b_smem.index(slot * 2 + (0 if FIRST else 1)).reshape([WG_M, BLOCK_N]).load(s_layout)
    mbarrier.arrive(b_empty.index(slot))
    return bt


@gluon.jit
def _add_bias(s, qk_scale, bt, HAS_BIAS: gl.constexpr):
    """(scores, scale still to apply). With a bias: s·scale + bias in natural units (one FMA per score), and
    log2(e) left to exp2's FMA in _softmax_update: one multiply per score fewer than scaling both by log2(e)."""
    if HAS_BIAS:
        return s * (qk_scale * LN2) + _widen(bt), LOG2E
    else:
        return s, qk_scale


@gluon.jit
def _widen(x):
    """x as fp32. bf16 pairs are widened one instruction per value (shift / mask of the packed register): the
    compiler's own conversion spends a PRMT and a shift on the high half, half an instruction per score more."""
    if x.dtype == gl.bfloat16:
        return gl.inline_asm_elementwise("{ shl.b32 $0, $2, 16; and.b32 $1, $2, 0xffff0000; }", "=r,=r,r", [x],
                                         dtype=gl.float32, is_pure=True, pack=2)
    else:
        return x.to(gl.float32)


@gluon.jit
def _key_bias(rb_row, start_n, cols0, n_lim, rb_stride_n):
    """The row bias of key block start_n, [BLOCK_N] in the score tile's column layout; 0 from n_lim on
    (those columns are masked structurally, and 0 is "masked" for a bool mask as well)."""
    cols = start_n + cols0
    return gl.load(rb_row + cols.to(gl.int64) * rb_stride_n, mask=cols < n_lim, other=0)


@gluon.jit
def _add_row_bias(s, scale, kb, ROW_BIAS: gl.constexpr):
    """Apply a key vector `kb` to (scores, scale still to apply). Float (1): the HAS_BIAS FMA form, with
    log2(e) applied once per key; a finfo.min fill overflows to -inf there, as in the tl kernels'
    score_tile. Bool (2, uint8): -inf where 0, the scale still folded into exp2's FMA."""
    if ROW_BIAS == 1:
        return s * scale + gl.expand_dims(kb.to(gl.float32) * LOG2E, 0), 1.0
    else:
        return gl.where(gl.expand_dims(kb != 0, 0), s, float("-inf")), scale


@gluon.jit
def _load_kv(k_desc, v_desc, bias_desc, k_smem, v_smem, b_smem, k_full, v_full, k_empty, v_empty, b_full, b_empty,
             g, b, hk, bb, bh_bias, m0, start_n, WG_M: gl.constexpr, STAGES: gl.constexpr, HAS_BIAS: gl.constexpr):
    """The K and V tiles (and the two bias tiles) of the program's g-th key block into ring slot g % STAGES."""
    slot = g % STAGES
    free_phase = ((g // STAGES) & 1) ^ 1  # a fresh barrier counts as having completed phase 1
    mbarrier.wait(k_empty.index(slot), free_phase)
    mbarrier.expect(k_full.index(slot), k_desc.block_type.nbytes)
    _tma_load(k_desc, [b, hk, start_n, 0], k_full.index(slot), k_smem.index(slot))
    mbarrier.wait(v_empty.index(slot), free_phase)
    mbarrier.expect(v_full.index(slot), v_desc.block_type.nbytes)
    _tma_load(v_desc, [b, hk, start_n, 0], v_full.index(slot), v_smem.index(slot))
    if HAS_BIAS:  # one [64, BLOCK_N] bias tile per consumer, both on one barrier
        mbarrier.wait(b_empty.index(slot), free_phase)
        mbarrier.expect(b_full.index(slot), 2 * bias_desc.block_type.nbytes)
        for i in gl.static_range(2):
            _tma_load(bias_desc, [bb, bh_bias, m0 + i * WG_M, start_n], b_full.index(slot),
                      b_smem.index(slot * 2 + i))


@gluon.jit
def _produce_tile(t, it, tc, q_desc, k_desc, v_desc, bias_desc, q_smem, k_smem, v_smem, b_smem, q_bar, q_empty,
                  k_full, v_full, k_empty, v_empty, b_full, b_empty, bias_b_mul, bias_h_mul, KVLENS, n_tiles, Hq, G,
                  Nq, Nk, n_groups, diag_offset, window_left, window_right,
                  BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, HAS_BIAS: gl.constexpr,
                  IS_CAUSAL: gl.constexpr, HAS_WL: gl.constexpr, HAS_WR: gl.constexpr, HAS_KVLEN: gl.constexpr,
                  REVERSE_M: gl.constexpr, BATCH_INNER: gl.constexpr):
    """Tile t's loads, its key blocks from the ring's position `it`, its Q in phase tc & 1; returns (it, tc) next."""
    WG_M: gl.constexpr = BLOCK_M // 2
    b, h, hk, bh, m0, n_lim, lo, n_blocks = _tile(
        t, n_tiles, Hq, G, Nq, Nk, KVLENS, n_groups, diag_offset, window_left, window_right, BLOCK_M, BLOCK_N,
        IS_CAUSAL, HAS_WL, HAS_WR, HAS_KVLEN, REVERSE_M, BATCH_INNER)
    bb = b * bias_b_mul
    bh_bias = h * bias_h_mul
    # The first key blocks go into the slots the previous tile frees, before this tile's Q waits for the
    # consumers to finish with the previous one's: the next tile's loads overlap the previous tile's end.
    n_pre = gl.minimum(n_blocks, STAGES)
    for j in range(n_pre):
        _load_kv(k_desc, v_desc, bias_desc, k_smem, v_smem, b_smem, k_full, v_full, k_empty, v_empty, b_full,
                 b_empty, it + j, b, hk, bb, bh_bias, m0, lo + j * BLOCK_N, WG_M, STAGES, HAS_BIAS)
    for i in gl.static_range(2):
        mbarrier.wait(q_empty.index(i), (tc & 1) ^ 1)
        mbarrier.expect(q_bar.index(i), q_desc.block_type.nbytes)
        _tma_load(q_desc, [b, h, m0 + i * WG_M, 0], q_bar.index(i), q_smem.index(i))
    for j in range(n_pre, n_blocks):
        _load_kv(k_desc, v_desc, bias_desc, k_smem, v_smem, b_smem, k_full, v_full, k_empty, v_empty, b_full,
                 b_empty, it + j, b, hk, bb, bh_bias, m0, lo + j * BLOCK_N, WG_M, STAGES, HAS_BIAS)
    return it + n_blocks, tc + 1


@gluon.jit
def _ws_producer(q_desc, k_desc, v_desc, bias_desc, q_smem, k_smem, v_smem, b_smem, q_bar, q_empty, k_full, v_full,
                 k_empty, v_empty, b_full, b_empty, bias_b_mul, bias_h_mul, KVLENS, n_tiles, Hq, G, Nq, Nk, n_groups,
                 diag_offset, window_left, window_right,
                 BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, HAS_BIAS: gl.constexpr,
                 IS_CAUSAL: gl.constexpr, HAS_WL: gl.constexpr, HAS_WR: gl.constexpr, HAS_KVLEN: gl.constexpr,
                 REVERSE_M: gl.constexpr, BATCH_INNER: gl.constexpr, PERSISTENT: gl.constexpr):
    if PERSISTENT:
        it = 0  # key blocks loaded so far by this program (the ring's position)
        tc = 0  # tiles begun
        for t in range(gl.program_id(0), n_tiles, gl.num_programs(0)):
            it, tc = _produce_tile(
                t, it, tc, q_desc, k_desc, v_desc, bias_desc, q_smem, k_smem, v_smem, b_smem, q_bar, q_empty, k_full,
                v_full, k_empty, v_empty, b_full, b_empty, bias_b_mul, bias_h_mul, KVLENS, n_tiles, Hq, G, Nq, Nk,
                n_groups, diag_offset, window_left, window_right, BLOCK_M, BLOCK_N, STAGES, HAS_BIAS, IS_CAUSAL,
                HAS_WL, HAS_WR, HAS_KVLEN, REVERSE_M, BATCH_INNER)
    else:
        _produce_tile(
            gl.program_id(0), 0, 0, q_desc, k_desc, v_desc, bias_desc, q_smem, k_smem, v_smem, b_smem, q_bar, q_empty,
            k_full, v_full, k_empty, v_empty, b_full, b_empty, bias_b_mul, bias_h_mul, KVLENS, n_tiles, Hq, G, Nq, Nk,
            n_groups, diag_offset, window_left, window_right, BLOCK_M, BLOCK_N, STAGES, HAS_BIAS, IS_CAUSAL, HAS_WL,
            HAS_WR, HAS_KVLEN, REVERSE_M, BATCH_INNER)


@gluon.jit
def _consume_tile(t, it, tc, turn_phase, q_smem, o_smem, k_smem, v_smem, b_smem, q_bar, q_empty, k_full, v_full,
                  k_empty, v_empty, b_full, b_empty, my_turn, their_turn, o_desc, LSE, KVLENS, n_tiles, Hq, G, Nq, Nk,
                  n_groups, qk_scale, diag_offset, window_left, window_right, row_bias, rb_stride_b, rb_stride_h,
                  rb_stride_n, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_D: gl.constexpr,
                  BLOCK_DV: gl.constexpr, STAGES: gl.constexpr, IS_CAUSAL: gl.constexpr, HAS_WL: gl.constexpr,
                  HAS_WR: gl.constexpr, QREG: gl.constexpr, PINGPONG: gl.constexpr, FIRST: gl.constexpr,
                  HAS_BIAS: gl.constexpr, ROW_BIAS: gl.constexpr, SINKS, HAS_SINKS: gl.constexpr,
                  HAS_KVLEN: gl.constexpr, REVERSE_M: gl.constexpr, BATCH_INNER: gl.constexpr, SEP_O: gl.constexpr):
    """One consumer warpgroup's share of tile t: its 64 rows, from key block `it` of the program's ring and with
    the tile's Q in phase tc & 1. Returns (it, tc, turn_phase) for the next tile."""
    WG_M: gl.constexpr = BLOCK_M // 2
    dtype: gl.constexpr = o_desc.dtype
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_DV, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    q_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2)
    rows_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    cols_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
    orow_layout: gl.constexpr = gl.SliceLayout(1, o_layout)
    cols0 = gl.arange(0, BLOCK_N, layout=cols_layout)
    s_zero = gl.zeros([WG_M, BLOCK_N], gl.float32, layout=s_layout)
    q2 = q_smem.reshape([WG_M, BLOCK_D])
    b, h, hk, bh, m0, n_lim, lo, n_blocks = _tile(
        t, n_tiles, Hq, G, Nq, Nk, KVLENS, n_groups, diag_offset, window_left, window_right, BLOCK_M, BLOCK_N,
        IS_CAUSAL, HAS_WL, HAS_WR, HAS_KVLEN, REVERSE_M, BATCH_INNER)
    if not FIRST:
        m0 = m0 + WG_M
    # This warpgroup's own unmasked range; the tile's range [lo, lo + n_blocks) is the union of both.
    _lo, full_lo, full_hi, _hi = _kv_range(m0, Nq, n_lim, diag_offset, window_left, window_right,
                                           IS_CAUSAL, HAS_WL, HAS_WR, WG_M, BLOCK_N)
    rows = m0 + gl.arange(0, WG_M, layout=rows_layout)
    m_i = gl.full([WG_M], float("-inf"), gl.float32, layout=rows_layout)
    l_i = gl.full([WG_M], 0.0, gl.float32, layout=rows_layout)
    acc = gl.zeros([WG_M, BLOCK_DV], gl.float32, layout=o_layout)

    mbarrier.wait(q_bar, tc & 1)
    if QREG:
        q_op = q2.load(q_layout)
        if SEP_O:  # Q lives in registers now: the producer may load the next tile's into its slot
            mbarrier.arrive(q_empty)
    else:
        q_op = q2
    kb = None  # the key vector of the current block (ROW_BIAS), loaded between Q·Kᵀ's issue and its wait
    if ROW_BIAS != 0:
        rb_row = row_bias + b.to(gl.int64) * rb_stride_b + h.to(gl.int64) * rb_stride_h

    if n_blocks > 0:
        g0 = it
        mbarrier.wait(k_full.index(g0 % STAGES), (g0 // STAGES) & 1)
        k_t = k_smem.index(g0 % STAGES).reshape([BLOCK_N, BLOCK_D]).permute((1, 0))
        turn_phase = _take_turn(my_turn, turn_phase, PINGPONG)
        s_tok = warpgroup_mma(q_op, k_t, s_zero, use_acc=False, is_async=True)
        _pass_turn(their_turn, PINGPONG)
        # The key vector is loaded after Q·Kᵀ is issued, before its wait: the latency hides behind the
        # product, and the BLOCK_N / 4 registers it takes per thread are not held across P·V's issue too
        # (loaded at the top of the iteration instead, the masked d128 / d256 builds spilled 100-460 B).
        if ROW_BIAS != 0:
            kb = _key_bias(rb_row, lo, cols0, n_lim, rb_stride_n)
        bt0 = None  # (named apart from the loop's `bt`, which would otherwise be carried across iterations)
        if HAS_BIAS:
            bt0 = _load_bias(b_smem, b_full, b_empty, g0 % STAGES, (g0 // STAGES) & 1, s_layout, WG_M, BLOCK_N,
                             FIRST)
        s = warpgroup_mma_wait(0, deps=[s_tok])
        mbarrier.arrive(k_empty.index(g0 % STAGES))
        s, scale = _finish_scores(s, qk_scale, bt0, kb, rows, lo, cols0, n_lim, full_lo, full_hi, diag_offset,
                                  window_left, window_right, IS_CAUSAL, HAS_WL, HAS_WR, HAS_BIAS, ROW_BIAS)
        p, m_i, l_i, alpha = _softmax_update(s, m_i, l_i, scale)
        for j in range(1, n_blocks):
            g = it + j
            slot = g % STAGES
            prev = (g - 1) % STAGES
            start_n = lo + j * BLOCK_N
            mbarrier.wait(k_full.index(slot), (g // STAGES) & 1)
            k_t = k_smem.index(slot).reshape([BLOCK_N, BLOCK_D]).permute((1, 0))
            mbarrier.wait(v_full.index(prev), ((g - 1) // STAGES) & 1)
            v_j = v_smem.index(prev).reshape([BLOCK_N, BLOCK_DV])
            p_op = gl.convert_layout(p.to(dtype), p_layout)
            turn_phase = _take_turn(my_turn, turn_phase, PINGPONG)
            s_tok = warpgroup_mma(q_op, k_t, s_zero, use_acc=False, is_async=True)
            o_tok = warpgroup_mma(p_op, v_j, acc, is_async=True)
            _pass_turn(their_turn, PINGPONG)
            if ROW_BIAS != 0:
                kb = _key_bias(rb_row, start_n, cols0, n_lim, rb_stride_n)
            bt = None
            if HAS_BIAS:
                bt = _load_bias(b_smem, b_full, b_empty, slot, (g // STAGES) & 1, s_layout, WG_M, BLOCK_N,
                                FIRST)
            s = warpgroup_mma_wait(1, deps=[s_tok])
            mbarrier.arrive(k_empty.index(slot))
            s, scale = _finish_scores(s, qk_scale, bt, kb, rows, start_n, cols0, n_lim, full_lo, full_hi,
                                      diag_offset, window_left, window_right, IS_CAUSAL, HAS_WL, HAS_WR, HAS_BIAS,
                                      ROW_BIAS)
            p, m_i, l_i, alpha = _softmax_update(s, m_i, l_i, scale)
            acc = warpgroup_mma_wait(0, deps=[o_tok])
            mbarrier.arrive(v_empty.index(prev))
            acc = acc * gl.expand_dims(gl.convert_layout(alpha, orow_layout), 1)
        last = n_blocks - 1
        g_last = it + last
        mbarrier.wait(v_full.index(g_last % STAGES), (g_last // STAGES) & 1)
        v_j = v_smem.index(g_last % STAGES).reshape([BLOCK_N, BLOCK_DV])
        if HAS_KVLEN:
            # The key range ends at the length (kv_block_range), so only the last tile can straddle it. Both
            # warpgroups zero the same rows of the shared tile (each before its own product; they write only
            # zeros).
            last_n = lo + last * BLOCK_N
            if last_n + BLOCK_N > n_lim:
                zero_rows_from(v_j, n_lim - last_n, BLOCK_N, BLOCK_DV, 4)
                fence_async_shared()
                _partition_barrier()
        p_op = gl.convert_layout(p.to(dtype), p_layout)
        turn_phase = _take_turn(my_turn, turn_phase, PINGPONG)
        o_tok = warpgroup_mma(p_op, v_j, acc, is_async=True)
        _pass_turn(their_turn, PINGPONG)
        acc = warpgroup_mma_wait(0, deps=[o_tok])
        mbarrier.arrive(v_empty.index(g_last % STAGES))
    if SEP_O and not QREG:  # every Q·Kᵀ of the tile has retired
        mbarrier.arrive(q_empty)

    if HAS_SINKS:
        # The head's sink logit: one more score with no value, in the max and the denominator (m_i is in
        # log2 units; the sink is a natural-log logit). A row with no admissible key: out 0, lse = sink.
        sink = gl.load(SINKS + h).to(gl.float32) * LOG2E
        m_s = gl.maximum(m_i, sink)
        m_use = gl.where(m_s == float("-inf"), 0.0, m_s)
        alpha = gl.exp2(m_i - m_use)
        l_i = l_i * alpha + gl.exp2(sink - m_use)
        acc = acc * gl.expand_dims(gl.convert_layout(alpha, orow_layout), 1)
        m_i = m_s
    empty = l_i == 0.0
    inv_l = gl.where(empty, 0.0, 1.0 / gl.where(empty, 1.0, l_i))
    out = acc * gl.expand_dims(gl.convert_layout(inv_l, orow_layout), 1)
    lse = gl.where(empty, float("-inf"), (m_i + gl.log2(gl.where(empty, 1.0, l_i))) * LN2)
    gl.store(LSE + bh.to(gl.int64) * Nq + rows, lse, mask=rows < Nq)
    if SEP_O:
        tma.store_wait(0)  # the previous tile's output has left o_smem (its store ran behind this tile)
    o_smem.reshape([WG_M, BLOCK_DV]).store(out.to(dtype))
    fence_async_shared()
    _tma_store(o_desc, [b, h, m0, 0], o_smem)
    if not SEP_O:  # O shares Q's slot: the next Q may land only once the output has left it
        tma.store_wait(0)
        mbarrier.arrive(q_empty)
    return it + n_blocks, tc + 1, turn_phase


@gluon.jit
def _ws_consumer(q_smem, o_smem, k_smem, v_smem, b_smem, q_bar, q_empty, k_full, v_full, k_empty, v_empty, b_full,
                 b_empty, my_turn, their_turn, o_desc, LSE, KVLENS, n_tiles, Hq, G, Nq, Nk, n_groups, qk_scale,
                 diag_offset, window_left, window_right, row_bias, rb_stride_b, rb_stride_h, rb_stride_n,
                 BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_D: gl.constexpr, BLOCK_DV: gl.constexpr,
                 STAGES: gl.constexpr, IS_CAUSAL: gl.constexpr, HAS_WL: gl.constexpr, HAS_WR: gl.constexpr,
                 QREG: gl.constexpr, PINGPONG: gl.constexpr, FIRST: gl.constexpr, HAS_BIAS: gl.constexpr,
                 ROW_BIAS: gl.constexpr, SINKS, HAS_SINKS: gl.constexpr, HAS_KVLEN: gl.constexpr,
                 REVERSE_M: gl.constexpr, BATCH_INNER: gl.constexpr, SEP_O: gl.constexpr, PERSISTENT: gl.constexpr):
    # Ping-pong: the two warpgroups take turns issuing their wgmma (turn t of a warpgroup waits for the
    # other's turn t - 1), so one's softmax runs while the other's products occupy the tensor cores.
    # The first warpgroup's wait on a fresh barrier with parity 1 passes at once. Both issue the same number of
    # turns per tile, so the turns carry over from tile to tile.
    turn_phase = 0 if FIRST else 1
    if PERSISTENT:
        it = 0  # key blocks consumed so far by this program (the ring's position)
        tc = 0  # tiles begun
        for t in range(gl.program_id(0), n_tiles, gl.num_programs(0)):
            it, tc, turn_phase = _consume_tile(
                t, it, tc, turn_phase, q_smem, o_smem, k_smem, v_smem, b_smem, q_bar, q_empty, k_full, v_full,
                k_empty, v_empty, b_full, b_empty, my_turn, their_turn, o_desc, LSE, KVLENS, n_tiles, Hq, G, Nq, Nk,
                n_groups, qk_scale, diag_offset, window_left, window_right, row_bias, rb_stride_b, rb_stride_h,
                rb_stride_n, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, STAGES, IS_CAUSAL, HAS_WL, HAS_WR, QREG, PINGPONG,
                FIRST, HAS_BIAS, ROW_BIAS, SINKS, HAS_SINKS, HAS_KVLEN, REVERSE_M, BATCH_INNER, SEP_O)
    else:  # one tile, straight-line code: no tile state is carried around a loop
        _consume_tile(
            gl.program_id(0), 0, 0, turn_phase, q_smem, o_smem, k_smem, v_smem, b_smem, q_bar, q_empty, k_full,
            v_full, k_empty, v_empty, b_full, b_empty, my_turn, their_turn, o_desc, LSE, KVLENS, n_tiles, Hq, G, Nq,
            Nk, n_groups, qk_scale, diag_offset, window_left, window_right, row_bias, rb_stride_b, rb_stride_h,
            rb_stride_n, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, STAGES, IS_CAUSAL, HAS_WL, HAS_WR, QREG, PINGPONG,
            FIRST, HAS_BIAS, ROW_BIAS, SINKS, HAS_SINKS, HAS_KVLEN, REVERSE_M, BATCH_INNER, SEP_O)
    tma.store_wait(0)


@gluon.jit
def attn_fwd_gluon_ws_kernel(
    q_desc, k_desc, v_desc, o_desc, LSE, KVLENS, bias_desc, bias_b_mul, bias_h_mul,
    row_bias, rb_stride_b, rb_stride_h, rb_stride_n,
    Hq, G, Nq, Nk, qk_scale, diag_offset, window_left, window_right, n_groups, n_tiles,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_D: gl.constexpr, BLOCK_DV: gl.constexpr,
    STAGES: gl.constexpr, IS_CAUSAL: gl.constexpr, HAS_WL: gl.constexpr, HAS_WR: gl.constexpr,
    HAS_KVLEN: gl.constexpr, REVERSE_M: gl.constexpr, QREG: gl.constexpr, CONSUMER_REGS: gl.constexpr,
    PINGPONG: gl.constexpr = False, HAS_BIAS: gl.constexpr = False, ROW_BIAS: gl.constexpr = 0,
    BATCH_INNER: gl.constexpr = False, SINKS=None, HAS_SINKS: gl.constexpr = False, SEP_O: gl.constexpr = False,
    PERSISTENT: gl.constexpr = False,
):
    """BLOCK_M = 128 query rows per tile (two warpgroups of 64); launched with num_warps=4.

    Program p runs tiles p, p + P, ... of n_tiles (P programs): P = n_tiles is one tile per program; fewer
    programs are persistent, and then the producer loads the next tile's first K/V blocks and Q while the
    consumers finish the previous tile and its output store runs behind the next tile (SEP_O).
    SEP_O: the output's own shared tile, so Q's slot is freed as soon as Q is read (in registers with QREG, else
    after the tile's last Q·Kᵀ); without it O is staged in Q's slot, freed once the output's store is done.
    ROW_BIAS: 0 none, 1 float, 2 bool (uint8) bias constant along query rows, at row_bias + b·rb_stride_b
    + h·rb_stride_h + key·rb_stride_n (strides of its broadcast [B, Hq, 1, Nk] view, 0 on broadcast dims);
    without it the four arguments are None (constexpr: the kernel's signature and code stay as they were).
    BATCH_INNER: tile order with the batch fastest (_batch_inner_ids), for a bias tile shared by the batch.
    n_groups: otherwise, the tile order's (batch x head) groups (triton_family.launch_groups).
    HAS_SINKS: SINKS [Hq] (any float dtype), each head's logit in the softmax denominator (ops.py)."""
    WG_M: gl.constexpr = BLOCK_M // 2
    dtype: gl.constexpr = q_desc.dtype

    q_smem = gl.allocate_shared_memory(dtype, [2, 1, 1, WG_M, BLOCK_D], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BLOCK_N, BLOCK_D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [STAGES, 1, 1, BLOCK_N, BLOCK_DV], v_desc.layout)
    if SEP_O:
        o_smem = gl.allocate_shared_memory(dtype, [2, 1, 1, WG_M, BLOCK_DV], o_desc.layout)
    else:
        gl.static_assert(BLOCK_D == BLOCK_DV, "O staged in Q's slot needs BLOCK_D == BLOCK_DV")
        o_smem = q_smem  # each warpgroup's Q tile is dead once its last Q·Kᵀ has retired
    q_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    k_full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    b_full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    b_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    if HAS_BIAS:
        # A float bias [B|1, H|1, Nq, Nk] (broadcast dims read at coordinate 0): two tiles per slot.
        b_smem = gl.allocate_shared_memory(bias_desc.dtype, [2 * STAGES, 1, 1, WG_M, BLOCK_N], bias_desc.layout)
    else:
        b_smem = k_smem
    for i in gl.static_range(2):
        mbarrier.init(q_bar.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=1)
        mbarrier.init(turn.index(i), count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(k_full.index(i), count=1)
        mbarrier.init(v_full.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=2)
        mbarrier.init(v_empty.index(i), count=2)
        mbarrier.init(b_full.index(i), count=1)
        mbarrier.init(b_empty.index(i), count=2)

    gl.warp_specialize([
        (_ws_consumer, (q_smem.index(0), o_smem.index(0), k_smem, v_smem, b_smem, q_bar.index(0), q_empty.index(0),
                        k_full, v_full, k_empty, v_empty, b_full, b_empty, turn.index(0), turn.index(1), o_desc, LSE,
                        KVLENS, n_tiles, Hq, G, Nq, Nk, n_groups, qk_scale, diag_offset, window_left, window_right,
                        row_bias, rb_stride_b, rb_stride_h, rb_stride_n, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, STAGES,
                        IS_CAUSAL, HAS_WL, HAS_WR, QREG, PINGPONG, True, HAS_BIAS, ROW_BIAS, SINKS, HAS_SINKS,
                        HAS_KVLEN, REVERSE_M, BATCH_INNER, SEP_O, PERSISTENT)),
        (_ws_consumer, (q_smem.index(1), o_smem.index(1), k_smem, v_smem, b_smem, q_bar.index(1), q_empty.index(1),
                        k_full, v_full, k_empty, v_empty, b_full, b_empty, turn.index(1), turn.index(0), o_desc, LSE,
                        KVLENS, n_tiles, Hq, G, Nq, Nk, n_groups, qk_scale, diag_offset, window_left, window_right,
                        row_bias, rb_stride_b, rb_stride_h, rb_stride_n, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, STAGES,
                        IS_CAUSAL, HAS_WL, HAS_WR, QREG, PINGPONG, False, HAS_BIAS, ROW_BIAS, SINKS, HAS_SINKS,
                        HAS_KVLEN, REVERSE_M, BATCH_INNER, SEP_O, PERSISTENT)),
        (_ws_producer, (q_desc, k_desc, v_desc, bias_desc, q_smem, k_smem, v_smem, b_smem, q_bar, q_empty, k_full,
                        v_full, k_empty, v_empty, b_full, b_empty, bias_b_mul, bias_h_mul, KVLENS, n_tiles, Hq, G,
                        Nq, Nk, n_groups, diag_offset, window_left, window_right, BLOCK_M, BLOCK_N, STAGES, HAS_BIAS,
                        IS_CAUSAL, HAS_WL, HAS_WR, HAS_KVLEN, REVERSE_M, BATCH_INNER, PERSISTENT)),
    ], [4, 1], [CONSUMER_REGS, 24])

    for i in gl.static_range(2):
        mbarrier.invalidate(q_bar.index(i))
        mbarrier.invalidate(q_empty.index(i))
        mbarrier.invalidate(turn.index(i))
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(k_full.index(i))
        mbarrier.invalidate(v_full.index(i))
        mbarrier.invalidate(k_empty.index(i))
        mbarrier.invalidate(v_empty.index(i))
        mbarrier.invalidate(b_full.index(i))
        mbarrier.invalidate(b_empty.index(i))
