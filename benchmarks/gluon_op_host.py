"""Host time of one `fa3_gluon::bwd` call and of its parts, on the H200's host (the op runs as an extern call in
Inductor's code: every microsecond here is paid once per site and training step).

Shape: a padded BERT layer's backward (B32 x 512, 16 heads, d64, bf16, a boolean key-padding mask and key
lengths, dropout 0.1). Each line is the least of three means over 50 calls, in µs, measured without
synchronizing (the GPU work of these calls is ~0.4 ms, so the queue never fills). "empty rows kernel" is that
kernel's launch through `wrap_triton` outside the op, where it goes through the higher-order op's dispatch;
inside the op it is launched directly (its share is the difference of the first two lines).

Run on a Hopper GPU:  python benchmarks/gluon_op_host.py
"""
from __future__ import annotations

import time

import torch

from fa_compile import dispatch
from fa_compile.kernels import gluon_ops, triton_family as tf, triton_ops


def main() -> None:
    b, h, n, d = 32, 16, 512, 64
    q, k, v, do = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2) for _ in range(4))
    out = torch.randn_like(q)
    lse = torch.randn(b, h, n, device="cuda").abs() + 5
    keep = torch.ones(b, 1, 1, n, dtype=torch.bool, device="cuda")
    keep[:16, ..., 256:] = False
    kvl = torch.full((b,), n, dtype=torch.int32, device="cuda")
    kvl[:16] = 256
    seed = torch.tensor([5], device="cuda")
    tail = (seed, 0.125, False, 0, -1, -1)
    cfgs = ([64, 64, 4, 2], [64, 64, 4, 2])
    empty_mean_v = triton_ops.EMPTY_GRADS["mean_v"]
    args = dispatch.AttentionArgs(q, k, v, 0.125, False, diag_offset=0, window_left=-1, window_right=-1, bias=keep,
                                  kv_lens=kvl, dropout_p=0.1, dropout_seed=seed, needs_backward=True)
    dq, dk, dvv = gluon_ops._outputs(q, k, v)
    delta = torch.empty((b, h, n), device=q.device, dtype=torch.float32)
    cap = tf._capability(q.device)
    parts = {
        "op, with the empty-row fix-up": lambda: torch.ops.fa3_gluon.bwd(
            do, q, k, v, out, lse, keep, kvl, *tail, 0.1, empty_mean_v, *cfgs),
        "op, without it": lambda: torch.ops.fa3_gluon.bwd(do, q, k, v, out, lse, keep, kvl, *tail, 0.1, 0, *cfgs),
        "op body, without it": lambda: gluon_ops._bwd(do, q, k, v, out, lse, keep, kvl, *tail, 0.1, 0, *cfgs),
        "AttentionArgs": lambda: dispatch.AttentionArgs(
            q, k, v, 0.125, False, diag_offset=0, window_left=-1, window_right=-1, bias=keep, kv_lens=kvl,
            dropout_p=0.1, dropout_seed=seed, needs_backward=True),
        "output allocation": lambda: gluon_ops._outputs(q, k, v),
        "lse cast, delta allocation": lambda: (lse.to(torch.float32).contiguous(), torch.empty((b, h, n), device="cuda")),
        "delta kernel": lambda: tf.bwd_delta(out, do, delta, cap),
        "backward_gluon (the Gluon kernel)": lambda: tf.backward_gluon(args, q, k, v, do, lse, delta, dq, dk, dvv, cap, 2),
        "dQ buffer zeros": lambda: torch.zeros((1, b * h, n, d), device="cuda"),
        "5 TMA descriptors": lambda: [tf._gluon_desc(t, 64, 64) for t in (q, k, v, do, q)],
        "empty rows kernel": lambda: triton_ops._empty_rows_grads(do, q, k, v, lse, dq, dk, dvv, 0.125, False),
    }
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; host µs per call", flush=True)
    for name, f in parts.items():
        f()
        torch.cuda.synchronize()
        means = []
        for _ in range(3):
            t = time.perf_counter()
            for _ in range(50):
                f()
            means.append((time.perf_counter() - t) / 50 * 1e6)
            torch.cuda.synchronize()
        print(f"{name:36s} {min(means):7.1f}", flush=True)


if __name__ == "__main__":
    main()
