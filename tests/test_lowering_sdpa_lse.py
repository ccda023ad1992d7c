"""The SDPA-family lowerings (fa_compile/lowering/sdpa.py) on CUDA FakeTensors (no GPU needed): a graph that reads
no lse asks cuDNN and mem-efficient for none, as SDPA itself does without a gradient; a graph that reads it (a
training forward saves it) still gets it. (Masked sites, whose empty rows are found from the lse, need bool ops that
FakeTensors on a CPU-only build cannot run: tests/test_lowering_gpu.py covers them.)"""
from __future__ import annotations

import expecttest
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

import fa_compile.ops  # noqa: F401  (registers torch.ops.fa3)
from fa_compile.candidates import common
from fa_compile.lowering import graph_pass

OP = torch.ops.fa3.attention.default
_CALLS = {"cudnn": torch.ops.aten._scaled_dot_product_cudnn_attention.default,
          "efficient": torch.ops.aten._scaled_dot_product_efficient_attention.default}


@pytest.fixture(autouse=True)
def _hopper(monkeypatch):
    monkeypatch.setattr(common, "device_capability", lambda device: (9, 0))
    from fa_compile.lowering import sdpa  # noqa: F401  (registers the SDPA-family lowerings)


def _lowered(kernel: str, read_lse: bool) -> torch.fx.GraphModule:
    b, h, n, d = 2, 4, 64, 32

    def f(x):
        q, k, v = x.view(b, n, 3, h, d).permute(2, 0, 3, 1, 4).unbind(0)
        out, lse = OP(q, k, v, d ** -0.5, True, 0, -1, -1, None, None, 0.0, 0.0, None, kernel)
        y = out.transpose(1, 2).reshape(b, n, h * d)
        return (y, lse) if read_lse else y

    with FakeTensorMode():
        x = torch.empty(b, n, 3 * h * d, device="cuda", dtype=torch.bfloat16)
        gm = make_fx(f, tracing_mode="fake")(x)
        decisions = graph_pass.lower_graph(gm.graph)
    assert [d.kernel for d in decisions] == [kernel] and all(d.lowered for d in decisions), decisions
    gm.recompile()
    return gm


def _compute_lse_flag(gm: torch.fx.GraphModule, kernel: str) -> bool:
    calls = [n for n in gm.graph.nodes if n.target is _CALLS[kernel]]
    assert len(calls) == 1, gm.code
    return calls[0].args[4]


@pytest.mark.parametrize("kernel", ["cudnn", "efficient"])
def test_a_graph_that_reads_no_lse_asks_for_none(kernel):
    assert _compute_lse_flag(_lowered(kernel, read_lse=False), kernel) is False
    if kernel == "cudnn":  # (mem-efficient's lse call reads the CUDA generator: not traceable without a GPU)
        assert _compute_lse_flag(_lowered(kernel, read_lse=True), kernel) is True


def test_the_inference_graph_without_lse_is_pinned():
    gm = _lowered("cudnn", read_lse=False)
    expecttest.assert_expected_inline(gm.code.strip(), """\
def forward(self, x_1):
    view = torch.ops.aten.view.default(x_1, [2, 64, 3, 4, 32]);  x_1 = None
    permute = torch.ops.aten.permute.default(view, [2, 0, 3, 1, 4]);  view = None
    unbind = torch.ops.aten.unbind.int(permute);  permute = None
    getitem = unbind[0]
    getitem_1 = unbind[1]
    getitem_2 = unbind[2];  unbind = None
    _scaled_dot_product_cudnn_attention = torch.ops.aten._scaled_dot_product_cudnn_attention.default(getitem, getitem_1, getitem_2, None, False, 0.0, True, scale = 0.1767766952966369);  getitem = getitem_1 = getitem_2 = None
    getitem_5 = _scaled_dot_product_cudnn_attention[0];  _scaled_dot_product_cudnn_attention = None
    transpose = torch.ops.aten.transpose.int(getitem_5, 1, 2);  getitem_5 = None
    view_1 = torch.ops.aten.view.default(transpose, [2, 64, 128]);  transpose = None
    return view_1""")
