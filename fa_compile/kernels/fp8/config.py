"""Constants and tile choices shared by the FP8 kernel's launcher, quantization and emulation."""
from __future__ import annotations

from torch import Tensor

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
# Defaults, from the emulated accuracy report (benchmarks/fp8_accuracy.py --emulate, d128, N 1024, rel. L2 vs
# fp32): K smoothing takes a shared K offset from 21% to 5.2% (the Gaussian floor); the Hadamard rotation takes
# outlier channels (x20..50) from 20% to 7.3% and changes nothing on Gaussian inputs; Q smoothing changes
# nothing anywhere (within 0.001), so it stays off (it costs a [blocks, Nk] fp32 term per head).
SMOOTH_Q_DEFAULT = False
HADAMARD_DEFAULT = True
# Q.Kᵀ in int8 (quantize.py): emulated, Gaussian 5.2% -> 3.8%, outliers 7.3% -> 3.2%; off until its speed on
# Hopper is measured (benchmarks/fp8_kernels.py, column fp8_int8qk).
QK_INT8_DEFAULT = False
# Two-level P.V accumulation (each key block's product summed fresh, then added in fp32): SageAttention2's
# remedy for the FP8 wgmma's reduced-precision accumulator. On the H200 (2026-12-02, N 4096) it changed
# nothing measurable (benchmarks/fp8_accuracy.py, rel. L2 vs fp32 equal to 4 digits with and without, on
# Gaussian, K-offset and outlier inputs, d128 and d256), while its second accumulator costs registers: at
# d256 the kernel runs 924 / 886 TFLOP/s without it against 624 / 613 with it (fp8_kernels.py --sweep,
# non-causal / causal). So it is off at d256; at d <= 128 it stays on (without it only the causal tile was
# faster, 764 against 683; the non-causal case was not timed at the chosen tile).
TWO_LEVEL_DEFAULT = True
TWO_LEVEL_MAX_HEAD_DIM = 128


def two_level_default(head_dim: int) -> bool:
    """The default of fp8_forward's `two_level` for a head-dim block (see TWO_LEVEL_DEFAULT)."""
    return TWO_LEVEL_DEFAULT and head_dim <= TWO_LEVEL_MAX_HEAD_DIM

# Head dims the kernel takes (q and v alike): e4m3 tensor-core products reduce over 32 elements at a time.
HEAD_DIMS = (32, 64, 128, 256)


def default_blocks(head_dim: int, interpreter: bool = False) -> tuple[int, int]:
    """(block_m, block_n): the kernel's tiles, which are also the Q and K scale blocks.

    Hopper, from benchmarks/fp8_kernels.py --sweep (H200, 2026-12-02, N 16k, TFLOP/s of the kernel alone):
    64 query rows by 128 keys up to d128 (712 / 683 non-causal / causal, no register spills, against
    592 / 602 for 128 x 128 with 8 warps), 128 x 128 at d256 (624 / 613, against 520 / 502 for 128 x 64).
    The interpreter: 16 x 16, so that tiny test shapes cross several blocks."""
    if interpreter:
        return 16, 16
    return (64, 128) if head_dim <= 128 else (128, 128)


def structural_ok(rows: Tensor, cols: Tensor, n_lim, diag_offset: int, window_left: int, window_right: int,
                  causal: bool) -> Tensor:
    """Admissible (row, col) pairs (broadcasting tensors), as triton_common.structural_ok."""
    dd = cols - rows - diag_offset
    ok = cols < n_lim
    if causal:
        ok = ok & (dd <= 0)
    if window_left >= 0:
        ok = ok & (dd >= -window_left)
    if window_right >= 0:
        ok = ok & (dd <= window_right)
    return ok
