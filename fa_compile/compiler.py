"""The torch.compile backend: rewrite attention in the Dynamo graph, then hand it to an inner compiler."""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch.fx as fx

from . import config

INNER_COMPILERS = ("inductor", "aot_eager", "eager")
_DONE = "fa_compile_rewritten"


@dataclass(frozen=True)
class BackendConfig:
    inner: str = "inductor"
    kernel: Optional[str] = None  # force one kernel for every site (also FA_COMPILE_KERNEL)
    mode: Optional[str] = None  # Inductor mode: "default", "reduce-overhead", "max-autotune", ...
    options: dict = field(default_factory=dict)  # Inductor config patches

    def __post_init__(self) -> None:
        if self.inner not in INNER_COMPILERS:
            raise ValueError(f"inner: must be one of {INNER_COMPILERS}, got {self.inner!r}")
        if self.inner != "inductor" and (self.mode or self.options):
            raise ValueError(f"mode, options: only apply to inner='inductor', not {self.inner!r}")


def run_pass(gm: fx.GraphModule, kernel: Optional[str] = None) -> list:
    """Rewrite `gm` in place (once) and return the site reports; logs them when FA_COMPILE_LOG=1."""
    from . import ops  # noqa: F401  (registers torch.ops.fa3 before the pass emits it)
    from .patterns.pipeline import rewrite_attention
    from .patterns.site import PassOptions

    if gm.meta.get(_DONE):
        return []
    reports = rewrite_attention(gm, PassOptions(kernel=kernel))
    gm.meta[_DONE] = True
    from torch._dynamo.utils import counters

    counters["fa_compile"]["graphs"] += 1
    counters["fa_compile"]["sites_rewritten"] += sum(r.rewritten for r in reports)
    counters["fa_compile"]["sites_missed"] += sum(not r.rewritten for r in reports)
    if config.log_enabled() and reports:
        from .report import ExplainReport

        print(ExplainReport.from_reports(reports, with_kernels=True), file=sys.stderr)
    return reports


def _inner_compile(cfg: BackendConfig, gm: fx.GraphModule, example_inputs: Sequence[Any], mode: Optional[str], options: Optional[dict]):
    if cfg.inner == "eager":
        return gm.forward
    if cfg.inner == "aot_eager":
        from torch._dynamo.backends.debugging import aot_eager

        return aot_eager(gm, example_inputs)
    import torch._inductor
    from torch._inductor.compile_fx import compile_fx

    patches: dict = {}
    chosen_mode = mode or cfg.mode
    if chosen_mode:
        patches.update(torch._inductor.list_mode_options(chosen_mode))
    patches.update(cfg.options)
    patches.update(options or {})
    return compile_fx(gm, example_inputs, config_patches=patches)


def backend(
    inner: str = "inductor",
    *,
    kernel: Optional[str] = None,
    mode: Optional[str] = None,
    options: Optional[dict] = None,
    tune: bool = False,
) -> Callable:
    """A configured backend for `torch.compile(model, backend=fa_compile.backend(...))`.

    inner: the compiler that gets the rewritten graph ("inductor", "aot_eager", "eager").
    kernel: force one kernel by name for every site (an error at run time names the refusal).
    mode / options: passed to Inductor, as torch.compile's own `mode=` / `options=` are.
    tune: time the eligible kernels once per shape bucket on this GPU and cache the winner on disk
    (as FA_COMPILE_TUNE=1 does).
    """
    if tune:
        from . import tuning

        tuning.enable(True)
    cfg = BackendConfig(inner=inner, kernel=kernel, mode=mode, options=dict(options or {}))

    def fa3_backend(gm: fx.GraphModule, example_inputs: Sequence[Any], mode: Optional[str] = None, options: Optional[dict] = None):
        if not config.killed():
            run_pass(gm, cfg.kernel)
        return _inner_compile(cfg, gm, example_inputs, mode, options)

    fa3_backend.fa_compile_config = cfg  # type: ignore[attr-defined]
    return fa3_backend


# The backend registered under the name "fa3".
fa3 = backend()


def _inductor_pre_grad_pass(graph: fx.Graph) -> None:
    gm = graph.owning_module
    if gm is None or config.killed():
        return
    run_pass(gm)


def install_inductor_pass() -> None:
    """Chain the rewrite into Inductor's pre-grad custom pass (for FA_COMPILE=1 and default torch.compile)."""
    import torch._inductor.config as inductor_config

    current = inductor_config.pre_grad_custom_pass
    if current is _inductor_pre_grad_pass:
        return
    if current is None:
        inductor_config.pre_grad_custom_pass = _inductor_pre_grad_pass
        return

    def chained(graph: fx.Graph) -> None:
        _inductor_pre_grad_pass(graph)
        current(graph)

    inductor_config.pre_grad_custom_pass = chained
