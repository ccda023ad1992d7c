"""Masks whose structure is known only at run time, proven from the graph: query positions read from a
tensor (static KV caches: `cache_position`, HF's `q_arange + cache offset`, gpt-fast's tril buffer indexed
by `input_pos`) become the op's q_pos, and equalities of segment ids (packed sequences: sequence ids,
HF's ids from restarting position ids, ids built from cu_seqlens) its q_seg / k_seg. Outputs and
gradients equal eager's on fresh inputs, fully masked rows included; where the structure is proven no
[Nq, Nk] mask is left in the graph.
"""
from __future__ import annotations

import math

import expecttest
import pytest
import torch
import torch.nn.functional as F

import fa_compile
from fa_compile import ops  # noqa: F401  (registers torch.ops.fa3)
from conftest import TOL, Compiled
from eager_diff import check, rand
from fa_compile.patterns.emit import example_value, op_accepts

NEG_INF = float("-inf")
B, H, D, L = 2, 2, 8, 12  # batch, heads, head dim, static cache length

pytestmark = pytest.mark.skipif(not op_accepts("q_pos"),
                                reason="fa3.attention takes no q_pos / q_seg / k_seg")


def qkv(nq: int, nk: int = L, seed: int = 0, grad: bool = True) -> list:
    return [rand(B, H, nq, D, seed=seed, requires_grad=grad), rand(B, H, nk, D, seed=seed + 1, requires_grad=grad),
            rand(B, H, nk, D, seed=seed + 2, requires_grad=grad)]


def masks_of(res) -> list:
    return [r.mask for r in res.reports]


def op_calls(c: Compiled) -> list:
    return [n for gm in c.graphs for n in gm.graph.nodes if n.target is torch.ops.fa3.attention.default]


def dense_masks(c: Compiled, nq: int, nk: int) -> list:
    """Nodes left in the rewritten graphs whose value is a [.., Nq, Nk] tensor (a materialized mask)."""
    return [n.name for gm in c.graphs for n in gm.graph.nodes if n.op != "placeholder"
            and isinstance(example_value(n), torch.Tensor) and example_value(n).dim() >= 2
            and tuple(example_value(n).shape[-2:]) == (nq, nk)]


def no_dense_mask(fn, args: list, nq: int, nk: int) -> None:
    c = Compiled(fn)
    with torch.no_grad():
        c(*[a.detach() if isinstance(a, torch.Tensor) else a for a in args])
    assert c.rewritten and dense_masks(c, nq, nk) == [], c.graphs[-1].code


# ----------------------------------------------------------------------------- run-time query positions

def _scores(q, k):
    return q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])


def _keep(spelling: str, nk: int, pos: torch.Tensor) -> torch.Tensor:
    """Key j admitted for query i when j <= pos[.., i], spelled as models do; [.., Nq, Nk] bool."""
    kv = torch.arange(nk, device=pos.device)
    p = pos[..., :, None]
    if spelling == "le":
        return kv <= p
    if spelling == "lt":
        return kv < (pos + 1)[..., :, None]
    if spelling == "ge-mirrored":
        return p >= kv
    if spelling == "not-gt":
        return ~(kv > p)
    if spelling == "offset-arange":  # HF: kv_arange = arange(Nk) + kv_offset
        return (kv + 2) <= (pos + 2)[..., :, None]
    raise AssertionError(spelling)


def _batched(m: torch.Tensor) -> torch.Tensor:
    return m[:, None] if m.dim() == 3 else m[None, None]


@pytest.mark.parametrize("spelling", ["le", "lt", "ge-mirrored", "not-gt", "offset-arange"])
def test_cache_position_spellings_are_query_positions(spelling):
    def fn(q, k, v, pos):
        keep = _batched(_keep(spelling, k.shape[-2], pos))
        return torch.where(keep, _scores(q, k), NEG_INF).softmax(-1) @ v

    args = [*qkv(3), torch.tensor([4, 5, 6])]
    assert masks_of(check(fn, args, rewritten=1)) == ["query-positions"]
    no_dense_mask(fn, args, 3, L)


@pytest.mark.parametrize("fill", ["where-min", "masked_fill-min", "additive-min", "finite-1e4"])
def test_cache_position_fills_keep_eager_rows(fill):
    """Per-batch positions [B, Nq]; a negative one leaves its row without keys (uniform in eager)."""

    def fn(q, k, v, pos):
        keep = _batched(_keep("le", k.shape[-2], pos))
        s = _scores(q, k)
        low = torch.finfo(s.dtype).min
        if fill == "where-min":
            s = torch.where(keep, s, low)
        elif fill == "masked_fill-min":
            s = s.masked_fill(~keep, low)
        elif fill == "additive-min":
            s = s + torch.where(keep, 0.0, low)
        else:
            s = s.masked_fill(~keep, -1e4)
        return s.softmax(-1) @ v

    pos = torch.tensor([[-1, 3, 11], [2, 7, 20]])
    res = check(fn, [*qkv(3), pos], rewritten=1)
    assert masks_of(res) == ["query-positions"]


def test_cache_positions_with_dynamic_sizes():
    def fn(q, k, v, pos):
        keep = torch.arange(k.shape[-2])[None, :] <= pos[:, None]
        return torch.where(keep, _scores(q, k), torch.finfo(q.dtype).min).softmax(-1) @ v

    c = Compiled(fn, dynamic=True)
    for nq, nk, seed in ((3, 12, 0), (5, 9, 1), (4, 16, 2)):
        args = [*qkv(nq, nk, seed=seed, grad=False), torch.arange(nq) + nk - nq - 1]
        torch.testing.assert_close(c(*args), fn(*args), **TOL[torch.float32])
    assert len(c.graphs) == 1, "recompiled for other sizes"
    assert [r.mask for r in c.reports] == ["query-positions"]


def test_sliding_window_from_positions_stays_an_exact_mask():
    """A window relative to run-time positions (j > P[i] - w) has no op form: it stays an exact bool mask
    beside the positions."""

    def fn(q, k, v, pos):
        kv, p = torch.arange(k.shape[-2])[None, :], pos[:, None]
        keep = (kv <= p) & (kv > p - 3)
        return torch.where(keep, _scores(q, k), torch.finfo(q.dtype).min).softmax(-1) @ v

    res = check(fn, [*qkv(3), torch.tensor([4, 5, 6])], rewritten=1)
    assert masks_of(res) == ["query-positions+bool-mask"]


def test_positions_written_in_place_after_the_mask_keep_eager_values():
    """The mask reads pos before the graph writes into it: a copy taken later would see other values, so
    the positions stay the exact bool mask."""

    def fn(q, k, v, pos):
        keep = torch.arange(k.shape[-2])[None, :] <= pos[:, None]
        pos.add_(3)
        return torch.where(keep, _scores(q, k), torch.finfo(q.dtype).min).softmax(-1) @ v

    res = check(fn, [*qkv(3, grad=False), torch.tensor([4, 5, 6])], inner="eager", rewritten=1)
    assert masks_of(res) == ["bool-mask"]


def test_decode_position_is_a_key_length():
    """One query (decode): a position constant along queries is the key length of every batch row."""

    def fn(q, k, v, pos):
        keep = torch.arange(k.shape[-2])[None, :] <= pos[:, None]
        return torch.where(keep[None, None], _scores(q, k), NEG_INF).softmax(-1) @ v

    res = check(fn, [*qkv(1), torch.tensor([5])], rewritten=1)
    assert masks_of(res) == ["key-padding"]


def test_positions_with_padding_and_causal_keep_the_key_vector():
    """Static-cache prefill of a chunk: j <= cache_position[i], a causal band on the chunk's own keys and a
    [B, 1, 1, Nk] padding vector: the padding stays that small and no [Nq, Nk] mask is built."""

    def fn(q, k, v, pos, am):
        keep = (torch.arange(k.shape[-2])[None, :] <= pos[:, None])[None, None] & am.bool()[:, None, None, :]
        s = _scores(q, k) + torch.where(keep, 0.0, torch.finfo(q.dtype).min)
        return s.softmax(-1) @ v

    am = torch.ones(B, L, dtype=torch.long)
    am[0, :3] = 0
    args = [*qkv(4), torch.tensor([3, 4, 5, 6]), am]
    res = check(fn, args, rewritten=1)
    assert masks_of(res) == ["query-positions+bool-mask"]
    c = Compiled(fn)
    c(*args)
    (call,) = op_calls(c)
    assert tuple(example_value(call.args[8]).shape) == (B, 1, 1, L)
    assert dense_masks(c, 4, L) == []


def test_sdpa_bool_mask_from_per_row_positions():
    def fn(q, k, v, pos):
        keep = torch.arange(k.shape[-2]) <= pos[:, None, :, None]  # [B, 1, Nq, Nk]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=keep)

    res = check(fn, [*qkv(3), torch.tensor([[-1, 3, 11], [2, 7, 20]])], rewritten=1)
    assert masks_of(res) == ["query-positions"]


class GptFast(torch.nn.Module):
    """gpt-fast: a registered lower-triangular bool buffer indexed by the graph input `input_pos`."""

    def __init__(self, buffer: torch.Tensor):
        super().__init__()
        self.register_buffer("causal_mask", buffer)

    def forward(self, q, k, v, input_pos):
        mask = self.causal_mask[None, None, input_pos]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


@pytest.mark.parametrize("pos", [[4, 5, 6], [-3, -2, -1], [0, 11, 3]])
def test_gpt_fast_tril_buffer_indexed_by_input_pos(pos):
    model = GptFast(torch.tril(torch.ones(L, L, dtype=torch.bool)))
    res = check(model, [*qkv(3), torch.tensor(pos)], rewritten=1)
    assert masks_of(res) == ["query-positions"]


class GptFastAttention(torch.nn.Module):
    """gpt-fast's attention with its KVCache: k/v written into [B, H, L, D] buffers at input_pos, the
    mask a row of the model's tril buffer per query."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.wqkv = torch.nn.Linear(16, 3 * H * D, bias=False)
        self.register_buffer("k_cache", torch.zeros(B, H, L, D))
        self.register_buffer("v_cache", torch.zeros(B, H, L, D))
        self.register_buffer("causal_mask", torch.tril(torch.ones(L, L, dtype=torch.bool)))

    def forward(self, x, input_pos):
        b, t, _ = x.shape
        q, k, v = self.wqkv(x).view(b, t, 3, H, D).permute(2, 0, 3, 1, 4)
        self.k_cache[:, :, input_pos] = k
        self.v_cache[:, :, input_pos] = v
        mask = self.causal_mask[None, None, input_pos]
        y = F.scaled_dot_product_attention(q, self.k_cache, self.v_cache, attn_mask=mask)
        return y.transpose(1, 2).reshape(b, t, H * D)


def test_gpt_fast_prefill_and_decode_with_its_cache():
    import copy

    ref = GptFastAttention()
    model = copy.deepcopy(ref)
    c = Compiled(model, dynamic=False)
    steps = [torch.arange(5)] + [torch.tensor([t]) for t in range(5, 8)]
    for i, pos in enumerate(steps):
        x = rand(B, pos.shape[0], 16, seed=i)
        with torch.no_grad():
            torch.testing.assert_close(c(x, pos), ref(x, pos), **TOL[torch.float32])
    assert c.rewritten and not c.missed, c.reports
    assert {r.mask for r in c.reports} == {"query-positions"}
    assert dense_masks(c, 5, L) == []


def test_gpt_fast_buffer_that_is_not_tril_is_a_bool_mask():
    g = torch.Generator().manual_seed(3)
    model = GptFast(torch.rand(L, L, generator=g) > 0.3)
    res = check(model, [*qkv(3), torch.tensor([4, 5, 6])], rewritten=1)
    assert masks_of(res) == ["bool-mask"]


def test_positions_not_along_queries_are_not_query_positions():
    """P varying along batches only is a key length; P varying along heads is no structure at all."""

    def per_batch(q, k, v, p):
        keep = torch.arange(k.shape[-2])[None, :] <= p[:, None]  # [B, Nk]
        return torch.where(keep[:, None, None, :], _scores(q, k), NEG_INF).softmax(-1) @ v

    def per_head(q, k, v, p):
        keep = torch.arange(k.shape[-2]) <= p[:, None, None]  # [H, 1, Nk]
        return torch.where(keep, _scores(q, k), torch.finfo(q.dtype).min).softmax(-1) @ v

    assert masks_of(check(per_batch, [*qkv(3), torch.tensor([4, 9])], rewritten=1)) == ["key-padding"]
    assert masks_of(check(per_head, [*qkv(3), torch.tensor([4, 9])], rewritten=1)) == ["bool-mask"]


# ----------------------------------------------------------------------------- segments

def _seg_keep(seg: torch.Tensor) -> torch.Tensor:
    return seg[:, None, :, None] == seg[:, None, None, :]


@pytest.mark.parametrize("spelling", ["3d-then-heads", "keys-first", "ids-1d"])
def test_segment_spellings(spelling):
    def fn(q, k, v, seg):
        if spelling == "3d-then-heads":
            keep = (seg[:, :, None] == seg[:, None, :])[:, None]
        elif spelling == "keys-first":
            keep = seg[:, None, None, :] == seg[:, None, :, None]
        else:
            keep = seg[0][:, None] == seg[0][None, :]
        return torch.where(keep, _scores(q, k), torch.finfo(q.dtype).min).softmax(-1) @ v

    args = [*qkv(6, 6), torch.tensor([[0, 0, 1, 1, 1, 2], [5, 3, 3, 5, 5, 5]])]
    assert masks_of(check(fn, args, rewritten=1)) == ["segments"]
    no_dense_mask(fn, args, 6, 6)


@pytest.mark.parametrize("fill", ["neg-inf", "min", "finite-1e4"])
def test_sequence_ids_causal_are_segments(fill):
    def fn(q, k, v, seg):
        n = q.shape[-2]
        keep = _seg_keep(seg) & (torch.arange(n)[None, :] <= torch.arange(n)[:, None])
        s = _scores(q, k)
        c = {"neg-inf": NEG_INF, "min": torch.finfo(s.dtype).min, "finite-1e4": -1e4}[fill]
        return s.masked_fill(~keep, c).softmax(-1) @ v

    seg = torch.tensor([[0, 0, 1, 1, 1, 2], [5, 3, 3, 5, 5, 5]])  # any values, unsorted
    args = [*qkv(6, 6), seg]
    assert masks_of(check(fn, args, rewritten=1)) == ["causal+segments"]
    if fill != "finite-1e4":  # the masked keys' share of a finite fill is summed over an [Nq, Nk] keep-mask
        no_dense_mask(fn, args, 6, 6)


def test_segments_with_empty_rows_under_a_finite_fill():
    """A padding key vector that empties some rows of a segment: eager's uniform row under finfo.min."""

    def fn(q, k, v, seg, am):
        keep = _seg_keep(seg) & am.bool()[:, None, None, :]
        return torch.where(keep, _scores(q, k), torch.finfo(q.dtype).min).softmax(-1) @ v

    seg = torch.tensor([[0, 0, 1, 1, 2, 2], [0, 1, 1, 1, 1, 1]])
    am = torch.tensor([[1, 1, 1, 1, 0, 0], [0, 1, 1, 1, 1, 1]])
    res = check(fn, [*qkv(6, 6), seg, am], rewritten=1)
    assert masks_of(res) == ["segments+bool-mask"]


@pytest.mark.parametrize("how", ["searchsorted", "cumsum", "repeat_interleave"])
def test_ids_built_from_cu_seqlens_are_segments(how):
    def fn(q, k, v, cu):
        n = q.shape[-2]
        if how == "searchsorted":  # token t lies in sequence ids[t]
            ids = torch.searchsorted(cu[1:], torch.arange(n), right=True)
        elif how == "cumsum":
            starts = torch.zeros(n, dtype=torch.long)
            starts[cu[1:-1]] = 1
            ids = starts.cumsum(0)
        else:
            ids = torch.repeat_interleave(torch.arange(cu.shape[0] - 1), cu.diff(), output_size=n)
        keep = (ids[:, None] == ids[None, :]) & (torch.arange(n)[None, :] <= torch.arange(n)[:, None])
        return torch.where(keep, _scores(q, k), NEG_INF).softmax(-1) @ v

    res = check(fn, [*qkv(7, 7), torch.tensor([0, 2, 3, 7])], rewritten=1)
    assert masks_of(res) == ["causal+segments"]


def _runs_of(pos: torch.Tensor, step: int = 1) -> torch.Tensor:
    """HF's find_packed_sequence_indices: a new id wherever the positions do not step by `step`."""
    return (torch.diff(pos, prepend=pos[:, :1] - 1, dim=-1) != step).cumsum(-1)


def _gathered_causal(q, k, v, pos, ids):
    """HF's causal mask remapped to packed positions: pos[b, j] <= pos[b, i], and ids[b, i] == ids[b, j]."""
    n = q.shape[-2]
    b_idx = torch.arange(q.shape[0])[:, None, None, None]
    q_idx, kv_idx = torch.arange(n)[None, None, :, None], torch.arange(n)[None, None, None, :]
    keep = (pos[b_idx, kv_idx] <= pos[b_idx, q_idx]) & (ids[b_idx, q_idx] == ids[b_idx, kv_idx])
    return torch.where(keep, _scores(q, k), torch.finfo(q.dtype).min).softmax(-1) @ v


def test_positions_compared_within_unit_runs_are_causal():
    """Within a run of positions stepping by 1, pos[j] <= pos[i] is j <= i: causal + segments."""

    def fn(q, k, v, pos):
        return _gathered_causal(q, k, v, pos, _runs_of(pos))

    args = [*qkv(7, 7), torch.tensor([[0, 1, 2, 0, 1, 5, 6], [3, 4, 5, 6, 0, 1, 2]])]
    assert masks_of(check(fn, args, rewritten=1)) == ["causal+segments"]
    no_dense_mask(fn, args, 7, 7)


@pytest.mark.parametrize("ids", ["step-2", "other-ids"])
def test_positions_compared_without_unit_runs_stay_a_mask(ids):
    """Ids whose runs do not prove pos[j] - pos[i] == j - i (another step, ids of other positions): the
    comparison is kept as a bool mask next to the segments."""

    def fn(q, k, v, pos, other):
        return _gathered_causal(q, k, v, pos, _runs_of(pos, 2) if ids == "step-2" else _runs_of(other))

    pos = torch.tensor([[0, 2, 4, 0, 1, 5, 7], [3, 5, 1, 6, 0, 1, 2]])
    other = torch.tensor([[0, 1, 2, 3, 4, 5, 6], [0, 1, 2, 0, 1, 2, 3]])
    assert masks_of(check(fn, [*qkv(7, 7), pos, other], rewritten=1)) == ["segments+bool-mask"]


def test_ids_on_one_axis_only_are_not_segments():
    """ids[i] == ids[i] along the query axis on both sides is no segment equality (no key-side ids)."""

    def fn(q, k, v, a, b):
        keep = a[:, None, :, None] == b[:, None, :, None]  # [B, 1, Nq, 1]: rows kept whole or dropped
        return torch.where(keep, _scores(q, k), torch.finfo(q.dtype).min).softmax(-1) @ v

    res = check(fn, [*qkv(6, 6), torch.tensor([[0, 1, 2, 3, 4, 5]] * 2), torch.tensor([[0, 1, 0, 3, 0, 5]] * 2)],
                rewritten=1)
    assert masks_of(res) == ["bool-mask"]


@pytest.mark.parametrize("kind", ["segments", "positions"])
def test_ids_and_positions_along_the_heads_axis_are_a_bool_mask(kind):
    """Ids / positions [H, N] whose leading axis lands on the heads (`m[None]`), not the batch: the op's q_seg /
    k_seg / q_pos are per batch row, so such a mask is a bool mask (with B == H the shapes would fit)."""

    def fn(q, k, v, ids):
        if kind == "segments":
            m = ids[:, :, None] == ids[:, None, :]  # [H, N, N]
        else:
            m = torch.arange(k.shape[-2])[None, None, :] <= ids[:, :, None]  # [H, Nq, Nk]
        return torch.softmax(_scores(q, k).masked_fill(~m[None], NEG_INF), -1) @ v

    ids = torch.tensor([[0, 0, 1, 1, 1, 2], [5, 5, 3, 3, 3, 3]]) if kind == "segments" else \
        torch.tensor([[5, 2, 4, 0, 3, 1], [3, 3, 1, 5, 0, 2]])
    assert B == H == ids.shape[0]
    assert masks_of(check(fn, [*qkv(6, 6), ids], rewritten=1)) == ["bool-mask"]


# ----------------------------------------------------------------------------- the rewritten graph

def _code(fn, *args) -> str:
    c = Compiled(fn)
    c(*args)
    return c.graphs[-1].code.strip()


def test_pinned_graph_cache_positions():
    def fn(q, k, v, pos):
        keep = torch.arange(k.shape[-2])[None, :] <= pos[:, None]
        return torch.where(keep, _scores(q, k), NEG_INF).softmax(-1) @ v

    expecttest.assert_expected_inline(_code(fn, *qkv(3, grad=False), torch.tensor([4, 5, 6])), """\
def forward(self, L_k_ : torch.Tensor, L_pos_ : torch.Tensor, L_q_ : torch.Tensor, L_v_ : torch.Tensor):
    l_k_ = L_k_
    l_pos_ = L_pos_
    l_q_ = L_q_
    l_v_ = L_v_
    getitem_1 = l_pos_[(slice(None, None, None), None)];  l_pos_ = None
    getitem_2 = getitem_1[(slice(None, None, None), 0)];  getitem_1 = None
    to = getitem_2.to(torch.int64, copy = True);  getitem_2 = None
    attention_default = torch.ops.fa3.attention.default(l_q_, l_k_, l_v_, 0.35355339059327373, False, 0, -1, -1, None, None, 0.0, 0.0, None, None, None, to, None, None);  l_q_ = l_k_ = l_v_ = to = None
    getitem_3 = attention_default[0]
    getitem_4 = attention_default[1];  attention_default = None
    isneginf = torch.isneginf(getitem_4);  getitem_4 = None
    unsqueeze = torch.unsqueeze(isneginf, -1);  isneginf = None
    full_like = torch.full_like(getitem_3, nan)
    where_1 = torch.where(unsqueeze, full_like, getitem_3);  unsqueeze = full_like = getitem_3 = None
    return (where_1,)""")


def test_pinned_graph_segments():
    def fn(q, k, v, seg):
        return torch.where(_seg_keep(seg), _scores(q, k), NEG_INF).softmax(-1) @ v

    seg = torch.tensor([[0, 0, 1, 1, 1, 2], [5, 3, 3, 5, 5, 5]])
    expecttest.assert_expected_inline(_code(fn, *qkv(6, 6, grad=False), seg), """\
def forward(self, L_seg_ : torch.Tensor, L_k_ : torch.Tensor, L_q_ : torch.Tensor, L_v_ : torch.Tensor):
    l_seg_ = L_seg_
    l_k_ = L_k_
    l_q_ = L_q_
    l_v_ = L_v_
    getitem = l_seg_[(slice(None, None, None), None, slice(None, None, None), None)]
    getitem_2 = getitem[(slice(None, None, None), 0, slice(None, None, None), 0)];  getitem = None
    to = getitem_2.to(torch.int64, copy = True);  getitem_2 = None
    getitem_1 = l_seg_[(slice(None, None, None), None, None, slice(None, None, None))];  l_seg_ = None
    getitem_3 = getitem_1[(slice(None, None, None), 0, 0, slice(None, None, None))];  getitem_1 = None
    to_1 = getitem_3.to(torch.int64, copy = True);  getitem_3 = None
    attention_default = torch.ops.fa3.attention.default(l_q_, l_k_, l_v_, 0.35355339059327373, False, 0, -1, -1, None, None, 0.0, 0.0, None, None, None, None, to, to_1);  l_q_ = l_k_ = l_v_ = to = to_1 = None
    getitem_4 = attention_default[0]
    getitem_5 = attention_default[1];  attention_default = None
    isneginf = torch.isneginf(getitem_5);  getitem_5 = None
    unsqueeze = torch.unsqueeze(isneginf, -1);  isneginf = None
    full_like = torch.full_like(getitem_4, nan)
    where_1 = torch.where(unsqueeze, full_like, getitem_4);  unsqueeze = full_like = getitem_4 = None
    return (where_1,)""")


def test_explain_reports_query_positions():
    model = GptFast(torch.tril(torch.ones(L, L, dtype=torch.bool)))
    torch._dynamo.reset()
    report = fa_compile.explain(model, *qkv(3, grad=False), torch.tensor([4, 5, 6]))
    assert [s.mask for s in report.sites] == ["query-positions"]
    assert "query-positions" in report.table()


# ----------------------------------------------------------------------------- Hugging Face models

transformers = pytest.importorskip("transformers")


def tiny_llama(impl: str):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
                                   num_hidden_layers=2, vocab_size=97, max_position_embeddings=64, bos_token_id=1,
                                   eos_token_id=2, pad_token_id=0)
    return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=impl).eval()


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_hf_static_cache_chunks_and_decode(impl):
    """Prefill in two chunks then decode into a StaticCache with a left-padded 2-d attention_mask: the
    second chunk's mask (HF: kv_arange <= q_arange + cache offset, & padding) is query positions with
    the padding as a [B, 1, 1, Nk] key vector; decode's is a key length."""
    model = tiny_llama(impl)
    ids = torch.randint(3, 97, (B, 7), generator=torch.Generator().manual_seed(1))
    am = torch.ones(B, 16, dtype=torch.long)
    am[0, :2] = 0

    def run(forward):
        cache = transformers.StaticCache(config=model.config, max_cache_len=16)
        with torch.no_grad():
            return [forward(input_ids=ids[:, a:b], attention_mask=am, past_key_values=cache, use_cache=True).logits
                    for a, b in ((0, 3), (3, 6), (6, 7))]

    ref = run(model.forward)
    c = Compiled(model.forward, fullgraph=False)
    got = run(c)
    for x, y in zip(got, ref):
        torch.testing.assert_close(x, y, atol=2e-5, rtol=2e-5)
    assert not c.missed, c.missed
    masks = [r.mask for r in c.reports]
    assert masks == ["causal+bool-mask"] * 2 + ["query-positions+bool-mask"] * 2 + ["key-padding+bool-mask"] * 2
    chunk = [n for n in op_calls(c) if example_value(n.args[0]).shape[2] == 3 and len(n.args) > 15]
    assert chunk and all(tuple(example_value(n.args[8]).shape) == (B, 1, 1, 16) for n in chunk)


def test_hf_sliding_window_static_cache_chunks_recompiled_with_symbolic_lengths():
    """A sliding-window model's chunked prefill into a StaticCache: the second chunk recompiles with a symbolic query
    length, and the mask's diagonal offset is built from the cache's SymInt length plus a multiple of it. Those size
    nodes need example values of their own (emit.set_example_value without a tensor): the site was refused with
    "rewrite failed: ... diag_offset ... NoneType"."""
    torch.manual_seed(0)
    cfg = transformers.MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                     num_attention_heads=4, num_key_value_heads=2, sliding_window=4, pad_token_id=0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()
    ids = torch.randint(3, 64, (B, 10), generator=torch.Generator().manual_seed(1))
    am = torch.ones(B, 10, dtype=torch.long)
    am[0, :5] = 0

    def run(forward):
        cache = transformers.StaticCache(config=model.config, max_cache_len=16)
        with torch.no_grad():
            return [forward(input_ids=ids[:, a:b], attention_mask=am[:, :b], past_key_values=cache,
                            cache_position=torch.arange(a, b)).logits for a, b in ((0, 6), (6, 10))]

    ref = run(model.forward)
    c = Compiled(model.forward, fullgraph=False)
    got = run(c)
    for x, y in zip(got, ref):
        torch.testing.assert_close(x, y, atol=2e-5, rtol=2e-5)
    assert len(c.reports) == 2 and not c.missed, [r.reason for r in c.reports]


def test_hf_static_cache_generate_tokens_equal_eager():
    model = tiny_llama("eager")
    ids = torch.randint(3, 97, (B, 7), generator=torch.Generator().manual_seed(1))
    am = torch.ones_like(ids)
    am[0, :2] = 0

    def greedy():
        return model.generate(ids, attention_mask=am, max_new_tokens=4, min_new_tokens=4, do_sample=False,
                              cache_implementation="static")

    ref = greedy()
    c = Compiled(model.forward, fullgraph=False, dynamic=False)
    model.forward = c
    out = greedy()
    assert torch.equal(out, ref)
    assert c.rewritten and not c.missed, c.reports


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_hf_packed_sequences_from_restarting_position_ids(impl):
    """No attention_mask, position ids that restart: HF's find_packed_sequence_indices ids compared
    along queries and keys are segments (training: gradients of every parameter equal eager's)."""
    model = tiny_llama(impl).train()
    ids = torch.randint(3, 97, (B, 7), generator=torch.Generator().manual_seed(1))
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1], [0, 1, 2, 3, 0, 1, 2]])

    class Wrap(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.m = model

        def forward(self, i, p):
            return self.m(input_ids=i, position_ids=p, use_cache=False).logits

    res = check(Wrap(), [ids, pos], inner="aot_eager")
    assert res.rewritten and masks_of(res) == ["causal+segments"] * 2, res.reports


# ------------------------------------------------------------------ key lengths: the value eager's mask read

def lengths_advanced_after_the_mask(q, k, v, lens):
    keep = (torch.arange(k.shape[2])[None, :] < lens[:, None])[:, None, None, :]
    lens.add_(2)  # a server advancing its lengths: eager's mask holds the old ones
    return F.scaled_dot_product_attention(q, k, v, attn_mask=keep)


def int8_lengths(q, k, v, lens):
    keep = (torch.arange(k.shape[2])[None, :] < lens.to(torch.int8)[:, None])[:, None, None]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=keep)


def uint8_lengths_inclusive(q, k, v, lens):
    keep = (torch.arange(k.shape[2])[None, :] <= lens[:, None])[:, None, None]  # 255: every key
    return F.scaled_dot_product_attention(q, k, v, attn_mask=keep)


def positions_two_ahead(q, k, v, cp):
    keep = (torch.arange(k.shape[2])[None, :] - 2 <= cp[:, None])[None, None]  # key j for query i: j - 2 <= cp[i]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=keep)


INT64_MAX = torch.iinfo(torch.int64).max


@pytest.mark.parametrize("fn,lens", [
    (lengths_advanced_after_the_mask, torch.tensor([5, 9])),
    (int8_lengths, torch.tensor([1, 12])),
    (uint8_lengths_inclusive, torch.tensor([255, 3], dtype=torch.uint8)),
    (uint8_lengths_inclusive, torch.tensor([INT64_MAX, 3])),
    (positions_two_ahead, torch.tensor([INT64_MAX, 1, 5, INT64_MAX - 1, 0, -3, 2, 9])),
], ids=["written_after_the_mask", "int8", "uint8_255_inclusive", "int64_max_inclusive", "int64_max_positions"])
def test_key_lengths_keep_eagers_value(fn, lens):
    """The op reads key lengths at the site in int32: not after a write eager's mask did not see, and widened
    before the mask's offset and the clamp (an int8 length clamped to 2**31 - 1 in int8, 255 + 1 in uint8 wrap)."""
    nq = len(lens) if fn is positions_two_ahead else 1
    res = check(fn, qkv(nq) + [lens], grad=True)
    assert fa_compile.explain(fn, *[x.detach() for x in qkv(nq)], lens.clone()).sites  # explain runs as well
    if fn is lengths_advanced_after_the_mask:
        assert all(r.mask != "key-padding" for r in res.reports), masks_of(res)
    else:
        assert masks_of(res) == ["query-positions" if fn is positions_two_ahead else "key-padding"]
