"""`fa3::cpu_flash_forward`: aten's CPU flash kernel with the op's output conventions, the forward that
lowered CPU graphs call (fa_compile/lowering/cpu_flash.py says when and why).

Defined with the other `torch.ops.fa3` ops (ops.py imports this module), not with the lowering: Inductor's
cached code calls it in processes that have lowered nothing, and importing the lowering package would
load Inductor at `import fa_compile.ops`.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch
from torch import Tensor

from .kernels.reference import zero_past_kv_lens
from .ops import _LIB, _TAGS

_FWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
_BWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default


@functools.lru_cache(maxsize=None)
def native_gqa() -> bool:
    """aten's CPU flash kernel takes K and V with fewer heads than Q (query head h reading kv head h // G)
    in both directions, with dK, dV per kv head: asked of the kernel once, on tiny inputs, against K and V
    repeated per query head (torch 2.13 does; a torch whose kernel refuses or differs gets the repeat).
    It saves a copy of K and V per call and the backward's sum over each group."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing

    # asked on real tensors even where the first caller is being traced (a lowering's replacement)
    with unset_fake_temporarily(), disable_proxy_modes_tracing(), torch.no_grad():
        g = torch.Generator().manual_seed(0)
        q, do = torch.randn(1, 4, 5, 8, generator=g), torch.randn(1, 4, 5, 8, generator=g)
        k, v = torch.randn(1, 2, 5, 8, generator=g), torch.randn(1, 2, 5, 8, generator=g)
        try:
            out, lse = _FWD(q, k, v, 0.0, True, scale=0.5)
            dq, dk, dv = _BWD(do, q, k, v, out, lse, 0.0, True, scale=0.5)
        except Exception:  # noqa: BLE001 - any refusal means: repeat K and V
            return False
        kr, vr = _repeat_kv(k, 2), _repeat_kv(v, 2)
        out_r, lse_r = _FWD(q, kr, vr, 0.0, True, scale=0.5)
        dq_r, dk_r, dv_r = _BWD(do, q, kr, vr, out_r, lse_r, 0.0, True, scale=0.5)
        same = (out.shape == out_r.shape and dk.shape == k.shape and dv.shape == v.shape
                and torch.allclose(out, out_r) and torch.allclose(lse, lse_r) and torch.allclose(dq, dq_r)
                and torch.allclose(dk, dk_r.view(1, 2, 2, 5, 8).sum(2), atol=1e-5)
                and torch.allclose(dv, dv_r.view(1, 2, 2, 5, 8).sum(2), atol=1e-5))
    return bool(same)


def _repeat_kv(t: Tensor, groups: int) -> Tensor:
    """[B, Hkv, N, D] -> [B, Hkv * groups, N, D], head h reading kv head h // groups (the op's GQA)."""
    if groups == 1:
        return t
    b, h, n, d = t.shape
    return t.unsqueeze(2).expand(b, h, groups, n, d).reshape(b, h * groups, n, d)


def _nan_rows(q: Tensor, k: Tensor, mask: Optional[Tensor], causal: bool, groups: int) -> Tensor:
    """[B, Hq, Nq] bool: the rows the reference makes NaN that the kernel returned as out 0, lse 0.

    The kernel takes a row's max over finite scores only, so a row with none ends as if it were empty.
    A non-finite query element (NaN or +-inf) makes every score of its row NaN or infinite, and softmax
    over such a row NaN (inf - inf, or a row of -inf). With a finite query, a score is non-finite exactly
    when its key holds a non-finite element (q . k of finite vectors is taken not to overflow, as
    everywhere in the op), so a row whose admitted keys all hold one has no finite score either: those
    are the rows (mask and top-left `causal` decide what a row admits). The caller leaves structurally
    empty rows out (they stay the op's empty rows)."""
    from .lowering import conventions

    # x - x is NaN exactly where x is NaN or infinite (0 elsewhere), and y != y is isnan(y); each pass
    # reads contiguous rows.
    q0, k0 = q - q, k - k
    qbad = q0.ne(q0).any(-1)
    kgood = k0.eq(k0).all(-1)  # [B, Hkv, Nk]: every element finite
    if groups > 1:
        kgood = kgood.repeat_interleave(groups, dim=1)
    good = kgood.unsqueeze(2)  # [B, Hq, 1, Nk]
    if mask is not None:
        good = good & conventions.admitted(q, k, mask, causal)
    elif causal:
        nq, nk = q.shape[2], k.shape[2]
        good = good & (torch.arange(nk, device=q.device).view(1, nk) <= torch.arange(nq, device=q.device).view(nq, 1))
    dead = ~good.any(-1)  # [B, Hq, Nq] or [B, Hq, 1]
    return qbad | dead


def last_dim_dense(t: Tensor) -> Tensor:
    """t with a unit stride on its last dim: aten's CPU flash kernels read each row of D elements as
    contiguous whatever the strides say (SDPA itself sends other strides to its math path), so a K
    given transposed or a V expanded along D would be read wrongly. Decided at trace time where the
    strides are symbolic (a copy unless stride 1 is proven)."""
    stride, d = t.stride(-1), t.shape[-1]
    if isinstance(stride, int) and isinstance(d, int):  # real tensors (the op's calls): no symbolic test
        return t if stride == 1 or d <= 1 else t.contiguous()
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return t if statically_known_true(stride == 1) or statically_known_true(d <= 1) else t.contiguous()


def _all_finite(t: Tensor) -> bool:
    """No element of t is NaN or infinite, decided by one fp32 sum (NaN and +-inf propagate through
    a sum); a sum that overflows on finite elements answers False, which costs only the exact path."""
    return t.numel() == 0 or bool(torch.isfinite(t.sum(dtype=torch.float32)))


EMPTY_FILLS = ("zero", "nan", "mean_v")  # what a row that admits no key holds in out (empty_rows.py)

_LIB.define("cpu_flash_forward(Tensor q, Tensor k, Tensor v, Tensor? bias, Tensor? kv_lens, float scale, "
            "bool causal, int groups, str empty_fill) -> (Tensor, Tensor)", tags=_TAGS)


def corrected_forward(q: Tensor, k: Tensor, v: Tensor, bias: Optional[Tensor], kv_lens: Optional[Tensor],
                      scale: float, causal: bool, groups: int, empty_fill: str, checked: bool) -> tuple[Tensor, Tensor]:
    """(out, lse) of the op through aten's CPU flash kernel: out with the kernel's strides (q's dimension
    order), lse fp32; NaN rows as the reference gives them, rows that admit no key with lse -inf and
    `empty_fill` in out. `causal`: top-left, and only where it excludes something.

    checked: decide on the data first (real tensors: the op) and skip the corrections no input needs;
    otherwise every correction is computed (traced as graph ops into a lowered graph)."""
    if empty_fill not in EMPTY_FILLS:
        raise ValueError(f"empty_fill: expected one of {EMPTY_FILLS}, got {empty_fill!r}")
    from .lowering import conventions

    q, k, v = last_dim_dense(q), last_dim_dense(k), last_dim_dense(v)

    mask = conventions.additive_mask(q, k, bias, kv_lens)
    # keys and values past kv_lens are never read (a cache's unused slots may hold NaN); an empty row's
    # mean-of-V fill below still averages the given v, as the fix-up it stands for does
    kz, vz = zero_past_kv_lens(k, kv_lens), zero_past_kv_lens(v, kv_lens)
    finite = checked and _all_finite(q) and _all_finite(kz)
    kk, bad_rows = kz, None
    if not finite and (kv_lens is not None or (bias is not None and bias.dtype == torch.bool)):
        # masks the op applies by exclusion, which the kernel receives added: conventions.without_nan_keys
        kk, bad_rows = conventions.without_nan_keys(q, kz, mask, causal, groups)
    rep = 1 if native_gqa() else groups
    raw, lse = _FWD(q, _repeat_kv(kk, rep), _repeat_kv(vz, rep), 0.0, causal, attn_mask=mask, scale=scale)
    out, lse = raw, lse.to(torch.float32)
    empty = conventions.empty_rows(q, k, mask, kv_lens, causal, bias)
    if checked and empty is not None and not bool(empty.any()):
        empty = None
    if not finite:
        nan = _nan_rows(q, kz, mask, causal, groups)
        if bad_rows is not None:
            nan = nan | bad_rows
        if empty is not None:  # structurally empty rows stay empty rows
            nan = nan & ~empty
        out = out.masked_fill(nan.unsqueeze(-1), float("nan"))
        lse = lse.masked_fill(nan, float("nan"))
    if empty is not None:
        lse = lse.masked_fill(empty, conventions.NEG_INF)
        rows = empty.unsqueeze(-1)
        if empty_fill == "mean_v":  # emit's fill: mean over every key, query head h reading kv head h // G
            fill = v.mean(dim=2, keepdim=True)
            fill = fill.repeat_interleave(groups, dim=1) if groups > 1 else fill
            out = torch.where(rows, fill.to(out.dtype), out)
        else:
            out = out.masked_fill(rows, float("nan") if empty_fill == "nan" else 0.0)
    return conventions.with_strides(out, raw.stride()), lse


def cpu_flash_forward(q: Tensor, k: Tensor, v: Tensor, bias: Optional[Tensor], kv_lens: Optional[Tensor],
                      scale: float, causal: bool, groups: int, empty_fill: str) -> tuple[Tensor, Tensor]:
    """`corrected_forward`, checked; lse contiguous."""
    out, lse = corrected_forward(q, k, v, bias, kv_lens, scale, causal, groups, empty_fill, checked=True)
    return out, lse.contiguous()


def _cpu_flash_forward_fake(q, k, v, bias, kv_lens, scale, causal, groups, empty_fill):
    from .lowering import conventions

    mask = conventions.additive_mask(q, k, bias, kv_lens)
    rep = 1 if native_gqa() else groups
    q, k, v = last_dim_dense(q), last_dim_dense(k), last_dim_dense(v)
    out, lse = _FWD(q, _repeat_kv(k, rep), _repeat_kv(v, rep), 0.0, causal, attn_mask=mask, scale=scale)
    return out, lse.new_empty(lse.shape, dtype=torch.float32)


_LIB.impl("cpu_flash_forward", cpu_flash_forward, "CompositeExplicitAutograd")
torch.library.register_fake("fa3::cpu_flash_forward", _cpu_flash_forward_fake, lib=_LIB)
_CPU_FLASH_FORWARD = torch.ops.fa3.cpu_flash_forward.default


EMPTY_GRADS = ("none", "mean_v", "uniform")  # the empty-row fix-up's backward the op computes (empty_rows_backward.py)

_LIB.define("cpu_flash_backward(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor? mask, "
            "float scale, bool causal, int groups, str empty_grad, Tensor? k_all=None, Tensor? v_all=None) "
            "-> (Tensor, Tensor, Tensor)", tags=_TAGS)


def cpu_flash_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                       mask: Optional[Tensor], scale: float, causal: bool, groups: int,
                       empty_grad: str, k_all: Optional[Tensor] = None,
                       v_all: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of aten's CPU flash kernel (additive `mask`, top-left `causal`) together with the backward
    of emit's empty-row fix-up, `dout` being the gradient of the fix-up's output: rows with lse -inf (no
    admissible key) get no gradient through the kernel (their dout is zeroed, as the fix-up's `where`
    does); with empty_grad "mean_v" also the mean of V's gradient (those rows' dout / Nk on every key of
    dv, summed over the query heads of a group), with "uniform" also eager's q / k gradient at uniform
    weights (row_fixups._uniform_grads) over every key: `k_all` / `v_all` where k / v had the keys past the
    key lengths zeroed (eager's uniform row weighs those too). Whether any row is empty is decided once, on
    the lse; with none, dout goes to the kernel as it is and nothing else is computed. Gradients have the
    strides `torch.empty_like` gives q, k and v."""
    if empty_grad not in EMPTY_GRADS:
        raise ValueError(f"empty_grad: expected one of {EMPTY_GRADS}, got {empty_grad!r}")
    from .row_fixups import _laid_out_like, _uniform_grads

    empty = torch.isneginf(lse)
    rows = empty.unsqueeze(-1) if bool(empty.any()) else None
    d_attn, lse_b = dout, lse
    if rows is not None:  # an empty row's scores are all -inf: any finite lse gives P = 0 there
        d_attn = dout.masked_fill(rows, 0)
        lse_b = lse.masked_fill(empty, 0.0)
    rep = 1 if groups == 1 or native_gqa() else groups
    dq_nan = None
    if mask is not None and not _all_finite(k):  # as the forward ran (conventions.nan_keys_for_backward)
        from .lowering import conventions

        kd, dq_nan = conventions.nan_keys_for_backward(last_dim_dense(k))
    else:
        kd = last_dim_dense(k)
    vd = last_dim_dense(v)
    dq, dk, dv = _BWD(last_dim_dense(d_attn), last_dim_dense(q), _repeat_kv(kd, rep), _repeat_kv(vd, rep),
                      last_dim_dense(out), lse_b, 0.0, causal, attn_mask=mask, scale=scale)
    b, hkv, nk = k.shape[0], k.shape[1], k.shape[2]
    if rep > 1:  # dK, dV per query head: each kv head's is the sum over its group
        dk = dk.view(b, hkv, groups, nk, k.shape[3]).sum(dim=2)
        dv = dv.view(b, hkv, groups, nk, v.shape[3]).sum(dim=2)
    if rows is not None and empty_grad != "none":
        dg = dout.masked_fill(~rows, 0)
        # mean(v, dim=2)'s gradient: the empty rows' dout summed, over the group's query heads too, / Nk
        s = dg.sum(dim=2, keepdim=True)
        if groups > 1:
            s = s.view(b, hkv, groups, 1, v.shape[3]).sum(dim=2)
        dv = dv + s / nk
        if empty_grad == "uniform":
            acc = torch.promote_types(q.dtype, torch.float32)
            uq, uk = _uniform_grads(dg, q, k if k_all is None else k_all, v if v_all is None else v_all, scale, acc,
                                    True, True)
            dq, dk = dq + uq, dk + uk
    if dq_nan is not None:
        from .lowering import conventions

        dq = conventions.with_nan_columns(dq, dq_nan)
    return _laid_out_like(dq, q), _laid_out_like(dk, k), _laid_out_like(dv, v)


def _cpu_flash_backward_fake(dout, q, k, v, out, lse, mask, scale, causal, groups, empty_grad, k_all=None,
                             v_all=None):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


_LIB.impl("cpu_flash_backward", cpu_flash_backward, "CompositeExplicitAutograd")
torch.library.register_fake("fa3::cpu_flash_backward", _cpu_flash_backward_fake, lib=_LIB)
_CPU_FLASH_BACKWARD = torch.ops.fa3.cpu_flash_backward.default
