"""DTensor sharding rules for the fa3 ops: batch- and head-sharded inputs run the op on local shards.

Every op of the `fa3` namespace that user code or a rewritten graph calls on tensors that may be
DTensors has a rule here: `attention`, `attention_backward`, `paged_attention`, `attention_fp8`, and
the row fix-ups `uniform_row_grad(_backward)`, `filled_scores_grad(_backward)`, `nan_row_grad`. (The lowered ops,
`fa3_triton::*`, `fa3_decode::fwd` and `fa3_lowered::forward`, live only in post-grad graphs, after
AOTAutograd has turned every DTensor into its local tensor, so no DTensor reaches them.)

Per mesh dimension each op accepts three placements (DTensor's `expand_to_full_mesh_op_strategy`
combines them over the mesh dimensions):
- everything replicated -> outputs replicated;
- batch: every tensor with a batch dimension Shard on it (q/k/v/out/lse and their gradients dim 0,
  kv_lens, cache_seqlens, page_table, descales, a [B, N] q_pos / q_seg / k_seg, a bias or bool mask
  whose batch dim is not 1); the rest (a broadcast bias, [N] positions, a page pool, sinks)
  replicated;
- heads: q and k/v Shard on their head dimension together, offered only when the number of shards
  divides Hkv (hence Hq): each shard then holds whole GQA groups, Hq / Hkv per shard as in the full
  op; sinks and descales shard with the heads, a bias or mask whose head dim is not 1 too.
A bias broadcast over the sharded dimension gets its gradient as Partial (each shard's sum).

Anything else is redistributed by DTensor, before the local op runs, to the one of those placements
its cost model finds cheapest (never a wrong result; torch 2.13 on a 1-D mesh picks as noted):
- sequence-sharded q/k/v (Shard(2)): replicated, an all-gather of the sequence, with a warning
  pointing to `fa_compile.context_parallel`, which keeps the sequence sharded (ring attention);
- head-dim-sharded (Shard(3)) inputs, and heads that do not split into whole GQA groups (MQA's one
  K/V head on two ranks, 3 K/V heads on 2): replicated (an all-gather);
- Partial inputs: reduced (an all-reduce, or a reduce-scatter onto the batch / heads);
- inconsistent placements (q on batch, k on heads, v replicated): made consistent (here: batch).
Dropout (dropout_p > 0) accepts the replicated placement only: its mask is a hash of the local
(batch, head) indices, so shards would draw a different (and correlated) mask from the full op.

Registration is lazy: `torch.distributed.tensor` costs about a second to import, so `install()`
(called by `import fa_compile`) only hooks the imports, and the rules are registered as soon as
DTensor and the module that defines an op have both been imported, in either order.
"""
from __future__ import annotations

import importlib.machinery
import sys
import warnings
from typing import Any, Callable, Optional

_DTENSOR = "torch.distributed.tensor"

# The three single-mesh-dimension placements a rule offers.
REPLICATE, BATCH, HEADS = "replicate", "batch", "heads"
KINDS = (REPLICATE, BATCH, HEADS)


class _Args:
    """An op call's arguments by name: `shape(name)` of a DTensor argument (None when it is absent or
    not a DTensor), `value(name)` of the others."""

    __slots__ = ("shapes", "values")

    def __init__(self, shapes: dict, values: dict) -> None:
        self.shapes, self.values = shapes, values

    def shape(self, name: str) -> Optional[tuple]:
        return self.shapes.get(name)

    def value(self, name: str) -> Any:
        return self.values.get(name)


# A rule: (kind, args) -> (output placements, {argument name: placement}) or None when the op does not
# accept that kind here. Placements are the kinds' own: "R" (Replicate), an int d (Shard(d)), "P"
# (Partial, sum). Arguments that are not DTensors are skipped by the caller.
Rule = Callable[[str, _Args], Optional[tuple[list, dict]]]


class _OpRule:
    """An op's rule. Plain classes here, not dataclasses: this module is imported at `import torch`."""

    __slots__ = ("module", "op", "rule", "heads", "sequence")

    def __init__(self, module: str, op: str, rule: Rule, heads: tuple, sequence: tuple) -> None:
        self.module = module      # the module whose import defines the op
        self.op = op              # its name in torch.ops.fa3
        self.rule = rule
        self.heads = heads        # (argument, head dim): sharded evenly only (whole GQA groups per shard)
        self.sequence = sequence  # (argument, sequence dim): sharding there is redistributed, with a warning


# ------------------------------------------------------------------------------------ placements
def _dim(kind: str, batch_dim: Optional[int], head_dim: Optional[int]):
    """Shard a tensor's batch / head dimension under that kind (None: it has none: replicated)."""
    d = batch_dim if kind == BATCH else head_dim if kind == HEADS else None
    return "R" if d is None else d


def _bhsd(kind: str):
    return _dim(kind, 0, 1)


def _broadcast(kind: str, shape: Optional[tuple]):
    """A tensor broadcasting (right-aligned) to [B, H, Nq, Nk] (a bias, a bool mask): its batch / head
    dim is sharded when it has one of full size (a size-1 dim broadcasts, so it is replicated)."""
    if shape is None:
        return "R"
    nd = len(shape)
    bd, hd = nd - 4, nd - 3
    return _dim(kind, bd if bd >= 0 and shape[bd] != 1 else None, hd if hd >= 0 and shape[hd] != 1 else None)


def _broadcast_grad(kind: str, shape: Optional[tuple]):
    """The gradient of such a tensor: sharded like it, or Partial where it broadcast over the shards."""
    p = _broadcast(kind, shape)
    return "P" if p == "R" and kind != REPLICATE else p


def _indices(kind: str, shape: Optional[tuple]):
    """q_pos / q_seg / k_seg: [N] or [1, N] replicated, [B, N] sharded with the batch."""
    if shape is None or len(shape) != 2 or shape[0] == 1:
        return "R"
    return _dim(kind, 0, None)


def _batch_vector(kind: str):
    return _dim(kind, 0, None)


def _heads_vector(kind: str):
    return _dim(kind, None, 0)


# ------------------------------------------------------------------------------------------ rules
def _attention_inputs(kind: str, a: _Args, qkv: tuple = ("q", "k", "v")) -> dict:
    ins = {name: _bhsd(kind) for name in qkv}
    ins.update(bias=_broadcast(kind, a.shape("bias")), kv_lens=_batch_vector(kind), dropout_seed="R",
               sinks=_heads_vector(kind), q_pos=_indices(kind, a.shape("q_pos")),
               q_seg=_indices(kind, a.shape("q_seg")), k_seg=_indices(kind, a.shape("k_seg")))
    return ins


def _no_dropout(kind: str, a: _Args) -> bool:
    p = a.value("dropout_p")
    return kind == REPLICATE or not p  # dropout: replicated only (see the module docstring)


def _attention_rule(kind: str, a: _Args):
    if not _no_dropout(kind, a):
        return None
    return [_bhsd(kind), _bhsd(kind)], _attention_inputs(kind, a)


def _attention_backward_rule(kind: str, a: _Args):
    if not _no_dropout(kind, a):
        return None
    ins = _attention_inputs(kind, a, ("dout", "q", "k", "v", "out", "lse"))
    wants_dbias = bool(a.value("bias_requires_grad")) and a.shape("bias") is not None
    dbias = _broadcast_grad(kind, a.shape("bias")) if wants_dbias else "R"  # else an empty [0]
    return [_bhsd(kind)] * 3 + [dbias], ins


def _fp8_rule(kind: str, a: _Args):
    ins = {name: _bhsd(kind) for name in ("q", "k", "v", "q_descale", "k_descale", "v_descale")}
    ins.update(bias=_broadcast(kind, a.shape("bias")), kv_lens=_batch_vector(kind))
    return [_bhsd(kind), _bhsd(kind)], ins


def _row_grad_inputs(kind: str, a: _Args, qkv: tuple) -> dict:
    ins = {name: _bhsd(kind) for name in qkv}
    ins.update(bias=_broadcast(kind, a.shape("bias")), filled=_broadcast(kind, a.shape("filled")))
    return ins


def _row_grad_rule(kind: str, a: _Args):
    return [_bhsd(kind)], _row_grad_inputs(kind, a, ("q", "k", "v"))


def _row_grad_backward_rule(kind: str, a: _Args):
    return [_bhsd(kind)] * 2, _row_grad_inputs(kind, a, ("dg", "q", "k", "v"))


def _nan_row_grad_rule(kind: str, a: _Args):
    """fa3.nan_row_grad: q, k, v, its value and `empty` ([B, Hq, Nq, 1]) all shard on batch or heads."""
    return [_bhsd(kind)], {name: _bhsd(kind) for name in ("q", "k", "v", "empty")}


def _cache_head_dim(a: _Args) -> int:
    return 1 if a.value("layout") == "bhsd" else 2


def _paged_rule(kind: str, a: _Args):
    """q / out [B, Nq, Hq, D]; caches [B, L, Hkv, D] ("bshd") or [B, Hkv, L, D] ("bhsd"), or a pool of
    pages (blocks first) when page_table is given, which no batch shard owns: replicated then."""
    paged = a.shape("page_table") is not None
    cache = _dim(kind, None if paged else 0, _cache_head_dim(a))
    ins = dict(q=_dim(kind, 0, 2), k_cache=cache, v_cache=cache, cache_seqlens=_batch_vector(kind),
               page_table=_batch_vector(kind), cache_leftpad=_batch_vector(kind))
    return [_dim(kind, 0, 2), _bhsd(kind)], ins


_QKV_HEADS = (("q", 1), ("k", 1), ("v", 1))
_QKV_SEQ = (("q", 2), ("k", 2), ("v", 2))
RULES = (
    _OpRule("fa_compile.ops", "attention", _attention_rule, _QKV_HEADS, _QKV_SEQ),
    _OpRule("fa_compile.ops", "attention_backward", _attention_backward_rule, _QKV_HEADS, _QKV_SEQ),
    _OpRule("fa_compile.fp8", "attention_fp8", _fp8_rule, _QKV_HEADS, _QKV_SEQ),
    _OpRule("fa_compile.row_fixups", "uniform_row_grad", _row_grad_rule, _QKV_HEADS, _QKV_SEQ),
    _OpRule("fa_compile.row_fixups", "uniform_row_grad_backward", _row_grad_backward_rule, _QKV_HEADS, _QKV_SEQ),
    _OpRule("fa_compile.row_fixups", "filled_scores_grad", _row_grad_rule, _QKV_HEADS, _QKV_SEQ),
    _OpRule("fa_compile.row_fixups", "filled_scores_grad_backward", _row_grad_backward_rule, _QKV_HEADS, _QKV_SEQ),
    _OpRule("fa_compile.row_fixups", "nan_row_grad", _nan_row_grad_rule, _QKV_HEADS, _QKV_SEQ),
    _OpRule("fa_compile.paged", "paged_attention", _paged_rule, (("q", 2), ("k_cache", None), ("v_cache", None)),
            (("q", 1),)),
)


# ----------------------------------------------------------------------------- DTensor strategies
def _named_args(op_schema) -> tuple[_Args, list[str]]:
    """The call's arguments by schema name, and the names of its DTensor arguments in the order DTensor
    lists their strategies (positional, then keyword)."""
    from torch.distributed.tensor._op_schema import OpStrategy

    shapes, values, order = {}, {}, []
    schema = op_schema.op._schema.arguments
    given = list(zip((arg.name for arg in schema), op_schema.args_schema))
    given += [(name, op_schema.kwargs_schema[name]) for name in op_schema.kwargs_schema]
    for arg in schema:
        if arg.has_default_value():
            values[arg.name] = arg.default_value
    for name, value in given:
        if isinstance(value, OpStrategy):
            shapes[name] = tuple(value.shape)
            order.append(name)
        else:
            values[name] = value
    return _Args(shapes, values), order


def _placement(p):
    from torch.distributed.tensor import Partial, Replicate, Shard

    return Replicate() if p == "R" else Partial() if p == "P" else Shard(p)


def _shards_on(spec, dim: int) -> int:
    """How many pieces a DTensorSpec cuts dimension `dim` into."""
    from torch.distributed.tensor import Shard

    n = 1
    for mesh_dim, p in enumerate(spec.placements):
        if isinstance(p, Shard) and p.dim == dim:
            n *= spec.mesh.size(mesh_dim)
    return n


_WARNED: set = set()


def _warn_sequence_sharding(op: str, entry: _OpRule, op_schema, order: list[str]) -> None:
    from torch.distributed.tensor import Shard

    for name, dim in entry.sequence:
        if name not in order:
            continue
        # in the order of `order` (our ops' tensors are positional: kwargs hold scalars only)
        strategies = (*op_schema.args_strategy, *getattr(op_schema, "kwargs_strategy", ()))
        spec = strategies[order.index(name)].strategies[0].output_spec
        if any(isinstance(p, Shard) and p.dim == dim for p in spec.placements):
            key = (op, name)
            if key not in _WARNED:
                _WARNED.add(key)
                warnings.warn(
                    f"fa3.{op}: {name} is sharded on its sequence dimension ({spec.placements}); DTensor "
                    f"redistributes it to a batch-, head-sharded or replicated placement before the op runs "
                    f"(an all-to-all, or an all-gather of the whole sequence). To keep the sequence sharded "
                    f"(ring attention), run the model under fa_compile.context_parallel.", stacklevel=2)
            return


def _head_dim(entry: _OpRule, name: str, a: _Args) -> int:
    dim = dict(entry.heads)[name]
    return _cache_head_dim(a) if dim is None else dim


def _strategy(entry: _OpRule, op_schema):
    """The OpStrategy of one call: the rule's placements per kind, expanded over the mesh; head
    sharding kept only where every head-sharded tensor is cut into equal whole heads."""
    from torch.distributed.tensor._op_schema import OpStrategy
    from torch.distributed.tensor._ops.utils import expand_to_full_mesh_op_strategy

    a, order = _named_args(op_schema)
    _warn_sequence_sharding(entry.op, entry, op_schema, order)
    single = []
    for kind in KINDS:
        got = entry.rule(kind, a)
        if got is None:
            continue
        outs, ins = got
        single.append([_placement(p) for p in outs] + [_placement(ins.get(name, "R")) for name in order])
    mesh = op_schema.get_mesh_from_args()
    n_out = len(op_schema.op._schema.returns)
    full = expand_to_full_mesh_op_strategy(mesh, op_schema, single, input_index=n_out)
    heads = [(order.index(name), name) for name, _ in entry.heads if name in order]

    def even(spec) -> bool:
        for i, name in heads:
            dim = _head_dim(entry, name, a)
            if a.shape(name)[dim] % _shards_on(spec.input_specs[i], dim):
                return False
        return True

    kept = [s for s in full.strategies if even(s)]
    return OpStrategy(kept)


def _schema_info(op):
    """Every non-tensor argument is part of DTensor's cache key (the rules read dropout_p, layout and
    bias_requires_grad)."""
    from torch.distributed.tensor._op_schema import RuntimeSchemaInfo

    args = op._schema.arguments
    first = next((i for i, arg in enumerate(args) if not arg.kwarg_only and not _is_tensor(arg)), 100)
    kwargs = [arg.name for arg in args if arg.kwarg_only and not _is_tensor(arg)]
    return RuntimeSchemaInfo(static_argnum=first, static_kwargkey=kwargs or None)


def _is_tensor(arg) -> bool:
    import torch

    t = arg.type
    if isinstance(t, torch.OptionalType):
        t = t.getElementType()
    return isinstance(t, torch.TensorType)


_REGISTERED: set = set()


def register_loaded() -> list[str]:
    """Register the rules of every op whose module is imported, if DTensor is; returns the op names
    registered by this call."""
    if _DTENSOR not in sys.modules:
        return []
    import torch
    from torch.distributed.tensor import DTensor

    propagator = DTensor._op_dispatcher.sharding_propagator
    done = []
    for entry in RULES:
        if entry.op in _REGISTERED or entry.module not in sys.modules or not hasattr(torch.ops.fa3, entry.op):
            continue
        op = getattr(torch.ops.fa3, entry.op).default
        propagator.register_op_strategy(op, lambda op_schema, entry=entry: _strategy(entry, op_schema),
                                        _schema_info(op))
        _REGISTERED.add(entry.op)
        done.append(entry.op)
    return done


# ------------------------------------------------------------------------------------ import hooks
_HOOKED = frozenset({_DTENSOR, *(entry.module for entry in RULES)})


class _RegisterOnImport:  # a sys.meta_path finder (importlib.abc costs an import of importlib.resources)
    """Wraps the loaders of DTensor and of the modules that define the ops: `register_loaded()` runs
    right after each of them has loaded."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name not in _HOOKED:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return None
        exec_module = loader.exec_module

        def exec_and_register(module: Any) -> None:
            exec_module(module)
            try:
                register_loaded()
            except Exception as e:  # never break the user's import
                warnings.warn(f"fa-compile could not register the DTensor sharding rules of its ops: "
                              f"{type(e).__name__}: {e}")

        loader.exec_module = exec_and_register
        return spec


def install() -> None:
    """Register the rules now for what is imported, and on import for the rest."""
    register_loaded()
    if not any(isinstance(f, _RegisterOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _RegisterOnImport())
