"""fa3::key_limit (fa_compile/key_limit_op.py) after AOTAutograd: on CUDA one Triton kernel launched by
Inductor (`fa3_decode::key_limit`, fa_compile/kernels/decode_ops.py), elsewhere its graph ops, which Inductor fuses.

Written as graph ops, the limit over a 16384-key cache was two reduction kernels per decode layer
(Inductor splits a reduction of that length when it has few rows), 3.3 us of the step's 43 on the H200;
the kernel reads each row in one block of up to 16384 keys. Where the kernel cannot take the mask
(fp64, Triton unusable) or its splice fails, the graph ops run instead; if those fail too, the op stays
(its eager body is exact, one run-time call).

The layers of a step share one limit (share.py keeps one node per distinct mask and threshold).

Prefill sites get the limit here, at lowering time, where their kernel is known (`for_site`): a lowering that
reads kv_lens beside a bias and skips the key tiles past it (`cuts_padded_keys`: our Triton kernels) takes a
limit computed from a key-padding mask (one value per key and sequence, e.g. a BERT-style `attention_mask`),
so a sequence padded to half the batch's length costs half the key tiles, forward and backward. The pattern
stage leaves prefill sites alone (patterns/key_limit.py): there the kernel is not known, and cuDNN would build a
bias from kv_lens per call. Why the result is unchanged is patterns/key_limit.py's argument, with one more
condition for a float mask: no structure (causal, window, positions, segments) that can keep a row from every
admissible key of its sequence (such a row weighs its absorbed keys, the cut ones included).
"""
from __future__ import annotations

import os
import warnings
from typing import Optional

import torch
import torch.fx as fx
from torch import Tensor

from .. import dispatch
from ..key_limit_op import KEY_LIMIT, key_limit_math
from . import splice

DEVICES = ("cuda",)  # where the Triton kernel runs (tests add "cpu" under the interpreter)
_WARNED: set = set()


def _kernel_reasons(bias: torch.Tensor) -> list[str]:
    from ..kernels import decode_ops
    from ..kernels.triton_family import device_reasons, triton_available

    if bias.device.type not in DEVICES:
        return [f"device {bias.device.type}"]
    if not triton_available():
        return ["triton not installed"]
    if os.environ.get("FA_COMPILE_TRITON_LOWER", "auto") == "0":
        return ["Triton kernels are not lowered (FA_COMPILE_TRITON_LOWER=0)"]
    r = device_reasons(bias.device)
    if bias.dtype not in decode_ops.KEY_LIMIT_DTYPES:
        r.append(f"dtype {bias.dtype}")
    return r


def lower(graph: fx.Graph, node: fx.Node) -> Optional[str]:
    """Replace one fa3::key_limit node; returns what it became ("kernel", "graph ops") or None (kept)."""
    bias, absorb = node.args[0], float(node.args[1])
    val = bias.meta.get("val") if isinstance(bias, fx.Node) else None
    if not isinstance(val, torch.Tensor):
        return None
    tries = []
    if not _kernel_reasons(val):
        from torch._subclasses.functional_tensor import dispatch_functionalize

        from ..kernels import decode_ops

        # traced functionalized, the triton_op becomes its kernel's HOP, which Inductor launches itself
        # (traced plainly it stayed an extern call of the op, which a process that has not imported the
        # kernels cannot resolve when it runs Inductor's cached code)
        tries.append(("kernel", dispatch_functionalize(lambda b: decode_ops.key_limit(b, absorb))))
    tries.append(("graph ops", lambda b: key_limit_math(b, absorb)))
    for what, fn in tries:
        try:
            splice.replace_value(graph, node, fn, [bias])
            return what
        except Exception as e:
            if (what, type(e).__name__) not in _WARNED:
                _WARNED.add((what, type(e).__name__))
                warnings.warn(f"fa_compile: lowering the key limit {node.name} to its {what} failed "
                              f"({type(e).__name__}: {str(e)[:200]}); trying the next way", RuntimeWarning, stacklevel=2)
    return None


def is_key_limit(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is KEY_LIMIT


def _key_vector_dims(bias: Tensor, b: int) -> bool:
    """Whether `bias` (broadcastable to [B, H, Nq, Nk]) holds one value per sequence and key: its head and
    query dimensions have size 1 or stride 0, its batch dimension size 1 or B, its key dimension stride != 0."""
    if bias.dim() == 0 or bias.dim() > 4:
        return False
    sizes = (1,) * (4 - bias.dim()) + tuple(bias.shape)
    strides = (0,) * (4 - bias.dim()) + tuple(bias.stride())
    if not all(isinstance(x, int) for x in sizes + strides):
        return False
    if any(sizes[i] != 1 and strides[i] != 0 for i in (1, 2)) or sizes[0] not in (1, b):
        return False
    return sizes[3] > 1 and strides[3] != 0


def cuts_keys(args: dispatch.AttentionArgs, key_tile: int) -> bool:
    """Whether a prefill site lowered to a `cuts_padded_keys` kernel gets the mask's key limit as kv_lens: a
    bool or float key-padding mask (one value per sequence and key), no kv_lens of its own, no bias gradient
    (the kernels would not write dS past the limit), more keys than one key tile (else nothing to cut), and
    for a float mask no structure that can keep a row from its sequence's admissible keys (module docstring)."""
    bias = args.bias
    if not isinstance(bias, Tensor) or args.kv_lens is not None or args.bias_requires_grad:
        return False
    if not (bias.dtype == torch.bool or bias.dtype.is_floating_point):
        return False
    nk, b = args.k.shape[2], args.q.shape[0]
    if not (isinstance(nk, int) and isinstance(b, int)) or nk <= key_tile or not _key_vector_dims(bias, b):
        return False
    if bias.dtype != torch.bool:
        structured = bool(args.causal) or int(args.window_left) >= 0 or int(args.window_right) >= 0
        if structured or any(t is not None for t in (args.q_pos, args.q_seg, args.k_seg)):
            return False
    return True


def _limit_of(bias: Tensor, b: int, absorb: float) -> Tensor:
    """kv_lens [B] int32 of a key-padding mask (see _key_vector_dims): fa3::key_limit over its [Bm, Nk] rows."""
    while bias.dim() < 4:
        bias = bias.unsqueeze(0)
    limit = torch.ops.fa3.key_limit(bias[:, 0, 0, :], absorb)
    return limit.expand(b) if limit.shape[0] != b else limit


def for_site(graph: fx.Graph, node: fx.Node, bias: fx.Node, args: dispatch.AttentionArgs,
             cache: dict) -> Optional[fx.Node]:
    """kv_lens for the attention `node` (where `cuts_keys` holds): a node computing the key limit of `bias`,
    inserted before `node` and shared through `cache` (bias node -> limit) by every later site of the graph
    with that mask; None when it cannot be built (the site then reads every key, as before)."""
    b = int(args.q.shape[0])
    hit = cache.get((bias, b))
    if hit is not None:
        return hit
    from ..patterns.key_limit import absorb_threshold

    absorb = 0.0 if args.bias.dtype == torch.bool else absorb_threshold(args.bias.dtype)
    try:
        new = splice.insert_value(graph, node, lambda t: _limit_of(t, b, absorb), [bias])
    except Exception as e:  # never a failed compile: without the limit the site reads every key
        if ("insert", type(e).__name__) not in _WARNED:
            _WARNED.add(("insert", type(e).__name__))
            warnings.warn(f"fa_compile: the key limit of {bias.name} for {node.name} could not be built "
                          f"({type(e).__name__}: {str(e)[:200]}); the site reads every key", RuntimeWarning, stacklevel=2)
        return None
    cache[(bias, b)] = new
    return new


def lower_inserted(graph: fx.Graph, cache: dict) -> None:
    """Lower the key-limit nodes `for_site` inserted (their op, inside the values it built)."""
    for value in cache.values():
        todo = [value] + list(value.all_input_nodes)
        for n in todo:
            if is_key_limit(n):
                lower(graph, n)
