"""The Triton attention kernels on a CUDA GPU (bf16 / fp16, larger and odd shapes), against the
reference op computed on the same device in fp32. Skipped without CUDA (CI has none)."""
from __future__ import annotations

import pytest
import torch

from fa_compile.kernels import triton_family as tf

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or not tf.triton_available(), reason="needs CUDA and triton"),
]

BF16, F16 = torch.bfloat16, torch.float16


def _check(**kw):
    from fa_compile.kernels.triton_testing import check_case, make_case

    torch.manual_seed(0)
    return check_case(make_case(device="cuda", **kw))


def _hopper_gluon() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9 and tf.gluon_available()


@pytest.fixture(params=["tl", "gluon"])
def fwd_path(request, monkeypatch):
    """Run a structural-mask case through the `tl` forward and through the Gluon forward (Hopper only)."""
    if request.param == "tl":
        monkeypatch.setenv("FA_COMPILE_GLUON", "0")
    elif not _hopper_gluon():
        pytest.skip("the Gluon forward runs on Hopper only")
    for name in ("attn_fwd_gluon_kernel", "attn_fwd_kernel", "attn_bwd_gluon_kernel"):
        tf.LAST_COMPILED.pop(name, None)
    yield request.param
    # The path asked for is the one that ran.
    ran_gluon = "attn_fwd_gluon_kernel" in tf.LAST_COMPILED
    assert ran_gluon == (request.param == "gluon")
    if request.param == "tl":
        assert "attn_bwd_gluon_kernel" not in tf.LAST_COMPILED


@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("d", [64, 80, 128, 256])
def test_dense(dtype, d, fwd_path):
    _check(b=2, hq=4, nq=317, nk=450, d=d, dtype=dtype, layout="bshd")


@pytest.mark.parametrize("off", ["top_left", "bottom_right"])
@pytest.mark.parametrize("d", [64, 128])
def test_causal_gqa(off, d, fwd_path):
    nq, nk = 300, 520
    _check(b=2, hq=8, hkv=2, nq=nq, nk=nk, d=d, dtype=BF16, causal=True, diag_offset=0 if off == "top_left" else nk - nq)


def test_window_kv_lens_fp16(fwd_path):
    _check(b=3, hq=4, nq=400, nk=400, d=96, dtype=F16, window_left=70, window_right=10, kv_lens=[400, 0, 257])


@pytest.mark.skipif(not _hopper_gluon(), reason="the Gluon forward runs on Hopper only")
@pytest.mark.parametrize("d,cfg,kw", [
    (128, (128, 128, 2, False), dict(causal=True)),
    (128, (128, 128, 3, False, True), dict(causal=True, diag_offset=-37)),
    (128, (128, 64, 2, True), dict(causal=True, diag_offset=-37, kv_lens=[901, 130])),
    (128, (128, 128, 3, False, True), dict(window_left=300, window_right=40)),
    (128, (128, 64, 3, True, True), dict(window_left=100, window_right=0, kv_lens=[901, 3])),
    (64, (128, 128, 2, True, True), dict(kv_lens=[0, 640])),
    (64, (128, 128, 2, True), dict(causal=True)),
    (256, (128, 64, 2, False, True), dict(causal=True, diag_offset=201)),
    (256, (128, 32, 3, False), dict()),
    (192, (128, 64, 2, False), dict(dv=128)),
    (192, (128, 64, 2, False, True), dict(dv=128, causal=True)),
    # Persistent (each of 5 programs walks several of the 48 tiles): O in a tile of its own or in Q's slot.
    (128, (128, 128, 2, False, True, True), dict(causal=True, diag_offset=-37, kv_lens=[901, 130])),
    (128, (128, 128, 3, False, True, True), dict(window_left=100, window_right=0, kv_lens=[901, 3])),
    (64, (128, 128, 2, True, False, True), dict(kv_lens=[0, 640])),
    (256, (128, 64, 2, False, False, True), dict(causal=True, diag_offset=201)),
    (192, (128, 64, 2, False, True, True), dict(dv=128, kv_lens=[77, 901])),
], ids=["d128", "d128_pp_neg_offset", "d128_n64_lens", "d128_pp_window", "d128_qreg_window_lens", "d64_pp_lens",
        "d64_causal", "d256_pp_br", "d256_n32", "mla", "mla_pp_causal", "persistent_d128_own_o",
        "persistent_d128_o_in_q", "persistent_d64_qreg_empty_seq", "persistent_d256", "persistent_mla"])
def test_gluon_forward_configs(d, cfg, kw, monkeypatch):
    # Every tile shape the tuning compares, on ragged GQA shapes with masks that leave some rows empty.
    bm, bn, st, qreg, *pp = cfg
    persistent = len(pp) > 1 and pp[1]
    want = tf.BlockConfig(bm, bn, 4, st, qreg=qreg, pingpong=bool(pp and pp[0]), persistent=persistent)
    if persistent:
        monkeypatch.setattr(tf, "sm_count", lambda device: 5)
    key = max(64, 1 << (max(d, kw.get("dv", d)) - 1).bit_length())
    monkeypatch.setitem(tf.CONFIG_OVERRIDE, ("fwd_gluon", key), want)
    tf.LAST_COMPILED.pop("attn_fwd_gluon_kernel", None)
    _check(b=2, hq=4, hkv=2, nq=700, nk=901, d=d, dtype=BF16, layout="bshd", **kw)
    assert tf.LAST_COMPILED["attn_fwd_gluon_kernel"][0] == want  # 6 query blocks: persistent under a mask too


@pytest.mark.parametrize("shape", [(1, 4, 257, 300), (257, 300), (2, 1, 1, 300)], ids=["heads", "2d", "keys"])
def test_float_bias_grad(shape):
    _check(b=2, hq=4, nq=257, nk=300, d=64, dtype=BF16, bias_shape=shape, bias_grad=True)


def test_bool_mask_softcap_dropout():
    _check(b=2, hq=4, hkv=2, nq=200, nk=333, d=128, dtype=F16, bias_shape=(2, 1, 200, 333), bias_bool=True,
           softcap=20.0, dropout_p=0.2)


def test_fp32_tf32():
    prev = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        _check(b=1, hq=2, nq=130, nk=190, d=64, dtype=torch.float32, causal=True)
    finally:
        torch.set_float32_matmul_precision(prev)


def test_deterministic_backward():
    from fa_compile.kernels.triton_testing import make_case, poisoned_backward, poisoned_forward

    case = make_case(device="cuda", b=2, hq=8, hkv=2, nq=512, nk=512, d=128, dtype=BF16, causal=True)
    out, lse = poisoned_forward(case)
    dout = torch.randn_like(out)
    tf.LAST_COMPILED.pop("attn_bwd_gluon_kernel", None)
    tf.LAST_COMPILED.pop("attn_bwd_dq_kernel", None)
    torch.use_deterministic_algorithms(True)
    try:
        a = poisoned_backward(case, dout, out, lse)
        b = poisoned_backward(case, dout, out, lse)
    finally:
        torch.use_deterministic_algorithms(False)
    for x, y in zip(a[:3], b[:3]):
        assert torch.equal(x, y)
    assert "attn_bwd_gluon_kernel" not in tf.LAST_COMPILED  # its dQ atomics are order-dependent
    assert "attn_bwd_dq_kernel" in tf.LAST_COMPILED  # and so are the fused tl backward's


@pytest.mark.parametrize("mode", ["1", "0"], ids=["fused_dq", "dq_kernel"])
@pytest.mark.parametrize("kw", [
    dict(b=4, hq=4, nq=300, nk=300, d=64, bias_shape=(4, 1, 1, 300), bias_bool=True, dropout_p=0.1,
         kv_lens=[300, 170, 0, 41]),
    dict(b=2, hq=8, hkv=2, nq=333, nk=520, d=128, causal=True, diag_offset=187, layout="bshd"),
    dict(b=1, hq=2, nq=200, nk=257, d=256, softcap=20.0, window_left=64),
], ids=["d64_keymask_dropout_kvlens", "d128_causal_gqa", "d256_softcap_window"])
def test_tl_backward_dq_paths(kw, mode, monkeypatch):
    # dQ added by the dK/dV kernel's atomics (fuses_dq) or by the dQ kernel; Gluon off so the tl pair runs
    monkeypatch.setenv("FA_COMPILE_FUSED_DQ", mode)
    monkeypatch.setenv("FA_COMPILE_GLUON", "0")
    tf.LAST_COMPILED.pop("attn_bwd_dq_kernel", None)
    _check(dtype=BF16, **kw)
    assert ("attn_bwd_dq_kernel" in tf.LAST_COMPILED) == (mode == "0")


@pytest.mark.skipif(not _hopper_gluon(), reason="the Gluon backward runs on Hopper only")
@pytest.mark.parametrize("d,cfg,kw", [
    (128, (64, 2), dict(causal=True)),
    (128, (64, 2), dict(causal=True, diag_offset=-37, kv_lens=[901, 130])),
    (128, (64, 2), dict(window_left=300, window_right=40, layout="bhsd")),
    (128, (64, 2), dict(window_left=100, window_right=0, kv_lens=[901, 0])),
    (128, (64, 2), dict(hkv=1, causal=True, diag_offset=201)),
    (64, (64, 2), dict(causal=True, dtype=torch.float16)),
    (64, (64, 3), dict(kv_lens=[0, 640])),
    (64, (128, 2), dict(causal=True, diag_offset=201)),
    (96, (64, 2), dict()),
    (128, (64, 2), dict(dv=64, causal=True)),
    (64, (64, 3), dict(dropout_p=0.2, kv_lens=[0, 640])),
    (128, (64, 2), dict(causal=True, dropout_p=0.1, hkv=1)),
    (64, (64, 3), dict(bias_shape=(2, 1, 1, 901), bias_bool=True, dropout_p=0.1, dtype=torch.float16)),
    (128, (64, 2), dict(bias_shape=(901,), bias_bool=True, window_left=200, window_right=30)),
], ids=["d128_causal", "d128_neg_offset_lens", "d128_window_bhsd", "d128_window_lens0", "d128_mqa_br",
        "d64_causal_fp16", "d64_s3_lens0", "d64_m128_br", "d96", "d128_dv64", "d64_dropout_lens0",
        "d128_causal_dropout_mqa", "d64_keymask_dropout_fp16", "d128_keymask_window"])
def test_gluon_backward(d, cfg, kw, monkeypatch):
    # Every element of dQ / dK / dV against the reference, on ragged GQA shapes whose masks leave some
    # query rows and some key blocks empty, under each tile the tuning compares.
    bm, st = cfg
    want = tf.BlockConfig(bm, 128, 8, st)
    key = max(64, 1 << (max(d, kw.get("dv", d)) - 1).bit_length())
    monkeypatch.setitem(tf.CONFIG_OVERRIDE, ("bwd_gluon", key), want)
    tf.LAST_COMPILED.pop("attn_bwd_gluon_kernel", None)
    kw = dict(dict(b=2, hq=4, hkv=2, dtype=BF16, layout="bshd"), **kw)
    _check(nq=700, nk=901, d=d, **kw)
    assert tf.LAST_COMPILED["attn_bwd_gluon_kernel"][0] == want


def test_gluon_backward_not_for_bias_or_softcap():
    # A float bias with its gradient, and softcap: the tl backward (checked element by element).
    if not _hopper_gluon():
        pytest.skip("the Gluon backward runs on Hopper only")
    for kw in (dict(bias_shape=(1, 4, 300, 411), bias_grad=True), dict(softcap=30.0)):
        tf.LAST_COMPILED.pop("attn_bwd_gluon_kernel", None)
        _check(b=2, hq=4, nq=300, nk=411, d=128, dtype=BF16, layout="bshd", **kw)
        assert "attn_bwd_gluon_kernel" not in tf.LAST_COMPILED


@pytest.mark.parametrize("causal", [False, True])
def test_pointer_path_without_tma(causal, monkeypatch):
    # The Ampere-safe forward (plain pointer loads), as taken on 8.x or with unaligned strides.
    monkeypatch.setenv("FA_COMPILE_TRITON_TMA", "0")
    tf.LAST_COMPILED.pop("attn_fwd_gluon_kernel", None)
    _check(b=2, hq=4, hkv=2, nq=300, nk=411, d=128, dtype=BF16, causal=causal, layout="bshd")
    assert "attn_fwd_gluon_kernel" not in tf.LAST_COMPILED  # Gluon needs TMA too


def test_unaligned_head_dim_falls_back():
    # d = 36: BSHD strides of 72 bytes are not 16-byte multiples, so TMA cannot take them.
    _check(b=1, hq=3, nq=130, nk=200, d=36, dtype=F16, layout="bshd", causal=True)


@pytest.mark.parametrize("d,cfg,causal", [
    (128, (64, 64, 4, 3), False), (128, (64, 64, 4, 2), True), (128, (128, 128, 8, 3), False),
    (64, (128, 64, 4, 3), True), (64, (64, 128, 4, 3), False), (256, (128, 64, 8, 2), True),
    (256, (128, 32, 8, 3), False),
], ids=["d128", "d128_s2_causal", "d128_w8", "d64_causal", "d64_n128", "d256_causal", "d256_n32"])
def test_q_in_registers_forward(d, cfg, causal, monkeypatch):
    # Q as the register operand of Q·Kᵀ (qreg), pinned; the `tl` forward (Gluon off).
    monkeypatch.setenv("FA_COMPILE_GLUON", "0")
    monkeypatch.setitem(tf.CONFIG_OVERRIDE, ("fwd", d), tf.BlockConfig(*cfg, qreg=True))
    _check(b=2, hq=4, hkv=2, nq=700, nk=901, d=d, dtype=BF16, causal=causal, layout="bshd")
    assert tf.LAST_COMPILED["attn_fwd_kernel"][0].qreg


@pytest.mark.parametrize("shape,cfg", [
    ((1, 4, 300, 411), (64, 64, 4, 2, True)), ((2, 1, 300, 411), (64, 64, 4, 3, True)),
    ((2, 4, 300, 411), (64, 64, 4, 2)), ((1, 1, 1, 411), (64, 64, 4, 3, True)),
], ids=["heads_qreg", "batch_qreg_s3", "full_s2", "keys_qreg"])
def test_float_bias_configs(shape, cfg, monkeypatch):
    # The tl float-bias forward (bias added inside one FMA) under the configs the tuning compared.
    monkeypatch.setenv("FA_COMPILE_GLUON", "0")
    monkeypatch.setitem(tf.CONFIG_OVERRIDE, ("fwd_bias", 128), tf.BlockConfig(*cfg))
    monkeypatch.setitem(tf.CONFIG_OVERRIDE, ("fwd", 128), tf.BlockConfig(*cfg))
    _check(b=2, hq=4, nq=300, nk=411, d=128, dtype=BF16, bias_shape=shape, bias_grad=True, causal=shape[-2] == 1)


@pytest.mark.parametrize("d,dkdv,dq", [(128, (64, 128, 8, 2), (128, 32, 4, 3)), (64, (64, 64, 4, 3), (128, 32, 4, 3))])
def test_backward_configs(d, dkdv, dq, monkeypatch):
    # The previous defaults (the current ones run in every other test), with the dQ kernel.
    monkeypatch.setenv("FA_COMPILE_FUSED_DQ", "0")
    monkeypatch.setitem(tf.CONFIG_OVERRIDE, ("dkdv", d), tf.BlockConfig(*dkdv))
    monkeypatch.setitem(tf.CONFIG_OVERRIDE, ("dq", d), tf.BlockConfig(*dq))
    _check(b=2, hq=4, hkv=2, nq=333, nk=500, d=d, dtype=BF16, causal=True, layout="bshd")


@pytest.mark.skipif(not _hopper_gluon(), reason="the Gluon forward runs on Hopper only")
@pytest.mark.parametrize("shape,kw", [
    ((1, 4, 700, 904), dict(causal=True)),
    ((2, 4, 700, 904), dict(kv_lens=[904, 77])),
    ((700, 904), dict(window_left=200, window_right=30)),
    ((2, 1, 700, 904), dict(d=64)),
    ((1, 4, 700, 904), dict(d=256, causal=True, diag_offset=204)),
    ((2, 4, 700, 904), dict(dtype=F16)),
], ids=["heads_causal", "full_lens", "2d_window", "batch_d64", "heads_d256_br", "full_fp16"])
def test_gluon_float_bias(shape, kw, monkeypatch):
    # A float bias read by TMA in the Gluon forward (broadcast dims at coordinate 0); its gradient and
    # the backward come from the tl kernels, on the Gluon forward's LSE.
    tf.LAST_COMPILED.pop("attn_fwd_gluon_kernel", None)
    d, dtype = kw.pop("d", 128), kw.pop("dtype", BF16)  # bf16 biases are widened by _widen's shift / mask
    _check(b=2, hq=4, hkv=2, nq=700, nk=904, d=d, dtype=dtype, layout="bshd", bias_shape=shape, bias_grad=True, **kw)
    assert "attn_fwd_gluon_kernel" in tf.LAST_COMPILED


@pytest.mark.skipif(not _hopper_gluon(), reason="the Gluon forward runs on Hopper only")
@pytest.mark.parametrize("batch_inner", [True, False], ids=["batch_fastest", "query_blocks_fastest"])
def test_gluon_bias_launch_orders(batch_inner, monkeypatch):
    # A bias shared by a batch of three but not by the heads, causal (query blocks reversed): both launch
    # orders of the Gluon forward (tf._bias_batch_inner) against the reference.
    monkeypatch.setattr(tf, "GLUON_BIAS_BATCH_INNER", batch_inner)
    tf.LAST_COMPILED.pop("attn_fwd_gluon_kernel", None)
    _check(b=3, hq=4, hkv=2, nq=700, nk=904, d=128, dtype=BF16, layout="bshd", bias_shape=(1, 4, 700, 904),
           causal=True)
    assert "attn_fwd_gluon_kernel" in tf.LAST_COMPILED


def test_gluon_bias_broadcast_view_and_fallbacks():
    # An expanded [B, H, N, N] view (stride 0 over batch) is read without copies; a bias TMA cannot
    # read (rows of 600 bytes) takes the tl forward, one constant along rows the Gluon key vector.
    if not _hopper_gluon():
        pytest.skip("the Gluon forward runs on Hopper only")
    from fa_compile.kernels.triton_testing import check_case, make_case

    case = make_case(device="cuda", b=2, hq=4, nq=300, nk=904, d=128, dtype=BF16, bias_shape=(1, 4, 300, 904))
    case.bias = case.bias.expand(2, 4, 300, 904)
    view, bmul, hmul = tf._gluon_bias(case.bias, case.q)
    assert (bmul, hmul) == (0, 1) and view.data_ptr() == case.bias.data_ptr()
    tf.LAST_COMPILED.pop("attn_fwd_gluon_kernel", None)
    check_case(case)
    assert "attn_fwd_gluon_kernel" in tf.LAST_COMPILED
    for shape, nk, gluon in (((1, 4, 300, 300), 300, False), ((2, 1, 1, 904), 904, True)):
        case = make_case(device="cuda", b=2, hq=4, nq=300, nk=nk, d=128, dtype=BF16, bias_shape=shape)
        assert tf._gluon_bias(case.bias, case.q) is None  # no bias tile for TMA ...
        tf.LAST_COMPILED.pop("attn_fwd_gluon_kernel", None)
        check_case(case)
        # ... so the tl forward, except a bias constant along rows: the Gluon forward's key vector.
        assert ("attn_fwd_gluon_kernel" in tf.LAST_COMPILED) == gluon


def _key_mask(b: int, nk: int, kind: str, dtype=None, seed: int = 3) -> torch.Tensor:
    """A [B, 1, 1, Nk] key-padding mask on the GPU; bool (keep), or float of `dtype` with finfo.min on the
    masked keys. kind "random": batch 0 drops ~30% of keys at random, batch 1 keys past 200 (right padding),
    batch 2 the first 150 (left padding); "empty": batch 1 masks every key."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    keep = torch.rand(b, nk, generator=g) > 0.3
    keep[1:] = True
    if kind == "empty":
        keep[1] = False
    else:
        keep[1, 200:] = False
    if b > 2:
        keep[2, :150] = False
    keep = keep.view(b, 1, 1, nk).cuda()
    if dtype is None:
        return keep
    return torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill(~keep, torch.finfo(dtype).min)


@pytest.mark.skipif(not _hopper_gluon(), reason="the Gluon forward runs on Hopper only")
@pytest.mark.parametrize("name", ["bool_gqa_empty_batch", "bool_causal_left_pad_d64", "bf16_min_causal_br",
                                  "fp32_min_window_lens_d256", "bool_bn_expanded", "bf16_heads_grad",
                                  "fp16_keys_1d"])
def test_gluon_key_padding_mask(name):
    # A bias constant along query rows (an HF key-padding mask and its broadcast forms) in the Gluon
    # forward (ROW_BIAS), against the reference with poisoned outputs; backward on the tl kernels.
    # Float masks keep at least one finite key per row: a row of finfo.min alone is uniform in the
    # reference, but empty in the kernels (test_gluon_float_key_mask_empty_batch_as_tl).
    from fa_compile.kernels.triton_testing import check_case, make_case

    base = dict(b=3, hq=4, hkv=2, nq=300, nk=411, d=128, dtype=BF16, layout="bshd")
    empty = None  # (batch, rows) expected empty: lse -inf, out 0
    if name == "bool_gqa_empty_batch":
        case = make_case(device="cuda", **base)
        case.bias, empty = _key_mask(3, 411, "empty"), (1, slice(None))
    elif name == "bool_causal_left_pad_d64":  # top-left causal: rows < 150 of batch 2 see padding only
        case = make_case(device="cuda", **dict(base, hq=8, nq=333, nk=333, d=64), causal=True)
        case.bias, empty = _key_mask(3, 333, "random"), (2, slice(0, 150))
    elif name == "bf16_min_causal_br":  # bottom-right causal: every row admits >= 112 keys, some kept
        case = make_case(device="cuda", **dict(base, b=2), causal=True, diag_offset=111)
        case.bias = _key_mask(2, 411, "random", BF16)
    elif name == "fp32_min_window_lens_d256":
        case = make_case(device="cuda", **dict(base, b=2, d=256), window_left=150, window_right=20, kv_lens=[411, 250])
        case.bias = _key_mask(2, 411, "random", torch.float32)
    elif name == "bool_bn_expanded":  # [B, Nk] -> [:, None, None, :].expand(B, H, Nq, Nk): stride 0 on H, Nq
        case = make_case(device="cuda", **dict(base, nq=200, nk=200))
        case.bias = _key_mask(3, 200, "random").view(3, 200)[:, None, None, :].expand(3, 4, 200, 200)
    elif name == "bf16_heads_grad":  # [1, H, 1, Nk], with its gradient from the tl backward
        case = make_case(device="cuda", **dict(base, b=2), bias_shape=(1, 4, 1, 411), bias_grad=True, causal=True)
    else:  # a 1-D [Nk] bias (batch and head strides 0), fp16
        case = make_case(device="cuda", **dict(base, b=2, dtype=F16), bias_shape=(411,))
    b, hq, nq, _ = case.q.shape
    assert tf._bias4(case.bias, b, hq, nq, case.k.shape[2])[1] in (3, 4)  # constant along query rows
    tf.LAST_COMPILED.pop("attn_fwd_gluon_kernel", None)
    res = check_case(case)
    block = max(64, 1 << (case.q.shape[-1] - 1).bit_length())
    assert tf.LAST_COMPILED["attn_fwd_gluon_kernel"][0] == tf.GLUON_ROWBIAS_CONFIGS[block]
    if empty is not None:
        bi, rows = empty
        assert torch.isneginf(res["lse"][bi, :, rows]).all() and (res["out"][bi, :, rows] == 0).all()


@pytest.mark.skipif(not _hopper_gluon(), reason="the Gluon forward runs on Hopper only")
def test_gluon_float_key_mask_empty_batch_as_tl(monkeypatch):
    # A batch whose keys all carry finfo(fp32).min: its scores times log2(e) overflow to -inf, so its rows
    # are empty (lse -inf, out 0) in the Gluon forward exactly as in the tl kernels' score_tile (the
    # reference averages V there; fa_compile's patterns route such masks to the "mean_v_add" handling).
    from fa_compile.kernels.triton_testing import make_case, poisoned_forward

    case = make_case(device="cuda", b=2, hq=4, hkv=2, nq=300, nk=411, d=128, dtype=BF16, layout="bshd", causal=True,
                     diag_offset=111)
    case.bias = _key_mask(2, 411, "empty", torch.float32)
    tf.LAST_COMPILED.pop("attn_fwd_gluon_kernel", None)
    out, lse = poisoned_forward(case)
    assert "attn_fwd_gluon_kernel" in tf.LAST_COMPILED
    assert torch.isneginf(lse[1]).all() and (out[1] == 0).all()
    monkeypatch.setenv("FA_COMPILE_GLUON", "0")
    tf.LAST_COMPILED.pop("attn_fwd_gluon_kernel", None)
    out_tl, lse_tl = poisoned_forward(case)
    assert "attn_fwd_gluon_kernel" not in tf.LAST_COMPILED
    torch.testing.assert_close(out, out_tl, atol=1.6e-2, rtol=1.6e-2)
    torch.testing.assert_close(lse, lse_tl, atol=1e-4, rtol=1e-4)  # -inf where the other is -inf


@pytest.mark.parametrize("path", ["gluon", "tl_tma", "pointer"])
@pytest.mark.parametrize("kw", [
    dict(b=3, hq=4, hkv=2, nq=300, nk=520, d=128, kv_lens=[520, 201, 77]),
    dict(b=3, hq=4, nq=333, nk=333, d=64, causal=True, kv_lens=[333, 130, 255], dropout_p=0.1),
], ids=["d128_gqa", "d64_causal_dropout"])
def test_nothing_past_kv_lens_is_read(kw, path, monkeypatch):
    # A cache's unused slots (here NaN past each sequence's length) change no output, lse or gradient bit, and
    # every value stays finite: TMA loads whole tiles, so the tile that straddles a length is zeroed past it.
    from fa_compile.kernels.triton_testing import make_case, poisoned_backward, poisoned_forward

    if path == "gluon" and not _hopper_gluon():
        pytest.skip("the Gluon kernels run on Hopper only")
    if path != "gluon":
        monkeypatch.setenv("FA_COMPILE_GLUON", "0")
    if path == "pointer":
        monkeypatch.setenv("FA_COMPILE_TRITON_TMA", "0")
    case = make_case(device="cuda", dtype=BF16, layout="bshd", **kw)
    dout = torch.randn(case.q.shape, device="cuda", dtype=BF16)
    for name in ("attn_fwd_gluon_kernel", "attn_bwd_gluon_kernel"):
        tf.LAST_COMPILED.pop(name, None)
    results = []
    for fill in (0.0, float("nan")):
        for name in ("k", "v"):
            t = getattr(case, name).clone()
            for b, n in enumerate(kw["kv_lens"]):
                t[b, :, n:] = fill
            setattr(case, name, t)
        out, lse = poisoned_forward(case)
        results.append((out, lse, *poisoned_backward(case, dout, out, lse)[:3]))
    if path == "gluon":  # the Gluon forward has no dropout (the tl forward with descriptors takes it)
        assert "attn_bwd_gluon_kernel" in tf.LAST_COMPILED
        assert ("attn_fwd_gluon_kernel" in tf.LAST_COMPILED) == ("dropout_p" not in kw)
    for name, clean, poisoned in zip(("out", "lse", "dq", "dk", "dv"), *results):
        assert torch.isfinite(poisoned).all(), name
        # dQ's fp32 sums (atomics) may arrive in another order; everything else is bit-identical
        if name == "dq":
            torch.testing.assert_close(poisoned, clean, atol=2e-2, rtol=2e-2)
        else:
            assert torch.equal(poisoned, clean), name
