"""The Triton family's triton_ops (fa_compile/kernels/triton_ops.py) and their lowering (fa_compile/lowering/triton.py)
on CPU, under the Triton interpreter: eager ops against the reference on every element (outputs poisoned
first), the ops traced by AOTAutograd into triton_kernel_wrapper_functional nodes, the lowering spliced
into graphs by lower_graph (pinned), and the sites it refuses.

As tests/test_kernels_interp.py: unless this process already has TRITON_INTERPRET=1, the module runs
itself in a fresh subprocess with it set (the interpreter must be on before any kernel is defined).
Shapes are tiny; fp16 / fp32 only (the interpreter's bf16 dot is unreliable).
"""
from __future__ import annotations

import contextlib
import os
import re

import pytest
import torch

from fa_compile.kernels import triton_family as tf

IN_CHILD = os.environ.get("TRITON_INTERPRET") == "1"
needs_triton = pytest.mark.skipif(not tf.triton_available(), reason="triton not installed")

if not IN_CHILD:

    @needs_triton
    def test_triton_lowering_under_interpreter():
        from fa_compile.kernels.triton_testing import run_under_interpreter

        run_under_interpreter(__file__)

else:
    import expecttest
    from torch.fx.experimental.proxy_tensor import make_fx

    import fa_compile
    from fa_compile import ops  # noqa: F401  (registers torch.ops.fa3)
    from fa_compile.kernels import decode_ops  # noqa: F401  (bound to the real `_empty` before any fixture patches it)
    from fa_compile.kernels import reference as ref
    from fa_compile.kernels import triton_ops
    from fa_compile.kernels.triton_testing import eager_empty_fill, finite_poison_empty, make_case, tolerances
    from fa_compile.lowering import choice, graph_pass, site_args
    from fa_compile.lowering import triton as triton_lowering

    TILE = [16, 16, 4, 1]  # the family's interpreter tile (pick_config on CPU)
    FUNCTIONAL = torch.ops.higher_order.triton_kernel_wrapper_functional

    pytestmark = pytest.mark.usefixtures("tf32_matmul")

    @pytest.fixture
    def poisoned(monkeypatch):
        """Every output the ops allocate starts as NaN: an element no kernel writes fails the comparison."""
        def nan_empty(shape, stride, dtype, device):
            poison = float("nan") if dtype.is_floating_point else -7  # (a key limit's int32 output)
            return torch.empty_strided(shape, stride, dtype=dtype, device=device).fill_(poison)

        monkeypatch.setattr(triton_ops, "_empty", nan_empty)

    @pytest.fixture
    def cpu_lowering(monkeypatch):
        """The lowering for CPU sites, which only the interpreter runs (Inductor never sees them)."""
        from fa_compile.lowering import key_limit

        monkeypatch.setitem(choice.LOWERINGS, ("cpu", "triton"), triton_lowering.TRITON_LOWERING)
        monkeypatch.setattr(key_limit, "DEVICES", ("cuda", "cpu"))  # and a key-padding mask's limit as its kernel

    def _cut_tail(case, n):
        """Every key from n on masked: the key limit (key_limit.for_site) cuts the tiles past it."""
        case.bias = case.bias.clone()
        case.bias[..., n:] = False
        return case

    def _tails(case, lengths):
        """Sequence i's keys from lengths[i] on masked (its other keys keep the case's random mask)."""
        case.bias = case.bias.clone()
        for i, n in enumerate(lengths):
            case.bias[i, ..., n:] = False
        return case

    def _empty_rows(case):
        case.bias = case.bias.clone()
        case.bias[..., 3, :] = False if case.bias.dtype == torch.bool else float("-inf")
        return case

    def _positions(b, nq, nk):
        g = torch.Generator().manual_seed(7)
        pos = torch.stack([torch.randperm(nk, generator=g)[:nq].sort().values for _ in range(b)])
        pos[0, 2] = -1
        return pos

    _SEG = torch.tensor([[0] * 9 + [1] * 3 + [2] * 11, [4] * 20 + [5] * 3], dtype=torch.int32)

    CASES = {
        "plain_bshd": lambda: make_case(b=2, hq=2, nq=21, nk=33, d=32, layout="bshd"),
        "causal_offset_gqa": lambda: make_case(b=1, hq=4, hkv=2, nq=19, nk=26, d=24, causal=True, diag_offset=5),
        "causal_negative_offset": lambda: make_case(b=1, hq=2, nq=20, nk=20, d=16, causal=True, diag_offset=-4),
        "float_bias_grad_empty_row": lambda: _empty_rows(make_case(b=2, hq=2, nq=18, nk=23, d=16,
                                                                   bias_shape=(1, 2, 18, 23), bias_grad=True)),
        "bool_key_padding": lambda: make_case(b=2, hq=2, nq=17, nk=29, d=16, bias_shape=(2, 1, 1, 29), bias_bool=True),
        "causal_key_padding": lambda: _tails(make_case(b=3, hq=4, hkv=2, nq=30, nk=40, d=16, causal=True, diag_offset=10,
                                                       bias_shape=(3, 1, 1, 40), bias_bool=True), (40, 18, 5)),
        "one_key_mask_for_the_batch": lambda: _cut_tail(make_case(b=3, hq=2, nq=17, nk=40, d=16, bias_shape=(1, 1, 1, 40),
                                                                  bias_bool=True), 21),
        "kv_lens_empty_batch_fp32": lambda: make_case(b=3, hq=2, nq=14, nk=21, d=16, kv_lens=[21, 0, 9],
                                                      dtype=torch.float32),
        "window_softcap": lambda: make_case(b=1, hq=2, nq=22, nk=22, d=16, window_left=5, window_right=2, softcap=2.0),
        "dropout_gqa": lambda: make_case(b=1, hq=4, hkv=2, nq=18, nk=21, d=16, dropout_p=0.3, kv_lens=[15]),
        # run-time positions per sequence (a static cache's prefill), one row at -1 (no key: an empty row)
        "positions_gqa": lambda: make_case(b=2, hq=4, hkv=2, nq=13, nk=37, d=16, q_pos=_positions(2, 13, 37)),
        # packed sequences: segment ids per sequence and key, with causality
        "segments_causal": lambda: make_case(b=2, hq=2, nq=23, nk=23, d=16, causal=True, q_seg=_SEG, k_seg=_SEG),
    }

    def _fwd(case, q=None, k=None, v=None):
        q, k, v = (case.q, case.k, case.v) if q is None else (q, k, v)
        return triton_ops.fwd(q, k, v, case.bias, case.kv_lens, case.dropout_seed, case.scale, case.causal,
                              case.diag_offset, case.window_left, case.window_right, case.softcap, case.dropout_p,
                              TILE, None, 0, case.q_pos, case.q_seg, case.k_seg)

    def _bwd(case, dout, out, lse, fused_dq=False):
        want_ds = bool(case.bias_requires_grad)
        return triton_ops.bwd(dout, case.q, case.k, case.v, out, lse, case.bias, case.kv_lens, case.dropout_seed,
                              case.scale, case.causal, case.diag_offset, case.window_left, case.window_right,
                              case.softcap, case.dropout_p, want_ds, TILE, TILE, 0, fused_dq, case.q_pos, case.q_seg,
                              case.k_seg)

    @contextlib.contextmanager
    def _deterministic():
        prev = torch.are_deterministic_algorithms_enabled()
        torch.use_deterministic_algorithms(True)
        try:
            yield
        finally:
            torch.use_deterministic_algorithms(prev)

    def _dout(out):
        g = torch.Generator().manual_seed(1234)
        return torch.randn(out.shape, generator=g).to(out.dtype)

    def _check_forward(case, out, lse):
        (fa, fr), _ = tolerances(case.q.dtype, "cpu")
        r_out, r_lse = ref.attention_reference(case.q, case.k, case.v, **case.mask_kwargs())
        torch.testing.assert_close(out, r_out, atol=fa, rtol=fr, msg=lambda m: "out: " + m)
        torch.testing.assert_close(lse, r_lse, atol=1e-4, rtol=1e-4, msg=lambda m: "lse: " + m)
        b, hq, nq, dv = out.shape
        assert out.stride() == (nq * hq * dv, dv, hq * dv, 1) and lse.dtype == torch.float32 and lse.is_contiguous()

    def _check_backward(case, dout, grads, dbias):
        _, (ga, gr) = tolerances(case.q.dtype, "cpu")
        r = ref.attention_backward_reference(dout, case.q, case.k, case.v, bias_requires_grad=case.bias_requires_grad,
                                             **case.mask_kwargs())
        for name, got, want, like in zip(("dq", "dk", "dv"), grads, r, (case.q, case.k, case.v)):
            torch.testing.assert_close(got, want, atol=ga, rtol=gr, msg=lambda m, n=name: f"{n}: " + m)
            assert got.stride() == torch.empty_like(like).stride(), name
        if case.bias_requires_grad:
            torch.testing.assert_close(dbias, r[3], atol=ga, rtol=gr, msg=lambda m: "dbias: " + m)

    @pytest.mark.parametrize("fused", [True, False], ids=["fused_dq", "dq_kernel"])
    @pytest.mark.parametrize("name", list(CASES))
    def test_ops_eager_match_reference(name, fused, poisoned):
        case = CASES[name]()
        out, lse = _fwd(case)
        _check_forward(case, out, lse)
        dout = _dout(out)
        if fused and case.bias_requires_grad:
            with pytest.raises(ValueError, match="write_ds"):  # the bias gradient needs the dQ kernel's dS
                _bwd(case, dout, out, lse, fused_dq=True)
            return
        dq, dk, dv, ds = _bwd(case, dout, out, lse, fused_dq=fused)
        dbias = tf._reduce_dbias(ds, case.bias) if case.bias_requires_grad else None
        assert case.bias_requires_grad or ds.numel() == 0
        _check_backward(case, dout, (dq, dk, dv), dbias)

    def test_ops_reject_a_bad_tile():
        case = CASES["plain_bshd"]()
        with pytest.raises(ValueError, match="config"):
            triton_ops.fwd(case.q, case.k, case.v, None, None, None, case.scale, False, 0, -1, -1, 0.0, 0.0, [16, 16])

    def _aot_graphs(fn, *args):
        """Run fn under torch.compile(aot_eager, fullgraph) and return (result, the AOT forward graph codes)."""
        from torch._dynamo.backends.common import aot_autograd

        codes = []

        def keep(gm, _inputs):
            codes.append(gm.code)
            return gm

        torch._dynamo.reset()
        res = torch.compile(fn, backend=aot_autograd(fw_compiler=keep), fullgraph=True)(*args)
        return res, codes

    @pytest.mark.parametrize("name", ["causal_offset_gqa", "float_bias_grad_empty_row"])
    def test_ops_trace_into_kernel_nodes_under_aot(name):
        case = CASES[name]()
        (out, lse), codes = _aot_graphs(lambda q, k, v: _fwd(case, q, k, v), case.q, case.k, case.v)
        e_out, e_lse = _fwd(case)
        assert torch.equal(out, e_out) and torch.equal(lse, e_lse)  # the same kernel, tile and inputs
        _check_forward(case, out, lse)
        assert len(codes) == 1 and "triton_kernel_wrapper_functional" in codes[0] and "fa3_triton" not in codes[0]
        dout = _dout(out)
        grads, codes = _aot_graphs(lambda d, o, l: _bwd(case, d, o, l), dout, out, lse)
        want = _bwd(case, dout, out, lse)
        assert all(torch.equal(a, b) for a, b in zip(grads, want))
        assert codes[0].count("triton_kernel_wrapper_functional(") == 3  # delta, dK/dV, dQ
        dbias = tf._reduce_dbias(grads[3], case.bias) if case.bias_requires_grad else None
        _check_backward(case, dout, grads[:3], dbias)

    # -- the lowering ------------------------------------------------------------------------------------

    def _site(case, backward=False, dout=None, out=None, lse=None):
        """A graph holding one fa3 node forced to kernel "triton" (FakeTensor metadata on every node)."""
        kw = dict(bias=case.bias, kv_lens=case.kv_lens, softcap=case.softcap, dropout_p=case.dropout_p,
                  dropout_seed=case.dropout_seed, q_pos=case.q_pos, q_seg=case.q_seg, k_seg=case.k_seg)
        scalars = (case.scale, case.causal, case.diag_offset, case.window_left, case.window_right)
        names = [n for n in ("bias", "kv_lens", "dropout_seed", "q_pos", "q_seg", "k_seg") if kw[n] is not None]

        def fwd(q, k, v, *rest):
            t = dict(kw, **dict(zip(names, rest)))
            return torch.ops.fa3.attention(q, k, v, *scalars, force_kernel="triton", **t)

        def bwd(dout, q, k, v, out, lse, *rest):
            t = dict(kw, **dict(zip(names, rest)))
            return torch.ops.fa3.attention_backward(dout, q, k, v, out, lse, *scalars, force_kernel="triton",
                                                    bias_requires_grad=case.bias_requires_grad, **t)

        extra = [kw[n] for n in names]
        if backward:
            inputs = [dout, case.q, case.k, case.v, out, lse, *extra]
            return make_fx(bwd, tracing_mode="fake")(*inputs), inputs
        inputs = [case.q, case.k, case.v, *extra]
        return make_fx(fwd, tracing_mode="fake")(*inputs), inputs

    def _lower(gm):
        decisions = graph_pass.lower_graph(gm.graph)
        gm.recompile()
        return decisions

    def _normalized(code: str) -> str:
        """Kernel side-table indices depend on what else this process traced."""
        return re.sub(r"(kernel_idx|constant_args_idx) = \d+", r"\1 = N", code.strip())

    @pytest.mark.parametrize("name", ["causal_offset_gqa", "float_bias_grad_empty_row", "bool_key_padding",
                                      "one_key_mask_for_the_batch", "causal_key_padding", "kv_lens_empty_batch_fp32",
                                      "dropout_gqa", "positions_gqa", "segments_causal"])
    @pytest.mark.parametrize("fused", [True, False], ids=["fused_dq", "dq_kernel"])
    def test_lowered_site_matches_reference(name, fused, cpu_lowering, poisoned, monkeypatch):
        # fused: the dK/dV kernel adds dQ by atomics (FA_COMPILE_FUSED_DQ=1); else the dQ kernel (the default)
        monkeypatch.setenv("FA_COMPILE_FUSED_DQ", "1" if fused else "0")
        case = CASES[name]()
        gm, inputs = _site(case)
        decisions = _lower(gm)
        # a key-padding mask longer than one key tile: the kernels read keys up to its limit (key_limit.for_site)
        cut = ("bool_key_padding", "one_key_mask_for_the_batch", "causal_key_padding")
        note = f" ({choice.KEYS_CUT_TEXT})" if name in cut else ""
        fuses = fused and not case.bias_requires_grad  # the dQ kernel writes the bias gradient's dS
        notes = [n for n in (choice.KEYS_CUT_TEXT if note else "", triton_lowering.FUSED_DQ_TEXT if fuses else "") if n]
        bnote = f" ({'; '.join(notes)})" if notes else ""
        assert [str(d) for d in decisions] == ["triton -> fa3_triton.fwd" + note]
        nodes = [n.target for n in gm.graph.nodes if n.op == "call_function"]
        assert FUNCTIONAL in nodes and site_args.FORWARD not in nodes
        out, lse = gm(*inputs)
        _check_forward(case, out, lse)
        dout = _dout(out)
        gm, inputs = _site(case, backward=True, dout=dout, out=out, lse=lse)
        decisions = _lower(gm)
        assert [str(d) for d in decisions] == ["triton -> fa3_triton.bwd" + bnote]
        nodes = [n.target for n in gm.graph.nodes if n.op == "call_function"]
        # delta, dK/dV (and dQ unless fused), + the key limit
        assert nodes.count(FUNCTIONAL) == 3 - fuses + bool(note) and site_args.BACKWARD not in nodes
        dq, dk, dv, dbias = gm(*inputs)
        _check_backward(case, dout, (dq, dk, dv), dbias)
        assert case.bias_requires_grad or dbias.numel() == 0

    @pytest.mark.parametrize("name", ["dropout_gqa", "bool_key_padding", "kv_lens_empty_batch_fp32"])
    def test_gluon_backward_site_calls_the_gluon_op(name, cpu_lowering, poisoned, monkeypatch):
        """On Hopper a backward the Gluon kernel takes becomes a call of fa3_gluon.bwd, which launches it at run time
        (wrap_triton cannot); that decision (triton_lowering.gluon_backward) needs a Hopper GPU and is forced here.
        Under the interpreter the op's body runs the pointer kernels instead (no Gluon on CPU), so the lowered
        graph's values are checked against the reference, every element, outputs poisoned."""
        monkeypatch.setattr(triton_lowering, "gluon_backward", lambda args: True)
        case = CASES[name]()
        out, lse = _fwd(case)
        dout = _dout(out)
        gm, inputs = _site(case, backward=True, dout=dout, out=out, lse=lse)
        decisions = _lower(gm)
        cut = name == "bool_key_padding"  # and its key limit, computed by one kernel in the graph
        notes = "; ".join(n for n in (choice.KEYS_CUT_TEXT if cut else "", triton_lowering.GLUON_BWD_TEXT) if n)
        assert [str(d) for d in decisions] == [f"triton -> fa3_gluon.bwd ({notes})"]
        nodes = [n.target for n in gm.graph.nodes if n.op == "call_function"]
        assert nodes.count(torch.ops.fa3_gluon.bwd.default) == 1 and nodes.count(FUNCTIONAL) == int(cut)
        assert site_args.BACKWARD not in nodes
        dq, dk, dv, dbias = gm(*inputs)
        _check_backward(case, dout, (dq, dk, dv), dbias)
        assert dbias.numel() == 0

    def test_lowered_gluon_backward_graph_is_pinned(cpu_lowering, monkeypatch):
        monkeypatch.setattr(triton_lowering, "gluon_backward", lambda args: True)
        case = CASES["dropout_gqa"]()
        out, lse = _fwd(case)
        gm, _ = _site(case, backward=True, dout=_dout(out), out=out, lse=lse)
        _lower(gm)
        expecttest.assert_expected_inline(_normalized(gm.code), """\
def forward(self, arg0_1, arg1_1, arg2_1, arg3_1, arg4_1, arg5_1, arg6_1, arg7_1):
    convert_element_type = torch.ops.prims.convert_element_type.default(arg4_1, torch.float32)
    convert_element_type_1 = torch.ops.prims.convert_element_type.default(arg0_1, torch.float32)
    mul = torch.ops.aten.mul.Tensor(convert_element_type, convert_element_type_1);  convert_element_type = convert_element_type_1 = None
    sum_1 = torch.ops.aten.sum.dim_IntList(mul, [-1]);  mul = None
    bwd = torch.ops.fa3_gluon.bwd.default(arg0_1, arg1_1, arg2_1, arg3_1, arg4_1, arg5_1, sum_1, None, arg6_1, arg7_1, 0.25, False, 0, -1, -1, 0.3, False, [16, 16, 4, 1], [16, 16, 4, 1]);  arg0_1 = arg1_1 = arg2_1 = arg3_1 = arg4_1 = arg5_1 = sum_1 = arg6_1 = arg7_1 = None
    getitem_4 = bwd[0]
    getitem_5 = bwd[1]
    getitem_6 = bwd[2];  bwd = None
    convert_element_type_2 = torch.ops.prims.convert_element_type.default(getitem_4, torch.float16);  getitem_4 = None
    empty = torch.ops.aten.empty.memory_format([0], dtype = torch.float16, layout = torch.strided, device = device(type='cpu'), pin_memory = False)
    return (convert_element_type_2, getitem_5, getitem_6, empty)""")

    @pytest.mark.parametrize("positions", [False, True], ids=["causal", "q_pos"])
    def test_lowered_site_with_sinks_matches_reference(positions, cpu_lowering, poisoned):
        # Sinks lower with the forward kernel's sink step; the backward kernels take the lse that includes
        # them (so P is the probability beside the sink), and a row without keys attends to the sink alone.
        # q_pos: the same mask as run-time positions (a static cache's prefill of a model with sinks), so the
        # replacement takes the sinks and the positions both, each once.
        case = make_case(b=2, hq=4, hkv=2, nq=19, nk=19, d=16, causal=not positions, diag_offset=-3)
        if positions:
            case.q_pos = (torch.arange(19) - 3).expand(2, 19).contiguous()  # key j for query i iff j <= i - 3
        sinks = torch.randn(4, generator=torch.Generator().manual_seed(3)).to(case.q.dtype) * 2
        scalars = (case.scale, case.causal, case.diag_offset, case.window_left, case.window_right)
        extra = (sinks, case.q_pos) if positions else (sinks,)

        def fwd(q, k, v, s, *p):
            return torch.ops.fa3.attention(q, k, v, *scalars, force_kernel="triton", sinks=s, q_pos=(p or [None])[0])

        gm = make_fx(fwd, tracing_mode="fake")(case.q, case.k, case.v, *extra)
        assert [str(d) for d in _lower(gm)] == ["triton -> fa3_triton.fwd"]
        assert site_args.FORWARD not in [n.target for n in gm.graph.nodes]
        out, lse = gm(case.q, case.k, case.v, *extra)
        (fa, fr), (ga, gr) = tolerances(case.q.dtype, "cpu")
        r_out, r_lse = ref.attention_reference(case.q, case.k, case.v, sinks=sinks, **case.mask_kwargs())
        torch.testing.assert_close(out, r_out, atol=fa, rtol=fr)
        torch.testing.assert_close(lse, r_lse, atol=1e-4, rtol=1e-4)
        # rows 0-2 have no key: the sink alone (to fp32 rounding of its log2 round trip)
        torch.testing.assert_close(lse[:, :, :3], sinks.float().view(1, 4, 1).expand(2, 4, 3), atol=1e-6, rtol=1e-6)
        assert (out[:, :, :3] == 0).all()

        def bwd(dout, q, k, v, o, l, s, *p):
            return torch.ops.fa3.attention_backward(dout, q, k, v, o, l, *scalars, force_kernel="triton", sinks=s,
                                                    q_pos=(p or [None])[0])

        dout = _dout(out)
        gm = make_fx(bwd, tracing_mode="fake")(dout, case.q, case.k, case.v, out, lse, *extra)
        assert [str(d) for d in _lower(gm)] == ["triton -> fa3_triton.bwd"]
        dq, dk, dv, _ = gm(dout, case.q, case.k, case.v, out, lse, *extra)
        r = ref.attention_backward_reference(dout, case.q, case.k, case.v, bias_requires_grad=False, sinks=sinks,
                                             **case.mask_kwargs())
        for name, got, want in zip(("dq", "dk", "dv"), (dq, dk, dv), r):
            torch.testing.assert_close(got, want, atol=ga, rtol=gr, msg=lambda m, n=name: f"{n}: " + m)

    # Rows that admit no key: eager's value written by the forward kernel itself (empty_fill), as the decode
    # kernel does (tests/test_lowering_decode.py), where emit's fix-up is all that reads the op's outputs.

    def _empty_rows_case(dtype=torch.float16):
        """GQA, key padding as a bool [B, 1, 1, Nk] mask (batch 1: every key padded) and one [B, Hq, Nq, Nk]
        bool mask row of its own: rows with no key in whole tiles, in part of a tile, and in one head."""
        case = make_case(b=3, hq=4, hkv=2, nq=21, nk=37, d=16, dtype=dtype, seed=11, bias_shape=(3, 4, 21, 37),
                         bias_bool=True)
        case.bias[1] = False  # a fully padded sequence
        case.bias[0, 2, 5] = False  # one row of one head
        case.v = case.v + 1.0  # a mean far from 0: a wrong count of keys shows
        return case

    @pytest.fixture
    def finite_poison(monkeypatch):
        """Outputs (and workspaces) start as 12345 (a NaN poison would hide a missing NaN write)."""
        monkeypatch.setattr(triton_ops, "_empty", finite_poison_empty)

    @pytest.mark.parametrize("kind", ["zero", "nan", "mean_v"])
    def test_op_writes_eagers_value_on_rows_with_no_key(kind, finite_poison):
        case = _empty_rows_case()
        out, lse = triton_ops.fwd(case.q, case.k, case.v, case.bias, None, None, case.scale, False, 0, -1, -1, 0.0,
                                  0.0, TILE, None, triton_ops.EMPTY_FILLS[kind])
        want, want_lse = ref.attention_reference(case.q, case.k, case.v, **case.mask_kwargs())
        empty = torch.isneginf(want_lse)
        assert 0 < int(empty.sum()) < empty.numel()
        if kind != "zero":
            want = eager_empty_fill(case, kind, want, want_lse)
        torch.testing.assert_close(out, want, atol=2e-3, rtol=2e-3, equal_nan=True)
        torch.testing.assert_close(lse, want_lse, atol=1e-4, rtol=1e-4)  # -inf stays on those rows

    def test_op_rejects_an_unknown_fill():
        case = _empty_rows_case()
        with pytest.raises(ValueError, match="empty_fill"):
            triton_ops.fwd(case.q, case.k, case.v, case.bias, None, None, case.scale, False, 0, -1, -1, 0.0, 0.0, TILE,
                           None, 3)

    # The fix-up's backward computed by the backward op (empty_grad): dout is the gradient of the fix-up's
    # output, whose `where` gives the op the empty rows' dout zeroed and the fill the rest.
    GRAD_CASES = {
        "bool_mask_gqa": _empty_rows_case,
        "kv_lens_dropout_gqa": lambda: make_case(b=2, hq=4, hkv=2, nq=18, nk=21, d=24, dropout_p=0.3,
                                                 kv_lens=[15, 0], seed=5),
        "causal_offset_bshd": lambda: make_case(b=1, hq=2, nq=20, nk=13, d=16, causal=True, diag_offset=-4,
                                                layout="bshd", seed=6),
    }

    def _fixup_grads(case, kind, dout, lse):
        """Autograd through the fill alone (mean of V, + uniform_row_grad), on the empty rows' dout."""
        from fa_compile.row_fixups import _uniform_row_grad_autograd

        leaves = [t.detach().float().requires_grad_() for t in (case.q, case.k, case.v)]
        groups = case.q.shape[1] // case.k.shape[1]
        fill = leaves[2].mean(dim=2, keepdim=True).repeat_interleave(groups, dim=1).expand(dout.shape)
        if kind == "uniform":
            fill = fill + _uniform_row_grad_autograd(*leaves, case.scale)
        dg = dout.float().masked_fill(~torch.isneginf(lse)[..., None], 0.0)
        grads = torch.autograd.grad(fill, leaves, dg, allow_unused=True)
        return [torch.zeros_like(t) if g is None else g for g, t in zip(grads, leaves)]

    def _fixup_case(name, kind):
        """(case, out, lse, dout) of GRAD_CASES[name] for the fix-up `kind`: dout holds what the fix-up's `where`
        hides from the op on empty rows, NaN where its fill has no gradient (NaN fill), else large."""
        case = GRAD_CASES[name]()
        out, lse = triton_ops.fwd(case.q, case.k, case.v, case.bias, case.kv_lens, case.dropout_seed, case.scale,
                                  case.causal, case.diag_offset, case.window_left, case.window_right, case.softcap,
                                  case.dropout_p, TILE, None, triton_ops.EMPTY_FILLS["zero" if kind == "none" else "mean_v"])
        empty = torch.isneginf(lse)
        assert 0 < int(empty.sum()) < empty.numel()
        dout = _dout(out).masked_fill(empty[..., None], float("nan") if kind == "none" else 30.0)
        return case, out, lse, dout

    def _check_fixup_grads(case, kind, dout, lse, grads):
        """The reference's gradients on the empty rows' dout zeroed, plus autograd through the fill; dq / dk / dv in
        their inputs' dtypes and dense strides."""
        empty = torch.isneginf(lse)
        want = ref.attention_backward_reference(dout.masked_fill(empty[..., None], 0.0), case.q, case.k, case.v,
                                                bias_requires_grad=False, **case.mask_kwargs())
        if kind != "none":
            want = [w.float() + f for w, f in zip(want, _fixup_grads(case, kind, dout, lse))]
        _, (ga, gr) = tolerances(case.q.dtype, "cpu")
        for g, got, w, like in zip(("dq", "dk", "dv"), grads, want, (case.q, case.k, case.v)):
            torch.testing.assert_close(got.float(), w.float(), atol=ga, rtol=gr, msg=lambda m, g=g: f"{g}: {m}")
            assert got.dtype == like.dtype and got.stride() == torch.empty_like(like).stride(), g

    @pytest.mark.parametrize("fused", [True, False], ids=["fused_dq", "dq_kernel"])
    @pytest.mark.parametrize("kind", ["none", "mean_v", "uniform"])
    @pytest.mark.parametrize("name", list(GRAD_CASES))
    def test_bwd_op_computes_the_fixups_backward(name, kind, fused, poisoned):
        case, out, lse, dout = _fixup_case(name, kind)
        dq, dk, dv, _ = triton_ops.bwd(dout, case.q, case.k, case.v, out, lse, case.bias, case.kv_lens,
                                       case.dropout_seed, case.scale, case.causal, case.diag_offset,
                                       case.window_left, case.window_right, case.softcap, case.dropout_p, False,
                                       TILE, TILE, triton_ops.EMPTY_GRADS[kind], fused)
        _check_fixup_grads(case, kind, dout, lse, (dq, dk, dv))
        with pytest.raises(ValueError, match="empty_grad"):
            triton_ops.bwd(dout, case.q, case.k, case.v, out, lse, case.bias, case.kv_lens, case.dropout_seed,
                           case.scale, case.causal, case.diag_offset, case.window_left, case.window_right,
                           case.softcap, case.dropout_p, False, TILE, TILE, 7)

    @pytest.mark.parametrize("kind", ["none", "mean_v", "uniform"])
    @pytest.mark.parametrize("name", ["bool_mask_gqa", "kv_lens_dropout_gqa"])
    def test_gluon_backward_graph_computes_the_fixups_backward(name, kind, poisoned, monkeypatch):
        """The lowered graph of a Gluon backward site: δ as graph ops, fa3_gluon.bwd (under the interpreter its
        fallback, the pointer kernels told to zero the empty rows' dout), the fix-up's kernel
        (fa3_triton.empty_rows_bwd) into the fp32 dQ sums and dK / dV, then dQ's cast: against the reference and
        autograd through the fill, as the pointer op's own fold above."""
        monkeypatch.setattr(triton_lowering, "gluon_backward", lambda args: True)
        case, out, lse, dout = _fixup_case(name, kind)
        fn = triton_lowering.TRITON_LOWERING.backward_fn(_args(case, backward=True), empty_grad=kind)
        extra = [t for t in (case.bias, case.kv_lens, case.dropout_seed) if t is not None]
        dq, dk, dv, _ = fn(dout, case.q, case.k, case.v, out, lse, *extra)
        _check_fixup_grads(case, kind, dout, lse, (dq, dk, dv))

    @pytest.fixture
    def lowered_training(monkeypatch, cpu_lowering):
        """backend="fa3" with Inductor's codegen replaced (it builds no user kernel for the CPU): AOTAutograd
        with Inductor's decompositions, joint-graph passes and partitioner, then the lowering pass on both graphs, which run
        their kernels under the interpreter."""
        from functorch.compile import make_boxed_func
        from torch._dynamo.backends.common import aot_autograd
        from torch._inductor.compile_fx import partition_fn as inductor_partition  # joint passes, min-cut
        from torch._inductor.decomposition import select_decomp_table

        from fa_compile import compiler

        codes = []

        def lowered(gm, _inputs):
            graph_pass.lower_graph(gm.graph)
            gm.recompile()
            codes.append(gm)
            return make_boxed_func(gm)

        def inner(cfg, gm, example_inputs, mode, options):
            return aot_autograd(fw_compiler=lowered, bw_compiler=lowered, decompositions=select_decomp_table(),
                                partition_fn=inductor_partition)(gm, example_inputs)

        monkeypatch.setattr(compiler, "_inner_compile", inner)
        return codes

    def _kernel_output(a) -> bool:
        """`a` is an output of a lowered kernel (a getitem of a triton_kernel_wrapper_functional node)."""
        import operator

        return getattr(a, "target", None) is operator.getitem and getattr(a.args[0], "target", None) is FUNCTIONAL

    def _padded_layer(fill: str, groups: int):
        """A Hugging Face-style padded attention: projections, heads by view / transpose, GQA by repeat_kv, a key
        mask added as finfo.min (a row with no kept key averages V) or filled with -inf (such a row is NaN),
        `.transpose(1, 2).contiguous()` and an output projection."""
        def layer(x, wq, wk, wv, wo, keep):
            b, n, _ = x.shape
            q = (x @ wq).view(b, n, -1, 16).transpose(1, 2)
            k, v = ((x @ w).view(b, n, -1, 16).transpose(1, 2) for w in (wk, wv))
            k, v = (t.repeat_interleave(groups, dim=1) for t in (k, v))
            s = q @ k.transpose(-1, -2) * 0.25
            s = s + torch.where(keep, 0.0, torch.finfo(s.dtype).min).to(s.dtype) if fill == "finfo_min" else \
                s.masked_fill(~keep, float("-inf"))
            o = torch.softmax(s.float(), dim=-1).to(q.dtype) @ v
            return o.transpose(1, 2).contiguous().view(b, n, -1) @ wo
        return layer

    @pytest.mark.parametrize("grads", ["all", "v"])
    @pytest.mark.parametrize("groups", [1, 2])
    @pytest.mark.parametrize("fill", ["finfo_min", "neg_inf"])
    def test_training_fixup_and_its_backward_run_in_the_kernels(fill, groups, grads, lowered_training):
        """In training the forward kernel writes the mean of V on rows with no kept key and the backward kernels
        compute the fix-up's backward (zeroed dO, the mean's gradient, eager's uniform-row q / k gradient): no
        `where`, mean, sum or add of it is left in either graph, nor the head transposes' copies. Output and every
        gradient match eager's, a fully padded sequence included."""
        from fa_compile.lowering.graph_pass import records

        gen = torch.Generator().manual_seed(17 + groups)
        hq, hkv = 2 * groups, 2
        x = torch.randn(3, 19, 32, generator=gen).half()
        ws = [(torch.randn(32, h * 16, generator=gen) * 0.2).half() for h in (hq, hkv, hkv)]
        ws.append((torch.randn(hq * 16, 32, generator=gen) * 0.2).half())
        ws[2] = ws[2] + 0.05  # a mean of V away from 0
        keep = torch.ones(3, 1, 1, 19, dtype=torch.bool)
        keep[0, ..., 7:] = False
        keep[2] = False  # no key at all: the fix-up's rows
        w = torch.randn(3, 19, 32, generator=gen).half()
        layer = _padded_layer(fill, groups)

        def run(fn, dtype, batches=3):
            leaves = [t.detach()[:batches] if i == 0 else t.detach() for i, t in enumerate([x] + ws)]
            leaves = [t.to(dtype).clone().requires_grad_(grads == "all" or i == 3) for i, t in enumerate(leaves)]
            out = fn(*leaves, keep[:batches])
            (torch.nan_to_num(out, nan=0.0) * w[:batches].to(dtype)).sum().backward()
            return [out] + [t.grad for t in leaves if t.requires_grad]

        torch._dynamo.reset()
        n_before = len(records())
        got = run(torch.compile(layer, backend=fa_compile.backend(kernel="triton")), torch.float16)
        _, (ga, gr) = tolerances(torch.float16, "cpu")
        # with -inf fills eager's NaN row makes the gradient of every value of its head NaN, and with it x's gradient
        # in that sequence and the V projection's: fa3.nan_row_grad puts those NaNs back (README)
        want = run(layer, torch.float32)
        if fill == "neg_inf":
            assert got[0][2].isnan().all() and want[1].isnan().any()
        for i, (a, e) in enumerate(zip(got, want)):
            assert torch.equal(a.isnan(), e.isnan()), i
            torch.testing.assert_close(a.float(), e, atol=ga, rtol=gr, equal_nan=True, msg=lambda m, i=i: f"{i}: {m}")
        decisions = [r.decision for r in records()[n_before:]]
        assert [str(d).split(" (")[0] for d in decisions] == ["triton -> fa3_triton.fwd", "triton -> fa3_triton.bwd"]
        kind = "their dout zeroed"
        if fill == "finfo_min":
            kind += ", the mean of V's gradient"
            kind += " and eager's uniform-row q / k gradients" if grads == "all" else ""
        assert decisions[1].folded == f"empty rows: {kind} by the kernel", decisions[1].folded
        if fill == "finfo_min":
            assert decisions[0].folded == "empty rows: mean of V written by the kernel"
        fwd_gm, bwd_gm = lowered_training[-2:]
        fwd_code, bwd_code = fwd_gm.code, bwd_gm.code
        # under -inf fills the backward adds eager's NaN terms of the empty rows' heads (fa3.nan_row_grad's backward:
        # an eq, a where and an add after the kernels); the finfo.min fix-up leaves nothing outside the kernels
        banned = ("uniform_row_grad", "aten.div") + (("aten.where", "aten.eq", "aten.isneginf") if fill == "finfo_min"
                                                     else ())
        assert not any(op in bwd_code for op in banned), bwd_code
        assert ("aten.where" in bwd_code) == (fill == "neg_inf"), bwd_code
        # nothing adds to, or copies, what the kernels return (the fix-up's adds; the head transposes' clones)
        aten = torch.ops.aten
        for gm in (fwd_gm, bwd_gm) if fill == "finfo_min" else (fwd_gm,):
            after = [n.target for n in gm.graph.nodes if any(_kernel_output(a) for a in n.args)]
            assert not {aten.add.Tensor, aten.clone.default, torch.ops.prims.copy_strided.default} & set(after), gm.code
        if fill == "finfo_min":
            assert not any(op in fwd_code for op in ("aten.where", "aten.mean")), fwd_code
        want_code = triton_ops.EMPTY_GRADS["uniform" if fill == "finfo_min" and grads == "all" else
                                           "mean_v" if fill == "finfo_min" else "none"]
        assert f"'ZERO_EMPTY': True" in bwd_code and (("UNIFORM': " + str(want_code == 3)) in bwd_code) == (
            want_code != 1), bwd_code

    def _dropped_rows_training(groups: int, grads: str) -> list:
        """A padded layer with dropout trained once, compiled (the Triton family) and eagerly with the op's keep mask
        (the seed drawn again): every output and gradient equal; returns the lowering's decisions."""
        from fa_compile.kernels.dropout_hash import dropout_keep_mask
        from fa_compile.lowering.graph_pass import records
        from fa_compile.patterns.emit import DROPOUT_SEED_HIGH

        gen = torch.Generator().manual_seed(5 + groups)
        hq, hkv, p = 2 * groups, 2, 0.25
        x = torch.randn(3, 19, 32, generator=gen).half()
        ws = [(torch.randn(32, h * 16, generator=gen) * 0.2).half() for h in (hq, hkv, hkv)]
        ws.append((torch.randn(hq * 16, 32, generator=gen) * 0.2).half())
        ws[2] = ws[2] + 0.05
        keep = torch.ones(3, 1, 1, 19, dtype=torch.bool)
        keep[0, ..., 7:] = False
        keep[2] = False  # no key at all: the dropped uniform rows
        w = torch.randn(3, 19, 32, generator=gen).half()

        def layer(x, wq, wk, wv, wo, keep, drop=lambda t: torch.nn.functional.dropout(t, p, training=True)):
            b, n, _ = x.shape
            q = (x @ wq).view(b, n, -1, 16).transpose(1, 2)
            k, v = ((x @ w).view(b, n, -1, 16).transpose(1, 2) for w in (wk, wv))
            k, v = (t.repeat_interleave(groups, dim=1) for t in (k, v))
            s = q @ k.transpose(-1, -2) * 0.25
            s = s + torch.where(keep, 0.0, torch.finfo(s.dtype).min).to(s.dtype)
            return (drop(torch.softmax(s.float(), dim=-1)).to(q.dtype) @ v).transpose(1, 2).reshape(b, n, -1) @ wo

        def run(fn, dtype, **kw):
            leaves = [t.detach().to(dtype).clone().requires_grad_(grads == "all" or i == 3)
                      for i, t in enumerate([x] + ws)]
            out = fn(*leaves, keep, **kw)
            (out * w.to(dtype)).sum().backward()
            return [out] + [t.grad for t in leaves if t.requires_grad]

        torch._dynamo.reset()
        n_before = len(records())
        torch.manual_seed(11)
        with torch._inductor.config.patch(fallback_random=True):  # (as in the key-limit test below)
            got = run(torch.compile(layer, backend=fa_compile.backend(kernel="triton")), torch.float16)
        torch.manual_seed(11)
        seed = torch.randint(0, DROPOUT_SEED_HIGH, (), dtype=torch.int64)
        mask = dropout_keep_mask(seed, 3, hq, 19, 19, p, torch.device("cpu"))
        want = run(layer, torch.float32, drop=lambda t: t * mask / (1 - p))
        _, (ga, gr) = tolerances(torch.float16, "cpu")
        for i, (a, e) in enumerate(zip(got, want)):
            torch.testing.assert_close(a.float(), e, atol=ga, rtol=gr, msg=lambda m, i=i: f"{i}: {m}")
        return [r.decision for r in records()[n_before:]]

    @pytest.mark.parametrize("gluon", [False, True], ids=["pointer_bwd", "gluon_bwd"])
    @pytest.mark.parametrize("grads", ["all", "v"])
    @pytest.mark.parametrize("groups", [1, 2])
    def test_training_dropped_uniform_rows_run_in_the_kernels(groups, grads, gluon, lowered_training, monkeypatch):
        """With dropout, a finfo.min key mask's fully masked rows get eager's dropped uniform weights
        (fa3::dropped_uniform_rows): the lowered forward writes them into the kernel's out
        (fa3_triton.dropped_rows_fill) and the lowered backward adds their gradients into the kernels' dq, dk, dv
        (fa3_triton.dropped_rows_bwd); no `where`, add or dropped_uniform_rows op is left. Output and every
        gradient match eager's arithmetic with the op's keep mask (the seed drawn again), a fully padded sequence
        included. Also with the backward lowered as on Hopper: fa3_gluon.bwd (under the interpreter its fallback,
        the pointer kernels), then the dropped rows' kernel into its fp32 dQ sums and dK / dV."""
        if gluon:
            monkeypatch.setattr(triton_lowering, "gluon_backward", lambda args: True)
        decisions = _dropped_rows_training(groups, grads)
        bwd_target = "fa3_gluon.bwd" if gluon else "fa3_triton.bwd"
        assert [str(d).split(" (")[0] for d in decisions] == ["triton -> fa3_triton.fwd", f"triton -> {bwd_target}"]
        assert decisions[0].folded == "empty rows: dropped uniform weights times V written by the kernel"
        assert decisions[1].folded == \
            "empty rows: their dout zeroed, the dropped uniform weights' gradients added by the kernel"
        fwd_gm, bwd_gm = lowered_training[-2:]
        for gm, kernel in ((fwd_gm, "dropped_rows_fwd_kernel"), (bwd_gm, "dropped_rows_bwd_kernel")):
            assert "dropped_uniform_rows" not in gm.code and "aten.where" not in gm.code, gm.code
            names = [triton_kernel_name(n) for n in gm.graph.nodes if n.target is FUNCTIONAL]
            assert names.count(kernel) == 1, names
            after = [n.target for n in gm.graph.nodes if any(_kernel_output(a) for a in n.args)]
            assert torch.ops.aten.add.Tensor not in after, gm.code

    def test_dropped_rows_kernel_that_fails_to_build_keeps_the_op(lowered_training, monkeypatch):
        """Where the dropped rows' kernel cannot be built (a GPU or Triton it was not measured on), the site keeps
        the op and its run-time dispatch, with one warning: the results are still eager's."""
        def broken(*a, **kw):
            raise triton_lowering.SpliceError("the dropped-rows kernel failed here")

        monkeypatch.setattr(triton_lowering, "_verify_dropped", broken)
        with pytest.warns(RuntimeWarning, match="dropped-rows kernel failed"):
            decisions = _dropped_rows_training(1, "all")
        assert all("lowering failed" in str(d.reason) for d in decisions), [str(d) for d in decisions]

    @pytest.mark.parametrize("fill", ["finfo_min", "neg_inf"])
    @pytest.mark.parametrize("dropout", [0.0, 0.25])
    def test_key_padding_limit_cuts_the_kernels_key_loops(fill, dropout, lowered_training):
        """Two padded layers sharing one key-padding mask, training: each graph computes the mask's key limit once
        (one kernel), both sites' kernels take it as kv_lens (HAS_KVLEN), and output and every gradient match
        eager's: sequences of all 47 keys, of 9 (two whole tiles past it), of none, and of 33 with a kept key
        in the last tile only; with dropout, against the fa3 op's own run-time dispatch (same counter hash)."""
        from fa_compile.lowering.graph_pass import records

        gen = torch.Generator().manual_seed(5)
        layer = _padded_layer(fill, 1)

        def two_layers(x, wq, wk, wv, wo, keep):
            y = layer(x, wq, wk, wv, wo, keep)
            return layer(y, wq, wk, wv, wo, keep)

        if dropout:  # the same layer through the op's dropout: the rewrite keeps softmax -> dropout -> @ v
            def layer(x, wq, wk, wv, wo, keep):  # noqa: F811
                b, n, _ = x.shape
                q, k, v = ((x @ w).view(b, n, -1, 16).transpose(1, 2) for w in (wq, wk, wv))
                s = (q @ k.transpose(-1, -2) * 0.25).masked_fill(~keep, float("-inf"))
                p = torch.nn.functional.dropout(torch.softmax(s.float(), dim=-1).to(q.dtype), dropout)
                return (p @ v).transpose(1, 2).contiguous().view(b, n, -1) @ wo

        x = torch.randn(4, 47, 32, generator=gen).half()
        ws = [(torch.randn(32, 32, generator=gen) * 0.2).half() for _ in range(4)]
        keep = torch.zeros(4, 1, 1, 47, dtype=torch.bool)
        for i, n in enumerate((47, 9, 0, 33)):
            keep[i, ..., :n] = True
        keep[3, ..., 20:30] = False  # a hole: the limit is the last kept key, not the count
        keep[3, ..., 45] = True
        w = torch.randn(4, 47, 32, generator=gen).half()

        def run(fn, dtype, batches):
            leaves = [t.detach()[:batches] if i == 0 else t.detach() for i, t in enumerate([x] + ws)]
            leaves = [t.to(dtype).clone().requires_grad_() for t in leaves]
            if dropout:
                torch.manual_seed(11)
            out = fn(*leaves, keep[:batches])
            (torch.nan_to_num(out, nan=0.0) * w[:batches].to(dtype)).sum().backward()
            return [out] + [t.grad for t in leaves]

        # eager's NaN rows (the -inf fill of the sequence with no key) reach every gradient: as in the test above,
        # that case compares the batches with a kept key
        batches = 4 if fill == "finfo_min" else 2
        torch._dynamo.reset()
        n_before = len(records())
        # (fallback_random: Inductor's joint pass for random ops needs its own codegen context, which the fixture
        # replaces; the op's dropout seed is drawn as in eager either way)
        with torch._inductor.config.patch(fallback_random=True):
            got = run(torch.compile(two_layers, backend=fa_compile.backend(kernel="triton")), torch.float16, batches)
        graphs = lowered_training[-2:]  # forward, backward; their kernels' names now (dynamo.reset clears the table)
        kernels = [[n for n in gm.graph.nodes if n.target is FUNCTIONAL] for gm in graphs]
        names = [[triton_kernel_name(n) for n in ks] for ks in kernels]
        if dropout:  # the same kernels reading every key (no limit): the same counter hash, the same values
            from fa_compile.lowering import key_limit

            torch._dynamo.reset()
            with pytest.MonkeyPatch.context() as m, torch._inductor.config.patch(fallback_random=True):
                m.setattr(key_limit, "cuts_keys", lambda *a: False)
                want = run(torch.compile(two_layers, backend=fa_compile.backend(kernel="triton")), torch.float16,
                           batches)
        else:
            want = run(two_layers, torch.float32, batches)
        _, (ga, gr) = tolerances(torch.float16, "cpu")
        for i, (a, e) in enumerate(zip(got, want)):
            assert torch.equal(a.isnan(), e.isnan()), i
            torch.testing.assert_close(a.float(), e.float(), atol=ga, rtol=gr, equal_nan=True,
                                       msg=lambda m, i=i: f"{i}: {m}")
        decisions = [r.decision for r in records()[n_before:]][:4]
        assert [d.keys for d in decisions] == [choice.KEYS_CUT_TEXT] * 4, [str(d) for d in decisions]
        n_bwd = 2 if tf.fuses_dq(False) else 4  # dK/dV per layer, and dQ unless dK/dV adds it
        for gm, ks, ns, n_attn in zip(graphs, kernels, names, (2, n_bwd)):
            assert ns.count("key_limit_kernel") == 1, ns  # one limit for both layers
            attn = [n for n in ks if "KVLENS" in n.kwargs["kwargs"]]  # forward; dK/dV (and dQ)
            assert len(attn) == n_attn, ns
            assert gm.code.count("'HAS_KVLEN': True") == len(attn), gm.code

    def triton_kernel_name(node) -> str:
        from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table

        k = kernel_side_table.get_kernel(node.kwargs["kernel_idx"])
        return getattr(k, "__name__", None) or getattr(getattr(k, "fn", None), "__name__", "?")

    def _key_args(bias, **kw):
        from fa_compile import dispatch

        q = torch.empty(2, 4, 40, 16, dtype=torch.float16)
        k = torch.empty(2, 4, 40, 16, dtype=torch.float16)
        return dispatch.AttentionArgs(q=q, k=k, v=k, scale=0.25, bias=bias, **kw)

    def test_which_sites_get_the_key_limit():
        """key_limit.cuts_keys: one value per sequence and key (any dtype the op takes), more keys than a tile;
        not a mask that varies along queries or heads, nor beside kv_lens or a bias gradient, nor a float mask
        with structure (a causal / windowed row may see only absorbed keys, the cut ones among them)."""
        from fa_compile.lowering.key_limit import cuts_keys

        keyvec = torch.ones(2, 1, 1, 40, dtype=torch.bool)
        add16 = torch.zeros(2, 1, 1, 40, dtype=torch.float16)
        assert cuts_keys(_key_args(keyvec), 16)
        assert cuts_keys(_key_args(keyvec.expand(2, 4, 40, 40)), 16)  # broadcast by strides 0
        assert cuts_keys(_key_args(torch.ones(40, dtype=torch.bool)), 16)  # one mask for the batch
        assert cuts_keys(_key_args(keyvec, causal=True, window_left=3), 16)  # a bool mask masks the cut keys itself
        assert cuts_keys(_key_args(add16), 16)
        assert not cuts_keys(_key_args(keyvec), 40)  # one tile holds every key
        assert not cuts_keys(_key_args(torch.ones(2, 1, 40, 40, dtype=torch.bool)), 16)  # a row per query
        assert not cuts_keys(_key_args(torch.ones(2, 4, 1, 40, dtype=torch.bool)), 16)  # a row per head
        assert not cuts_keys(_key_args(keyvec, kv_lens=torch.full((2,), 40, dtype=torch.int32)), 16)
        assert not cuts_keys(_key_args(add16, bias_requires_grad=True, needs_backward=True), 16)
        for structure in (dict(causal=True), dict(window_left=5), dict(window_right=0),
                          dict(q_pos=torch.zeros(2, 40, dtype=torch.int64))):
            assert not cuts_keys(_key_args(add16, **structure), 16), structure

    def _emitted_site(case, kind, extra_use=False, grad=False):
        """The post-grad form of a site with emit's empty-row fix-up, forced to kernel "triton": emit_attention's
        graph traced to ATen with Inductor's decompositions (what the lowering pass sees after AOTAutograd).
        `extra_use` also computes from the op's lse (beyond the graph's outputs, which a training graph saves
        for the backward), so the kernel's own -inf must stay there."""
        import operator

        import torch.fx as fx
        from torch._inductor.decomposition import select_decomp_table
        from torch._subclasses.fake_tensor import FakeTensorMode

        from fa_compile.patterns import emit

        inputs = [case.q, case.k, case.v, case.bias]
        mode = FakeTensorMode()
        g = fx.Graph()
        nodes = []
        for name, t in zip(("q", "k", "v", "bias"), inputs):
            n = g.placeholder(name)
            n.meta["example_value"] = mode.from_tensor(t)
            nodes.append(n)
        out, node = emit.emit_attention(g, *nodes[:3], scale=case.scale, bias=nodes[3], empty_rows=kind, kernel="triton")
        lse = g.call_function(operator.getitem, (node, 1))
        g.output((out, g.call_function(torch.ops.aten.mul.Tensor, (lse, 2.0))) if extra_use else out)
        gm = fx.GraphModule({}, g)
        return make_fx(gm, decomposition_table=select_decomp_table(), tracing_mode="fake")(*inputs), inputs

    @pytest.mark.parametrize("kind", ["nan", "mean_v"])
    def test_emits_fixup_is_folded_into_the_kernel(kind, cpu_lowering, finite_poison):
        case = _empty_rows_case()
        gm, inputs = _emitted_site(case, kind)
        want = gm(*inputs)  # the op (run-time dispatch, forced to triton) and the fix-up as graph ops
        decisions = _lower(gm)
        what = "NaN" if kind == "nan" else "mean of V"
        assert [str(d) for d in decisions] == [f"triton -> fa3_triton.fwd (empty rows: {what} written by the kernel)"]
        left = {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}
        assert not any(x in t for t in left for x in ("where", "mean", "eq", "isneginf", "fa3.attention")), left
        kernels = [n.kwargs["kwargs"].get("EMPTY_FILL") for n in gm.graph.nodes if n.target is FUNCTIONAL]
        assert kernels == [triton_ops.EMPTY_FILLS[kind]]
        got = gm(*inputs)
        assert got.stride() == want.stride()
        torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3, equal_nan=True)
        r_out, r_lse = ref.attention_reference(case.q, case.k, case.v, **case.mask_kwargs())
        torch.testing.assert_close(got, eager_empty_fill(case, kind, r_out, r_lse), atol=2e-3, rtol=2e-3, equal_nan=True)

    def test_a_fixup_whose_lse_is_read_elsewhere_stays_graph_ops(cpu_lowering, poisoned):
        # The graph also computes from the op's lse: the fix-up stays. (A graph output alone, the lse a training
        # graph saves for the backward, is the fold's `saved` case: test_training_fixup_and_its_backward_...)
        case = _empty_rows_case()
        gm, inputs = _emitted_site(case, "mean_v", extra_use=True)
        want = gm(*inputs)
        assert [str(d) for d in _lower(gm)] == ["triton -> fa3_triton.fwd"]
        kernels = [n.kwargs["kwargs"].get("EMPTY_FILL") for n in gm.graph.nodes if n.target is FUNCTIONAL]
        assert kernels == [0]
        got = gm(*inputs)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, atol=2e-3, rtol=2e-3, equal_nan=True)

    # On CPU Triton's mutation analysis has no driver, so tensors_to_clone names every tensor argument;
    # on a GPU only the outputs (O, LSE; delta, dK, dV, dQ, dS) are cloned, then reinplaced by Inductor.
    def test_lowered_forward_graph_is_pinned(cpu_lowering):
        case = make_case(b=1, hq=2, nq=20, nk=20, d=16, causal=True, kv_lens=[11])
        gm, _ = _site(case)
        _lower(gm)
        expecttest.assert_expected_inline(_normalized(gm.code), """\
def forward(self, arg0_1, arg1_1, arg2_1, arg3_1):
    empty_strided = torch.ops.aten.empty_strided.default([1, 2, 20, 16], [640, 16, 32, 1], dtype = torch.float16, device = device(type='cpu'), pin_memory = False)
    empty_strided_1 = torch.ops.aten.empty_strided.default([1, 2, 20], [40, 20, 1], dtype = torch.float32, device = device(type='cpu'), pin_memory = False)
    empty_strided_2 = torch.ops.aten.empty_strided.default([1], [1], dtype = torch.float32, device = device(type='cpu'), pin_memory = False)
    triton_kernel_wrapper_functional_proxy = torch.ops.higher_order.triton_kernel_wrapper_functional(kernel_idx = N, constant_args_idx = N, grid = [(4, 1, 1)], tma_descriptor_metadata = {}, kwargs = {'Q': arg0_1, 'K': arg1_1, 'V': arg2_1, 'O': empty_strided, 'LSE': empty_strided_1, 'BIAS': empty_strided_2, 'KVLENS': arg3_1, 'SEED': empty_strided_2, 'stride_qb': 640, 'stride_qh': 320, 'stride_qm': 16, 'stride_kb': 640, 'stride_kh': 320, 'stride_kn': 16, 'stride_vb': 640, 'stride_vh': 320, 'stride_vn': 16, 'stride_ob': 640, 'stride_oh': 16, 'stride_om': 32, 'stride_bb': 0, 'stride_bh': 0, 'stride_bm': 0, 'stride_bn': 0, 'Hq': 2, 'G': 1, 'Nq': 20, 'Nk': 20, 'D': 16, 'DV': 16, 'qk_scale': 0.36067376022224085, 'softcap': 0.0, 'cap_scale': 0.0, 'diag_offset': 0, 'window_left': -1, 'window_right': -1, 'drop_threshold': 0, 'drop_scale': 1.0, 'BLOCK_D': 16, 'BLOCK_DV': 16, 'EVEN_D': True, 'REVERSE_M': True, 'BIAS_FMA': False, 'IS_CAUSAL': True, 'HAS_WL': False, 'HAS_WR': False, 'HAS_KVLEN': True, 'BIAS_KIND': 0, 'SOFTCAP': False, 'DROPOUT': False, 'PLAIN': True, 'BLOCK_M': 16, 'BLOCK_N': 16, 'SINKS': empty_strided_2, 'HAS_SINKS': False, 'QPOS': empty_strided_2, 'stride_pb': 0, 'stride_pm': 0, 'HAS_QPOS': False, 'QSEG': empty_strided_2, 'stride_qsb': 0, 'stride_qsm': 0, 'KSEG': empty_strided_2, 'stride_ksb': 0, 'stride_ksn': 0, 'HAS_SEG': False, 'EMPTY_FILL': 0}, tensors_to_clone = ['Q', 'K', 'V', 'O', 'LSE', 'BIAS', 'KVLENS', 'SEED', 'SINKS', 'QPOS', 'QSEG', 'KSEG']);  arg0_1 = arg1_1 = arg2_1 = empty_strided = empty_strided_1 = empty_strided_2 = arg3_1 = None
    getitem_5 = triton_kernel_wrapper_functional_proxy['O']
    getitem_6 = triton_kernel_wrapper_functional_proxy['LSE'];  triton_kernel_wrapper_functional_proxy = None
    return (getitem_5, getitem_6)""")

    def test_lowered_backward_graph_is_pinned(cpu_lowering):
        case = make_case(b=1, hq=2, nq=20, nk=20, d=16, bias_shape=(1, 1, 20, 20), bias_grad=True)
        out, lse = _fwd(case)
        gm, _ = _site(case, backward=True, dout=_dout(out), out=out, lse=lse)
        _lower(gm)
        expecttest.assert_expected_inline(_normalized(gm.code), """\
def forward(self, arg0_1, arg1_1, arg2_1, arg3_1, arg4_1, arg5_1, arg6_1):
    empty_strided = torch.ops.aten.empty_strided.default([1, 2, 20, 16], [640, 320, 16, 1], dtype = torch.float16, device = device(type='cpu'), pin_memory = False)
    empty_strided_1 = torch.ops.aten.empty_strided.default([1, 2, 20, 16], [640, 320, 16, 1], dtype = torch.float16, device = device(type='cpu'), pin_memory = False)
    empty_strided_2 = torch.ops.aten.empty_strided.default([1, 2, 20, 16], [640, 320, 16, 1], dtype = torch.float16, device = device(type='cpu'), pin_memory = False)
    full = torch.ops.aten.full.default([1, 2, 20, 20], 0, dtype = torch.float32, layout = torch.strided, device = device(type='cpu'), pin_memory = False)
    empty_strided_3 = torch.ops.aten.empty_strided.default([1], [1], dtype = torch.float32, device = device(type='cpu'), pin_memory = False)
    empty_1 = torch.ops.aten.empty.memory_format([1, 2, 20], dtype = torch.float32, device = device(type='cpu'), pin_memory = False)
    triton_kernel_wrapper_functional_proxy = torch.ops.higher_order.triton_kernel_wrapper_functional(kernel_idx = N, constant_args_idx = N, grid = [(4, 1, 1)], tma_descriptor_metadata = {}, kwargs = {'O': arg4_1, 'DO': arg0_1, 'DELTA': empty_1, 'stride_ob': 640, 'stride_oh': 16, 'stride_om': 32, 'stride_db': 640, 'stride_dh': 320, 'stride_dm': 16, 'Hq': 2, 'Nq': 20, 'DV': 16, 'BLOCK_M': 16, 'BLOCK_DV': 16}, tensors_to_clone = ['O', 'DO', 'DELTA']);  arg4_1 = arg0_1 = empty_1 = None
    getitem_5 = triton_kernel_wrapper_functional_proxy['DO']
    getitem_6 = triton_kernel_wrapper_functional_proxy['DELTA'];  triton_kernel_wrapper_functional_proxy = None
    empty_strided_4 = torch.ops.aten.empty_strided.default([1], [1], dtype = torch.float32, device = device(type='cpu'), pin_memory = False)
    triton_kernel_wrapper_functional_proxy_1 = torch.ops.higher_order.triton_kernel_wrapper_functional(kernel_idx = N, constant_args_idx = N, grid = [(4, 1, 1)], tma_descriptor_metadata = {}, kwargs = {'Q': arg1_1, 'K': arg2_1, 'V': arg3_1, 'DO': getitem_5, 'LSE': arg5_1, 'DELTA': getitem_6, 'DK': empty_strided_1, 'DV_': empty_strided_2, 'BIAS': arg6_1, 'KVLENS': empty_strided_3, 'SEED': empty_strided_3, 'q_desc': empty_strided_3, 'k_desc': empty_strided_3, 'v_desc': empty_strided_3, 'do_desc': empty_strided_3, 'stride_qb': 640, 'stride_qh': 320, 'stride_qm': 16, 'stride_kb': 640, 'stride_kh': 320, 'stride_kn': 16, 'stride_vb': 640, 'stride_vh': 320, 'stride_vn': 16, 'stride_dob': 640, 'stride_doh': 320, 'stride_dom': 16, 'stride_dkb': 640, 'stride_dkh': 320, 'stride_dkn': 16, 'stride_dvb': 640, 'stride_dvh': 320, 'stride_dvn': 16, 'stride_bb': 400, 'stride_bh': 0, 'stride_bm': 20, 'stride_bn': 1, 'Hq': 2, 'Hkv': 2, 'G': 1, 'Nq': 20, 'Nk': 20, 'D': 16, 'DV': 16, 'qk_scale': 0.36067376022224085, 'softcap': 0.0, 'cap_scale': 0.0, 'scale': 0.25, 'diag_offset': 0, 'window_left': -1, 'window_right': -1, 'drop_threshold': 0, 'drop_scale': 1.0, 'BLOCK_D': 16, 'BLOCK_DV': 16, 'USE_TMA': False, 'IS_CAUSAL': False, 'HAS_WL': False, 'HAS_WR': False, 'HAS_KVLEN': False, 'BIAS_KIND': 1, 'SOFTCAP': False, 'DROPOUT': False, 'PLAIN': False, 'BLOCK_M': 16, 'BLOCK_N': 16, 'QPOS': empty_strided_3, 'stride_pb': 0, 'stride_pm': 0, 'HAS_QPOS': False, 'QSEG': empty_strided_3, 'stride_qsb': 0, 'stride_qsm': 0, 'KSEG': empty_strided_3, 'stride_ksb': 0, 'stride_ksn': 0, 'HAS_SEG': False, 'ZERO_EMPTY': False, 'DQA': empty_strided_4, 'FUSED_DQ': False}, tensors_to_clone = ['Q', 'K', 'V', 'DO', 'LSE', 'DELTA', 'DK', 'DV_', 'BIAS', 'KVLENS', 'SEED', 'q_desc', 'k_desc', 'v_desc', 'do_desc', 'QPOS', 'QSEG', 'KSEG', 'DQA']);  arg1_1 = arg2_1 = arg3_1 = getitem_5 = arg5_1 = getitem_6 = empty_strided_1 = empty_strided_2 = arg6_1 = empty_strided_3 = empty_strided_4 = None
    getitem_7 = triton_kernel_wrapper_functional_proxy_1['Q']
    getitem_8 = triton_kernel_wrapper_functional_proxy_1['K']
    getitem_9 = triton_kernel_wrapper_functional_proxy_1['V']
    getitem_10 = triton_kernel_wrapper_functional_proxy_1['DO']
    getitem_11 = triton_kernel_wrapper_functional_proxy_1['LSE']
    getitem_12 = triton_kernel_wrapper_functional_proxy_1['DELTA']
    getitem_13 = triton_kernel_wrapper_functional_proxy_1['DK']
    getitem_14 = triton_kernel_wrapper_functional_proxy_1['DV_']
    getitem_15 = triton_kernel_wrapper_functional_proxy_1['BIAS']
    getitem_24 = triton_kernel_wrapper_functional_proxy_1['KSEG'];  triton_kernel_wrapper_functional_proxy_1 = None
    triton_kernel_wrapper_functional_proxy_2 = torch.ops.higher_order.triton_kernel_wrapper_functional(kernel_idx = N, constant_args_idx = N, grid = [(4, 1, 1)], tma_descriptor_metadata = {}, kwargs = {'Q': getitem_7, 'K': getitem_8, 'V': getitem_9, 'DO': getitem_10, 'LSE': getitem_11, 'DELTA': getitem_12, 'DQ': empty_strided, 'DS': full, 'BIAS': getitem_15, 'KVLENS': getitem_24, 'SEED': getitem_24, 'q_desc': getitem_24, 'k_desc': getitem_24, 'v_desc': getitem_24, 'do_desc': getitem_24, 'stride_qb': 640, 'stride_qh': 320, 'stride_qm': 16, 'stride_kb': 640, 'stride_kh': 320, 'stride_kn': 16, 'stride_vb': 640, 'stride_vh': 320, 'stride_vn': 16, 'stride_dob': 640, 'stride_doh': 320, 'stride_dom': 16, 'stride_dqb': 640, 'stride_dqh': 320, 'stride_dqm': 16, 'stride_bb': 400, 'stride_bh': 0, 'stride_bm': 20, 'stride_bn': 1, 'Hq': 2, 'G': 1, 'Nq': 20, 'Nk': 20, 'D': 16, 'DV': 16, 'qk_scale': 0.36067376022224085, 'softcap': 0.0, 'cap_scale': 0.0, 'scale': 0.25, 'diag_offset': 0, 'window_left': -1, 'window_right': -1, 'drop_threshold': 0, 'drop_scale': 1.0, 'BLOCK_D': 16, 'BLOCK_DV': 16, 'WRITE_DS': True, 'REVERSE_M': False, 'USE_TMA': False, 'IS_CAUSAL': False, 'HAS_WL': False, 'HAS_WR': False, 'HAS_KVLEN': False, 'BIAS_KIND': 1, 'SOFTCAP': False, 'DROPOUT': False, 'PLAIN': False, 'BLOCK_M': 16, 'BLOCK_N': 16, 'QPOS': getitem_24, 'stride_pb': 0, 'stride_pm': 0, 'HAS_QPOS': False, 'QSEG': getitem_24, 'stride_qsb': 0, 'stride_qsm': 0, 'KSEG': getitem_24, 'stride_ksb': 0, 'stride_ksn': 0, 'HAS_SEG': False, 'ZERO_EMPTY': False}, tensors_to_clone = ['Q', 'K', 'V', 'DO', 'LSE', 'DELTA', 'DQ', 'DS', 'BIAS', 'KVLENS', 'SEED', 'q_desc', 'k_desc', 'v_desc', 'do_desc', 'QPOS', 'QSEG', 'KSEG']);  getitem_7 = getitem_8 = getitem_9 = getitem_10 = getitem_11 = getitem_12 = empty_strided = full = getitem_15 = getitem_24 = None
    getitem_32 = triton_kernel_wrapper_functional_proxy_2['DQ']
    getitem_33 = triton_kernel_wrapper_functional_proxy_2['DS'];  triton_kernel_wrapper_functional_proxy_2 = None
    sum_1 = torch.ops.aten.sum.dim_IntList(getitem_33, [1], True);  getitem_33 = None
    convert_element_type = torch.ops.prims.convert_element_type.default(sum_1, torch.float16);  sum_1 = None
    return (getitem_32, getitem_13, getitem_14, convert_element_type)""")

    def test_lowered_fused_backward_graph_is_pinned(cpu_lowering, monkeypatch):
        # dQ through the dK/dV kernel: a zeroed fp32 buffer it adds into, then one scaled cast into dq's strides
        monkeypatch.setenv("FA_COMPILE_FUSED_DQ", "1")
        case = make_case(b=1, hq=2, nq=20, nk=20, d=16, causal=True)
        out, lse = _fwd(case)
        gm, inputs = _site(case, backward=True, dout=_dout(out), out=out, lse=lse)
        _lower(gm)
        expecttest.assert_expected_inline(_normalized(gm.code), """\
def forward(self, arg0_1, arg1_1, arg2_1, arg3_1, arg4_1, arg5_1):
    empty_strided = torch.ops.aten.empty_strided.default([1, 2, 20, 16], [640, 320, 16, 1], dtype = torch.float16, device = device(type='cpu'), pin_memory = False)
    empty_strided_1 = torch.ops.aten.empty_strided.default([1, 2, 20, 16], [640, 320, 16, 1], dtype = torch.float16, device = device(type='cpu'), pin_memory = False)
    empty_strided_2 = torch.ops.aten.empty_strided.default([1, 2, 20, 16], [640, 320, 16, 1], dtype = torch.float16, device = device(type='cpu'), pin_memory = False)
    empty_strided_3 = torch.ops.aten.empty_strided.default([1], [1], dtype = torch.float32, device = device(type='cpu'), pin_memory = False)
    empty_1 = torch.ops.aten.empty.memory_format([1, 2, 20], dtype = torch.float32, device = device(type='cpu'), pin_memory = False)
    triton_kernel_wrapper_functional_proxy = torch.ops.higher_order.triton_kernel_wrapper_functional(kernel_idx = N, constant_args_idx = N, grid = [(4, 1, 1)], tma_descriptor_metadata = {}, kwargs = {'O': arg4_1, 'DO': arg0_1, 'DELTA': empty_1, 'stride_ob': 640, 'stride_oh': 16, 'stride_om': 32, 'stride_db': 640, 'stride_dh': 320, 'stride_dm': 16, 'Hq': 2, 'Nq': 20, 'DV': 16, 'BLOCK_M': 16, 'BLOCK_DV': 16}, tensors_to_clone = ['O', 'DO', 'DELTA']);  arg4_1 = arg0_1 = empty_1 = None
    getitem_5 = triton_kernel_wrapper_functional_proxy['DO']
    getitem_6 = triton_kernel_wrapper_functional_proxy['DELTA'];  triton_kernel_wrapper_functional_proxy = None
    full = torch.ops.aten.full.default([1, 2, 20, 16], 0, dtype = torch.float32, layout = torch.strided, device = device(type='cpu'), pin_memory = False)
    triton_kernel_wrapper_functional_proxy_1 = torch.ops.higher_order.triton_kernel_wrapper_functional(kernel_idx = N, constant_args_idx = N, grid = [(4, 1, 1)], tma_descriptor_metadata = {}, kwargs = {'Q': arg1_1, 'K': arg2_1, 'V': arg3_1, 'DO': getitem_5, 'LSE': arg5_1, 'DELTA': getitem_6, 'DK': empty_strided_1, 'DV_': empty_strided_2, 'BIAS': empty_strided_3, 'KVLENS': empty_strided_3, 'SEED': empty_strided_3, 'q_desc': empty_strided_3, 'k_desc': empty_strided_3, 'v_desc': empty_strided_3, 'do_desc': empty_strided_3, 'stride_qb': 640, 'stride_qh': 320, 'stride_qm': 16, 'stride_kb': 640, 'stride_kh': 320, 'stride_kn': 16, 'stride_vb': 640, 'stride_vh': 320, 'stride_vn': 16, 'stride_dob': 640, 'stride_doh': 320, 'stride_dom': 16, 'stride_dkb': 640, 'stride_dkh': 320, 'stride_dkn': 16, 'stride_dvb': 640, 'stride_dvh': 320, 'stride_dvn': 16, 'stride_bb': 0, 'stride_bh': 0, 'stride_bm': 0, 'stride_bn': 0, 'Hq': 2, 'Hkv': 2, 'G': 1, 'Nq': 20, 'Nk': 20, 'D': 16, 'DV': 16, 'qk_scale': 0.36067376022224085, 'softcap': 0.0, 'cap_scale': 0.0, 'scale': 0.25, 'diag_offset': 0, 'window_left': -1, 'window_right': -1, 'drop_threshold': 0, 'drop_scale': 1.0, 'BLOCK_D': 16, 'BLOCK_DV': 16, 'USE_TMA': False, 'IS_CAUSAL': True, 'HAS_WL': False, 'HAS_WR': False, 'HAS_KVLEN': False, 'BIAS_KIND': 0, 'SOFTCAP': False, 'DROPOUT': False, 'PLAIN': True, 'BLOCK_M': 16, 'BLOCK_N': 16, 'QPOS': empty_strided_3, 'stride_pb': 0, 'stride_pm': 0, 'HAS_QPOS': False, 'QSEG': empty_strided_3, 'stride_qsb': 0, 'stride_qsm': 0, 'KSEG': empty_strided_3, 'stride_ksb': 0, 'stride_ksn': 0, 'HAS_SEG': False, 'ZERO_EMPTY': False, 'DQA': full, 'FUSED_DQ': True}, tensors_to_clone = ['Q', 'K', 'V', 'DO', 'LSE', 'DELTA', 'DK', 'DV_', 'BIAS', 'KVLENS', 'SEED', 'q_desc', 'k_desc', 'v_desc', 'do_desc', 'QPOS', 'QSEG', 'KSEG', 'DQA']);  arg1_1 = arg2_1 = arg3_1 = getitem_5 = arg5_1 = getitem_6 = empty_strided_1 = empty_strided_2 = empty_strided_3 = full = None
    getitem_13 = triton_kernel_wrapper_functional_proxy_1['DK']
    getitem_14 = triton_kernel_wrapper_functional_proxy_1['DV_']
    getitem_25 = triton_kernel_wrapper_functional_proxy_1['DQA'];  triton_kernel_wrapper_functional_proxy_1 = None
    mul = torch.ops.aten.mul.Tensor(getitem_25, 0.25);  getitem_25 = None
    copy = torch.ops.aten.copy.default(empty_strided, mul);  empty_strided = mul = None
    empty_2 = torch.ops.aten.empty.memory_format([0], dtype = torch.float16, layout = torch.strided, device = device(type='cpu'), pin_memory = False)
    return (copy, getitem_13, getitem_14, empty_2)""")

    def test_deterministic_mode_lowers_the_dq_kernel(cpu_lowering, poisoned, monkeypatch):
        monkeypatch.setenv("FA_COMPILE_FUSED_DQ", "1")  # asked for, and refused in deterministic mode
        case = CASES["causal_offset_gqa"]()
        out, lse = _fwd(case)
        dout = _dout(out)
        with _deterministic():
            gm, inputs = _site(case, backward=True, dout=dout, out=out, lse=lse)
            assert [str(d) for d in _lower(gm)] == ["triton -> fa3_triton.bwd"]
        kernels = [n.kwargs["kernel_idx"] for n in gm.graph.nodes if n.target is FUNCTIONAL]
        assert len(kernels) == 3  # delta, dK/dV, dQ
        first = gm(*inputs)
        _check_backward(case, dout, first[:3], None)
        assert all(torch.equal(a, b) for a, b in zip(first, gm(*inputs)))

    def _args(case, backward=False) -> "object":
        from fa_compile import dispatch

        return dispatch.AttentionArgs(case.q, case.k, case.v, case.scale, case.causal, case.diag_offset,
                                      case.window_left, case.window_right, case.bias, case.kv_lens, case.softcap,
                                      case.dropout_p, case.dropout_seed, backward, case.bias_requires_grad)

    def test_describe_names_the_triton_ops(cpu_lowering):
        text = choice.describe(_args(CASES["causal_offset_gqa"](), backward=True), "triton")
        assert text == "forward triton -> fa3_triton.fwd; backward triton -> fa3_triton.bwd", text
        # explain() names the key-padding limit where the lowering will add it (29 keys, 16-key tiles)
        text = choice.describe(_args(CASES["bool_key_padding"](), backward=True), "triton")
        note = choice.KEYS_CUT_TEXT
        assert text == f"forward triton -> fa3_triton.fwd ({note}); backward triton -> fa3_triton.bwd ({note})", text
        # and dQ added by the dK/dV kernel where asked for; not with a bias gradient (the dQ kernel writes dS),
        # nor in deterministic mode
        with pytest.MonkeyPatch.context() as m:
            m.setenv("FA_COMPILE_FUSED_DQ", "1")
            text = choice.describe(_args(CASES["bool_key_padding"](), backward=True), "triton")
            fused = triton_lowering.FUSED_DQ_TEXT
            assert text == (f"forward triton -> fa3_triton.fwd ({note}); "
                            f"backward triton -> fa3_triton.bwd ({note}; {fused})"), text
            text = choice.describe(_args(CASES["float_bias_grad_empty_row"](), backward=True), "triton")
            assert text == "forward triton -> fa3_triton.fwd; backward triton -> fa3_triton.bwd", text
            with _deterministic():
                text = choice.describe(_args(CASES["causal_offset_gqa"](), backward=True), "triton")
            assert text == "forward triton -> fa3_triton.fwd; backward triton -> fa3_triton.bwd", text

    def test_descriptor_kernels_and_tile_tuning_keep_the_op(monkeypatch):
        # Hopper with TMA-aligned strides: beyond 1024 x 1024 scores the family's descriptor / Gluon
        # kernels keep the op; shorter sites lower the pointer kernels anyway.
        monkeypatch.setattr(triton_lowering, "_capability", lambda t: (9, 0))
        lowering = triton_lowering.TRITON_LOWERING
        case = make_case(b=1, hq=2, nq=1040, nk=1040, d=64)
        why = lowering.reasons(_args(case), "forward")
        assert len(why) == 1 and "TMA-descriptor / Gluon" in why[0], why
        assert lowering.reasons(_args(make_case(b=1, hq=2, nq=16, nk=16, d=64)), "forward") == []
        monkeypatch.setenv("FA_COMPILE_TRITON_TMA", "0")
        assert lowering.reasons(_args(case), "forward") == []
        from fa_compile.kernels import tile_tuning

        monkeypatch.setattr(tile_tuning, "ENABLED", True)
        why = lowering.reasons(_args(case, backward=True), "backward")
        assert len(why) == 1 and "tile tuning" in why[0], why
        assert lowering.reasons(_args(case), "forward") == []  # the pointer forward never tunes its tile
        odd = make_case(b=1, hq=2, nq=16, nk=16, d=20)  # 40-byte rows: the family takes the pointer kernels
        monkeypatch.delenv("FA_COMPILE_TRITON_TMA")
        assert lowering.reasons(_args(odd), "forward") == []

    def test_symbolic_sizes_keep_the_op():
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.fx.experimental.symbolic_shapes import ShapeEnv

        case = make_case(b=1, hq=2, nq=16, nk=16, d=16)
        mode = FakeTensorMode(shape_env=ShapeEnv())
        from torch._dynamo.source import ConstantSource
        from torch.fx.experimental.symbolic_shapes import StatelessSymbolicContext, DimDynamic

        ctx = StatelessSymbolicContext(dynamic_sizes=[DimDynamic.STATIC, DimDynamic.STATIC, DimDynamic.DYNAMIC,
                                                      DimDynamic.STATIC])
        q = mode.from_tensor(case.q, source=ConstantSource("q"), symbolic_context=ctx)
        case.q = q
        why = triton_lowering.TRITON_LOWERING.reasons(_args(case), "forward")
        assert len(why) == 1 and "dynamic here: q.shape[2]" in why[0], why
