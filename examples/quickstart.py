"""fa-compile in one minute: compile a model whose attention is hand-written, see what was rewritten.

    python examples/quickstart.py
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

import fa_compile


class CausalSelfAttention(nn.Module):
    """nanoGPT-style attention, written the way many models write it: no SDPA anywhere."""

    def __init__(self, dim: int, heads: int, block: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.register_buffer("mask", torch.tril(torch.ones(block, block)).view(1, 1, block, block))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.mask[:, :, :t, :t] == 0, float("-inf"))
        att = F.softmax(att, dim=-1)
        y = att @ v
        return self.proj(y.transpose(1, 2).contiguous().view(b, t, c))


class GQAttention(nn.Module):
    """Llama-style grouped-query attention with repeat_kv and an upcast softmax."""

    def __init__(self, dim: int, heads: int, kv_heads: int):
        super().__init__()
        self.h, self.hkv, self.d = heads, kv_heads, dim // heads
        self.q = nn.Linear(dim, dim, bias=False)
        self.kv = nn.Linear(dim, 2 * kv_heads * self.d, bias=False)
        self.o = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q(x).view(b, t, self.h, self.d).transpose(1, 2)
        k, v = self.kv(x).view(b, t, 2, self.hkv, self.d).permute(2, 0, 3, 1, 4)
        rep = self.h // self.hkv
        k = k[:, :, None].expand(b, self.hkv, rep, t, self.d).reshape(b, self.h, t, self.d)
        v = v[:, :, None].expand(b, self.hkv, rep, t, self.d).reshape(b, self.h, t, self.d)
        s = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(self.d)
        causal = torch.full((t, t), float("-inf"), device=x.device).triu(1)
        p = F.softmax(s + causal, dim=-1, dtype=torch.float32).to(q.dtype)
        return self.o(torch.matmul(p, v).transpose(1, 2).reshape(b, t, -1))


class Model(nn.Module):
    def __init__(self, dim: int = 64, layers: int = 2, block: int = 64):
        super().__init__()
        self.layers = nn.ModuleList()
        for i in range(layers):
            self.layers.append(CausalSelfAttention(dim, 4, block) if i % 2 == 0 else GQAttention(dim, 4, 2))
        self.norms = nn.ModuleList(nn.LayerNorm(dim) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for norm, layer in zip(self.norms, self.layers):
            x = x + layer(norm(x))
        return x


def main() -> None:
    torch.manual_seed(0)
    model = Model().eval()
    x = torch.randn(2, 48, 64)

    report = fa_compile.explain(model, x)
    print(report.table())  # print(report) adds, per kernel, why it did not take a site
    kernels = sorted({row.kernel_fwd for row in report.rows if row.kernel_fwd})
    print(f"\neager calls of the op here ({x.device.type}, {str(x.dtype).removeprefix('torch.')}) run: {', '.join(kernels)}")

    # Under Inductor each site's kernel is chosen at compile time and called from the generated code
    # (on CPU aten's flash-attention kernel where it takes the site); FA_COMPILE_LOG=1 shows the choice.
    compiled = torch.compile(model, backend="fa3")
    with torch.no_grad():
        diff = (compiled(x) - model(x)).abs().max().item()
    print(f"max |compiled - eager| = {diff:.2e}")


if __name__ == "__main__":
    main()
