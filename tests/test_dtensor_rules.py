"""DTensor sharding rules of the fa3 ops (fa_compile/distributed/sharding.py), on CPU with gloo, 2 ranks.

Each case runs the op (or a module) on full tensors (the oracle) and on DTensors of a 1-D mesh, and
compares the DTensor results, gathered with `full_tensor()`, with the oracle's outputs and gradients,
element by element; where the rules keep the placement (batch, heads, replicated) it is checked too.
One spawn runs every case; the parametrized tests read their case's result from it."""
from __future__ import annotations

import math
import traceback
import warnings

import pytest
import torch

from distributed_helpers import run_ranks

WORLD = 2


def _tol() -> dict:
    from conftest import TOL

    return TOL[torch.float32]


def _check(name: str, got, want: torch.Tensor) -> None:
    from torch.distributed.tensor import DTensor

    if isinstance(got, DTensor):
        got = got.full_tensor()
    torch.testing.assert_close(got, want, **_tol(), msg=lambda m: f"{name}: {m}")


def _placements(t) -> tuple:
    return tuple(t.placements)


def _op_case(mesh, seed: int, *, b=2, hq=4, hkv=2, n=8, d=8, place="batch", causal=False, bias=None, lens=False,
             sinks=False, window=(-1, -1), positions=False, expect=None, avoid=None, warns=None) -> None:
    """fa_compile.attention on DTensors placed per `place` (q, k, v, dout alike, or one per tensor) vs the
    full op: out, lse and the gradients of q, k, v (and of the bias / sinks when given)."""
    import fa_compile
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    named = {"batch": Shard(0), "heads": Shard(1), "replicate": Replicate(), "seq": Shard(2), "headdim": Shard(3)}
    qkv_places = [named[p] for p in (place if isinstance(place, tuple) else (place,) * 4)]
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, n, d, generator=g)
    k = torch.randn(b, hkv, n, d, generator=g)
    v = torch.randn(b, hkv, n, d, generator=g)
    dout = torch.randn(b, hq, n, d, generator=g)
    dlse = torch.randn(b, hq, n, generator=g)
    extra: dict = {}
    if bias == "heads":  # a float bias with a head dim, learned
        extra["bias"] = (torch.randn(b, hq, n, n, generator=g), Shard(1), True)
    elif bias == "broadcast":  # [Nq, Nk], learned: its gradient sums over batch and heads
        extra["bias"] = (torch.randn(n, n, generator=g), Replicate(), True)
    elif bias == "mask":  # a bool [B, 1, Nq, Nk] mask
        extra["bias"] = (torch.rand(b, 1, n, n, generator=g) > 0.3, Replicate(), False)
    if lens:
        extra["kv_lens"] = (torch.tensor([n - 3 - i for i in range(b)], dtype=torch.int32), Replicate(), False)
    if sinks:
        extra["sinks"] = (torch.randn(hq, generator=g), Replicate(), True)
    if positions:
        extra["q_pos"] = (torch.randint(0, n, (b, n), generator=g), Replicate(), False)
        extra["q_seg"] = (torch.randint(0, 2, (b, n), generator=g), Replicate(), False)
        extra["k_seg"] = (torch.randint(0, 2, (b, n), generator=g), Replicate(), False)

    def run(tensors: dict):
        leaves = {name: t.detach().requires_grad_(grad) for name, (t, grad) in tensors.items()
                  if name not in ("dout", "dlse")}
        main = [leaves.pop(name) for name in ("q", "k", "v")]
        out, lse = fa_compile.attention(*main, causal=causal, window=window, return_lse=True, **leaves)
        torch.autograd.backward([out, lse], [tensors["dout"][0], tensors["dlse"][0]])
        grads = {name: t.grad for name, t in zip(("q", "k", "v"), main)}
        grads.update({name: t.grad for name, t in leaves.items() if t.requires_grad})
        return out, lse, grads

    full = {"q": (q, True), "k": (k, True), "v": (v, True), "dout": (dout, False), "dlse": (dlse, False)}
    full.update({name: (t, grad) for name, (t, _, grad) in extra.items()})
    ref_out, ref_lse, ref_grads = run(full)
    dist_tensors = {}
    for (name, (t, grad)), p in zip(list(full.items())[:4], qkv_places):
        dist_tensors[name] = (distribute_tensor(t, mesh, [p]), grad)
    lse_place = qkv_places[3] if qkv_places[3] != Shard(3) else Replicate()
    dist_tensors["dlse"] = (distribute_tensor(dlse, mesh, [lse_place]), False)
    for name, (t, p, grad) in extra.items():
        dist_tensors[name] = (distribute_tensor(t, mesh, [p]), grad)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out, lse, grads = run(dist_tensors)
    messages = [str(w.message) for w in caught if "fa3.attention" in str(w.message)]
    if warns is None:
        assert not messages, messages
    else:
        assert any(warns in m for m in messages), messages
    _check("out", out, ref_out)
    _check("lse", lse, ref_lse)
    for name, want in ref_grads.items():
        _check(f"d{name}", grads[name], want)
    if avoid is not None:  # (heads that do not split into whole GQA groups)
        assert named[avoid] not in _placements(out) + _placements(lse), (_placements(out), _placements(lse))
    if expect is not None:
        assert _placements(out) == (named[expect],) and _placements(lse) == (named[expect],), \
            (_placements(out), _placements(lse))
        for name in ("q", "k", "v"):
            assert _placements(grads[name]) == (named[expect],), (name, _placements(grads[name]))


def _dropout_case(mesh, seed: int) -> None:
    """dropout_p > 0 runs replicated (see sharding.py): with the same seed, exactly the full op's result."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, 2, 8, 8, generator=g) for _ in range(3))
    seed_t = torch.tensor([1234], dtype=torch.int64)
    ref_out, ref_lse = torch.ops.fa3.attention(q, k, v, 0.3, dropout_p=0.25, dropout_seed=seed_t)
    dq, dk, dv = (distribute_tensor(t, mesh, [Shard(0)]) for t in (q, k, v))
    plain, _ = torch.ops.fa3.attention(dq, dk, dv, 0.3)  # the same DTensors first without dropout: batch
    assert _placements(plain) == (Shard(0),), _placements(plain)  # (dropout_p is in DTensor's cache key)
    out, lse = torch.ops.fa3.attention(dq, dk, dv, 0.3, dropout_p=0.25,
                                       dropout_seed=distribute_tensor(seed_t, mesh, [Replicate()]))
    assert _placements(out) == (Replicate(),), _placements(out)
    _check("out", out, ref_out)
    _check("lse", lse, ref_lse)


def _paged_case(mesh, seed: int, place: str, paged: bool) -> None:
    """fa3.paged_attention on batch- / head-sharded q and caches (a page pool stays replicated)."""
    import fa_compile
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    g = torch.Generator().manual_seed(seed)
    b, nq, hq, hkv, d, page = 2, 2, 4, 2, 8, 4
    q = torch.randn(b, nq, hq, d, generator=g)
    lens = torch.tensor([7, 5], dtype=torch.int32)
    if paged:
        kc, vc = (torch.randn(6, page, hkv, d, generator=g) for _ in range(2))
        table = torch.tensor([[4, 1], [0, 5]], dtype=torch.int32)
    else:
        kc, vc = (torch.randn(b, 8, hkv, d, generator=g) for _ in range(2))
        table = None
    ref_out, ref_lse = fa_compile.paged_attention(q, kc, vc, lens, table, causal=True, return_softmax_lse=True)
    shard = Shard(0) if place == "batch" else Shard(2)
    cache_place = Replicate() if paged and place == "batch" else shard
    dq = distribute_tensor(q, mesh, [shard])
    dk, dv = (distribute_tensor(t, mesh, [cache_place]) for t in (kc, vc))
    dl = distribute_tensor(lens, mesh, [Replicate()])
    dt = None if table is None else distribute_tensor(table, mesh, [Replicate()])
    out, lse = fa_compile.paged_attention(dq, dk, dv, dl, dt, causal=True, return_softmax_lse=True)
    assert _placements(out) == (shard,), _placements(out)
    _check("out", out, ref_out)
    _check("lse", lse, ref_lse)


class _Block(torch.nn.Module):
    """A pre-norm attention block with the attention written out (the fa3 pass rewrites it)."""

    def __init__(self, e: int, h: int, hkv: int, additive: bool = False) -> None:
        super().__init__()
        self.h, self.hkv, self.d, self.additive = h, hkv, e // h, additive
        self.norm = torch.nn.LayerNorm(e)
        self.q_proj = torch.nn.Linear(e, h * self.d, bias=False)
        self.k_proj = torch.nn.Linear(e, hkv * self.d, bias=False)
        self.v_proj = torch.nn.Linear(e, hkv * self.d, bias=False)
        self.o_proj = torch.nn.Linear(h * self.d, e, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        y = self.norm(x)
        # -1 for the head count: under tensor parallelism these are the local (or DTensor) views
        q = self.q_proj(y).view(b, n, -1, self.d).transpose(1, 2)
        k = self.k_proj(y).view(b, n, -1, self.d).transpose(1, 2)
        v = self.v_proj(y).view(b, n, -1, self.d).transpose(1, 2)
        groups = q.shape[1] // k.shape[1]
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
        s = q @ k.transpose(-1, -2) / math.sqrt(self.d)
        keep = torch.ones_like(s, dtype=torch.bool).tril()  # (like s: a DTensor under tensor parallelism)
        if self.additive:  # Hugging Face's eager spelling: an additive finfo.min mask
            s = s + torch.zeros_like(s).masked_fill(~keep, torch.finfo(s.dtype).min)
        else:
            s = s.masked_fill(~keep, float("-inf"))
        o = (torch.softmax(s, dim=-1) @ v).transpose(1, 2).reshape(b, n, -1)
        return x + self.o_proj(o)


def _tp_case(mesh, seed: int, how: str) -> None:
    """The block under a tensor-parallel plan whose q/k/v projections hand DTensors (Shard on heads) to the
    attention; "sp": with the layer norm sequence-parallel (Shard(1) activations around the attention).
    Compiled with the fa3 backend (its pass rewrites the attention to fa3.attention on DTensors), or eager."""
    import fa_compile
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, SequenceParallel,
                                                   parallelize_module)

    torch.manual_seed(seed)
    e, h, hkv, b, n = 16, 4, 2, 2, 8
    additive = how.endswith("_additive")
    ref = _Block(e, h, hkv, additive)
    model = _Block(e, h, hkv, additive)
    model.load_state_dict(ref.state_dict())
    sp = how.endswith("_sp")
    colwise = ColwiseParallel(input_layouts=Shard(1) if sp else Replicate(), use_local_output=False)
    plan = {"q_proj": colwise, "k_proj": colwise, "v_proj": colwise,
            "o_proj": RowwiseParallel(output_layouts=Shard(1) if sp else Replicate(), use_local_output=not sp)}
    if sp:
        plan["norm"] = SequenceParallel(use_local_output=False)
    parallelize_module(model, mesh, plan)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(b, n, e, generator=g)
    dy = torch.randn(b, n, e, generator=g)
    xr = x.detach().requires_grad_()
    ref(xr).backward(dy)
    xd = (distribute_tensor(x, mesh, [Shard(1)]) if sp else x.clone()).requires_grad_()
    fn = model
    if how.startswith(("compiled", "inductor")):
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        backend = "fa3" if how.startswith("inductor") else fa_compile.backend(inner="aot_eager")
        fn = torch.compile(model, backend=backend, fullgraph=True)
    y = fn(xd)
    if sp:
        assert _placements(y) == (Shard(1),), _placements(y)
    y.backward(distribute_tensor(dy, mesh, [Shard(1)]) if sp else dy)
    if fn is not model:
        assert torch._dynamo.utils.counters["fa_compile"]["sites_rewritten"] >= 1, "the site was not rewritten"
    _check("y", y, ref(x))
    _check("dx", xd.grad, xr.grad)
    for name, p in ref.named_parameters():
        _check(f"d{name}", model.get_parameter(name).grad, p.grad)


def _rewritten_case(mesh, seed: int) -> None:
    """The rewritten site's graph calls fa3.attention on head-sharded DTensors (DTensor would raise
    without a rule for it) and keeps them head-sharded."""
    from conftest import Compiled
    from torch.distributed.tensor import Shard, distribute_tensor

    def attn(q, k, v):
        s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        return torch.softmax(s, dim=-1) @ v

    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, 4, 8, 8, generator=g) for _ in range(3))
    fn = Compiled(attn, inner="eager")
    out = fn(*(distribute_tensor(t, mesh, [Shard(1)]) for t in (q, k, v)))
    assert len(fn.rewritten) == 1 and fn.op_calls() == 1, (fn.reports, fn.op_calls())
    assert _placements(out) == (Shard(1),), _placements(out)
    _check("out", out, attn(q, k, v))


def _row_fixup_case(mesh, seed: int, op: str, place: str) -> None:
    """The row fix-ups (value 0, the point is their gradient) on batch- / head-sharded DTensors: a bias
    with heads and a broadcast bool `filled` for filled_scores_grad; softcap > 0 (the dense backward)."""
    import fa_compile.row_fixups  # noqa: F401  (defines the ops)
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    g = torch.Generator().manual_seed(seed)
    b, hq, hkv, n, d = 2, 4, 2, 8, 8
    q = torch.randn(b, hq, n, d, generator=g)
    k, v = (torch.randn(b, hkv, n, d, generator=g) for _ in range(2))
    dg = torch.randn(b, hq, n, d, generator=g)
    bias = torch.randn(b, hq, n, n, generator=g)
    filled = torch.rand(1, 1, n, n, generator=g) > 0.5
    shard = Shard(0) if place == "batch" else Shard(1)

    def run(q, k, v, dg, bias, filled):
        q, k = q.detach().requires_grad_(), k.detach().requires_grad_()
        if op == "uniform_row_grad":
            out = torch.ops.fa3.uniform_row_grad(q, k, v, 0.5, 3.0)
        else:
            out = torch.ops.fa3.filled_scores_grad(q, k, v, bias, filled, 0.5, 3.0)
        out.backward(dg)
        return out, q.grad, k.grad

    want = run(q, k, v, dg, bias, filled)
    got = run(*(distribute_tensor(t, mesh, [shard]) for t in (q, k, v, dg, bias)),
              distribute_tensor(filled, mesh, [Replicate()]))
    for name, a, w in zip(("out", "dq", "dk"), got, want):
        assert _placements(a) == (shard,), (name, _placements(a))
        _check(name, a, w)


def _nan_row_grad_case(mesh, seed: int, place: str) -> None:
    """fa3.nan_row_grad (value 0; its backward puts eager's NaN gradients of empty rows back) on batch- / head-sharded
    DTensors, GQA: the value and q's, k's and v's NaN positions are the plain tensors'."""
    import fa_compile.row_fixups  # noqa: F401  (defines the op)
    from torch.distributed.tensor import Shard, distribute_tensor

    g = torch.Generator().manual_seed(seed)
    b, hq, hkv, n, d = 2, 4, 2, 8, 8
    q = torch.randn(b, hq, n, d, generator=g)
    k, v = (torch.randn(b, hkv, n, d, generator=g) for _ in range(2))
    empty = torch.zeros(b, hq, n, 1, dtype=torch.bool)
    empty[0, 3, 2] = empty[1, 0] = True
    dg = torch.randn(b, hq, n, d, generator=g)
    shard = Shard(0) if place == "batch" else Shard(1)

    def run(q, k, v, empty, dg):
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        out = torch.ops.fa3.nan_row_grad(q, k, v, empty, True)
        out.backward(dg)
        return out, q.grad, k.grad, v.grad

    want = run(q, k, v, empty, dg)
    assert all(w.isnan().any() for w in want[1:])
    got = run(*(distribute_tensor(t, mesh, [shard]) for t in (q, k, v, empty, dg)))
    for name, a, w in zip(("out", "dq", "dk", "dv"), got, want):
        assert _placements(a) == (shard,), (name, _placements(a))
        full = a.full_tensor()
        assert torch.equal(full.isnan(), w.isnan()), name
        torch.testing.assert_close(full, w, equal_nan=True, atol=0, rtol=0)


def _fp8_case(mesh, seed: int) -> None:
    """fa3.attention_fp8 on head-sharded fp16 DTensors (off the FP8 kernel it runs the exact fp16 op)."""
    import fa_compile.fp8  # noqa: F401  (defines the op)
    from torch.distributed.tensor import Shard, distribute_tensor

    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 4, 8, 8, generator=g).half()
    k, v = (torch.randn(2, 2, 8, 8, generator=g).half() for _ in range(2))
    ref_out, ref_lse = torch.ops.fa3.attention_fp8(q, k, v, 0.35, True)
    out, lse = torch.ops.fa3.attention_fp8(*(distribute_tensor(t, mesh, [Shard(1)]) for t in (q, k, v)), 0.35, True)
    assert _placements(out) == (Shard(1),), _placements(out)
    torch.testing.assert_close(out.full_tensor(), ref_out, atol=0, rtol=0)
    torch.testing.assert_close(lse.full_tensor(), ref_lse, atol=0, rtol=0)


CASES = {
    "batch": dict(place="batch", expect="batch", causal=True),
    "batch_uneven_lens": dict(b=3, place="batch", expect="batch", lens=True, bias="mask"),
    "batch_positions_segments": dict(place="batch", expect="batch", positions=True),
    "heads_gqa": dict(place="heads", expect="heads", causal=True),
    "heads_gqa_bias": dict(place="heads", expect="heads", bias="heads", lens=True),
    "heads_broadcast_bias": dict(place="heads", expect="heads", bias="broadcast", causal=True),
    "batch_broadcast_bias": dict(place="batch", expect="batch", bias="broadcast"),
    "heads_sinks_window": dict(place="heads", expect="heads", sinks=True, causal=True, window=(3, -1)),
    "replicated": dict(place="replicate", expect="replicate", causal=True, sinks=True, bias="broadcast"),
    "mqa_indivisible_heads": dict(hq=4, hkv=1, place="heads", avoid="heads"),  # Hkv = 1 cannot be split
    "gqa_uneven_heads": dict(b=1, hq=6, hkv=3, place="heads", avoid="heads"),
    "sequence_sharded": dict(place="seq", causal=True, warns="fa_compile.context_parallel"),
    "head_dim_sharded": dict(place="headdim", lens=True),
    "inconsistent": dict(place=("batch", "heads", "replicate", "batch"), causal=True, bias="heads"),
}
OTHER = ("dropout_replicated", "paged_batch", "paged_heads", "paged_pool_batch", "uniform_row_grad_heads",
         "filled_scores_grad_heads", "filled_scores_grad_batch", "nan_row_grad_heads", "nan_row_grad_batch", "fp8_op_heads", "rewritten_site",
         "tp_eager", "tp_compiled", "tp_eager_sp", "tp_inductor_sp", "tp_compiled_additive", "partial_inputs")


def _partial_case(mesh, seed: int) -> None:
    """Partial q / k / v (each rank holds a share of the sum) are reduced before the op runs."""
    from torch.distributed.tensor import DTensor, Partial

    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, 2, 8, 8, generator=g) for _ in range(3))
    rank = torch.distributed.get_rank()
    share = [(t * (0.25 if rank == 0 else 0.75)) for t in (q, k, v)]
    dq, dk, dv = (DTensor.from_local(t, mesh, [Partial()]) for t in share)
    out, lse = torch.ops.fa3.attention(dq, dk, dv, 0.4, True)
    ref_out, ref_lse = torch.ops.fa3.attention(q, k, v, 0.4, True)
    _check("out", out, ref_out)
    _check("lse", lse, ref_lse)


def _all_cases(rank: int, world: int) -> dict:
    import fa_compile  # noqa: F401  (installs the rules' import hooks)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    runs = {name: (lambda kw=kw: _op_case(mesh, 0, **kw)) for name, kw in CASES.items()}
    runs.update({
        "dropout_replicated": lambda: _dropout_case(mesh, 1),
        "paged_batch": lambda: _paged_case(mesh, 2, "batch", False),
        "paged_heads": lambda: _paged_case(mesh, 3, "heads", True),
        "paged_pool_batch": lambda: _paged_case(mesh, 4, "batch", True),
        "uniform_row_grad_heads": lambda: _row_fixup_case(mesh, 5, "uniform_row_grad", "heads"),
        "filled_scores_grad_heads": lambda: _row_fixup_case(mesh, 5, "filled_scores_grad", "heads"),
        "filled_scores_grad_batch": lambda: _row_fixup_case(mesh, 5, "filled_scores_grad", "batch"),
        "nan_row_grad_heads": lambda: _nan_row_grad_case(mesh, 11, "heads"),
        "nan_row_grad_batch": lambda: _nan_row_grad_case(mesh, 11, "batch"),
        "fp8_op_heads": lambda: _fp8_case(mesh, 10),
        "rewritten_site": lambda: _rewritten_case(mesh, 6),
        "tp_eager": lambda: _tp_case(mesh, 7, "eager"),
        "tp_compiled": lambda: _tp_case(mesh, 7, "compiled"),
        "tp_eager_sp": lambda: _tp_case(mesh, 8, "eager_sp"),
        "tp_inductor_sp": lambda: _tp_case(mesh, 8, "inductor_sp"),
        "tp_compiled_additive": lambda: _tp_case(mesh, 9, "compiled_additive"),
        "partial_inputs": lambda: _partial_case(mesh, 9),
    })
    results = {}
    for name, fn in runs.items():
        try:
            fn()
            results[name] = None
        except Exception:  # noqa: BLE001  (reported per case by the parent)
            results[name] = traceback.format_exc()
    return results


@pytest.fixture(scope="module")
def results() -> list:
    return run_ranks(WORLD, _all_cases, timeout=300)


@pytest.mark.parametrize("case", [*CASES, *OTHER])
def test_dtensor(results, case):
    for rank, got in enumerate(results):
        assert got[case] is None, f"rank {rank}:\n{got[case]}"


def test_import_does_not_load_dtensor():
    """`import fa_compile` (run at `import torch`) registers the rules lazily: no torch.distributed.tensor."""
    import subprocess
    import sys

    code = ("import sys, fa_compile, fa_compile.ops; "
            "print('torch.distributed.tensor' in sys.modules); "
            "import torch.distributed.tensor; from torch.distributed.tensor import DTensor; "
            "print(torch.ops.fa3.attention.default in DTensor._op_dispatcher.sharding_propagator.op_strategy_funcs)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "True"], out


_TWO_DIM = """
import warnings
import torch, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
import fa_compile.ops
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

warnings.simplefilter("ignore")
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
mesh = init_device_mesh("cpu", (2, 2))
for hq, hkv, places in ((4, 2, [Shard(0), Shard(1)]), (8, 4, [Shard(1), Shard(1)]), (8, 2, [Shard(1), Shard(1)]),
                        (8, 2, [Shard(0), Shard(0)])):
    ts = [distribute_tensor(torch.randn(4, h, 8, 8), mesh, places) for h in (hq, hkv, hkv)]
    out, lse = torch.ops.fa3.attention(*ts, 0.3, True)
    print(out.placements == lse.placements, *out.placements)
dist.destroy_process_group()
"""


def test_two_dim_mesh_placements():
    """A 2 x 2 mesh (placements only: the fake process group moves no data, values are the 1-D cases'):
    batch on one mesh dim and heads on the other stay so; heads on both stay only if 4 divides Hkv."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _TWO_DIM], capture_output=True, text=True, check=True).stdout
    assert out.splitlines() == ["True S(0) S(1)", "True S(1) S(1)", "True S(1) R", "True S(0) S(0)"], out
