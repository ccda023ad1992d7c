"""The installed package: lazy imports, what help() and dir() show, metadata, and a CPU install without triton."""
from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

import fa_compile

ROOT = Path(__file__).resolve().parents[1]


def run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


def test_dir_and_help_show_the_public_names():
    assert set(fa_compile.__all__) <= set(dir(fa_compile))
    doc = fa_compile.__doc__
    for name in fa_compile.__all__:
        assert name in doc
    for name in ("backend", "explain", "attention"):
        assert getattr(fa_compile, name).__doc__


def test_import_stays_lazy():
    out = run("import sys, fa_compile; print(sorted(m for m in ('torch', 'transformers', 'triton', "
              "'fa_compile.compiler', 'fa_compile.ops') if m in sys.modules))")
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


def test_runs_without_triton():
    """A CPU-only install has no triton (it is the [gpu] extra): eager op, explain() and compile still work."""
    code = (
        "import sys; sys.modules['triton'] = None\n"  # every `import triton` now raises ImportError
        "import torch, fa_compile\n"
        "q = torch.randn(1, 2, 16, 8, requires_grad=True)\n"
        "fa_compile.attention(q, q, q, causal=True).sum().backward()\n"
        "f = lambda q: torch.softmax(q @ q.transpose(-1, -2), -1) @ q\n"
        "assert '1 of 1 attention sites rewritten' in str(fa_compile.explain(f, q))\n"
        "torch.testing.assert_close(torch.compile(f, backend=fa_compile.backend('aot_eager'))(q), f(q))\n"
        "from fa_compile.__main__ import main; assert main([]) == 0\n"
    )
    out = run(code)
    assert out.returncode == 0, out.stderr
    assert "triton     not here: triton not installed" in out.stdout


def test_metadata_license_and_typing():
    meta = importlib.metadata.metadata("fa-compile")
    assert (ROOT / "LICENSE").read_text().startswith("BSD 3-Clause License")
    assert (ROOT / "fa_compile" / "py.typed").exists()
    text = (ROOT / "pyproject.toml").read_text()
    assert 'license = "BSD-3-Clause"' in text and '"torch>=2.11"' in text and "gpu = [" in text
    assert meta["Name"] == "fa-compile"
