"""Run-time query positions (q_pos) and segment ids (q_seg / k_seg) of `torch.ops.fa3.attention`:
the reference against eager softmax attention under a dense mask built element by element, the op's
autograd (no gradient for the ids), fake tensors, argument errors that name the argument, dispatch's
reasons (the peers refuse, the reference and our Triton family take them) and the compile-time lowering,
which makes such a CPU site the reference math as graph ops."""
from __future__ import annotations

import itertools

import pytest
import torch

import fa_compile
import fa_compile.ops  # noqa: F401  (registers torch.ops.fa3)
from fa_compile import dispatch
from fa_compile.kernels import reference as ref


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _rows(t, b: int, n: int) -> list[list[int]]:
    """An index tensor [n] or [B|1, n] as B python lists."""
    t = t.reshape(1, n) if t.dim() == 1 else t
    return [t[min(i, t.shape[0] - 1)].tolist() for i in range(b)]


def dense_keep(b: int, nq: int, nk: int, q_pos=None, q_seg=None, k_seg=None) -> torch.Tensor:
    """[B, 1, Nq, Nk] bool, element by element from the definitions (independent of the reference)."""
    keep = torch.ones(b, 1, nq, nk, dtype=torch.bool)
    pos = _rows(q_pos, b, nq) if q_pos is not None else None
    qs = _rows(q_seg, b, nq) if q_seg is not None else None
    ks = _rows(k_seg, b, nk) if k_seg is not None else None
    for bb, i, j in itertools.product(range(b), range(nq), range(nk)):
        ok = True
        if pos is not None:
            ok = ok and j <= pos[bb][i]
        if qs is not None:
            ok = ok and qs[bb][i] == ks[bb][j]
        keep[bb, 0, i, j] = ok
    return keep


def eager_attention(q, k, v, scale, keep, bias=None):
    """softmax(q k^T scale + bias, masked by `keep`) v in fp64; empty rows give 0 (the op's convention)."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1).double(), v.repeat_interleave(g, 1).double()
    s = q.double() @ k.transpose(-1, -2) * scale
    if bias is not None:
        s = s + bias.double()
    s = s.masked_fill(~keep, float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return p @ v


def _qkv(b=2, hq=4, hkv=2, nq=9, nk=13, d=8, seed=0, dtype=torch.float32, grad=False):
    g = _gen(seed)
    q, k, v = (torch.randn(b, h, n, d, generator=g, dtype=dtype) for h, n in ((hq, nq), (hkv, nk), (hkv, nk)))
    if grad:
        for t in (q, k, v):
            t.requires_grad_(True)
    return q, k, v


CASES = {
    "q_pos_per_batch": lambda nq, nk, g: dict(q_pos=torch.randint(-3, nk + 4, (2, nq), generator=g)),
    "q_pos_shared_int32": lambda nq, nk, g: dict(q_pos=torch.randint(-2, nk + 2, (nq,), generator=g).int()),
    "q_pos_static_cache": lambda nq, nk, g: dict(q_pos=torch.arange(nq).view(1, nq) + 2),
    "segments_sorted": lambda nq, nk, g: dict(q_seg=torch.tensor([[0] * 3 + [1] * 4 + [3] * (nq - 7)] * 2),
                                              k_seg=torch.tensor([[0] * 5 + [1] * 2 + [2] * 3 + [3] * (nk - 10)] * 2)),
    "segments_unsorted_mixed_dtypes": lambda nq, nk, g: dict(q_seg=torch.randint(0, 3, (2, nq), generator=g),
                                                             k_seg=torch.randint(0, 3, (nk,), generator=g).int()),
    "positions_and_segments": lambda nq, nk, g: dict(q_pos=torch.randint(0, nk, (2, nq), generator=g),
                                                     q_seg=torch.randint(-1, 2, (nq,), generator=g),
                                                     k_seg=torch.randint(-1, 2, (2, nk), generator=g)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_reference_matches_eager_under_the_dense_mask(name):
    q, k, v = _qkv()
    kw = CASES[name](9, 13, _gen(1))
    keep = dense_keep(2, 9, 13, **kw)
    out, lse = ref.attention_reference(q, k, v, scale=0.4, **kw)
    torch.testing.assert_close(out.double(), eager_attention(q, k, v, 0.4, keep), atol=1e-5, rtol=1e-5)
    assert torch.equal(torch.isneginf(lse), ~keep.any(-1).expand_as(lse))  # empty rows: lse -inf, out 0
    assert (out[~keep.any(-1).expand(2, 4, 9)] == 0).all()


def test_masks_and_with_causal_window_bias_and_kv_lens():
    q, k, v = _qkv(nq=10, nk=12)
    g = _gen(2)
    q_pos = torch.randint(-1, 14, (2, 10), generator=g)
    q_seg, k_seg = torch.randint(0, 2, (2, 10), generator=g), torch.randint(0, 2, (2, 12), generator=g)
    bias = torch.randn(2, 1, 1, 12, generator=g)
    kv_lens = torch.tensor([9, 12])
    out, _ = ref.attention_reference(q, k, v, scale=0.3, causal=True, diag_offset=3, window_left=6, bias=bias,
                                     kv_lens=kv_lens, q_pos=q_pos, q_seg=q_seg, k_seg=k_seg)
    keep = dense_keep(2, 10, 12, q_pos, q_seg, k_seg).clone()
    for bb, i, j in itertools.product(range(2), range(10), range(12)):
        d = j - i - 3
        keep[bb, 0, i, j] &= d <= 0 and d >= -6 and j < int(kv_lens[bb])
    torch.testing.assert_close(out.double(), eager_attention(q, k, v, 0.3, keep, bias), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["q_pos_per_batch", "segments_unsorted_mixed_dtypes", "positions_and_segments"])
def test_op_gradients_match_eager(name):
    q, k, v = _qkv(grad=True, dtype=torch.float64)
    bias = torch.randn(2, 4, 9, 13, generator=_gen(3), dtype=torch.float64, requires_grad=True)
    kw = CASES[name](9, 13, _gen(4))
    out = fa_compile.attention(q, k, v, scale=0.5, bias=bias, **kw)
    want = eager_attention(q, k, v, 0.5, dense_keep(2, 9, 13, **kw), bias)
    torch.testing.assert_close(out, want, atol=1e-10, rtol=1e-10)
    dout = torch.randn(out.shape, generator=_gen(5), dtype=torch.float64)
    got = torch.autograd.grad(out, (q, k, v, bias), dout)
    exp = torch.autograd.grad(want, (q, k, v, bias), dout)
    for n, a, b in zip(("dq", "dk", "dv", "dbias"), got, exp):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10, msg=lambda m, n=n: f"{n}: {m}")


def test_lse_gradient_and_bshd_layout():
    q, k, v = _qkv(grad=True, dtype=torch.float64, nq=7, nk=11)
    q_pos = torch.tensor([[0, 3, -1, 20, 5, 10, 2], [1, 1, 1, 9, 9, 9, 6]])
    qb, kb, vb = (t.detach().transpose(1, 2).contiguous().requires_grad_(True) for t in (q, k, v))
    out, lse = fa_compile.attention(qb, kb, vb, layout="bshd", q_pos=q_pos, return_lse=True)
    keep = dense_keep(2, 7, 11, q_pos=q_pos)
    g = 2
    s = q.double() @ k.repeat_interleave(g, 1).transpose(-1, -2) / 8 ** 0.5
    want_lse = s.masked_fill(~keep, float("-inf")).logsumexp(-1)
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-6, rtol=1e-6)
    ok = torch.isfinite(want_lse)
    dl = torch.randn(lse.shape, generator=_gen(6), dtype=torch.float64)
    (gq,) = torch.autograd.grad((lse.double()[ok] * dl[ok]).sum(), (qb,))
    (wq,) = torch.autograd.grad((want_lse[ok] * dl[ok]).sum(), (q,))
    torch.testing.assert_close(gq.transpose(1, 2), wq, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(out.transpose(1, 2), eager_attention(q, k, v, 8 ** -0.5, keep).to(out.dtype))


def test_ids_get_no_gradient_and_fake_tensors_work():
    q, k, v = _qkv(grad=True)
    q_pos = torch.arange(9)
    out = torch.ops.fa3.attention(q, k, v, 0.3, False, 0, -1, -1, None, None, 0.0, 0.0, None, None, None,
                                  q_pos, torch.zeros(9, dtype=torch.int64), torch.zeros(13, dtype=torch.int64))[0]
    out.sum().backward()
    assert q.grad is not None and q_pos.grad is None
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode()
    fq, fk, fv = (mode.from_tensor(t.detach()) for t in (q, k, v))
    with mode:
        o, lse = torch.ops.fa3.attention(fq, fk, fv, 0.3, q_pos=mode.from_tensor(q_pos))
        assert o.shape == (2, 4, 9, 8) and lse.shape == (2, 4, 9)
        with pytest.raises(ValueError, match="^q_pos: expected shape"):
            torch.ops.fa3.attention(fq, fk, fv, 0.3, q_pos=mode.from_tensor(torch.arange(8)))


def test_schema_appends_the_arguments_after_sinks():
    for op in (torch.ops.fa3.attention.default, torch.ops.fa3.attention_backward.default):
        names = [a.name for a in op._schema.arguments]
        assert names[-4:] == ["sinks", "q_pos", "q_seg", "k_seg"]


Q, K = (2, 4, 5, 8), (2, 2, 7, 8)
ERRORS = [
    ("q_pos_float", dict(q_pos=torch.zeros(5)), ValueError, "q_pos: dtype must be int32 or int64"),
    ("q_pos_bool", dict(q_pos=torch.zeros(5, dtype=torch.bool)), ValueError, "q_pos: dtype"),
    ("q_pos_length", dict(q_pos=torch.zeros(7, dtype=torch.int64)), ValueError, r"q_pos: expected shape \[Nq\] = \[5\]"),
    ("q_pos_batch", dict(q_pos=torch.zeros(3, 5, dtype=torch.int64)), ValueError, r"q_pos: expected shape"),
    ("q_pos_3d", dict(q_pos=torch.zeros(2, 5, 1, dtype=torch.int64)), ValueError, r"q_pos: expected shape"),
    ("q_pos_device", dict(q_pos=torch.zeros(5, dtype=torch.int64, device="meta")), ValueError,
     "q_pos: must be on q's device"),
    ("q_pos_list", dict(q_pos=[0, 1, 2, 3, 4]), TypeError, "q_pos: expected a Tensor or None"),
    ("q_seg_alone", dict(q_seg=torch.zeros(5, dtype=torch.int64)), ValueError, "k_seg: required when q_seg"),
    ("k_seg_alone", dict(k_seg=torch.zeros(7, dtype=torch.int64)), ValueError, "q_seg: required when k_seg"),
    ("q_seg_float", dict(q_seg=torch.zeros(5), k_seg=torch.zeros(7, dtype=torch.int64)), ValueError,
     "q_seg: dtype must be int32 or int64"),
    ("k_seg_length", dict(q_seg=torch.zeros(5, dtype=torch.int64), k_seg=torch.zeros(5, dtype=torch.int64)),
     ValueError, r"k_seg: expected shape \[Nk\] = \[7\]"),
    ("k_seg_device", dict(q_seg=torch.zeros(2, 5, dtype=torch.int32),
                          k_seg=torch.zeros(2, 7, dtype=torch.int32, device="meta")), ValueError,
     "k_seg: must be on q's device"),
]


@pytest.mark.parametrize("kw, exc, msg", [c[1:] for c in ERRORS], ids=[c[0] for c in ERRORS])
def test_argument_errors_name_the_argument(kw, exc, msg):
    q, k = torch.randn(*Q), torch.randn(*K)
    with pytest.raises(exc, match="^" + msg):
        fa_compile.attention(q, k, k, **kw)
    if exc is ValueError:  # the op's own checks say the same
        with pytest.raises(exc, match="^" + msg):
            torch.ops.fa3.attention(q, k, k, 0.3, **kw)


def _args(**kw) -> dispatch.AttentionArgs:
    q, k, v = _qkv(nq=1, nk=40)
    return dispatch.AttentionArgs(q, k, v, 0.3, **kw)


def test_peers_refuse_with_a_reason_and_the_reference_takes_them():
    from fa_compile.candidates import common

    pos = _args(q_pos=torch.tensor([30]))
    seg = _args(q_seg=torch.zeros(1, dtype=torch.int64), k_seg=torch.zeros(40, dtype=torch.int64))
    assert any("q_pos" in r for r in common.position_segment_reasons(pos, "cuDNN"))
    assert any("q_seg / k_seg" in r for r in common.position_segment_reasons(seg, "FA3"))
    assert common.may_have_empty_rows(pos) and common.may_have_empty_rows(seg)
    for args in (pos, seg):
        for cand in dispatch.candidates("forward") + dispatch.candidates("backward"):
            if cand.name in ("cudnn", "fa3", "fa4", "flash", "efficient"):
                reasons = cand.not_supported_reasons(args)
                assert reasons, cand.name  # (on this CPU machine the device is a reason too)
        assert dispatch.ReferenceCandidate().not_supported_reasons(args) == []
    fake_cuda = dispatch.AttentionArgs(*(torch.empty(2, 4, 1, 64, device="meta") for _ in range(3)), 0.1,
                                       q_pos=torch.empty(2, 1, dtype=torch.int64, device="meta"))
    assert "q_pos" in " ".join(common.common_feature_reasons(fake_cuda, "x"))


def test_the_compile_time_lowering_takes_them_as_the_reference_math(monkeypatch):
    # aten's CPU flash kernel has no run-time positions or segment ids: the reference math as graph ops takes
    # the site; with it switched off the op keeps it.
    from fa_compile.lowering import choice

    for kw in (dict(q_pos=torch.tensor([3])), dict(q_seg=torch.zeros(1, dtype=torch.int64),
                                                   k_seg=torch.zeros(40, dtype=torch.int64))):
        d = choice.decide(_args(**kw), None, "forward", measure=False)  # one query: the decode-step math
        assert d.lowered and d.kernel == "decode_math", str(d)
        with monkeypatch.context() as m:
            m.setenv("FA_COMPILE_DECODE_MATH", "0")
            d = choice.decide(_args(**kw), None, "forward", measure=False)
            assert d.lowered and d.kernel == "reference_math" and "q_pos / segment ids" in d.instead_of, str(d)
            m.setenv("FA_COMPILE_REFERENCE_MATH", "0")
            d = choice.decide(_args(**kw), None, "forward", measure=False)
        assert not d.lowered and "q_pos / segment ids" in d.reason


@pytest.mark.parametrize("name", ["q_pos_per_batch", "segments_sorted", "positions_and_segments"])
def test_compiled_sites_match_eager(name):
    # Compiled on CPU, the site becomes the reference math as graph ops: outputs and gradients (fp32) as the
    # dense-mask eager attention's (computed in fp64).
    from fa_compile.lowering import records

    q, k, v = _qkv(grad=True)
    kw = CASES[name](9, 13, _gen(4))

    def fn(q, k, v):
        return fa_compile.attention(q, k, v, scale=0.5, **kw)

    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    torch._dynamo.reset()
    n = len(records())
    # (the pass records its decisions on a real compile, not on a cache hit)
    with inductor_config.patch(fx_graph_cache=False), functorch_config.patch(enable_autograd_cache=False):
        out = torch.compile(fn, backend="fa3")(q, k, v)
    decisions = [r.decision for r in records()[n:]]
    # (9 queries: a training forward keeps the lowering of its backward, the reference math, which reads its lse)
    kinds = {(d.direction, d.kernel) for d in decisions if d.lowered}
    assert decisions and len(kinds) == len({(d.direction, d.kernel) for d in decisions}) \
        and kinds <= {("forward", "reference_math"), ("backward", "reference_math")}, [str(d) for d in decisions]
    want = eager_attention(q, k, v, 0.5, dense_keep(2, 9, 13, **kw))
    torch.testing.assert_close(out.double(), want, atol=2e-6, rtol=2e-6)
    dout = torch.randn(out.shape, generator=_gen(5))
    got = torch.autograd.grad(out, (q, k, v), dout)
    exp = torch.autograd.grad(want, (q, k, v), dout.double())
    for n_, a, b in zip(("dq", "dk", "dv"), got, exp):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, atol=2e-5, rtol=2e-5, msg=lambda m, n_=n_: f"{n_}: {m}")


def test_zero_sizes_with_positions_and_segments():
    q, k, v = torch.randn(2, 2, 0, 8), torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8)
    out = fa_compile.attention(q, k, v, q_pos=torch.zeros(2, 0, dtype=torch.int64),
                               q_seg=torch.zeros(0, dtype=torch.int64), k_seg=torch.zeros(2, 5, dtype=torch.int64))
    assert out.shape == (2, 2, 0, 8)
    q = torch.randn(2, 2, 3, 8)
    out, lse = fa_compile.attention(q, k[:, :, :0], v[:, :, :0], q_pos=torch.tensor([0, 1, 2]), return_lse=True)
    assert (out == 0).all() and torch.isneginf(lse).all()
