"""Single-query attention written without a query axis (patterns/query_axis.py): scores `[..., Nk]` from a
query vector, softmax over the keys, the probabilities applied to V, read as a `[..., 1, Nk]` attention.

Each spelling is compared with eager on fresh random inputs (output, inputs afterwards, every gradient) and must be
rewritten; spellings the edit must not touch keep eager's graph and results.
"""
from __future__ import annotations

import math

import expecttest
import torch
import torch.nn.functional as F

from eager_diff import check, rand
from test_patterns_softmax import pinned

B, H, N, D = 2, 3, 7, 8


def vec_kv(grad=True, seed=0):
    q = rand(B, H, D, seed=seed, requires_grad=grad)
    k = rand(B, H, N, D, seed=seed + 1, requires_grad=grad)
    v = rand(B, H, N, D, seed=seed + 2, requires_grad=grad)
    return [q, k, v]


def keep_mask():
    keep = torch.ones(B, N, dtype=torch.bool)
    keep[1, 4:] = False
    return keep


def einsum_vector(q, k, v):
    s = torch.einsum("bhd,bhkd->bhk", q, k) * D ** -0.5
    return torch.einsum("bhk,bhkd->bhd", s.softmax(-1), v)


def einsum_vector_padded(q, k, v, keep):
    s = torch.einsum("bhd,bhkd->bhk", q, k) / math.sqrt(D)
    s = s.masked_fill(~keep[:, None, :], float("-inf"))
    p = F.softmax(s.float(), dim=-1).type_as(q)
    return torch.einsum("bhk,bhdk->bhd", p, v.transpose(-1, -2))  # V kept as [B, H, D, N]


def luong(h, enc, keep):  # seq2seq: one decoder state per sequence over the encoder's outputs
    s = torch.bmm(enc, h.unsqueeze(2)).squeeze(2)
    s = s.masked_fill(~keep, -1e9)
    p = torch.softmax(s, dim=1)
    return torch.bmm(p.unsqueeze(1), enc).squeeze(1)


def matmul_column(q, k, v, bias):  # q as a column, an additive per-head bias over the keys, dropout in eval
    s = (k @ q.unsqueeze(-1)).squeeze(-1) / 4 + bias
    p = F.dropout(s.softmax(-1), p=0.1, training=False)
    return (p.unsqueeze(-2) @ v).squeeze(-2)


def matmul_row(q, k, v):  # q as a row: squeeze(q.unsqueeze(-2) @ kᵀ, -2)
    s = torch.matmul(q.unsqueeze(-2), k.transpose(-1, -2)).squeeze(-2) * 0.3
    return torch.matmul(torch.softmax(s, -1).unsqueeze(-2), v).squeeze(-2)


def test_einsum_vector_query():
    res = check(einsum_vector, vec_kv(), rewritten=1)
    assert res.rewritten[0].mask == "none"


def test_einsum_vector_query_with_key_padding_and_transposed_values():
    check(einsum_vector_padded, vec_kv() + [keep_mask()], rewritten=1)


def test_luong_bmm():
    h = rand(B, D, seed=3, requires_grad=True)
    enc = rand(B, N, D, seed=4, requires_grad=True)
    res = check(luong, [h, enc, keep_mask()], rewritten=1)
    assert res.rewritten[0].mask != "none"


def test_matmul_column_query_with_a_bias():
    bias = rand(H, N, seed=5, requires_grad=True)  # learnable, broadcast over the batch
    check(matmul_column, vec_kv() + [bias], rewritten=1)


def test_matmul_row_query():
    check(matmul_row, vec_kv(), rewritten=1)


def test_inductor_and_half_precision():
    check(einsum_vector_padded, vec_kv() + [keep_mask()], inner="inductor", rewritten=1)
    q, k, v = (t.detach().to(torch.bfloat16).requires_grad_() for t in vec_kv())
    check(matmul_row, [q, k, v], dtype=torch.bfloat16, rewritten=1)


# ------------------------------------------------- the product where eager took it: writes, grad modes, autocast

def written_between_product_and_squeeze(q, k, v):
    q = q * 1
    m = k @ q.unsqueeze(-1)
    q.add_(1.0)  # eager's scores were taken before this write
    s = m.squeeze(-1)
    return (s.softmax(-1).unsqueeze(-2) @ v).squeeze(-2)


def product_without_grad(q, k, v):
    with torch.no_grad():
        m = k @ q.unsqueeze(-1)  # no gradient reaches q or k
    return (m.squeeze(-1).softmax(-1).unsqueeze(-2) @ v).squeeze(-2)


def product_under_autocast(q, k, v):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        m = k @ q.unsqueeze(-1)  # bf16 scores
    return (m.squeeze(-1).float().softmax(-1).unsqueeze(-2) @ v).squeeze(-2)


def refused_beside_a_rewritten_site(q, k, v, w):
    s = (k @ q.unsqueeze(-1)).squeeze(-1) * w  # a factor varying along the keys: refused
    y1 = (s.softmax(-1).unsqueeze(-2) @ v).squeeze(-2)
    y2 = torch.einsum("bhk,bhkd->bhd", torch.einsum("bhd,bhkd->bhk", q, k).softmax(-1), v)
    return y1 + y2


def test_a_write_between_the_product_and_its_squeeze():
    check(written_between_product_and_squeeze, vec_kv(grad=False))  # (with grad, eager's backward refuses the write)


def test_grad_mode_and_autocast_regions_around_the_product():
    check(product_without_grad, vec_kv())
    check(product_under_autocast, vec_kv())


def test_an_edited_site_that_is_refused_beside_a_rewritten_one():
    res = check(refused_beside_a_rewritten_site, vec_kv() + [rand(N, seed=6) + 2.0], rewritten=1)
    assert any("varies along the key axis" in r for r in res.reasons), res.reasons


# -------------------------------------------------------------------------------- left as written

def probabilities_returned(q, k, v):
    p = torch.einsum("bhd,bhkd->bhk", q, k).softmax(-1)
    return torch.einsum("bhk,bhkd->bhd", p, v), p


def softmax_over_heads(q, k, v):  # normalised over dim 1 (the heads), not the keys: not attention
    s = torch.einsum("bhd,bhkd->bhk", q, k)
    return torch.einsum("bhk,bhkd->bhd", s.softmax(1), v)


def unsqueezed_elsewhere(q, k, v):  # p.unsqueeze(1) @ ...: not the P·V of the keys
    p = torch.einsum("bhd,bhkd->bhk", q, k).softmax(-1)  # [B, H, N]
    return (p.unsqueeze(1) @ v.transpose(1, 2).reshape(B, 1, N, H * D)).squeeze(1)


def test_probabilities_read_elsewhere_are_left_alone():
    check(probabilities_returned, vec_kv(), rewritten=0)


def test_other_softmax_axes_and_products_are_left_alone():
    check(softmax_over_heads, vec_kv(), rewritten=0)
    check(unsqueezed_elsewhere, vec_kv(), rewritten=0)


class TestPinnedQueryAxis(expecttest.TestCase):
    def test_pinned_luong(self):
        h, enc = rand(B, D, seed=3), rand(B, N, D, seed=4)
        self.assertExpectedInline(pinned(luong, h, enc, keep_mask()), """\
unsqueeze(l_h_, 2)
invert(l_keep_)
unsqueeze(invert, -2)
logical_not(unsqueeze_2)
permute(unsqueeze, (0, 2, 1))
unsqueeze(permute, 1)
unsqueeze(l_enc_, 1)
unsqueeze(l_enc_, 1)
unsqueeze(logical_not, 1)
transpose(unsqueeze_6, -2, -1)
where(transpose_2, unsqueeze_4, 0.0)
where(unsqueeze_6, 0.0, -1000000000.0)
to(where_1, torch.float32)
fa3.attention(unsqueeze_3, where, unsqueeze_5, 1.0, False, 0, -1, -1, to, None, 0.0, 0.0, None, None)
getitem(attention_default, 0)
squeeze(getitem, 1)
squeeze(squeeze_2, 1)""")
