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
    assert site.q_shape == (2, 4, 16, 8) and site.k_shape == (2, 4, 16, 8) and site.dtype == "float32"
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


def test_location_is_module_path_and_source_line_for_every_form():
    """Hand-written (matmul) and SDPA sites alike: `<module path> at <file>:<line>`, one dtype spelling."""
    import torch.nn.functional as F

    class Attn(torch.nn.Module):
        def __init__(self, sdpa: bool):
            super().__init__()
            self.sdpa = sdpa

        def forward(self, q):
            if self.sdpa:
                return F.scaled_dot_product_attention(q, q, q, is_causal=True)
            return torch.softmax(q @ q.transpose(-2, -1), dim=-1) @ q

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList([Attn(False), Attn(True)])

        def forward(self, q):
            for layer in self.layers:
                q = layer(q)
            return q

    report = fa_compile.explain(Net(), torch.randn(1, 2, 8, 4))
    wheres = [s.where for s in report.sites]
    assert sorted(w.split(" at ")[0] for w in wheres) == ["layers.0", "layers.1"]
    assert all(w.split(" at ")[1].startswith("test_explain.py:") for w in wheres)
    assert {s.dtype for s in report.sites} == {"float32"}
    assert "torch.float32" not in str(report)


def test_counters_describe_the_graph_that_runs_after_a_dynamo_restart(capfd, monkeypatch):
    """dynamic=True makes a float argument a graph input; AOTAutograd then specializes it and Dynamo
    restarts the compile. The discarded first graph (its site refused for the symbolic float) is not counted."""
    import torch.nn.functional as F
    from torch._dynamo.utils import counters

    def f(q, k, v, p):
        return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)

    torch._dynamo.reset()
    counters["fa_compile"].clear()
    monkeypatch.setenv("FA_COMPILE_LOG", "1")
    compiled = torch.compile(f, backend=fa_compile.backend("aot_eager"), dynamic=True)
    q, k, v = (torch.randn(1, 2, 8, 4, requires_grad=True) for _ in range(3))
    out = compiled(q, k, v, 0.0)
    out.sum().backward()
    torch.testing.assert_close(out, f(q, k, v, 0.0))
    assert dict(counters["fa_compile"]) | {"lowered": 0} == {"graphs": 1, "sites_rewritten": 1, "sites_missed": 0,
                                                             "lowered": 0}
    log = capfd.readouterr().err
    assert "fa-compile: 1 of 1 attention sites rewritten" in log and "0 of 1" not in log
    torch._dynamo.reset()


def _probs_then_break(q, k, v):
    p = torch.softmax(q @ k.transpose(-2, -1) * 0.25, -1)
    torch._dynamo.graph_break()
    return p @ v


def test_graph_break_between_softmax_and_pv_is_named():
    q, k, v = (torch.randn(1, 2, 8, 4) for _ in range(3))
    torch._dynamo.reset()
    report = fa_compile.explain(_probs_then_break, q, k, v)
    (miss,) = report.missed
    assert "the probabilities leave the graph at a graph break" in miss.reason, miss.reason
    assert "torch._dynamo.graph_break()" in miss.reason and "test_explain.py:" in miss.reason
    assert "output_attentions" not in miss.reason
    torch._dynamo.reset()


def test_output_attentions_names_the_returned_weights():
    def f(q, k, v):
        p = torch.softmax(q @ k.transpose(-2, -1) * 0.25, -1)
        return p @ v, p  # what output_attentions=True returns

    q, k, v = (torch.randn(1, 2, 8, 4) for _ in range(3))
    torch._dynamo.reset()
    report = fa_compile.explain(f, q, k, v)
    (miss,) = report.missed
    assert "probabilities are also returned to the caller (output_attentions)" in miss.reason
    assert "as output 1 of the compiled graph besides the P·V product" in miss.reason, miss.reason
    assert "graph break" not in miss.reason
    torch._dynamo.reset()
