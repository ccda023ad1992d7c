"""The split-KV decode kernel as the `fa3_decode::fwd` triton_op (kernels/decode_ops.py) and its lowering
(fa_compile/lowering/decode.py), on CPU under the Triton interpreter: the op against the reference on
every element (outputs poisoned first), the same as the run-time candidate's launch, sites with q_pos or
with kv_lens beside a bias lowered into kernel nodes (pinned), and the sites it refuses.

As tests/test_lowering_triton.py: unless this process already has TRITON_INTERPRET=1, the module runs
itself in a fresh subprocess with it set. fp16 / fp32 only (the interpreter's bf16 dot is unreliable).
"""
from __future__ import annotations

import os

import pytest
import torch

from fa_compile.kernels import triton_family as tf

IN_CHILD = os.environ.get("TRITON_INTERPRET") == "1"
needs_triton = pytest.mark.skipif(not tf.triton_available(), reason="triton not installed")

if not IN_CHILD:

    @needs_triton
    def test_decode_lowering_under_interpreter():
        from fa_compile.kernels.triton_testing import run_under_interpreter

        run_under_interpreter(__file__)

else:
    import expecttest
    from torch.fx.experimental.proxy_tensor import make_fx

    from fa_compile import dispatch
    from fa_compile import ops  # noqa: F401  (registers torch.ops.fa3)
    from fa_compile.kernels import decode, decode_ops, triton_ops
    from fa_compile.kernels import reference as ref
    from fa_compile.kernels.triton_testing import make_case
    from fa_compile.lowering import choice, graph_pass, site_args
    from fa_compile.lowering import decode as decode_lowering

    FUNCTIONAL = torch.ops.higher_order.triton_kernel_wrapper_functional

    pytestmark = pytest.mark.usefixtures("tf32_matmul")

    @pytest.fixture
    def poisoned(monkeypatch):
        """Every output and workspace the op allocates starts as NaN."""
        def nan_empty(shape, stride, dtype, device):
            return torch.empty_strided(shape, stride, dtype=dtype, device=device).fill_(float("nan"))

        monkeypatch.setattr(decode_ops, "_empty", nan_empty)

    @pytest.fixture
    def cpu_lowering(monkeypatch):
        monkeypatch.setitem(choice.LOWERINGS, ("cpu", "decode"), decode_lowering.DECODE_LOWERING)

    def _q_pos_case(dtype=torch.float16):
        case = make_case(b=2, hq=8, hkv=2, nq=3, nk=600, d=32, dtype=dtype, seed=4, needs_backward=False)
        case.q_pos = torch.tensor([[517, 518, 519], [5, 6, 7]])  # each sequence's own decode positions
        return case

    def _bias_lens_case(dtype=torch.float16, bool_mask=False):
        case = make_case(b=3, hq=4, hkv=4, nq=1, nk=150, d=16, dtype=dtype, seed=6, needs_backward=False,
                         kv_lens=[150, 41, 0])
        keep = torch.rand(3, 1, 1, 150, generator=torch.Generator().manual_seed(8)) > 0.3
        keep[1, ..., 30:] = False
        case.bias = keep if bool_mask else torch.zeros(keep.shape, dtype=dtype).masked_fill(~keep, torch.finfo(dtype).min)
        return case

    CASES = {
        "q_pos_gqa": _q_pos_case,
        "q_pos_fp32": lambda: _q_pos_case(torch.float32),
        "float_bias_kv_lens": _bias_lens_case,
        "bool_bias_kv_lens": lambda: _bias_lens_case(bool_mask=True),
        "causal_diag": lambda: make_case(b=2, hq=4, hkv=2, nq=4, nk=90, d=16, causal=True, diag_offset=60,
                                         kv_lens=[90, 50], bias_shape=(2, 1, 1, 90), needs_backward=False),
    }

    def _op(case, splits, block_n=16):
        return decode_ops.fwd(case.q, case.k, case.v, case.bias, case.kv_lens, case.q_pos, case.scale, case.causal,
                              case.diag_offset, splits, block_n)

    @pytest.mark.parametrize("splits", [1, 3])
    @pytest.mark.parametrize("name", list(CASES))
    def test_op_matches_reference_and_the_candidate(name, splits, poisoned):
        case = CASES[name]()
        out, lse = _op(case, splits)
        want, want_lse = ref.attention_reference(case.q, case.k, case.v, **case.mask_kwargs())
        tol = 2e-3 if case.q.dtype == torch.float16 else 1e-4
        torch.testing.assert_close(out, want, atol=tol, rtol=tol)
        torch.testing.assert_close(lse, want_lse, atol=1e-4, rtol=1e-4)
        b, hq, nq, dv = out.shape
        assert out.stride() == (nq * hq * dv, dv, hq * dv, 1) and lse.is_contiguous()
        o2, l2 = decode.attention_decode(case, num_splits=splits)  # the run-time candidate's launch
        torch.testing.assert_close(out, o2, atol=tol, rtol=tol)
        torch.testing.assert_close(lse, l2, atol=1e-5, rtol=1e-5)

    def test_op_rejects_a_bad_plan():
        case = _q_pos_case()
        with pytest.raises(ValueError, match="splits"):
            _op(case, 0)

    def _site(case):
        """A graph holding one fa3 node forced to kernel "decode" (FakeTensor metadata on every node)."""
        kw = dict(bias=case.bias, kv_lens=case.kv_lens, q_pos=case.q_pos)
        names = [n for n in ("bias", "kv_lens", "q_pos") if kw[n] is not None]

        def fwd(q, k, v, *rest):
            t = dict(kw, **dict(zip(names, rest)))
            return torch.ops.fa3.attention(q, k, v, case.scale, case.causal, case.diag_offset, -1, -1, t["bias"],
                                           t["kv_lens"], 0.0, 0.0, None, "decode", None, t["q_pos"])

        inputs = [case.q, case.k, case.v, *[kw[n] for n in names]]
        return make_fx(fwd, tracing_mode="fake")(*inputs), inputs

    @pytest.mark.parametrize("name", ["q_pos_gqa", "float_bias_kv_lens", "bool_bias_kv_lens", "causal_diag"])
    def test_lowered_site_matches_reference(name, cpu_lowering, poisoned):
        case = CASES[name]()
        gm, inputs = _site(case)
        decisions = graph_pass.lower_graph(gm.graph)
        gm.recompile()
        assert [str(d) for d in decisions] == ["decode -> fa3_decode.fwd"]
        nodes = [n.target for n in gm.graph.nodes if n.op == "call_function"]
        assert FUNCTIONAL in nodes and site_args.FORWARD not in nodes
        out, lse = gm(*inputs)
        want, want_lse = ref.attention_reference(case.q, case.k, case.v, **case.mask_kwargs())
        torch.testing.assert_close(out, want, atol=2e-3, rtol=2e-3)
        torch.testing.assert_close(lse, want_lse, atol=1e-4, rtol=1e-4)

    def test_lowered_graph_is_pinned(cpu_lowering):
        # The kernels Inductor will launch, in order, with the plan fixed at compile time (2 splits of a
        # 600-slot cache on the interpreter's pretend 8 SMs) and the combine after them.
        case = _q_pos_case()
        gm, _ = _site(case)
        graph_pass.lower_graph(gm.graph)
        gm.recompile()
        calls = []
        for n in gm.graph.nodes:
            if n.target is FUNCTIONAL:
                kw = n.kwargs["kwargs"]
                kernel = "partial" if "Q" in kw else "combine"
                calls.append(f"{kernel} grid={n.kwargs['grid']} " + " ".join(
                    f"{k}={kw[k]}" for k in ("num_splits", "SPLIT", "BLOCK_N", "HAS_QPOS", "DIAG_CAUSAL", "BIAS_KIND",
                                            "HAS_SEQLENS") if k in kw))
        expecttest.assert_expected_inline("\n".join(calls), """\
partial grid=[(2, 4, 1)] num_splits=2 SPLIT=True BLOCK_N=64 HAS_QPOS=True DIAG_CAUSAL=False BIAS_KIND=0 HAS_SEQLENS=False
combine grid=[(48, 1, 1)] num_splits=2""")

    def test_describe_names_the_decode_op(cpu_lowering):
        case = _q_pos_case()
        args = dispatch.AttentionArgs(case.q, case.k, case.v, case.scale, q_pos=case.q_pos)
        assert choice.describe(args, "decode") == "forward decode -> fa3_decode.fwd"

    def test_backward_and_symbolic_sizes_keep_the_op():
        low = decode_lowering.DECODE_LOWERING
        case = _q_pos_case()
        args = dispatch.AttentionArgs(case.q, case.k, case.v, case.scale, q_pos=case.q_pos)
        assert low.reasons(args, "backward") == ["the decode kernel's lowering: forward only"]
        assert low.reasons(args, "forward") == []
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.fx.experimental.symbolic_shapes import ShapeEnv

        mode = FakeTensorMode(shape_env=ShapeEnv())
        from torch._dynamo.source import ConstantSource
        from torch.fx.experimental.symbolic_shapes import DimDynamic, StatelessSymbolicContext

        ctx = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.STATIC, DimDynamic.STATIC, DimDynamic.DYNAMIC,
                                                      DimDynamic.STATIC])
        k = mode.from_tensor(case.k, source=ConstantSource("k"), symbolic_context=ctx)
        v = mode.from_tensor(case.v, source=ConstantSource("v"), symbolic_context=ctx)
        q = mode.from_tensor(case.q)
        why = low.reasons(dispatch.AttentionArgs(q, k, v, case.scale, q_pos=case.q_pos), "forward")
        assert len(why) == 1 and "dynamic" in why[0], why
        assert triton_ops.NAMESPACE != decode_ops.NAMESPACE
