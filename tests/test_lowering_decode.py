"""The split-KV decode kernel as the `fa3_decode::fwd` triton_op (fa_compile/kernels/decode_ops.py) and its lowering
(fa_compile/lowering/decode.py), on CPU under the Triton interpreter: the op against the reference on
every element (outputs poisoned first), the same as the run-time candidate's launch, sites with q_pos or
with kv_lens beside a bias lowered into kernel nodes (pinned), the sites it refuses, and lengths that
several layers share written once (`fa3_decode::materialize`).

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
    from fa_compile.kernels.triton_testing import eager_empty_fill, finite_poison_empty, make_case
    from fa_compile.lowering import choice, graph_pass, site_args
    from fa_compile.lowering import decode as decode_lowering

    FUNCTIONAL = torch.ops.higher_order.triton_kernel_wrapper_functional

    pytestmark = pytest.mark.usefixtures("tf32_matmul")

    @pytest.fixture
    def poisoned(monkeypatch):
        """Every output and workspace the op allocates starts as NaN (an integer one: its dtype's minimum)."""
        def nan_empty(shape, stride, dtype, device):
            poison = float("nan") if dtype.is_floating_point else torch.iinfo(dtype).min
            return torch.empty_strided(shape, stride, dtype=dtype, device=device).fill_(poison)

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

    # Rows that admit no key: eager's value written by the kernel itself (empty_fill), not by graph ops after it.

    def _empty_rows_case(dtype=torch.float16):
        case = make_case(b=3, hq=8, hkv=2, nq=2, nk=150, d=16, dtype=dtype, seed=9, needs_backward=False,
                         kv_lens=[150, 0, 90])  # batch 1: no key at all
        keep = torch.rand(3, 8, 2, 150, generator=torch.Generator().manual_seed(10)) > 0.5
        keep[0, 3, 1] = False  # one row of one head
        keep[2, :, 0] = False  # token 0 of batch 2, in every head
        case.bias = keep
        case.v = case.v + 1.0  # a mean far from 0: a wrong count of keys shows
        return case

    @pytest.fixture
    def finite_poison(monkeypatch):
        """Outputs (and workspaces) start as 12345 (a NaN poison would hide a missing NaN write)."""
        monkeypatch.setattr(decode_ops, "_empty", finite_poison_empty)

    @pytest.mark.parametrize("splits", [1, 3])
    @pytest.mark.parametrize("kind", ["nan", "mean_v"])
    def test_op_writes_eagers_value_on_rows_with_no_key(kind, splits, finite_poison):
        case = _empty_rows_case()
        out, lse = decode_ops.fwd(case.q, case.k, case.v, case.bias, case.kv_lens, None, case.scale, False, 0,
                                  splits, 16, decode_ops.EMPTY_FILLS[kind])
        want, want_lse = ref.attention_reference(case.q, case.k, case.v, **case.mask_kwargs())
        empty = torch.isneginf(want_lse)
        assert 0 < int(empty.sum()) < empty.numel()
        torch.testing.assert_close(out, eager_empty_fill(case, kind, want, want_lse), atol=2e-3, rtol=2e-3, equal_nan=True)
        torch.testing.assert_close(lse, want_lse, atol=1e-4, rtol=1e-4)  # -inf stays on those rows

    def test_op_rejects_an_unknown_fill():
        case = _empty_rows_case()
        with pytest.raises(ValueError, match="empty_fill"):
            decode_ops.fwd(case.q, case.k, case.v, case.bias, case.kv_lens, None, case.scale, False, 0, 1, 16, 3)

    def _emitted_step(case, kind, repeat="interleave", extra_use=False):
        """The post-grad form of a decode step with emit's empty-row fix-up: emit_attention's graph, traced
        to ATen with Inductor's decompositions (what the lowering pass sees after AOTAutograd). `repeat`
        "repeat" spells the head repeat as .repeat (not emit's: wrong head order for GQA); `extra_use`
        also returns the op's own out."""
        import torch.fx as fx
        from torch._inductor.decomposition import select_decomp_table
        from torch._subclasses.fake_tensor import FakeTensorMode

        from fa_compile.patterns import emit

        inputs = [case.q, case.k, case.v, case.bias, case.kv_lens]
        mode = FakeTensorMode()
        g = fx.Graph()
        nodes = []
        for name, t in zip(("q", "k", "v", "bias", "kv_lens"), inputs):
            n = g.placeholder(name)
            n.meta["example_value"] = mode.from_tensor(t)
            nodes.append(n)
        if repeat == "interleave" and not extra_use:
            out, _ = emit.emit_attention(g, *nodes[:3], scale=case.scale, bias=nodes[3], kv_lens=nodes[4],
                                         empty_rows=kind)
            g.output(out)
        else:  # spelled by hand: forms emit does not produce, which the fold must leave alone
            q, k, v, bias, kv_lens = nodes
            op = g.call_function(torch.ops.fa3.attention.default,
                                 (q, k, v, case.scale, False, 0, -1, -1, bias, kv_lens, 0.0, 0.0, None, None))
            o, lse = (g.call_function(__import__("operator").getitem, (op, i)) for i in (0, 1))
            hg = case.q.shape[1] // case.k.shape[1]
            mean = g.call_function(torch.mean, (v,), dict(dim=2, keepdim=True))
            fill = g.call_method("repeat", (mean, 1, hg, 1, 1)) if repeat == "repeat" else \
                g.call_function(torch.repeat_interleave, (mean, hg), dict(dim=1))
            cond = g.call_function(torch.unsqueeze, (g.call_function(torch.isneginf, (lse,)), -1))
            res = g.call_function(torch.where, (cond, fill, o))
            g.output((res, o) if extra_use else res)
        gm = fx.GraphModule({}, g)
        return make_fx(gm, decomposition_table=select_decomp_table(), tracing_mode="fake")(*inputs), inputs

    @pytest.mark.parametrize("kind", ["nan", "mean_v"])
    def test_emits_fixup_is_folded_into_the_kernel(kind, cpu_steps, finite_poison):
        case = _empty_rows_case()
        gm, inputs = _emitted_step(case, kind)
        want = gm(*inputs)  # the op (reference kernel) and the fix-up as graph ops
        decisions = graph_pass.lower_graph(gm.graph)
        gm.recompile()
        what = "NaN" if kind == "nan" else "mean of V"
        assert [str(d) for d in decisions] == [f"decode -> fa3_decode.fwd (empty rows: {what} written by the kernel)"]
        left = {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}
        assert not any(x in t for t in left for x in ("where", "mean", "eq", "isneginf")), left
        fills = [n.args[1] for n in gm.graph.nodes if n.target is torch.ops.aten.full.default]
        assert not any(v != v for v in fills), fills  # (the poison's 12345 fills stay; no NaN fill does)
        kernels = [n.kwargs["kwargs"].get("EMPTY_FILL") for n in gm.graph.nodes if n.target is FUNCTIONAL]
        assert kernels[0] == decode_ops.EMPTY_FILLS[kind]
        torch.testing.assert_close(gm(*inputs), want, atol=2e-3, rtol=2e-3, equal_nan=True)

    @pytest.mark.parametrize("form", ["repeat", "extra_use"])
    def test_fixups_in_other_forms_stay_graph_ops(form, cpu_steps, poisoned):
        # .repeat tiles the heads (query head h reads kv head h % Hkv, not h // G), and an out that is read
        # elsewhere needs the op's zeros: either way the fix-up stays, and the numbers are eager's.
        case = _empty_rows_case()
        gm, inputs = _emitted_step(case, "mean_v", repeat="repeat" if form == "repeat" else "interleave",
                                   extra_use=form == "extra_use")
        want = gm(*inputs)
        decisions = graph_pass.lower_graph(gm.graph)
        gm.recompile()
        assert [str(d) for d in decisions] == ["decode -> fa3_decode.fwd"]
        torch.testing.assert_close(gm(*inputs), want, atol=2e-3, rtol=2e-3, equal_nan=True)

    def test_kv_lens_is_passed_once(cpu_lowering):
        # A tensor passed as several kernel arguments is realized once per argument by Inductor: kv_lens
        # goes to SEQLENS only (LEFTPAD and TABLE are unused without paging).
        gm, _ = _site(CASES["float_bias_kv_lens"]())
        graph_pass.lower_graph(gm.graph)
        lens_node = [n for n in gm.graph.nodes if n.op == "placeholder"][4]
        (partial,) = [n for n in gm.graph.nodes if n.target is FUNCTIONAL and "Q" in n.kwargs["kwargs"]]
        assert [k for k, a in partial.kwargs["kwargs"].items() if a is lens_node] == ["SEQLENS"]

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

    def _lowered_launches(case) -> list:
        gm, _ = _site(case)
        graph_pass.lower_graph(gm.graph)
        gm.recompile()
        return [n for n in gm.graph.nodes if n.target is FUNCTIONAL]

    def test_lowered_graph_is_pinned(cpu_lowering):
        # The kernels Inductor will launch, in order, with the plan fixed at compile time (2 splits of a
        # 600-slot cache on the interpreter's pretend 8 SMs, CUDA graphs on) and the combine after them.
        case = _q_pos_case()
        gm, _ = _site(case)
        with torch._inductor.config.patch({"triton.cudagraphs": True}):
            graph_pass.lower_graph(gm.graph)
        gm.recompile()
        calls = []
        for n in gm.graph.nodes:
            if n.target is FUNCTIONAL:
                kw = n.kwargs["kwargs"]
                kernel = "partial" if "Q" in kw else "combine"
                calls.append(f"{kernel} grid={n.kwargs['grid']} " + " ".join(
                    f"{k}={kw[k]}" for k in ("num_splits", "SPLIT", "BLOCK_N", "HAS_QPOS", "DIAG_CAUSAL", "BIAS_KIND",
                                            "HAS_SEQLENS", "EMPTY_FILL") if k in kw))
        expecttest.assert_expected_inline("\n".join(calls), """\
partial grid=[(2, 4, 1)] num_splits=2 SPLIT=True BLOCK_N=64 HAS_QPOS=True DIAG_CAUSAL=False BIAS_KIND=0 HAS_SEQLENS=False EMPTY_FILL=0
combine grid=[(48, 1, 1)] num_splits=2 BLOCK_N=64 EMPTY_FILL=0""")

    def test_short_static_cache_runs_one_split_without_cuda_graphs(cpu_lowering, poisoned):
        # Launched by Inductor's code without CUDA graphs, a decode step is host-bound: a cache of at most
        # HOST_BOUND_MAX_KEYS slots gets no combine launch. Longer caches, and any cache under CUDA graphs, keep
        # the planner's splits.
        from fa_compile.lowering import decode as lowering_decode

        case = _q_pos_case()  # 600 slots
        assert case.k.shape[2] <= lowering_decode.HOST_BOUND_MAX_KEYS
        launches = _lowered_launches(case)
        assert [n.kwargs["grid"] for n in launches] == [[(1, 4, 1)]], launches
        with torch._inductor.config.patch({"triton.cudagraphs": True}):
            assert len(_lowered_launches(case)) == 2
        long = make_case(b=2, hq=8, hkv=2, nq=3, nk=1100, d=32, dtype=torch.float16, seed=4, needs_backward=False)
        long.q_pos = torch.tensor([[1017, 1018, 1019], [5, 6, 7]])
        long_launches = _lowered_launches(long)
        assert len(long_launches) == 2 and long_launches[0].kwargs["grid"][0][0] > 1, long_launches
        gm, inputs = _site(case)
        graph_pass.lower_graph(gm.graph)
        gm.recompile()
        out, lse = gm(*inputs)
        want, want_lse = ref.attention_reference(case.q, case.k, case.v, **case.mask_kwargs())
        torch.testing.assert_close(out, want, atol=2e-3, rtol=2e-3)
        torch.testing.assert_close(lse, want_lse, atol=1e-4, rtol=1e-4)

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

    # Decode steps at compile time: every decode-shaped inference site the kernel can compute is lowered to
    # it (choice.decide asks before the decode-step math and dispatch's order), with or without the
    # static-cache arguments the run-time dispatch order asks for, and at a symbolic cache length.

    @pytest.fixture
    def cpu_steps(monkeypatch, cpu_lowering):
        monkeypatch.setattr(decode_lowering, "STEP_DEVICES", ("cuda", "cpu"))

    STEP_CASES = {
        "float_bias_gqa": lambda: make_case(b=2, hq=8, hkv=2, nq=1, nk=77, d=32, bias_shape=(2, 1, 1, 77),
                                            needs_backward=False),
        "causal_bottom_right_mha": lambda: make_case(b=3, hq=4, nq=2, nk=301, d=16, causal=True, diag_offset=299,
                                                     needs_backward=False),
        "no_mask_bshd": lambda: make_case(b=2, hq=4, hkv=2, nq=1, nk=130, d=64, layout="bshd",
                                          needs_backward=False),
        "bool_mask_per_query": lambda: make_case(b=2, hq=4, hkv=4, nq=3, nk=50, d=16, bias_shape=(2, 4, 3, 50),
                                                 bias_bool=True, needs_backward=False),
    }

    def _step_site(case, tracing_mode="fake"):
        """An fa3 node as the rewrite emits it for a decode step (no forced kernel)."""
        names = [n for n in ("bias", "kv_lens") if getattr(case, n) is not None]
        causal = case.causal

        def fwd(q, k, v, *rest):
            t = dict(zip(names, rest))
            # the causal diagonal of a decode step, bottom-right: read from the sizes (symbolic when they are)
            off = k.shape[2] - q.shape[2] if causal else 0
            out, lse = torch.ops.fa3.attention(q, k, v, case.scale, causal, off, -1, -1, t.get("bias"),
                                               t.get("kv_lens"), 0.0, 0.0, None, None)
            return out, lse * 1.0  # (an lse returned as it is would be a training graph's, saved for the backward)

        inputs = [case.q, case.k, case.v, *[getattr(case, n) for n in names]]
        return make_fx(fwd, tracing_mode=tracing_mode)(*inputs), inputs

    @pytest.mark.parametrize("name", list(STEP_CASES))
    def test_decode_steps_lower_to_the_kernel(name, cpu_steps, poisoned):
        case = STEP_CASES[name]()
        gm, inputs = _step_site(case)
        decisions = graph_pass.lower_graph(gm.graph)
        gm.recompile()
        assert [str(d) for d in decisions] == ["decode -> fa3_decode.fwd"]
        assert all(r[0] != "decode" for r in decisions[0].refused)  # the run-time order rule is not a refusal here
        out, lse = gm(*inputs)
        want, want_lse = ref.attention_reference(case.q, case.k, case.v, **case.mask_kwargs())
        torch.testing.assert_close(out, want, atol=2e-3, rtol=2e-3)
        torch.testing.assert_close(lse, want_lse, atol=1e-4, rtol=1e-4)

    def test_unused_decode_arguments_are_none(cpu_steps):
        # An unused pointer argument is None, a constant of the launch: no buffer is allocated for it per call and the
        # launcher passes no pointer. Never an input (q) in its place: Inductor realizes a tensor it computes once per
        # kernel argument that receives it, so q was copied into each unused slot.
        case = STEP_CASES["no_mask_bshd"]()
        gm, _ = _step_site(case)
        graph_pass.lower_graph(gm.graph)
        launches = [n for n in gm.graph.nodes if n.op == "call_function" and "triton_kernel_wrapper" in str(n.target)]
        assert len(launches) == 1, gm.graph  # one launch: no splits at this length
        kw = launches[0].kwargs["kwargs"]
        tensors = [name for name, a in kw.items() if isinstance(a, torch.fx.Node)]  # (constants live in a side table)
        assert tensors == ["Q", "K", "V", "O", "LSE"], tensors

    def test_decode_steps_at_a_symbolic_cache_length(cpu_steps, poisoned):
        # Traced once with Nk symbolic (as Dynamo's dynamic shapes give a growing DynamicCache): lowered,
        # the splits planned from the traced length, and exact at shorter and longer caches, causal included.
        from torch._dynamo.source import ConstantSource
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

        case = make_case(b=2, hq=8, hkv=2, nq=1, nk=1100, d=32, causal=True, diag_offset=1099, needs_backward=False)
        mode = FakeTensorMode(shape_env=ShapeEnv())
        ctx = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.STATIC, DimDynamic.STATIC, DimDynamic.DYNAMIC,
                                                      DimDynamic.STATIC])
        with mode:
            static = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.STATIC] * 4)
            case.q = mode.from_tensor(case.q, source=ConstantSource("q"), symbolic_context=static)
            case.k, case.v = (mode.from_tensor(t, source=ConstantSource(n), symbolic_context=ctx)
                              for n, t in (("k", case.k), ("v", case.v)))
            gm, _ = _step_site(case, tracing_mode="real")
        assert any(isinstance(n.meta.get("val"), torch.SymInt) for n in gm.graph.nodes)
        decisions = graph_pass.lower_graph(gm.graph)
        gm.recompile()
        assert [str(d) for d in decisions] == ["decode -> fa3_decode.fwd"]
        grids = [n.kwargs["grid"] for n in gm.graph.nodes if n.target is FUNCTIONAL]
        assert grids[0] == [(4, 4, 1)], grids  # 1100 keys: 4 splits on the interpreter's pretend 8 SMs
        for nk in (1, 45, 300, 1100, 2000):
            c = make_case(b=2, hq=8, hkv=2, nq=1, nk=nk, d=32, causal=True, diag_offset=nk - 1, seed=nk,
                          needs_backward=False)
            out, lse = gm(c.q, c.k, c.v)
            want, want_lse = ref.attention_reference(c.q, c.k, c.v, **c.mask_kwargs())
            torch.testing.assert_close(out, want, atol=2e-3, rtol=2e-3)
            torch.testing.assert_close(lse, want_lse, atol=1e-4, rtol=1e-4)

    def test_decode_steps_the_kernel_refuses_go_on(cpu_steps):
        # softcap, a window, training, more than 16 queries, the switch: not the kernel's (the decode-step
        # math, where it applies, or dispatch's order takes them; decomposed.py's own tests).
        low = decode_lowering.DECODE_LOWERING
        c = STEP_CASES["float_bias_gqa"]()
        base = dict(q=c.q, k=c.k, v=c.v, scale=c.scale)
        assert low.step_reasons(dispatch.AttentionArgs(**base), "forward") == []
        assert "softcap" in " ".join(low.step_reasons(dispatch.AttentionArgs(**base, softcap=30.0), "forward"))
        assert "window" in " ".join(low.step_reasons(dispatch.AttentionArgs(**base, window_left=8), "forward"))
        assert "inference" in " ".join(low.step_reasons(dispatch.AttentionArgs(**base, needs_backward=True),
                                                        "forward"))
        long_q = make_case(b=1, hq=2, nq=17, nk=40, d=16, needs_backward=False)
        assert "query tokens" in " ".join(low.step_reasons(
            dispatch.AttentionArgs(q=long_q.q, k=long_q.k, v=long_q.v, scale=0.25), "forward"))
        os.environ["FA_COMPILE_DECODE_KERNEL"] = "0"
        try:
            assert "off" in " ".join(low.step_reasons(dispatch.AttentionArgs(**base), "forward"))
        finally:
            del os.environ["FA_COMPILE_DECODE_KERNEL"]

    # A kv_lens computed in the graph and read by several layers: Inductor copies an input it has not realized
    # for each user Triton kernel (exact traced strides), so the lengths are written once by a kernel of
    # their own and every layer reads that buffer.

    @pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
    def test_materialize_copies_strided_vectors(dtype, poisoned):
        base = torch.arange(300, dtype=dtype) * 3 - 7
        for x in (base, base[::3], base[5:6].expand(129), base[:0]):
            got = decode_ops.materialize(x)
            assert got.stride() == (1,) and got.dtype == dtype
            assert torch.equal(got, x.contiguous())

    def test_materialize_rejects_what_it_does_not_copy():
        with pytest.raises(ValueError, match="x: expected a 1-d tensor"):
            decode_ops.materialize(torch.zeros(2, 2, dtype=torch.int32))
        with pytest.raises(ValueError, match="x: expected a 1-d tensor"):
            decode_ops.materialize(torch.zeros(3))

    @pytest.fixture
    def materialize_on_cpu(monkeypatch):
        from fa_compile.lowering import share

        monkeypatch.setattr(share, "MATERIALIZE_DEVICES", ("cuda", "cpu"))

    def _layers_sharing_lengths(layers: int):
        case = make_case(b=2, hq=4, hkv=2, nq=1, nk=90, d=16, needs_backward=False)
        pos = torch.tensor([40])  # cache_position of the step: every sequence sees keys 0..40

        def step(q, k, v, pos):
            o = q
            for _ in range(layers):  # each layer derives the lengths with its own ops, as a model's layers do
                lens = (pos + 1).clamp(0, 2 ** 31 - 1).to(torch.int32).expand(q.shape[0])
                o, _ = torch.ops.fa3.attention(o, k, v, case.scale, False, 0, -1, -1, None, lens)
            return o

        inputs = [case.q, case.k, case.v, pos]
        return make_fx(step, tracing_mode="fake")(*inputs), inputs, step

    def test_lengths_shared_by_layers_are_written_once(cpu_steps, materialize_on_cpu, poisoned):
        gm, inputs, step = _layers_sharing_lengths(3)
        decisions = graph_pass.lower_graph(gm.graph)
        gm.recompile()
        assert [str(d) for d in decisions] == ["decode -> fa3_decode.fwd"] * 3
        launches = [n for n in gm.graph.nodes if n.target is FUNCTIONAL]
        copies = [n for n in launches if "stride_x" in n.kwargs["kwargs"]]
        partials = [n for n in launches if "Q" in n.kwargs["kwargs"]]
        assert len(copies) == 1 and len(partials) == 3
        (written,) = [u for u in copies[0].users]  # the copy's output, read by every layer's kernel as it is
        assert all(p.kwargs["kwargs"]["SEQLENS"] is written for p in partials)
        got, want = gm(*inputs), step(*inputs)
        assert not got.isnan().any()
        torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)

    def test_lengths_of_one_layer_are_not_copied(cpu_steps, materialize_on_cpu):
        gm, _, _ = _layers_sharing_lengths(1)
        graph_pass.lower_graph(gm.graph)
        assert not [n for n in gm.graph.nodes if n.target is FUNCTIONAL and "stride_x" in n.kwargs["kwargs"]]
