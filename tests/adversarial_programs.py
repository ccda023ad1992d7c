"""Hand-written attention programs for differential fuzzing, each composed from independent axes.

A `Program` names one choice per axis: the spelling of Q·Kᵀ, of the scale, of the softmax and of P·V;
the mask (kind, how it is applied, its fill value); a write into a caller tensor; a grad-mode or
autocast region; GQA; dropout 0; dtype; a shape whose dimensions may be 0; and the input values
(plain, logits large enough to cross a finite fill, a NaN or inf in one key, value or query, fp16
products that overflow). `build(prog)` returns the function `(q, k, v, key_keep, amask, buf, sbuf,
x) -> out`; `make_inputs(prog, seed)` its inputs; `keep_matrix` the keys each query row may attend to.
`programs()` is the hypothesis strategy that draws them.
"""
from __future__ import annotations

import dataclasses
from contextlib import nullcontext
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from conftest import TOL
from fused_helpers import assert_same, tolerances

QKS = ["matmul", "at", "einsum", "bmm", "baddbmm"]
SCALES = ["mul", "div", "q_folded"]
SOFTMAXES = ["Tensor.softmax", "F.softmax", "softmax_f32", "exp_sum"]
PVS = ["matmul", "at", "einsum", "bmm"]
MASKS = ["none", "causal", "padding", "window"]
MASK_FORMS = ["masked_fill", "masked_fill_", "where", "additive", "additive_bert", "additive_input"]
FILLS = ["-inf", "finfo.min", "-1e4", "-1e9", "-10000.0"]
WRITES = ["none", "out_kw", "copy_", "add_", "slice_assign", "scores_copy"]
# Writes the pass must see through aliases: into k after the site (through a view, `.data`, `out=`, an op that may
# return its input itself), into the bool mask through a view of it before the site, or into the returned output by
# the caller after the call and before the backward.
LATE = ["none", "k_view_after", "k_data_after", "k_out_after", "k_dropout_alias_after", "mask_view_before",
        "out_after_call"]
GRADS = ["qkv", "v"]  # which of q, k, v require grad: with only v, the op may save q and k where eager saves P
GRAD_MODES = ["none", "scores_no_grad", "scores_set_grad_false", "probs_no_grad", "enable_grad_in_no_grad",
              "body_no_grad", "call_no_grad", "call_inference_mode", "autocast", "scores_autocast"]
GQAS = ["none", "repeat_interleave", "repeat_kv"]
DROPOUTS = ["none", "p0", "p0_eval"]
VALUES = ["plain", "crossing", "nan_key", "nan_value", "inf_value", "inf_q", "fp16_overflow"]
INNERS = ["aot_eager"] * 19 + ["inductor"]  # Inductor adds ~10 s a compile on CPU
POISONS = ("nan_key", "nan_value", "inf_value", "inf_q")
WINDOW = 2  # keys j with i - WINDOW < j <= i


@dataclasses.dataclass(frozen=True)
class Program:
    qk: str = "at"
    scale: str = "mul"
    softmax: str = "Tensor.softmax"
    pv: str = "at"
    mask: str = "none"
    mask_form: str = "masked_fill"
    fill: str = "-inf"
    write: str = "none"
    late: str = "none"
    grads: str = "qkv"
    grad_mode: str = "none"
    gqa: str = "none"
    dropout: str = "none"
    dtype: torch.dtype = torch.float32
    shape: tuple = (2, 2, 5, 6, 8)  # B, H, Nq, Nk, D
    values: str = "plain"
    scale_value: float = 0.5
    inner: str = "aot_eager"

    @property
    def groups(self) -> int:
        return 1 if self.gqa == "none" else 2

    @property
    def kv_heads(self) -> int:
        return self.shape[1] // self.groups

    @property
    def requires_grad(self) -> tuple:
        """Whether q, k, v require grad. out= refuses autograd in eager ("out=... arguments don't support automatic
        differentiation")."""
        if self.write == "out_kw":
            return (False, False, False)
        return (True, True, True) if self.grads == "qkv" else (False, False, True)

    @property
    def compute_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.grad_mode in ("autocast", "scores_autocast") else self.dtype


def repeat_kv(x: torch.Tensor, how: str, g: int) -> torch.Tensor:
    """GQA: each of the `x.shape[1]` key/value heads serves `g` query heads, as models spell it."""
    if how == "repeat_kv":
        b, h, n, d = x.shape
        return x[:, :, None].expand(b, h, g, n, d).reshape(b, h * g, n, d)
    if how == "repeat_interleave":
        return x.repeat_interleave(g, dim=1)
    return x  # none / mqa_broadcast: the matmul broadcasts


def keep_matrix(prog: Program, nq: int, nk: int, key_keep: torch.Tensor) -> torch.Tensor:
    """[B, Nq, Nk] bool: the keys each query row may attend to (True = kept)."""
    i = torch.arange(nq)[:, None]
    j = torch.arange(nk)[None, :]
    if prog.mask == "causal":
        keep = j <= i
    elif prog.mask == "window":
        keep = (j <= i) & (j > i - WINDOW)
    else:
        keep = torch.ones(nq, nk, dtype=torch.bool)
    keep = keep[None].expand(key_keep.shape[0], nq, nk)
    if prog.mask == "padding":
        keep = keep & key_keep[:, None, :]
    return keep


def _fill(prog: Program, dtype: torch.dtype) -> float:
    if prog.fill == "-inf":
        return float("-inf")
    if prog.fill == "finfo.min":
        return torch.finfo(dtype).min
    return {"-1e4": -1e4, "-1e9": -1e9, "-10000.0": -10000.0}[prog.fill]


def build(prog: Program) -> Callable:
    """The program as a plain function of (q, k, v, key_keep, amask, buf, sbuf, x)."""
    c = prog.scale_value
    g = prog.groups

    def scores(q, k):
        b, h, nq, d = q.shape
        nk = k.shape[2]
        if prog.scale == "q_folded":
            q = q * c
        alpha = c if prog.qk == "baddbmm" and prog.scale == "mul" else 1.0
        if prog.qk == "matmul":
            s = torch.matmul(q, k.transpose(-2, -1))
        elif prog.qk == "at":
            s = q @ k.mT
        elif prog.qk == "einsum":
            s = torch.einsum("bhqd,bhkd->bhqk", q, k)
        elif prog.qk == "bmm":
            s = torch.bmm(q.reshape(b * h, nq, d), k.reshape(b * h, nk, d).transpose(1, 2)).view(b, h, nq, nk)
        else:  # GPT-2's upcast path: an uninitialized input that beta=0 ignores, the scale as alpha
            empty = torch.empty(b * h, nq, nk, dtype=q.dtype, device=q.device)
            s = torch.baddbmm(empty, q.reshape(b * h, nq, d), k.reshape(b * h, nk, d).transpose(1, 2),
                              beta=0.0, alpha=alpha).view(b, h, nq, nk)
        if prog.scale == "mul" and prog.qk != "baddbmm":
            s = s * c
        elif prog.scale == "div":
            s = s / (1.0 / c)
        return s

    def keep_of(nq, nk, device, key_keep):
        if prog.mask == "causal":
            keep = torch.ones(nq, nk, dtype=torch.bool, device=device).tril()
        elif prog.mask == "window":
            i = torch.arange(nq, device=device)[:, None]
            j = torch.arange(nk, device=device)[None, :]
            keep = (j <= i) & (j > i - WINDOW)
        else:
            keep = key_keep[:, None, None, :]
        if prog.late == "mask_view_before" and keep.numel() > 1:
            keep.view(-1)[1] = ~keep.view(-1)[1]  # one element flipped through a view: no longer the mask first built
        return keep

    def masked(s, key_keep, amask, keep=None):
        if prog.mask == "none":
            return s
        if prog.mask_form == "additive_input":
            return s + amask
        keep = keep_of(s.shape[-2], s.shape[-1], s.device, key_keep) if keep is None else keep
        fill = _fill(prog, s.dtype)
        if prog.mask_form == "masked_fill":
            return s.masked_fill(~keep, fill)
        if prog.mask_form == "masked_fill_":
            return s.masked_fill_(~keep, fill)
        if prog.mask_form == "where":
            return torch.where(keep, s, fill)
        if prog.mask_form == "additive":
            return s + torch.zeros(keep.shape, dtype=s.dtype, device=s.device).masked_fill(~keep, fill)
        return s + (1.0 - keep.to(s.dtype)) * fill  # additive_bert (finite fills only)

    def softmax(s):
        if prog.softmax == "Tensor.softmax":
            return s.softmax(-1)
        if prog.softmax == "F.softmax":
            return F.softmax(s, dim=-1)
        if prog.softmax == "softmax_f32":
            # an upcast to fp32 at least: the fp64 program keeps fp64 (its finfo.min fill is -inf in fp32)
            return torch.softmax(s, -1, dtype=torch.promote_types(s.dtype, torch.float32)).to(s.dtype)
        e = torch.exp(s - s.amax(-1, keepdim=True))
        return e / e.sum(-1, keepdim=True)

    def dropout(p):
        if prog.dropout == "p0":
            return F.dropout(p, 0.0)
        if prog.dropout == "p0_eval":
            return F.dropout(p, p=0.0, training=False)
        return p

    def pv(p, v, buf):
        if prog.write == "out_kw":
            return torch.matmul(p, v, out=buf)
        if prog.pv == "matmul":
            return torch.matmul(p, v)
        if prog.pv == "at":
            return p @ v
        if prog.pv == "einsum":
            return torch.einsum("bhqk,bhkd->bhqd", p, v)
        b, h, nq, nk = p.shape
        d = v.shape[-1]
        return torch.bmm(p.reshape(b * h, nq, nk), v.reshape(b * h, nk, d)).view(b, h, nq, d)

    def probs(q, k, key_keep, amask, sbuf):
        mode = prog.grad_mode
        # the mask written before the scores exist (a mask built and edited up front, as models build theirs)
        keep = keep_of(q.shape[2], k.shape[2], q.device, key_keep) if prog.late == "mask_view_before" else None
        if mode == "scores_no_grad":
            with torch.no_grad():
                s = scores(q, k)
        elif mode == "scores_set_grad_false":
            before = torch.is_grad_enabled()
            torch.set_grad_enabled(False)
            s = scores(q, k)
            torch.set_grad_enabled(before)
        elif mode == "scores_autocast":
            with torch.autocast("cpu", dtype=torch.bfloat16):
                s = scores(q, k)
            s = s.to(q.dtype)
        else:
            s = scores(q, k)
        if prog.write == "scores_copy":
            sbuf.copy_(s)
        if mode == "probs_no_grad":
            with torch.no_grad():
                return softmax(masked(s, key_keep, amask, keep))
        return softmax(masked(s, key_keep, amask, keep))

    def attention(q, k, v, key_keep, amask, buf, sbuf, x):
        k_in = k
        if prog.late == "k_dropout_alias_after":
            k = F.dropout(k, 0.5, training=False)  # k itself
        k, v = repeat_kv(k, prog.gqa, g), repeat_kv(v, prog.gqa, g)
        o = pv(dropout(probs(q, k, key_keep, amask, sbuf)), v, buf)
        if prog.late in ("k_view_after", "k_dropout_alias_after") and k_in.numel():
            k_in.view(-1)[: max(1, k_in.numel() // 2)].mul_(2.0)
        elif prog.late == "k_data_after":
            k_in.data.mul_(2.0)
        elif prog.late == "k_out_after":
            torch.mul(k_in, 2.0, out=k_in)
        if prog.write == "copy_":
            return buf.copy_(o)
        if prog.write == "add_":
            return o.add_(x)
        if prog.write == "slice_assign":
            buf[:] = o
            return buf
        return o

    def merged(o):
        # the caller writes into what it gets: heads merged, a view of the op's [B, N, H, D] output where rewritten
        return o.transpose(1, 2).flatten(2) if prog.late == "out_after_call" else o

    def fn(q, k, v, key_keep, amask, buf, sbuf, x):
        return merged(body(q, k, v, key_keep, amask, buf, sbuf, x))

    def body(q, k, v, key_keep, amask, buf, sbuf, x):
        mode = prog.grad_mode
        if mode == "body_no_grad":
            with torch.no_grad():
                return attention(q, k, v, key_keep, amask, buf, sbuf, x)
        if mode == "enable_grad_in_no_grad":
            with torch.no_grad():
                with torch.enable_grad():
                    return attention(q, k, v, key_keep, amask, buf, sbuf, x)
        if mode == "autocast":
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return attention(q, k, v, key_keep, amask, buf, sbuf, x)
        return attention(q, k, v, key_keep, amask, buf, sbuf, x)

    return fn


def _crossing_magnitude(prog: Program) -> float:
    """|q| on the crossing rows: their scores, -a·c·k[..., 0] with k[..., 0] in {1, 2}, lie below the
    fill (and within fp16's range before the scale); all products are exact in every dtype."""
    return 3.0 * 2 ** 30 if prog.fill == "-1e9" else 24576.0


def make_inputs(prog: Program, seed: int, poisoned: bool = True) -> dict:
    """The program's inputs; `poisoned=False` gives the same inputs with the NaN/inf left out."""
    gen = torch.Generator().manual_seed(seed)
    b, h, nq, nk, d = prog.shape
    hkv = prog.kv_heads
    dt = prog.dtype

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    q, k, v = randn(b, h, nq, d), randn(b, hkv, nk, d), randn(b, hkv, nk, d)
    if prog.values == "fp16_overflow":  # integer multiples of 64: q·k exact in fp32, beyond fp16's range
        q = 64.0 * torch.randint(-3, 4, q.shape, generator=gen)
        k = 64.0 * torch.randint(-3, 4, k.shape, generator=gen)
    if prog.values == "crossing" and d > 0:
        k[..., 0] = torch.randint(1, 3, k[..., 0].shape, generator=gen).float()
        rows = torch.arange(nq) % 2 == 1
        q[:, :, rows] = 0.0
        q[:, :, rows, 0] = -_crossing_magnitude(prog)
    if prog.values == "inf_q" and d > 0:
        k[..., 0] = k[..., 0].abs() + 0.5  # every score of the poisoned row is +inf: a NaN row in eager
    key_keep = torch.ones(b, nk, dtype=torch.bool)
    min_len = 1 if prog.values in POISONS else 0
    for i in range(1, b):
        key_keep[i, int(torch.randint(min_len, nk + 1, (), generator=gen)) if nk >= min_len else nk:] = False
    keep = keep_matrix(prog, nq, nk, key_keep)[:, None]
    amask = torch.zeros(b, 1, nq, nk).masked_fill(~keep, _fill(prog, dt) if prog.mask != "none" else 0.0)
    if poisoned and prog.values in POISONS and min(b, hkv, nk, d, nq) > 0:
        j0 = nk // 2
        if prog.values == "nan_key":
            k[0, 0, j0, 0] = float("nan")
        elif prog.values == "nan_value":
            v[0, 0, j0, d - 1] = float("nan")
        elif prog.values == "inf_value":
            v[0, 0, j0, d - 1] = float("inf")
        else:
            q[0, 0, nq // 2, 0] = float("inf")
    return dict(q=q.to(dt), k=k.to(dt), v=v.to(dt), key_keep=key_keep, amask=amask.to(dt),
                buf=torch.full((b, h, nq, d), float("nan"), dtype=dt),
                sbuf=torch.full((b, h, nq, nk), float("nan"), dtype=dt),
                x=randn(b, h, nq, d).to(prog.compute_dtype))


def poison_reach(prog: Program, key_keep: torch.Tensor) -> Optional[torch.Tensor]:
    """[B, H, Nq] bool: the rows the promise lets the poisoned input reach (None when none is placed)."""
    b, h, nq, nk, d = prog.shape
    if prog.values not in POISONS or min(b, prog.kv_heads, nk, d, nq) == 0:
        return None
    reach = torch.zeros(b, h, nq, dtype=torch.bool)
    if prog.values == "inf_q":
        reach[0, 0, nq // 2] = True
        return reach
    heads = torch.arange(h) // prog.groups == 0  # the query heads that read key/value head 0
    reach[0, heads] = keep_matrix(prog, nq, nk, key_keep)[0, :, nk // 2]
    return reach


# ----------------------------------------------------------------------------------- the differential check

ARG_NAMES = ("q", "k", "v", "key_keep", "amask", "buf", "sbuf", "x")


def _tol(dtype: torch.dtype) -> dict:
    # The suite's compiled-vs-eager tolerances (conftest; bf16 from the fused-call tests).
    return TOL.get(dtype) or tolerances(dtype)


def _grad_tol(dtype: torch.dtype) -> dict:
    # fp32 gradients: the training tests' tolerance (the backward sums over keys and queries).
    return dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else _tol(dtype)


def _recording_backend(inner: str, reports: list, use_pass: bool = True) -> Callable:
    """fa_compile.backend(inner), keeping the pass's site reports (use_pass=False: `inner` alone)."""
    import fa_compile
    from fa_compile.compiler import run_pass

    be = fa_compile.backend(inner)

    def backend(gm, example_inputs):
        if use_pass:
            reports.extend(run_pass(gm))  # marks gm done: the backend's own pass call is then a no-op
            return be(gm, example_inputs)
        return torch._dynamo.lookup_backend(inner)(gm, example_inputs)

    return backend


def _call(fn: Callable, prog: Program, ins: dict, dtype: Optional[torch.dtype] = None) -> tuple:
    args = [ins[n].clone() for n in ARG_NAMES]
    if dtype is not None:
        args = [a.to(dtype) if a.is_floating_point() else a for a in args]
    for a, rg in zip(args[:3], prog.requires_grad):
        a.requires_grad_(rg)
    # torch.inference_mode inside a compiled function fails in Dynamo itself (and leaves the process
    # unusable): it is drawn around the call, as model.generate() uses it.
    ctx = {"call_no_grad": torch.no_grad, "call_inference_mode": torch.inference_mode}.get(prog.grad_mode, nullcontext)
    with ctx():
        out = fn(*args)
        if prog.late == "out_after_call":
            out.add_(torch.ones((), dtype=out.dtype))  # the caller's residual, before the backward
    return out, args


def _backward(out: torch.Tensor, args: list, gout: torch.Tensor) -> list:
    if out.requires_grad:
        torch.autograd.backward(out, gout.to(out.dtype))
    return [a.grad for a in args[:3]]


def _same(got: torch.Tensor, want: torch.Tensor, tol: dict, what: str, exact: Optional[torch.Tensor] = None) -> None:
    """Every element of `got` close to `want` (NaN exactly where `want` has NaN). With `exact` (the
    program in fp64), a finite element may instead be as close to it as eager's element is, or within eager's
    largest error over the tensor (at most the relative tolerance of the tensor's largest value): eager's
    fp16 / bf16 rounding is not a digit the op must reproduce, and where eager happens to land on the exact
    value an element of the op's equally rounded sum need not (torch._dynamo's own accuracy check,
    `same(..., fp64_ref=...)`, likewise bounds the error by eager's over the whole tensor)."""
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)}, eager {tuple(want.shape)}"
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype}, eager {want.dtype}"
    if exact is not None and want.is_floating_point():
        g, w, x = got.double(), want.double(), exact.double()
        finite = w.isfinite() & x.isfinite()
        # eager's largest error, capped at the tolerance relative to the tensor's largest value (where eager's
        # arithmetic went wrong rather than rounded, its error allows nothing more)
        worst = torch.minimum((w - x)[finite].abs().max(), tol["rtol"] * x[finite].abs().max()) if finite.any() \
            else torch.zeros((), dtype=torch.float64)
        better = g.isfinite() & w.isfinite() & ((g - x).abs() <= torch.maximum((w - x).abs(), worst) + tol["atol"] + tol["rtol"] * x.abs())
        got = torch.where(better, want, got)
    try:
        assert_same(got, want, **tol)
    except AssertionError as e:
        extra, lost = got.isnan() & ~want.isnan(), want.isnan() & ~got.isnan()
        where = [f"{n} NaN where the expected value has {m} (first at {tuple(t.nonzero()[0].tolist())})"
                 for n, m, t in (("got", "none", extra), ("no", "NaN", lost)) if t.any()]
        raise AssertionError(f"{what}: {e} {'; '.join(where)}") from None


def check_program(prog: Program, seed: int, use_pass: bool = True) -> list:
    """Compile `prog` with the fa3 backend and compare it with eager on two sets of fresh inputs:
    output, the caller's buffers and whether the output aliases one, and the gradients of q, k, v
    (None exactly where eager's is None). Where the site was rewritten, NaN/inf inputs and fp16
    overflow are held to the project's promise instead of eager's arithmetic. use_pass=False
    compiles without the pass (to tell the pass's failures from torch's). Returns the reports."""
    fn = build(prog)
    reports: list = []
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=_recording_backend(prog.inner, reports, use_pass))
    tol, gtol = _tol(prog.compute_dtype), _grad_tol(prog.compute_dtype)
    for call, s in enumerate((seed, seed + 1)):
        ins = make_inputs(prog, s)
        ref, ref_args = _call(fn, prog, ins)
        out, args = _call(compiled, prog, ins)
        where = f"call {call}"
        rewritten = any(r.rewritten for r in reports)
        gout = torch.randn(ref.shape, generator=torch.Generator().manual_seed(s + 7))

        want, want_grads, exact, exact_grads = ref, None, None, [None] * 3
        low_precision = prog.compute_dtype != torch.float32
        if low_precision or prog.values == "fp16_overflow":
            ref64, args64 = _call(fn, prog, ins, torch.float64)
            exact = ref64.detach().to(ref.dtype)
            exact_grads = [None if g is None else g.to(prog.dtype) for g in _backward(ref64, args64, gout)]
        if rewritten and prog.values == "fp16_overflow":
            # Scores accumulate in fp32: compare with the same program in fp64, not eager's fp16 infs.
            want, want_grads = exact, exact_grads
        elif rewritten and prog.values in POISONS:
            reach = poison_reach(prog, ins["key_keep"])
            if prog.mask_form == "additive_input" and prog.values == "nan_key":
                reach = None  # a mask passed in as a tensor is added as eager adds it: NaN + (-inf) poisons as there
            if reach is not None:
                clean, _ = _call(fn, prog, make_inputs(prog, s, poisoned=False))
                want = torch.where(reach[..., None], ref, clean.detach())
                if prog.values in ("nan_value", "inf_value"):
                    # An excluded value may reach a row as eager's 0 · NaN does (by the kernel's tiling):
                    # such an element is NaN, never a wrong finite number.
                    want = torch.where(~reach[..., None] & out.detach().isnan(), out.detach(), want)
        elif rewritten and low_precision:
            # Eager's fp16 / bf16 score arithmetic can overflow where the program is finite in fp64 (a large logit
            # plus a finfo.min fill is -inf on every key of its row, so the row is NaN). The op adds in fp32:
            # those elements are held to the fp64 program, as fp16_overflow's are.
            want = torch.where(~ref.detach().isfinite() & exact.isfinite(), exact, ref.detach())
        # Logits of 1e4 and more: the backward's P = exp(s - lse) carries lse's fp32 rounding (|s|·2⁻²⁴,
        # times |q| in dk): gradients are held to finite where eager's are, not to their digits.
        finite_grads_only = prog.values in ("crossing", "fp16_overflow")

        _same(out.detach(), want.detach(), tol, f"{where}: output", exact if low_precision else None)
        # The caller's buffers hold what eager wrote into them (buf: the output, where it is written).
        holds_out = prog.write in ("out_kw", "copy_", "slice_assign")
        buf_want = want if holds_out else ref_args[5]
        _same(args[5].detach(), buf_want.detach(), tol, f"{where}: caller's buf after the call",
              exact if holds_out and low_precision else None)
        _same(args[6].detach(), ref_args[6].detach(), tol, f"{where}: caller's sbuf after the call")
        for i, name in enumerate(("q", "k", "v", "key_keep")):
            assert torch.equal(args[i].detach().isnan(), ref_args[i].detach().isnan()) and torch.equal(
                args[i].detach().nan_to_num(), ref_args[i].detach().nan_to_num()), f"{where}: caller's {name} after the call"
        for name, a, r in zip(ARG_NAMES, args, ref_args):
            if r.numel():
                assert (out.data_ptr() == a.data_ptr()) == (ref.data_ptr() == r.data_ptr()), \
                    f"{where}: output aliases {name} in eager: {ref.data_ptr() == r.data_ptr()}"
        assert out.requires_grad == ref.requires_grad, \
            f"{where}: output requires_grad {out.requires_grad}, eager {ref.requires_grad}"
        if prog.values in POISONS:
            continue  # the promise is about outputs; a NaN's gradient reaches every key
        got_grads = _backward(out, args, gout)
        ref_grads = _backward(ref, ref_args, gout)
        # A row with no admissible key is NaN as in eager, and so are the gradients eager's NaN reaches (README,
        # Numerics): every value's of the head, and under additive -inf masks every key's and the row's query's.
        # Where -inf fills and additive -inf masks meet, q's and k's stay finite (the known difference): there a
        # NaN of ours must be one of eager's, and the elements finite in both are compared.
        empty_rows = bool(ref.detach().isnan().any())
        for name, g, r, w, x in zip("qkv", got_grads, ref_grads, want_grads or ref_grads, exact_grads):
            assert (g is None) == (r is None), \
                f"{where}: {name}.grad is {'None' if g is None else 'set'}, eager's is {'None' if r is None else 'set'}"
            if g is None:
                continue
            if empty_rows and rewritten:
                nan_g, nan_w = g.isnan(), w.isnan()
                assert not (nan_g & ~nan_w).any(), f"{where}: {name}.grad NaN where eager's is not"
                if name == "v":  # eager's NaN that the program has in fp64 too (not an fp16 / bf16 overflow of eager's)
                    kept = nan_w if x is None else nan_w & x.isnan()
                    assert not (kept & ~nan_g).any(), f"{where}: v.grad finite where eager's is NaN"
                keep = ~nan_g & ~nan_w
                g, w, x = g[keep], w[keep], (None if x is None else x[keep])
            if finite_grads_only:
                # In fp16 / bf16 the exact gradient (fp64, rounded to the dtype) says where a rewritten site's is
                # finite: eager's own low-precision backward can overflow where the exact value fits.
                target = x if x is not None and rewritten else w
                assert torch.equal(g.isfinite(), target.isfinite()), f"{where}: {name}.grad finite elsewhere than expected"
            else:
                _same(g, w, gtol, f"{where}: {name}.grad", x if low_precision else None)
    missed = [r for r in reports if not r.rewritten]
    assert all(r.reason for r in missed), f"a refused site without a reason: {missed}"
    return reports


# ----------------------------------------------------------------------------------- the strategy

def programs():
    """Hypothesis strategy: one choice per axis, then the few constraints that keep eager well defined."""
    from hypothesis import strategies as st

    @st.composite
    def draw_program(draw) -> Program:
        pick = lambda xs: draw(st.sampled_from(xs))  # noqa: E731
        values = pick(VALUES)
        grad_mode = pick(GRAD_MODES)
        if values == "fp16_overflow":
            dtype = torch.float16
            grad_mode = "none" if grad_mode in ("autocast", "scores_autocast") else grad_mode
        elif grad_mode in ("autocast", "scores_autocast"):
            dtype = torch.float32  # CPU autocast lowers fp32 to bf16
        else:
            dtype = pick([torch.float32, torch.float16, torch.bfloat16])
        mask = pick(MASKS)
        form = pick(MASK_FORMS)
        fills = FILLS
        if values in POISONS or values == "fp16_overflow":
            fills = ["-inf"] if values == "fp16_overflow" else ["-inf", "finfo.min"]
        if form == "additive_bert":
            fills = [f for f in fills if f != "-inf"] or fills
            form = form if fills != ["-inf"] else "additive"  # (1 - keep) * -inf is NaN on kept keys
        if dtype == torch.float16:  # masked_fill refuses -1e9 in fp16; where / additive turn it into -inf
            fills = [f for f in fills if f != "-1e9"]
        fill = pick(fills)
        b, h, nq, nk, d = pick([1, 2]), pick([2, 4]), pick([1, 3, 5, 8]), pick([1, 4, 6, 8]), pick([4, 8, 16])
        if values in POISONS and mask == "window":
            nq = min(nq, nk)  # every row keeps a key: an empty row's finite fill attends to all keys
        zero = pick([None] * 15 + ["B", "H", "Nq", "Nk", "D"])
        shape = tuple(0 if zero == n else x for n, x in zip(("B", "H", "Nq", "Nk", "D"), (b, h, nq, nk, d)))
        scale = 0.5
        if values not in ("crossing", "fp16_overflow"):  # those need an exact power-of-two scale
            scale = pick([0.5, 0.125] + ([d ** -0.5] if d else []))
        # Under autocast P is bf16 or fp32 by spelling and out= insists on one dtype.
        write = pick([w for w in WRITES if w != "out_kw"] if grad_mode == "autocast" else WRITES)
        softmax = pick(SOFTMAXES if shape[3] else SOFTMAXES[:-1])  # amax() refuses an empty key axis
        # A mask written before the site changes which keys each row keeps: not with the poisons, whose reach
        # keep_matrix states. Writes into k after the site mostly with only v needing grad (eager refuses an
        # in-place write into a leaf that requires grad, and its backward one into a tensor it saved).
        # The output with heads merged (out_after_call) is not the [B, H, Nq, D] the poisons' reach and the caller's
        # buffer are compared in.
        late = pick([x for x in LATE if not (x in ("mask_view_before", "out_after_call") and values in POISONS)
                     and not (x == "out_after_call" and write in ("out_kw", "copy_", "slice_assign"))])
        grads = pick(["v"] * 3 + ["qkv"] if late.startswith("k_") else ["qkv"] * 3 + ["v"])
        return Program(qk=pick(QKS), scale=pick(SCALES), softmax=softmax, pv=pick(PVS), mask=mask,
                       mask_form=form, fill=fill, write=write, late=late, grads=grads, grad_mode=grad_mode, gqa=pick(GQAS),
                       dropout=pick(DROPOUTS), dtype=dtype, shape=shape, values=values, scale_value=scale,
                       inner="aot_eager" if values == "fp16_overflow" else pick(INNERS))  # Inductor upcasts fp16 too

    return draw_program()
