"""fa_compile.explain(): every softmax site, rewritten or missed with its reason, as a table."""
from __future__ import annotations

import math

import torch

import fa_compile


class AttnThenClassifier(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.head = torch.nn.Linear(8, 3)

    def forward(self, q, k, v):
        y = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), dim=-1) @ v
        return torch.softmax(self.head(y), dim=-1)  # a softmax that is not attention


def test_explain_reports_rewritten_and_missed_sites():
    q, k, v = (torch.randn(2, 4, 16, 8) for _ in range(3))
    report = fa_compile.explain(AttnThenClassifier(), q, k, v)
    assert len(report.rows) == 2
    (site,) = report.rewritten
    assert site.q_shape == (2, 4, 16, 8) and site.k_shape == (2, 4, 16, 8) and site.dtype == "torch.float32"
    (miss,) = report.missed
    assert miss.reason
    text = str(report)
    assert "1 of 2 attention sites rewritten" in text
    assert "MISSED" in text and miss.reason in text
    assert "reference" in text  # the kernel dispatch picks for CPU inputs


def test_explain_shows_forward_and_backward_kernels_for_training_inputs():
    q, k, v = (torch.randn(1, 2, 8, 8, requires_grad=True) for _ in range(3))
    report = fa_compile.explain(lambda q, k, v: torch.softmax(q @ k.transpose(-2, -1), -1) @ v, q, k, v)
    (row,) = report.rows
    assert row.kernel_fwd == "reference" and row.kernel_bwd == "reference"
