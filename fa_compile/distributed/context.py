"""`fa_compile.context_parallel`: shard the sequence across a device mesh and run every fa3.attention
inside as ring attention (ring.py).

    with fa_compile.context_parallel(mesh, buffers=(tokens, labels), buffer_seq_dims=(1, 1)):
        loss = model(tokens, labels)      # compiled with backend="fa3", or calling fa_compile.attention
        loss.backward()                   # the backward rings too: run it inside the context

Why not torch's own `torch.distributed.tensor.experimental.context_parallel`: it reaches attention by
monkey-patching `F.scaled_dot_product_attention` (or a TorchFunctionMode) and custom DTensor handlers
of the aten SDPA ops, all in private modules (`_context_parallel/_attention.py`) whose names and
dispatch modes differ between torch releases, and the ops it rings are aten's SDPA ops only. This entry
point mirrors its interface (buffers sharded in place along `buffer_seq_dims`, restored on exit unless
in `no_restore_buffers`; the head-tail load-balanced layout, whose buffers are interchangeable with
torch's), and hooks the op's own kernel entry points, so eager calls, `torch.ops.fa3.attention` calls
and the rewritten sites of compiled graphs all ring.

Rules while active:
- every fa3.attention call is self-attention on local shards (local Nq == Nk) in the layout of the
  context; causal, diag_offset and window are read in global positions, kv_lens holds global lengths.
- the global sequence length must be a multiple of 2W (load balance) or W: sharding refuses others
  with a ValueError naming the buffer (pad the batch to such a length; padded keys masked by kv_lens).
- q_seg / k_seg (packed sequences) are the local shards of the ids, in the context's layout (shard the
  ids buffer with the tokens): the key ids travel around the ring with their K/V shard;
- a data bias, q_pos and dropout raise a clear error (their values index local positions); sinks are
  exact (their gradient is each rank's share, like every weight's under CP).
- the backward must run inside the context too (as with torch's): outside it the op's backward
  would see only the local shards, so it raises a RuntimeError for an lse the ring produced.
- the partial results are merged with the op's fp32 lse, so float64 inputs are exact to fp32
  rounding under CP (float32 and lower: to their own).
- graphs compiled inside keep the fa3 op (no compile-time lowering: the ring is a run-time loop); a
  frame compiled outside is compiled again inside (the context holds a pass-through TorchFunctionMode,
  and Dynamo guards on that stack), whichever route compiled it. As a second line, a graph of
  backend="fa3" compiled with lowering outside that still reaches the context runs the rewritten graph
  uncompiled (with a warning) rather than its lowered kernels, which would attend to the local shard only.
- fa3.paged_attention and fa3.attention_fp8 raise (a KV cache and FP8 inference are not rung).
"""
from __future__ import annotations

import contextlib
import warnings
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
from torch import Tensor

_ACTIVE: Optional["_RingHook"] = None


def active() -> bool:
    """True inside `context_parallel`."""
    return _ACTIVE is not None


def _group_of(mesh: Any):
    import torch.distributed as dist

    if isinstance(mesh, dist.ProcessGroup):
        return mesh
    if isinstance(mesh, int) and mesh == dist.GroupMember.NON_GROUP_MEMBER:  # what new_group gives non-members
        raise ValueError(f"mesh: this process (global rank {dist.get_rank()}) is not a member of the group it names "
                         "(new_group gives the ranks outside it GroupMember.NON_GROUP_MEMBER)")
    if getattr(mesh, "ndim", None) != 1:
        raise ValueError(f"mesh: expected a 1-D DeviceMesh (e.g. mesh['cp']) or a ProcessGroup, got {mesh!r}")
    return mesh.get_group()


class _RingHook:
    """What ops.attention / ops.attention_backward call while context parallelism is active."""

    def __init__(self, layout):
        self.layout = layout

    @staticmethod
    def _check(q: Tensor, k: Tensor, bias, dropout_p: float, q_pos, q_seg, k_seg) -> None:
        if q.shape[2] != k.shape[2]:
            raise ValueError(f"q, k: context_parallel rings self-attention on sequence shards, so local query and "
                             f"key lengths must be equal; got Nq {q.shape[2]}, Nk {k.shape[2]}")
        if bias is not None:
            raise ValueError("bias: a data mask or bias is not supported under context_parallel (its "
                             "entries index local positions of one shard); express it as causal / window / kv_lens")
        if q_pos is not None:
            raise ValueError("q_pos: not supported under context_parallel (positions index local keys)")
        if dropout_p > 0:
            raise ValueError("dropout_p: attention dropout is not supported under context_parallel (its mask is "
                             "keyed by local positions)")

    def _structure(self, causal, diag_offset, window_left, window_right):
        from .ring import Structure

        return Structure(bool(causal), int(diag_offset), int(window_left), int(window_right))

    def forward(self, q, k, v, scale, causal=False, diag_offset=0, window_left=-1, window_right=-1, bias=None,
                kv_lens=None, softcap=0.0, dropout_p=0.0, dropout_seed=None, force_kernel=None, sinks=None,
                q_pos=None, q_seg=None, k_seg=None):
        from .ring import ring_forward

        self._check(q, k, bias, dropout_p, q_pos, q_seg, k_seg)
        with _suspended():
            out, lse = ring_forward(self.layout, self._structure(causal, diag_offset, window_left, window_right),
                                    q, k, v, scale, kv_lens, softcap, force_kernel, sinks, q_seg, k_seg)
        if lse.numel():  # its backward must ring too: ops.attention_backward refuses it outside the context
            from .. import ops

            ops._RING_LSE[lse.data_ptr()] = lse.untyped_storage()
        return out, lse

    def backward(self, dout, q, k, v, out, lse, scale, causal=False, diag_offset=0, window_left=-1, window_right=-1,
                 bias=None, kv_lens=None, softcap=0.0, dropout_p=0.0, dropout_seed=None, bias_requires_grad=False,
                 force_kernel=None, sinks=None, q_pos=None, q_seg=None, k_seg=None):
        from .ring import ring_backward

        self._check(q, k, bias, dropout_p, q_pos, q_seg, k_seg)
        with _suspended():
            dq, dk, dv = ring_backward(self.layout, self._structure(causal, diag_offset, window_left, window_right),
                                       dout, q, k, v, out, lse, scale, kv_lens, softcap, force_kernel, q_seg, k_seg)
        return dq, dk, dv, q.new_empty((0,))


class _CompileGuardMode(torch.overrides.TorchFunctionMode):
    """A pass-through mode held while the context is active. Dynamo guards on the torch-function-mode
    stack, so a frame compiled outside the context compiles again inside it, where the lowering keeps
    the fa3 op (which rings), whatever route compiled it (backend="fa3" or FA_COMPILE=1), and the
    frames compiled outside run again, unchanged, after the context."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _set_hook(hook: Optional[_RingHook]) -> None:
    from .. import ops

    global _ACTIVE
    _ACTIVE = hook
    ops._CP_HOOK = hook


@contextlib.contextmanager
def _suspended() -> Iterator[None]:
    """The ring's own block calls run the plain op."""
    from .. import ops

    saved = ops._CP_HOOK
    ops._CP_HOOK = None
    try:
        yield
    finally:
        ops._CP_HOOK = saved


def _load_balanced(load_balance: Optional[bool]) -> bool:
    if load_balance is None:
        return True  # torch's context_parallel default: the head-tail layout
    if not isinstance(load_balance, bool):
        raise TypeError(f"load_balance: expected a bool or None, got {type(load_balance).__name__}")
    return load_balance


def _chunks_of(world: int, balanced: bool) -> int:
    return 2 * world if balanced else world


def shard(t: Tensor, dim: int, world: int, rank: int, balanced: bool, name: str = "buffer") -> Tensor:
    """`rank`'s shard of `t` along `dim` in the layout (a new tensor)."""
    n = t.shape[dim]
    parts = _chunks_of(world, balanced)
    if n % parts:
        raise ValueError(f"{name}: sequence length {n} along dim {dim} is not a multiple of {parts} "
                         f"({'2 x ' if balanced else ''}the {world} context-parallel ranks); pad the sequence "
                         f"to a multiple of {parts} and mask the padded keys with kv_lens")
    chunks = t.chunk(parts, dim)
    if not balanced:
        return chunks[rank].clone()
    return torch.cat([chunks[rank], chunks[parts - 1 - rank]], dim)


def unshard_chunks(pieces: Sequence[Tensor], dim: int, balanced: bool) -> Tensor:
    """The global tensor from every rank's shard, in rank order."""
    if not balanced:
        return torch.cat(list(pieces), dim)
    world = len(pieces)
    halves = [p.chunk(2, dim) for p in pieces]
    order = [halves[i][0] for i in range(world)] + [halves[world - 1 - i][1] for i in range(world)]
    return torch.cat(order, dim)


def _tensor_list(buffers: Any, name: str) -> list:
    if isinstance(buffers, Tensor):  # iterating it would take its rows for the buffers
        raise TypeError(f"{name}: expected a sequence of tensors, got a Tensor (pass ({name[:-1]},) for one)")
    try:
        buffers = list(buffers)
    except TypeError:
        raise TypeError(f"{name}: expected a sequence of tensors, got {type(buffers).__name__}") from None
    for i, b in enumerate(buffers):
        if not isinstance(b, Tensor):
            raise TypeError(f"{name}[{i}]: expected a Tensor, got {type(b).__name__}")
    return buffers


def _seq_dims(dims: Any, buffers: list, name: str) -> list[int]:
    """One sequence dim per buffer, each an int within its buffer's dims (negative from the end)."""
    if isinstance(dims, (int, Tensor)) or not hasattr(dims, "__iter__"):
        raise TypeError(f"{name}: expected a sequence of ints, one per buffer, got {type(dims).__name__}")
    dims = list(dims)
    if len(buffers) != len(dims):
        raise ValueError(f"{name}: {len(dims)} dims for {len(buffers)} buffers")
    out = []
    for i, (b, d) in enumerate(zip(buffers, dims)):
        if isinstance(d, bool) or not isinstance(d, int):
            raise TypeError(f"{name}[{i}]: expected an int, got {type(d).__name__} {d!r}")
        nd = b.dim()
        if not -nd <= d < nd:
            raise ValueError(f"{name}[{i}]: dim {d} is out of range for a {nd}-D buffer")
        out.append(d % nd)
    return out


@contextlib.contextmanager
def context_parallel(
    mesh: Any,
    *,
    buffers: Sequence[Tensor] = (),
    buffer_seq_dims: Sequence[int] = (),
    no_restore_buffers: Optional[set] = None,
    load_balance: Optional[bool] = None,
) -> Iterator[None]:
    """Context parallelism over `mesh` (a 1-D DeviceMesh, or a ProcessGroup) for every fa3.attention
    call inside: ring attention on the local Q/K/V sequence shards, forward and backward.

    buffers: tensors whose dim `buffer_seq_dims[i]` is the sequence (input ids, labels, position ids,
    rotary tables): on entry each tensor object is pointed at its shard (its shape changes; `Tensor.set_`, so a
    view's base and other views of it are not written), and on exit back at its own memory, unchanged, unless
    in `no_restore_buffers` (those keep their shard). No nn.Parameter among them. load_balance: None or True,
    the head-tail layout (rank r holds chunks r and 2W-1-r of 2W; torch's default); False, contiguous W pieces.
    """
    import torch.distributed as dist

    from .ring import Layout

    if _ACTIVE is not None:
        raise RuntimeError("context_parallel: already active (contexts do not nest)")
    group = _group_of(mesh)
    buffers = _tensor_list(buffers, "buffers")
    buffer_seq_dims = _seq_dims(buffer_seq_dims, buffers, "buffer_seq_dims")
    no_restore = no_restore_buffers or set()
    for b in no_restore:
        if not any(b is x for x in buffers):
            raise ValueError("no_restore_buffers: must be a subset of buffers")
    for i, b in enumerate(buffers):
        if isinstance(b, torch.nn.Parameter):
            raise TypeError(f"buffers[{i}]: an nn.Parameter cannot be sharded in place")
    balanced = _load_balanced(load_balance)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if rank < 0:  # a group this process is not in (get_rank gives -1)
        raise ValueError(f"mesh: this process (global rank {dist.get_rank()}) is not a member of the group it names")
    shards = [shard(b, d, world, rank, balanced, f"buffers[{i}]")
              for i, (b, d) in enumerate(zip(buffers, buffer_seq_dims))]  # all checked before any is changed
    # each buffer's own memory, kept as it is and given back on exit (resize_ and copy_ would write a view's base)
    originals = [None if any(b is x for x in no_restore) else
                 (b.untyped_storage(), b.storage_offset(), b.size(), b.stride()) for b in buffers]
    with torch.no_grad():
        for b, s in zip(buffers, shards):
            b.set_(s)
    _set_hook(_RingHook(Layout(world, rank, balanced, group)))
    mode = _CompileGuardMode()
    try:
        with mode:
            yield
    finally:
        _set_hook(None)
        with torch.no_grad():
            for b, o in zip(buffers, originals):
                if o is not None:
                    b.set_(*o)


@torch.no_grad()
def context_parallel_unshard(mesh: Any, buffers: Sequence[Tensor], seq_dims: Sequence[int],
                             load_balance: Optional[bool] = None) -> list[Tensor]:
    """Gather sequence shards (outputs, gradients) made under `context_parallel` into global tensors
    in sequence order; `load_balance` as the context was given it."""
    import torch.distributed as dist

    group = _group_of(mesh)
    buffers = _tensor_list(buffers, "buffers")
    seq_dims = _seq_dims(seq_dims, buffers, "seq_dims")
    balanced = _load_balanced(load_balance)
    world = dist.get_world_size(group)
    result = []
    for b, d in zip(buffers, seq_dims):
        b = b.contiguous()
        pieces = [torch.empty_like(b) for _ in range(world)]
        dist.all_gather(pieces, b, group=group)
        result.append(unshard_chunks(pieces, d, balanced))
    return result


_WARNED: set = set()


def warn_sites_left_alone(reports: Sequence[Any]) -> None:
    """Warn when a graph compiled under context_parallel (the context's mode makes Dynamo compile its frames again
    inside it) has softmax sites the pass left alone: such a site runs as written, on this rank's shard of the
    sequence only (only fa3.attention calls take the ring), so an attention among them attends to the local keys
    alone."""
    left = [f"{r.where or r.form} ({r.reason})" for r in reports if not r.rewritten]
    if _ACTIVE is None or not left:
        return
    shown = "; ".join(left[:3]) + (f"; and {len(left) - 3} more" if len(left) > 3 else "")
    warnings.warn(f"fa_compile: under context_parallel, {len(left)} softmax site(s) that the pass left alone run as "
                  f"written, on this rank's shard of the sequence only: an attention among them attends to the local "
                  f"keys alone (explain() says why each was left): {shown}", RuntimeWarning, stacklevel=2)


def guard_compiled(compiled: Callable, gm: torch.fx.GraphModule) -> Callable:
    """`compiled` (a graph whose fa3 nodes may have been lowered to kernels at compile time), which
    under context_parallel runs `gm` (the rewritten graph, fa3 ops kept) instead: a lowered kernel
    would attend each rank's queries to its own shard only."""
    from .. import ops

    targets = (ops._ATTENTION, ops._ATTENTION_BACKWARD)
    if not any(n.op == "call_function" and n.target in targets for n in gm.graph.nodes):
        return compiled

    def run(*args):  # the backend's calling convention: compiled(*inputs)
        if _ACTIVE is None:
            return compiled(*args)
        key = id(gm)
        if key not in _WARNED:
            _WARNED.add(key)
            warnings.warn("fa_compile: a graph compiled with lowered attention kernels outside context_parallel runs "
                          "inside it: it runs uncompiled, with ring attention; compile inside the context (or with "
                          "fa_compile.backend(lower=False)) for a compiled ring", RuntimeWarning, stacklevel=2)
        return gm(*args)

    run.__dict__.update(getattr(compiled, "__dict__", {}))  # what Dynamo and AOTAutograd attach to it
    return run
