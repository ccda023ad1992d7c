"""The NaN-key promise (README, "Numerics") on CUDA, through every kernel family that takes the site: a
key holding a NaN reaches exactly the rows that admit it, whether the op is called directly (run-time
dispatch, a kernel forced) or the site is lowered into Inductor's graph. cuDNN and mem-efficient receive
a bool mask or key lengths added (`NaN + (-inf)` is NaN): the NaN elements are zeroed for them and the
admitting rows made NaN (lowering/conventions.without_nan_keys)."""
from __future__ import annotations

import pytest
import torch

import fa_compile
import fa_compile.ops  # noqa: F401  (registers torch.ops.fa3)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

B, HQ, HKV, N, D = 2, 4, 2, 48, 64
J = 30  # the poisoned key
KERNELS = ["cudnn", "efficient", "flash", "triton", "reference"]


def _qkv(dtype: torch.dtype, seed: int = 0) -> tuple:
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(B, HQ, N, D, device="cuda", generator=g).to(dtype)
    k, v = (torch.randn(B, HKV, N, D, device="cuda", generator=g).to(dtype) for _ in range(2))
    return q, k, v


def _poisoned(k: torch.Tensor, value: float) -> torch.Tensor:
    k = k.clone()
    k[:, :, J, ::7] = value  # some elements of key J in every batch and head
    return k


_i = torch.arange(N)
_lens = torch.tensor([J, N])  # batch 0 excludes key J, batch 1 admits it


def _structures() -> dict:
    """name -> (op keyword arguments, CPU tensors; [B, N] bool: the rows that admit key J)."""
    rows_all = torch.ones(B, N, dtype=torch.bool)
    keep = (_i.view(N, 1) % 3 != 0) | (_i.view(1, N) != J)  # rows i % 3 == 0 exclude key J
    pad = _i.view(1, N) < _lens.view(B, 1)  # [B, Nk] key padding
    return {
        "bool_bias": (dict(bias=keep), (_i % 3 != 0).expand(B, N)),
        "key_padding_bias": (dict(bias=pad.view(B, 1, 1, N)), rows_all & (_lens.view(B, 1) > J)),
        "kv_lens": (dict(kv_lens=_lens), rows_all & (_lens.view(B, 1) > J)),
        "causal": (dict(causal=True), (_i >= J).expand(B, N)),
        "causal_kv_lens": (dict(causal=True, kv_lens=_lens), (_i >= J).expand(B, N) & (_lens.view(B, 1) > J)),
    }


STRUCTURES = list(_structures())


def _on_gpu(kw: dict) -> dict:
    return {n: t.cuda() if isinstance(t, torch.Tensor) else t for n, t in kw.items()}


def _op(q, k, v, kernel: str, **kw) -> torch.Tensor:
    return torch.ops.fa3.attention(q, k, v, D ** -0.5, force_kernel=kernel, **kw)[0]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("structure", STRUCTURES)
@pytest.mark.parametrize("kernel", KERNELS)
def test_nan_key_reaches_exactly_the_rows_that_admit_it(kernel, structure, dtype):
    kw, admits = _structures()[structure]
    kw = _on_gpu(kw)
    q, k, v = _qkv(dtype)
    try:
        clean = _op(q, k, v, kernel, **kw)
    except Exception as e:  # a kernel that does not take the site says so
        pytest.skip(f"{kernel}: {str(e).splitlines()[0]}")
    out = _op(q, _poisoned(k, float("nan")), v, kernel, **kw)
    nan = out.isnan()
    rows = admits.cuda().view(B, 1, N).expand(B, HQ, N)
    assert torch.equal(nan.any(-1), nan.all(-1)), "a row is partly NaN"
    assert torch.equal(nan.any(-1), rows), f"NaN rows {nan.any(-1).sum().item()}, admitting rows {rows.sum().item()}"
    # the rows that exclude key J do not depend on what it holds
    zeroed = _op(q, _poisoned(k, 0.0), v, kernel, **kw)
    torch.testing.assert_close(out[~rows], zeroed[~rows], atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(out[~rows], clean[~rows], atol=2e-3, rtol=2e-3)


def _key_padding_masked_fill(q, k, v, keep):
    s = q @ k.repeat_interleave(HQ // HKV, dim=1).transpose(-1, -2) * D ** -0.5
    s = s.masked_fill(~keep[:, None, None, :], float("-inf"))
    return s.softmax(-1) @ v.repeat_interleave(HQ // HKV, dim=1)


@pytest.mark.parametrize("kernel", [None, "cudnn", "triton"])
def test_compiled_key_padding_with_a_nan_key_matches_eager(kernel):
    """Eager's masked_fill replaces the NaN score of an excluded key: the lowered site must give the same
    rows, NaN only in the batch that admits the key."""
    q, k, v = _qkv(torch.bfloat16, seed=1)
    keep = _i.view(1, N).cuda() < _lens.view(B, 1).cuda()
    kp = _poisoned(k, float("nan"))
    want = _key_padding_masked_fill(q, kp, v, keep)
    torch._dynamo.reset()
    got = torch.compile(_key_padding_masked_fill, backend=fa_compile.backend(kernel=kernel))(q, kp, v, keep)
    assert not got[0].isnan().any(), "the batch that excludes the NaN key got NaN"
    assert got[1].isnan().all(), "the batch that admits the NaN key is not NaN"
    torch.testing.assert_close(got[0], want[0], atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("structure", ["key_padding_bias", "kv_lens"])
def test_nan_key_in_a_decode_step(structure):
    """One query token per sequence through the split-KV decode kernel: the batch whose lengths exclude
    the NaN key is exact, the other NaN."""
    kw = _on_gpu(_structures()[structure][0])
    q, k, v = _qkv(torch.bfloat16, seed=2)
    q = q[:, :, -1:].contiguous()
    with torch.no_grad():
        try:
            clean = _op(q, k, v, "decode", **kw)
        except Exception as e:
            pytest.skip(f"decode: {str(e).splitlines()[0]}")
        out = _op(q, _poisoned(k, float("nan")), v, "decode", **kw)
    assert not out[0].isnan().any() and out[1].isnan().all()
    torch.testing.assert_close(out[0], clean[0], atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("kernel", [None, "cudnn", "triton"])
def test_compiled_key_padding_with_a_nan_key_gradients_match_eager(kernel):
    """Training through a lowered site whose key-padding mask excludes a NaN key in batch 0 and admits it in batch 1:
    every gradient element is NaN exactly where eager's is (batch 0's dQ carries the key's NaN columns, 0 · NaN in
    dS · K; its dK and dV are finite), and equal to eager's (fp32) elsewhere."""
    q, k, v = _qkv(torch.float16, seed=3)
    keep = _i.view(1, N).cuda() < _lens.view(B, 1).cuda()
    kp = _poisoned(k, float("nan"))
    w = torch.randn(B, HQ, N, D, device="cuda", generator=torch.Generator(device="cuda").manual_seed(4))

    def grads(fn, dtype):
        leaves = [t.to(dtype).requires_grad_() for t in (q, kp, v)]
        out = fn(*leaves, keep)
        (out.float() * w).sum().backward()
        return [out] + [t.grad for t in leaves]

    want = grads(_key_padding_masked_fill, torch.float32)
    torch._dynamo.reset()
    got = grads(torch.compile(_key_padding_masked_fill, backend=fa_compile.backend(kernel=kernel)), torch.float16)
    assert not want[2][0].isnan().any() and want[1][0].isnan().any()  # the case is the one described
    for name, g, e in zip(("out", "dq", "dk", "dv"), got, want):
        nans = f"{name}: NaN in {int(g.isnan().sum())} elements, eager {int(e.isnan().sum())}"
        assert torch.equal(g.isnan(), e.isnan()), nans
        torch.testing.assert_close(g.float().nan_to_num(0), e.nan_to_num(0), atol=1e-2, rtol=1e-2,
                                   msg=lambda m, n=name: f"{n}: {m}")
