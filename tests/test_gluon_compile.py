"""The Gluon Hopper kernels (fa_compile/kernels/gluon_fwd.py, gluon_bwd.py) compiled for sm_90 on a machine without a GPU.

Gluon has no interpreter, so numerics are checked on the GPU (test_kernels_gpu.py); this test keeps
the kernel building under the Triton installed here (CI's) and pins the properties its speed rests
on: wgmma (HGMMA) for both products, TMA loads, register rebalancing between the partitions, and
no shared-memory round trip for P (the P·V operand stays in registers). The host-side launch
arguments are checked with the kernel replaced by a recorder."""
from __future__ import annotations

import re

import pytest
import torch

from fa_compile.kernels import triton_family as tf

pytestmark = pytest.mark.skipif(not tf.triton_available() or not tf.gluon_available(), reason="needs triton with Gluon")


class _Sm90Driver:
    """Just enough of a Triton driver to compile (never launch) for capability 9.0."""

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")


@pytest.fixture
def sm90():
    from triton.runtime.driver import driver

    prev = driver._active  # restored as found (None on a machine without a GPU: resolved lazily)
    driver.set_active(_Sm90Driver())
    try:
        yield
    finally:
        driver._active = prev


def _compile(d: int, cfg: tf.BlockConfig, causal: bool, masks: bool, bias: bool = False, row_bias=None,
             batch_inner: bool = False, sinks: bool = False, sep_o: bool = False):
    """row_bias: None, or the dtype of a key vector [B, Nk] (torch.uint8 for a bool mask). One program walks
    the tiles (persistent: the loop the kernel always has, run more than once)."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from fa_compile.kernels.gluon_fwd import attn_fwd_gluon_ws_kernel

    b, h, n = 1, 2, 256
    q = torch.empty(b, n, h, d, dtype=torch.bfloat16).transpose(1, 2)  # BSHD storage
    lse = torch.empty(b, h, n)

    def desc(rows: int, t: torch.Tensor = q, cols: int = d):
        block = [1, 1, rows, cols]
        return TensorDescriptor(t, list(t.shape), list(t.stride()), block,
                                gl.NVMMASharedLayout.get_default_for(block, gl.bfloat16))

    bias_desc = desc(64, torch.empty(1, h, n, n, dtype=torch.bfloat16), cfg.block_n) if bias else desc(cfg.block_n)
    # A key-padding mask [B, 1, 1, Nk]: batch stride n, head stride 0, key stride 1 (as _bias4 gives them).
    rb_args = (torch.empty(b, n, dtype=row_bias), n, 0, 1) if row_bias is not None else (None, None, None, None)
    rb_kind = 0 if row_bias is None else (2 if row_bias == torch.uint8 else 1)
    return attn_fwd_gluon_ws_kernel.warmup(
        desc(64), desc(cfg.block_n), desc(cfg.block_n), desc(64), lse, lse, bias_desc, 0, 1, *rb_args, h, 1, n, n, 0.1,
        0, 16, 0, 1, b * h * -(-n // cfg.block_m),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=d, BLOCK_DV=d, STAGES=cfg.num_stages, IS_CAUSAL=causal,
        HAS_WL=masks, HAS_WR=masks, HAS_KVLEN=masks, REVERSE_M=causal, QREG=cfg.qreg, CONSUMER_REGS=240,
        PINGPONG=cfg.pingpong, HAS_BIAS=bias, ROW_BIAS=rb_kind, BATCH_INNER=batch_inner,
        SINKS=torch.empty(h) if sinks else None, HAS_SINKS=sinks, SEP_O=sep_o, PERSISTENT=cfg.persistent, num_warps=4, grid=(1,),
    )


def _assert_fast_path(k) -> None:
    ptx = k.asm["ptx"]
    assert "wgmma.mma_async" in ptx and "mma.sync" not in ptx
    assert "cp.async.bulk.tensor" in ptx  # TMA
    assert re.search(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+240", ptx)  # consumers raised to 240
    assert re.search(r"setmaxnreg\.dec\.sync\.aligned\.u32\s+24\b", ptx)  # producer lowered to 24
    # P stays in registers as the A operand of P·V: the only register-to-shared stores are the two
    # consumers' O tiles (and, with key lengths, the [32, D] row chunks that zero the value tile straddling
    # one: zero_rows_from), and no shared buffer is allocated from a register value (a staged P would be).
    ir = k.asm["ttgir"]
    stores = re.findall(r"ttg\.local_store [^\n]*: tensor<(\d+)x", ir)
    assert stores.count("64") == 2 and set(stores) <= {"64", "32"}
    assert not re.search(r"ttg\.local_alloc %", ir)
    assert k.metadata.shared <= 232448  # fits the 227 KB an H100/H200 block may use


@pytest.mark.parametrize("d,causal,masks,bias", [
    (128, True, False, False), (64, False, True, False), (256, True, True, False), (128, True, False, True),
    (64, False, True, True), (256, False, False, True),
])
def test_default_configs_build_for_sm90(sm90, d, causal, masks, bias):
    cfg = (tf.GLUON_BIAS_CONFIGS if bias else tf.GLUON_CONFIGS)[d]
    _assert_fast_path(_compile(d, cfg, causal, masks, bias))
    if bias:  # the launch order of a bias shared by the batch: program ids only, the same fast path
        _assert_fast_path(_compile(d, cfg, causal, masks, bias, batch_inner=True))


@pytest.mark.parametrize("d,stages,qreg,bias,row_bias", [
    (64, 2, True, False, None), (128, 2, False, False, torch.uint8), (128, 2, True, False, None),
    (64, 2, True, True, None),
])
def test_separate_output_tile_builds_for_sm90(sm90, d, stages, qreg, bias, row_bias):
    # The persistent forward's own O tile (SEP_O): the same fast path, within the shared memory a block may use.
    cfg = tf.BlockConfig(128, 128, 4, stages, qreg=qreg, persistent=True)
    assert tf._gluon_separate_o(cfg, d, d, 2 if bias else 0)
    _assert_fast_path(_compile(d, cfg, True, True, bias, row_bias=row_bias, sep_o=True))


@pytest.mark.parametrize("d,causal,masks,bias", [(64, True, False, False), (128, True, True, False),
                                                  (128, False, False, True)])
def test_sinks_build_for_sm90(sm90, d, causal, masks, bias):
    # Attention sinks: one scalar load and a rescale in each consumer's epilogue, the same fast path.
    cfg = (tf.GLUON_BIAS_CONFIGS if bias else tf.GLUON_CONFIGS)[d]
    k = _compile(d, cfg, causal, masks, bias, sinks=True)
    _assert_fast_path(k)
    assert "ld.global" in k.asm["ptx"]  # the sink logit
    if not masks:  # (key-padding lengths are a global load too)
        assert "ld.global" not in _compile(d, cfg, causal, masks, bias).asm["ptx"]


@pytest.mark.parametrize("d,dtype,causal,masks", [
    (64, torch.uint8, True, False), (64, torch.bfloat16, False, True), (128, torch.uint8, False, False),
    (128, torch.uint8, True, True), (128, torch.bfloat16, True, False), (128, torch.float32, False, False),
    (256, torch.float32, True, True), (256, torch.uint8, False, False),
], ids=["d64_bool_causal", "d64_bf16_masks", "d128_bool", "d128_bool_all_masks", "d128_bf16_causal", "d128_fp32",
        "d256_fp32_all_masks", "d256_bool"])
def test_row_bias_builds_for_sm90(sm90, d, dtype, causal, masks):
    # A key-padding mask (bool as uint8, or float of any dtype) on the default row-bias tiles: the same
    # fast path, plus one key-vector load per key block and consumer, in the score tile's column layout
    # and issued between the Q·Kᵀ wgmma and its wait (so its latency hides behind the product).
    k = _compile(d, tf.GLUON_ROWBIAS_CONFIGS[d], causal, masks, row_bias=dtype)
    _assert_fast_path(k)
    assert "ld.global" in k.asm["ptx"]
    lines = [ln.strip() for ln in k.asm["ttgir"].splitlines()]
    loads = [i for i, ln in enumerate(lines) if re.search(r"= tt\.load .*#ttg\.slice<\{dim = 0, parent = #mma", ln)]
    assert len(loads) == 4  # two consumers x (first key block, loop)
    assert all(lines[i + 1].startswith("%") and "ttng.warp_group_dot_wait" in lines[i + 1] for i in loads)


def _record_launches(monkeypatch, module, name: str) -> list:
    """Replace module.name (a kernel) by a recorder of its launches: [(grid, args, kwargs)]; returns "handle"."""
    calls: list = []

    class _Recorder:
        def __getitem__(self, grid):
            return lambda *a, **kw: calls.append((grid, a, kw)) or "handle"

    monkeypatch.setattr(module, name, _Recorder())
    return calls


def _case(**kw):
    from fa_compile.kernels.triton_testing import make_case

    return make_case(**{**dict(b=2, hq=4, hkv=2, nq=300, nk=904, d=128, dtype=torch.bfloat16, layout="bshd"), **kw})


def test_bias_views_for_tma():
    # Broadcast dims become size-1 dims read at coordinate 0; biases TMA cannot read are refused (tl path).
    c = _case(bias_shape=(1, 4, 300, 904))
    view, bmul, hmul = tf._gluon_bias(c.bias.expand(2, 4, 300, 904), c.q)
    assert (tuple(view.shape), bmul, hmul) == ((1, 4, 300, 904), 0, 1) and view.data_ptr() == c.bias.data_ptr()
    view, bmul, hmul = tf._gluon_bias(_case(bias_shape=(300, 904)).bias, c.q)
    assert (tuple(view.shape), bmul, hmul) == ((1, 1, 300, 904), 0, 0)
    view, bmul, hmul = tf._gluon_bias(_case(bias_shape=(2, 1, 300, 904)).bias, c.q)
    assert (bmul, hmul) == (1, 0)
    assert tf._gluon_bias(_case(bias_shape=(2, 1, 1, 904)).bias, c.q) is None  # constant along rows
    assert tf._gluon_bias(_case(bias_shape=(1, 4, 300, 904)).bias.float(), c.q) is None  # dtype differs from q
    assert tf._gluon_bias(torch.zeros(1, 4, 300, 300, dtype=torch.bfloat16), c.q) is None  # 600-byte rows
    assert tf._gluon_bias(_case(bias_shape=(1, 4, 300, 904), bias_bool=True).bias, c.q) is None


def test_host_launch_arguments(monkeypatch):
    # What _forward_gluon hands the kernel: grid, tiles, the bias view and its coordinates, the config.
    import fa_compile.kernels.gluon_fwd as gf

    calls = _record_launches(monkeypatch, gf, "attn_fwd_gluon_ws_kernel")
    for bias_shape, want_cfg in ((None, tf.GLUON_CONFIGS[128]), ((2, 4, 300, 904), tf.GLUON_BIAS_CONFIGS[128])):
        c = _case(bias_shape=bias_shape, causal=True, kv_lens=[904, 5])
        out = torch.empty(2, 300, 4, 128, dtype=torch.bfloat16).transpose(1, 2)
        lse = torch.empty(2, 4, 300)
        calls.clear()
        gb = tf._gluon_bias(c.bias, c.q) if c.bias is not None else None
        assert (gb is None) == (bias_shape is None)
        kind, cfg = tf._gluon_config(gb, 128)
        assert (kind, cfg) == ("fwd_gluon" if bias_shape is None else "fwd_gluon_bias", want_cfg)
        tf._forward_gluon(c, c.q, c.k, c.v, out, lse, 128, 128, cfg, gb)
        (grid, a, kw), = calls
        # ceil(300 / 128) query blocks x (batch, head) tiles, one axis: no 65535 cap
        assert grid == ((8,) if want_cfg.persistent else (3 * 8,))
        qd, kd, vd, od, lse_arg, kvl, bias_desc, bmul, hmul, *rb_args = a[:13]
        assert qd.block_shape == [1, 1, 64, 128] and od.block_shape == [1, 1, 64, 128]
        assert kd.block_shape == vd.block_shape == [1, 1, want_cfg.block_n, 128]
        assert qd.strides == list(c.q.stride()) and od.base.data_ptr() == out.data_ptr()  # BSHD, no copies
        assert lse_arg is lse and kvl is c.kv_lens
        assert rb_args == [None] * 4 and kw["ROW_BIAS"] == 0  # constexpr None: compiled as before they existed
        assert a[13:15] == (4, 2)  # Hq, group size
        # causal: 3 query blocks x 8 (batch, head) in groups of >= 2·SMs / 3 = 6 (sm_count is 8 off a GPU): one
        assert a[21] == 1
        # 24 tiles walked by 8 programs (sm_count off a GPU); three stages leave no room for O beside Q
        assert a[22] == 24 and kw["PERSISTENT"] is want_cfg.persistent and kw["SEP_O"] is False
        assert kw["HAS_BIAS"] == (bias_shape is not None) and kw["IS_CAUSAL"] and kw["HAS_KVLEN"]
        assert kw["BATCH_INNER"] is False  # no bias, or one per batch element: the usual order
        assert (kw["BLOCK_M"], kw["BLOCK_N"], kw["STAGES"], kw["PINGPONG"]) == (
            want_cfg.block_m, want_cfg.block_n, want_cfg.num_stages, want_cfg.pingpong)
        if bias_shape is not None:
            assert bias_desc.base.data_ptr() == c.bias.data_ptr() and (bmul, hmul) == (1, 1)
            assert bias_desc.block_shape == [1, 1, 64, want_cfg.block_n]
        assert tf.LAST_COMPILED["attn_fwd_gluon_kernel"] == (want_cfg, "handle")


@pytest.mark.parametrize("cfg,sep_o", [
    (tf.BlockConfig(128, 128, 4, 2, qreg=True, persistent=True), True),  # d128: Q, O and two stages fit
    (tf.BlockConfig(128, 128, 4, 3, pingpong=True, persistent=True), False),  # three stages leave no room for O
    (tf.BlockConfig(128, 128, 4, 2, persistent=False), False),
])
def test_persistent_launch(cfg, sep_o, monkeypatch):
    # A persistent forward launches one program per SM (8 off a GPU) over all 24 tiles, and stages O apart from Q
    # only where shared memory holds both beside the K/V ring. A causal mask or a window (uneven work per tile)
    # keeps one program per tile past 16 query blocks per (batch, head).
    import fa_compile.kernels.gluon_fwd as gf

    calls = _record_launches(monkeypatch, gf, "attn_fwd_gluon_ws_kernel")
    for nq, kw in ((300, dict(kv_lens=[904, 5])), (300, dict(causal=True)), (2200, dict(window_left=64)),
                   (2200, dict(causal=True)), (2200, {})):
        calls.clear()
        c = _case(nq=nq, **kw)
        out = torch.empty(2, nq, 4, 128, dtype=torch.bfloat16).transpose(1, 2)
        tf._forward_gluon(c, c.q, c.k, c.v, out, torch.empty(2, 4, nq), 128, 128, cfg, None)
        (grid, a, launch), = calls
        tiles = -(-nq // 128) * 8
        walks = cfg.persistent and (nq == 300 or not kw)
        assert grid == ((8,) if walks else (tiles,)) and a[22] == tiles
        assert launch["PERSISTENT"] is walks and launch["SEP_O"] is (sep_o and walks)
        assert tf.LAST_COMPILED["attn_fwd_gluon_kernel"][0].persistent is walks
    assert tf._gluon_separate_o(cfg, 128, 64, 0)  # widths that differ always have their own O tile


@pytest.mark.parametrize("bias_shape,batch,want", [
    ((1, 4, 300, 904), 2, True), ((1, 4, 300, 904), 1, False), ((2, 4, 300, 904), 2, False),
    ((1, 1, 300, 904), 2, False), ((300, 904), 2, False), ((4, 300, 904), 3, True),
], ids=["1h_b2", "1h_b1", "bh", "11", "2d", "3d_b3"])
def test_batch_inner_order_for_batch_shared_bias(bias_shape, batch, want, monkeypatch):
    # The batch runs fastest exactly when a bias tile is shared by a batch of several but not by the heads
    # (a [1, 1, N, N] bias is read by every head anyway); the switch turns it off.
    import fa_compile.kernels.gluon_fwd as gf

    calls = _record_launches(monkeypatch, gf, "attn_fwd_gluon_ws_kernel")
    c = _case(b=batch, bias_shape=bias_shape, causal=True)
    gb = tf._gluon_bias(c.bias, c.q)
    assert tf._bias_batch_inner(gb, batch) is want
    out = torch.empty(batch, 300, 4, 128, dtype=torch.bfloat16).transpose(1, 2)
    tf._forward_gluon(c, c.q, c.k, c.v, out, torch.empty(batch, 4, 300), 128, 128, tf.GLUON_BIAS_CONFIGS[128], gb)
    (grid, _a, kw), = calls
    assert kw["BATCH_INNER"] is want and grid == (3 * batch * 4,)
    monkeypatch.setattr(tf, "GLUON_BIAS_BATCH_INNER", False)
    assert tf._bias_batch_inner(gb, batch) is False


def _compile_bwd(d: int, cfg: tf.BlockConfig, causal: bool, masks: bool, group: int, dropout: bool = False,
                 key_mask: bool = False):
    from fa_compile.kernels.gluon_bwd import attn_bwd_gluon_kernel

    b, h, n = 1, 4, 256
    q = torch.empty(b, n, h, d, dtype=torch.bfloat16).transpose(1, 2)  # BSHD storage
    lse = torch.empty(b, h, n)
    dqa = torch.empty(1, b * h, n, d)
    return attn_bwd_gluon_kernel.warmup(
        tf._gluon_desc(q, cfg.block_m, d), tf._gluon_desc(q, cfg.block_n, d), tf._gluon_desc(q, cfg.block_n, d),
        tf._gluon_desc(q, cfg.block_m, d), lse, lse, tf._gluon_desc(dqa, cfg.block_m, d), q, q, lse,
        *q.stride()[:3], *q.stride()[:3],
        h, h // group, group, n, n, d, d, 0.1, 0.1, 0, 16, 16, torch.empty(1, dtype=torch.int64), 429496729, 1.0 / 0.9,
        torch.empty(b, n, dtype=torch.uint8), n, 1, 2,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=d, BLOCK_DV=d, STAGES=cfg.num_stages, IS_CAUSAL=causal,
        HAS_WL=masks, HAS_WR=masks, HAS_KVLEN=masks, DROPOUT=dropout, KEY_MASK=key_mask, num_warps=cfg.num_warps,
        grid=(1,),
    )


@pytest.mark.parametrize("d,causal,masks,group", [(128, True, False, 1), (64, False, True, 2), (128, False, True, 4)])
def test_backward_builds_for_sm90(sm90, d, causal, masks, group):
    k = _compile_bwd(d, tf.GLUON_BWD_CONFIGS[d], causal, masks, group)
    ptx = k.asm["ptx"]
    assert "wgmma.mma_async" in ptx and "mma.sync" not in ptx
    assert "cp.async.bulk.tensor" in ptx  # TMA
    assert re.search(r"setmaxnreg\.inc\.sync\.aligned\.u32\s+240", ptx)  # consumer warpgroups raised to 240
    assert re.search(r"setmaxnreg\.dec\.sync\.aligned\.u32\s+24\b", ptx)  # producer and writer at 24
    # dQ goes to the fp32 buffer by TMA bulk reductions, never by per-element atomics.
    assert re.search(r"cp\.reduce\.async\.bulk\.tensor\.4d\.global\.shared::cta\.add", ptx)
    assert not re.search(r"\b(atom|red)\.global", ptx)
    ir = k.asm["ttgir"]
    # Five products per query block; Pᵀ and dSᵀ are register operands, and the consumers' only register-to-shared
    # stores are dSᵀ (for dQ = dS·K, which needs both warpgroups' halves) and the dQ tile.
    assert len(re.findall(r"ttng\.warp_group_dot ", ir)) == 5
    consumer = ir[ir.index("default {"):ir.index("partition0(")]
    producer = ir[ir.index("partition0("):ir.index("partition1(")]
    loop = consumer[consumer.index("scf.for"):]
    assert len(re.findall(r"ttg\.local_store ", loop)) == 2
    # Before the loop, with key lengths only: the [32, D] row chunks that zero K and V past the length (zero_rows_from).
    assert set(re.findall(r"ttg\.local_store [^\n]*: tensor<(\d+)x", consumer[:consumer.index("scf.for")])) <= {"32"}
    # The consumers read each block's lse and δ from shared memory: the producer warp loads them into the
    # Q/dO slot, so no global load sits on the consumers' critical path.
    assert not re.search(r"= tt\.load ", consumer)
    assert len(re.findall(r"ttg\.local_load .*#ttg\.slice<\{dim = 0", consumer)) == 2
    assert len(re.findall(r"= tt\.load ", producer)) == 2 and len(re.findall(r"ttg\.local_store ", producer)) == 2
    # A dQ tile reaches the writer warp by a named-barrier arrival that does not block the consumers (the
    # writer waits there): one barrier over the consumer partition per step, for dSᵀ's two halves, not two.
    writer = ir[ir.index("partition1("):]
    assert len(re.findall(r"\b(ttg|gpu)\.barrier\b", loop)) == 1
    assert consumer.count('"bar.arrive $1, 288;') == 1 and writer.count('"bar.sync $1, 288;') == 1
    assert "ttng.wait_barrier" not in writer
    assert k.metadata.shared <= 232448


@pytest.mark.parametrize("d", [64, 128])
def test_backward_with_dropout_and_key_mask_builds_for_sm90(sm90, d):
    # The dropout hash and a key-padding mask in the consumers: the mask's bytes for the program's keys are one
    # load before the loop (the same for every query block and head), not a load per step.
    k = _compile_bwd(d, tf.GLUON_BWD_CONFIGS[d], False, True, 2, dropout=True, key_mask=True)
    assert "wgmma.mma_async" in k.asm["ptx"]
    ir = k.asm["ttgir"]
    consumer = ir[ir.index("default {"):ir.index("partition0(")]
    assert len(re.findall(r"= tt\.load ", consumer)) == 1
    loop = consumer[consumer.index("scf.for"):]
    assert not re.search(r"= tt\.load ", loop)


def test_backward_host_launch_and_refusals(monkeypatch):
    # What _backward_gluon hands the kernel, and the cases that must keep the tl backward.
    import fa_compile.kernels.gluon_bwd as gb

    calls = _record_launches(monkeypatch, gb, "attn_bwd_gluon_kernel")
    c = _case(causal=True, kv_lens=[904, 5])
    dout = torch.randn(2, 300, 4, 128, dtype=torch.bfloat16).transpose(1, 2)
    lse, delta = torch.zeros(2, 4, 300), torch.zeros(2, 4, 300)
    dq = torch.full_like(c.q, float("nan"))
    dk, dv = torch.empty_like(c.k), torch.empty_like(c.v)
    cfg = tf.GLUON_BWD_CONFIGS[128]
    tf._backward_gluon(c, c.q, c.k, c.v, dout, lse, delta, dq, dk, dv, 128, 128, cfg)
    (grid, a, kw), = calls
    assert grid == (8 * 2 * 2,)  # ceil(904 / 128) key blocks x (batch, K/V head)
    qd, kd, vd, dod, lse_arg, delta_arg, dqa_desc, dk_arg, dv_arg, kvl = a[:10]
    assert qd.block_shape == dod.block_shape == [1, 1, cfg.block_m, 128]
    assert kd.block_shape == vd.block_shape == [1, 1, 128, 128]
    assert qd.strides == list(c.q.stride()) and dod.base.data_ptr() == dout.data_ptr()  # BSHD, no copies
    dqa = dqa_desc.base  # fp32 [1, B * Hq, Nq, D], zeroed; TMA reduces [BLOCK_M, D] tiles into it
    assert dqa.dtype == torch.float32 and dqa.shape == (1, 8, 300, 128) and not dqa.any()
    assert dqa_desc.block_shape == [1, 1, cfg.block_m, 128]
    assert dk_arg is dk and dv_arg is dv and kvl is c.kv_lens and lse_arg is lse and delta_arg is delta
    assert a[16:19] == (4, 2, 2)  # Hq, Hkv, group size
    # causal: 8 key blocks x 4 (batch, K/V head) in groups of >= 2·SMs / 8 = 2 of them (sm_count is 8 off a GPU)
    assert a[34] == 2
    assert kw["IS_CAUSAL"] and kw["HAS_KVLEN"] and kw["num_warps"] == 8
    assert torch.equal(dq, torch.zeros_like(dq))  # cast from the (here untouched) fp32 buffer
    assert tf.LAST_COMPILED["attn_bwd_gluon_kernel"] == (cfg, "handle")

    from fa_compile.kernels.triton_testing import make_case

    cap = (9, 0)
    applies = tf.gluon_backward_applies
    assert applies(c, cap)
    assert not applies(_case(bias_shape=(1, 4, 300, 904)), cap)  # a bias
    big = make_case(b=1, hq=2, nq=64, nk=64, d=256, dtype=torch.bfloat16)
    assert not applies(big, cap)  # dK, dV of d256 too large for registers
    assert not applies(make_case(b=1, hq=2, nq=64, nk=64, d=36, dtype=torch.bfloat16), cap)  # not a multiple of 8
    assert not applies(c, (8, 0))
    assert not applies(_case(softcap=20.0), cap)
    assert applies(_case(dropout_p=0.1), cap)  # the forward's counter-hash mask, in the kernel
    # a boolean key-padding mask shared by heads and query rows, read as bytes per key; no other bias
    assert applies(_case(bias_shape=(2, 1, 1, 904), bias_bool=True), cap)
    assert applies(_case(bias_shape=(904,), bias_bool=True), cap)
    assert not applies(_case(bias_shape=(2, 4, 1, 904), bias_bool=True), cap)  # one per head
    assert not applies(_case(bias_shape=(2, 1, 300, 904), bias_bool=True), cap)  # one per query row
    assert not applies(_case(bias_shape=(2, 1, 1, 904)), cap)  # additive
    km = tf.gluon_key_mask(_case(bias_shape=(2, 1, 1, 904), bias_bool=True).bias)
    assert km[0].dtype == torch.uint8 and km[1:] == (904, 1)
    assert tf.gluon_key_mask(_case(bias_shape=(904,), bias_bool=True).bias)[1:] == (0, 1)
    torch.use_deterministic_algorithms(True)
    try:
        assert not applies(c, cap)  # reduction order varies
    finally:
        torch.use_deterministic_algorithms(False)
    monkeypatch.setenv("FA_COMPILE_GLUON", "0")
    assert not applies(c, cap)


@pytest.mark.parametrize("name", ["bool_b11n", "fp32_b11n_min", "bool_bn_expanded", "bf16_keys_1d", "bf16_heads_keys"])
def test_row_bias_routing_and_launch_arguments(name, monkeypatch):
    # attention_forward on a (pretended) Hopper: a bias constant along query rows goes to the Gluon forward
    # as ROW_BIAS (1 float of any dtype, 2 bool as uint8) with the batch, head and key strides of its
    # broadcast [B, Hq, 1, Nk] view, read in place; the tile is GLUON_ROWBIAS_CONFIGS'.
    import fa_compile.kernels.gluon_fwd as gf

    calls = _record_launches(monkeypatch, gf, "attn_fwd_gluon_ws_kernel")
    monkeypatch.setattr(tf, "_capability", lambda device: (9, 0))
    monkeypatch.delenv("FA_COMPILE_TUNE", raising=False)
    c = _case(causal=True, kv_lens=[904, 5])
    keys = torch.rand(2, 904) > 0.3
    if name == "bool_b11n":
        c.bias, want = keys.view(2, 1, 1, 904), (2, torch.uint8, (904, 0, 1))
    elif name == "fp32_b11n_min":
        fill = torch.zeros(2, 1, 1, 904).masked_fill(~keys.view(2, 1, 1, 904), torch.finfo(torch.float32).min)
        c.bias, want = fill, (1, torch.float32, (904, 0, 1))
    elif name == "bool_bn_expanded":  # an HF-style [B, Nk] mask expanded to [B, H, Nq, Nk]
        c.bias, want = keys[:, None, None, :].expand(2, 4, 300, 904), (2, torch.uint8, (904, 0, 1))
    elif name == "bf16_keys_1d":
        c.bias, want = torch.randn(904, dtype=torch.bfloat16), (1, torch.bfloat16, (0, 0, 1))
    else:
        c.bias, want = torch.randn(1, 4, 1, 904, dtype=torch.bfloat16), (1, torch.bfloat16, (0, 904, 1))
    assert tf._bias4(c.bias, 2, 4, 300, 904)[1] == 2 + want[0]  # kinds 3 / 4: constant along query rows
    out = torch.empty(2, 300, 4, 128, dtype=torch.bfloat16).transpose(1, 2)
    lse = torch.empty(2, 4, 300)
    assert tf.attention_forward(c, out=out, lse=lse) == (out, lse)
    (grid, a, kw), = calls
    cfg = tf.GLUON_ROWBIAS_CONFIGS[128]
    assert tf._gluon_config(None, 128, row_bias=True) == ("fwd_gluon_rowbias", cfg)
    assert grid == ((8,) if cfg.persistent else (3 * 8,)) and a[4] is lse and a[5] is c.kv_lens
    rb, *strides = a[9:13]
    assert kw["ROW_BIAS"] == want[0] and not kw["HAS_BIAS"] and kw["IS_CAUSAL"] and kw["HAS_KVLEN"]
    assert rb.dtype == want[1] and rb.data_ptr() == c.bias.data_ptr() and tuple(strides) == want[2]
    assert (kw["BLOCK_N"], kw["STAGES"], kw["QREG"], kw["PINGPONG"]) == (
        cfg.block_n, cfg.num_stages, cfg.qreg, cfg.pingpong)
    assert a[13:15] == (4, 2)
    assert tf.LAST_COMPILED["attn_fwd_gluon_kernel"] == (cfg, "handle")


def test_gluon_takes_row_bias_not_other_untileable_biases():
    c = _case()
    ok = lambda kind, gb=None: tf._gluon_ok(c, (c.q, c.k, c.v), (9, 0), kind, 128, gb)  # noqa: E731
    assert ok(0) and ok(3) and ok(4)  # none; float / bool constant along query rows
    assert not ok(1) and not ok(2)  # a float tile TMA cannot read; a bool tile
    c.softcap = 20.0
    assert not ok(3) and not ok(4)


def test_lowered_backward_takes_the_gluon_op_where_measured_faster(monkeypatch):
    # The lowering's rule (fa_compile/lowering/triton.py, gluon_backward) on FakeTensors of a Hopper site: the Gluon
    # op from GLUON_BWD_MIN_WORK scores per site on (a padded BERT's B32 x 12 heads x 256 tokens trained faster on
    # the pointer pair, whose launches cost less host time), and without dropout from 512 x 512 scores per head on
    # (a ViT's 197 tokens ran faster on the pointer pair); FA_COMPILE_GLUON=1 at every size; a boolean key-padding
    # mask shared by the heads, no other bias; not with FA_COMPILE_GLUON=0, in deterministic mode, or on another GPU.
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fa_compile import dispatch
    from fa_compile.lowering import triton as lowering

    monkeypatch.setattr(tf, "gluon_available", lambda: True)
    monkeypatch.delenv("FA_COMPILE_GLUON", raising=False)
    cap = [(9, 0)]
    monkeypatch.setattr(lowering, "_capability", lambda t: cap[0])

    def site(n: int, batch: int = 64, heads: int = 4, bias=None, bias_dtype=torch.bool, dropout_p=0.0):
        with FakeTensorMode():
            q = torch.empty(batch, n, heads, 64, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
            b = None if bias is None else torch.empty(bias, device="cuda", dtype=bias_dtype)
            seed = torch.empty((), device="cuda", dtype=torch.int64) if dropout_p else None
            return dispatch.AttentionArgs(q, q, q, 0.125, False, bias=b, dropout_p=dropout_p, dropout_seed=seed)

    takes = lowering.gluon_backward
    assert takes(site(512)) and takes(site(1024))
    assert not takes(site(197, batch=2048)) and not takes(site(511, batch=128))  # per head
    # the scores per site: B32 x 12 heads x 256^2 (25.2M) is under the line, x 384^2 (56.6M) over it
    assert not takes(site(256, batch=32, heads=12, dropout_p=0.1))
    assert takes(site(384, batch=32, heads=12, dropout_p=0.1))
    assert takes(site(197, batch=512, dropout_p=0.1))  # with dropout, any length
    assert not takes(site(1024, batch=2, dropout_p=0.1)) and not takes(site(4096, batch=1, heads=1))
    assert takes(site(512, bias=(64, 1, 1, 512), dropout_p=0.1))
    assert not takes(site(512, bias=(64, 4, 1, 512)))  # one mask per head
    assert not takes(site(512, bias=(64, 1, 1, 512), bias_dtype=torch.bfloat16))  # additive
    low = lowering.TRITON_LOWERING
    assert low.target_for(site(512), "backward") == "fa3_gluon.bwd"
    assert low.target_for(site(512), "forward") == "fa3_triton.fwd"
    assert low.target_for(site(197), "backward") == "fa3_triton.bwd"
    assert low.backward_note(site(512)) == lowering.GLUON_BWD_TEXT
    assert "the pointer kernels, not the Gluon backward: 25.2M scores" in low.backward_note(
        site(256, batch=32, heads=12, dropout_p=0.1))
    torch.use_deterministic_algorithms(True)
    try:
        assert not takes(site(512))  # the Gluon kernel's dQ sums arrive in varying order
    finally:
        torch.use_deterministic_algorithms(False)
    monkeypatch.setenv("FA_COMPILE_GLUON", "1")  # every size
    assert takes(site(64, batch=1, dropout_p=0.1)) and takes(site(197, batch=1))
    monkeypatch.setenv("FA_COMPILE_GLUON", "0")
    assert not takes(site(512))
    monkeypatch.delenv("FA_COMPILE_GLUON")
    cap[0] = (8, 0)
    assert not takes(site(512, dropout_p=0.1))


def test_gluon_op_body_launches_kernels_directly(monkeypatch):
    # Inductor's code calls fa3_gluon.bwd as an extern op on real tensors: its launches must not go through
    # wrap_triton's higher-order op (~240 against ~70 us of host time per launch on the H200). Off a Hopper GPU
    # the body takes the pointer kernels' path, which records here whether wrap_triton would trace.
    from torch._library.triton import is_wrap_triton_enabled

    from fa_compile.kernels import gluon_ops  # noqa: F401  (registers the op)
    from fa_compile.kernels import triton_ops

    seen = []

    def fallback(dout, q, k, v, *rest):
        seen.append(is_wrap_triton_enabled())
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), None

    monkeypatch.setattr(triton_ops, "bwd", fallback)
    q = torch.randn(1, 2, 8, 16)
    lse = torch.zeros(1, 2, 8)
    dq, dk, dv = torch.ops.fa3_gluon.bwd(q, q, q, q, q, lse, lse, None, None, None, 0.25, False, 0, -1, -1, 0.0,
                                         False, [16, 16, 4, 1], [16, 16, 4, 1])
    assert seen == [False] and is_wrap_triton_enabled()
    # the fallback's dq comes back as the Gluon kernel's dQ sums would: fp32, contiguous
    assert dq.shape == q.shape and dq.dtype == torch.float32 and dq.is_contiguous() and not dq.any()


@pytest.mark.parametrize("make", [
    lambda: torch.empty(2, 3, 5, 8),
    lambda: torch.empty(2, 5, 3, 8).transpose(1, 2),  # BSHD storage
    lambda: torch.empty(2, 5, 1, 8).transpose(1, 2),  # one head: a size-1 dim with a tied stride
    lambda: torch.empty(2, 1, 5, 8).expand(2, 3, 5, 8),  # a broadcast: not dense
    lambda: torch.empty(2, 3, 5, 16)[..., ::2],  # strided last dim
    lambda: torch.empty(0, 3, 5, 8).transpose(1, 2),
])
def test_dense_strides_memo_is_empty_like(make):
    from fa_compile.kernels import triton_ops

    t = make()
    want = torch.empty_like(t).stride()
    assert triton_ops._dense_strides(t) == want
    assert triton_ops._dense_strides(t) == want  # from the memo
    assert (tuple(t.shape), tuple(t.stride())) in triton_ops._DENSE_STRIDES
