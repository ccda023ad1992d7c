"""Terms written into a slice of the scores (patterns/slice_update.py), drawn at random: any slice of the head,
query and key axes, in place or not, added or subtracted, through a view of the slice or not, with a term that
needs a gradient or not. Each program is compared with eager on fresh inputs (output and every gradient); a
rewritten site must be exact, a refused one must say why."""
from __future__ import annotations

import pytest
import torch

from eager_diff import check, rand

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

B, H, N, D = 2, 3, 7, 8


def _program(form: str, idx: tuple, view: bool):
    def fn(q, k, v, t):
        s = (q * 0.35) @ k.transpose(-2, -1)
        part = s[idx]
        if view:  # the key axis split in two, the term broadcast over the first half
            shape = list(part.shape)
            term = t.expand(*shape[:-1], 2, shape[-1] // 2)
            s[idx] = (part.view(*shape[:-1], 2, shape[-1] // 2) + term).view(shape)
        elif form == "iadd":
            s[idx] += t  # a read of the slice, an in-place add, the write back
        elif form == "isub":
            s[idx] -= t
        elif form == "add":
            s[idx] = part + t
        else:
            s[idx] = t + part
        return torch.softmax(s, -1) @ v
    return fn


@st.composite
def programs(draw):
    h0 = draw(st.integers(0, 1))
    q0, q1 = draw(st.integers(0, 3)), draw(st.integers(4, N))
    k0 = draw(st.integers(0, 3))
    view = draw(st.booleans())
    k1 = k0 + 2 * draw(st.integers(1, (N - k0) // 2)) if view else draw(st.integers(k0 + 1, N))
    idx = (slice(None), slice(h0, None), slice(q0, q1), slice(k0, k1))
    form = draw(st.sampled_from(["iadd", "isub", "add", "add_swapped"]))
    grad = draw(st.booleans())
    shape = (B, H - h0, q1 - q0, (k1 - k0) // 2) if view else (B, H - h0, q1 - q0, k1 - k0)
    if view:
        shape = (B, H - h0, q1 - q0, 1, shape[-1])
    return form, idx, view, shape, grad


@settings(max_examples=25, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
@given(programs())
def test_terms_written_into_random_slices_match_eager(drawn):
    form, idx, view, shape, grad = drawn
    q, k, v = (rand(B, H, N, D, seed=i, requires_grad=True) for i in range(3))
    t = rand(*shape, seed=5, requires_grad=grad)
    res = check(_program(form, idx, view), [q, k, v, t])
    assert len(res.rewritten) == 1, res.reasons  # every drawn form is a term of the scores
