"""Test helpers for the Triton attention family: build a case, run it with poisoned outputs, compare
every element with the reference (fa_compile/kernels/reference.py). Shared by the interpreter and GPU tests."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import Tensor

from . import reference as ref
from . import triton_family as tf

# (forward atol/rtol, gradient atol/rtol): P is rounded to the input dtype before the P.V and
# dS.K / dS^T.Q products, so errors are a few units in the last place of that dtype.
TOL = {
    torch.float16: ((2e-3, 2e-3), (1e-2, 1e-2)),
    torch.bfloat16: ((1.6e-2, 1.6e-2), (6e-2, 6e-2)),
    torch.float32: ((1e-4, 1e-4), (5e-4, 5e-4)),  # interpreter: exact fp32 products
}
TOL_TF32 = ((2e-3, 2e-3), (1e-2, 1e-2))  # fp32 inputs on the GPU go through TF32


@dataclass
class Case:
    """Everything one kernel call takes; `args` duck-types fa_compile.dispatch.AttentionArgs."""

    q: Tensor
    k: Tensor
    v: Tensor
    scale: float
    causal: bool = False
    diag_offset: int = 0
    window_left: int = -1
    window_right: int = -1
    bias: Optional[Tensor] = None
    kv_lens: Optional[Tensor] = None
    softcap: float = 0.0
    dropout_p: float = 0.0
    dropout_seed: Optional[Tensor] = None
    needs_backward: bool = True
    bias_requires_grad: bool = False
    extra: dict = field(default_factory=dict)
    q_pos: Optional[Tensor] = None
    q_seg: Optional[Tensor] = None
    k_seg: Optional[Tensor] = None

    def mask_kwargs(self) -> dict:
        return dict(
            scale=self.scale, causal=self.causal, diag_offset=self.diag_offset, window_left=self.window_left,
            window_right=self.window_right, bias=self.bias, kv_lens=self.kv_lens, softcap=self.softcap,
            dropout_p=self.dropout_p, dropout_seed=self.dropout_seed, q_pos=self.q_pos, q_seg=self.q_seg,
            k_seg=self.k_seg,
        )


def make_case(
    *, b: int = 2, hq: int = 2, hkv: Optional[int] = None, nq: int = 33, nk: Optional[int] = None, d: int = 64,
    dv: Optional[int] = None, dtype=torch.float16, device="cpu", layout: str = "bhsd", seed: int = 0,
    bias_shape: Optional[tuple] = None, bias_bool: bool = False, bias_grad: bool = False, **kw,
) -> Case:
    """Random case; layout 'bshd' makes q/k/v transposed views of [B, N, H, D] storage."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    hkv = hkv or hq
    nk = nq if nk is None else nk
    dv = d if dv is None else dv

    def rnd(bb, h, n, dd):
        if layout == "bshd":
            return torch.randn(bb, n, h, dd, generator=g).to(device=device, dtype=dtype).transpose(1, 2)
        return torch.randn(bb, h, n, dd, generator=g).to(device=device, dtype=dtype)

    q, k, v = rnd(b, hq, nq, d), rnd(b, hkv, nk, d), rnd(b, hkv, nk, dv)
    bias = None
    if bias_shape is not None:
        if bias_bool:
            bias = (torch.rand(bias_shape, generator=g) > 0.3).to(device)
        else:
            bias = torch.randn(bias_shape, generator=g).to(device=device, dtype=dtype)
    if "kv_lens" in kw and kw["kv_lens"] is not None and not isinstance(kw["kv_lens"], Tensor):
        kw["kv_lens"] = torch.tensor(kw["kv_lens"], dtype=torch.int32, device=device)
    if kw.get("dropout_p", 0) > 0 and kw.get("dropout_seed") is None:
        kw["dropout_seed"] = torch.tensor(int(torch.randint(0, 2**62, (1,), generator=g)), device=device)
    return Case(q=q, k=k, v=v, scale=kw.pop("scale", d ** -0.5), bias=bias,
                bias_requires_grad=bias_grad and bias is not None and not bias_bool, **kw)


def poisoned_forward(case: Case) -> tuple[Tensor, Tensor]:
    b, hq, nq, _ = case.q.shape
    dv = case.v.shape[-1]
    out = torch.full((b, nq, hq, dv), float("nan"), dtype=case.q.dtype, device=case.q.device).transpose(1, 2)
    lse = torch.full((b, hq, nq), float("nan"), dtype=torch.float32, device=case.q.device)
    return tf.attention_forward(case, out=out, lse=lse)


def poisoned_backward(case: Case, dout: Tensor, out: Tensor, lse: Tensor):
    grads = tuple(torch.full_like(t, float("nan")) for t in (case.q, case.k, case.v))
    return tf.attention_backward(case, dout, out, lse, grads=grads)


def past_lens_filled(k: Tensor, v: Tensor, lens, poison: bool) -> tuple[Tensor, Tensor]:
    """Copies of k and v [B, H, Nk, D] whose rows past lens[b] hold 0 (poison False) or what uninitialised
    memory may hold (K NaN, V inf): a cache's unused slots, which the op never reads."""
    k, v = k.clone(), v.clone()
    for b, n in enumerate(lens.tolist() if isinstance(lens, Tensor) else lens):
        k[b, :, n:] = float("nan") if poison else 0.0
        v[b, :, n:] = float("inf") if poison else 0.0
    return k, v


def tolerances(dtype: torch.dtype, device) -> tuple:
    if dtype == torch.float32 and torch.device(device).type == "cuda":
        return TOL_TF32
    return TOL[dtype]


def check_case(case: Case, backward: bool = True) -> dict:
    """Run forward (and backward) with poisoned buffers; assert every element against the reference."""
    (fa, fr), (ga, gr) = tolerances(case.q.dtype, case.q.device)
    out, lse = poisoned_forward(case)
    r_out, r_lse = ref.attention_reference(case.q, case.k, case.v, **case.mask_kwargs())
    torch.testing.assert_close(out, r_out, atol=fa, rtol=fr, msg=lambda m: "out: " + m)
    lse_tol = 5e-3 if (case.q.dtype == torch.float32 and case.q.device.type == "cuda") else 1e-4  # TF32 scores
    torch.testing.assert_close(lse, r_lse, atol=lse_tol, rtol=lse_tol, msg=lambda m: "lse: " + m)
    res = {"out": out, "lse": lse}
    if not backward:
        return res
    g = torch.Generator(device="cpu").manual_seed(1234)
    dout = torch.randn(out.shape, generator=g).to(device=out.device, dtype=out.dtype)
    dq, dk, dv, dbias = poisoned_backward(case, dout, out, lse)
    r = ref.attention_backward_reference(
        dout, case.q, case.k, case.v, bias_requires_grad=case.bias_requires_grad, **case.mask_kwargs()
    )
    for name, got, want in (("dq", dq, r[0]), ("dk", dk, r[1]), ("dv", dv, r[2])):
        torch.testing.assert_close(got, want, atol=ga, rtol=gr, msg=lambda m, n=name: f"{n}: " + m)
    if case.bias_requires_grad:
        assert dbias is not None and dbias.shape == case.bias.shape
        torch.testing.assert_close(dbias.float(), r[3].float(), atol=ga, rtol=gr, msg=lambda m: "dbias: " + m)
    else:
        assert dbias is None
    res.update(dq=dq, dk=dk, dv=dv, dbias=dbias, dout=dout)
    return res


def run_under_interpreter(test_file: str, timeout: int = 900) -> None:
    """Run `test_file`'s tests in a child pytest with TRITON_INTERPRET=1 (the interpreter must be set
    before triton is imported, so the parent cannot switch it) and fail with the child's output."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, TRITON_INTERPRET="1")
    res = subprocess.run([sys.executable, "-m", "pytest", test_file, "-q", "-x", "-p", "no:cacheprovider"],
                         capture_output=True, text=True, env=env, timeout=timeout)
    assert res.returncode == 0, res.stdout[-8000:] + res.stderr[-4000:]
    assert " passed" in res.stdout, res.stdout[-2000:]


def eager_empty_fill(case: Case, kind: str, out: Tensor, lse: Tensor) -> Tensor:
    """The reference `out` with emit's empty-row fix-up applied (what eager gives on rows with no key):
    NaN ("nan") or the mean of V over all keys, repeated over each KV head's query heads ("mean_v")."""
    g = case.q.shape[1] // case.k.shape[1]
    if kind == "nan":
        fill = torch.full_like(out, float("nan"))
    else:
        fill = torch.mean(case.v, dim=2, keepdim=True).repeat_interleave(g, dim=1).to(out.dtype)
    return torch.where(torch.isneginf(lse).unsqueeze(-1), fill, out)


def finite_poison_empty(shape, stride, dtype: torch.dtype, device) -> Tensor:
    """An `_empty` replacement for the ops' output allocations: every element starts as 12345 (a NaN poison
    would hide a missing NaN write)."""
    return torch.empty_strided(shape, stride, dtype=dtype, device=device).fill_(12345.0)
