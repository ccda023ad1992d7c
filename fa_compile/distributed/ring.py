"""Ring attention: fa3.attention and fa3.attention_backward on sequence-sharded Q/K/V.

Every rank holds its queries and one K/V shard; the K/V shards pass around the ring of the context
parallel group (rank r sends to r + 1 and receives from r - 1) while the current shard's blocks are
computed, so communication overlaps compute. A step's blocks are calls of the op's own kernel
entry points (`ops.attention` / `ops.attention_backward`), so dispatch picks the fastest kernel per
block, with the block's mask given as structure: the global positions of the query and key chunks
turn the call's causal / diagonal offset / window into a per-block offset, or "no mask" (a block
entirely below the diagonal), or "skip" (entirely masked: not computed). Key padding (`kv_lens`, in
global positions) becomes each block's count of valid local keys.

Forward: partial (out, lse) of the blocks are merged exactly by their log-sum-exp (natural log, as the
op returns it). Backward: every block's (dq, dk, dv) is the backward kernel's with the *global* out
and lse of the local queries (P = exp(s - lse) is then each block's exact share; `_block_backward`
says how a kernel that recomputes P from the block alone gets the same), dq summed locally, dk / dv
accumulated (fp32 or wider) on an accumulator that travels with its K/V shard and reaches the
shard's owner after the last step, its transfer overlapped with the next block as the K/V's is.

Layout (`Layout`): with load balancing the global sequence is cut into 2W chunks and rank r holds
chunks r and 2W-1-r (head-tail, as torch's `context_parallel` and the Llama 3 recipe), so causal work
is even across ranks; without it, rank r holds the r-th of W contiguous pieces.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

_NEG_INF = float("-inf")


@dataclass(frozen=True)
class Layout:
    """Which global positions each rank of the ring holds (identical for Q and K/V)."""

    world: int
    rank: int
    load_balance: bool
    group: Optional[dist.ProcessGroup] = None

    def segments(self, rank: int, n_local: int) -> list[tuple[int, int, int]]:
        """(global_start, local_start, length) of `rank`'s pieces, in local (and global) order."""
        if not self.load_balance:
            return [(rank * n_local, 0, n_local)]
        if n_local % 2:
            raise ValueError(f"context_parallel: a local sequence of {n_local} tokens cannot hold the two chunks "
                             f"of the load-balanced layout (global length must be a multiple of 2 * {self.world})")
        c = n_local // 2
        return [(rank * c, 0, c), ((2 * self.world - 1 - rank) * c, c, c)]

    def peer(self, offset: int) -> int:
        """The global rank of the ring member `offset` steps after this one."""
        r = (self.rank + offset) % self.world
        return dist.get_global_rank(self.group, r) if self.group is not None else r


@dataclass(frozen=True)
class Structure:
    """The mask arguments of the sharded call, in global positions."""

    causal: bool
    diag_offset: int
    window_left: int
    window_right: int


@dataclass(frozen=True)
class Block:
    """One kernel call: local query rows [q0, q1) against the shard's local keys [k0, k1)."""

    q0: int
    q1: int
    k0: int
    k1: int
    full: bool  # no mask inside the block
    diag_offset: int  # local diagonal offset when not full
    k_starts: tuple[tuple[int, int], ...]  # (global_start, length) of the key pieces, for kv_lens


def _pair_status(s: Structure, qs: int, nq: int, ks: int, nk: int) -> tuple[str, int]:
    """("skip" | "full" | "masked", local diag_offset) for query piece at global qs and key piece at ks.

    Admissible iff lo <= j - i - off <= hi with local i, j and off = diag_offset + qs - ks."""
    off = s.diag_offset + qs - ks
    if nq == 0 or nk == 0:
        return "skip", off
    hi = math.inf
    if s.causal:
        hi = 0
    if s.window_right >= 0:
        hi = min(hi, s.window_right)
    lo = -s.window_left if s.window_left >= 0 else -math.inf
    # j - i ranges over [-(nq - 1), nk - 1]; admissible j - i over [off + lo, off + hi].
    if off + hi < -(nq - 1) or off + lo > nk - 1 or lo > hi:
        return "skip", off
    if off + hi >= nk - 1 and off + lo <= -(nq - 1):
        return "full", off
    return "masked", off


def plan_blocks(s: Structure, q_segs: Sequence[tuple[int, int, int]],
                k_segs: Sequence[tuple[int, int, int]]) -> list[Block]:
    """The kernel calls of one (local queries, K/V shard) pair: fully masked pieces skipped; unmasked
    neighbours joined into one call (key pieces only when their global positions make the valid-key
    count a prefix, which holds for pieces in increasing global order, as both layouts have)."""
    per_q: list[list[Block]] = []
    for qs, q0, nq in q_segs:
        st = [(_pair_status(s, qs, nq, ks, nk), (ks, k0, nk)) for ks, k0, nk in k_segs]
        live = [(status, seg) for status, seg in st if status[0] != "skip"]
        if live and all(status[0] == "full" for status, _ in live) and all(
                a[1][1] + a[1][2] == b[1][1] for a, b in zip(live, live[1:])):
            k0, k1 = live[0][1][1], live[-1][1][1] + live[-1][1][2]
            per_q.append([Block(q0, q0 + nq, k0, k1, True, 0, tuple((seg[0], seg[2]) for _, seg in live))])
            continue
        per_q.append([Block(q0, q0 + nq, seg[1], seg[1] + seg[2], status[0] == "full", status[1], ((seg[0], seg[2]),))
                      for status, seg in live])
    # Query pieces that each make one identical unmasked call: one call for all of them.
    flat = [b for bs in per_q for b in bs]
    if len(per_q) > 1 and all(len(bs) == 1 for bs in per_q) and all(b.full for b in flat) and \
            len({(b.k0, b.k1) for b in flat}) == 1 and all(a.q1 == b.q0 for a, b in zip(flat, flat[1:])):
        first = flat[0]
        return [Block(first.q0, flat[-1].q1, first.k0, first.k1, True, 0, first.k_starts)]
    return flat


def _block_kv_lens(kv_lens: Optional[Tensor], b: Block) -> Optional[Tensor]:
    """Valid local keys of the block: the sum over its key pieces of clamp(kv_lens - start, 0, length)."""
    if kv_lens is None:
        return None
    total = None
    for start, n in b.k_starts:
        part = (kv_lens - start).clamp(0, n)
        total = part if total is None else total + part
    return total.to(kv_lens.dtype).contiguous()


class _Shift:
    """Send tensors to the next rank and receive the previous rank's, asynchronously."""

    def __init__(self, layout: Layout, tensors: Sequence[Tensor], tag: int):
        self.recv = [torch.empty_like(t) for t in tensors]
        nxt, prev = layout.peer(1), layout.peer(-1)
        ops = []
        for i, (t, r) in enumerate(zip(tensors, self.recv)):
            ops.append(dist.P2POp(dist.isend, t, nxt, layout.group, tag + i))
            ops.append(dist.P2POp(dist.irecv, r, prev, layout.group, tag + i))
        self.works = dist.batch_isend_irecv(ops)

    def wait(self) -> list[Tensor]:
        for w in self.works:
            w.wait()
        return self.recv


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _merge(out_acc: Tensor, lse_acc: Tensor, o: Tensor, l: Tensor) -> None:
    """out_acc, lse_acc (rows of one block) <- the exact softmax merge with the block's (o, l), in place."""
    new = torch.logaddexp(lse_acc, l)
    safe = torch.where(torch.isneginf(new), torch.zeros_like(new), new)  # rows no key reached yet: weights 0
    w_old = torch.exp(lse_acc - safe).unsqueeze(-1)
    w_new = torch.exp(l - safe).unsqueeze(-1)
    out_acc.mul_(w_old).add_(o.to(out_acc.dtype) * w_new)
    lse_acc.copy_(new)


def _slice_seg(seg: Optional[Tensor], lo: int, hi: int) -> Optional[Tensor]:
    """Positions lo:hi of segment ids ([N] or [B, N]), contiguous for the kernels."""
    return None if seg is None else seg[..., lo:hi].contiguous()


def ring_forward(layout: Layout, s: Structure, q: Tensor, k: Tensor, v: Tensor, scale: float,
                 kv_lens: Optional[Tensor], softcap: float, force_kernel: Optional[str],
                 sinks: Optional[Tensor], q_seg: Optional[Tensor] = None,
                 k_seg: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """(out [B, Hq, Nq, Dv] in q's dtype, lse [B, Hq, Nq] fp32) of the local queries against the whole
    sequence. `sinks` join the merged denominator once, after the ring. Segment ids (local shards in
    the context's layout, as q and k) travel with their K/V shard: a block's keys keep their own ids."""
    from .. import ops

    b, hq, nq, _ = q.shape
    dv = v.shape[3]
    out_acc = torch.zeros((b, hq, nq, dv), dtype=_acc_dtype(q.dtype), device=q.device)
    lse_acc = torch.full((b, hq, nq), _NEG_INF, dtype=torch.float32, device=q.device)
    q_segs = layout.segments(layout.rank, nq)
    kv = [k.contiguous(), v.contiguous()] + ([k_seg.contiguous()] if k_seg is not None else [])
    for step in range(layout.world):
        shift = _Shift(layout, kv, tag=0) if step + 1 < layout.world else None
        src = (layout.rank - step) % layout.world
        kk, vv = kv[0], kv[1]
        ks = kv[2] if k_seg is not None else None
        for blk in plan_blocks(s, q_segs, layout.segments(src, kk.shape[2])):
            o, l = ops.attention(
                q[:, :, blk.q0:blk.q1], kk[:, :, blk.k0:blk.k1], vv[:, :, blk.k0:blk.k1], scale,
                not blk.full and s.causal, blk.diag_offset if not blk.full else 0,
                -1 if blk.full else s.window_left, -1 if blk.full else s.window_right, None,
                _block_kv_lens(kv_lens, blk), softcap, 0.0, None, force_kernel, None, None,
                _slice_seg(q_seg, blk.q0, blk.q1), _slice_seg(ks, blk.k0, blk.k1))
            _merge(out_acc[:, :, blk.q0:blk.q1], lse_acc[:, :, blk.q0:blk.q1], o, l)
        if shift is not None:
            kv = shift.wait()
    if sinks is not None:
        final = torch.logaddexp(lse_acc, sinks.to(torch.float32)[None, :, None])
        out_acc.mul_(torch.exp(lse_acc - final).unsqueeze(-1))  # (lse_acc -inf: weight 0, final = sink)
        lse_acc = final
    out = ops._out_like(q, v)
    out.copy_(out_acc)
    return out, lse_acc.contiguous()


def _block_backward(s: Structure, blk: Block, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                    lse: Tensor, scale: float, kv_lens: Optional[Tensor], softcap: float,
                    force_kernel: Optional[str], q_seg: Optional[Tensor] = None,
                    k_seg: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    """One block's (dq, dk, dv) with P = exp(s - lse) for the global lse of its rows.

    Fused backward kernels read P that way from the lse they are given: they get the global one,
    forced by name so that dispatch's run-time fallback cannot swap in the reference unscaled (here, a
    failing kernel falls back to the scaled reference below). The reference recomputes
    P_b = softmax over the block's keys instead; since exp(s - lse) = P_b * w with
    w = exp(lse_b - lse) per row (lse_b: the block's own, from a block forward), it gets dO * w, which
    makes its dV = P_b^T (dO w), delta = w rowsum(dO O) and dS = P_b w (dP - delta) the exact ones."""
    from .. import dispatch, ops

    causal = not blk.full and s.causal
    off = blk.diag_offset if not blk.full else 0
    wl, wr = (-1, -1) if blk.full else (s.window_left, s.window_right)
    args = dispatch.AttentionArgs(q, k, v, scale, causal, off, wl, wr, None, kv_lens, softcap, needs_backward=True,
                                  q_seg=q_seg, k_seg=k_seg)
    kernel = dispatch.select_backward(args, force_kernel).name
    lse = lse.contiguous()
    if kernel != "reference":
        try:
            return ops.attention_backward(dout, q, k, v, out, lse, scale, causal, off, wl, wr, None, kv_lens,
                                          softcap, 0.0, None, False, kernel, None, None, q_seg, k_seg)[:3]
        except Exception as e:  # a limit its reasons missed: the reference, exact as below (dispatch's own rule)
            if force_kernel is not None:
                raise
            dispatch._warn_once(kernel, "backward", e, "reference")
    _, lse_b = ops.attention(q, k, v, scale, causal, off, wl, wr, None, kv_lens, softcap, 0.0, None, force_kernel,
                             None, None, q_seg, k_seg)
    w = torch.where(torch.isneginf(lse_b), torch.zeros_like(lse_b), torch.exp(lse_b - lse))
    d_scaled = dout * w.unsqueeze(-1).to(dout.dtype)
    return ops.attention_backward(d_scaled, q, k, v, out, lse_b, scale, causal, off, wl, wr, None, kv_lens, softcap,
                                  0.0, None, False, "reference", None, None, q_seg, k_seg)[:3]


def ring_backward(layout: Layout, s: Structure, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                  lse: Tensor, scale: float, kv_lens: Optional[Tensor], softcap: float,
                  force_kernel: Optional[str], q_seg: Optional[Tensor] = None,
                  k_seg: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of the local shards, given the global out and lse of the local queries."""
    from .. import ops

    nq = q.shape[2]
    acc = _acc_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    q_segs = layout.segments(layout.rank, nq)
    kv = [k.contiguous(), v.contiguous()] + ([k_seg.contiguous()] if k_seg is not None else [])
    dkv: Optional[list[Tensor]] = None  # the accumulator of the shard computed last step
    for step in range(layout.world):
        kv_shift = _Shift(layout, kv, tag=0) if step + 1 < layout.world else None
        acc_shift = _Shift(layout, dkv, tag=3) if dkv is not None else None
        src = (layout.rank - step) % layout.world
        kk, vv = kv[0], kv[1]
        ks = kv[2] if k_seg is not None else None
        dk = torch.zeros(kk.shape, dtype=acc, device=kk.device)
        dv = torch.zeros(vv.shape, dtype=acc, device=vv.device)
        for blk in plan_blocks(s, q_segs, layout.segments(src, kk.shape[2])):
            gq, gk, gv = _block_backward(
                s, blk, dout[:, :, blk.q0:blk.q1], q[:, :, blk.q0:blk.q1], kk[:, :, blk.k0:blk.k1],
                vv[:, :, blk.k0:blk.k1], out[:, :, blk.q0:blk.q1], lse[:, :, blk.q0:blk.q1], scale,
                _block_kv_lens(kv_lens, blk), softcap, force_kernel, _slice_seg(q_seg, blk.q0, blk.q1),
                _slice_seg(ks, blk.k0, blk.k1))
            dq[:, :, blk.q0:blk.q1] += gq
            dk[:, :, blk.k0:blk.k1] += gk
            dv[:, :, blk.k0:blk.k1] += gv
        if acc_shift is not None:  # the previous rank's accumulator for the shard computed here
            got = acc_shift.wait()
            dk += got[0]
            dv += got[1]
        dkv = [dk, dv]
        if kv_shift is not None:
            kv = kv_shift.wait()
    if layout.world > 1:  # the last shard computed here belongs to the next rank: hand its gradient on
        dkv = _Shift(layout, dkv, tag=3).wait()
    return (torch.empty_like(q).copy_(dq), torch.empty_like(k).copy_(dkv[0]), torch.empty_like(v).copy_(dkv[1]))
