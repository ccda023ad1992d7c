"""Spellings of attention that read as the same attention once one general rule is applied.

- a dead use of the scores (a copy or view whose result nobody reads) is no use: dead pure nodes are
  removed before analysis; a dead node that writes or draws random numbers is kept;
- an in-place update of scores nothing else aliases (`s.masked_fill_(m, -inf)` as a statement) is
  its functional op; aliased or grad-mode-crossing updates are left alone;
- a read of only the scores' shape / dtype (`torch.ones_like(s)`, `s.new_ones(...)`) is not a use
  of their values;
- F.linear(q, k) is Q·Kᵀ (its bias an additive mask), exp(log_softmax(s)) is softmax(s), so is
  exp(s - rowmax(s)) / Σ exp(s - rowmax(s)) (softmax's own formula; without the row max it is not: eager's
  exp overflows where softmax does not), so is exp(s - logsumexp(s)) (not over rows a finite fill may mask
  entirely: eager's logsumexp rounds at the fill's magnitude there), a
  multiplicative 0/1 mask `s * m + (1 - m) * c` is masked_fill(m == 0, c) (m proven 0/1, or refused),
  baddbmm's beta * input is an additive bias for every beta;
- probabilities set to 0 exactly where an absorbing fill masked the scores (DeBERTa's XSoftmax) differ from the
  softmax only on rows with no admissible key: those are 0 with no gradient, the op's own empty row.
Each is compared with eager on fresh random inputs: output, inputs afterwards and every gradient.
"""
from __future__ import annotations

import collections
import math

import expecttest
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from conftest import Compiled
from eager_diff import check, rand
from test_patterns_softmax import pinned

B, H, N, D = 2, 2, 6, 8


def qkv(shape=(B, H, N, D), grad=True, seed=0, dtype=torch.float32):
    return [rand(*shape, seed=seed + i, dtype=dtype, requires_grad=grad) for i in range(3)]


def causal_bool(n=N):
    return torch.ones(n, n, dtype=torch.bool).triu(1)  # True = masked


def reasons(res) -> str:
    return " | ".join(res.reasons)


# ------------------------------------------------------------------------------- dead uses of the scores

def dead_clone(q, k, v):
    s = q @ k.transpose(-2, -1) * 0.25
    qk = s.clone()  # kept for an optional return value that is never returned  # noqa: F841
    return torch.softmax(s, -1) @ v


def dead_view_chain(q, k, v):
    s = q @ k.transpose(-2, -1) * 0.25
    flat = s.view(B, H * N, N).float().contiguous()  # noqa: F841
    return torch.softmax(s, -1) @ v


AttnOut = collections.namedtuple("AttnOut", ["out", "weights_view"])


class ReturnsNamedTuple(nn.Module):
    def forward(self, q, k, v):
        s = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))
        return AttnOut(torch.softmax(s, -1) @ v, s.transpose(-2, -1))


class DropsTheView(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = ReturnsNamedTuple()

    def forward(self, q, k, v):
        return self.attn(q, k, v).out * 2.0


def dead_broadcast(q, k, v):
    """WavLM: the attention weights (here the probabilities) feed only a broadcast_to nobody reads."""
    p = torch.softmax(q @ k.transpose(-2, -1) * 0.25, -1)
    torch.broadcast_to(p, (2,) + tuple(p.shape))  # dead
    p.broadcast_to((2,) + tuple(p.shape))  # dead
    return p @ v


@pytest.mark.parametrize("fn", [dead_clone, dead_view_chain, dead_broadcast, DropsTheView()],
                         ids=lambda f: type(f).__name__ if isinstance(f, nn.Module) else f.__name__)
def test_dead_use_of_the_scores_is_no_use(fn):
    check(fn, qkv(), rewritten=1)


def dead_random_use(q, k, v):
    s = q @ k.transpose(-2, -1) * 0.25
    noise = torch.rand_like(s) + s  # noqa: F841  (dead, but it draws random numbers: not removed)
    return torch.softmax(s, -1) @ v


def test_dead_node_that_draws_random_numbers_is_kept():
    res = check(dead_random_use, qkv(), rewritten=0)
    assert "also used outside the attention" in reasons(res)


def test_a_graph_with_no_rewrite_is_handed_on_as_traced():
    def f(q, k, v):
        s = q @ k.transpose(-2, -1)
        keep = s.clone()  # noqa: F841
        s.masked_fill_(causal_bool(), -1e9)
        return torch.softmax(s, dim=1) @ v  # softmax over the query axis: not attention

    c = Compiled(f)
    args = qkv(grad=False)
    torch.testing.assert_close(c(*args), f(*args))
    assert len(c.rewritten) == 0
    targets = [n.target for n in c.graphs[0].graph.nodes]
    assert "clone" in targets and "masked_fill_" in targets and "masked_fill" not in targets
    assert "masked_fill_" in c.graphs[0].code


# ------------------------------------------------------------------------- in-place updates of the scores

def masked_fill_statement(q, k, v):
    s = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))
    s.masked_fill_(causal_bool(q.size(-2)), -math.inf)
    return torch.softmax(s, -1) @ v


def test_masked_fill_in_place_statement_dynamic():
    c = Compiled(masked_fill_statement, dynamic=True)
    for n in (6, 9):
        args = qkv(shape=(B, H, n, D), grad=False, seed=n)
        torch.testing.assert_close(c(*args), masked_fill_statement(*args))
    assert len(c.graphs) == 1 and len(c.rewritten) == 1 and c.rewritten[0].mask == "causal"


def masked_fill_padding_finfo(q, k, v, key_keep):
    s = q @ k.transpose(-2, -1) * 0.25
    s.masked_fill_(~key_keep[:, None, None, :], torch.finfo(s.dtype).min)
    s.div_(2.0)  # a second in-place update of the same tensor
    return torch.softmax(s, -1) @ v


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_masked_fill_in_place_statement_is_functional(dtype):
    res = check(masked_fill_statement, qkv(dtype=dtype), dtype=dtype, rewritten=1)
    assert res.rewritten[0].mask == "causal"


def setitem_bool_mask(q, k, v):
    s = q @ k.transpose(-2, -1) * 0.25
    s[causal_bool().expand(s.shape)] = -math.inf  # x[mask] = c with a mask of x's shape: masked_fill_
    return torch.softmax(s, -1) @ v


def test_setitem_with_a_bool_mask_of_the_scores_shape_is_masked_fill():
    res = check(setitem_bool_mask, qkv(), rewritten=1)
    assert res.rewritten[0].mask == "causal"


def test_in_place_statement_through_inductor():
    res = check(masked_fill_statement, qkv(), inner="inductor", rewritten=1)
    assert res.rewritten[0].mask == "causal"


def test_in_place_updates_in_sequence_are_functional():
    keep = torch.ones(B, N, dtype=torch.bool)
    keep[0, -2:] = False
    res = check(masked_fill_padding_finfo, qkv() + [keep], rewritten=1)
    assert res.rewritten[0].scale == pytest.approx(0.125)


def masked_fill_of_a_view(q, k, v):
    b, h, n, d = q.shape
    s = torch.bmm(q.reshape(b * h, n, d), k.reshape(b * h, n, d).transpose(1, 2)).view(b, h, n, n)
    s.masked_fill_(causal_bool(n), -math.inf)  # writes through the only view of the product
    return torch.softmax(s * 0.25, -1) @ v


def test_masked_fill_in_place_through_a_view_is_functional():
    res = check(masked_fill_of_a_view, qkv(), rewritten=1)
    assert res.rewritten[0].mask == "causal"


def masked_fill_base_read(q, k, v):
    b, h, n, d = q.shape
    raw = torch.bmm(q.reshape(b * h, n, d), k.reshape(b * h, n, d).transpose(1, 2))
    s = raw.view(b, h, n, n)
    s.masked_fill_(causal_bool(n), -1e9)
    return torch.softmax(s * 0.25, -1) @ v + raw.amax()  # the base sees the write too


def masked_fill_aliased(q, k, v):
    s = q @ k.transpose(-2, -1) * 0.25
    rows = s.view(B, H * N, N)  # a view of the scores, made before the write and read after it
    s.masked_fill_(causal_bool(), -1e9)
    return torch.softmax(s, -1) @ v + rows.sum(-1).view(B, H, N, 1)


def masked_fill_under_no_grad(q, k, v):
    s = q @ k.transpose(-2, -1) * 0.25
    with torch.no_grad():
        s.masked_fill_(causal_bool(), -1e9)  # eager's gradient ignores the fill
    return torch.softmax(s, -1) @ v


@pytest.mark.parametrize("fn", [masked_fill_aliased, masked_fill_base_read, masked_fill_under_no_grad],
                         ids=lambda f: f.__name__)
def test_in_place_update_that_is_not_functional_is_refused(fn):
    res = check(fn, qkv(), rewritten=0)
    assert "modified in place" in reasons(res)


def einsum_bias_scaled_in_place(q, k, v, r, keep):
    s = torch.einsum("bhid,bhjd->bhij", q, k) * 0.25
    pos = torch.einsum("bhid,jd->bhij", q, r[1:])  # a query-dependent relative bias: a product, so fresh
    pos *= keep  # in place, on the fresh bias term (Funnel's `positional_attn *= cls_mask`)
    return torch.softmax(s + pos, -1) @ v


def sliced_bias_scaled_in_place(q, k, v, r, keep):
    s = q @ k.transpose(-2, -1) * 0.25
    pos = torch.einsum("bhid,jd->bhij", q, r)[..., 1:]  # a strided view: the slice of a relative shift
    pos *= keep
    return torch.softmax(s + pos, -1) @ v


def sliced_bias_then_viewed(q, k, v, r, keep):
    s = q @ k.transpose(-2, -1) * 0.25
    pos = torch.einsum("bhid,jd->bhij", q, r)[..., 1:]
    pos *= keep
    flat = pos.transpose(-1, -2)  # a view-taking reader after the update: x2's other strides would show here
    return torch.softmax(s + flat.transpose(-1, -2), -1) @ v


class ProjectionScaledInPlace(nn.Module):
    """DeBERTa's disentangled bias: relative positions projected by a module after Q·Kᵀ, then scaled in place."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(D, H * D)

    def forward(self, q, k, v, r):
        s = q @ k.transpose(-2, -1) * 0.25
        pos = self.proj(r).view(N, H, D).permute(1, 0, 2)
        pos /= 2.0  # in place, on a view of the projection
        return torch.softmax(s + q @ pos.transpose(-1, -2), -1) @ v


def test_in_place_scaling_of_a_projection_is_functional():
    torch.manual_seed(0)
    res = check(ProjectionScaledInPlace(), qkv() + [rand(N, D, seed=7, requires_grad=True)], rewritten=1)
    assert res.rewritten[0].mask == "bias"


def _bias_args():
    keep = torch.ones(N, N)
    keep[0] = 0  # a class token's row: no relative bias
    return qkv() + [rand(N + 1, D, seed=7), keep]  # N + 1 relative positions: the sliced form reads N of them


@pytest.mark.parametrize("fn", [einsum_bias_scaled_in_place, sliced_bias_scaled_in_place], ids=lambda f: f.__name__)
def test_in_place_update_of_a_fresh_bias_term_is_functional(fn):
    res = check(fn, _bias_args(), rewritten=1)
    assert res.rewritten[0].mask == "bias"


def causal_made_in_place_after_the_scores(q, k, v):
    """DALLE-pytorch: the scores first, then the causal mask of their shape made in place."""
    dots = torch.einsum("b h i d, b h j d -> b h i j", q * 0.35, k)
    i, j = dots.shape[-2:]
    mask = torch.ones(i, j, dtype=torch.bool).triu_(j - i + 1)
    return torch.einsum("b h i j, b h j d -> b h i d", dots.masked_fill(mask, -torch.finfo(dots.dtype).max)
                        .softmax(dim=-1), v)


def band_made_in_place(q, k, v):
    keep = torch.ones(N, N, dtype=torch.bool).tril_(0).triu_(-2)  # keys i - 2 .. i
    return ((q @ k.transpose(-2, -1) * 0.25).masked_fill(~keep, float("-inf"))).softmax(-1) @ v


@pytest.mark.parametrize("fn", [causal_made_in_place_after_the_scores, band_made_in_place], ids=["triu_", "tril_ triu_"])
def test_a_mask_made_in_place_from_a_factory_is_structure(fn):
    # a fresh tensor updated in place is its functional op (patterns/functionalize.py): the mask is proven as the
    # out-of-place triu / tril would be
    res = check(fn, qkv(), rewritten=1)
    assert res.rewritten[0].mask.startswith("causal" if fn is causal_made_in_place_after_the_scores else "window"), \
        res.rewritten[0].mask


def test_in_place_update_of_a_strided_bias_before_the_site_reads_it_is_rewritten():
    # written after Q·Kᵀ but before the add reads it (through a view): eager's add and the op, which runs where
    # P·V did, read the same written values, with and without gradients
    res = check(sliced_bias_then_viewed, _bias_args(), rewritten=1)
    assert res.rewritten[0].mask == "bias"
    keep = _bias_args()[-1]
    check(sliced_bias_then_viewed, qkv(grad=False) + [rand(N + 1, D, seed=7), keep], rewritten=1)


def _index_table():
    """Data2VecVision's relative-position index, shrunk: slice writes on integer tensors made in the graph."""
    c = torch.arange(N)
    rel = (c[:, None, None] - c[None, :, None]).expand(N, N, 2).contiguous()
    rel[:, :, 0] += N - 1  # operator.iadd on a view, then setitem
    idx = torch.zeros(N, N, dtype=torch.long)
    idx[1:, 1:] = rel[1:, 1:, 0]  # in [0, 2N - 2]
    idx[0, :] = 2 * N - 1
    return idx


def index_table_built_after_the_scores(q, k, v, table):
    s = q @ k.transpose(-1, -2) * 0.25
    return torch.softmax(s + table[_index_table()].permute(2, 0, 1), dim=-1) @ v


# Q, K or V copied (clone, .contiguous() of a transpose, a cast) and the copy written in place, as partial rotary
# embeddings written by slice assignment do: the op must read the written copy, never the copy's source.
def rotary_written_into_a_clone_of_k(q, k, v):
    q = q * 0.5  # the site's first read comes before the write
    k = k.clone()
    k[..., :2] = k[..., :2].flip(-1) * torch.tensor([-1.0, 1.0])
    return torch.softmax(q @ k.mT, -1) @ v


def clone_of_v_written_after_the_scores(q, k, v):
    s = q @ k.mT * 0.5
    v = v.clone()
    v[:, :, 0] = 0
    return torch.softmax(s, -1) @ v


def clone_of_q_written_before_the_scores(q, k, v):
    k = k * 0.5
    q = q.clone()
    q[..., 0].zero_()
    return torch.softmax(q @ k.mT, -1) @ v


def contiguous_copy_of_k_written(q, k, v):
    kt = k.transpose(1, 2).contiguous()  # a copy: the transpose is not contiguous
    kt[:, 0] = 0
    return torch.softmax(q @ kt.transpose(1, 2).mT * 0.25, -1) @ v


@pytest.mark.parametrize("fn", [rotary_written_into_a_clone_of_k, clone_of_v_written_after_the_scores,
                                clone_of_q_written_before_the_scores, contiguous_copy_of_k_written],
                         ids=lambda f: f.__name__)
@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no_grad"])
def test_a_written_copy_of_an_input_is_what_the_site_reads(fn, grad):
    res = check(fn, qkv(grad=grad))
    assert res.reports, "no site found"
    if not (grad and fn is contiguous_copy_of_k_written):  # (saved for the backward, its `.contiguous()` may
        assert len(res.rewritten) == 1, reasons(res)          # alias the input k, which is written: refused)


def _repeat_kv(t, g):
    b, h, n, d = t.shape
    return t[:, :, None].expand(b, h, g, n, d).reshape(b, h * g, n, d)


def sdpa_gqa_source_written_after_the_repeat(q, k, v):
    v = v * 1.0
    vr = _repeat_kv(v, 2)
    v.mul_(2)  # the repeated copy keeps the old values
    return F.scaled_dot_product_attention(q, _repeat_kv(k, 2), vr)


def sdpa_gqa_repeat_interleave_source_written(q, k, v):
    k = k * 1.0
    kr = k.repeat_interleave(2, 1)
    k.mul_(2)
    return F.scaled_dot_product_attention(q, kr, v.repeat_interleave(2, 1))


def sdpa_gqa_repeated_copy_written(q, k, v):
    vr = _repeat_kv(v, 2)
    vr[:, 1] = 0  # into the copy: the source does not see it
    return F.scaled_dot_product_attention(q, _repeat_kv(k, 2), vr)


def mask_cloned_then_its_source_written(q, k, v):
    m = torch.zeros(N, N)
    m[:, N - 2:] = -math.inf
    m2 = m.clone()
    m.zero_()  # the clone keeps the padding
    return torch.softmax(q @ k.mT * 0.25 + m2, -1) @ v + m.sum()


def bool_mask_cloned_then_its_source_written(q, k, v):
    keep = torch.ones(N, N, dtype=torch.bool).tril()
    keep2 = keep.clone()
    keep.fill_(True)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=keep2)


@pytest.mark.parametrize("fn", [sdpa_gqa_source_written_after_the_repeat, sdpa_gqa_repeat_interleave_source_written,
                                sdpa_gqa_repeated_copy_written, mask_cloned_then_its_source_written,
                                bool_mask_cloned_then_its_source_written], ids=lambda f: f.__name__)
def test_a_copy_parted_from_its_source_by_a_write_is_read_as_the_copy(fn):
    # The repeat of K / V (a copy) and a cloned mask hold their values from where they were made: the rewrite
    # reads the copy, not its source (the GQA repeat was removed and the source read; the mask's structure was read
    # from its source, written since). Without gradients: eager's own backward raises on some of these writes.
    gqa = fn.__name__.startswith("sdpa_gqa")
    q = rand(B, 4, N, D, seed=1)
    kv = [rand(B, 2 if gqa else 4, N, D, seed=s) for s in (2, 3)]
    check(fn, [q] + kv, grad=False)


def copy_of_k_written_between_the_scores_and_pv(q, k, v):
    k = k.clone()
    s = q @ k.mT * 0.5
    k[..., 0] = 0  # after Q·Kᵀ read k: the op, where P·V runs, would read the new values
    return torch.softmax(s, -1) @ (v + k)


def test_a_copy_written_after_the_scores_read_it_is_refused():
    res = check(copy_of_k_written_between_the_scores_and_pv, qkv(grad=False), rewritten=0)
    assert "modified in place between the scores and the P·V product" in reasons(res)


def bias_written_after_it_was_added(q, k, v):
    s = q @ k.transpose(-1, -2) * 0.25
    bias = torch.zeros(N, N)
    bias[0, 1] = -1.0
    s = s + bias
    bias[2, 2] = -5.0  # eager added the bias before this write
    return torch.softmax(s, -1) @ v


def mask_written_after_the_fill(q, k, v):
    s = q @ k.transpose(-1, -2) * 0.25
    masked = torch.zeros(N, N, dtype=torch.bool)
    masked[:, N - 2:] = True
    s = s.masked_fill(masked, -math.inf)
    masked[3, :] = True  # eager filled before this write
    return torch.softmax(s, -1) @ v


def scale_written_after_the_product(q, k, v):
    s = q @ k.transpose(-1, -2)
    scale = torch.full((H, 1, 1), 0.25)
    s = s * scale
    scale.fill_(2.0)  # eager scaled the scores before this write
    return torch.softmax(s, -1) @ v


def test_memory_written_while_the_site_runs_and_never_read_by_it():
    res = check(index_table_built_after_the_scores, qkv() + [rand(2 * N, H, seed=3, requires_grad=True)], rewritten=1)
    assert res.rewritten[0].mask == "bias"


@pytest.mark.parametrize("fn", [bias_written_after_it_was_added, mask_written_after_the_fill,
                                scale_written_after_the_product], ids=lambda f: f.__name__)
def test_memory_the_site_reads_written_while_it_runs_is_refused(fn):
    res = check(fn, qkv(grad=False), rewritten=0)  # (eager's own backward refuses the last two: saved, then written)
    assert "modified in place" in reasons(res)


# ---------------------------------------------------------------------------- terms added to a reshaped view

def decomposed_bias_on_a_5d_view(q, k, v, rh, rw):
    s = (q * 0.35) @ k.transpose(-2, -1)  # [B, H, N, N], N = 2 × 3 positions
    s = (s.view(B * H, 2, 3, 2, 3) + rh[:, :, :, :, None] + rw[:, :, :, None, :]).view(B, H, N, N)  # VitDet
    return s.softmax(dim=-1) @ v


def terms_around_a_5d_view(q, k, v, rh, rw):
    s = (q * 0.35) @ k.transpose(-2, -1)
    s = (rh[:, :, :, :, None] + s.view(B * H, 2, 3, 2, 3) - 0.5 - rw[:, :, :, None, :]).view(B, H, N, N)
    return s.softmax(dim=-1) @ v


def view_read_twice(q, k, v, rh, rw):
    s = (q * 0.35) @ k.transpose(-2, -1)
    t = s.view(B * H, 2, 3, 2, 3) + rh[:, :, :, :, None]
    return (t.view(B, H, N, N).softmax(dim=-1) @ v) + t.sum()  # the 5-D sum has a second reader


def _rel():
    return [rand(B * H, 2, 3, 2, seed=11, requires_grad=True), rand(B * H, 2, 3, 3, seed=12, requires_grad=True)]


@pytest.mark.parametrize("fn", [decomposed_bias_on_a_5d_view, terms_around_a_5d_view], ids=lambda f: f.__name__)
def test_terms_added_to_a_reshaped_view_are_terms_of_the_scores(fn):
    res = check(fn, qkv() + _rel(), rewritten=1)
    assert res.rewritten[0].mask == "bias"


def reshaped_sum_outside_the_scores(q, k, v, b):
    o = torch.softmax(q @ k.transpose(-2, -1) * 0.25, -1) @ v
    return (o.reshape(B, H, N, 2, D // 2) + b).reshape(B, H, N, D)  # a per-half bias on the output


def test_a_reshaped_sum_outside_the_scores_is_not_edited():
    c = Compiled(reshaped_sum_outside_the_scores)
    args = qkv(grad=False) + [rand(2, 1, seed=4)]
    torch.testing.assert_close(c(*args), reshaped_sum_outside_the_scores(*args))
    assert len(c.reports) == 1 and c.reports[0].rewritten
    assert "expand" not in c.graphs[0].code  # the sum is left as written: its term is not materialized


def test_a_reshaped_view_read_elsewhere_is_left_alone():
    res = check(view_read_twice, qkv() + _rel(), rewritten=0)
    assert "Q·Kᵀ" in reasons(res)


# ----------------------------------------------------------------- terms added to a slice and written back
# MViTv2: a relative-position bias on the spatial block only; the class token's row and column keep their scores.
NS = 1 + 2 * 3  # a class token and a 2 × 3 grid


def slice_iadd(q, k, v, rel):
    s = (q * 0.35) @ k.transpose(-2, -1)
    s[:, :, 1:, 1:] += rel  # torchvision's MViT
    return s.softmax(dim=-1) @ v


def slice_written_back_through_a_view(q, k, v, rh, rw):
    s = (q * 0.35) @ k.transpose(-2, -1)
    s[:, :, 1:, 1:] = (s[:, :, 1:, 1:].view(B, H, 2, 3, 2, 3) + rh[..., None] + rw[..., None, :]
                       ).view(B, H, NS - 1, NS - 1)  # timm's MViTv2
    return s.softmax(dim=-1) @ v


def slice_minus_a_term(q, k, v, rel):
    s = q @ k.transpose(-2, -1) * 0.35
    s[:, 1:, 1:, :-1] = s[:, 1:, 1:, :-1] - rel[:, 1:]  # a block of the second head
    return torch.softmax(s, -1) @ v


def _grid(grad=True):
    return qkv(shape=(B, H, NS, D), grad=grad)


def _slice_rel(grad=True):
    return [rand(B, H, NS - 1, NS - 1, seed=13, requires_grad=grad)]


def _slice_rel_hw(grad=True):
    return [rand(B, H, 2, 3, 2, seed=14, requires_grad=grad), rand(B, H, 2, 3, 3, seed=15, requires_grad=grad)]


@pytest.mark.parametrize("fn,extra", [(slice_iadd, _slice_rel), (slice_written_back_through_a_view, _slice_rel_hw),
                                      (slice_minus_a_term, _slice_rel)], ids=["iadd", "view", "sub"])
@pytest.mark.parametrize("inner", ["aot_eager", "inductor"])
def test_terms_added_to_a_slice_of_the_scores_are_a_bias(fn, extra, inner):
    res = check(fn, _grid() + extra(), rewritten=1, inner=inner)
    assert res.rewritten[0].mask == "bias"


def slice_term_minus_scores(q, k, v, rel):
    s = (q * 0.35) @ k.transpose(-2, -1)
    s[:, :, 1:, 1:] = rel - s[:, :, 1:, 1:]  # the slice's sign flips: not a term of the scores
    return s.softmax(dim=-1) @ v


def slice_read_between(q, k, v, rel):
    s = (q * 0.35) @ k.transpose(-2, -1)
    part = s[:, :, 1:, 1:]
    part += rel
    peek = s.sum()  # the scores read after the slice was written in place, before the write back
    s[:, :, 1:, 1:] = part
    return (s.softmax(dim=-1) @ v) + peek


def slice_other_index(q, k, v, rel):
    s = (q * 0.35) @ k.transpose(-2, -1)
    s[:, :, 1:, :-1] = s[:, :, 1:, 1:] + rel  # written to another block than it was read from
    return s.softmax(dim=-1) @ v


def slice_promoting_term(q, k, v, rel):
    s = (q * 0.35) @ k.transpose(-2, -1)
    s[:, :, 1:, 1:] = s[:, :, 1:, 1:] + rel.double()  # the sum is float64, written back as float32
    return s.softmax(dim=-1) @ v


def slice_added_into_the_term(q, k, v, rel):
    s = (q * 0.35) @ k.transpose(-2, -1)
    r = rel[:, :, :, :]  # a view of the caller's tensor
    r += s[:, :, 1:, 1:]  # the term is written (the slice added into it), then written back as the slice
    s[:, :, 1:, 1:] = r
    return s.softmax(dim=-1) @ v + rel.mean()


@pytest.mark.parametrize("fn", [slice_term_minus_scores, slice_read_between, slice_other_index, slice_promoting_term,
                                slice_added_into_the_term], ids=lambda f: f.__name__)
def test_a_slice_update_that_is_not_a_term_of_the_scores_is_left_alone(fn):
    res = check(fn, _grid() + _slice_rel(grad=fn is not slice_added_into_the_term), rewritten=0)
    assert "modified in place" in reasons(res)


# ----------------------------------------------------- key blocks scored apart, normalised together
# PEGASUS-X: each block of queries attends to the global tokens and to its own block.
NB, BL, G = 3, 4, 2  # blocks, block length, global tokens


def global_local(q, kg, vg, kl, vl, m):  # q, kl, vl [B, H, NB·BL, D]; kg, vg [B, H, G, D]; m [B, NB, G + BL]
    qb, kb, vb = (t.view(B, H, NB, BL, D) for t in (q, kl, vl))
    s = torch.cat([torch.einsum("BHNKF,BHGF->BHNKG", qb, kg), torch.einsum("BHNKF,BHNXF->BHNKX", qb, kb)], dim=-1)
    p = F.softmax(s * D ** -0.5 + m[:, None, :, None, :], dim=-1)
    return torch.einsum("BHNKG,BHGF->BHNKF", p[:, :, :, :, :G], vg) + \
        torch.einsum("BHNKX,BHNXF->BHNKF", p[:, :, :, :, G:], vb)


def global_local_values_last(q, kg, vg, kl, vl, m):  # other letters, the values first, the sum the other way round
    qb, kb, vb = (t.view(B, H, NB, BL, D) for t in (q, kl, vl))
    s = torch.cat([torch.einsum("bhnid,bhjd->bhnij", qb, kg), torch.einsum("bhnid,bhnjd->bhnij", qb, kb)], -1)
    p = torch.softmax(s + m[:, None, :, None, :], -1)
    local = torch.einsum("bhnje,bhnij->bhnie", vb, p[..., G:])
    return local + torch.einsum("bhje,bhnij->bhnie", vg, p[:, :, :, :, :G])


def global_local_crossed(q, kg, vg, kl, vl, m):  # the slices applied to the other block's values
    qb, kb, vb = (t.view(B, H, NB, BL, D) for t in (q, kl, vl))
    s = torch.cat([torch.einsum("BHNKF,BHNXF->BHNKX", qb, kb), torch.einsum("BHNKF,BHNXF->BHNKX", qb, kb)], dim=-1)
    p = F.softmax(s + m[:, None, :, None, :].expand(B, 1, NB, 1, 2 * BL)[..., :2 * BL], dim=-1)
    return torch.einsum("BHNKX,BHNXF->BHNKF", p[..., :BL], vb.flip(-2)) + \
        torch.einsum("BHNKX,BHNXF->BHNKF", p[..., BL:], vb)


def _global_local_args(grad=True, width=G + BL):
    q, kl, vl = qkv(shape=(B, H, NB * BL, D), grad=grad)
    kg, vg = (rand(B, H, G, D, seed=20 + i, requires_grad=grad) for i in range(2))
    m = torch.zeros(B, NB, width)
    m[1, -1, -2:] = -math.inf  # padding in the last block of the second sequence
    return [q, kg, vg, kl, vl, m]


@pytest.mark.parametrize("fn", [global_local, global_local_values_last], ids=lambda f: f.__name__)
@pytest.mark.parametrize("inner", ["aot_eager", "inductor"])
def test_key_blocks_normalised_together_are_one_attention(fn, inner):
    check(fn, _global_local_args(), rewritten=1, inner=inner)


def test_probabilities_applied_to_other_values_than_their_keys_are_left_alone():
    res = check(global_local_crossed, _global_local_args(width=2 * BL), rewritten=0)
    assert "Q·Kᵀ" in reasons(res)


def global_local_capped_by_a_tensor(q, kg, vg, kl, vl, m, t):
    qb, kb, vb = (x.view(B, H, NB, BL, D) for x in (q, kl, vl))
    s = torch.cat([torch.einsum("BHNKF,BHGF->BHNKG", qb, kg), torch.einsum("BHNKF,BHNXF->BHNKX", qb, kb)], dim=-1)
    p = F.softmax(torch.tanh(s / t) * t, dim=-1)  # a soft cap by a tensor: not a softcap the op takes
    o = torch.einsum("BHNKG,BHGF->BHNKF", p[..., :G], vg) + torch.einsum("BHNKX,BHNXF->BHNKF", p[..., G:], vb)
    return o.reshape(B, H, NB * BL, D) + torch.softmax(q @ kl.transpose(-2, -1), -1) @ vl  # a site rewritten


def three_blocks_summed_right_first_capped(q, kg, vg, kl, vl, m, t):
    qb, kb, vb = (x.view(B, H, NB, BL, D) for x in (q, kl, vl))
    s = torch.cat([torch.einsum("BHNKF,BHGF->BHNKG", qb, kg), torch.einsum("BHNKF,BHNXF->BHNKX", qb, kb),
                   torch.einsum("BHNKF,BHNXF->BHNKX", qb, kb * 0.5)], dim=-1)
    p = F.softmax(torch.tanh(s / t) * t, dim=-1)
    local = torch.einsum("BHNKX,BHNXF->BHNKF", p[..., G:G + BL], vb)
    o = torch.einsum("BHNKG,BHGF->BHNKF", p[..., :G], vg) + (local + torch.einsum("BHNKX,BHNXF->BHNKF",
                                                                                    p[..., G + BL:], vb))
    return o, torch.softmax(q @ kl.transpose(-2, -1), -1) @ vl  # a site rewritten


def global_local_keys_written_between(q, kg, vg, kl, vl, m):
    qb, kb, vb = (t.view(B, H, NB, BL, D) for t in (q, kl, vl))
    a = torch.einsum("BHNKF,BHGF->BHNKG", qb, kg)
    kg.mul_(2)  # the global keys updated after their block was scored
    s = torch.cat([a, torch.einsum("BHNKF,BHNXF->BHNKX", qb, kb)], dim=-1)
    p = F.softmax(s * D ** -0.5 + m[:, None, :, None, :], dim=-1)
    return torch.einsum("BHNKG,BHGF->BHNKF", p[..., :G], vg) + torch.einsum("BHNKX,BHNXF->BHNKF", p[..., G:], vb)


def global_local_values_written_between(q, kg, vg, kl, vl, m):
    qb, kb, vb = (t.view(B, H, NB, BL, D) for t in (q, kl, vl))
    s = torch.cat([torch.einsum("BHNKF,BHGF->BHNKG", qb, kg), torch.einsum("BHNKF,BHNXF->BHNKX", qb, kb)], dim=-1)
    p = F.softmax(s * D ** -0.5 + m[:, None, :, None, :], dim=-1)
    first = torch.einsum("BHNKG,BHGF->BHNKF", p[..., :G], vg)
    vg.mul_(2)  # the global values updated after their product
    o = first + torch.einsum("BHNKX,BHNXF->BHNKF", p[..., G:], vb)
    return o.reshape(B, H, NB * BL, D) + torch.softmax(q @ kl.transpose(-2, -1), -1) @ vl  # a site rewritten


@pytest.mark.parametrize("fn", [global_local_keys_written_between, global_local_values_written_between],
                         ids=lambda f: f.__name__)
def test_key_blocks_with_a_write_before_their_concatenation_or_sum_are_left_alone(fn):
    # the edit would read the keys at the concatenation and the values at the sum, after the write
    args = _global_local_args()
    # eager's backward refuses a tensor its product saved and the program then wrote: those take no gradient
    frozen = ("q", "kg") if fn is global_local_keys_written_between else ("q", "kg", "vg", "kl")
    for i, name in enumerate(("q", "kg", "vg", "kl", "vl")):
        args[i].requires_grad_(name not in frozen)
    res = check(fn, args)
    assert [r.form for r in res.rewritten] == ([] if fn is global_local_keys_written_between else
                                               ["matmul-softmax-matmul"]), res.reports


def test_key_blocks_put_back_keep_the_sum_as_written():
    c = Compiled(three_blocks_summed_right_first_capped)
    args = _global_local_args(grad=False) + [rand(1, H, 1, 1, 1, seed=30)]
    got = c(*args)[0]
    assert [r.rewritten for r in c.reports] == [False, True]
    assert "expand" not in c.graphs[0].code and c.graphs[0].code.count("einsum(") == 6
    # the blocks' products summed a + (b + c) as written, not (a + b) + c: eager's own ops, bit for bit
    assert torch.equal(got, three_blocks_summed_right_first_capped(*args)[0])


def test_key_blocks_no_rewrite_takes_are_put_back_as_written():
    c = Compiled(global_local_capped_by_a_tensor)
    args = _global_local_args(grad=False) + [rand(1, H, 1, 1, 1, seed=30)]
    torch.testing.assert_close(c(*args), global_local_capped_by_a_tensor(*args))
    assert [r.rewritten for r in c.reports] == [False, True] and "tanh" in c.reports[0].reason
    code = c.graphs[0].code
    assert code.count("einsum(") == 4 and code.count("cat(") == 1 and "expand" not in code, code


# ------------------------------------------------- query rows folded for a batched product, split back

class FoldedRowsMQA(nn.Module):
    """Multi-query attention as GPTBigCode-era code wrote it for bmm: the heads folded into the query rows
    ([B, N·H, D]) against one key tensor stored transposed ([B, D, Nk]), the scores viewed to [B, N, H, Nk]
    for a bool mask, and the probabilities folded back for the product with V."""

    def __init__(self, heads=3, dim=8, beta=1):
        super().__init__()
        self.heads, self.dim, self.beta = heads, dim, beta
        self.c_attn = nn.Linear(heads * dim, heads * dim + 2 * dim)
        self.drop = nn.Dropout(0.0)

    def forward(self, x, keep):  # keep: [B, N, 1, Nk] bool, True = attend
        b, n, _ = x.shape
        h, d = self.heads, self.dim
        q, kv = self.c_attn(x).split((h * d, 2 * d), dim=2)
        k, v = kv.split((d, d), dim=-1)
        k = k.transpose(1, 2)  # [B, D, Nk]
        w = torch.empty(b, n * h, n, dtype=x.dtype, device=x.device)
        w = torch.zeros_like(w) if self.beta else w  # beta=1 adds zeros; beta=0 ignores the empty input
        w = torch.baddbmm(w, q.reshape(b, n * h, d), k, beta=self.beta, alpha=d ** -0.5).view(b, n, h, n)
        w = torch.where(keep, w, torch.full([], torch.finfo(w.dtype).min, dtype=w.dtype))
        w = self.drop(torch.softmax(w, dim=-1))
        return torch.bmm(w.view(b, n * h, n), v).view(b, n, h * d)


def folded_heads_rows(q, k, v):  # q [B, H, N, D], k and v [B, N, D]: rows (H, N), bmm then a scale
    s = torch.bmm(q.reshape(B, H * N, D), k.transpose(1, 2)) * D ** -0.5
    s = s.view(B, H, N, N).masked_fill(causal_bool(), -math.inf)
    return torch.bmm(s.softmax(-1).view(B, H * N, N), v).view(B, H, N, D)


def folded_rows_broadcast_pv(q, k, v):  # split scores, P·V already a broadcast product
    s = torch.bmm(q.reshape(B, H * N, D), k.transpose(1, 2)).view(B, H, N, N) / math.sqrt(D)
    return s.masked_fill(causal_bool(), -math.inf).softmax(-1) @ v.unsqueeze(1)


def _mqa_args():
    x = rand(2, 5, 24, seed=3, requires_grad=True)
    keep = torch.ones(5, 5, dtype=torch.bool).tril().expand(2, 5, 5).clone()
    keep[1, :, :2] = False  # padding on the left of the second sequence...
    keep[1, :2, 0] = True  # ...whose first rows still admit a key
    return [x, keep[:, :, None, :]]


@pytest.mark.parametrize("beta", [1, 0], ids=["zeros_added", "empty_ignored"])
def test_heads_folded_into_the_query_rows_are_split_back(beta):
    res = check(FoldedRowsMQA(beta=beta), _mqa_args(), rewritten=1)
    assert res.rewritten[0].mask == "bool-mask"


@pytest.mark.parametrize("fn", [folded_heads_rows, folded_rows_broadcast_pv], ids=lambda f: f.__name__)
def test_split_rows_of_a_bmm_read_as_a_4d_product(fn):
    q = rand(B, H, N, D, seed=0, requires_grad=True)
    k, v = (rand(B, N, D, seed=i, requires_grad=True) for i in (1, 2))
    res = check(fn, [q, k, v], rewritten=1)
    assert "causal" in res.rewritten[0].mask


def test_heads_folded_into_the_query_rows_through_inductor():
    check(FoldedRowsMQA(), _mqa_args(), inner="inductor", rewritten=1)


def test_heads_folded_into_the_query_rows_dynamic():
    m = FoldedRowsMQA()
    c = Compiled(m, inner="aot_eager", dynamic=True)
    compiles = []
    for n in (5, 7, 4):
        x = rand(2, n, 24, seed=n)
        keep = torch.ones(n, n, dtype=torch.bool).tril().expand(2, n, n)[:, :, None, :]
        torch.testing.assert_close(c(x, keep), m(x, keep))
        compiles.append(len(c.reports))
    # one rewritten compile serves every length (Dynamo may compile the first call's frame twice: it restarts
    # once it has to specialize the dropout's p, which dynamic=True first made an input)
    assert compiles[0] >= 1 and compiles[1:] == [compiles[0]] * 2, compiles
    assert c.rewritten and not c.missed, [r.reason for r in c.missed]


def folded_rows_beside_a_site(q, k, v):
    """Two sites: a plain one (rewritten) and a folded multi-query one whose probabilities are also returned
    (refused): the folded one is handed on as the 3-D products it was written with."""
    plain = torch.softmax(q @ q.transpose(-2, -1) * 0.25, -1) @ q
    s = torch.bmm(q.reshape(B, H * N, D), k.transpose(1, 2)) * 0.25
    p = s.view(B, H, N, N).softmax(-1)
    return plain, torch.bmm(p.view(B, H * N, N), v).view(B, H, N, D), p


def test_split_rows_of_a_refused_site_are_put_back():
    q = rand(B, H, N, D, seed=0)
    k, v = (rand(B, N, D, seed=i) for i in (1, 2))
    c = Compiled(folded_rows_beside_a_site)
    got, want = c(q, k, v), folded_rows_beside_a_site(q, k, v)
    assert [r.rewritten for r in c.reports] == [True, False], [r.reason for r in c.reports]
    for g, w in zip(got[1:], want[1:]):
        torch.testing.assert_close(g, w, atol=0, rtol=0)  # the same ops as traced: the same bits
    code = c.graphs[0].code
    assert "unsqueeze" not in code and code.count("torch.matmul(") == 2, code  # 3-D products: K and V not broadcast


def test_folded_tokens_as_heads_swap_to_queries():
    """N = 20 tokens folded ahead of H = 18 heads: the split scores are [B, N, H, Nk], so the op would see 20 heads
    of 18 queries each over one K/V head. With one K/V head the two axes may trade places, and the op runs 18
    heads of 20 queries (the mask transposed with them)."""
    m = FoldedRowsMQA(heads=18, dim=8)
    x = rand(2, 20, 144, seed=3, requires_grad=True)
    keep = torch.ones(20, 20, dtype=torch.bool).tril().expand(2, 20, 20).clone()
    keep[1, :, :3] = False
    keep[1, :3, 0] = True
    res = check(m, [x, keep[:, :, None, :]], rewritten=1)
    call = res.rewritten[0].call
    assert tuple(call.args[0].meta["example_value"].shape) == (2, 18, 20, 8)  # heads 18, queries 20
    assert tuple(call.args[8].meta["example_value"].shape) == (2, 1, 20, 20)  # the mask, transposed with them


@pytest.mark.parametrize("tokens,heads,swapped", [(20, 8, True), (12, 8, False)])
def test_folded_few_heads_swap_past_the_decode_tile(tokens, heads, swapped):
    """Few heads (8, the op's queries) folded behind the tokens (its heads): 20 x 8 = 160 rows exceed what the
    decode kernel packs over one K/V head, so the axes trade places (8 heads of 20 queries); 12 x 8 = 96 rows
    fit that tile and the decode-shaped site keeps its axes."""
    m = FoldedRowsMQA(heads=heads, dim=8)
    x = rand(2, tokens, heads * 8, seed=5, requires_grad=True)
    keep = torch.ones(tokens, tokens, dtype=torch.bool).tril().expand(2, tokens, tokens).clone()
    keep[0, :, :2] = False
    keep[0, :2, 0] = True
    res = check(m, [x, keep[:, :, None, :]], rewritten=1)
    q = res.rewritten[0].call.args[0].meta["example_value"]
    assert tuple(q.shape) == ((2, heads, tokens, 8) if swapped else (2, tokens, heads, 8))


def test_swap_threshold_is_the_decode_kernels_tile():
    from fa_compile.kernels.decode import MAX_ROWS
    from fa_compile.patterns.emit import DECODE_PACKED_ROWS

    assert DECODE_PACKED_ROWS == MAX_ROWS


def split_rows_not_softmaxed(q, k, v):  # the same split feeds a sum, not a softmax: not attention
    s = torch.bmm(q.reshape(B, H * N, D), k.transpose(1, 2)).view(B, H, N, N)
    return s.amax(-1, keepdim=True) * q


def split_rows_read_twice(q, k, v):  # the folded scores are also read elsewhere
    s3 = torch.bmm(q.reshape(B, H * N, D), k.transpose(1, 2)) * 0.25
    o = torch.bmm(s3.view(B, H, N, N).softmax(-1).view(B, H * N, N), v)
    return o.view(B, H, N, D) + s3.sum()


def added_input_not_zero(q, k, v):  # baddbmm adds a real bias before the view: not a plain product
    s = torch.baddbmm(torch.ones(B, H * N, N), q.reshape(B, H * N, D), k.transpose(1, 2), alpha=0.25)
    return torch.bmm(s.view(B, H, N, N).softmax(-1).view(B, H * N, N), v)


@pytest.mark.parametrize("fn", [split_rows_not_softmaxed, split_rows_read_twice, added_input_not_zero],
                         ids=lambda f: f.__name__)
def test_split_rows_left_alone_where_not_exact_or_not_attention(fn):
    q = rand(B, H, N, D, seed=0)
    k, v = (rand(B, N, D, seed=i) for i in (1, 2))
    c = Compiled(fn)
    torch.testing.assert_close(c(q, k, v), fn(q, k, v), atol=0, rtol=0)  # the graph as traced: the same bits
    assert "matmul" not in c.graphs[0].code, c.graphs[0].code


# ------------------------------------------------------------- P·V with the operands swapped: v_t @ pᵀ

class ChannelsFirstAttention(nn.Module):
    """Keys and values kept channels first ([B, H, D, N], as 1-D convolutional models hold them): scores q @ k,
    and the probabilities applied from the right, v @ pᵀ -> [B, H, D, Nq]."""

    def __init__(self, c=16, heads=2):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Conv1d(c, 3 * c, 1)

    def forward(self, x, keep):  # x [B, C, N], keep [B, N] bool
        b, c, n = x.shape
        q, k, v = self.qkv(x).chunk(3, 1)
        q = q.view(b, self.heads, c // self.heads, n).transpose(2, 3)
        k, v = (t.view(b, self.heads, c // self.heads, n) for t in (k, v))
        s = torch.matmul(q, k) / math.sqrt(c // self.heads)
        s = s + (1.0 - keep[:, None, None, :].float()) * -10000.0
        p = F.dropout(F.softmax(s, dim=-1), 0.0, self.training)
        return torch.matmul(v, p.transpose(-1, -2)).reshape(b, c, n)


def _channels_first_args():
    keep = torch.ones(2, 6, dtype=torch.bool)
    keep[1, 4:] = False
    return [rand(2, 16, 6, seed=7, requires_grad=True), keep]


@pytest.mark.parametrize("inner", ["aot_eager", "inductor"])
def test_probabilities_applied_from_the_right_read_as_p_v(inner):
    res = check(ChannelsFirstAttention(), _channels_first_args(), inner=inner, rewritten=1)
    assert res.rewritten[0].mask != "none"


def vt_p_transposed_on_other_axes(q, k, v):  # p.transpose(0, 1) swaps batch and heads: not P·V
    p = torch.softmax(q @ k.transpose(-2, -1) * 0.25, -1)  # [B, H, N, N], B == H
    return torch.matmul(v.transpose(-1, -2), p.transpose(0, 1))


def test_a_transpose_of_other_axes_is_left_alone():
    q, k, v = qkv(grad=False)
    c = Compiled(vt_p_transposed_on_other_axes)
    torch.testing.assert_close(c(q, k, v), vt_p_transposed_on_other_axes(q, k, v), atol=0, rtol=0)
    assert not c.rewritten and c.graphs[0].code.count(".transpose(") == 3, c.graphs[0].code  # as traced


def vt_p_beside_a_site(q, k, v):
    """Two sites: a plain one (rewritten) and v @ pᵀ whose probabilities are also returned (refused)."""
    plain = torch.softmax(q @ q.transpose(-2, -1) * 0.25, -1) @ q
    p = torch.softmax(q @ k.transpose(-2, -1) * 0.25, -1)
    return plain, torch.matmul(v.transpose(-1, -2), p.transpose(-1, -2)), p


def test_swapped_p_v_of_a_refused_site_is_put_back():
    q, k, v = qkv(grad=False)
    c = Compiled(vt_p_beside_a_site)
    got, want = c(q, k, v), vt_p_beside_a_site(q, k, v)
    assert [r.rewritten for r in c.reports] == [True, False], [r.reason for r in c.reports]
    for g, w in zip(got[1:], want[1:]):
        torch.testing.assert_close(g, w, atol=0, rtol=0)  # the product as written: the same bits
    assert "matmul(transpose" in c.graphs[0].code.replace("torch.", "").replace(" ", ""), c.graphs[0].code


# ------------------------------------------------------- key-major scores: k @ qᵀ, softmax over dim -2

def key_major(q, k, v):
    sT = torch.matmul(k, q.transpose(-1, -2)) / math.sqrt(D)  # [B, H, Nk, Nq]
    sT = sT.masked_fill(causal_bool().transpose(0, 1), -math.inf)  # key j > query i masked
    pT = torch.softmax(sT.float(), dim=-2).to(q.dtype)
    return torch.matmul(pT.transpose(-1, -2), v)


def key_major_bmm_padding(q, k, v, keep):  # 3-D, a key-padding column vector, P·V as v_t @ pT
    b = q.shape[0]
    q3, k3, v3 = (t.reshape(b * H, N, D) for t in (q, k, v))
    sT = torch.bmm(k3, q3.transpose(1, 2)) * D ** -0.5 + (~keep).repeat_interleave(H, 0)[:, :, None] * -1e9
    pT = sT.softmax(dim=1)
    return torch.bmm(v3.transpose(1, 2), pT).transpose(1, 2).reshape(b, H, N, D)


def test_key_major_scores_read_query_major():
    res = check(key_major, qkv(), rewritten=1)
    assert res.rewritten[0].mask == "causal"


def test_key_major_scores_with_a_padding_column_and_v_applied_from_the_left():
    keep = torch.ones(B, N, dtype=torch.bool)
    keep[1, 4:] = False
    res = check(key_major_bmm_padding, qkv() + [keep], rewritten=1)
    assert res.rewritten[0].mask != "none"


def key_major_read_twice(q, k, v):  # the key-major scores are also returned: the site stays as written
    sT = torch.matmul(k, q.transpose(-1, -2)) * 0.25
    return torch.matmul(torch.softmax(sT, dim=-2).transpose(-1, -2), v), sT


def test_key_major_scores_read_elsewhere_are_left_alone():
    res = check(key_major_read_twice, qkv(), rewritten=0)
    assert "softmax is over dim 2" in reasons(res)


# ---------------------------------------------- the edits above against writes, layouts and chained sites

def split_rows_q_written_after_the_scores(q, k, v):
    b, h, n, d = q.shape
    s3 = torch.bmm(q.reshape(b, h * n, d), k.transpose(1, 2))
    q.mul_(2.0)  # eager's scores read q before this write
    s = s3.view(b, h, n, n) * 0.35
    return torch.bmm(s.softmax(-1).view(b, h * n, n), v).view(b, h, n, d)


def split_rows_zeros_written_before_the_product(q, k, v):
    b, h, n, d = q.shape
    bias = torch.zeros(b, h * n, n)
    bias[:, :, 4:] = float("-inf")  # the added input is no longer zeros
    s = torch.baddbmm(bias, q.reshape(b, h * n, d), k.transpose(1, 2), alpha=d ** -0.5).view(b, h, n, n)
    return torch.bmm(s.softmax(-1).view(b, h * n, n), v).view(b, h, n, d)


def key_major_bias_written_after_it_was_added(q, k, v, bias):
    sT = torch.matmul(k, q.transpose(-1, -2)) * 0.35 + bias
    bias.zero_()
    return torch.matmul(torch.softmax(sT, dim=-2).transpose(-1, -2), v)


def key_major_q_written_after_the_scores(q, k, v, bias):
    sT = torch.matmul(k, q.transpose(-1, -2)) * 0.35
    q.mul_(2.0)
    return torch.matmul(torch.softmax(sT + bias, dim=-2).transpose(-1, -2), v)


@pytest.mark.parametrize("fn", [split_rows_q_written_after_the_scores, split_rows_zeros_written_before_the_product],
                         ids=lambda f: f.__name__)
def test_split_rows_read_their_operands_when_eager_did(fn):
    q = rand(B, H, N, D, seed=0)
    k, v = (rand(B, N, D, seed=i) for i in (1, 2))
    check(fn, [q, k, v], grad=False)  # rewritten or not: eager's values, q's write included


@pytest.mark.parametrize("fn", [key_major_bias_written_after_it_was_added, key_major_q_written_after_the_scores],
                         ids=lambda f: f.__name__)
def test_key_major_steps_read_their_operands_when_eager_did(fn):
    check(fn, qkv(grad=False) + [rand(N, N, seed=9)], grad=False)


def swapped_p_v_viewed(q, k, v):  # k, v channels first: the written product is contiguous, so .view is valid
    p = torch.softmax(torch.matmul(q, k) / math.sqrt(D), -1)
    return torch.matmul(v, p.transpose(-1, -2)).view(B, H * D, N)


def key_major_softmax_not_attention(q, k, v):  # beside a rewritten site: its probabilities are viewed
    o = torch.softmax(q @ k.transpose(-2, -1) * 0.25, -1) @ v
    w = torch.softmax(torch.matmul(k, q.transpose(-1, -2)), dim=-2)
    return o, (w * 2).view(-1)


def test_edited_products_keep_the_written_layout():
    q, k, v = rand(B, H, N, D, seed=0), rand(B, H, D, N, seed=1), rand(B, H, D, N, seed=2)
    check(swapped_p_v_viewed, [q, k, v], rewritten=1, grad=False)
    res = check(key_major_softmax_not_attention, qkv(grad=False), grad=False)
    assert [r.rewritten for r in res.reports] == [True, False], [r.reason for r in res.reports]


def channels_first_chain(q, k, v):  # one site's output is the channels-first K of the next
    p = torch.softmax(torch.matmul(q, k) * 0.3, -1)
    y = torch.matmul(v, p.transpose(-1, -2))
    p2 = torch.softmax(torch.matmul(q, y) * 0.3, -1)
    return torch.matmul(v, p2.transpose(-1, -2)).reshape(q.shape[0], -1)


def test_a_site_output_is_not_taken_for_probabilities():
    q, k, v = rand(B, H, N, D, seed=0), rand(B, H, D, N, seed=1), rand(B, H, D, N, seed=2)
    check(channels_first_chain, [q, k, v], rewritten=2, grad=False)


def key_major_probabilities_written(q, k, v):  # beside a rewritten site: the write must reach the product
    o = torch.softmax(q @ k.transpose(-1, -2) * 0.3, -1) @ v
    pT = torch.softmax(torch.matmul(k, q.transpose(-1, -2)) * 0.35, dim=-2)
    pT[:, :, 0] = 0.0  # key 0 gets no weight
    return o, torch.matmul(pT.transpose(-1, -2), v)


def split_rows_zeros_out_alias(q, k, v, buf):  # zeros(out=buf) is buf, written through buf before the product
    b, h, n, d = q.shape
    bias = torch.zeros(b, h * n, n, out=buf)
    buf[:, :, 4:] = float("-inf")
    s = torch.baddbmm(bias, q.reshape(b, h * n, d), k.transpose(1, 2), alpha=d ** -0.5).view(b, h, n, n)
    return torch.bmm(s.softmax(-1).view(b, h * n, n), v).view(b, h, n, d)


def key_major_dense_transpose(q, k, v):
    pT = torch.softmax(torch.matmul(k, q.transpose(-1, -2)) * 0.35, dim=-2)
    return pT.transpose(-1, -2).contiguous() @ v


def test_writes_into_edited_tensors_are_kept():
    check(key_major_probabilities_written, qkv(grad=False), grad=False)
    q = rand(B, H, N, D, seed=0)
    k, v = (rand(B, N, D, seed=i) for i in (1, 2))
    check(split_rows_zeros_out_alias, [q, k, v, torch.empty(B, H * N, N)], grad=False)


def test_key_major_probabilities_copied_before_p_v():
    check(key_major_dense_transpose, qkv(), rewritten=1)


def no_grad_key_major(q, k, v):
    with torch.no_grad():
        return key_major(q, k, v)


def no_grad_channels_first(q, k, v):
    with torch.no_grad():
        return swapped_p_v_viewed(q, k, v)


def test_edits_inside_no_grad_regions():
    res = check(no_grad_key_major, qkv(), rewritten=1)  # inputs need grad; the region computes none
    assert res.rewritten[0].mask == "causal"
    q, k, v = rand(B, H, N, D, seed=0, requires_grad=True), rand(B, H, D, N, seed=1), rand(B, H, D, N, seed=2)
    check(no_grad_channels_first, [q, k, v], rewritten=1)


def whole_rows_finite_fill(q, k, v, m):  # a mask constant along the keys, filled with a finite value
    return torch.softmax((q @ k.transpose(-1, -2) * 0.35).masked_fill(m[:, None], -1e9), -1) @ v


def test_whole_query_rows_under_a_finite_fill():
    m = torch.zeros(N, dtype=torch.bool)
    m[3] = True
    check(whole_rows_finite_fill, qkv() + [m], rewritten=1)


# ---------------------------------------------------------------------------- 5-D scores with a 5-D mask

def five_d_additive(q, k, v, mask):  # ProphetNet's n-gram stream, LongT5's blocks
    s = torch.einsum("bnhtc,bnhsc->bnhts", q, k) * 0.25 + mask
    return torch.einsum("bnhts,bnhsc->bnhtc", torch.softmax(s, dim=-1), v)


def five_d_filled(q, k, v, mask):
    s = torch.einsum("bnhtc,bnhsc->bnhts", q, k) * 0.25
    s = s.masked_fill(mask, -math.inf)
    return torch.einsum("bnhts,bnhsc->bnhtc", torch.softmax(s, dim=-1), v)


def five_d_causal_and_bias(q, k, v, mask):
    s = torch.einsum("bnhtc,bnhsc->bnhts", q, k) * 0.25 + mask
    s = s.masked_fill(torch.ones(N, N, dtype=torch.bool).triu(1), -math.inf)
    return torch.einsum("bnhts,bnhsc->bnhtc", torch.softmax(s, dim=-1), v)


def _five_d(mask_shape, kind):
    q, k, v = (rand(B, 3, H, N, D, seed=i, requires_grad=True) for i in range(3))
    if kind == "bool":
        mask = rand(*mask_shape, seed=5) > 0.5
        mask[..., 0] = False  # every row admits key 0 (a row that admits none is NaN, its gradients too)
    else:
        mask = rand(*mask_shape, seed=5, requires_grad=True)
    return [q, k, v, mask]


@pytest.mark.parametrize("mask_shape", [(B, 3, H, N, N), (B, 3, 1, N, N), (1, 3, H, N, N), (B, 1, 1, 1, N)],
                         ids=["full", "heads_broadcast", "batch_broadcast", "key_vector"])
@pytest.mark.parametrize("fn,kind", [(five_d_additive, "float"), (five_d_filled, "bool"),
                                     (five_d_causal_and_bias, "float")], ids=["additive", "filled", "causal_bias"])
def test_five_d_scores_with_a_mask_of_their_rank(fn, kind, mask_shape):
    res = check(fn, _five_d(mask_shape, kind), rewritten=1)
    assert res.rewritten[0].mask != "none"


def test_five_d_scores_with_a_mask_through_inductor():
    res = check(five_d_causal_and_bias, _five_d((B, 3, 1, N, N), "float"), inner="inductor", rewritten=1)
    assert "causal" in res.rewritten[0].mask


def test_five_d_scores_keep_eager_nan_rows():
    q, k, v, mask = _five_d((B, 3, H, N, N), "bool")
    mask[1, :, :, 2, :] = True  # row 2 of the second batch admits no key: NaN there, as in eager
    res = check(five_d_filled, [t.detach() for t in (q, k, v)] + [mask], rewritten=1, grad=False)
    assert res.rewritten[0].mask != "none"


# ---------------------------------------------------------------------------- masks from the scores' shape

def ones_like_tril(q, k, v):
    s = q @ k.transpose(-2, -1) * 0.25
    mask = torch.ones_like(s).tril() == 0
    return torch.softmax(s.masked_fill(mask, -math.inf), -1) @ v


def full_like_triu(q, k, v):
    s = q @ k.transpose(-2, -1) * 0.25
    return torch.softmax(s + torch.full_like(s, -math.inf).triu(1), -1) @ v


def new_ones_sizes(q, k, v):
    s = q @ k.transpose(-2, -1) * 0.25
    keep = s.new_ones(s.size(-2), s.size(-1), dtype=torch.bool).tril()
    return torch.softmax(torch.where(keep, s, torch.finfo(s.dtype).min), -1) @ v


@pytest.mark.parametrize("fn", [ones_like_tril, full_like_triu, new_ones_sizes], ids=lambda f: f.__name__)
def test_mask_built_from_the_scores_shape(fn):
    res = check(fn, qkv(), rewritten=1)
    assert res.rewritten[0].mask == "causal"


def test_mask_built_from_the_scores_shape_dynamic():
    c = Compiled(ones_like_tril, dynamic=True)
    for n in (6, 9):
        args = qkv(shape=(B, H, n, D), grad=False, seed=n)
        torch.testing.assert_close(c(*args), ones_like_tril(*args), equal_nan=True)
    assert len(c.graphs) == 1 and len(c.rewritten) == 1 and c.rewritten[0].mask == "causal"


def mask_from_the_scores_values(q, k, v):
    s = q @ k.transpose(-2, -1) * 0.25
    return torch.softmax(s.masked_fill(torch.ones_like(s) * s < -1.0, -math.inf), -1) @ v


def test_mask_from_the_scores_values_is_refused():
    res = check(mask_from_the_scores_values, qkv(), rewritten=0)
    assert "also used outside the attention" in reasons(res)


# --------------------------------------------------------------------------------------------- F.linear

def linear_qk(q, k, v):
    return torch.softmax(F.linear(q, k) * 0.25, -1) @ v


def linear_qk_bias(q, k, v, b):
    return torch.softmax(F.linear(q, k, b) * 0.25, -1) @ v


def test_linear_is_q_kt():
    q = rand(B, H, N, D, requires_grad=True)
    k, v = rand(5, D, seed=1, requires_grad=True), rand(5, D, seed=2, requires_grad=True)
    res = check(linear_qk, [q, k, v], rewritten=1)
    assert res.rewritten[0].k_shape[2:] == (5, D)


def test_linear_bias_is_an_additive_mask_of_the_keys():
    q = rand(B, H, N, D, requires_grad=True)
    k, v = rand(5, D, seed=1, requires_grad=True), rand(5, D, seed=2, requires_grad=True)
    res = check(linear_qk_bias, [q, k, v, rand(5, seed=3, requires_grad=True)], rewritten=1)
    assert res.rewritten[0].mask == "bias"


# --------------------------------------------------------------------------------- exp of the log-softmax

LOG_SOFTMAX_FORMS = {
    "F.log_softmax.exp": lambda q, k, v: F.log_softmax(q @ k.transpose(-2, -1) * 0.25, dim=-1).exp() @ v,
    "torch.exp(Tensor.log_softmax)": lambda q, k, v: torch.exp((q @ k.transpose(-2, -1) * 0.25).log_softmax(-1)) @ v,
    "torch.log_softmax_dtype": lambda q, k, v: torch.log_softmax(q @ k.transpose(-2, -1), -1,
                                                                 dtype=torch.float32).exp().to(q.dtype) @ v,
}


@pytest.mark.parametrize("form", list(LOG_SOFTMAX_FORMS))
def test_exp_of_log_softmax_is_softmax(form):
    check(LOG_SOFTMAX_FORMS[form], qkv(), rewritten=1)


def log_probs_also_used(q, k, v):
    lp = F.log_softmax(q @ k.transpose(-2, -1) * 0.25, -1)
    return lp.exp() @ v + lp.mean(-1, keepdim=True)


def test_log_probabilities_read_elsewhere_are_refused():
    res = check(log_probs_also_used, qkv(), rewritten=0)
    assert "the log-probabilities are also read by" in reasons(res)


# ------------------------------------------------------------------------ exp over its row sum (written out)

def _exp_sum(s, rowmax, total):
    e = torch.exp(s - rowmax(s))
    return e / total(e)


EXP_SUM_FORMS = {
    "amax.sum": lambda q, k, v: _exp_sum(q @ k.transpose(-2, -1) * 0.25, lambda s: s.amax(-1, keepdim=True),
                                         lambda e: e.sum(-1, keepdim=True)) @ v,
    "max.values_detached.torch.sum": lambda q, k, v: _exp_sum(
        q @ k.transpose(-2, -1) / 4.0, lambda s: s.max(dim=-1, keepdim=True)[0].detach(),
        lambda e: torch.sum(e, dim=3, keepdim=True)) @ v,
    "causal masked_fill": lambda q, k, v: _exp_sum(
        (q @ k.transpose(-2, -1) * 0.25).masked_fill(causal_bool(), -math.inf),
        lambda s: torch.amax(s, dim=(-1,), keepdim=True), lambda e: e.sum(dim=-1, keepdim=True)) @ v,
    # the max of detached scores (the shift carries no gradient, as with the max detached after the reduction)
    "detached.amax.sum": lambda q, k, v: _exp_sum(q @ k.transpose(-2, -1) * 0.25,
                                                  lambda s: s.detach().amax(-1, keepdim=True),
                                                  lambda e: e.sum(-1, keepdim=True)) @ v,
    "torch.detach.max.sum": lambda q, k, v: _exp_sum(q @ k.transpose(-2, -1) * 0.25,
                                                     lambda s: torch.detach(s).max(-1, keepdim=True)[0],
                                                     lambda e: e.sum(-1, keepdim=True)) @ v,
}


def detached_scores_also_returned(q, k, v):
    s = q @ k.transpose(-2, -1) * 0.25
    sd = s.detach()
    e = torch.exp(s - sd.amax(-1, keepdim=True))
    return (e / e.sum(-1, keepdim=True)) @ v, sd


def test_detached_scores_read_elsewhere_are_a_use_of_the_scores():
    check(detached_scores_also_returned, qkv(), rewritten=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("form", list(EXP_SUM_FORMS))
def test_exp_over_its_row_sum_is_softmax(form, dtype):
    res = check(EXP_SUM_FORMS[form], qkv(dtype=dtype), dtype=dtype, rewritten=1)
    assert ("causal" in res.rewritten[0].mask) == ("causal" in form)


def exp_sum_unshifted(q, k, v):
    e = torch.exp(q @ k.transpose(-2, -1) * 0.25)
    return e / e.sum(-1, keepdim=True) @ v


def exp_also_read(q, k, v):
    s = q @ k.transpose(-2, -1) * 0.25
    e = torch.exp(s - s.amax(-1, keepdim=True))
    return (e / e.sum(-1, keepdim=True)) @ v + e.mean(-1, keepdim=True)


def row_sum_also_read(q, k, v):
    s = q @ k.transpose(-2, -1) * 0.25
    e = torch.exp(s - s.amax(-1, keepdim=True))
    z = e.sum(-1, keepdim=True)
    return (e / z) @ v + z.log()


def test_exp_over_its_row_sum_without_the_row_max_is_not_softmax():
    # exp(s) overflows for a large logit where softmax(s) does not: eager's inf / inf is NaN, not a probability
    check(exp_sum_unshifted, qkv(), rewritten=0)
    q, k, v = qkv(grad=False)
    big = exp_sum_unshifted(q * 40, k * 40, v)
    assert big.isnan().any() and torch.compile(exp_sum_unshifted, backend="fa3")(q * 40, k * 40, v).isnan().any()


@pytest.mark.parametrize("fn", [exp_also_read, row_sum_also_read], ids=["exp", "row_sum"])
def test_exp_or_row_sum_read_elsewhere_are_refused(fn):
    res = check(fn, qkv(), rewritten=0)
    assert "only the softmax's own division may read them" in reasons(res)


# ------------------------------------------------------- exp of the scores minus their logsumexp (Reformer)

def _first_row(n=N):
    return (torch.arange(n) == 0)[:, None].expand(n, n)


def _exp_lse(s):
    return torch.exp(s - torch.logsumexp(s, dim=-1, keepdim=True))


EXP_LSE_FORMS = {
    "torch.logsumexp": lambda q, k, v: _exp_lse(q @ k.transpose(-2, -1) * 0.25) @ v,
    "Tensor.logsumexp.exp": lambda q, k, v: (lambda s: (s - s.logsumexp(3, True)).exp())(
        q @ k.transpose(-2, -1) / 4.0) @ v,
    "causal finfo.min": lambda q, k, v: _exp_lse(
        (q @ k.transpose(-2, -1) * 0.25).masked_fill(causal_bool(), torch.finfo(q.dtype).min)) @ v,
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("form", list(EXP_LSE_FORMS))
def test_exp_minus_logsumexp_is_softmax(form, dtype):
    check(EXP_LSE_FORMS[form], qkv(dtype=dtype), dtype=dtype, rewritten=1)


def exp_lse_empty_row_nan(q, k, v):
    return _exp_lse((q @ k.transpose(-2, -1) * 0.25).masked_fill(causal_bool() | _first_row(), -math.inf)) @ v


def test_exp_minus_logsumexp_keeps_a_fully_masked_row_nan():
    res = check(exp_lse_empty_row_nan, qkv(grad=False), rewritten=1)
    assert res.ref[:, :, 0].isnan().all() and not res.ref[:, :, 1:].isnan().any()


def test_exp_minus_logsumexp_through_inductor():
    check(EXP_LSE_FORMS["torch.logsumexp"], qkv(), inner="inductor", rewritten=1)


def exp_lse_finite_fill(q, k, v, keep):
    """Reformer's local attention: where(mask, s, -1e9)."""
    return _exp_lse(torch.where(keep[:, None, None, :], q @ k.transpose(-2, -1) * 0.25, -1e9)) @ v


def test_exp_minus_logsumexp_over_a_row_of_finite_fills_is_refused():
    args = qkv() + [keep_padding(N)]  # batch 1 has no key at all
    res = check(exp_lse_finite_fill, args, rewritten=0)
    assert "eager's logsumexp rounds at the fill's magnitude" in reasons(res)
    q, k, v, keep = args
    # logsumexp(-1e9 + 0 * s) rounds to -1e9 in fp32: every key gets weight 1, not 1 / N
    torch.testing.assert_close(res.ref[1].detach(), v[1].detach().sum(-2, keepdim=True).expand(H, N, D))


def _chunked_causal(first_chunk_row_empty: bool):
    """Reformer's decoder mask, compile-time index arithmetic: chunks of 3 positions, each looking one chunk back
    (the first one at the last chunk, whose positions all lie ahead), query position >= key position."""
    def fn(q, k, v):  # q, k, v [B, H, 2 chunks, 3, D]
        pos = torch.arange(6, device=q.device).view(2, 3)
        kpos = torch.cat([pos.roll(1, 0), pos], dim=-1)  # [2 chunks, 6 keys]: the previous chunk, then its own
        keep = pos.unsqueeze(-1) >= kpos.unsqueeze(-2)
        if first_chunk_row_empty:
            keep = keep & (pos.unsqueeze(-1) > 0)  # position 0 admits no key
        kk = torch.cat([k.roll(1, 2), k], dim=-2)
        vv = torch.cat([v.roll(1, 2), v], dim=-2)
        return _exp_lse(torch.where(keep, q @ kk.transpose(-2, -1) * 0.25, -1e9)) @ vv
    return fn


def test_exp_minus_logsumexp_with_a_finite_fill_over_a_constant_mask_that_leaves_every_row_a_key():
    res = check(_chunked_causal(False), qkv(shape=(B, H, 2, 3, D)), rewritten=1)
    assert res.rewritten[0].mask == "bool-mask"


def test_exp_minus_logsumexp_with_a_finite_fill_over_a_constant_mask_with_an_empty_row_is_refused():
    res = check(_chunked_causal(True), qkv(shape=(B, H, 2, 3, D)), rewritten=0)
    assert "eager's logsumexp rounds at the fill's magnitude" in reasons(res)


def exp_lse_positive_fill(q, k, v):
    """A constant chunked mask that leaves every row a key, filled with +1e9: the masked scores set the logsumexp,
    which eager rounds at 1e9 (each masked key gets weight about 1, not 1 / count)."""
    s = q @ k.transpose(-2, -1) * 0.25
    i = torch.arange(s.shape[-1], device=s.device)
    return _exp_lse(s.masked_fill((i[:, None] // 2) < (i[None, :] // 2), 1e9)) @ v


def test_exp_minus_logsumexp_with_a_positive_fill_is_refused():
    res = check(exp_lse_positive_fill, qkv(), rewritten=0)
    assert "eager's logsumexp rounds at the fill's magnitude" in reasons(res)


def lse_also_read(q, k, v):
    s = q @ k.transpose(-2, -1) * 0.25
    lse = torch.logsumexp(s, -1, keepdim=True)
    return torch.exp(s - lse) @ v + lse


def exp_lse_over_queries(q, k, v):
    s = q @ k.transpose(-2, -1) * 0.25
    return torch.exp(s - torch.logsumexp(s, -2, keepdim=True)) @ v  # normalised over the queries: not attention


def exp_lse_of_other_scores(q, k, v):
    s = q @ k.transpose(-2, -1) * 0.25
    return torch.exp(s - torch.logsumexp(s * 2.0, -1, keepdim=True)) @ v  # not s's own normaliser


def test_exp_minus_logsumexp_read_elsewhere_is_refused():
    res = check(lse_also_read, qkv(), rewritten=0)
    assert "the scores' logsumexp or the log-probabilities are also read by" in reasons(res)


@pytest.mark.parametrize("fn", [exp_lse_over_queries, exp_lse_of_other_scores])
def test_exp_minus_another_logsumexp_is_not_softmax(fn):
    res = check(fn, qkv(), rewritten=0)
    assert not res.reports  # no softmax found


class BufferFill(nn.Module):
    """Reformer: the mask value is a 0-d module buffer, torch.where(keep, s, self.mask_value)."""

    def __init__(self, value=torch.finfo(torch.float32).min):
        super().__init__()
        self.register_buffer("mask_value", torch.tensor(value), persistent=False)

    def forward(self, q, k, v):
        s = torch.where(~causal_bool(), q @ k.transpose(-2, -1) * 0.25, self.mask_value)
        return _exp_lse(s) @ v


def test_a_fill_read_from_a_buffer_is_its_value():
    res = check(BufferFill(), qkv(), rewritten=1)
    assert res.rewritten[0].mask == "causal"


def fill_from_data(q, k, v):
    s = q @ k.transpose(-2, -1) * 0.25
    return torch.softmax(s.masked_fill(causal_bool(), q.detach().amin() - 1e4), -1) @ v  # not a constant


def fill_that_needs_a_gradient(q, k, v):
    s = q @ k.transpose(-2, -1) * 0.25
    return torch.softmax(torch.where(causal_bool(), q.sum() * 0.0 - 1e4, s), -1) @ v  # eager gives it a gradient


def test_a_fill_read_from_a_tensor_that_is_not_a_constant_is_refused():
    assert "mask fill value" in reasons(check(fill_from_data, qkv(), rewritten=0))
    assert "torch.where on the scores without a constant fill" in reasons(check(fill_that_needs_a_gradient, qkv(),
                                                                                rewritten=0))


# --------------------------------------- probabilities set to 0 where the scores were filled (DeBERTa's XSoftmax)

def query_key_padding(n=N, masked=2):
    """DeBERTa's mask: keep[b, i] & keep[b, j] (True = kept); batch 1's last `masked` queries see no key."""
    keep = keep_padding(masked)
    return keep[:, None, :, None] & keep[:, None, None, :]


def xsoftmax(q, k, v, keep):
    """DeBERTa-v2 / SEW-D's XSoftmax.forward, inlined (eval, or no_grad)."""
    rmask = ~keep
    s = (q @ k.transpose(-2, -1) * 0.25).masked_fill(rmask, torch.tensor(torch.finfo(q.dtype).min))
    p = torch.softmax(s, -1)
    p.masked_fill_(rmask, 0)
    return p @ v


def xsoftmax_where(q, k, v, keep):
    s = torch.where(keep, q @ k.transpose(-2, -1) * 0.25, -math.inf)
    p = torch.where(keep, F.dropout(torch.softmax(s, -1), 0.0), 0.0)
    return p @ v


def xsoftmax_bias(q, k, v, keep, pos):
    """SEW-D's relative-position bias (a product of the queries and position embeddings) added before the fill. (A bias
    from the inputs is refused there: it may hold finfo.min itself, test_mask_values.py.)"""
    rmask = ~keep
    bias = (q @ pos.transpose(-1, -2)) * 0.25
    s = torch.bmm((q * 0.25).flatten(0, 1), k.flatten(0, 1).transpose(1, 2)).view(B, H, N, N) + bias
    p = torch.softmax(s.masked_fill(rmask, torch.finfo(s.dtype).min), -1).masked_fill(rmask, 0)
    return torch.bmm(p.view(B * H, N, N), v.flatten(0, 1)).view(B, H, N, D)


def conformer_rel_pos(q, k, v, keep, pos):
    """ESPnet / WeNet / NeMo's relative-position attention: the positional product added before the scale,
    (q_u·Kᵀ + q_v·Pᵀ) / √d, then the padding filled with finfo.min and the probabilities zeroed there."""
    rmask = ~keep
    s = (q @ k.transpose(-2, -1) + (q * 0.5) @ pos.transpose(-2, -1)) / math.sqrt(D)
    p = torch.softmax(s.masked_fill(rmask, torch.finfo(s.dtype).min), dim=-1).masked_fill(rmask, 0.0)
    return p @ v


def xsoftmax_causal(q, k, v):
    rmask = causal_bool()  # the diagonal is always kept: no empty row
    p = torch.softmax((q @ k.transpose(-2, -1) * 0.25).masked_fill(rmask, -1e38), -1).masked_fill(rmask, 0.0)
    return p @ v


XSOFTMAX_FORMS = {
    "where -inf, where 0": (xsoftmax_where, lambda: [query_key_padding()]),
    "bias then fill, bmm": (xsoftmax_bias, lambda: [query_key_padding(), rand(B, H, N, D, seed=7, requires_grad=True)]),
    "causal (no empty row)": (xsoftmax_causal, lambda: []),
    "bias before the scale (Conformer)": (conformer_rel_pos, lambda: [query_key_padding(),
                                                                       rand(1, H, N, D, seed=8, requires_grad=True)]),
}


@pytest.mark.parametrize("form", list(XSOFTMAX_FORMS))
def test_probabilities_zeroed_where_the_scores_were_filled(form):
    fn, extra = XSOFTMAX_FORMS[form]
    res = check(fn, qkv() + extra(), rewritten=1)
    if "causal" not in form:
        assert res.ref[1, :, -2:].eq(0).all() and res.out[1, :, -2:].eq(0).all()  # the rows with no key


def test_probabilities_zeroed_in_place_without_grad():
    # eager's backward cannot run through the in-place write into softmax's output (why XSoftmax is an
    # autograd.Function): the in-place form is inference code
    res = check(xsoftmax, qkv(grad=False) + [query_key_padding()], rewritten=1)
    assert res.ref[1, :, -2:].eq(0).all() and res.out[1, :, -2:].eq(0).all()


def test_probabilities_zeroed_through_inductor():
    check(xsoftmax_where, qkv() + [query_key_padding()], inner="inductor", rewritten=1)


def zeroed_by_the_mask_computed_again(q, k, v, keep):
    s = (q @ k.transpose(-2, -1) * 0.25).masked_fill(~keep, torch.finfo(q.dtype).min)
    return torch.softmax(s, -1).masked_fill(~keep, 0) @ v  # a second ~keep: the same pure op on the same input


def test_probabilities_zeroed_by_the_mask_computed_again_are_rewritten():
    # two nodes computing ~keep hold one value (aliasing.same_value): the zeroing is where the fill masked
    check(zeroed_by_the_mask_computed_again, qkv() + [query_key_padding()], rewritten=1)


def zeroed_at_other_keys(q, k, v, keep):
    s = (q @ k.transpose(-2, -1) * 0.25).masked_fill(~keep, torch.finfo(q.dtype).min)
    return torch.softmax(s, -1).masked_fill(keep, 0) @ v  # zeroes the kept keys


def zeroed_after_a_finite_fill(q, k, v, keep):
    rmask = ~keep
    s = (q @ k.transpose(-2, -1) * 0.25).masked_fill(rmask, -1e4)  # the masked keys keep a weight
    return torch.softmax(s, -1).masked_fill(rmask, 0) @ v


def zeroed_without_a_fill(q, k, v, keep):
    return torch.softmax(q @ k.transpose(-2, -1) * 0.25, -1).masked_fill(~keep, 0) @ v


def zeroed_with_another_mask_term(q, k, v, keep):
    rmask = ~keep
    s = (q @ k.transpose(-2, -1) * 0.25).masked_fill(causal_bool(), -math.inf).masked_fill(rmask, -math.inf)
    return torch.softmax(s, -1).masked_fill(rmask, 0) @ v  # rows the causal mask empties are not all zeroed


def zeroed_after_a_view(q, k, v, keep):
    rmask = ~keep
    p = torch.softmax((q @ k.transpose(-2, -1) * 0.25).masked_fill(rmask, torch.finfo(q.dtype).min), -1)
    return (p.view(H, B, N, N).masked_fill(rmask[0], 0)).view(B, H, N, N) @ v  # another tensor's positions


ZEROED_REFUSALS = {
    zeroed_at_other_keys: "which is not proven to be where a fill before the softmax masked the scores",
    zeroed_after_a_finite_fill: "that fill does not absorb the scores",
    zeroed_without_a_fill: "which is not proven to be where a fill before the softmax masked the scores",
    zeroed_with_another_mask_term: "may leave a row with no admissible key that the zeroing does not cover",
    zeroed_after_a_view: "which is not proven to be where a fill before the softmax masked the scores",
}


@pytest.mark.parametrize("fn", list(ZEROED_REFUSALS), ids=lambda f: f.__name__)
def test_probabilities_zeroed_elsewhere_are_refused(fn):
    res = check(fn, qkv() + [query_key_padding()], rewritten=0)
    assert ZEROED_REFUSALS[fn] in reasons(res), reasons(res)


class TestPinnedExpSum(expecttest.TestCase):
    def test_pinned_exp_over_row_sum(self):
        self.assertExpectedInline(pinned(EXP_SUM_FORMS["amax.sum"], *qkv()), """\
fa3.attention(l_q_, l_k_, l_v_, 0.25, False, 0, -1, -1, None, None, 0.0, 0.0, None, None)
getitem(attention_default, 0)
clone(getitem)""")


# ------------------------------------------------------------------------------------ multiplicative masks

class TrilBufferMask(nn.Module):
    def __init__(self, fill: float):
        super().__init__()
        self.fill = fill
        self.register_buffer("m", torch.ones(N, N).tril())

    def forward(self, q, k, v):
        s = q @ k.transpose(-2, -1)
        s = s * self.m + (1 - self.m) * self.fill
        return torch.softmax(s / math.sqrt(q.size(-1)), -1) @ v


def bool_cast_mask(q, k, v, key_keep):
    m = key_keep[:, None, None, :].to(q.dtype)
    s = q @ k.transpose(-2, -1) * 0.25
    return torch.softmax(m * s - 1e9 * (1.0 - m), -1) @ v


def keep_padding(rows_masked=2):
    keep = torch.ones(B, N, dtype=torch.bool)
    keep[1, -rows_masked:] = False
    return keep


@pytest.mark.parametrize("fill", [-1e9, -1e4, torch.finfo(torch.float32).min])
def test_multiplicative_tril_buffer_mask(fill):
    res = check(TrilBufferMask(fill), qkv(), rewritten=1)
    assert "causal" in res.rewritten[0].mask


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_multiplicative_mask_of_a_bool_cast(dtype):
    check(bool_cast_mask, qkv(dtype=dtype) + [keep_padding()], dtype=dtype, rewritten=1)  # fp16: -1e9 is -inf


def soft_mask(q, k, v, m):
    s = q @ k.transpose(-2, -1) * 0.25
    return torch.softmax(s * m + (1 - m) * -1e9, -1) @ v


def test_multiplicative_mask_not_proven_zero_one_is_refused():
    m = torch.rand(B, 1, 1, N, generator=torch.Generator().manual_seed(3))  # values in (0, 1): a blend
    res = check(soft_mask, qkv() + [m], rewritten=0)
    assert "is not proven to hold only 0 and 1" in reasons(res)


def test_multiplicative_mask_that_needs_a_gradient_is_refused():
    m = keep_padding().to(torch.float32)[:, None, None, :].requires_grad_(True)
    res = check(soft_mask, qkv() + [m], rewritten=0)
    assert "a mask that needs a gradient" in reasons(res)


def spelled_twice(q, k, v, key_keep, view=False):
    m = key_keep.to(q.dtype)
    s = q @ k.transpose(-2, -1) * 0.25
    if view:
        return torch.softmax(s * m.view(B, 1, 1, N) + (1 - m.view(B, 1, 1, N)) * -1e4, -1) @ v
    return torch.softmax(s * m[:, None, None, :] + (1 - m[:, None, None, :]) * -1e9, -1) @ v


def spelled_twice_around_a_write(q, k, v, key_keep):
    before = key_keep.to(q.dtype)[:, None, None, :]
    key_keep.fill_(True)
    after = key_keep.to(q.dtype)[:, None, None, :]
    s = q @ k.transpose(-2, -1) * 0.25
    return torch.softmax(s * before + (1 - after) * -1e9, -1) @ v


@pytest.mark.parametrize("view", [False, True], ids=["index", "view"])
def test_multiplicative_mask_spelled_twice(view):
    # the mask's broadcast view written in the product and again in the penalty: two nodes, one value
    check(lambda q, k, v, keep: spelled_twice(q, k, v, keep, view), qkv() + [keep_padding()], rewritten=1)


def test_multiplicative_mask_whose_penalty_tensor_is_written_holds_the_written_value():
    # `c = torch.tensor(-1e4); c.fill_(3.0)`: the penalty is 3, not the literal -1e4 the tensor was made from
    def f(q, k, v, key_keep):
        m = key_keep[:, None, None, :].to(q.dtype)
        c = torch.tensor(-1e4)
        c.fill_(3.0)
        s = q @ k.transpose(-2, -1) * 0.25
        return torch.softmax(s * m + (1 - m) * c, -1) @ v

    check(f, qkv() + [keep_padding()], rewritten=0)


def test_multiplicative_mask_spelled_twice_around_a_write_is_refused():
    # the caller's mask is cast before and after it is overwritten: the product and the penalty read different values
    # (no gradient: AOTAutograd's own gradient of this program differs from eager's, with or without the pass)
    check(spelled_twice_around_a_write, qkv(grad=False) + [keep_padding()], rewritten=0, grad=False)


# ------------------------------------------------------------------------------------------- baddbmm beta

def baddbmm_beta(q, k, v, bias, beta=0.5):
    b, h, n, d = q.shape
    s = torch.baddbmm(bias, q.reshape(b * h, n, d), k.reshape(b * h, n, d).transpose(1, 2), beta=beta, alpha=0.25)
    return torch.bmm(torch.softmax(s, -1), v.reshape(b * h, n, d)).view(b, h, n, d)


@pytest.mark.parametrize("beta", [0.5, -2.0])
def test_baddbmm_beta_is_an_additive_bias(beta):
    res = check(lambda q, k, v, bias: baddbmm_beta(q, k, v, bias, beta),
                qkv() + [rand(B * H, N, N, seed=7, requires_grad=True)], rewritten=1)
    assert res.rewritten[0].scale == pytest.approx(0.25)


def test_baddbmm_beta_input_scaled_afterwards():
    def f(q, k, v, bias):
        b, h, n, d = q.shape
        s = torch.baddbmm(bias, q.reshape(b * h, n, d), k.reshape(b * h, n, d).transpose(1, 2), beta=0.5) * 0.25
        return torch.bmm(torch.softmax(s, -1), v.reshape(b * h, n, d)).view(b, h, n, d)

    check(f, qkv() + [rand(B * H, N, N, seed=7, requires_grad=True)], rewritten=1)


def test_baddbmm_beta_input_softcapped_afterwards_is_refused():
    def f(q, k, v, bias):
        b, h, n, d = q.shape
        s = torch.baddbmm(bias, q.reshape(b * h, n, d), k.reshape(b * h, n, d).transpose(1, 2), beta=0.5)
        s = torch.tanh(s / 5.0) * 5.0
        return torch.bmm(torch.softmax(s, -1), v.reshape(b * h, n, d)).view(b, h, n, d)

    res = check(f, qkv() + [rand(B * H, N, N, seed=7)], rewritten=0)
    assert "added input is softcapped or scaled by a tensor afterwards" in reasons(res)


# ----------------------------------------------------------------------------------------- pinned graphs

class TestPinnedSpellings(expecttest.TestCase):
    def test_pinned_dead_clone(self):
        self.assertExpectedInline(pinned(dead_clone, *qkv(grad=False)), """\
fa3.attention(l_q_, l_k_, l_v_, 0.25, False, 0, -1, -1, None, None, 0.0, 0.0, None, None)
getitem(attention_default, 0)
contiguous(getitem)""")

    def test_pinned_linear(self):
        q, k, v = rand(B, H, N, D), rand(5, D, seed=1), rand(5, D, seed=2)
        self.assertExpectedInline(pinned(linear_qk, q, k, v), """\
unsqueeze(l_k_, 0)
unsqueeze(unsqueeze, 0)
unsqueeze(l_v_, 0)
unsqueeze(unsqueeze_2, 0)
expand(unsqueeze_1, 2, -1, -1, -1)
expand(unsqueeze_3, 2, -1, -1, -1)
fa3.attention(l_q_, expand, expand_1, 0.25, False, 0, -1, -1, None, None, 0.0, 0.0, None, None)
getitem(attention_default, 0)
contiguous(getitem)""")

    def test_pinned_terms_of_a_slice(self):
        args = _grid(grad=False) + _slice_rel_hw(grad=False)
        self.assertExpectedInline(pinned(slice_written_back_through_a_view, *args), """\
getitem(l_rh_, (Ellipsis, None))
getitem(l_rw_, (Ellipsis, None, slice(None, None, None)))
expand(getitem_1, 2, 2, 2, 3, 2, 3)
reshape(expand, 2, 2, 6, 6)
pad(reshape, [1, 0, 1, 0, 0, 0, 0, 0])
expand(getitem_2, 2, 2, 2, 3, 2, 3)
reshape(expand_1, 2, 2, 6, 6)
pad(reshape_1, [1, 0, 1, 0, 0, 0, 0, 0])
add(pad, pad_1)
fa3.attention(l_q_, l_k_, l_v_, 0.35, False, 0, -1, -1, add_4, None, 0.0, 0.0, None, None)
getitem(attention_default, 0)
getitem(attention_default, 1)
isneginf(getitem_4)
unsqueeze(isneginf, -1)
full_like(getitem_3, nan)
where(unsqueeze, full_like, getitem_3)""")

    def test_pinned_key_blocks(self):
        args = _global_local_args(grad=False)
        self.assertExpectedInline(pinned(global_local, *args), """\
view(l_q_, 2, 2, 3, 4, 8)
view(l_kl_, 2, 2, 3, 4, 8)
view(l_vl_, 2, 2, 3, 4, 8)
unsqueeze(l_kg_, 2)
expand(unsqueeze, 2, 2, 3, -1, -1)
cat([expand, kb], 3)
getitem(l_m_, (slice(None, None, None), None, slice(None, None, None), None, slice(None, None, None)))
unsqueeze(l_vg_, 2)
expand(unsqueeze_1, 2, 2, 3, -1, -1)
cat([expand_1, vb], 3)
flatten(qb, 0, 1)
flatten(cat_1, 0, 1)
flatten(cat_2, 0, 1)
expand(getitem, -1, 2, -1, -1, -1)
flatten(expand_2, 0, 1)
fa3.attention(flatten, flatten_1, flatten_2, 0.3535533905932738, False, 0, -1, -1, flatten_3, None, 0.0, 0.0, None, None)
getitem(attention_default, 0)
getitem(attention_default, 1)
isneginf(getitem_4)
unsqueeze(isneginf, -1)
full_like(getitem_3, nan)
where(unsqueeze_2, full_like, getitem_3)
unflatten(where, 0, (2, 2))""")

    def test_pinned_terms_of_a_reshaped_view(self):
        rh, rw = (t.detach() for t in _rel())
        self.assertExpectedInline(pinned(decomposed_bias_on_a_5d_view, *qkv(grad=False), rh, rw), """\
getitem(l_rh_, (slice(None, None, None), slice(None, None, None), slice(None, None, None), slice(None, None, None), None))
getitem(l_rw_, (slice(None, None, None), slice(None, None, None), slice(None, None, None), None, slice(None, None, None)))
expand(getitem, 4, 2, 3, 2, 3)
reshape(expand, 2, 2, 6, 6)
expand(getitem_1, 4, 2, 3, 2, 3)
reshape(expand_1, 2, 2, 6, 6)
add(reshape, reshape_1)
fa3.attention(l_q_, l_k_, l_v_, 0.35, False, 0, -1, -1, add_4, None, 0.0, 0.0, None, None)
getitem(attention_default, 0)
getitem(attention_default, 1)
isneginf(getitem_3)
unsqueeze(isneginf, -1)
full_like(getitem_2, nan)
where(unsqueeze, full_like, getitem_2)""")

    def test_pinned_heads_folded_into_the_query_rows(self):
        m = FoldedRowsMQA()
        x, keep = _mqa_args()
        self.assertExpectedInline(pinned(m, x.detach(), keep), """\
linear(l_x_, l_self_modules_c_attn_parameters_weight_, l_self_modules_c_attn_parameters_bias_)
split(linear, (24, 16))
getitem(split, 0)
getitem(split, 1)
split(kv, (8, 8))
getitem(split_1, 0)
getitem(split_1, 1)
transpose(k, 1, 2)
reshape(q, 2, 15, 8)
reshape(reshape, 2, 5, 3, 8)
unsqueeze(k_1, 1)
unsqueeze(v, 1)
permute(unsqueeze, (0, 1, 3, 2))
fa3.attention(reshape_1, permute, unsqueeze_1, 0.3535533905932738, False, 0, -1, -1, l_keep_, None, 0.0, 0.0, None, None)
getitem(attention_default, 0)
getitem(attention_default, 1)
isneginf(getitem_5)
unsqueeze(isneginf, -1)
mean(unsqueeze_1)
repeat_interleave(mean, 5)
to(repeat_interleave, torch.float32)
where(unsqueeze_2, to, getitem_4)
reshape(where_1, 2, 15, 8)
view(reshape_2, 2, 5, 24)""")

    def test_pinned_exp_minus_logsumexp(self):
        self.assertExpectedInline(pinned(EXP_LSE_FORMS["torch.logsumexp"], *qkv(grad=False)), """\
fa3.attention(l_q_, l_k_, l_v_, 0.25, False, 0, -1, -1, None, None, 0.0, 0.0, None, None)
getitem(attention_default, 0)
contiguous(getitem)""")

    def test_pinned_probabilities_zeroed_where_filled(self):
        # fully masked rows: the op's own 0, no fix-up after it
        self.assertExpectedInline(pinned(xsoftmax, *qkv(grad=False), query_key_padding()), """\
fa3.attention(l_q_, l_k_, l_v_, 0.25, False, 0, -1, -1, l_keep_, None, 0.0, 0.0, None, None)
getitem(attention_default, 0)
contiguous(getitem)""")

    def test_pinned_exp_of_log_softmax(self):
        self.assertExpectedInline(pinned(LOG_SOFTMAX_FORMS["F.log_softmax.exp"], *qkv(grad=False)), """\
fa3.attention(l_q_, l_k_, l_v_, 0.25, False, 0, -1, -1, None, None, 0.0, 0.0, None, None)
getitem(attention_default, 0)
contiguous(getitem)""")

    def test_pinned_masked_fill_in_place(self):
        self.assertExpectedInline(pinned(masked_fill_statement, *qkv(grad=False)), """\
fa3.attention(l_q_, l_k_, l_v_, 0.35355339059327373, True, 0, -1, -1, None, None, 0.0, 0.0, None, None)
getitem(attention_default, 0)
contiguous(getitem)""")

    def test_pinned_ones_like_mask(self):
        self.assertExpectedInline(pinned(ones_like_tril, *qkv(grad=False)), """\
fa3.attention(l_q_, l_k_, l_v_, 0.25, True, 0, -1, -1, None, None, 0.0, 0.0, None, None)
getitem(attention_default, 0)
contiguous(getitem)""")

    def test_pinned_multiplicative_mask(self):
        self.assertExpectedInline(pinned(bool_cast_mask, *qkv(grad=False), keep_padding()), """\
getitem(l_key_keep_, (slice(None, None, None), None, None, slice(None, None, None)))
transpose(getitem, -2, -1)
where(transpose_1, l_k_, 0.0)
where(getitem, 0.0, -1000000000.0)
to(where_1, torch.float32)
fa3.attention(l_q_, where, l_v_, 0.25, False, 0, -1, -1, to_1, None, 0.0, 0.0, None, None)
getitem(attention_default, 0)
contiguous(getitem_1)""")

    def test_pinned_baddbmm_beta(self):
        self.assertExpectedInline(pinned(baddbmm_beta, *qkv(grad=False), rand(B * H, N, N, seed=7)), """\
reshape(l_q_, 4, 6, 8)
reshape(l_k_, 4, 6, 8)
reshape(l_v_, 4, 6, 8)
mul(l_bias_, 0.5)
unsqueeze(reshape, 1)
unsqueeze(reshape_1, 1)
unsqueeze(reshape_2, 1)
unsqueeze(mul, 1)
fa3.attention(unsqueeze, unsqueeze_1, unsqueeze_2, 0.25, False, 0, -1, -1, unsqueeze_3, None, 0.0, 0.0, None, None)
getitem(attention_default, 0)
getitem(attention_default, 1)
isneginf(getitem_1)
unsqueeze(isneginf, -1)
full_like(getitem, nan)
where(unsqueeze_4, full_like, getitem)
squeeze(where, 1)
view(squeeze, 2, 2, 6, 8)""")


# ------------------------------------------------------- K/V head repeats with an index after the inserted axis

def _repeat_after_index(x: torch.Tensor, g: int, index: tuple) -> torch.Tensor:
    b, hk, n, d = x.shape
    return x[(slice(None), slice(None), None) + index].expand(b, hk, g, n, d).reshape(b, hk * g, n, d)


def _perm(n: int) -> torch.Tensor:
    return torch.arange(n).roll(2)


def keys_permuted_in_the_repeat(q, k, v):
    g = q.shape[1] // k.shape[1]
    k, v = _repeat_after_index(k, g, (_perm(k.shape[2]),)), _repeat_after_index(v, g, (Ellipsis,))
    return (q @ k.transpose(-1, -2) * k.shape[-1] ** -0.5).softmax(-1) @ v


def key_dims_permuted_in_the_repeat_sdpa(q, k, v):
    g = q.shape[1] // k.shape[1]
    k = _repeat_after_index(k, g, (Ellipsis, _perm(k.shape[3])))
    return F.scaled_dot_product_attention(q, k, _repeat_after_index(v, g, ()))


def values_permuted_in_the_repeat_sdpa(q, k, v):
    g = q.shape[1] // k.shape[1]
    v = _repeat_after_index(v, g, (_perm(v.shape[2]), slice(None)))
    return F.scaled_dot_product_attention(q, _repeat_after_index(k, g, ()), v)


@pytest.mark.parametrize("fn", [keys_permuted_in_the_repeat, key_dims_permuted_in_the_repeat_sdpa,
                                values_permuted_in_the_repeat_sdpa], ids=lambda f: f.__name__)
def test_an_index_after_the_inserted_head_axis_is_kept(fn):
    # x[:, :, None, perm] repeats the heads of a permuted x: the repeat may go, the permutation stays (the site is
    # rewritten over the indexed K/V, or left alone, and equals eager either way).
    q = rand(B, 4, N, D, seed=1, requires_grad=True)
    k, v = (rand(B, 2, N, D, seed=s, requires_grad=True) for s in (2, 3))
    check(fn, [q, k, v])


# ------------------------------------------------------------------------------- einsum operands in either order

@pytest.mark.parametrize("scores_eq, pv_eq", [
    ("bjhd,bihd->bhij", "bhij,bjhd->bihd"),  # K first
    ("bihd,bjhd->bhij", "bjhd,bhij->bihd"),  # V first
    ("bjhd,bihd->bhij", "bjhd,bhij->bihd"),  # both
    ("bjhd,bihd->bhji", "bhji,bjhd->bihd"),  # K first and the scores laid out [key, query]: not attention over keys
])
def test_einsum_operands_in_either_order(scores_eq, pv_eq):
    # An einsum's product does not depend on the order of its operands: the site is the one the output's letters
    # describe (the query letter before the key letter in the scores, as the softmax reads them).
    def f(q, k, v):
        s = torch.einsum(scores_eq, *((k, q) if scores_eq.startswith("bj") else (q, k))) * 0.35
        return torch.einsum(pv_eq, *((v, s.softmax(-1)) if pv_eq.startswith("bj") else (s.softmax(-1), v)))

    args = qkv(shape=(B, N, H, D))
    args[1] = rand(B, N + 2, H, D, seed=5, requires_grad=True)  # Nk != Nq: a swapped site would not run
    args[2] = rand(B, N + 2, H, D, seed=6, requires_grad=True)
    check(f, args, rewritten=0 if scores_eq.endswith("ji") else 1)


def esm_probs(q, k, v):
    # fair-esm's MultiheadAttention: the probabilities' first copy is read only for its dtype by the second
    aw = torch.bmm(q, k.transpose(1, 2))
    awf = F.softmax(aw, dim=-1, dtype=torch.float32)
    aw = awf.type_as(aw)
    p = F.dropout(awf.type_as(aw), p=0.1, training=False)
    return torch.bmm(p, v)


def esm_probs_dtype_read_outside(q, k, v):
    aw = torch.bmm(q, k.transpose(1, 2))
    awf = F.softmax(aw, dim=-1, dtype=torch.float32)
    aw = awf.type_as(aw)
    out = torch.bmm(awf.type_as(aw), v)
    return out, v.sum(-1).type_as(aw)  # the copy's dtype is also read outside the site: it stays


@pytest.mark.parametrize("fn", [esm_probs, esm_probs_dtype_read_outside], ids=lambda f: f.__name__)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_a_copy_of_the_probabilities_read_only_for_its_dtype(fn, dtype):
    q, k, v = (rand(4, 7, 8, dtype=dtype, seed=i, requires_grad=True) for i in range(3))
    check(fn, [q, k, v], dtype=dtype, rewritten=1, grad=fn is esm_probs)


@pytest.mark.parametrize("op", ["mul", "div"])
def test_an_integer_constant_scale_is_a_scale_and_a_run_time_one_is_refused_by_name(op):
    # `s * torch.tensor(2)`: the floating scores promote the integer to their dtype, as they do a float; an integer
    # tensor read at run time is left alone with a reason that says so (it read "varies along the key axis")
    def const(q, k, v):
        s = q @ k.mT
        s = s * torch.tensor(3) if op == "mul" else s / torch.tensor(3)
        return torch.softmax(s, -1) @ v

    def runtime(q, k, v, t):
        s = q @ k.mT
        return torch.softmax(s * t if op == "mul" else s / t, -1) @ v

    q, k, v = (rand(2, 2, 5, 4, seed=s, requires_grad=True) for s in range(3))
    res = check(const, [q, k, v])
    assert [r.rewritten for r in res.reports] == [True]
    assert res.reports[0].scale == pytest.approx(3.0 if op == "mul" else 1 / 3)
    res = check(runtime, [q, k, v, torch.tensor(3)])
    assert [r.rewritten for r in res.reports] == [False]
    assert "integer tensor (int64) read at run time" in res.reports[0].reason


@pytest.mark.parametrize("case", ["batch", "query", "heads"])
def test_a_mask_that_broadcasts_the_scores_up_is_refused_with_its_reason(case):
    # scores of q and k broadcast to a larger shape by the mask: eager's result, and a reason in words (it was the
    # rewrite's internal shape error)
    q_shape, mask_shape = {"batch": ((1, 2, 5, 4), (2, 1, 5, 6)), "query": ((2, 2, 1, 4), (1, 1, 5, 6)),
                           "heads": ((2, 1, 5, 4), (1, 2, 5, 6))}[case]
    kv_shape = q_shape[:2] + (6, 4)
    q = rand(*q_shape, seed=1, requires_grad=True)
    k, v = rand(*kv_shape, seed=2, requires_grad=True), rand(*kv_shape, seed=3, requires_grad=True)
    m = rand(*mask_shape, seed=4, requires_grad=True)
    res = check(lambda q, k, v, m: torch.softmax(q @ k.mT * 0.5 + m, -1) @ v, [q, k, v, m])
    assert [r.rewritten for r in res.reports] == [False]
    assert "broadcasts them from" in res.reports[0].reason, res.reports[0].reason


@pytest.mark.parametrize("form", ["half-scale-inside", "other-divisor", "masked-after"])
def test_a_softcap_whose_tanh_is_scaled_by_another_factor(form):
    # c * tanh(a * s) is the op's softcap c with the scale a * c before it (c tanh(y / d) = c tanh((y c / d) / c))
    d = 4

    def fn(q, k, v):
        s = q @ k.mT
        if form == "half-scale-inside":
            s = 2 * torch.tanh(s * (d ** -0.5 / 2))
        elif form == "other-divisor":
            s = 30.0 * torch.tanh(s * d ** -0.5 / 50.0)
        else:
            i, j = torch.arange(6)[:, None], torch.arange(6)[None, :]
            s = (5.0 * torch.tanh(s * 0.1)).masked_fill(j > i, float("-inf"))
        return torch.softmax(s, -1) @ v

    q, k, v = (rand(2, 2, 6, d, seed=s, requires_grad=True) for s in range(3))
    res = check(fn, [q, k, v])
    assert [r.rewritten for r in res.reports] == [True], [r.reason for r in res.reports]
    want = {"half-scale-inside": (2.0, d ** -0.5), "other-divisor": (30.0, 30.0 * d ** -0.5 / 50.0),
            "masked-after": (5.0, 0.5)}[form]
    assert (res.reports[0].softcap, res.reports[0].scale) == pytest.approx(want)


@pytest.mark.parametrize("fill", ["full_like -1e9", "full_like -inf", "new_full finfo.min"])
def test_where_with_a_full_tensor_as_its_fill(fill):
    # torch.where(keep, s, torch.full_like(s, c)): a tensor of one constant value is the fill c
    n = 6

    def fn(q, k, v, m):
        s = q @ k.mT * 0.5
        if fill == "new_full finfo.min":
            return torch.softmax(torch.where(~m, s.new_full((n, n), torch.finfo(s.dtype).min), s), -1) @ v
        return torch.softmax(torch.where(m, s, torch.full_like(s, -1e9 if "1e9" in fill else float("-inf"))), -1) @ v

    q, k, v = (rand(2, 2, n, 4, seed=s, requires_grad=True) for s in range(3))
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    res = check(fn, [q, k, v, causal])
    assert [r.rewritten for r in res.reports] == [True], [r.reason for r in res.reports]


@pytest.mark.parametrize("second", ["same", "other-diagonal"])
def test_a_post_softmax_zero_fill_with_its_mask_computed_twice(second):
    # softmax(s.masked_fill(~c, min)).masked_fill(~c, 0) with `~c` written twice: two nodes of one pure op on the
    # same input hold the same mask (patterns/aliasing.same_value); a mask of another diagonal is another mask
    n = 8

    def fn(q, k, v):
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        p = torch.softmax((q @ k.mT * 0.5).masked_fill(~causal, torch.finfo(torch.float32).min), -1)
        later = causal if second == "same" else torch.ones(n, n, dtype=torch.bool).tril(-1)
        return p.masked_fill(~later, 0.0) @ v

    q, k, v = (rand(1, 2, n, 4, seed=s, requires_grad=True) for s in range(3))
    res = check(fn, [q, k, v])
    assert [r.rewritten for r in res.reports] == [second == "same"], [r.reason for r in res.reports]


def late_normalised(q, k, v):
    s = q @ k.mT * 0.5
    e = torch.exp(s - s.amax(-1, keepdim=True))
    return (e @ v) / e.sum(-1, keepdim=True)


def late_normalised_causal(q, k, v):
    n = q.shape[-2]
    s = (q @ k.mT * 0.5).masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    e = torch.exp(s - s.max(-1, keepdim=True).values)
    return torch.matmul(e, v) / e.sum(dim=-1, keepdim=True)


def late_normalised_per_key(q, k, v, w):
    s = q @ k.mT * w  # a per-key factor: no scale, the site is refused
    e = torch.exp(s - s.amax(-1, keepdim=True))
    return (e @ v) / e.sum(-1, keepdim=True)


@pytest.mark.parametrize("fn", [late_normalised, late_normalised_causal], ids=lambda f: f.__name__)
def test_softmax_normalised_after_the_pv_product(fn):
    # (e @ v) / e.sum(-1, keepdim=True), e = exp(s - rowmax(s)): the same terms as (e / e.sum(...)) @ v
    q, k, v = (rand(2, 2, 6, 4, seed=s, requires_grad=True) for s in range(3))
    res = check(fn, [q, k, v])
    assert [r.rewritten for r in res.reports] == [True], [r.reason for r in res.reports]
    res = check(fn, [q, k, v], inner="inductor")
    assert [r.rewritten for r in res.reports] == [True]


def test_softmax_normalised_after_the_pv_product_is_put_back_where_refused():
    # the edit is tentative: where the site is refused the graph computes as written, bit for bit
    q, k, v = (rand(2, 2, 6, 4, seed=s) for s in range(3))
    w = rand(1, 1, 1, 6, seed=4)
    c = Compiled(late_normalised_per_key)
    got = c(q, k, v, w)
    assert not any(r.rewritten for r in c.reports)
    assert torch.equal(got, late_normalised_per_key(q, k, v, w))
    assert not any(n.op == "call_method" and n.target == "div" and n.args[0].op == "call_function"
                   and n.args[0].target is torch.exp for n in c.graphs[0].graph.nodes)
