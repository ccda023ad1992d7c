"""`fa_compile.explain(model_or_fn, *args, **kwargs)`: every softmax site, rewritten or missed and why,
with the kernel dispatch would choose for the example inputs."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from . import dispatch


@dataclass
class SiteRow:
    site: Any  # patterns.site.SiteReport
    kernel_fwd: Optional[str] = None
    kernel_bwd: Optional[str] = None
    refused: list = field(default_factory=list)  # [(candidate, [reasons])] ahead of the chosen forward kernel
    refused_bwd: list = field(default_factory=list)


def _args_of_call(node) -> Optional[dispatch.AttentionArgs]:
    """AttentionArgs built from an emitted fa3.attention node's example values (fake tensors)."""
    from .patterns.emit import example_value

    if node is None or node.target is not torch.ops.fa3.attention.default:
        return None  # fa3.paged_attention sites: see _paged_row
    vals = [example_value(a) for a in node.args]
    names = ("q", "k", "v", "scale", "causal", "diag_offset", "window_left", "window_right", "bias", "kv_lens",
             "softcap", "dropout_p", "dropout_seed")
    kw = dict(zip(names, vals))
    for i, name in enumerate(("sinks", "q_pos", "q_seg", "k_seg"), start=14):
        kw[name] = vals[i] if len(vals) > i else node.kwargs.get(name)
    if any(not isinstance(kw[n], torch.Tensor) for n in ("q", "k", "v")):
        return None
    kw["needs_backward"] = any(kw[n].requires_grad for n in ("q", "k", "v"))
    bias = kw.get("bias")
    kw["bias_requires_grad"] = isinstance(bias, torch.Tensor) and bias.requires_grad and bias.dtype != torch.bool
    return dispatch.AttentionArgs(**kw)


def paged_args_of_call(node) -> Any:
    """fa_compile.paged.PagedArgs built from an emitted fa3.paged_attention node's example values."""
    from . import paged
    from .patterns.emit import example_value

    q, kc, vc, lens, table, pad = (example_value(a) for a in node.args[:6])
    kw = node.kwargs
    return paged.PagedArgs(q, kc, vc, lens, table, pad, kw["scale"], kw.get("causal", False),
                           kw.get("layout", "bshd"), kw.get("num_splits", 0))


def _paged_row(row: SiteRow, node) -> SiteRow:
    """The kernel an emitted fa3.paged_attention node gets for its example values (fake tensors)."""
    from . import paged

    forced = node.kwargs.get("force_kernel")
    for name, reasons in paged.explain_choice(paged_args_of_call(node)):  # in priority order: the first that can runs
        if forced is not None and name != forced:
            continue
        if not reasons:
            row.kernel_fwd = name
            break
        row.refused.append((name, reasons))
    return row


def _kernel_row(site) -> SiteRow:
    from . import paged  # noqa: F401  (registers fa3::paged_attention)

    row = SiteRow(site)
    if site.rewritten and getattr(site.call, "target", None) is torch.ops.fa3.paged_attention.default:
        return _paged_row(row, site.call)
    if site.rewritten and site.fp8 == "used":
        row.kernel_fwd = "fp8"  # fa3.attention_fp8: the FP8 kernel, inference only (fa_compile/fp8.py)
        return row
    args = _args_of_call(site.call) if site.rewritten else None
    if args is not None:
        forced = site.call.args[13] if len(site.call.args) > 13 else None
        row.kernel_fwd, row.refused = dispatch.explain_choice(args, forced, "forward")
        if args.needs_backward:
            row.kernel_bwd, row.refused_bwd = dispatch.explain_choice(args, forced, "backward")
    return row


def dtype_name(dtype: Any) -> str:
    """One spelling for every site: "float32", not "torch.float32"."""
    return str(dtype).replace("torch.", "") if dtype is not None else ""


@dataclass
class ExplainReport:
    rows: list

    @classmethod
    def from_reports(cls, reports: list, with_kernels: bool = True) -> "ExplainReport":
        for r in reports:
            r.dtype = dtype_name(r.dtype) or None
        return cls([_kernel_row(r) if with_kernels else SiteRow(r) for r in reports])

    @property
    def sites(self) -> list:
        return [r.site for r in self.rows]

    @property
    def rewritten(self) -> list:
        return [r.site for r in self.rows if r.site.rewritten]

    @property
    def missed(self) -> list:
        return [r.site for r in self.rows if not r.site.rewritten]

    def table(self) -> str:
        """The summary line and one row per site (status, form, shapes, dtype, mask, GQA, kernels, where / why)."""
        head = ("#", "status", "form", "q / k / v", "dtype", "mask", "gqa", "kernel (fwd / bwd)", "where / why")
        lines = []
        for i, row in enumerate(self.rows):
            s = row.site
            shapes = " / ".join("x".join(str(d) for d in sh) if sh else "?" for sh in (s.q_shape, s.k_shape, s.v_shape))
            kern = "" if not s.rewritten else (row.kernel_fwd or "?") + (f" / {row.kernel_bwd}" if row.kernel_bwd else "")
            why = (s.where + (f"; {s.cache}" if s.cache else "")) if s.rewritten else f"{s.reason}  [{s.where}]"
            fixups = getattr(s.call, "meta", {}).get("fa_compile_fixups", []) if s.rewritten else []
            if fixups:
                why += "; with " + ", ".join(fixups)
            lines.append((str(i), "rewritten" if s.rewritten else "MISSED", s.form, shapes, dtype_name(s.dtype), s.mask,
                          s.gqa or "", kern, why))
        widths = [max(len(h), *(len(l[c]) for l in lines)) if lines else len(h) for c, h in enumerate(head)]
        fmt = lambda cols: "  ".join(c.ljust(w) for c, w in zip(cols, widths)).rstrip()
        out = [f"fa-compile: {len(self.rewritten)} of {len(self.rows)} attention sites rewritten", fmt(head),
               fmt(tuple("-" * w for w in widths))]
        out += [fmt(l) for l in lines]
        return "\n".join(out)

    def kernels_passed_over(self) -> str:
        """Why each faster kernel did not take a site: one line per kernel and reason, forward and
        backward merged, and sites whose reasons are the same as an earlier site's named with it."""
        groups: dict = {}  # the refusals of a site -> the sites that have them
        for i, row in enumerate(self.rows):
            if row.refused or row.refused_bwd:
                groups.setdefault((repr(row.refused), repr(row.refused_bwd)), (row, []))[1].append(i)
        out = []
        for row, sites in groups.values():
            names = ", ".join(map(str, sites))
            out.append(f"kernels passed over at site{'s' if len(sites) > 1 else ''} {names}:")
            merged: dict = {}  # (kernel, reasons) -> the passes ("fwd", "bwd") that refused it for them
            for direction, refused in (("fwd", row.refused), ("bwd", row.refused_bwd)):
                for name, reasons in refused:
                    merged.setdefault((name, "; ".join(reasons)), []).append(direction)
            out += [f"  {name} ({', '.join(dirs)}): {why}" for (name, why), dirs in merged.items()]
        return "\n".join(out)

    def fp8_lines(self) -> str:
        """With FP8 asked for: the sites that got it, and why each other site did not."""
        groups: dict = {}
        for i, row in enumerate(self.rows):
            if row.site.rewritten and row.site.fp8:
                groups.setdefault(row.site.fp8, []).append(i)
        return "\n".join(f"fp8 at site{'s' if len(sites) > 1 else ''} {', '.join(map(str, sites))}: {text}"
                         for text, sites in groups.items())

    def __str__(self) -> str:
        from .lowering import explain_lines  # what each site's kernel call becomes at compile time

        notes = "\n".join(filter(None, (self.kernels_passed_over(), self.fp8_lines(), explain_lines(self.rows))))
        return self.table() + ("\n" + notes if notes else "")

    __repr__ = __str__


def explain(model_or_fn: Callable, *args: Any, kernel: Optional[str] = None, fp8: Optional[bool] = None,
            **kwargs: Any) -> ExplainReport:
    """Trace `model_or_fn(*args, **kwargs)` with Dynamo, run the pass, and report every site.

    kernel / fp8: as `fa_compile.backend(kernel=..., fp8=...)` (fp8=None follows FA_COMPILE_FP8).

    The call runs once (the rewritten graph, eagerly); nothing the user compiled elsewhere is reset.
    """
    from .compiler import check_flag, run_pass

    check_flag(fp8, "fp8", optional=True)
    if kernel is not None:  # as backend(kernel=...): a misspelt or mistyped name fails here, naming the argument
        from .dispatch import check_kernel_name

        check_kernel_name(kernel, "kernel")
    reports: list = []

    def capture(gm, example_inputs):
        reports.extend(run_pass(gm, kernel, fp8=fp8))
        return gm.forward

    compiled = torch.compile(model_or_fn, backend=capture)
    compiled(*args, **kwargs)
    return ExplainReport.from_reports(reports, with_kernels=True)
