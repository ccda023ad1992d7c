"""The backend: by name without an import, the FA_COMPILE switches, inner compilers, modes, training."""
from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch._dynamo.utils import counters

import fa_compile


def attn(q, k, v):
    return torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), dim=-1) @ v


class Block(torch.nn.Module):
    """A small pre-norm transformer block with hand-written causal attention."""

    def __init__(self, dim: int = 32, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.norm = torch.nn.LayerNorm(dim)
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.proj = torch.nn.Linear(dim, dim)

    def forward(self, x):
        b, n, c = x.shape
        q, k, v = self.qkv(self.norm(x)).split(c, dim=-1)
        q, k, v = (t.view(b, n, self.heads, c // self.heads).transpose(1, 2) for t in (q, k, v))
        s = (q @ k.transpose(-2, -1)) * (c // self.heads) ** -0.5
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=x.device).triu(1), float("-inf"))
        y = torch.softmax(s, dim=-1) @ v
        return x + self.proj(y.transpose(1, 2).reshape(b, n, c))


def qkv(seed=0, shape=(2, 4, 16, 8)):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(*shape, generator=g) for _ in range(3))


def run_python(code: str, **env) -> subprocess.CompletedProcess:
    """`code` in a fresh interpreter; Inductor's caches off unless `env` turns them on (a cache hit
    skips the passes, and so the counters that the scripts print)."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("FA_COMPILE")}
    full_env.update(TORCHINDUCTOR_FX_GRAPH_CACHE="0", TORCHINDUCTOR_AUTOGRAD_CACHE="0")
    full_env.update(env)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env=full_env, timeout=600)


SCRIPT = """
    import math, sys, torch
    EARLY = "fa_compile.compiler" in sys.modules
    from torch._dynamo.utils import counters
    def attn(q, k, v):
        return torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), dim=-1) @ v
    q, k, v = (torch.randn(2, 4, 16, 8) for _ in range(3))
    out = torch.compile(attn, backend={backend!r})(q, k, v)
    torch.testing.assert_close(out, attn(q, k, v))
    print("imported-early", EARLY)
    print("rewritten", counters["fa_compile"]["sites_rewritten"])
"""


def test_backend_by_name_in_a_fresh_interpreter():
    r = run_python(SCRIPT.format(backend="fa3"))
    assert r.returncode == 0, r.stderr
    assert "imported-early False" in r.stdout  # nothing of ours ran before torch.compile asked for "fa3"
    assert "rewritten 1" in r.stdout


def test_env_opt_in_rewrites_default_torch_compile():
    r = run_python(SCRIPT.format(backend="inductor"), FA_COMPILE="1")
    assert r.returncode == 0, r.stderr
    assert "rewritten 1" in r.stdout


def test_without_the_flag_default_torch_compile_is_untouched_and_nothing_loads():
    code = textwrap.dedent(SCRIPT.format(backend="inductor")) + "\nprint('loaded', 'fa_compile.compiler' in sys.modules)\n"
    r = run_python(code)
    assert r.returncode == 0, r.stderr
    assert "rewritten 0" in r.stdout and "loaded False" in r.stdout


def test_kill_switch_disables_backend_fa3():
    r = run_python(SCRIPT.format(backend="fa3"), FA_COMPILE="0")
    assert r.returncode == 0, r.stderr
    assert "rewritten 0" in r.stdout


def test_compile_log_prints_the_site_table():
    r = run_python(SCRIPT.format(backend="fa3"), FA_COMPILE_LOG="1")
    assert r.returncode == 0, r.stderr
    assert "1 of 1 attention sites rewritten" in r.stderr


@pytest.mark.parametrize("inner", ["eager", "aot_eager", "inductor"])
def test_inner_compilers_train_like_eager(inner):
    torch.manual_seed(0)
    model = Block()
    ref_model = Block()
    ref_model.load_state_dict(model.state_dict())
    x = torch.randn(2, 12, 32)
    counters.clear()
    out = torch.compile(model, backend=fa_compile.backend(inner), fullgraph=True)(x)
    ref = ref_model(x)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert counters["fa_compile"]["sites_rewritten"] == 1
    out.square().sum().backward()
    ref.square().sum().backward()
    for (name, p), p_ref in zip(model.named_parameters(), ref_model.parameters()):
        torch.testing.assert_close(p.grad, p_ref.grad, atol=1e-4, rtol=1e-4, msg=name)


def test_no_graph_breaks_added():
    torch._dynamo.reset()
    counters.clear()
    model = Block()
    torch.compile(model, backend="fa3")(torch.randn(2, 8, 32))
    assert counters["stats"]["unique_graphs"] == 1
    assert sum(counters["graph_break"].values()) == 0
    assert counters["fa_compile"]["sites_rewritten"] == 1


@pytest.mark.parametrize("mode", ["reduce-overhead", "max-autotune-no-cudagraphs"])
def test_modes_pass_through_to_inductor(mode, monkeypatch):
    import torch._inductor

    seen = []
    real = torch._inductor.list_mode_options
    monkeypatch.setattr(torch._inductor, "list_mode_options", lambda m=None, d=None: seen.append(m) or real(m, d))
    torch._dynamo.reset()
    q, k, v = qkv(1)
    out = torch.compile(attn, backend="fa3", mode=mode)(q, k, v)
    torch.testing.assert_close(out, attn(q, k, v), atol=1e-5, rtol=1e-5)
    assert mode in seen


def test_dynamic_true_serves_other_lengths():
    torch._dynamo.reset()
    counters.clear()
    f = torch.compile(attn, backend="fa3", dynamic=True)
    for n in (12, 11, 17):  # not 8: duck sizing would tie N to the head dim at the first call
        q, k, v = qkv(n, (2, 4, n, 8))
        torch.testing.assert_close(f(q, k, v), attn(q, k, v), atol=1e-5, rtol=1e-5)
    assert counters["stats"]["unique_graphs"] == 1
    assert counters["fa_compile"]["sites_rewritten"] == 1


def test_forced_kernel_and_bad_options_name_the_argument():
    q, k, v = qkv(2)
    out = torch.compile(attn, backend=fa_compile.backend("eager", kernel="reference"))(q, k, v)
    torch.testing.assert_close(out, attn(q, k, v), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="inner"):
        fa_compile.backend("tvm")
    with pytest.raises(ValueError, match="mode, options"):
        fa_compile.backend("eager", mode="max-autotune")
    with pytest.raises(ValueError, match="^kernel: unknown kernel 'nope'"):
        fa_compile.backend("eager", kernel="nope")
    # explain takes the same kernel argument and checks it the same way, before tracing anything
    with pytest.raises(ValueError, match="^kernel: unknown kernel 'nope'"):
        fa_compile.explain(attn, q, k, v, kernel="nope")
    with pytest.raises(TypeError, match="^kernel: expected a kernel name"):
        fa_compile.explain(attn, q, k, v, kernel=3)
    # switches are bools: a string such as "false" would read as True (fp8 would round every site to e4m3)
    for kw in (dict(fp8="false"), dict(fp8=0), dict(lower="no"), dict(tune=1), dict(lower=None)):
        name = next(iter(kw))
        with pytest.raises(TypeError, match=f"^{name}: expected a bool"):
            fa_compile.backend(**kw)
    with pytest.raises(TypeError, match="^fp8: expected a bool or None"):
        fa_compile.explain(attn, q, k, v, fp8="0")
    for bad in ("x", [1]):  # (dict() of them raised "dictionary update sequence element #0 ...")
        with pytest.raises(TypeError, match="^options: a dict of Inductor config settings"):
            fa_compile.backend(options=bad)
    with pytest.raises(ValueError, match="^mode: .*fast"):  # at once, not at the first call
        fa_compile.backend(mode="fast")


VIEW_OF_OUTPUT = """
    import math, torch
    from torch._dynamo.utils import counters
    def f(q, k, v, w):
        o = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]), dim=-1) @ v
        y = o.transpose(1, 2).reshape(2, 16, 32) @ w
        return y, y.view(2, -1)  # an intermediate returned with a view of itself
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 16, 8, generator=g, requires_grad=True) for _ in range(3))
    w = torch.randn(32, 32, generator=g, requires_grad=True)
    got, want = torch.compile(f, backend="fa3")(q, k, v, w), f(q, k, v, w)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)
    ones = [torch.ones_like(t) for t in got]
    for a, b in zip(torch.autograd.grad(got, (q, k, v, w), ones), torch.autograd.grad(want, (q, k, v, w), ones)):
        torch.testing.assert_close(a, b)
    print("rewritten", counters["fa_compile"]["sites_rewritten"])
"""


def test_outputs_that_view_each_other_survive_a_warm_cache(tmp_path):
    """torch's AOTAutograd cache rebuilds, in a later process, an output that views another output with garbage
    sizes (with plain Inductor too: a RuntimeError or a crash): such graphs compile without that cache, so every
    process computes what the first did. The caches are left at their defaults, as a user has them."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FA_COMPILE", "TORCHINDUCTOR_"))}
    env["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path)
    for run in range(3):
        r = subprocess.run([sys.executable, "-c", textwrap.dedent(VIEW_OF_OUTPUT)], capture_output=True, text=True,
                           env=env, timeout=600)
        assert r.returncode == 0 and "rewritten 1" in r.stdout, (run, r.stdout, r.stderr[-2000:])


def test_only_outputs_over_one_storage_leave_the_autograd_cache():
    from fa_compile.compiler import _outputs_share_storage

    def traced(fn):
        graphs = []

        def grab(gm, example_inputs):
            graphs.append(gm)
            return gm.forward

        torch._dynamo.reset()
        torch.compile(fn, backend=grab, fullgraph=True)(torch.randn(4, 6))
        return graphs[0]

    assert _outputs_share_storage(traced(lambda x: (x.exp(), x.exp().view(-1)))) is False  # two storages
    assert _outputs_share_storage(traced(lambda x: (x.exp(), x.cos()))) is False
    y_and_view = traced(lambda x: (lambda y: (y, y.t()))(x.exp()))
    assert _outputs_share_storage(y_and_view) is True
    two_views = traced(lambda x: (lambda y: (y.view(-1), y[1:]))(x.exp()))
    assert _outputs_share_storage(two_views) is True
    from fa_compile.compiler import _autograd_cache_scope

    import torch._functorch.config as functorch_config

    if os.environ.get("TORCHINDUCTOR_AUTOGRAD_CACHE") == "1":
        pytest.skip("TORCHINDUCTOR_AUTOGRAD_CACHE=1 forces the cache over any patch")
    before = functorch_config.enable_autograd_cache
    for inputs, grad, off in (([torch.randn(2, requires_grad=True)], True, True),
                              ([torch.randn(2)], True, False),  # an inference graph keeps the cache
                              ([torch.randn(2, requires_grad=True)], False, False)):
        with torch.set_grad_enabled(grad), _autograd_cache_scope(y_and_view, inputs):
            assert functorch_config.enable_autograd_cache == (False if off else before)
    with _autograd_cache_scope(traced(lambda x: (x.exp(), x.cos())), [torch.randn(2, requires_grad=True)]):
        assert functorch_config.enable_autograd_cache == before
