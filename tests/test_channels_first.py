"""Attention over channels-first feature maps, as convolutional U-Nets and autoencoders write it: the values kept as
`[B, C, HW]` and the probabilities applied from the right (`bmm(v, p.permute(0, 2, 1))`, the latent-diffusion
autoencoder's `AttnBlock`) or by an einsum whose output puts the channels first (`einsum("bts,bcs->bct", p, v)`,
the guided-diffusion `QKVAttention`). Both are the usual P·V product transposed (patterns/transposed_pv.py).
Compared with eager on fresh random inputs: output and every gradient, modules' parameters included.
"""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from eager_diff import check, rand


class AttnBlock(nn.Module):
    """Single-head spatial self-attention over a feature map, values applied as v · pᵀ."""

    def __init__(self, c: int, permute: bool):
        super().__init__()
        self.norm = nn.GroupNorm(2, c)
        self.q, self.k, self.v, self.proj = (nn.Conv2d(c, c, 1) for _ in range(4))
        self.permute = permute

    def forward(self, x):
        h = self.norm(x)
        q, k, v = self.q(h), self.k(h), self.v(h)
        b, c, hh, ww = q.shape
        q = q.reshape(b, c, hh * ww).permute(0, 2, 1)  # [B, HW, C]
        k = k.reshape(b, c, hh * ww)  # [B, C, HW]
        w = torch.softmax(torch.bmm(q, k) * int(c) ** -0.5, dim=2)
        w = w.permute(0, 2, 1) if self.permute else w.transpose(1, 2)
        o = torch.bmm(v.reshape(b, c, hh * ww), w).reshape(b, c, hh, ww)  # [B, C, HW]
        return x + self.proj(o)


class QKVAttention(nn.Module):
    """Multi-head attention over a packed [B, 3 * H * C, T] tensor, channels first throughout."""

    def __init__(self, heads: int, out_letters: str):
        super().__init__()
        self.heads, self.out = heads, out_letters

    def forward(self, qkv):
        bs, width, length = qkv.shape
        ch = width // (3 * self.heads)
        q, k, v = qkv.reshape(bs * self.heads, ch * 3, length).split(ch, dim=1)
        scale = 1 / math.sqrt(math.sqrt(ch))
        weight = torch.einsum("bct,bcs->bts", q * scale, k * scale)
        weight = torch.softmax(weight.float(), dim=-1).type(weight.dtype)
        if self.out == "bct":
            a = torch.einsum("bts,bcs->bct", weight, v)
        else:  # the values first among the operands
            a = torch.einsum("bcs,bts->bct", v, weight)
        return a.reshape(bs, -1, length)


@pytest.mark.parametrize("permute", [True, False], ids=["permute", "transpose"])
def test_attn_block_values_applied_from_the_right(permute):
    torch.manual_seed(0)
    x = rand(2, 4, 3, 5, seed=1, requires_grad=True)
    res = check(AttnBlock(4, permute), [x], rewritten=1)
    assert res.rewritten[0].mask == "none"


@pytest.mark.parametrize("letters", ["bct", "v first"])
def test_qkv_attention_with_a_channels_first_output(letters):
    x = rand(2, 3 * 2 * 4, 6, seed=2, requires_grad=True)
    check(QKVAttention(2, letters), [x], rewritten=1)


def test_qkv_attention_under_inductor():
    x = rand(2, 3 * 2 * 4, 6, seed=3, requires_grad=True)
    check(QKVAttention(2, "bct"), [x], inner="inductor", rewritten=1)


def unbatched_mm(q, k, v):  # one 2-D attention written with torch.mm, the values [C, N] applied as v · pᵀ
    p = torch.softmax(torch.mm(q, k.t()) * 0.5, dim=-1)
    return torch.mm(v, p.t())


def test_unbatched_mm_with_values_applied_from_the_right():
    q, k = rand(5, 4, seed=1, requires_grad=True), rand(6, 4, seed=2, requires_grad=True)
    check(unbatched_mm, [q, k, rand(4, 6, seed=3, requires_grad=True)], rewritten=1)


def permute_of_other_axes(q, k, v):  # a permute that moves the batch: not P·V transposed, left as written
    p = torch.softmax(q @ k.transpose(-1, -2) * 0.25, -1)  # [B, N, N]
    return torch.bmm(v.permute(0, 2, 1), p.permute(2, 1, 0).contiguous()[:, :, : v.shape[0]].permute(2, 0, 1))


def test_other_permutes_are_not_read_as_a_transpose():
    q, k, v = (rand(3, 3, 4, seed=i, requires_grad=True) for i in range(3))
    check(permute_of_other_axes, [q, k, v], rewritten=0)
