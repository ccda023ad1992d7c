"""First-call tile tuning (fa_compile/kernels/tile_tuning.py): which candidate wins, what is cached where, and when
nothing is measured. The timer is injected: these tests check the choice logic, not a GPU."""
from __future__ import annotations

import math

import pytest
import torch

from fa_compile.kernels import tile_tuning as tt
from fa_compile.kernels import triton_family as tf

CUDA = torch.device("cuda", 0)
A, B, C = tf.BlockConfig(64, 64, 4, 3), tf.BlockConfig(128, 128, 8, 3), tf.BlockConfig(64, 128, 4, 2)


@pytest.fixture
def tuning_on(monkeypatch, tmp_path):
    monkeypatch.setenv("FA_COMPILE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(tt, "ENABLED", True)
    monkeypatch.setattr(tt, "_MEM", {})
    monkeypatch.setattr(tt, "_device_key", lambda index: "GPU-X|sm90|torch-t|triton-t")
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    return tmp_path


def _timer(ms: dict, calls: list):
    def timer(run):
        calls.append(run)
        run()
        return ms[len(calls) - 1]
    return timer


def _choose(key, cands, ms, calls, ran):
    enc, dec = (lambda c: list(tf.dataclasses.astuple(c))), (lambda v: tf.BlockConfig(*v))

    def run(c):
        ran.append(c)
        if isinstance(ms.get(len(ran) - 1), Exception):
            raise ms[len(ran) - 1]

    return tt.choose(key, CUDA, cands, run, enc, dec, timer=_timer({i: (math.inf if isinstance(v, Exception) else v)
                                                                    for i, v in ms.items()}, calls))


def test_fastest_wins_and_is_cached_in_memory_and_on_disk(tuning_on):
    calls, ran = [], []
    assert _choose("fwd|bd128", [A, B, C], {0: 2.0, 1: 1.0, 2: 1.5}, calls, ran) == B
    assert ran == [A, B, C]
    assert _choose("fwd|bd128", [A, B, C], {0: 0.1, 1: 9.0, 2: 9.0}, calls, ran) == B  # memory: not re-timed
    assert len(ran) == 3
    assert (tuning_on / "tiles.json").exists()
    tt._MEM.clear()
    assert _choose("fwd|bd128", [A, B, C], {0: 0.1, 1: 9.0, 2: 9.0}, calls, ran) == B  # disk: not re-timed
    assert len(ran) == 3
    assert _choose("fwd|bd64", [A, B, C], {0: 0.5, 1: 1.0, 2: 1.5}, calls, ran) == A  # another key: timed


def test_failing_candidates_are_skipped(tuning_on):
    calls, ran = [], []
    assert _choose("k1", [A, B, C], {0: 2.0, 1: RuntimeError("out of resources"), 2: 3.0}, calls, ran) == A
    calls, ran = [], []
    assert _choose("k2", [A, B], {0: RuntimeError("x"), 1: RuntimeError("y")}, calls, ran) == A  # all failed
    assert ("GPU-X|sm90|torch-t|triton-t", "k2") not in tt._MEM


def test_nothing_measured_when_off_single_cpu_or_capturing(tuning_on, monkeypatch):
    never = lambda c: pytest.fail("timed")  # noqa: E731
    enc, dec = (lambda c: []), (lambda v: A)
    assert tt.choose("k", CUDA, [A], never, enc, dec) == A
    assert tt.choose("k", torch.device("cpu"), [A, B], never, enc, dec) == A
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert tt.choose("k", CUDA, [A, B], never, enc, dec) == A
    monkeypatch.setattr(tt, "ENABLED", False)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert tt.choose("k", CUDA, [A, B], never, enc, dec) == A


def test_family_offers_candidates_on_hopper_only_and_respects_pins(tuning_on, monkeypatch):
    seen = []
    monkeypatch.setattr(tt, "choose", lambda key, dev, cands, run, **kw: seen.append((key, cands)) or cands[-1])
    q = torch.empty(1, 2, 8, 128, dtype=torch.bfloat16)
    default = tf.GLUON_CONFIGS[128]
    got = tf._tuned("fwd_gluon", 128, default, q, True, 0, (9, 0), lambda c: None)
    (key, cands), = seen
    assert key == "fwd_gluon|bd128|bfloat16|causal|bias0" and cands[0] == default and got == cands[-1]
    assert len(cands) == 1 + len(tf.TUNE_CANDIDATES[("fwd_gluon", 128)])
    assert tf._tuned("fwd_gluon", 128, default, q, True, 0, (8, 0), lambda c: None) == default  # Ampere: static
    monkeypatch.setitem(tf.CONFIG_OVERRIDE, ("fwd_gluon", 128), default)
    assert tf._tuned("fwd_gluon", 128, default, q, True, 0, (9, 0), lambda c: None) == default  # pinned
    assert len(seen) == 1


def test_fa_compile_tuning_switch_reaches_the_tiles(monkeypatch):
    from fa_compile import tuning

    monkeypatch.setattr(tt, "ENABLED", None)
    monkeypatch.delenv("FA_COMPILE_TUNE", raising=False)
    assert not tt.enabled()
    tuning.enable(True)
    try:
        assert tt.enabled()
    finally:
        tuning.enable(None)
    assert not tt.enabled()
