"""fa3::dropped_uniform_rows against eager's arithmetic in fp64 with the op's keep mask: the value on fully
masked rows (lse -inf), 0 elsewhere, and the gradients of q, k and v (the mask added: qk_grad 1; a clamp tying
every score: 0.5; a fill that cuts it: 0), with GQA and a softcap. Every element."""
from __future__ import annotations

import pytest
import torch

import fa_compile.ops  # noqa: F401  (registers the op)
from fa_compile.kernels.dropout_hash import dropout_keep_mask

B, HQ, HKV, NQ, NK, D = 3, 4, 2, 5, 7, 6
P, SCALE = 0.3, 0.7
MIN32 = torch.finfo(torch.float32).min
OP = torch.ops.fa3.dropped_uniform_rows


def _pad() -> torch.Tensor:
    pad = torch.ones(B, NK, dtype=torch.bool)
    pad[1] = False  # batch 1: every key masked
    pad[2, 3:] = False
    return pad


def _eager(q, k, v, pad, seed, softcap: float, qk_grad: float):
    g = HQ // HKV
    raw = q @ k.repeat_interleave(g, 1).mT * SCALE
    s = softcap * torch.tanh(raw / softcap) if softcap else raw
    m = ~pad[:, None, None, :]
    if qk_grad == 0:  # masked_fill: eager's gradient of the masked scores is cut
        s = s.masked_fill(m, MIN32)
    elif qk_grad == 1:
        s = s + m.double() * MIN32
    else:  # the clamp max(s + mask, finfo.min): every absorbed score ties it, torch.maximum halves its gradient
        s = torch.maximum(s + m.double() * MIN32, torch.tensor(MIN32, dtype=torch.float64))
    keep = dropout_keep_mask(seed, B, HQ, NQ, NK, P, q.device)
    return (s.softmax(-1) * keep / (1 - P)) @ v.repeat_interleave(g, 1)


@pytest.mark.parametrize("softcap", [0.0, 2.0])
@pytest.mark.parametrize("qk_grad", [0.0, 0.5, 1.0])
def test_value_and_gradients_equal_eagers_on_fully_masked_rows(softcap, qk_grad):
    torch.manual_seed(int(softcap * 10 + qk_grad * 2))
    q = torch.randn(B, HQ, NQ, D, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(B, HKV, NK, D, dtype=torch.float64, requires_grad=True) for _ in range(2))
    seed = torch.tensor(1234)
    lse = torch.zeros(B, HQ, NQ)
    lse[1] = float("-inf")  # the op's lse: -inf exactly on the rows that admit no key
    empty = torch.isneginf(lse).unsqueeze(-1)
    want = _eager(q, k, v, _pad(), seed, softcap, qk_grad)
    got = OP(q, k, v, lse, seed, P, SCALE, softcap, qk_grad)
    assert got.dtype == torch.float64 and got.shape == (B, HQ, NQ, D)
    torch.testing.assert_close(got, torch.where(empty, want, 0.0), atol=1e-12, rtol=1e-12)
    assert not torch.allclose(got[1], v[1].mean(1, keepdim=True).repeat_interleave(2, 0).expand(HQ, NQ, D))

    dout = torch.randn(B, HQ, NQ, D, dtype=torch.float64) * empty  # the where after the op passes those rows only
    want_g = torch.autograd.grad((want * dout).sum(), (q, k, v))
    got_g = torch.autograd.grad((got * dout).sum(), (q, k, v), allow_unused=True)
    for name, a, e in zip("qkv", got_g, want_g):
        if qk_grad == 0 and name in "qk":
            assert a is None, name
            assert e.abs().max() == 0, name  # eager's masked_fill gives them nothing on those rows either
            continue
        torch.testing.assert_close(a, e, atol=1e-12, rtol=1e-12, msg=lambda m, n=name: f"d{n}: {m}")
        assert e.abs().max() > 1e-3, name


def test_no_fully_masked_row_gives_zeros_in_the_inputs_layouts():
    q = torch.randn(B, NQ, HQ, D).transpose(1, 2)  # BSHD memory, as projections viewed as heads are
    k, v = (torch.randn(B, NK, HKV, D).transpose(1, 2) for _ in range(2))
    lse = torch.zeros(B, HQ, NQ)
    seed = torch.tensor(5)
    assert OP(q, k, v, lse, seed, P, SCALE).abs().max() == 0
    grads = torch.ops.fa3.dropped_uniform_rows_backward(torch.randn(B, HQ, NQ, D), q, k, v, lse, seed, P, SCALE,
                                                         0.0, 1.0)
    for g, like in zip(grads, (q, k, v)):
        assert g.abs().max() == 0 and g.stride() == like.stride() and g.dtype == like.dtype


@pytest.mark.parametrize("shape", [(B, 0, NQ, D), (0, HQ, NQ, D), (B, HQ, 0, D)], ids=["no heads", "no batch", "no query"])
def test_zero_sizes_give_empty_results(shape):
    # as eager: no head (or batch, or query) at all is an empty result, not a head-count error
    q = torch.randn(shape, requires_grad=True)
    kv_shape = (shape[0], shape[1] // 2, NK, D)
    k, v = (torch.randn(kv_shape, requires_grad=True) for _ in range(2))
    lse = torch.full(shape[:3], float("-inf"))
    out = OP(q, k, v, lse, torch.tensor(5), P, SCALE, 0.0, 1.0)
    assert out.shape == shape
    out.sum().backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape and v.grad.shape == v.shape


@pytest.mark.parametrize("change, message", [
    (dict(dropout_p=0.0), "dropout_p"),
    (dict(softcap=-1.0), "softcap"),
    (dict(k=torch.randn(B, 3, NK, D)), "k: 3 key heads"),
    (dict(lse=torch.zeros(B, HQ)), "lse: expected shape"),
])
def test_bad_arguments_name_the_argument(change, message):
    args = dict(q=torch.randn(B, HQ, NQ, D), k=torch.randn(B, HKV, NK, D), v=torch.randn(B, HKV, NK, D),
                lse=torch.zeros(B, HQ, NQ), seed=torch.tensor(1), dropout_p=P, scale=SCALE, softcap=0.0)
    args.update(change)
    with pytest.raises(ValueError, match=message):
        OP(*args.values())


def test_a_triton_kernel_that_fails_falls_back_to_the_torch_path_with_one_warning(monkeypatch):
    from fa_compile import dropped_rows

    def broken(*a, **kw):
        raise RuntimeError("no kernel here")

    monkeypatch.setattr(dropped_rows, "_on_triton", lambda *a: True)
    monkeypatch.setattr(dropped_rows, "fill_triton", broken)
    monkeypatch.setattr(dropped_rows, "backward_triton", broken)
    monkeypatch.setattr(dropped_rows, "_TRITON_FAILED", [])
    q, k, v = torch.randn(B, HQ, NQ, D), torch.randn(B, HKV, NK, D), torch.randn(B, HKV, NK, D)
    lse = torch.zeros(B, HQ, NQ)
    lse[1] = float("-inf")
    seed = torch.tensor(3)
    with pytest.warns(RuntimeWarning, match="dropped-rows Triton kernels failed"):
        got = OP(q, k, v, lse, seed, P, SCALE)
    torch.testing.assert_close(got, dropped_rows.fill_torch(q, v, lse, seed, P))
    grads = torch.ops.fa3.dropped_uniform_rows_backward(torch.randn(B, HQ, NQ, D), q, k, v, lse, seed, P, SCALE,
                                                         0.0, 1.0)  # no second warning: the torch path from now on
    assert grads[2][1:2].abs().max() > 0
