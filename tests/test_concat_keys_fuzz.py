"""Key blocks scored apart and normalised together (patterns/concat_keys.py), drawn at random: two or three blocks,
each shared by every query block (no block letter: PEGASUS-X's global tokens) or a block's own, of random lengths;
the probabilities' slices applied with the values on either side of the einsum and summed in any order; a mask or
none; fp32 or fp64. Each program is compared with eager on fresh inputs, output and every gradient."""
from __future__ import annotations

import itertools

import pytest
import torch

from eager_diff import check, rand

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

B, H, NB, BL, D = 2, 2, 3, 4, 8


def _program(shared: tuple, values_first: tuple, order: tuple, masked: bool):
    lens = None

    def fn(q, m, *kv):
        qb = q.view(B, H, NB, BL, D)
        ks, vs = kv[0::2], kv[1::2]
        blocks = [torch.einsum("bhnid,bhjd->bhnij" if s else "bhnid,bhnjd->bhnij", qb, k) for s, k in zip(shared, ks)]
        s = torch.cat(blocks, dim=-1) * 0.35
        if masked:
            s = s + m[:, None, :, None, :]
        p = torch.softmax(s, dim=-1)
        outs, at = [], 0
        for sh, vf, b, v in zip(shared, values_first, blocks, vs):
            n = b.shape[-1]
            sl = p[..., at:at + n]
            at += n
            pv = "bhnij" + (",bhje" if sh else ",bhnje")
            if vf:
                eq = ("bhje" if sh else "bhnje") + ",bhnij->bhnie"
                outs.append(torch.einsum(eq, v, sl))
            else:
                outs.append(torch.einsum(pv + "->bhnie", sl, v))
        total = outs[order[0]]
        for i in order[1:]:
            total = total + outs[i]
        return total
    return fn


@st.composite
def programs(draw):
    m = draw(st.integers(2, 3))
    shared = tuple(draw(st.booleans()) for _ in range(m))
    lens = tuple(draw(st.integers(1, 5)) if s else BL for s in shared)
    values_first = tuple(draw(st.booleans()) for _ in range(m))
    order = draw(st.sampled_from(list(itertools.permutations(range(m)))))
    masked = draw(st.booleans())
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    return shared, lens, values_first, order, masked, dtype


@settings(max_examples=20, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck))
@given(programs())
def test_key_blocks_drawn_at_random_match_eager(drawn):
    shared, lens, values_first, order, masked, dtype = drawn
    q = rand(B, H, NB * BL, D, seed=0, dtype=dtype, requires_grad=True)
    kv = []
    for i, (s, n) in enumerate(zip(shared, lens)):
        shape = (B, H, n, D) if s else (B, H, NB, n, D)
        kv += [rand(*shape, seed=10 + 2 * i, dtype=dtype, requires_grad=True),
               rand(*shape, seed=11 + 2 * i, dtype=dtype, requires_grad=True)]
    m = torch.zeros(B, NB, sum(lens), dtype=dtype)
    m[1, -1, -1] = float("-inf")
    res = check(_program(shared, values_first, order, masked), [q, m, *kv], dtype=dtype)
    assert len(res.rewritten) == 1, res.reasons
