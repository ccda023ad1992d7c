"""The Gluon backward op's replayed launches on a Hopper GPU (fa_compile/kernels/gluon_ops.py, replay.py): the op's
second call with tensors of the same layout replays the first call's launch, and gives what Triton's own launch
gives on the same inputs (dK and dV bit for bit: one program writes each; dQ to fp32 rounding: its sums arrive in
varying order), with every output poisoned first; on another stream and in a CUDA graph too. An address the replay
cannot take (an unaligned view) falls back to the op's other paths. Skipped without a Hopper GPU (CI has none)."""
from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9, reason="needs a Hopper GPU")]


@pytest.fixture(autouse=True)
def _setup(monkeypatch):
    from fa_compile.kernels import gluon_ops
    from fa_compile.kernels import triton_family as tf

    if not tf.triton_available() or not tf.gluon_available():
        pytest.skip("triton with Gluon not installed")
    for var in ("FA_COMPILE_REPLAY", "FA_COMPILE_GLUON", "FA_COMPILE_TRITON_TMA"):
        monkeypatch.delenv(var, raising=False)
    gluon_ops._REPLAYS.clear()
    yield
    gluon_ops._REPLAYS.clear()


def _poisoned(monkeypatch):
    from fa_compile.kernels import triton_ops

    real = triton_ops._empty

    def nan_filled(shape, stride, dtype, device):
        return real(shape, stride, dtype, device).fill_(float("nan"))

    monkeypatch.setattr(triton_ops, "_empty", nan_filled)


def _launches(monkeypatch) -> list:
    from fa_compile.kernels import replay

    seen, real = [], replay.Replay.launch

    def launch(self, tensors, device):
        seen.append(real(self, tensors, device))
        return seen[-1]

    monkeypatch.setattr(replay.Replay, "launch", launch)
    return seen


def _case(seed: int, d: int, masked: bool, causal: bool):
    """The op's arguments for a GQA layer in BSHD storage, out and lse from our forward kernel."""
    from fa_compile.kernels import triton_family as tf
    from fa_compile.kernels import triton_ops

    gen = torch.Generator(device="cuda").manual_seed(seed)
    b, hq, hkv, n = 3, 4, 2, 300
    q, k, v, dout = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16, generator=gen).transpose(1, 2)
                     for h in (hq, hkv, hkv, hq))
    keep = kv_lens = seed_t = None
    p = 0.0
    if masked:  # a key-padding mask, key lengths and dropout: the padded encoder's training site
        keep = torch.ones(b, 1, 1, n, dtype=torch.bool, device="cuda")
        keep[1, ..., 170:] = False
        kv_lens = torch.tensor([n, 170, n], dtype=torch.int32, device="cuda")
        seed_t, p = torch.tensor([seed + 7], device="cuda"), 0.1
    scale = d ** -0.5
    cfg = tf.pick_config("fwd", d, causal, (9, 0))
    out, lse = triton_ops.fwd(q, k, v, keep, kv_lens, seed_t, scale, causal, 0, -1, -1, 0.0, p,
                              [cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages], None, 0)
    delta = (out.float() * dout.float()).sum(-1)
    tiles = [[c.block_m, c.block_n, c.num_warps, c.num_stages]
             for c in (tf.pick_config(kd, d, causal, (9, 0)) for kd in ("dkdv", "dq"))]
    return (dout, q, k, v, out, lse, delta, keep, kv_lens, seed_t, scale, causal, 0, -1, -1, p, False, *tiles)


def _fresh(args: tuple) -> tuple:
    """The same values at new addresses (the next step's tensors)."""
    return tuple(a.clone(memory_format=torch.preserve_format) if isinstance(a, torch.Tensor) else a for a in args)


def _op(args: tuple):
    return torch.ops.fa3_gluon.bwd(*args)


def _check(got, want, what: str) -> None:
    for name, g, w in zip(("dq sums", "dk", "dv"), got, want):
        assert torch.isfinite(g).all(), f"{what}: {name} has NaN (an element left unwritten?)"
        if name == "dq sums":
            torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4, msg=lambda m: f"{what}: {name}: {m}")
        else:
            assert torch.equal(g, w), f"{what}: {name} differs from Triton's launch"


@pytest.mark.parametrize("d,masked,causal", [(64, True, False), (128, False, True), (64, False, False)],
                         ids=["d64-keymask-kvlens-dropout", "d128-causal", "d64-plain"])
def test_second_call_replays_the_first_launch(d, masked, causal, monkeypatch):
    from fa_compile.kernels import gluon_ops

    args = _case(d, d, masked, causal)
    monkeypatch.setenv("FA_COMPILE_REPLAY", "0")
    want = _op(_fresh(args))
    assert not gluon_ops._REPLAYS
    monkeypatch.delenv("FA_COMPILE_REPLAY")
    seen = _launches(monkeypatch)
    _op(args)  # through Triton, recorded
    assert len(gluon_ops._REPLAYS) == 1 and seen == []
    _poisoned(monkeypatch)
    for step in range(3):
        got = _op(_fresh(args))
        assert seen == [True] * (step + 1)
        _check(got, want, f"replay {step}")
    # on another stream: the launch goes to the current one
    s = torch.cuda.Stream()
    fresh = _fresh(args)
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        got = _op(fresh)
    torch.cuda.current_stream().wait_stream(s)
    assert seen[-1] is True
    _check(got, want, "replay on a side stream")


def test_a_new_layout_is_recorded_and_an_unaligned_view_falls_back(monkeypatch):
    from fa_compile.kernels import gluon_ops

    args = _case(1, 64, True, False)
    monkeypatch.setenv("FA_COMPILE_REPLAY", "0")
    want = _op(_fresh(args))
    monkeypatch.delenv("FA_COMPILE_REPLAY")
    seen = _launches(monkeypatch)
    _op(args)
    # q stored at an address 8 bytes past a 16-byte boundary: the same shape and strides (the replay's key), an
    # address its TMA descriptor cannot take. The op falls back and still computes the gradients.
    q = args[1]
    buf = torch.empty(q.untyped_storage().nbytes() // 2 + 4, device="cuda", dtype=q.dtype)
    q_odd = buf[4:].as_strided(q.shape, q.stride())
    q_odd.copy_(q)
    assert q_odd.data_ptr() % 16 == 8
    _poisoned(monkeypatch)
    got = _op((args[0], q_odd) + args[2:])
    assert seen == [False]
    for name, g, w in zip(("dq sums", "dk", "dv"), got, want):
        assert torch.isfinite(g).all(), name
        torch.testing.assert_close(g.float(), w.float(), atol=2e-2, rtol=2e-2, msg=lambda m: f"{name}: {m}")
    # another batch size: a new key, recorded by its first call
    small = tuple(a[:2] if isinstance(a, torch.Tensor) and a.dim() and a.shape[0] == 3 else a for a in args)
    n_before = len(gluon_ops._REPLAYS)
    _op(small)
    assert len(gluon_ops._REPLAYS) == n_before + 1 and seen == [False]
    # deterministic mode: not the Gluon kernel at all (its dQ sums arrive in varying order), so no replay
    torch.use_deterministic_algorithms(True)
    try:
        _op(_fresh(args))
    finally:
        torch.use_deterministic_algorithms(False)
    assert seen == [False]


def test_replay_is_captured_by_a_cuda_graph(monkeypatch):
    args = _case(2, 64, True, False)
    monkeypatch.setenv("FA_COMPILE_REPLAY", "0")
    nxt = _case(3, 64, True, False)
    want = _op(_fresh(nxt))
    monkeypatch.delenv("FA_COMPILE_REPLAY")
    seen = _launches(monkeypatch)
    static = _fresh(args)
    _op(args)  # recorded
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        _op(static)  # warm-up on the capture stream
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = _op(static)
    assert seen == [True, True]
    for dst, src in zip(static, nxt):
        if isinstance(dst, torch.Tensor):
            dst.copy_(src)
    for t in outs:
        t.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    _check(outs, want, "CUDA graph replay")
