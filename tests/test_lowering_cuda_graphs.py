"""The CUDA lowerings' graphs, traced on CPU with fake CUDA tensors (no GPU needed) and pinned:
what Inductor receives in place of an fa3 node for FA2 and FA3 (the kernels themselves, and the
lowerings that build masks with factory ops, which need a real CUDA build to trace, are checked
against the op on the GPU in test_lowering_gpu.py)."""
from __future__ import annotations

import expecttest
import torch
from torch._inductor.decomposition import select_decomp_table
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from fa_compile import dispatch
from fa_compile.lowering import choice
from fa_compile.lowering import fa3, sdpa  # noqa: F401  (register the lowerings)


def _graph(kernel: str, b=2, hq=4, hkv=4, nq=16, nk=16, d=64, bias=False, kv_lens=False, causal=False) -> str:
    with FakeTensorMode(allow_non_fake_inputs=True):
        dev, dt = "cuda", torch.bfloat16
        q = torch.empty(b, nq, hq, d, device=dev, dtype=dt).transpose(1, 2)  # BSHD storage, as models hold it
        k = torch.empty(b, nk, hkv, d, device=dev, dtype=dt).transpose(1, 2)
        v = torch.empty(b, nk, hkv, d, device=dev, dtype=dt).transpose(1, 2)
        keep = torch.empty(b, 1, 1, nk, device=dev, dtype=torch.bool) if bias else None
        lens = torch.empty(b, device=dev, dtype=torch.int64) if kv_lens else None
        args = dispatch.AttentionArgs(q=q, k=k, v=v, scale=d ** -0.5, causal=causal, diag_offset=nk - nq if causal else 0,
                                      bias=keep, kv_lens=lens)
        extra = [t for t in (keep, lens) if t is not None]
        fn = choice.LOWERINGS[("cuda", kernel)].forward_fn(args)
        gm = make_fx(fn, decomposition_table=select_decomp_table(), tracing_mode="real")(q, k, v, *extra)
    return gm.code.strip()


def test_flash_forward_causal():
    expecttest.assert_expected_inline(_graph("flash", causal=True), """\
def forward(self, arg0_1, arg1_1, arg2_1):
    _scaled_dot_product_flash_attention = torch.ops.aten._scaled_dot_product_flash_attention.default(arg0_1, arg1_1, arg2_1, 0.0, True, scale = 0.125);  arg0_1 = arg1_1 = arg2_1 = None
    getitem = _scaled_dot_product_flash_attention[0]
    getitem_1 = _scaled_dot_product_flash_attention[1]
    getitem_2 = _scaled_dot_product_flash_attention[2];  getitem_2 = None
    getitem_3 = _scaled_dot_product_flash_attention[3];  getitem_3 = None
    getitem_4 = _scaled_dot_product_flash_attention[4];  getitem_4 = None
    getitem_5 = _scaled_dot_product_flash_attention[5];  getitem_5 = None
    getitem_6 = _scaled_dot_product_flash_attention[6];  getitem_6 = None
    getitem_7 = _scaled_dot_product_flash_attention[7];  getitem_7 = None
    getitem_8 = _scaled_dot_product_flash_attention[8];  _scaled_dot_product_flash_attention = getitem_8 = None
    return (getitem, getitem_1)""")


def test_fa3_decode_forward_with_key_lengths():
    expecttest.assert_expected_inline(_graph("fa3", hq=16, hkv=8, nq=1, nk=320, d=128, kv_lens=True), """\
def forward(self, arg0_1, arg1_1, arg2_1, arg3_1):
    permute = torch.ops.aten.permute.default(arg0_1, [0, 2, 1, 3]);  arg0_1 = None
    permute_1 = torch.ops.aten.permute.default(arg1_1, [0, 2, 1, 3]);  arg1_1 = None
    permute_2 = torch.ops.aten.permute.default(arg2_1, [0, 2, 1, 3]);  arg2_1 = None
    clamp_min = torch.ops.aten.clamp_min.default(arg3_1, 0);  arg3_1 = None
    clamp_max = torch.ops.aten.clamp_max.default(clamp_min, 320);  clamp_min = None
    convert_element_type = torch.ops.prims.convert_element_type.default(clamp_max, torch.int32);  clamp_max = None
    forward = torch.ops.fa3_lowered.forward.default(permute, permute_1, permute_2, convert_element_type, 0.08838834764831845, False, -1, -1, 0.0, 0);  permute = permute_1 = permute_2 = convert_element_type = None
    getitem = forward[0]
    getitem_1 = forward[1];  forward = None
    permute_3 = torch.ops.aten.permute.default(getitem, [0, 2, 1, 3]);  getitem = None
    isinf = torch.ops.aten.isinf.default(getitem_1)
    scalar_tensor = torch.ops.aten.scalar_tensor.default(-inf, dtype = torch.float32, layout = torch.strided, device = device(type='cuda', index=0))
    where = torch.ops.aten.where.self(isinf, scalar_tensor, getitem_1);  scalar_tensor = getitem_1 = None
    unsqueeze = torch.ops.aten.unsqueeze.default(isinf, -1);  isinf = None
    scalar_tensor_1 = torch.ops.aten.scalar_tensor.default(0.0, dtype = torch.bfloat16, layout = torch.strided, device = device(type='cuda', index=0))
    where_1 = torch.ops.aten.where.self(unsqueeze, scalar_tensor_1, permute_3);  unsqueeze = scalar_tensor_1 = permute_3 = None
    return (where_1, where)""")


def test_triton_lowering_on_cuda_takes_short_sites(monkeypatch):
    # On CUDA the pointer kernels are lowered up to Nq x Nk = 1024 x 1024, also where Hopper would run the
    # descriptor kernels; longer sites there keep the op; FA_COMPILE_TRITON_LOWER=0 turns the lowering off.
    from fa_compile.lowering import triton as triton_lowering

    monkeypatch.delenv("FA_COMPILE_TRITON_LOWER", raising=False)
    monkeypatch.delenv("FA_COMPILE_TRITON_TMA", raising=False)
    monkeypatch.setattr(triton_lowering, "_capability", lambda t: (9, 0))
    lowering = choice.LOWERINGS[("cuda", "triton")]

    def reasons(n: int) -> list[str]:
        with FakeTensorMode(allow_non_fake_inputs=True):
            q = torch.empty(2, 4, n, 64, device="cuda", dtype=torch.float16)
            return lowering.reasons(dispatch.AttentionArgs(q=q, k=q, v=q, scale=0.125), "forward")

    assert reasons(1024) == []
    long = reasons(1025)
    assert len(long) == 1 and "TMA-descriptor / Gluon" in long[0] and "1025 x 1025" in long[0], long
    monkeypatch.setenv("FA_COMPILE_TRITON_LOWER", "1")
    assert reasons(1025) == []
    monkeypatch.setenv("FA_COMPILE_TRITON_LOWER", "0")
    off = reasons(16)
    assert len(off) == 1 and "FA_COMPILE_TRITON_LOWER=0" in off[0], off


def test_sdpa_bias_is_stored_at_its_own_size():
    # Inductor writes a broadcast bias out at its expanded size unless it is a view of a stored buffer
    # (traced here on CPU tensors: the graph does not depend on the device).
    from fa_compile.lowering.sdpa import _bias

    q = torch.empty(4, 16, 512, 64, dtype=torch.bfloat16)
    keep = torch.ones(4, 1, 1, 512, dtype=torch.bool)
    gm = make_fx(lambda q, m: _bias(q, q, m, None), decomposition_table=select_decomp_table(),
                 tracing_mode="fake")(q, keep)
    expecttest.assert_expected_inline(gm.code.strip(), """\
def forward(self, q_1, m_1):
    full = torch.ops.aten.full.default([4, 1, 1, 512], 0, dtype = torch.bfloat16, layout = torch.strided, device = device(type='cpu'), pin_memory = False)
    bitwise_not = torch.ops.aten.bitwise_not.default(m_1);  m_1 = None
    scalar_tensor = torch.ops.aten.scalar_tensor.default(-inf, dtype = torch.bfloat16, layout = torch.strided, device = device(type='cpu'))
    where = torch.ops.aten.where.self(bitwise_not, scalar_tensor, full);  bitwise_not = scalar_tensor = full = None
    inductor_force_stride_order = torch.ops.prims.inductor_force_stride_order.default(where, [512, 512, 512, 1]);  where = None
    expand = torch.ops.aten.expand.default(inductor_force_stride_order, [4, 16, 512, 512]);  inductor_force_stride_order = None
    return expand""")
