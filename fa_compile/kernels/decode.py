"""Decode attention over KV caches (contiguous or paged), Triton split-KV: launcher and heuristics.

What it supports: 1 or more query tokens per sequence (the last Nq positions; meant for 1..16), any
Hq / Hkv ratio (GQA packing: G * Nq rows per program, so keep it <= 128), per-sequence lengths and
left padding, caches in either layout, paged (any page size, int32 or int64 tables) or contiguous,
fp16 / bf16 (and fp32 through TF32 on the GPU), head dims up to 256. Semantics: decode_reference.py.

Triton is imported on first launch only, so this module imports on a machine without it.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .decode_reference import cache_view
from .triton_family import device_reasons, interpreting, sm_count, triton_available  # noqa: F401  (re-exported: decode.triton_available)

MAX_HEAD_DIM = 256
MAX_ROWS = 128  # G * Nq rows per program: one tile of the packed query group
MAX_SPLITS = 64
# A split reads at least this many keys: fewer and the combine's traffic and the launch tail cost
# more than the extra parallelism gains.
MIN_KEYS_PER_SPLIT = 256
# Programs per SM for a memory-bound pass: enough resident programs to keep loads in flight. The
# splits bring the program count up to, never past, this many per SM: one full wave. A count just over
# it leaves a second, nearly empty wave (H200, B8 x 32k page 64, 8 kv heads: 9 splits 3.2 TB/s, 8
# splits 4.4; B32 x 4k page 16: 3 splits 3.5, 2 splits 4.1; benchmarks/decode.py --sweep, 2026-12-02).
PROGRAMS_PER_SM = 4




def _pow2(n: int, lo: int = 16) -> int:
    return max(lo, 1 << (max(n, 1) - 1).bit_length())


def choose_num_splits(batch: int, kv_heads: int, max_len: int, num_sms: int, *, block_n: int = 64,
                      min_keys: int = MIN_KEYS_PER_SPLIT, programs_per_sm: int = PROGRAMS_PER_SM,
                      max_splits: int = MAX_SPLITS) -> int:
    """Splits of each sequence's keys so that B * Hkv * splits programs fill the GPU.

    No split when B * Hkv programs already fill `programs_per_sm` programs per SM; otherwise as many
    as bring the count up to that (rounded down: one wave, no tail), but never so many that a split
    gets fewer than `min_keys` keys (or one tile) of the longest possible sequence `max_len` (the
    cache's capacity: lengths live on the device, and reading them would cost a sync). Each sequence
    then splits its own valid length.
    """
    programs = batch * kv_heads
    if programs <= 0 or max_len <= 0 or num_sms <= 0:
        return 1
    target = num_sms * programs_per_sm
    if programs >= target:
        return 1
    by_len = max(1, max_len // max(min_keys, block_n))
    s = min(target // programs, by_len, max_splits)
    return max(1, s)


def launch_options(block_n: int, block_d: int, block_dv: int) -> tuple[dict, dict]:
    """(partial pass, combine) launch options on a GPU: warps and pipeline stages (none under the
    interpreter). Shared by the run-time launcher and the lowered op (decode_ops.py)."""
    if interpreting():
        return {}, {}
    # Two stages: three were slower on every swept shape at 64 keys per tile (H200, --sweep, 2026-12-02).
    return dict(num_warps=4, num_stages=2), dict(num_warps=4 if block_dv >= 128 else 2)


def pick_block_n(block_d: int, page: Optional[int]) -> int:
    """Keys per tile: 64 for head dims up to 128 (32 above, for registers)."""
    return 64 if block_d <= 128 else 32


def plan_splits(num_splits: int, batch: int, kv_heads: int, capacity: int, device: torch.device, block_n: int) -> int:
    """The splits a launch uses: `num_splits` (0: choose_num_splits), at most one per tile of keys."""
    s = num_splits if num_splits > 0 else choose_num_splits(batch, kv_heads, capacity, sm_count(device), block_n=block_n)
    return max(1, min(s, -(-capacity // block_n)))


def not_supported_reasons(q: Tensor, k_cache: Tensor, v_cache: Tensor, page_table: Optional[Tensor]) -> list[str]:
    """Why the Triton decode kernel cannot take these (already checked) inputs; [] when it can."""
    if not triton_available():
        return ["triton not installed"]
    dev = q.device
    r = device_reasons(dev)
    if q.dtype == torch.float32 and dev.type == "cuda" and torch.get_float32_matmul_precision() == "highest":
        r.append("float32 needs TF32 (torch.set_float32_matmul_precision('high')); precision is 'highest'")
    elif q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        r.append(f"dtype {q.dtype} is not supported")
    d, dv = q.shape[-1], v_cache.shape[-1]
    if d > MAX_HEAD_DIM or dv > MAX_HEAD_DIM:
        r.append(f"head dims {d}/{dv} exceed {MAX_HEAD_DIM}")
    hkv = k_cache.shape[2] if k_cache.dim() == 4 else 0
    rows = (q.shape[2] // max(hkv, 1)) * q.shape[1]
    if rows > MAX_ROWS:
        r.append(f"{rows} query rows per KV head (query heads per KV head x query tokens) exceed {MAX_ROWS}")
    return r


def paged_decode(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    cache_seqlens: Tensor,
    page_table: Optional[Tensor] = None,
    cache_leftpad: Optional[Tensor] = None,
    *,
    scale: float,
    causal: bool = True,
    layout: str = "bshd",
    num_splits: int = 0,
    block_n: Optional[int] = None,
    out: Optional[Tensor] = None,
    lse: Optional[Tensor] = None,
    workspace: Optional[tuple[Tensor, ...]] = None,
    q_pos: Optional[Tensor] = None,
    diag_offset: Optional[int] = None,
    bias: Optional[tuple[Tensor, int, tuple[int, int, int, int]]] = None,
) -> tuple[Tensor, Tensor]:
    """(out [B, Nq, Hq, Dv] in q's dtype, lse [B, Hq, Nq] fp32). num_splits 0 chooses
    (choose_num_splits); out / lse / workspace (fp32 [B*Hkv, S, G*Nq, Dv] and [B*Hkv, S, G*Nq] for the
    splits' outputs and row maxima, optionally a third like the second for their row sums) may be
    given, e.g. poisoned by tests. Inputs are assumed checked (fa_compile.paged).

    cache_seqlens may be None (every position of a contiguous cache is valid). q_pos (int [Nq] or
    [B|1, Nq]): token i admits keys j <= q_pos[b, i], and each sequence's valid range ends at its largest
    q_pos + 1. diag_offset (not None): token i admits keys j <= i + diag_offset. bias: (tensor, kind 1
    float / 2 bool as uint8, strides of its [B, Hq, Nq, Nk] broadcast view) over key positions."""
    from .decode_triton import decode_combine_kernel, decode_partial_kernel

    kc, vc = cache_view(k_cache, layout), cache_view(v_cache, layout)
    b, nq, hq, d = q.shape
    hkv, dv = kc.shape[2], vc.shape[3]
    g = hq // hkv
    if out is None:
        out = q.new_empty((b, nq, hq, dv))
    if lse is None:
        lse = torch.empty((b, hq, nq), device=q.device, dtype=torch.float32)
    if b * nq * hq == 0:
        return out, lse
    if dv == 0:  # nothing to read from V: the lse alone (rare; the reference computes it exactly)
        raise ValueError("v_cache: head dim 0 is not supported by the Triton decode kernel")
    paged = page_table is not None
    page = kc.shape[1]
    capacity = page_table.shape[1] * page if paged else kc.shape[1]
    block_d, block_dv = _pow2(d), _pow2(dv)
    bn = block_n or pick_block_n(max(block_d, block_dv), page if paged else None)
    splits = plan_splits(num_splits, b, hkv, capacity, q.device, bn)
    rows = g * nq
    block_m = _pow2(rows)
    # The kernel reads one length and one left pad per sequence at SEQLENS + b, LEFTPAD + b: unit stride
    # (a column of a wider tensor, or an expanded length, would be read past its values).
    lens = cache_seqlens.contiguous() if cache_seqlens is not None else q
    table = page_table if paged else lens
    leftpad = cache_leftpad.contiguous() if cache_leftpad is not None else lens
    if splits > 1:
        if workspace is None:
            opart = torch.empty((b * hkv, splits, rows, dv), device=q.device, dtype=torch.float32)
            lpart, spart = torch.empty((2, b * hkv, splits, rows), device=q.device, dtype=torch.float32).unbind(0)
        else:
            opart, lpart = workspace[:2]
            if opart.shape != (b * hkv, splits, rows, dv) or lpart.shape != (b * hkv, splits, rows):
                raise ValueError(f"workspace: expected shapes {(b * hkv, splits, rows, dv)} and {(b * hkv, splits, rows)}")
            spart = torch.empty_like(lpart) if len(workspace) < 3 else workspace[2]
            if spart.shape != lpart.shape:
                raise ValueError(f"workspace: the row sums' shape must be {(b * hkv, splits, rows)}, "
                                 f"got {tuple(spart.shape)}")
    else:
        opart = lpart = spart = lse
    const = dict(PAGE=page if paged else 1, PAGED=paged, PAGE_TILES=paged and page % bn == 0, HAS_LEFTPAD=cache_leftpad is not None, IS_CAUSAL=bool(causal),
                 SPLIT=splits > 1, BLOCK_M=block_m, BLOCK_N=bn, BLOCK_D=block_d, BLOCK_DV=block_dv,
                 HAS_SEQLENS=cache_seqlens is not None)
    if q_pos is not None:
        qp = q_pos.view(1, -1) if q_pos.dim() == 1 else q_pos
        const.update(QPOS=qp, stride_pb=0 if qp.shape[0] == 1 else qp.stride(0), stride_pm=qp.stride(1), HAS_QPOS=True)
    if diag_offset is not None:
        const.update(diag_offset=int(diag_offset), DIAG_CAUSAL=True)
    if bias is not None:
        bt, kind, bstr = bias
        const.update(BIAS=bt, stride_bb=bstr[0], stride_bh=bstr[1], stride_bm=bstr[2], stride_bn=bstr[3],
                     BIAS_KIND=kind)
    partial_opts, combine_opts = launch_options(bn, block_d, block_dv)
    const.update(partial_opts)
    ctx = torch.cuda.device(q.device) if q.device.type == "cuda" else _Null()
    with ctx:
        decode_partial_kernel[(splits, b * hkv)](
            q, kc, vc, lens, leftpad, table, out, lse, opart, lpart, spart,
            q.stride(0), q.stride(1), q.stride(2), q.stride(3),
            kc.stride(0), kc.stride(1), kc.stride(2), kc.stride(3),
            vc.stride(0), vc.stride(1), vc.stride(2), vc.stride(3),
            table.stride(0), table.stride(-1),
            out.stride(0), out.stride(1), out.stride(2),
            hkv, g, nq, d, dv, capacity, splits, float(scale),
            **const,
        )
        if splits > 1:
            cconst = dict(BLOCK_S=_pow2(splits, 2), BLOCK_DV=block_dv, **combine_opts)
            decode_combine_kernel[(b * hkv * rows,)](
                opart, lpart, spart, out, lse, out.stride(0), out.stride(1), out.stride(2), hkv, g, nq, dv, splits,
                **cconst,
            )
    return out, lse


# fa3.attention calls the decode kernel takes (dispatch's "decode" candidate): at most this many query
# tokens, the "1..16 new tokens" of a decode or speculative step.
ATTENTION_MAX_Q = 16


def attention_not_supported_reasons(args) -> list[str]:
    """Why the split-KV decode kernel cannot run these `torch.ops.fa3.attention` arguments (duck-typed
    AttentionArgs; metadata only, so fake tensors work): decode-shaped calls (Nq <= ATTENTION_MAX_Q) with
    masks it has, i.e. causal as a diagonal, kv_lens, q_pos and a float or bool bias of any broadcast.
    Only static-cache decode steps: calls with q_pos, or with kv_lens beside a bias (a data mask whose
    key limit the rewrite read at run time, patterns/key_limit.py), whose reads end at each sequence's
    limit; other decode calls go to the peers or the tiled family, which the compile-time lowering
    launches directly (candidates/__init__.py)."""
    r = kernel_not_supported_reasons(args)
    if r or getattr(args, "q_pos", None) is not None or (args.kv_lens is not None and args.bias is not None):
        return r
    return ["taken only for static-cache decode steps (run-time positions q_pos, or kv_lens with a bias); "
            "other decode calls go to the peers or the tiled family"]


def kernel_not_supported_reasons(args) -> list[str]:
    """What the split-KV decode kernel itself cannot compute in these decode-shaped (Nq <= ATTENTION_MAX_Q)
    arguments, whatever the run-time dispatch order (the compile-time lowering of decode steps reads this
    alone: fa_compile/lowering/decode.py)."""
    q, k, v = args.q, args.k, args.v
    nq = q.shape[2]
    if not isinstance(nq, int) or nq > ATTENTION_MAX_Q:
        return [f"{nq} query tokens: the decode kernel takes 1..{ATTENTION_MAX_Q} (the tiled kernel runs longer rows)"]
    r = not_supported_reasons(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None)
    if q.device.type == "cpu" and q.dtype == torch.bfloat16:
        r.append("bfloat16 under the Triton interpreter (its bf16 dot is unreliable)")
    if q.shape[3] == 0 or v.shape[3] == 0:
        r.append("head dim 0")
    if int(args.window_left) >= 0 or int(args.window_right) >= 0:
        r.append("no sliding window in the decode kernel")
    if float(args.softcap) > 0:
        r.append("no softcap in the decode kernel")
    if float(args.dropout_p) > 0:
        r.append("no dropout in the decode kernel")
    if getattr(args, "sinks", None) is not None:
        r.append("no attention sinks in the decode kernel")
    if getattr(args, "q_seg", None) is not None:
        r.append("no segment ids in the decode kernel")
    if args.bias is not None and args.bias.dtype not in (torch.bool, torch.float16, torch.bfloat16, torch.float32):
        r.append(f"bias dtype {args.bias.dtype} is not supported")
    return r


def attention_decode(args, out: Optional[Tensor] = None, lse: Optional[Tensor] = None,
                     num_splits: int = 0) -> tuple[Tensor, Tensor]:
    """`torch.ops.fa3.attention` on the split-KV decode kernel: (out [B, Hq, Nq, Dv] stored BSHD, lse
    [B, Hq, Nq] fp32). k / v are read as contiguous caches [B, Nk, Hkv, D] (transposed views, any
    strides), kv_lens as the lengths, q_pos / the causal diagonal / the bias as above; `out` (a
    [B, Nq, Hq, Dv] buffer) and `lse` may be given (tests poison them)."""
    from .triton_family import _bias4

    q, k, v = args.q, args.k, args.v
    b, hq, nq, _ = q.shape
    nk = k.shape[2]
    bias = None
    if args.bias is not None:
        bt, kind, bstr = _bias4(args.bias, b, hq, nq, nk)
        bias = (bt, 1 if kind in (1, 3) else 2, bstr)
    causal = bool(args.causal)
    o, l_ = paged_decode(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), args.kv_lens, None, None, scale=float(args.scale),
        causal=False, layout="bshd", num_splits=num_splits, out=out, lse=lse, q_pos=getattr(args, "q_pos", None),
        diag_offset=int(args.diag_offset) if causal else None, bias=bias,
    )
    return o.transpose(1, 2), l_


class DecodeAttention:
    """Dispatch candidate "decode" for `torch.ops.fa3.attention` (duck-typed args): the split-KV kernel
    on decode-shaped calls; forward only (the lse is the op's, so any backward follows it)."""

    name = "decode"
    never_reads_past_kv_lens = True  # its key loops end at each sequence's length

    def not_supported_reasons(self, args) -> list[str]:
        return attention_not_supported_reasons(args)

    def has_backward(self) -> bool:
        return False

    def forward(self, args) -> tuple[Tensor, Tensor]:
        return attention_decode(args)


DECODE = DecodeAttention()


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
