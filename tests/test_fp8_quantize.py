"""FP8 quantization, scaling and smoothing (fa_compile/kernels/fp8/quantize.py) and the emulation (reference.py), on CPU.

Scales and e4m3 values are checked exactly against a block-by-block loop; the smoothing identities
(softmax ignores k - kmean, lse gets q.kmean back) and the Hadamard rotation in fp32; the emulation
against the fp32 attention reference with error bounds that the method must meet."""
from __future__ import annotations

import math

import pytest
import torch

from fa_compile.kernels import reference as ref
from fa_compile.kernels.fp8 import FP8, fp8_reference, hadamard_matrix, quantize
from fa_compile.kernels.triton_testing import make_case


def _loop_scales(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(scales [B, H, nblocks], e4m3 values [B, H, N_pad, D]) by one block at a time."""
    b, h, n, d = x.shape
    nb = -(-n // block)
    scales = torch.empty(b, h, nb)
    vals = torch.zeros(b, h, nb * block, d, dtype=FP8)
    for i in range(b):
        for j in range(h):
            for blk in range(nb):
                t = x[i, j, blk * block:(blk + 1) * block].float()
                amax = t.abs().max() if t.numel() else torch.tensor(0.0)
                s = amax / 448 if amax > 0 else torch.tensor(1.0)
                scales[i, j, blk] = s
                vals[i, j, blk * block:blk * block + t.shape[0]] = (t / s).clamp(-448, 448).to(FP8)
    return scales, vals


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def _fp32_attention(q, k, v, scale, **kw):
    return ref.attention_reference(q.float(), k.float(), v.float(), scale=scale, **kw)


def _assert_lse_within_score_error(lse, want_lse, q, k, scale, block_m=16, block_n=16, **qkw):
    """lse is 1-Lipschitz in the max norm of the scores, and P's rounding does not enter it (the row
    sums are fp32): |lse - true lse| <= max_j |dequantized score - true score| on that row."""
    qz = quantize(q, k, k[..., :1].expand(*k.shape[:3], 32), block_m=block_m, block_n=block_n, **qkw)
    g = q.shape[1] // k.shape[1]
    nq, nk = q.shape[2], k.shape[2]
    qh = qz.q8.float() * qz.q_scale.repeat_interleave(block_m, 2)[..., None]
    kh = (qz.k8.float() * qz.k_scale.repeat_interleave(block_n, 2)[..., None]).repeat_interleave(g, 1)
    s_hat = qh @ kh.transpose(2, 3)
    if qz.qm_k is not None:
        s_hat = s_hat + qz.qm_k.repeat_interleave(block_m, 2)
    kt = k.float() - (qz.k_mean[:, :, None, :] if qz.k_mean is not None else 0.0)
    s_true = q.float() @ kt.repeat_interleave(g, 1).transpose(2, 3)
    bound = (s_hat[:, :, :nq, :nk] - s_true).abs().amax(-1) * scale + 1e-5
    finite = torch.isfinite(want_lse)
    assert torch.equal(finite, torch.isfinite(lse))
    assert ((lse - want_lse).abs()[finite] <= bound[finite]).all(), float(((lse - want_lse).abs() - bound).max())


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_scales_and_values_exact_without_smoothing(layout):
    c = make_case(b=2, hq=4, hkv=2, nq=37, nk=45, d=32, dv=64, layout=layout)
    qz = quantize(c.q, c.k, c.v, block_m=16, block_n=16, smooth_k=False)
    for x, s, v8 in ((c.q, qz.q_scale, qz.q8), (c.k, qz.k_scale, qz.k8)):
        ls, lv = _loop_scales(x, 16)
        assert torch.equal(s, ls)
        assert torch.equal(v8.view(torch.uint8), lv.view(torch.uint8))
    vamax = c.v.float().abs().amax(dim=2)
    assert torch.equal(qz.v_scale, vamax / 448)
    want = (c.v.float() / qz.v_scale[:, :, None, :]).to(FP8)
    assert qz.v8t.shape == (2, 2, 64, 48)  # transposed, keys padded to whole blocks
    assert torch.equal(qz.v8t[..., :45].transpose(2, 3).view(torch.uint8), want.view(torch.uint8))
    assert (qz.v8t[..., 45:].float() == 0).all() and (qz.k8[:, :, 45:].float() == 0).all()
    assert qz.q_kmean is None and qz.k_mean is None


def test_int8_qk_scales_and_values_exact():
    c = make_case(b=2, hq=4, hkv=2, nq=37, nk=45, d=32)
    c.q[:, 1, :16] = 0  # a zero block: scale 1
    qz = quantize(c.q, c.k, c.v, block_m=16, block_n=16, smooth_k=False, qk_int8=True)
    assert qz.q8.dtype == torch.int8 and qz.k8.dtype == torch.int8 and qz.v8t.dtype == FP8
    for x, s, v8 in ((c.q, qz.q_scale, qz.q8), (c.k, qz.k_scale, qz.k8)):
        xp = torch.nn.functional.pad(x.float(), (0, 0, 0, v8.shape[2] - x.shape[2]))
        for blk in range(s.shape[2]):
            t = xp[:, :, blk * 16:(blk + 1) * 16]
            amax = t.abs().amax(dim=(2, 3))
            want_s = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
            assert torch.equal(s[:, :, blk], want_s)
            want = torch.round(t / want_s[..., None, None]).clamp(-127, 127).to(torch.int8)
            assert torch.equal(v8[:, :, blk * 16:(blk + 1) * 16], want)
    assert qz.q_scale[0, 1, 0] == 1 and (qz.q8[:, 1, :16] == 0).all()


def test_int8_qk_is_more_accurate_on_gaussian_inputs():
    c = make_case(b=1, hq=4, nq=256, nk=256, d=64)
    want, want_lse = _fp32_attention(c.q, c.k, c.v, c.scale)
    e4m3, _ = fp8_reference(c.q, c.k, c.v, c.scale, block_m=64, block_n=64)
    int8, lse = fp8_reference(c.q, c.k, c.v, c.scale, block_m=64, block_n=64, qk_int8=True)
    assert _rel(int8, want) < 0.85 * _rel(e4m3, want)
    _assert_lse_within_score_error(lse, want_lse, c.q, c.k, c.scale, block_m=64, block_n=64, qk_int8=True,
                                   hadamard=True)


def test_zero_blocks_get_scale_one():
    c = make_case(b=1, hq=2, nq=40, nk=40, d=32)
    c.q[:, 0, 16:32] = 0  # one whole query block
    c.k[:, 1, :16] = 0
    c.v[:, :, :, 3] = 0  # one value channel
    qz = quantize(c.q, c.k, c.v, block_m=16, block_n=16, smooth_k=False)
    assert qz.q_scale[0, 0, 1] == 1 and qz.k_scale[0, 1, 0] == 1 and (qz.v_scale[0, :, 3] == 1).all()
    assert (qz.q8[0, 0, 16:32].float() == 0).all() and (qz.k8[0, 1, :16].float() == 0).all()
    for t in (qz.q_scale, qz.k_scale, qz.v_scale):
        assert torch.isfinite(t).all() and (t > 0).all()
    out, lse = fp8_reference(c.q, c.k, c.v, c.scale, block_m=16, block_n=16)
    assert torch.isfinite(out.float()).all() and torch.isfinite(lse).all()


def test_k_smoothing_mean_and_values_gqa():
    c = make_case(b=2, hq=4, hkv=2, nq=20, nk=35, d=32)
    c.k = c.k + 5.0
    qz = quantize(c.q, c.k, c.v, block_m=16, block_n=16)
    mean = c.k.float().mean(dim=2)
    torch.testing.assert_close(qz.k_mean, mean, atol=1e-6, rtol=0)
    ls, lv = _loop_scales(c.k.float() - qz.k_mean[:, :, None, :], 16)
    assert torch.equal(qz.k_scale, ls) and torch.equal(qz.k8.view(torch.uint8), lv.view(torch.uint8))
    # query head h reads kv-head h // 2
    want = torch.einsum("bhnd,bhd->bhn", c.q.float(), mean.repeat_interleave(2, dim=1))
    torch.testing.assert_close(qz.q_kmean, want, atol=1e-5, rtol=1e-6)


def test_k_smoothing_invariance_and_lse_correction():
    # In fp32: softmax(q.(k - kmean)) = softmax(q.k); lse(q.(k - kmean)) + scale * q.kmean = lse(q.k).
    c = make_case(b=2, hq=4, hkv=2, nq=24, nk=31, d=32, dtype=torch.float32)
    c.k = c.k + torch.randn(32) * 4
    qz = quantize(c.q, c.k, c.v, block_m=16, block_n=16)
    ks = c.k - qz.k_mean[:, :, None, :]
    o1, l1 = _fp32_attention(c.q, c.k, c.v, c.scale, causal=True)
    o2, l2 = _fp32_attention(c.q, ks, c.v, c.scale, causal=True)
    torch.testing.assert_close(o2, o1, atol=2e-6, rtol=2e-6)
    torch.testing.assert_close(l2 + c.scale * qz.q_kmean, l1, atol=1e-5, rtol=1e-6)


def test_k_smoothing_pays_on_a_shared_offset():
    c = make_case(b=1, hq=2, nq=64, nk=64, d=64)
    c.k = (c.k.float() + 8.0 * torch.randn(64)).half()
    want, want_lse = _fp32_attention(c.q, c.k, c.v, c.scale)
    plain, _ = fp8_reference(c.q, c.k, c.v, c.scale, smooth_k=False, block_m=16, block_n=16)
    smooth, lse = fp8_reference(c.q, c.k, c.v, c.scale, block_m=16, block_n=16)
    assert _rel(smooth, want) < 0.5 * _rel(plain, want)
    _assert_lse_within_score_error(lse, want_lse, c.q, c.k, c.scale)  # the true lse, not the smoothed one


def test_kv_lens_mean_over_valid_keys_and_garbage_ignored():
    c = make_case(b=3, hq=2, nq=18, nk=40, d=32, kv_lens=[40, 9, 0])
    clean = quantize(c.q, c.k, c.v, block_m=16, block_n=16, kv_lens=c.kv_lens)
    torch.testing.assert_close(clean.k_mean[1], c.k[1, :, :9].float().mean(1), atol=1e-6, rtol=0)
    assert (clean.k_mean[2] == 0).all()
    assert (clean.k8[1, :, 9:].float() == 0).all() and (clean.v8t[1, :, :, 9:].float() == 0).all()
    k, v = c.k.clone(), c.v.clone()
    k[1, :, 9:] = float("nan")
    v[1, :, 9:] = 1e4
    dirty = quantize(c.q, k, v, block_m=16, block_n=16, kv_lens=c.kv_lens)
    for name in ("q8", "k8", "v8t"):
        assert torch.equal(getattr(dirty, name).view(torch.uint8), getattr(clean, name).view(torch.uint8)), name
    for name in ("q_scale", "k_scale", "v_scale", "q_kmean", "k_mean"):
        assert torch.equal(getattr(dirty, name), getattr(clean, name)), name
    out, lse = fp8_reference(c.q, k, v, c.scale, kv_lens=c.kv_lens, block_m=16, block_n=16)
    assert torch.isneginf(lse[2]).all() and (out[2] == 0).all()
    want, want_lse = _fp32_attention(c.q, c.k, c.v, c.scale, kv_lens=c.kv_lens)
    assert _rel(out[:2], want[:2]) < 0.08
    _assert_lse_within_score_error(lse, want_lse, c.q, c.k, c.scale, kv_lens=c.kv_lens)


def test_q_smoothing_pieces():
    c = make_case(b=1, hq=4, hkv=2, nq=37, nk=29, d=32)
    c.q = (c.q.float() + 3.0).half()
    qz = quantize(c.q, c.k, c.v, block_m=16, block_n=16, smooth_q=True)
    qf = torch.nn.functional.pad(c.q.float(), (0, 0, 0, 48 - 37))
    rows = torch.arange(48) < 37
    for blk in range(3):
        sl = slice(blk * 16, (blk + 1) * 16)
        mean = qf[:, :, sl][:, :, rows[sl]].mean(2)
        torch.testing.assert_close(qz.q_mean[:, :, blk], mean, atol=1e-6, rtol=0)
    ks = torch.nn.functional.pad(c.k.float() - qz.k_mean[:, :, None, :], (0, 0, 0, 32 - 29))
    want = qz.q_mean @ ks.repeat_interleave(2, dim=1).transpose(2, 3)
    torch.testing.assert_close(qz.qm_k, want, atol=1e-5, rtol=1e-6)
    # dequantized Q + its block mean gives q back within e4m3's rounding
    deq = qz.q8.float() * qz.q_scale.repeat_interleave(16, 2)[..., None] + qz.q_mean.repeat_interleave(16, 2)
    assert _rel(deq[:, :, :37], c.q) < 0.05
    want_o, _ = _fp32_attention(c.q, c.k, c.v, c.scale)
    out, _ = fp8_reference(c.q, c.k, c.v, c.scale, smooth_q=True, block_m=16, block_n=16)
    assert _rel(out, want_o) < 0.08


@pytest.mark.parametrize("d", [32, 64, 128])
def test_hadamard_round_trip(d):
    r = hadamard_matrix(d, "cpu")
    assert set(r.unique().tolist()) == {-1.0, 1.0}
    assert torch.equal(r @ r.T, d * torch.eye(d))  # integers: exact
    assert torch.equal(hadamard_matrix(d, "cpu"), r)  # fixed signs
    q, k = torch.randn(3, d), torch.randn(5, d)
    torch.testing.assert_close((q @ r / d) @ (k @ r).T, q @ k.T, atol=1e-5 * math.sqrt(d), rtol=1e-5)
    c = make_case(b=1, hq=2, nq=20, nk=20, d=d, dtype=torch.float32)
    qz = quantize(c.q, c.k, c.v, block_m=16, block_n=16, hadamard=True)
    torch.testing.assert_close(qz.k_mean, (c.k.mean(2) @ r), atol=1e-5, rtol=1e-5)  # the rotated mean
    torch.testing.assert_close(qz.q_kmean, torch.einsum("bhnd,bhd->bhn", c.q, c.k.mean(2)), atol=1e-5, rtol=1e-5)


def test_hadamard_spreads_outlier_channels():
    c = make_case(b=1, hq=2, nq=64, nk=64, d=64)
    c.q[..., 5] *= 40
    c.k[..., 5] *= 40
    want, _ = _fp32_attention(c.q, c.k, c.v, c.scale)
    out, _ = fp8_reference(c.q, c.k, c.v, c.scale, hadamard=True, block_m=16, block_n=16)
    assert _rel(out, want) < 0.08
    with pytest.raises(ValueError, match="power-of-two"):
        quantize(c.q[..., :48], c.k[..., :48], c.v, block_m=16, block_n=16, hadamard=True)


def test_prequantized_inputs_take_descales():
    c = make_case(b=2, hq=2, nq=20, nk=20, d=32)
    q8, k8, v8 = (t.to(FP8) for t in (c.q, c.k, c.v))
    ds = torch.rand(2, 2) + 0.5
    qz = quantize(q8, k8, v8, block_m=16, block_n=16, q_descale=ds, k_descale=ds * 2, v_descale=ds * 3)
    assert torch.equal(qz.q_scale, ds[:, :, None].expand(2, 2, 2)) and torch.equal(qz.k_scale[..., 1], ds * 2)
    assert torch.equal(qz.v_scale, (ds * 3)[:, :, None].expand(2, 2, 32))
    assert torch.equal(qz.q8[:, :, :20].view(torch.uint8), q8.view(torch.uint8))
    out, lse = fp8_reference(q8, k8, v8, c.scale, q_descale=ds, k_descale=ds, v_descale=ds, block_m=16, block_n=16)
    assert out.dtype == torch.bfloat16
    want, want_lse = _fp32_attention(q8.float() * ds[..., None, None], k8.float() * ds[..., None, None],
                                     v8.float() * ds[..., None, None], c.scale)
    assert _rel(out, want) < 0.05
    torch.testing.assert_close(lse, want_lse, atol=1e-4, rtol=1e-5)  # exact scores: only P is rounded


def test_bad_inputs_name_the_argument():
    c = make_case(b=1, hq=2, nq=16, nk=16, d=32)
    with pytest.raises(ValueError, match="k and v must be too"):
        quantize(c.q.to(FP8), c.k, c.v, block_m=16, block_n=16)
    with pytest.raises(ValueError, match="descale must have shape"):
        quantize(c.q.to(FP8), c.k.to(FP8), c.v.to(FP8), block_m=16, block_n=16, q_descale=torch.ones(2))


@pytest.mark.parametrize("kw", [dict(causal=True, diag_offset=3), dict(window_left=6, window_right=2),
                                dict(bias_shape=(1, 2, 30, 41)), dict(bias_shape=(2, 1, 1, 41), bias_bool=True)],
                         ids=["causal", "window", "bias", "keymask"])
def test_emulation_is_attention(kw):
    c = make_case(b=2, hq=2, nq=30, nk=41, d=64, **kw)
    mk = dict(causal=c.causal, diag_offset=c.diag_offset, window_left=c.window_left, window_right=c.window_right,
              bias=c.bias)
    want, want_lse = _fp32_attention(c.q, c.k, c.v, c.scale, **mk)
    out, lse = fp8_reference(c.q, c.k, c.v, c.scale, block_m=16, block_n=16, **mk)
    assert out.dtype == torch.float16 and out.shape == want.shape and out.transpose(1, 2).is_contiguous()
    assert _rel(out, want) < 0.08
    _assert_lse_within_score_error(lse, want_lse, c.q, c.k, c.scale)
