"""Host time of one `fa3_gluon::bwd` call and of its parts, on the H200's host (the op runs as an extern call in
Inductor's code: every microsecond here is paid once per site and training step, and in a short training step the
GPU waits for it).

Shape: a padded BERT layer's backward (B32 x 512, 16 heads, d64, bf16, a boolean key-padding mask and key
lengths, dropout 0.1). Each line is the least and the median of seven means over 20 calls, in µs, measured
without synchronizing (the GPU work of these calls is ~0.4 ms, so the queue never fills). The parts are those of
`triton_family.backward_gluon` and of Triton's launch of the Gluon kernel (`kernel[grid](...)`: the binder, which
specializes the arguments, then the compiled kernel's launcher, which encodes the TMA descriptors). The op's calls
after its first replay the first launch (fa_compile/kernels/replay.py); FA_COMPILE_REPLAY=0 is timed beside it.

Run on a Hopper GPU:  python benchmarks/gluon_op_host.py
"""
from __future__ import annotations

import os
import statistics
import time
from unittest import mock

import torch

from fa_compile import dispatch
from fa_compile.kernels import gluon_ops, triton_family as tf


def main() -> None:
    import triton
    from torch._library.triton import set_wrap_triton_enabled

    from fa_compile.kernels import gluon_bwd
    from fa_compile.kernels.gluon_bwd import attn_bwd_gluon_kernel

    b, h, n, d = 32, 16, 512, 64
    q, k, v, do = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2) for _ in range(4))
    out = torch.randn_like(q)
    lse = torch.randn(b, h, n, device="cuda").abs() + 5
    delta = (out.float() * do.float()).sum(-1)
    keep = torch.ones(b, 1, 1, n, dtype=torch.bool, device="cuda")
    keep[:16, ..., 256:] = False
    kvl = torch.full((b,), n, dtype=torch.int32, device="cuda")
    kvl[:16] = 256
    seed = torch.tensor([5], device="cuda")
    cfgs = ([64, 64, 4, 2], [64, 64, 4, 2])
    args = dispatch.AttentionArgs(q, k, v, 0.125, False, diag_offset=0, window_left=-1, window_right=-1, bias=keep,
                                  kv_lens=kvl, dropout_p=0.1, dropout_seed=seed, needs_backward=True)
    dqs, dk, dvv = gluon_ops._outputs(q, k, v)
    cap = tf._capability(q.device)
    # one call through backward_gluon, recording the Gluon kernel's launch (grid, arguments) to time its parts
    launch = {}

    class Recorder:
        def __getitem__(self, grid):
            def run(*a, **kw):
                launch.update(grid=grid, args=a, kw=kw)
                return attn_bwd_gluon_kernel[grid](*a, **kw)
            return run

    with mock.patch.object(gluon_bwd, "attn_bwd_gluon_kernel", Recorder()):
        assert tf.backward_gluon(args, q, k, v, do, lse, delta, dqs, dk, dvv, cap, 2, dq_sums=True), "not on Hopper?"
    _, handle = tf.LAST_COMPILED["attn_bwd_gluon_kernel"]
    grid, pos, kw = launch["grid"], launch["args"], launch["kw"]
    binder = attn_bwd_gluon_kernel.device_caches[torch.cuda.current_device()][4]
    bound = list(binder(*pos, **kw)[0].values())
    op_args = (do, q, k, v, out, lse, delta, keep, kvl, seed, 0.125, False, 0, -1, -1, 0.1, True, *cfgs)
    key_args = (do, q, k, v, lse, delta, keep, kvl, seed, 0.125, False, 0, -1, -1, 0.1)
    key = gluon_ops._replay_key(*key_args)
    torch.ops.fa3_gluon.bwd(*op_args)  # records the launch that later calls replay
    assert key in gluon_ops._REPLAYS, "the launch was not recorded"
    rep = gluon_ops._REPLAYS[key][0]
    dqa = dqs.view(1, b * h, n, d)

    def through_triton():
        os.environ["FA_COMPILE_REPLAY"] = "0"
        try:
            torch.ops.fa3_gluon.bwd(*op_args)
        finally:
            del os.environ["FA_COMPILE_REPLAY"]

    parts = {
        "fa3_gluon.bwd (replayed launch)": lambda: torch.ops.fa3_gluon.bwd(*op_args),
        "  its Python body (no dispatcher)": lambda: gluon_ops._impl(*op_args),
        "  its replay key": lambda: gluon_ops._replay_key(*key_args),
        "  Replay.launch": lambda: rep.launch((q, k, v, do, lse, delta, dqa, dk, dvv, kvl, seed,
                                               keep.view(torch.uint8)), q.get_device()),
        "fa3_gluon.bwd, FA_COMPILE_REPLAY=0": through_triton,
        "its body, through Triton": lambda: gluon_ops._bwd(do, q, k, v, out, lse, delta, keep, kvl, seed, 0.125, False, 0, -1, -1,
                                           0.1, True, *cfgs),
        "  output allocation": lambda: gluon_ops._outputs(q, k, v),
        "  backward_gluon": lambda: tf.backward_gluon(args, q, k, v, do, lse, delta, dqs, dk, dvv, cap, 2,
                                                      dq_sums=True),
        "    gluon_backward_applies": lambda: tf.gluon_backward_applies(args, cap),
        "    _tma_ok (strides, alignment)": lambda: tf._tma_ok((q, k, v, do), cap),
        "    zeroing the dQ sums": lambda: dqs.zero_(),
        "    5 TensorDescriptor objects": lambda: [tf._gluon_desc(t, 64, 64) for t in (q, k, v, do, q)],
        "    gluon_key_mask": lambda: tf.gluon_key_mask(keep),
        "    kernel[grid](...)": lambda: attn_bwd_gluon_kernel[grid](*pos, **kw),
        "      Triton's binder": lambda: binder(*pos, **kw),
        "      compiled kernel's launch": lambda: handle[(grid[0], 1, 1)](*bound),
    }
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; "
          "host µs per call (least / median of 7 means of 20)", flush=True)
    with set_wrap_triton_enabled(False):
        for name, f in parts.items():
            f()
            torch.cuda.synchronize()
            means = []
            for _ in range(7):
                t = time.perf_counter()
                for _ in range(20):
                    f()
                means.append((time.perf_counter() - t) / 20 * 1e6)
                torch.cuda.synchronize()
            print(f"{name:36s} {min(means):7.1f} {statistics.median(means):7.1f}", flush=True)


if __name__ == "__main__":
    main()
