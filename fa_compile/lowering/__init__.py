"""Compile-time lowering of `torch.ops.fa3.*` in the post-AOTAutograd graphs.

Each `fa3.attention` / `fa3.attention_backward` node is replaced by the call of the kernel that the
run-time dispatch (fa_compile/dispatch.py) would choose for the node's FakeTensors, with the op's
output conventions (BSHD-strided out, fp32 lse [B, H, Nq], -inf lse and zero out on empty rows)
written as ordinary graph ops, so Inductor's generated code launches the kernel without a Python
dispatch per call. On CPU the forward's corrections are decisions on the data, which cost no device
sync there, so past a decode step's 16 queries kernel and corrections are one op
(`fa3::cpu_flash_forward`, fa_compile/cpu_flash_op.py) that pays for them only when an input needs them;
the backward's, with the empty-row fix-up's gradient, likewise (`fa3::cpu_flash_backward`); on a GPU our
Triton kernels take both fix-ups (the backward's in a kernel that reads the lse and stops when no row is empty).
A node whose kernel has no lowering, whose choice depends on a dynamic dimension, or whose lowering
fails keeps the op (run-time dispatch); each decision is recorded (`records()`).

Modules: `site_args` (node -> AttentionArgs), `choice` (which kernel, which lowering, or why none),
`cpu_flash` / `sdpa` / `fa3` / `triton` / `decomposed` (the replacements; `fa3` through a thin custom op
over FA3's C++ forward; `triton` calls the `fa3_triton` triton_ops of fa_compile/kernels/triton_ops.py;
`decode` calls the split-KV decode kernel's `fa3_decode` triton_op; `decomposed` writes a decode step's
reference math as graph ops), `empty_rows` (the rewrite's fix-up of rows with no admissible key, found
after the op so that a kernel which writes that value itself takes it), `empty_rows_backward` (that
fix-up's backward, found around the backward node for an op that computes it), `key_limit` (a decode step's
key limit, `fa3::key_limit`, as one Triton kernel on CUDA or as graph ops; and the limit of a key-padding mask
for the sites our Triton kernels take, which end their key loops there), `share` (one kv_lens /
key limit per step where every layer computes the same one), `splice` (tracing a
replacement into the graph, and dropping the copies its own strides make no-ops), `graph_pass` (the
Inductor CustomGraphPass).
"""
from __future__ import annotations

from .choice import Decision, describe, explain_lines
from .graph_pass import LoweringPass, capture_graphs, lower_graph, records

__all__ = ["Decision", "explain_lines", "LoweringPass", "capture_graphs", "describe", "lower_graph", "records"]
