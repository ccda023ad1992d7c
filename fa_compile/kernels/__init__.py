"""Attention kernels behind `torch.ops.fa3.*` (installed as `fa_compile.kernels`).

Each family is a module with a launcher and a `not_supported_reasons(...)` that says, for given
inputs, why it cannot take them (an empty list means it can). `reference` is pure torch and runs
everywhere; the Triton families import triton lazily so a CPU-only install works without it.
"""
