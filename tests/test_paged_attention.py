"""torch.ops.fa3.paged_attention: argument checks, the reference against a per-sequence loop, the
fake, the backward, the split heuristic, and the Triton split-KV decode kernel under the interpreter.

Kernel tests need TRITON_INTERPRET=1 set before any Triton kernel is defined, so (as in
test_kernels_interp.py) they run in a fresh subprocess with it set; everything else runs here.
Every kernel result is compared with the reference on every element, its outputs and split
workspaces poisoned with NaN first. fp16 / fp32 only: the interpreter's bf16 dot is unreliable.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Optional

import pytest
import torch
from torch import Tensor

import fa_compile
from fa_compile import paged
from fa_compile.kernels import decode
from fa_compile.kernels.decode_reference import paged_attention_reference

IN_CHILD = os.environ.get("TRITON_INTERPRET") == "1"


# ------------------------------------------------------------------------------------------- helpers
@dataclass
class Cache:
    q: Tensor
    k: Tensor
    v: Tensor
    seqlens: Tensor
    table: Optional[Tensor]
    leftpad: Optional[Tensor]
    layout: str
    causal: bool
    scale: float
    extra: dict = field(default_factory=dict)

    def args(self) -> tuple:
        return self.q, self.k, self.v, self.seqlens, self.table, self.leftpad


def make_cache(*, lens, nq=1, hq=4, hkv=2, d=32, dv=None, page: Optional[int] = 16, layout="bshd", causal=True,
               leftpad=None, share_prefix: int = 0, spare_blocks: int = 3, table_dtype=torch.int32,
               dtype=torch.float16, lmax: Optional[int] = None, seed=0) -> Cache:
    """Random q and cache. Paged: a pool with spare blocks, pages assigned in shuffled order; with
    share_prefix = n, every sequence's first n pages are sequence 0's (prefix sharing). Table entries
    past a sequence's pages are -1 (never read). page None: a contiguous [B, Lmax, ...] cache."""
    g = torch.Generator().manual_seed(seed)
    b = len(lens)
    dv = dv or d
    q = torch.randn(b, nq, hq, d, generator=g).to(dtype)
    seqlens = torch.tensor(lens, dtype=torch.int32)
    pad = None if leftpad is None else torch.tensor(leftpad, dtype=torch.int32)
    if page is None:
        lmax = lmax or max(max(lens), 1)
        shape = (b, lmax, hkv) if layout == "bshd" else (b, hkv, lmax)
        k = torch.randn(*shape, d, generator=g).to(dtype)
        v = torch.randn(*shape, dv, generator=g).to(dtype)
        return Cache(q, k, v, seqlens, None, pad, layout, causal, d ** -0.5)
    pages = [-(-n // page) for n in lens]
    max_pages = max(max(pages), 1) + 1
    need = sum(max(p - share_prefix, 0) for p in pages[1:]) + pages[0] + spare_blocks
    perm = torch.randperm(need, generator=g).tolist()
    table = torch.full((b, max_pages), -1, dtype=torch.int64)
    for i, n in enumerate(pages):
        for j in range(n):
            if i > 0 and j < share_prefix and j < pages[0]:
                table[i, j] = table[0, j]
            else:
                table[i, j] = perm.pop()
    shape = (need, page, hkv) if layout == "bshd" else (need, hkv, page)
    k = torch.randn(*shape, d, generator=g).to(dtype)
    v = torch.randn(*shape, dv, generator=g).to(dtype)
    return Cache(q, k, v, seqlens, table.to(table_dtype), pad, layout, causal, d ** -0.5)


def naive(c: Cache) -> tuple[Tensor, Tensor]:
    """Per-sequence loop over explicit key positions, fp64, differentiable: an oracle for the reference."""
    b, nq, hq, d = c.q.shape
    kc = c.k if c.layout == "bshd" else c.k.transpose(1, 2)
    vc = c.v if c.layout == "bshd" else c.v.transpose(1, 2)
    hkv, dv = kc.shape[2], vc.shape[3]
    outs, lses = [], []
    for i in range(b):
        end = int(c.seqlens[i])
        start = int(c.leftpad[i]) if c.leftpad is not None else 0
        pos = list(range(start, end))
        if c.table is None:
            ks = [kc[i, p] for p in pos]
            vs = [vc[i, p] for p in pos]
        else:
            page = kc.shape[1]
            ks = [kc[int(c.table[i, p // page]), p % page] for p in pos]
            vs = [vc[int(c.table[i, p // page]), p % page] for p in pos]
        k = torch.stack(ks).double() if ks else torch.zeros(0, hkv, d, dtype=torch.float64)
        v = torch.stack(vs).double() if vs else torch.zeros(0, hkv, dv, dtype=torch.float64)
        k = k.repeat_interleave(hq // hkv, dim=1)
        v = v.repeat_interleave(hq // hkv, dim=1)
        s = torch.einsum("qhd,khd->hqk", c.q[i].double(), k) * c.scale
        if c.causal:
            allowed = torch.tensor(pos, dtype=torch.int64).view(1, -1) <= (end - nq + torch.arange(nq)).view(-1, 1)
            s = s.masked_fill(~allowed, float("-inf"))
        lse = torch.logsumexp(s, dim=-1)
        p = torch.where(torch.isneginf(lse)[..., None], torch.zeros_like(s), torch.exp(s - lse[..., None]))
        outs.append(torch.einsum("hqk,khd->qhd", p, v))
        lses.append(lse)
    return torch.stack(outs), torch.stack(lses)


def cache_view_of(c: Cache, t: Tensor) -> Tensor:
    """A cache as [blocks (or B), page (or Lmax), Hkv, D], whatever its layout."""
    return t if c.layout == "bshd" else t.transpose(1, 2)


def run_op(c: Cache, **kw) -> tuple[Tensor, Tensor]:
    return torch.ops.fa3.paged_attention(*c.args(), scale=c.scale, causal=c.causal, layout=c.layout, **kw)


REFERENCE_CASES = {
    "paged_bshd_p16": dict(lens=[1, 37, 0, 100], nq=1),
    "paged_bhsd_p16_nq4": dict(lens=[5, 37, 64], nq=4, layout="bhsd"),
    "page1_int64": dict(lens=[3, 9, 1], nq=2, page=1, table_dtype=torch.int64),
    "prefix_sharing": dict(lens=[40, 45, 33], page=8, share_prefix=4, nq=3),
    "leftpad": dict(lens=[20, 30, 7], leftpad=[3, 0, 7], nq=2, page=4),
    "contiguous_bshd": dict(lens=[6, 13, 0], page=None, nq=4, lmax=16),
    "contiguous_bhsd_noncausal": dict(lens=[6, 13], page=None, layout="bhsd", nq=4, causal=False, lmax=20),
    "fewer_keys_than_queries": dict(lens=[2, 5], nq=4, page=16),
}


# --------------------------------------------------------------------------------- parent-process tests
if not IN_CHILD:

    @pytest.mark.parametrize("name", list(REFERENCE_CASES))
    def test_reference_matches_per_sequence_loop(name):
        c = make_cache(dtype=torch.float64, **REFERENCE_CASES[name])
        out, lse = paged_attention_reference(*c.args(), scale=c.scale, causal=c.causal, layout=c.layout)
        r_out, r_lse = naive(c)
        torch.testing.assert_close(out, r_out, atol=1e-10, rtol=1e-10)
        torch.testing.assert_close(lse.double(), r_lse, atol=1e-5, rtol=1e-6)  # the reference's lse is fp32
        assert lse.dtype == torch.float32

    @pytest.mark.parametrize("name", ["paged_bhsd_p16_nq4", "prefix_sharing", "leftpad", "contiguous_bshd"])
    def test_slots_outside_the_sequences_are_never_read(name):
        # Every cache slot no sequence uses ([cache_leftpad, cache_seqlens) of each) is set to NaN or inf, as
        # uninitialised memory may be: the op (the reference on CPU) gives the same bits as with zeros there.
        c = make_cache(dtype=torch.float32, **REFERENCE_CASES[name])
        kv = [cache_view_of(c, t).clone() for t in (c.k, c.v)]
        used = torch.zeros(kv[0].shape[:2], dtype=torch.bool)
        for i in range(c.q.shape[0]):
            start = int(c.leftpad[i]) if c.leftpad is not None else 0
            for p in range(start, int(c.seqlens[i])):
                page = kv[0].shape[1]
                used[(int(c.table[i, p // page]), p % page) if c.table is not None else (i, p)] = True
        results = []
        for fill in (0.0, float("nan")):
            for t in kv:
                t[~used] = fill if fill == 0.0 or t is kv[0] else float("inf")
            k, v = (t if c.layout == "bshd" else t.transpose(1, 2) for t in kv)
            q = c.q.clone().requires_grad_()
            out, lse = torch.ops.fa3.paged_attention(q, k, v, c.seqlens, c.table, c.leftpad, scale=c.scale,
                                                     causal=c.causal, layout=c.layout)
            results.append((out, lse, torch.autograd.grad(out.sum(), q)[0]))
        for what, clean, poisoned in zip(("out", "lse", "dq"), *results):
            assert torch.equal(poisoned, clean), what
            assert not torch.isnan(poisoned).any(), what

    def test_op_on_cpu_runs_the_reference_with_empty_rows():
        c = make_cache(lens=[0, 2, 9], nq=4, dtype=torch.float32)
        assert paged.choose(paged.PagedArgs(*c.args(), c.scale, True, c.layout, 0)).name == "reference"
        out, lse = run_op(c)
        assert out.shape == (3, 4, 4, 32) and out.is_contiguous() and lse.shape == (3, 4, 4)
        r_out, r_lse = naive(c)
        torch.testing.assert_close(out.double(), r_out, atol=1e-5, rtol=1e-5)
        assert torch.isneginf(lse[0]).all() and (out[0] == 0).all()
        assert torch.isneginf(lse[1, :, :2]).all() and torch.isfinite(lse[1, :, 2:]).all()  # causal: rows 0, 1 empty

    @pytest.mark.parametrize("layout", ["bshd", "bhsd"])
    def test_a_pool_of_no_blocks_with_empty_sequences(layout):
        # every length 0: no page is read, whatever the table holds; out 0 and lse -inf, as with a pool of pages
        q = torch.randn(2, 1, 4, 8)
        pool = torch.randn(0, 4, 2, 8) if layout == "bshd" else torch.randn(0, 2, 4, 8)
        table, lens = torch.zeros(2, 3, dtype=torch.int32), torch.zeros(2, dtype=torch.int32)
        out, lse = fa_compile.paged_attention(q, pool, pool, lens, table, layout=layout, return_softmax_lse=True)
        assert out.shape == (2, 1, 4, 8) and (out == 0).all() and torch.isneginf(lse).all()

    def test_wrapper_conventions():
        c = make_cache(lens=[9, 9], nq=1, dtype=torch.float32)
        out, lse = fa_compile.paged_attention(c.q, c.k, c.v, 9, c.table, causal=True, return_softmax_lse=True)
        r_out, r_lse = naive(c)
        torch.testing.assert_close(out.double(), r_out, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse.double(), r_lse, atol=1e-5, rtol=1e-5)
        only = fa_compile.paged_attention(c.q, c.k, c.v, c.seqlens, c.table, softmax_scale=c.scale, kernel="reference")
        torch.testing.assert_close(only, out)

    def _bad(**change):
        c = make_cache(lens=[5, 20], nq=2, dtype=torch.float32)
        kw = dict(q=c.q, k_cache=c.k, v_cache=c.v, cache_seqlens=c.seqlens, page_table=c.table, cache_leftpad=None,
                  scale=c.scale, layout="bshd", num_splits=0, force_kernel=None)
        for key, fn in change.items():
            kw[key] = fn(kw[key]) if callable(fn) else fn
        scal = {n: kw.pop(n) for n in ("scale", "layout", "num_splits", "force_kernel")}
        return lambda: torch.ops.fa3.paged_attention(*kw.values(), causal=True, **scal)

    @pytest.mark.parametrize("change,match", [
        (dict(q=lambda t: t[0]), r"^q: expected 4 dims"),
        (dict(q=lambda t: t.long()), r"^q: dtype"),
        (dict(k_cache=lambda t: t.half()), r"^k_cache: dtype"),
        (dict(v_cache=lambda t: t[:, :, :1]), r"^v_cache: shape"),
        (dict(k_cache=lambda t: t[..., :16]), r"^k_cache: head dim 16"),
        (dict(q=lambda t: t[:, :, :3]), r"^k_cache: q's 3 heads"),
        (dict(layout="sbhd"), r"^layout: must be"),
        (dict(page_table=lambda t: t[:1]), r"^page_table: expected shape \[batch, max_pages\]"),
        (dict(page_table=lambda t: t.float()), r"^page_table: dtype must be int32 or int64"),
        (dict(page_table=None), r"^k_cache: \d+ cache rows but q has batch 2"),
        (dict(cache_seqlens=lambda t: t[:1]), r"^cache_seqlens: expected shape \[batch\]"),
        (dict(cache_seqlens=lambda t: t.float()), r"^cache_seqlens: dtype"),
        (dict(cache_leftpad=torch.zeros(3, dtype=torch.int32)), r"^cache_leftpad: expected shape"),
        (dict(num_splits=-1), r"^num_splits: must be"),
        (dict(scale=float("inf")), r"^scale: must be a finite number"),
        (dict(force_kernel="flash"), r"^force_kernel: unknown kernel 'flash'"),
        (dict(force_kernel="fa3"), r"^force_kernel: 'fa3' cannot take these inputs"),
        (dict(cache_seqlens=lambda t: t + 100), r"^cache_seqlens: values must lie in \[0, 48\]"),
        (dict(cache_seqlens=lambda t: t - 6), r"^cache_seqlens: values must lie"),
        (dict(cache_leftpad=torch.tensor([6, 0], dtype=torch.int32)), r"^cache_leftpad: values must lie"),
        (dict(page_table=lambda t: t.clone().fill_(99)), r"^page_table: entry \[0, 0\] = 99 is outside the pool"),
    ], ids=lambda x: x if isinstance(x, str) else None)
    def test_argument_errors_name_the_argument(change, match):
        with pytest.raises((ValueError, TypeError), match=match):
            _bad(**change)()

    @pytest.mark.parametrize("change,match", [
        (dict(k_cache=None), r"^k_cache: expected a Tensor, got NoneType"),
        (dict(v_cache=[1.0]), r"^v_cache: expected a Tensor, got list"),
        (dict(page_table=[[0, 1]]), r"^page_table: expected a Tensor or None, got list"),
        (dict(q=lambda t: t[0]), r"^q: expected \[B, Nq, Hq, D\] \(4 dims\), got 3 dims"),
        (dict(softmax_scale="0.5"), r"^softmax_scale: expected a Python number or None, got str"),
        (dict(softmax_scale=True), r"^softmax_scale: expected a Python number or None, got bool"),
        (dict(softmax_scale=torch.tensor(0.5, requires_grad=True)), r"^softmax_scale: expected a Python number or None, got Tensor .* without its gradient"),
        (dict(num_splits=True), r"^num_splits: expected an int, got bool"),
        (dict(num_splits=1.5), r"^num_splits: expected an int, got float"),
        (dict(layout=None), r"^layout: expected 'bshd' or 'bhsd', got NoneType"),
        (dict(kernel=3), r"^kernel: expected a kernel name or None, got int"),
        (dict(kernel="flash"), r"^kernel: unknown kernel 'flash'; known: triton, fa3, reference"),
        (dict(softmax_scale=float("nan")), r"^softmax_scale: must be a finite number"),
        (dict(softmax_scale=10**400), r"^softmax_scale: must be a finite number, got 1000.*\(401 characters\)"),
        (dict(num_splits=2**70), r"^num_splits: must be in \[0, 2147483647\]"),
        (dict(cache_seqlens=2**40), r"^cache_seqlens: an int must be in \[0, 2147483647\]"),
    ], ids=lambda x: x if isinstance(x, str) else None)
    def test_wrapper_argument_types_name_the_argument(change, match):
        c = make_cache(lens=[5, 20], nq=2, dtype=torch.float32)
        kw = dict(q=c.q, k_cache=c.k, v_cache=c.v, cache_seqlens=c.seqlens, page_table=c.table)
        for key, fn in change.items():
            kw[key] = fn(kw[key]) if callable(fn) else fn
        with pytest.raises(TypeError if "expected" in match and "dims" not in match else ValueError, match=match):
            fa_compile.paged_attention(**kw)
        import numpy as np

        good = fa_compile.paged_attention(c.q, c.k, c.v, c.seqlens, c.table, softmax_scale=np.float32(c.scale))
        torch.testing.assert_close(good, fa_compile.paged_attention(c.q, c.k, c.v, c.seqlens, c.table,
                                                                     softmax_scale=float(np.float32(c.scale))))

    def test_unused_table_entries_are_not_checked():
        c = make_cache(lens=[5, 20], nq=1, dtype=torch.float32)
        assert (c.table[0, 1:] == -1).all()  # past sequence 0's one page
        run_op(c)
        c.leftpad = torch.tensor([0, 16], dtype=torch.int32)
        c.table[1, 0] = 1000  # a page wholly before the left padding is never read
        out, _ = run_op(c)
        torch.testing.assert_close(out.double(), naive(c)[0], atol=1e-5, rtol=1e-5)

    def test_fake_tensors_and_meta():
        from torch._subclasses.fake_tensor import FakeTensorMode

        c = make_cache(lens=[5, 20], nq=3, dv=16, layout="bhsd", dtype=torch.float16)
        with FakeTensorMode() as mode:
            fake = [mode.from_tensor(t) if t is not None else None for t in c.args()]
            out, lse = torch.ops.fa3.paged_attention(*fake, scale=0.1, causal=True, layout="bhsd")
            assert out.shape == (2, 3, 4, 16) and out.dtype == torch.float16
            assert lse.shape == (2, 4, 3) and lse.dtype == torch.float32
            with pytest.raises(ValueError, match="^layout"):
                torch.ops.fa3.paged_attention(*fake, scale=0.1, layout="x")

    def test_torch_compile_traces_the_op_and_its_backward():
        c = make_cache(lens=[7, 30], nq=2, dtype=torch.float32, share_prefix=1)

        def step(q, k, v, lens, table):
            out, lse = torch.ops.fa3.paged_attention(q, k, v, lens, table, scale=c.scale, causal=True)
            return out * 2, lse

        torch._dynamo.reset()
        compiled = [t.detach().requires_grad_() for t in (c.q, c.k, c.v)]
        eager = [t.detach().requires_grad_() for t in (c.q, c.k, c.v)]
        got = torch.compile(step, backend="aot_eager", fullgraph=True)(*compiled, c.seqlens, c.table)
        want = step(*eager, c.seqlens, c.table)
        for x, y in zip(got, want):
            torch.testing.assert_close(x, y)
        g = torch.Generator().manual_seed(3)
        dout = torch.randn(want[0].shape, generator=g)
        (got[0] * dout).sum().backward()
        (want[0] * dout).sum().backward()
        for x, y in zip(compiled, eager):
            torch.testing.assert_close(x.grad, y.grad)

    @pytest.mark.parametrize("name", ["prefix_sharing", "leftpad", "contiguous_bhsd_noncausal"])
    def test_backward_matches_autograd_of_the_loop(name):
        c = make_cache(dtype=torch.float64, **REFERENCE_CASES[name])
        leaves = [t.detach().requires_grad_() for t in (c.q, c.k, c.v)]
        g = torch.Generator().manual_seed(7)
        c1 = Cache(*leaves, c.seqlens, c.table, c.leftpad, c.layout, c.causal, c.scale)
        out, lse = run_op(c1)
        dout = torch.randn(out.shape, generator=g, dtype=torch.float64)
        dlse = torch.randn(lse.shape, generator=g, dtype=torch.float32).masked_fill(torch.isneginf(lse), 0)
        (out * dout).sum().add_((torch.where(torch.isneginf(lse), 0, lse) * dlse).sum()).backward()
        ref_leaves = [t.detach().requires_grad_() for t in (c.q, c.k, c.v)]
        r_out, r_lse = naive(Cache(*ref_leaves, c.seqlens, c.table, c.leftpad, c.layout, c.causal, c.scale))
        (r_out * dout).sum().add_((torch.where(torch.isneginf(r_lse), 0, r_lse) * dlse.double()).sum()).backward()
        for got, want in zip(leaves, ref_leaves):
            torch.testing.assert_close(got.grad, want.grad, atol=1e-5, rtol=1e-5)

    def test_backward_without_an_incoming_gradient_gives_zeros():
        # a downstream function whose backward returns None: autograd still calls ours (grads not materialised)
        class NoGrad(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                return x.clone()

            @staticmethod
            def backward(ctx, g):
                return None

        c = make_cache(lens=[5, 9], dtype=torch.float32)
        leaves = [t.detach().requires_grad_() for t in (c.q, c.k, c.v)]
        out, lse = run_op(Cache(*leaves, c.seqlens, c.table, c.leftpad, c.layout, c.causal, c.scale))
        (NoGrad.apply(out).sum() + NoGrad.apply(lse).sum() + sum((t * 0).sum() for t in leaves)).backward()
        for t in leaves:
            assert t.grad is not None and torch.equal(t.grad, torch.zeros_like(t))

    def test_choose_num_splits():
        f = decode.choose_num_splits
        assert f(128, 8, 2048, 132) == 1  # 1024 programs fill the SMs already
        assert f(32, 8, 4096, 132) == 2  # 256 programs: up to 4 per SM, never past (528)
        assert f(8, 8, 32768, 132) == 8
        assert f(1, 1, 1 << 20, 132) == decode.MAX_SPLITS
        assert f(1, 1, 300, 132) == 1  # too short to split (fewer than MIN_KEYS_PER_SPLIT keys a split)
        assert f(1, 1, 1024, 132) == 1024 // decode.MIN_KEYS_PER_SPLIT
        assert f(0, 8, 4096, 132) == 1 and f(4, 8, 0, 132) == 1
        for b in (1, 2, 4, 8, 16, 32, 64):
            for n in (64, 512, 4096, 65536):
                s = f(b, 8, n, 132)
                assert 1 <= s <= decode.MAX_SPLITS and (s == 1 or n // s >= decode.MIN_KEYS_PER_SPLIT)
                assert f(b, 8, 2 * n, 132) >= s  # longer caches never get fewer splits
        assert decode.plan_splits(7, 1, 1, 100, torch.device("cpu"), 64) == 2  # at most one split per tile

    def test_triton_refusals_on_cpu(monkeypatch):
        c = make_cache(lens=[5, 20], dtype=torch.float16)
        a = paged.PagedArgs(*c.args(), c.scale, True, c.layout, 0)
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        why = dict(paged.explain_choice(a))
        if decode.triton_available():
            assert why["triton"] == ["CPU tensors need the Triton interpreter (TRITON_INTERPRET=1)"]
        assert why["fa3"] and why["reference"] == []
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        a16 = paged.PagedArgs(c.q.bfloat16(), c.k.bfloat16(), c.v.bfloat16(), *c.args()[3:], c.scale, True, "bshd", 0)
        assert any("bfloat16" in r for r in paged.CANDIDATES[0].not_supported_reasons(a16))
        big = paged.PagedArgs(torch.empty(2, 16, 32, 32, dtype=torch.float16), *c.args()[1:], c.scale, True, "bshd", 0)
        assert any("query rows per KV head" in r for r in paged.CANDIDATES[0].not_supported_reasons(big))

    def test_opcheck():
        c = make_cache(lens=[7, 30], nq=2, dtype=torch.float32, share_prefix=1, leftpad=[2, 0])
        leaves = [t.detach().requires_grad_() for t in (c.q, c.k, c.v)]
        torch.library.opcheck(torch.ops.fa3.paged_attention.default, (*leaves, *c.args()[3:]),
                              dict(scale=c.scale, causal=True))

    needs_cuda = pytest.mark.skipif(not torch.cuda.is_available() or not decode.triton_available(),
                                    reason="needs CUDA and triton")

    @needs_cuda
    @pytest.mark.parametrize("kernel", ["triton", "fa3"])
    @pytest.mark.parametrize("kw", [
        dict(lens=[1, 4000, 0, 1537], page=16, hq=32, hkv=8, d=128, nq=1),
        dict(lens=[5000, 17, 3000], page=64, hq=32, hkv=8, d=128, nq=4, share_prefix=8),
        dict(lens=[1, 255, 256, 1000], page=1, hq=8, hkv=8, d=64, nq=2),
        dict(lens=[700, 2048], page=None, hq=32, hkv=8, d=128, nq=1, lmax=4096),
        dict(lens=[700, 2048], page=None, hq=32, hkv=8, d=128, nq=3, lmax=4096, layout="bhsd", leftpad=[0, 100]),
        dict(lens=[300, 900], page=256, hq=16, hkv=2, d=128, nq=16, layout="bhsd", leftpad=[7, 0]),
    ], ids=["b4_p16_gqa", "p64_prefix_nq4", "page1_mha", "contig", "contig_bhsd_leftpad", "p256_bhsd_nq16"])
    def test_gpu_kernels_against_reference(kw, kernel):
        c = make_cache(dtype=torch.bfloat16, **kw)
        c = Cache(*(None if t is None else t.cuda() for t in c.args()), c.layout, c.causal, c.scale)
        a = paged.PagedArgs(*c.args(), c.scale, c.causal, c.layout, 0)
        why = paged.CANDIDATES[KERNELS_INDEX[kernel]].not_supported_reasons(a)
        if why:
            pytest.skip("; ".join(why))
        out, lse = run_op(c, force_kernel=kernel)
        r_out, r_lse = run_op(c, force_kernel="reference")
        torch.testing.assert_close(out, r_out, atol=1.6e-2, rtol=1.6e-2)
        torch.testing.assert_close(lse, r_lse, atol=2e-3, rtol=2e-3)

    KERNELS_INDEX = {c.name: i for i, c in enumerate(paged.CANDIDATES)}

    @pytest.mark.skipif(not decode.triton_available(), reason="triton not installed")
    def test_kernel_under_interpreter():
        from fa_compile.kernels.triton_testing import run_under_interpreter

        run_under_interpreter(__file__, timeout=600)


# ----------------------------------------------------------------------------- interpreter (child) tests
else:
    from fa_compile.kernels.triton_testing import TOL

    def check_kernel(c: Cache, num_splits: int, block_n: int = 16) -> tuple[Tensor, Tensor]:
        """Run the Triton decode with NaN-poisoned out, lse and split workspaces; compare every element."""
        b, nq, hq, _ = c.q.shape
        kc = c.k if c.layout == "bshd" else c.k.transpose(1, 2)
        hkv, dv = kc.shape[2], c.v.shape[-1]
        cap = paged.capacity(c.k, c.table, c.layout)
        splits = decode.plan_splits(num_splits, b, hkv, cap, c.q.device, block_n)
        rows = hq // hkv * nq
        nan = float("nan")
        out = torch.full((b, nq, hq, dv), nan, dtype=c.q.dtype)
        lse = torch.full((b, hq, nq), nan)
        ws = (torch.full((b * hkv, splits, rows, dv), nan), torch.full((b * hkv, splits, rows), nan))
        got_out, got_lse = decode.paged_decode(*c.args(), scale=c.scale, causal=c.causal, layout=c.layout,
                                               num_splits=splits, block_n=block_n, out=out, lse=lse,
                                               workspace=ws if splits > 1 else None)
        assert got_out is out and got_lse is lse
        r_out, r_lse = paged_attention_reference(*c.args(), scale=c.scale, causal=c.causal, layout=c.layout)
        (fa, fr), _ = TOL[c.q.dtype]
        torch.testing.assert_close(out, r_out, atol=fa, rtol=fr, msg=lambda m: f"out (splits {splits}): " + m)
        torch.testing.assert_close(lse, r_lse, atol=1e-4, rtol=1e-4, msg=lambda m: f"lse (splits {splits}): " + m)
        return out, lse

    KERNEL_CASES = {
        # lengths 1, 0 (empty), and not multiples of the page (16) or the tile (16) or the split size
        "bshd_p16_nq1": dict(lens=[1, 37, 0, 100], nq=1),
        "bhsd_p16_nq4_int64": dict(lens=[5, 37, 64], nq=4, layout="bhsd", table_dtype=torch.int64),
        "page1": dict(lens=[3, 19, 1], nq=1, page=1),
        "page64_bhsd": dict(lens=[70, 129, 2], nq=4, page=64, layout="bhsd"),
        "prefix_sharing_p16": dict(lens=[40, 45, 33], page=16, share_prefix=2, nq=4),
        "leftpad_p16": dict(lens=[20, 50, 7], leftpad=[3, 17, 7], nq=4),
        "contiguous_bshd": dict(lens=[6, 53, 0], page=None, nq=4, lmax=64),
        "contiguous_bhsd_noncausal": dict(lens=[6, 33], page=None, layout="bhsd", nq=4, causal=False, lmax=40,
                                          leftpad=[2, 0]),
        "gqa_32_8": dict(lens=[35, 90], hq=32, hkv=8, nq=1),
        "gqa_32_8_nq4": dict(lens=[1, 47], hq=32, hkv=8, nq=4, page=16),
        "mha": dict(lens=[17, 64, 0], hq=4, hkv=4, nq=4, page=16, leftpad=[0, 9, 0]),
        "fewer_keys_than_queries": dict(lens=[2, 5], nq=4, page=1),
        "value_head_dim": dict(lens=[30, 9], nq=2, d=64, dv=32, page=16),
    }

    @pytest.mark.parametrize("splits", [1, 3])
    @pytest.mark.parametrize("name", list(KERNEL_CASES))
    def test_decode_kernel(name, splits):
        check_kernel(make_cache(**KERNEL_CASES[name]), splits)

    def test_empty_rows_and_sequences():
        c = make_cache(lens=[0, 2], nq=4, page=16)
        out, lse = check_kernel(c, 2)
        assert torch.isneginf(lse[0]).all() and (out[0] == 0).all()
        assert torch.isneginf(lse[1, :, :2]).all() and (out[1, :2] == 0).all() and torch.isfinite(lse[1, :, 2:]).all()

    def test_fp32_and_many_splits():
        check_kernel(make_cache(lens=[100, 3, 77], nq=2, dtype=torch.float32, page=8), 7)

    def test_default_tiles_and_splits():
        # The launcher's own choices (64-key tiles, splits from the pretend SM count).
        c = make_cache(lens=[300, 129, 1], nq=1, page=16)
        assert decode.plan_splits(0, 3, 2, paged.capacity(c.k, c.table, c.layout), c.q.device, 64) == 1
        check_kernel(c, 0, block_n=64)
        check_kernel(c, 2, block_n=64)

    def test_strided_and_expanded_lengths():
        """Lengths and left pads given as a column of a wider tensor (the neighbour in memory poisoned) or
        expanded from one value: the kernel reads the values, not the memory after the first one."""
        import dataclasses

        c = make_cache(lens=[20, 50, 7], leftpad=[3, 17, 7], nq=4)
        wide = torch.stack([c.seqlens, torch.full_like(c.seqlens, 10 ** 6)], 1)  # column 1: an out-of-range length
        pads = torch.stack([c.leftpad, torch.full_like(c.leftpad, 45)], 1)
        check_kernel(dataclasses.replace(c, seqlens=wide[:, 0], leftpad=pads[:, 0]), 1)
        check_kernel(dataclasses.replace(c, seqlens=wide[:, 0], leftpad=pads[:, 0]), 3)
        same = make_cache(lens=[33, 33, 33], nq=2)
        one = torch.tensor([33], dtype=same.seqlens.dtype)
        check_kernel(dataclasses.replace(same, seqlens=one.expand(3)), 2)

    def test_op_dispatches_to_triton_under_interpreter():
        c = make_cache(lens=[21, 70], nq=2, page=16, share_prefix=1)
        a = paged.PagedArgs(*c.args(), c.scale, True, c.layout, 0)
        assert paged.choose(a).name == "triton"
        out, lse = run_op(c)
        r_out, r_lse = run_op(c, force_kernel="reference")
        (fa, fr), _ = TOL[torch.float16]
        torch.testing.assert_close(out, r_out, atol=fa, rtol=fr)
        torch.testing.assert_close(lse, r_lse, atol=1e-4, rtol=1e-4)
        bf = make_cache(lens=[21, 70], nq=2, page=16, dtype=torch.bfloat16)
        assert paged.choose(paged.PagedArgs(*bf.args(), bf.scale, True, bf.layout, 0)).name == "reference"
