"""FP8 (e4m3) attention forward for Hopper: quantization (block scales, K / Q smoothing, optional
Hadamard rotation), the Triton kernel, its launcher and an exact torch emulation.

fp8_forward(q, k, v, scale, ...) -> (out, lse) as torch.ops.fa3.attention returns them;
fp8_reasons(q, k, v, bias, kv_lens) says why the kernel cannot take inputs (empty: it can);
fp8_reference(...) emulates the kernel in torch (the test oracle, the CPU accuracy report);
quantize(...) returns the Quantized pieces the kernel reads.
"""
from .config import HADAMARD_DEFAULT, SMOOTH_Q_DEFAULT
from .launch import fp8_forward, fp8_reasons, quantize_inputs
from .quantize import FP8, FP8_MAX, Quantized, hadamard_matrix, quantize
from .reference import fp8_reference

__all__ = [
    "FP8", "FP8_MAX", "HADAMARD_DEFAULT", "Quantized", "SMOOTH_Q_DEFAULT", "fp8_forward", "fp8_reasons",
    "fp8_reference",
    "hadamard_matrix", "quantize", "quantize_inputs",
]
