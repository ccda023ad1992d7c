"""`torch.ops.fa3.paged_attention` and `fa_compile.paged_attention`: attention of a few new query
tokens against a KV cache, contiguous or paged through a page table, read in place.

Schema (all tensors on one device):

    fa3::paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor cache_seqlens,
        Tensor? page_table=None, Tensor? cache_leftpad=None, *, float scale, bool causal=False,
        str layout="bshd", int num_splits=0, str? force_kernel=None) -> (Tensor out, Tensor lse)

- q [B, Nq, Hq, D]: the last Nq tokens of each sequence (decode: 1..16); float16 / bfloat16 /
  float32 / float64, any strides.
- k_cache, v_cache in q's dtype, head dims D and Dv, Hq % Hkv == 0 (GQA / MQA):
    page_table None: a contiguous cache per sequence, [B, Lmax, Hkv, D] ("bshd") or [B, Hkv, Lmax, D]
    ("bhsd", Hugging Face's StaticCache);
    page_table given: a pool of pages, (blocks, page, Hkv, D) ("bshd", vLLM / FA3) or
    (blocks, Hkv, page, D) ("bhsd"), any page size >= 1.
- page_table: int32 / int64 [B, max_pages]: position j of sequence b is slot j % page of block
  page_table[b, j // page]. Entries past a sequence's last page are never read (they may hold -1).
  Pages may be shared between sequences (prefix sharing) and appear in any order.
- cache_seqlens: int32 / int64 [B], the end (exclusive) of each sequence's valid keys, at most the
  capacity (max_pages * page, or Lmax); 0 is an empty sequence (out 0, lse -inf).
- cache_leftpad: int32 / int64 [B] or None: keys before it are not valid (left padding), so the
  valid keys are [cache_leftpad[b], cache_seqlens[b]) — FA3's convention. Slots outside that range are never
  read: they may hold anything, NaN included (a pool from torch.empty).
- causal: query i of sequence b sits at position cache_seqlens[b] - Nq + i and sees keys up to it
  (bottom-right alignment within the valid keys; rows left with no key give out 0, lse -inf).
- num_splits: split-KV parallelism of the kernels that have it; 0 lets the kernel choose.
- force_kernel: "triton", "fa3" or "reference" (None: the first that takes the inputs, in that order).
- Returns out [B, Nq, Hq, Dv] contiguous in q's dtype, lse [B, Hq, Nq] fp32 (natural log).

Argument errors name the argument. Values (lengths within the capacity, left padding within the
length, page-table entries of the pages in use within the pool) are checked for CPU tensors; on a GPU
checking them would cost a device sync per call, so they are not, and lengths are clamped to
[0, capacity] (table entries are trusted). The backward (q, k_cache, v_cache) recomputes the
reference under autograd: exact, not fast; decode needs no gradient.
"""
from __future__ import annotations

import functools
import math
import numbers
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch
from torch import Tensor

from . import ops  # (its context-parallel hook: a KV cache is not rung)
from .dispatch import renamed_force_error
from .kernels import decode as _decode
from .kernels.decode_reference import cache_view, paged_attention_reference

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_INT_DTYPES = (torch.int32, torch.int64)
LAYOUTS = ("bshd", "bhsd")
KERNELS = ("triton", "fa3", "reference")


# --------------------------------------------------------------------------------------------- checks
def _check_index(name: str, t: Optional[Tensor], shape: tuple, device: torch.device, what: str) -> None:
    if t is None:
        return
    if not isinstance(t, Tensor):
        raise TypeError(f"{name}: expected a Tensor or None, got {type(t).__name__}")
    if t.dim() != len(shape) or any(a != b_ for a, b_ in zip(t.shape, shape) if b_ is not None):
        raise ValueError(f"{name}: expected shape {what}, got {tuple(t.shape)}")
    if t.dtype not in _INT_DTYPES:
        raise ValueError(f"{name}: dtype must be int32 or int64, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name}: must be on q's device {device}, got {t.device}")


def check_args(q: Tensor, k_cache: Tensor, v_cache: Tensor, cache_seqlens: Tensor, page_table: Optional[Tensor],
               cache_leftpad: Optional[Tensor], scale: float, layout: str, num_splits: int,
               force_kernel: Optional[str]) -> None:
    """Metadata checks (fake tensors too); a TypeError / ValueError naming the argument."""
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("cache_seqlens", cache_seqlens)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name}: expected a Tensor, got {type(t).__name__}")
    if not isinstance(layout, str) or layout not in LAYOUTS:
        raise ValueError(f"layout: must be 'bshd' or 'bhsd', got {layout!r}")
    if q.dim() != 4:
        raise ValueError(f"q: expected 4 dims [batch, query tokens, heads, head_dim], got shape {tuple(q.shape)}")
    if q.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"q: dtype {q.dtype} is not a floating type (float16, bfloat16, float32, float64)")
    paged = page_table is not None
    dims = ("blocks, page, heads, head_dim" if layout == "bshd" else "blocks, heads, page, head_dim") if paged else \
        ("batch, max_len, heads, head_dim" if layout == "bshd" else "batch, heads, max_len, head_dim")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dim() != 4:
            raise ValueError(f"{name}: expected 4 dims [{dims}] (layout {layout!r}), got shape {tuple(t.shape)}")
        if t.dtype != q.dtype:
            raise ValueError(f"{name}: dtype {t.dtype} must match q's ({q.dtype})")
        if t.device != q.device:
            raise ValueError(f"{name}: must be on q's device {q.device}, got {t.device}")
    kc, vc = cache_view(k_cache, layout), cache_view(v_cache, layout)
    b, _nq, hq, d = q.shape
    if tuple(vc.shape[:3]) != tuple(kc.shape[:3]):
        raise ValueError(f"v_cache: shape {tuple(v_cache.shape)} does not match k_cache's {tuple(k_cache.shape)} "
                         "except in the head dim")
    if kc.shape[3] != d:
        raise ValueError(f"k_cache: head dim {kc.shape[3]} differs from q's {d}")
    hkv = kc.shape[2]
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(f"k_cache: q's {hq} heads are not a multiple of the cache's {hkv} (GQA needs Hq % Hkv == 0)")
    if paged:
        _check_index("page_table", page_table, (b, None), q.device, f"[batch, max_pages] = [{b}, max_pages]")
        if kc.shape[1] == 0:
            raise ValueError(f"k_cache: page size 0 (shape {tuple(k_cache.shape)}, layout {layout!r})")
    elif kc.shape[0] != b:
        raise ValueError(f"k_cache: {kc.shape[0]} cache rows but q has batch {b} (without page_table the cache "
                         f"is [{dims}]; a pool of pages needs page_table)")
    _check_index("cache_seqlens", cache_seqlens, (b,), q.device, f"[batch] = [{b}]")
    _check_index("cache_leftpad", cache_leftpad, (b,), q.device, f"[batch] = [{b}]")
    check_scalars(scale, num_splits)
    if force_kernel is not None and force_kernel not in KERNELS:
        raise ValueError(f"force_kernel: unknown kernel {force_kernel!r}; known: {', '.join(KERNELS)}")


_INT32_MAX = 2**31 - 1


def finite_number(x: Any) -> bool:
    """math.isfinite, also for an int too large for a float (False there, where math.isfinite raises)."""
    try:
        return math.isfinite(x)
    except OverflowError:
        return False


def short_repr(x: Any, width: int = 40) -> str:
    """repr(x), its middle elided past `width` characters (an int of 400 digits in an error message)."""
    r = repr(x)
    return r if len(r) <= width else f"{r[:width // 2]}...{r[-8:]} ({len(r)} characters)"


def check_scalars(scale: float, num_splits: int) -> None:
    if not isinstance(scale, (int, float)) or isinstance(scale, bool) or not finite_number(scale):
        raise ValueError(f"scale: must be a finite number, got {short_repr(scale)}")
    if not isinstance(num_splits, int) or isinstance(num_splits, bool) or not 0 <= num_splits <= _INT32_MAX:
        raise ValueError(f"num_splits: must be an int in [0, {_INT32_MAX}] (0: chosen by the kernel), "
                         f"got {short_repr(num_splits)}")


def capacity(k_cache: Tensor, page_table: Optional[Tensor], layout: str) -> int:
    """Key positions each sequence can address: max_pages * page, or Lmax."""
    kc = cache_view(k_cache, layout)
    return page_table.shape[1] * kc.shape[1] if page_table is not None else kc.shape[1]


def check_values(k_cache: Tensor, cache_seqlens: Tensor, page_table: Optional[Tensor],
                 cache_leftpad: Optional[Tensor], layout: str) -> None:
    """Value checks: lengths in [0, capacity], left padding in [0, length], the table entries of every
    page a sequence uses within the pool. Reads the tensors (a device sync on a GPU)."""
    cap = capacity(k_cache, page_table, layout)
    lens = cache_seqlens.to(torch.int64)
    if lens.numel() and (int(lens.min()) < 0 or int(lens.max()) > cap):
        raise ValueError(f"cache_seqlens: values must lie in [0, {cap}] (the cache's capacity), got "
                         f"min {int(lens.min())}, max {int(lens.max())}")
    if cache_leftpad is not None and cache_leftpad.numel():
        pad = cache_leftpad.to(torch.int64)
        if int(pad.min()) < 0 or bool((pad > lens).any()):
            raise ValueError("cache_leftpad: values must lie in [0, cache_seqlens[b]]")
    if page_table is not None and page_table.numel():
        kc = cache_view(k_cache, layout)
        page, nblocks = kc.shape[1], kc.shape[0]
        start = cache_leftpad.to(torch.int64) if cache_leftpad is not None else torch.zeros_like(lens)
        j = torch.arange(page_table.shape[1], device=page_table.device).view(1, -1)
        used = (j < (lens.view(-1, 1) + page - 1) // page) & (j >= start.view(-1, 1) // page)
        bad = used & ((page_table < 0) | (page_table >= nblocks))
        if bool(bad.any()):
            bb, pp = (int(x) for x in bad.nonzero()[0])
            raise ValueError(f"page_table: entry [{bb}, {pp}] = {int(page_table[bb, pp])} is outside the pool of "
                             f"{nblocks} blocks (k_cache has shape {tuple(k_cache.shape)}, layout {layout!r})")


# ----------------------------------------------------------------------------------------- candidates
@dataclass
class PagedArgs:
    q: Tensor
    k_cache: Tensor
    v_cache: Tensor
    cache_seqlens: Tensor
    page_table: Optional[Tensor]
    cache_leftpad: Optional[Tensor]
    scale: float
    causal: bool
    layout: str
    num_splits: int


class _TritonDecode:
    name = "triton"

    def not_supported_reasons(self, a: PagedArgs) -> list[str]:
        r = _decode.not_supported_reasons(a.q, cache_view(a.k_cache, a.layout), cache_view(a.v_cache, a.layout),
                                          a.page_table)
        if a.q.device.type == "cpu" and a.q.dtype == torch.bfloat16:
            r.append("bfloat16 under the Triton interpreter (its bf16 dot is unreliable)")
        if a.q.shape[3] == 0 or a.v_cache.shape[3] == 0:
            r.append("head dim 0")
        return r

    def forward(self, a: PagedArgs) -> tuple[Tensor, Tensor]:
        return _decode.paged_decode(a.q, a.k_cache, a.v_cache, a.cache_seqlens, a.page_table, a.cache_leftpad,
                                    scale=a.scale, causal=a.causal, layout=a.layout, num_splits=a.num_splits)


@functools.lru_cache(maxsize=None)
def _fa3_plan() -> tuple[Optional[tuple[Any, tuple, dict]], str]:
    """(op, argument template, name -> position) of FA3's C++ forward `torch.ops.flash_attn_3.fwd`,
    the call under `flash_attn_with_kvcache`, or (None, why not)."""
    try:
        import flash_attn_interface  # noqa: F401, PLC0415  (registers torch.ops.flash_attn_3)

        op = torch.ops.flash_attn_3.fwd.default
        schema = op._schema.arguments
    except Exception as e:  # ImportError, or a binary built for another torch
        return None, f"FA3 is not importable ({type(e).__name__}: {str(e)[:120]})"
    ours = {"q", "k", "v", "seqused_k", "page_table", "leftpad_k", "softmax_scale", "num_splits"}
    template, index = [], {}
    for i, arg in enumerate(schema):
        index[arg.name] = i
        if arg.has_default_value():
            template.append(arg.default_value)
        elif isinstance(arg.type, torch.OptionalType) or arg.name in ours or arg.name in ("causal", "is_causal"):
            template.append(None)
        else:
            return None, f"FA3's forward schema has a required argument {arg.name!r} this adapter does not fill"
    index["causal"] = index.get("is_causal", index.get("causal", -1))
    missing = sorted(n for n in (*ours, "causal") if index.get(n, -1) < 0)
    if missing or any(arg.kwarg_only for arg in schema):
        return None, f"FA3's forward schema lacks {missing or 'positional arguments'}"
    return (op, tuple(template), index), ""


class _FA3Decode:
    """FA3's `flash_attn_with_kvcache` conventions through its C++ op: k_cache (blocks, page, Hkv, D)
    with page_table, or [B, Lmax, Hkv, D] without; seqused_k = cache_seqlens; leftpad_k = cache_leftpad."""

    name = "fa3"

    def not_supported_reasons(self, a: PagedArgs) -> list[str]:
        plan, why = _fa3_plan()
        if plan is None:
            return [why]
        r: list[str] = []
        dev = a.q.device
        if dev.type != "cuda":
            return [f"FA3 runs on CUDA only, inputs are on {dev.type}"]
        if torch.cuda.get_device_capability(dev)[0] != 9:
            r.append(f"FA3 needs sm90, device is sm{''.join(map(str, torch.cuda.get_device_capability(dev)))}")
        if a.q.dtype not in (torch.float16, torch.bfloat16):
            r.append(f"FA3 takes float16 / bfloat16, got {a.q.dtype}")
        d, dv = a.q.shape[3], a.v_cache.shape[3]
        if d != dv or d % 8 or not 0 < d <= 256:
            r.append(f"FA3 needs equal QK / V head dims, multiples of 8 up to 256; got {d} / {dv}")
        kc, vc = cache_view(a.k_cache, a.layout), cache_view(a.v_cache, a.layout)
        if kc.stride(-1) != 1 or vc.stride(-1) != 1:
            r.append("FA3 needs caches with a contiguous head dim")
        if a.page_table is not None:
            if a.layout != "bshd" or not (kc.is_contiguous() and vc.is_contiguous()):
                r.append("FA3 reads pages (blocks, page, Hkv, D) stored contiguously (layout 'bshd')")
            if a.cache_leftpad is not None:
                r.append("FA3: left padding together with a page table is not supported")
        return r

    def forward(self, a: PagedArgs) -> tuple[Tensor, Tensor]:
        (op, template, index), _ = _fa3_plan()
        kc, vc = cache_view(a.k_cache, a.layout), cache_view(a.v_cache, a.layout)
        cap = capacity(a.k_cache, a.page_table, a.layout)
        args = list(template)
        vals = dict(q=a.q if a.q.stride(-1) == 1 else a.q.contiguous(), k=kc, v=vc,
                    seqused_k=a.cache_seqlens.clamp(0, cap).to(torch.int32),
                    page_table=None if a.page_table is None else a.page_table.to(torch.int32).contiguous(),
                    leftpad_k=None if a.cache_leftpad is None else a.cache_leftpad.to(torch.int32).contiguous(),
                    softmax_scale=float(a.scale), causal=bool(a.causal), num_splits=int(a.num_splits))
        for name, value in vals.items():
            args[index[name]] = value
        res = op(*args)
        out, lse = res[0], res[1].to(torch.float32)
        # Empty rows (an empty sequence, or fewer valid keys than causal rows need): the op's convention.
        empty = torch.isinf(lse)
        lse = lse.masked_fill(empty, float("-inf"))
        out = out.masked_fill(empty.transpose(1, 2).unsqueeze(-1), 0)
        return out, lse


class _Reference:
    name = "reference"

    def not_supported_reasons(self, a: PagedArgs) -> list[str]:
        return []

    def forward(self, a: PagedArgs) -> tuple[Tensor, Tensor]:
        return paged_attention_reference(a.q, a.k_cache, a.v_cache, a.cache_seqlens, a.page_table, a.cache_leftpad,
                                         scale=a.scale, causal=a.causal, layout=a.layout)


CANDIDATES = (_TritonDecode(), _FA3Decode(), _Reference())


_CHOICE: dict = {}


def _choice_key(a: PagedArgs, force_kernel: Optional[str]) -> tuple:
    """Everything the candidates' reasons read: metadata and the process settings they consult."""
    meta = tuple((None if t is None else (type(t), t.device, t.dtype, tuple(t.shape), t.stride()))
                 for t in (a.q, a.k_cache, a.v_cache, a.cache_seqlens, a.page_table, a.cache_leftpad))
    return (a.layout, force_kernel, meta, _decode.interpreting(), torch.get_float32_matmul_precision())


def choose(a: PagedArgs, force_kernel: Optional[str] = None):
    """The candidate that runs these inputs (memoised on their metadata): the forced one (an error
    with its reasons if it cannot), else the first in CANDIDATES that can. Empty problems go to the
    reference."""
    key = _choice_key(a, force_kernel)
    cand = _CHOICE.get(key)
    if cand is None:
        # A memo hit means equal metadata passed these checks before.
        check_args(a.q, a.k_cache, a.v_cache, a.cache_seqlens, a.page_table, a.cache_leftpad, a.scale, a.layout,
                   a.num_splits, force_kernel)
        cand = _choose(a, force_kernel)
        if len(_CHOICE) > 4096:
            _CHOICE.clear()
        _CHOICE[key] = cand
    return cand


def _choose(a: PagedArgs, force_kernel: Optional[str]):
    if force_kernel is not None:
        cand = next(c for c in CANDIDATES if c.name == force_kernel)
        why = cand.not_supported_reasons(a)
        if why:
            raise ValueError(f"force_kernel: {force_kernel!r} cannot take these inputs: {'; '.join(why)}")
        return cand
    if a.q.numel() == 0:
        return CANDIDATES[-1]
    return next(c for c in CANDIDATES if not c.not_supported_reasons(a))


def explain_choice(a: PagedArgs) -> list[tuple[str, list[str]]]:
    """(kernel, reasons it cannot run) for every candidate, in priority order."""
    return [(c.name, c.not_supported_reasons(a)) for c in CANDIDATES]


# -------------------------------------------------------------------------------------------- the op
_LIB = torch.library.Library("fa3", "FRAGMENT")
_LIB.define(
    "paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor cache_seqlens, Tensor? page_table=None, "
    "Tensor? cache_leftpad=None, *, float scale, bool causal=False, str layout=\"bshd\", int num_splits=0, "
    "str? force_kernel=None) -> (Tensor, Tensor)",
    tags=(torch.Tag.pt2_compliant_tag,),
)


def _paged_impl(q, k_cache, v_cache, cache_seqlens, page_table=None, cache_leftpad=None, *, scale, causal=False,
                layout="bshd", num_splits=0, force_kernel=None):
    check_scalars(scale, num_splits)
    if ops._CP_HOOK is not None:  # a KV cache is not a sequence shard: attending to it alone would be wrong
        raise RuntimeError("fa3.paged_attention: not supported under fa_compile.context_parallel")
    a = PagedArgs(q, k_cache, v_cache, cache_seqlens, page_table, cache_leftpad, float(scale), bool(causal), layout,
                  int(num_splits))
    cand = choose(a, force_kernel)  # checks the tensors' metadata (memoised)
    if q.device.type == "cpu":
        check_values(k_cache, cache_seqlens, page_table, cache_leftpad, layout)
    out, lse = cand.forward(a)
    if out.dtype != q.dtype or not out.is_contiguous():
        out = out.to(q.dtype).contiguous()
    if lse.dtype != torch.float32 or not lse.is_contiguous():
        lse = lse.to(torch.float32).contiguous()
    return out, lse


def _paged_fake(q, k_cache, v_cache, cache_seqlens, page_table=None, cache_leftpad=None, *, scale, causal=False,
                layout="bshd", num_splits=0, force_kernel=None):
    check_args(q, k_cache, v_cache, cache_seqlens, page_table, cache_leftpad, scale, layout, num_splits, force_kernel)
    b, nq, hq, _ = q.shape
    dv = cache_view(v_cache, layout).shape[3]
    return q.new_empty((b, nq, hq, dv)), q.new_empty((b, hq, nq), dtype=torch.float32)


_LIB.impl("paged_attention", _paged_impl, "CompositeExplicitAutograd")
torch.library.register_fake("fa3::paged_attention", _paged_fake, lib=_LIB)
_PAGED = torch.ops.fa3.paged_attention.default


class _PagedFunction(torch.autograd.Function):
    """Forward: the chosen kernel. Backward: the reference recomputed under autograd (gradients of q and
    of the caches; a page shared by several sequences gets the sum)."""

    @staticmethod
    def forward(ctx, q, k_cache, v_cache, cache_seqlens, page_table, cache_leftpad, scale, causal, layout, num_splits,
                force_kernel):
        with torch._C._AutoDispatchBelowAutograd():
            out, lse = _PAGED(q, k_cache, v_cache, cache_seqlens, page_table, cache_leftpad, scale=scale, causal=causal,
                              layout=layout, num_splits=num_splits, force_kernel=force_kernel)
        ctx.save_for_backward(q, k_cache, v_cache, cache_seqlens, page_table, cache_leftpad)
        ctx.scalars = (scale, causal, layout)
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k_cache, v_cache, cache_seqlens, page_table, cache_leftpad = ctx.saved_tensors
        scale, causal, layout = ctx.scalars
        want = [t.detach().requires_grad_(need) for t, need in zip((q, k_cache, v_cache), ctx.needs_input_grad[:3])]
        with torch.enable_grad():
            out, lse = paged_attention_reference(*want, cache_seqlens, page_table, cache_leftpad, scale=scale,
                                                 causal=causal, layout=layout)
            outs, grads = [], []
            for o, g in ((out, dout), (lse, dlse)):
                if g is not None:
                    outs.append(o)
                    grads.append(g)
            inputs = [t for t in want if t.requires_grad]
            # no incoming gradient at all (set_materialize_grads(False)): every input's is zero
            got = list(torch.autograd.grad(outs, inputs, grads, allow_unused=True)) if outs and inputs else \
                [None] * len(inputs)
        res = []
        for t in want:
            g = got.pop(0) if t.requires_grad else None
            res.append(torch.zeros_like(t) if (g is None and t.requires_grad) else g)
        return (*res, None, None, None, None, None, None, None, None)


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _runs_directly(tensors) -> bool:
    """Real eager tensors, no dispatch mode or functorch transform: call the kernel without a second
    trip through the dispatcher (host time per decode step)."""
    if torch._C._len_torch_dispatch_stack() or torch._C._functorch.peek_interpreter_stack() is not None:
        return False
    return all(t is None or (type(t) in _PLAIN and not t.is_meta) for t in tensors)


def _paged_autograd(q, k_cache, v_cache, cache_seqlens, page_table=None, cache_leftpad=None, *, scale, causal=False,
                    layout="bshd", num_splits=0, force_kernel=None):
    if torch.is_grad_enabled() and (q.requires_grad or k_cache.requires_grad or v_cache.requires_grad):
        return _PagedFunction.apply(q, k_cache, v_cache, cache_seqlens, page_table, cache_leftpad, scale, causal,
                                    layout, num_splits, force_kernel)
    kw = dict(scale=scale, causal=causal, layout=layout, num_splits=num_splits, force_kernel=force_kernel)
    if _runs_directly((q, k_cache, v_cache, cache_seqlens, page_table, cache_leftpad)):
        return _paged_impl(q, k_cache, v_cache, cache_seqlens, page_table, cache_leftpad, **kw)
    with torch._C._AutoDispatchBelowAutograd():
        return _PAGED(q, k_cache, v_cache, cache_seqlens, page_table, cache_leftpad, **kw)


_LIB.impl("paged_attention", _paged_autograd, "Autograd")


# ------------------------------------------------------------------------------------- Python wrapper
def _check_wrapper_types(**args: Any) -> None:
    """TypeErrors naming the argument for what the op's schema would reject with a RuntimeError (or, for a
    tensor scale, take as a float and drop its gradient)."""
    for name in ("q", "k_cache", "v_cache"):
        if not isinstance(args[name], Tensor):
            raise TypeError(f"{name}: expected a Tensor, got {type(args[name]).__name__}")
    for name in ("page_table", "cache_leftpad"):
        if args[name] is not None and not isinstance(args[name], Tensor):
            raise TypeError(f"{name}: expected a Tensor or None, got {type(args[name]).__name__}")
    scale = args["softmax_scale"]
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, numbers.Real)):
        raise TypeError(f"softmax_scale: expected a Python number or None, got {type(scale).__name__} (a tensor "
                        "scale would be read as a constant, without its gradient)")
    for name in ("causal", "return_softmax_lse"):
        if not isinstance(args[name], bool):
            raise TypeError(f"{name}: expected a bool, got {type(args[name]).__name__}")
    if isinstance(args["num_splits"], bool) or not isinstance(args["num_splits"], int):
        raise TypeError(f"num_splits: expected an int, got {type(args['num_splits']).__name__}")
    if not isinstance(args["layout"], str):
        raise TypeError(f"layout: expected 'bshd' or 'bhsd', got {type(args['layout']).__name__}")
    if args["kernel"] is not None and not isinstance(args["kernel"], str):
        raise TypeError(f"kernel: expected a kernel name or None, got {type(args['kernel']).__name__}")
    # the op's own checks name its arguments (scale, force_kernel): these two are named as the caller wrote them
    if scale is not None and not finite_number(scale):
        raise ValueError(f"softmax_scale: must be a finite number, got {short_repr(scale)}")
    if not 0 <= args["num_splits"] <= _INT32_MAX:
        raise ValueError(f"num_splits: must be in [0, {_INT32_MAX}] (0: chosen by the kernel), "
                         f"got {short_repr(args['num_splits'])}")
    if args["kernel"] is not None and args["kernel"] not in KERNELS:
        raise ValueError(f"kernel: unknown kernel {args['kernel']!r}; known: {', '.join(KERNELS)}")


def paged_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    cache_seqlens: Union[int, Tensor],
    page_table: Optional[Tensor] = None,
    cache_leftpad: Optional[Tensor] = None,
    *,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    layout: str = "bshd",
    num_splits: int = 0,
    return_softmax_lse: bool = False,
    kernel: Optional[str] = None,
):
    """Attention of q against a KV cache read in place: `torch.ops.fa3.paged_attention` (see this
    module's docstring for the full semantics), with FA3's `flash_attn_with_kvcache` conventions.

    Arguments and their `flash_attn_with_kvcache` counterparts:
        q                  q: [B, Nq, Hq, D], the newest Nq tokens of each sequence.
        k_cache, v_cache   k_cache, v_cache: [B, Lmax, Hkv, D] without a page table, (blocks, page, Hkv, D)
                           with one; layout="bhsd" also takes [B, Hkv, Lmax, D] / (blocks, Hkv, page, D),
                           which FA3 does not.
        cache_seqlens      cache_seqlens: an int or int32 / int64 [B], the end of each sequence's keys
                           (FA3 takes int32 only).
        page_table         page_table (FA2: block_table): int32 / int64 [B, max_pages].
        cache_leftpad      cache_leftpad: [B], the first valid key of each sequence.
        softmax_scale      softmax_scale: default 1 / sqrt(D).
        causal             causal: bottom-right aligned, as FA3.
        num_splits         num_splits: 0 lets the kernel choose.
        return_softmax_lse return_softmax_lse: also return lse [B, Hq, Nq] fp32.
        kernel             (ours) "triton", "fa3" or "reference"; None chooses.
    Not taken (compute them before the call): k / v (append new tokens: write them into the cache
    first), rotary_cos / rotary_sin, cache_batch_idx, window_size, softcap, FP8 descales.
    Returns out [B, Nq, Hq, Dv] in q's dtype (and lse). Bad arguments raise a TypeError or ValueError
    naming the argument. On a GPU the values of cache_seqlens / cache_leftpad / page_table are not
    checked per call (a device sync); `fa_compile.paged.check_values(...)` checks them once.
    """
    _check_wrapper_types(q=q, k_cache=k_cache, v_cache=v_cache, page_table=page_table, cache_leftpad=cache_leftpad,
                         softmax_scale=softmax_scale, causal=causal, layout=layout, num_splits=num_splits,
                         return_softmax_lse=return_softmax_lse, kernel=kernel)
    if isinstance(cache_seqlens, bool) or not isinstance(cache_seqlens, (int, Tensor)):
        raise TypeError(f"cache_seqlens: expected an int or a Tensor, got {type(cache_seqlens).__name__}")
    if q.dim() != 4:
        raise ValueError(f"q: expected [B, Nq, Hq, D] (4 dims), got {q.dim()} dims {tuple(q.shape)}")
    if isinstance(cache_seqlens, int):
        if not 0 <= cache_seqlens <= _INT32_MAX:
            raise ValueError(f"cache_seqlens: an int must be in [0, {_INT32_MAX}], got {short_repr(cache_seqlens)}")
        cache_seqlens = torch.full((q.shape[0],), cache_seqlens, dtype=torch.int32, device=q.device)
    if softmax_scale is None:
        if q.shape[-1] == 0:
            raise ValueError("softmax_scale: the default 1 / sqrt(head_dim) needs q's head dim D > 0; "
                             "pass softmax_scale= explicitly")
        softmax_scale = 1.0 / math.sqrt(q.shape[-1])
    try:
        out, lse = torch.ops.fa3.paged_attention(
            q, k_cache, v_cache, cache_seqlens, page_table, cache_leftpad, scale=float(softmax_scale), causal=causal,
            layout=layout, num_splits=num_splits, force_kernel=kernel,
        )
    except ValueError as e:  # the op names its force_kernel: name ours
        renamed = renamed_force_error(e, "kernel") if kernel is not None else None
        if renamed is None:
            raise
        raise renamed from None
    return (out, lse) if return_softmax_lse else out
