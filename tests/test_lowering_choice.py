"""The compile-time choice's own rule (fa_compile/lowering/choice.py `_filling_kernel`): a short CUDA inference
site whose output carries emit's empty-row fix-up goes to our Triton forward, which writes those rows itself,
and every case the rule must leave to dispatch's choice. CUDA sites as FakeTensors (no GPU needed); dispatch's
choice and the Triton lowering's own refusals are stubbed, so what is checked is the rule's gating."""
from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from fa_compile import dispatch
from fa_compile.candidates import common
from fa_compile.lowering import choice
from fa_compile.lowering import decode as decode_lowering
from fa_compile.lowering import triton as triton_lowering


@pytest.fixture
def peers(monkeypatch):
    """Dispatch picks cuDNN unless a kernel is forced; the Triton lowering refuses nothing; no decode step."""
    def explain_choice(args, forced=None, direction="forward"):
        return (forced or "cudnn"), [("flash", ["stub"])]

    monkeypatch.setattr(dispatch, "explain_choice", explain_choice)
    monkeypatch.setattr(triton_lowering.TRITON_LOWERING, "reasons", lambda args, direction: [])
    monkeypatch.setattr(decode_lowering.DECODE_LOWERING, "step_reasons", lambda args, direction: ["not a step"])
    monkeypatch.delenv("FA_COMPILE_TUNE", raising=False)
    monkeypatch.setattr(common, "device_capability", lambda device: (9, 0))  # an H200, where the rule was measured
    from fa_compile.lowering import sdpa  # noqa: F401  (registers the cuDNN lowering)


def _args(nq=128, nk=128, d=64, **kw) -> dispatch.AttentionArgs:
    with FakeTensorMode():
        q = torch.empty(2, 4, nq, d, device="cuda", dtype=torch.bfloat16)
        k = torch.empty(2, 4, nk, d, device="cuda", dtype=torch.bfloat16)
        v = torch.empty(2, 4, nk, d, device="cuda", dtype=torch.bfloat16)
        bias = torch.empty(2, 1, 1, nk, device="cuda", dtype=torch.bool)
        extra = {n: torch.empty(2, nq, device="cuda", dtype=torch.int64) for n in kw.pop("runtime", ())}
    return dispatch.AttentionArgs(q, k, v, d ** -0.5, bias=bias, **extra, **kw)


def _decide(args, forced=None, fix="mean_v"):
    return choice.decide(args, forced, "forward", measure=False, empty_fix=fix)


def test_a_short_padded_inference_site_takes_the_kernel_that_fills(peers):
    d = _decide(_args())
    assert (d.kernel, d.target) == ("triton", "fa3_triton.fwd"), d
    assert d.refused[0][0] == "cudnn" and "writes the rows that admit no key itself" in d.refused[0][1][0], d.refused
    assert _decide(_args(), fix="nan").kernel == "triton"


@pytest.mark.parametrize("case", ["no_fixup", "training", "forced", "long", "head_dim_256", "q_pos", "segments",
                                  "sdpa_kernel", "decode_step", "triton_refuses", "ampere"])
def test_the_rule_leaves_other_sites_to_dispatch(case, peers, monkeypatch):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    args, forced, fix = _args(), None, "mean_v"
    if case == "no_fixup":
        fix = None
    elif case == "training":
        args = _args(needs_backward=True)
    elif case == "forced":
        forced = "cudnn"
    elif case == "long":
        args = _args(nq=1024, nk=512)
    elif case == "head_dim_256":
        args = _args(d=256)
    elif case == "q_pos":
        args = _args(runtime=("q_pos",))
    elif case == "segments":
        args = _args(runtime=("q_seg", "k_seg"))
    elif case == "decode_step":
        monkeypatch.setattr(decode_lowering.DECODE_LOWERING, "step_reasons", lambda args, direction: [])
    elif case == "ampere":
        monkeypatch.setattr(common, "device_capability", lambda device: (8, 0))
    elif case == "triton_refuses":
        monkeypatch.setattr(triton_lowering.TRITON_LOWERING, "reasons", lambda args, direction: ["no"])
    if case == "sdpa_kernel":
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            d = _decide(args, forced, fix)
    else:
        d = _decide(args, forced, fix)
    assert d.kernel == ("decode" if case == "decode_step" else "cudnn"), d
