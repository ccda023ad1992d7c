"""Differential fuzzing of the softmax-attention recognizer.

A hypothesis strategy composes one spelling from each axis (scale × mask × softmax × layout × GQA ×
dtype, plus an occasional twist that makes it not attention), builds a small function from them,
compiles it with the fa3 pass, and checks: the compiled output equals eager, and the site was
rewritten (or, for a twist, left alone with the stated reason).
"""
from __future__ import annotations

import math
import zlib

import pytest
import torch
import torch.nn.functional as F

from adversarial_programs import repeat_kv as _repeat
from conftest import TOL, Compiled

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

B, H, HKV, N, D = 2, 4, 2, 8, 8

SCALES = ["none", "div_sqrt", "mul_pow", "number_first", "tensor0d", "q_prescaled", "softcap"]
MASKS = ["none", "causal_fill_inf", "causal_where_min", "additive_first", "additive_last", "padding_bool"]
SOFTMAXES = ["F.softmax", "torch.softmax", "Tensor.softmax", "dtype_f32_to", "float_type_as"]
LAYOUTS = ["bhsd", "bshd", "bmm3d", "einsum"]
GQAS = ["none", "repeat_kv", "repeat_interleave", "mqa_broadcast"]
TWISTS = ["none", "none", "none", "softmax_dim_-2", "returns_probs"]  # mostly attention


def build(scale, mask, softmax, layout, gqa, twist):
    def scores_of(q, k):
        if scale == "q_prescaled":
            q = q * D ** -0.5
        if layout == "einsum":
            s = torch.einsum("bhqd,bhkd->bhqk", q, k)
        elif layout == "bmm3d":
            s = torch.bmm(q, k.transpose(1, 2))
        else:
            s = q @ k.transpose(-2, -1)
        if scale == "div_sqrt":
            s = s / math.sqrt(D)
        elif scale == "mul_pow":
            s = s * D ** -0.5
        elif scale == "number_first":
            s = 0.3 * s
        elif scale == "tensor0d":
            s = s * torch.tensor(0.4, dtype=s.dtype)
        elif scale == "softcap":
            s = torch.tanh(s * 0.35 / 4.0) * 4.0
        return s

    def masked(s, m):
        n = s.shape[-1]
        if mask in ("causal_fill_inf", "causal_where_min"):
            upper = torch.ones(n, n, dtype=torch.bool, device=s.device).triu(1)
            if mask == "causal_fill_inf":
                return s.masked_fill(upper, float("-inf"))
            return torch.where(~upper, s, torch.finfo(s.dtype).min)
        if mask == "additive_first":
            return m + s
        if mask == "additive_last":
            return s + m
        if mask == "padding_bool":
            return s.masked_fill(~m, float("-inf"))
        return s

    def sm(s, dtype):
        dim = -2 if twist == "softmax_dim_-2" else -1
        if softmax == "F.softmax":
            return F.softmax(s, dim=dim)
        if softmax == "torch.softmax":
            return torch.softmax(s, dim)
        if softmax == "Tensor.softmax":
            return s.softmax(dim)
        if softmax == "dtype_f32_to":
            return F.softmax(s, dim=dim, dtype=torch.float32).to(dtype)
        return torch.softmax(s.float(), dim).type_as(s)

    def fn(q, k, v, m):
        dtype = q.dtype
        if layout == "bshd":  # inputs come [B, N, H, D]
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        k, v = _repeat(k, gqa, H // k.shape[1]), _repeat(v, gqa, H // v.shape[1])
        if layout == "bmm3d":
            b, h, n, d = q.shape
            q = q.reshape(b * h, n, d)
            k, v = k.expand(b, h, n, d).reshape(b * h, n, d), v.expand(b, h, n, d).reshape(b * h, n, d)
        p = sm(masked(scores_of(q, k), m), dtype)
        out = p @ v if layout != "einsum" else torch.einsum("bhqk,bhkd->bhqd", p, v)
        if twist == "returns_probs":
            return out, p
        return out

    return fn


def inputs(layout, gqa, mask, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    hkv = {"none": H, "repeat_kv": HKV, "repeat_interleave": HKV, "mqa_broadcast": 1}[gqa]
    if layout == "bmm3d" and gqa == "mqa_broadcast":
        hkv = 1  # expanded to H before the 3-D reshape
    qs, ks = (B, H, N, D), (B, hkv, N, D)
    if layout == "bshd":
        qs, ks = (B, N, H, D), (B, N, hkv, D)
    mk = lambda s: torch.randn(*s, generator=g).to(dtype)  # noqa: E731
    q, k, v = mk(qs), mk(ks), mk(ks)
    if mask == "padding_bool":
        keep = torch.ones(B, N, dtype=torch.bool)
        keep[1, N // 2:] = False
        m = keep[:, None, None, :] if layout != "bmm3d" else keep.repeat_interleave(H, 0)[:, None, :]
    else:
        m = torch.randn(B, 1, N, N, generator=g).to(dtype)
        if layout == "bmm3d":
            m = m.expand(B, H, N, N).reshape(B * H, N, N)
    return q, k, v, m


@settings(max_examples=25, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(scale=st.sampled_from(SCALES), mask=st.sampled_from(MASKS), softmax=st.sampled_from(SOFTMAXES),
       layout=st.sampled_from(LAYOUTS), gqa=st.sampled_from(GQAS),
       dtype=st.sampled_from([torch.float32, torch.float16]), twist=st.sampled_from(TWISTS))
def test_fuzz_spellings(scale, mask, softmax, layout, gqa, dtype, twist):
    fn = build(scale, mask, softmax, layout, gqa, twist)
    args = inputs(layout, gqa, mask, dtype, seed=zlib.crc32(repr((scale, mask, softmax, layout, gqa, twist)).encode()) % 1000)
    c = Compiled(fn)
    out = c(*args)
    ref = fn(*args)
    torch.testing.assert_close(out, ref, **TOL[dtype], equal_nan=True)
    assert len(c.reports) == 1, c.reports
    (r,) = c.reports
    if twist == "softmax_dim_-2":
        assert not r.rewritten and "not the last dim" in r.reason, r
    elif twist == "returns_probs":
        assert not r.rewritten and "output_attentions" in r.reason, r
    else:
        assert r.rewritten, (scale, mask, softmax, layout, gqa, dtype, r.reason)
        assert c.op_calls() == 1
