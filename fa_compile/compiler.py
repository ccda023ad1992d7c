"""The torch.compile backend: rewrite attention in the Dynamo graph, then hand it to an inner compiler."""
from __future__ import annotations

import hashlib
import sys
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from . import config

INNER_COMPILERS = ("inductor", "aot_eager", "eager")
_DONE = "fa_compile_rewritten"


@dataclass(frozen=True)
class BackendConfig:
    """What `backend(...)` was asked for; the returned backend carries it as `.fa_compile_config`."""

    inner: str = "inductor"
    kernel: Optional[str] = None  # force one kernel for every site (also FA_COMPILE_KERNEL)
    mode: Optional[str] = None  # Inductor mode: "default", "reduce-overhead", "max-autotune", ...
    options: dict = field(default_factory=dict)  # Inductor config patches
    tune: bool = False  # time the eligible kernels at compile time (this backend's graphs only)
    lower: bool = True  # lower each fa3 node to its kernel's own call in the post-grad graph (inductor only)
    fp8: Optional[bool] = None  # FP8 attention at eligible inference sites; None: FA_COMPILE_FP8 decides

    def __post_init__(self) -> None:
        if self.inner not in INNER_COMPILERS:
            raise ValueError(f"inner: must be one of {INNER_COMPILERS}, got {self.inner!r}")
        if self.inner != "inductor" and (self.mode or self.options):
            raise ValueError(f"mode, options: only apply to inner='inductor', not {self.inner!r}")


def run_pass(gm: fx.GraphModule, kernel: Optional[str] = None, record: bool = True,
             fp8: Optional[bool] = None, constants: bool = True) -> list:
    """Rewrite `gm` in place (once) and return the site reports; with `record`, counts them and logs
    them when FA_COMPILE_LOG=1 (the backend records only once its inner compile kept the graph).
    fp8: FP8 attention at the sites that can take it (fa_compile/fp8.py); None reads FA_COMPILE_FP8.
    constants: the mask analysis may read module buffers as constants, for a caller that wraps the
    compiled graph with `constant_guard.guard_constants` (the reads are kept on gm.meta); False treats
    them as data (patterns/constants.py)."""
    from . import constant_guard, forward_ad
    from . import ops  # noqa: F401  (registers torch.ops.fa3 before the pass emits it)
    from . import paged  # noqa: F401  (registers torch.ops.fa3.paged_attention, emitted for paged caches)
    from .patterns import constants as pass_constants
    from .patterns.pipeline import GraphRecord, rewrite_attention
    from .patterns.site import PassOptions

    if gm.meta.get(_DONE):
        return []
    options = PassOptions(kernel=kernel, paged_check=paged_refusal)
    if constants:
        before = GraphRecord(gm.graph)
        with pass_constants.reading() as reads:
            reports = rewrite_attention(gm, options)
        changed = any(r.rewritten for r in reports)
        constant_guard.record(gm, reads, before.original() if reads and changed else None)
        if changed:  # (the graph as traced, rebuilt only should a call with forward-AD tangents come)
            gm.meta[forward_ad.PASS_RECORD] = before
    else:
        reports = rewrite_attention(gm, options)
    if config.fp8_requested() if fp8 is None else fp8:
        from .fp8 import convert_sites

        convert_sites(gm, reports)
    gm.meta[_DONE] = True
    if record:
        record_reports(reports)
    return reports


def paged_refusal(node: fx.Node) -> Optional[str]:
    """Why an emitted fa3.paged_attention call would run only the reference on its GPU (None: a fused
    kernel takes it, or it is on the CPU, where the reference is the paged path): the pass then keeps
    the gathered K/V, whose attention kernels take any number of query tokens."""
    from . import paged
    from .report import paged_args_of_call

    a = paged_args_of_call(node)
    if a.q.device.type == "cpu" or node.kwargs.get("force_kernel") is not None:
        return None
    refused = [(name, why) for name, why in paged.explain_choice(a) if name != "reference"]
    if all(why for _, why in refused):
        why = "; ".join(f"{n}: {'; '.join(w)}" for n, w in refused)
        return f"no fused paged kernel takes these inputs ({why})"
    return None


_ATTEMPTS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # Dynamo CompileContext -> (attempt, graphs, rewritten, missed)


def record_reports(reports: list) -> None:
    """Count the reports in torch._dynamo.utils.counters["fa_compile"] and log them (FA_COMPILE_LOG=1).

    Dynamo may restart a compile and throw its graph away (e.g. when AOTAutograd specializes a float
    that dynamic=True made an input); the counts of an earlier attempt of the same compile are then
    taken back, so the counters describe the graphs that run."""
    import torch._guards
    from torch._dynamo.utils import counters

    c = counters["fa_compile"]
    ctx = torch._guards.CompileContext.try_get()
    now = (1, sum(r.rewritten for r in reports), sum(not r.rewritten for r in reports))
    if ctx is not None:  # one context per frame compile; its attempt counts the restarts
        cid = ctx.compile_id
        attempt, *before = _ATTEMPTS.get(ctx, (ctx.attempt, 0, 0, 0))
        if attempt != ctx.attempt:  # a restart: the earlier attempt's graphs never run
            c["graphs"], c["sites_rewritten"], c["sites_missed"] = (
                c["graphs"] - before[0], c["sites_rewritten"] - before[1], c["sites_missed"] - before[2])
            before = [0, 0, 0]
            if config.log_enabled():
                print(f"fa-compile: Dynamo restarted compile {cid}: the graph of the table above is discarded",
                      file=sys.stderr)
        _ATTEMPTS[ctx] = (ctx.attempt, *(b + n for b, n in zip(before, now)))
    c["graphs"] += now[0]
    c["sites_rewritten"] += now[1]
    c["sites_missed"] += now[2]
    if config.log_enabled() and reports:
        from .report import ExplainReport

        print(ExplainReport.from_reports(reports, with_kernels=True), file=sys.stderr)


def _lowering_pass(current: Any, tune: Optional[bool] = None) -> Any:
    """Our post-grad lowering pass chained ahead of `current` (the user's), never twice."""
    from .lowering import LoweringPass

    if isinstance(current, LoweringPass):
        current = current.chained
    return LoweringPass(chained=current, tune=tune)


_FALLBACK_WARNED: set = set()


def _warn_compile_fallback(err: Exception, what: str = "the lowered attention kernels",
                           instead: str = "torch.ops.fa3 kept (run-time dispatch)") -> None:
    import warnings

    key = (type(err).__name__, str(err)[:80])
    if key not in _FALLBACK_WARNED:
        _FALLBACK_WARNED.add(key)
        warnings.warn(f"fa_compile: compiling {what} failed ({type(err).__name__}: "
                      f"{str(err)[:200]}); compiled again with {instead}",
                      RuntimeWarning, stacklevel=3)


def _outputs_share_storage(gm: fx.GraphModule) -> bool:
    """Whether two outputs of the Dynamo graph lie over one storage (one a view of the other, or both views
    of one intermediate)."""
    import torch
    from torch.multiprocessing.reductions import StorageWeakRef

    out = next((n for n in reversed(gm.graph.nodes) if n.op == "output"), None)
    if out is None:
        return False
    seen: set = set()
    for node in _flat_nodes(out.args):
        value = node.meta.get("example_value")
        if not isinstance(value, torch.Tensor) or value.is_sparse:
            continue
        try:
            ref = StorageWeakRef(value.untyped_storage())
        except Exception:  # noqa: BLE001 - a tensor without a plain storage: nothing to compare
            continue
        if ref in seen:
            return True
        seen.add(ref)
    return False


def _flat_nodes(args: Any) -> list:
    found: list = []
    fx.node.map_arg(args, found.append)
    return found


def _autograd_cache_scope(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
    """No AOTAutograd cache for a training graph whose outputs share a storage: from a warm entry, torch
    (2.13 at least, with plain Inductor as well) rebuilds an output that is a view of another output with
    garbage sizes, a RuntimeError or a crash in the second process (inference graphs were not seen to).
    Such a graph compiles as in a cold process (Inductor's own graph cache still serves it); every other
    graph keeps the cache."""
    import contextlib

    import torch
    import torch._functorch.config as functorch_config

    trains = torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in example_inputs)
    if not trains or not hasattr(functorch_config, "enable_autograd_cache") or not _outputs_share_storage(gm):
        return contextlib.nullcontext()
    return functorch_config.patch(enable_autograd_cache=False)


def _inner_compile(cfg: BackendConfig, gm: fx.GraphModule, example_inputs: Sequence[Any], mode: Optional[str], options: Optional[dict]):
    if cfg.inner == "inductor":
        from .forward_ad import route_dual_calls
        from .sdpa_pattern_guard import softmax_dim_checked

        with _autograd_cache_scope(gm, example_inputs), softmax_dim_checked():
            return route_dual_calls(_compile_inductor(cfg, gm, example_inputs, mode, options), gm)
    if (mode and mode != "default") or options:
        # torch.compile(..., mode=/options=) reach the backend as these arguments: never drop them.
        raise ValueError(f"mode, options: torch.compile's mode={mode!r} / options={options!r} only apply to "
                         f"fa_compile.backend(inner='inductor'), this backend's inner compiler is {cfg.inner!r}")
    if cfg.inner == "eager":
        return gm.forward
    from torch._dynamo.backends.debugging import aot_eager

    return aot_eager(gm, example_inputs)


def _compile_inductor(cfg: BackendConfig, gm: fx.GraphModule, example_inputs: Sequence[Any], mode: Optional[str],
                      options: Optional[dict]):
    import torch._inductor
    from torch._inductor.compile_fx import compile_fx

    patches: dict = {}
    chosen_mode = mode or cfg.mode
    if chosen_mode:
        patches.update(torch._inductor.list_mode_options(chosen_mode))
    patches.update(cfg.options)
    patches.update(options or {})
    import torch._inductor.config as inductor_config

    from . import ops
    from .sdpa_pattern_guard import keyed

    patches["joint_custom_pre_pass"] = keyed(patches.get("joint_custom_pre_pass",
                                                         inductor_config.joint_custom_pre_pass))

    if not cfg.lower or config.killed() or ops._CP_HOOK is not None:  # context parallel: the ring needs the op
        return compile_fx(gm, example_inputs, config_patches=patches)
    from .distributed.context import guard_compiled

    current = patches.get("post_grad_custom_pre_pass", inductor_config.post_grad_custom_pre_pass)
    lowering = _lowering_pass(current, cfg.tune or None)
    try:
        # (lowered kernels would attend to one shard: under context_parallel, gm runs with the op instead)
        compiled = compile_fx(gm, example_inputs, config_patches=dict(patches, post_grad_custom_pre_pass=lowering))
        return guard_compiled(compiled, gm)
    except Exception as e:
        # A lowered kernel call that Inductor cannot compile: the graph again with the fa3 op kept
        # (its run-time dispatch), so a lowering never fails a compile. AOTAutograd traced copies of
        # gm, so gm itself is as the rewrite left it. (A backward compiled lazily, at its first run,
        # is not covered here; the splice-time checks of fa_compile/lowering are its guard.)
        if not lowering.lowered:
            raise  # nothing of ours in the graphs: not a lowering's failure
        _warn_compile_fallback(e)
        return compile_fx(gm, example_inputs, config_patches=patches)


def check_flag(value: Any, name: str, optional: bool = False) -> None:
    """A switch is a bool (or None where that means "follow the environment"): a string such as "false" would
    otherwise read as True."""
    if not (isinstance(value, bool) or (optional and value is None)):
        raise TypeError(f"{name}: expected a bool{' or None' if optional else ''}, got {type(value).__name__} "
                        f"{value!r}")


def backend(
    inner: str = "inductor",
    *,
    kernel: Optional[str] = None,
    mode: Optional[str] = None,
    options: Optional[dict] = None,
    tune: bool = False,
    lower: bool = True,
    fp8: Optional[bool] = None,
) -> Callable:
    """A configured backend for `torch.compile(model, backend=fa_compile.backend(...))`.

    inner: the compiler that gets the rewritten graph ("inductor", "aot_eager", "eager").
    kernel: force one kernel by name for every site (an error at run time names the refusal).
    mode / options: passed to Inductor, as torch.compile's own `mode=` / `options=` are.
    tune: at compile time, time the eligible kernels of each site on this GPU once per shape bucket
    and cache the winner on disk (FA_COMPILE_TUNE=1 does the same for every compile and at run time);
    for this backend's graphs only.
    lower: under inner="inductor", replace each fa3 op in the post-grad graphs by the call of the kernel
    chosen for it at compile time (fa_compile/lowering/); False keeps the op and its run-time dispatch.
    fp8: True runs every inference site the FP8 kernel takes in FP8 (Q, K, V and P rounded to e4m3: results
    change by more than rounding; `explain()` says per site whether and why not); False never; None
    (the default) follows FA_COMPILE_FP8. Float8 inputs take the FP8 op whatever this says.
    """
    if kernel is not None:  # a misspelt kernel fails here, not at the first call of the compiled model
        from .dispatch import check_kernel_name

        check_kernel_name(kernel, "kernel")
    check_flag(tune, "tune")
    check_flag(lower, "lower")
    check_flag(fp8, "fp8", optional=True)
    if options is not None and not isinstance(options, dict):
        raise TypeError(f"options: a dict of Inductor config settings, got {type(options).__name__} {options!r}")
    if mode is not None:
        import torch._inductor

        try:  # a misspelt mode fails here, as torch.compile's own does, not at the first call
            torch._inductor.list_mode_options(mode)
        except Exception as e:
            raise ValueError(f"mode: {e}") from None
    cfg = BackendConfig(inner=inner, kernel=kernel, mode=mode, options=dict(options or {}), tune=tune, lower=lower,
                        fp8=fp8)

    def fa3_backend(gm: fx.GraphModule, example_inputs: Sequence[Any], mode: Optional[str] = None, options: Optional[dict] = None):
        """The torch.compile backend: rewrite attention in `gm`, then compile it with the inner compiler."""
        from . import tuning

        with tuning.scoped(cfg.tune or None):
            reports = [] if config.killed() else run_pass(gm, cfg.kernel, record=False, fp8=cfg.fp8)
            try:
                compiled = _inner_compile(cfg, gm, example_inputs, mode, options)
            except Exception as e:  # our op inside a HOP body the inner compiler rejects: those bodies as traced
                from .patterns.subgraphs import undo_subgraph_rewrites

                if not undo_subgraph_rewrites(gm, e):
                    raise
                _warn_compile_fallback(e, "the rewritten higher-order-op bodies", "those bodies as traced")
                compiled = _inner_compile(cfg, gm, example_inputs, mode, options)
        record_reports(reports)  # not reached for a graph the inner compile made Dynamo discard
        from .constant_guard import guard_constants
        from .distributed.context import warn_sites_left_alone

        warn_sites_left_alone(reports)

        def recompile(traced: fx.GraphModule, inputs: list) -> Callable:
            """The traced graph rewritten with buffers read as data, and compiled as above (guard_constants)."""
            with tuning.scoped(cfg.tune or None):
                again = run_pass(traced, cfg.kernel, record=False, fp8=cfg.fp8, constants=False)
                fn = _inner_compile(cfg, traced, inputs, mode, options)
            record_reports(again)
            return fn

        return guard_constants(compiled, gm, example_inputs, recompile)

    fa3_backend.fa_compile_config = cfg  # type: ignore[attr-defined]
    # The registered backend's name (torch.compile takes a callable's __name__ as its compiler_name): Dynamo then
    # clears, after each compile, the weak references its fake-tensor converter keeps to the real inputs, as it
    # does for registered backends only (torch.utils.swap_tensors refuses a tensor with one).
    fa3_backend.__name__ = fa3_backend.compiler_name = "fa3"  # type: ignore[attr-defined]
    return fa3_backend


# The backend registered under the name "fa3".
fa3 = backend()


class PreGradRewritePass(CustomGraphPass):
    """The attention rewrite as Inductor's pre-grad custom pass (FA_COMPILE=1), then `chained` (the
    pass the user had installed), if any. A CustomGraphPass, so the FX graph cache keys on it."""

    def __init__(self, chained: Any = None):
        self.chained = chained

    def __call__(self, graph: fx.Graph) -> None:
        gm = graph.owning_module
        if gm is not None and not config.killed():
            from .patterns.fused_common import specializing_floats

            with specializing_floats():  # floats read as constants are guarded here (see fused_common)
                run_pass(gm, constants=False)  # nothing here sees the compiled graph to check them
        if self.chained is not None:
            self.chained(graph)

    def uuid(self) -> Optional[Any]:
        import os

        from .lowering.graph_pass import _source_hash, chained_uuid

        keyed, chained = chained_uuid(self.chained)
        if not keyed:
            return None
        from . import patterns as _patterns

        patterns = os.path.dirname(os.path.abspath(_patterns.__file__))
        here = os.path.dirname(os.path.abspath(__file__))
        files = [__file__, os.path.join(here, "fp8.py"), os.path.join(here, "sdpa_pattern_guard.py")]
        files += sorted(os.path.join(root, f) for root, _dirs, fs in os.walk(patterns) for f in fs if f.endswith(".py"))
        key = repr((get_hash_for_files(tuple(files)).hex(), _source_hash(), config.killed(), config.fp8_requested(),
                    chained))
        return hashlib.sha256(key.encode()).hexdigest()


def install_inductor_pass() -> None:
    """Chain the rewrite into Inductor's pre-grad custom pass and the lowering into its post-grad
    pre-pass (for FA_COMPILE=1 and default torch.compile), each ahead of what the user had there."""
    import torch._inductor.config as inductor_config

    from .sdpa_pattern_guard import install

    install()  # refused sites run as written here too (Inductor's attention patterns ignore the softmax's dim)
    current = inductor_config.pre_grad_custom_pass
    if not isinstance(current, PreGradRewritePass):
        inductor_config.pre_grad_custom_pass = PreGradRewritePass(current)
    post = inductor_config.post_grad_custom_pre_pass
    from .lowering import LoweringPass

    if not isinstance(post, LoweringPass):
        inductor_config.post_grad_custom_pre_pass = _lowering_pass(post)
