"""Draw one chart per table of BENCHMARKS.md from the recorded results.

Reads the JSON results in benchmarks/results/ and, for the tables whose figures exist only as text
(BENCHMARKS.md, benchmarks/results/*.md and *.txt), the exact figures copied below with their source
file and date. Writes one PNG per table into benchmarks/results/. Nothing is measured here: every
bar is a recorded figure, unchanged.

Needs matplotlib, a benchmark-only dependency: `pip install matplotlib`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Callable

RESULTS = Path(__file__).resolve().parent / "results"
DPI = 110
MISSING = None  # a peer that was not run or does not take that input

# ---------------------------------------------------------------------------------------------
# Figures recorded only as text. Each block names its source file and date; values are verbatim
# strings, so a chart labels each bar exactly as its source writes it.
# ---------------------------------------------------------------------------------------------

# BENCHMARKS.md "Whole models" table, GPT-2 rows. Sources: benchmarks/results/models.md,
# run 4 (2026-11-29 16:40 UTC), run 3 (2026-11-29 16:24 UTC), run 1 (2026-11-29 14:25 UTC,
# eager + inductor); the reduce-overhead row is from BENCHMARKS.md (profile_model.py, 2026-11-29).
GPT2_MODELS = {
    "forward, ms": {
        "GPT-2 run 16:40": {"eager + inductor": MISSING, "SDPA + inductor": "7.645", "eager + fa3": "6.003"},
        "GPT-2 run 16:24": {"eager + inductor": MISSING, "SDPA + inductor": "7.184", "eager + fa3": "5.716"},
        "GPT-2 run 14:25": {"eager + inductor": "13.99", "SDPA + inductor": MISSING, "eager + fa3": MISSING},
        "GPT-2 reduce-overhead": {"eager + inductor": MISSING, "SDPA + inductor": "6.714", "eager + fa3": "5.062"},
    },
    "training step, ms": {
        "GPT-2 run 16:40": {"eager + inductor": MISSING, "SDPA + inductor": "28.44", "eager + fa3": "24.36"},
        "GPT-2 run 16:24": {"eager + inductor": MISSING, "SDPA + inductor": "28.11", "eager + fa3": "25.69"},
        "GPT-2 run 14:25": {"eager + inductor": "47.02", "SDPA + inductor": MISSING, "eager + fa3": MISSING},
    },
    "peak memory, training, GB": {
        "GPT-2": {"eager + inductor": "16.86", "SDPA + inductor": "6.16", "eager + fa3": "6.13"},
    },
}

# BENCHMARKS.md generate() table. Source: benchmarks/results/models.md, run 4 (2026-11-29
# 16:40 UTC) and run 3 (2026-11-29 16:24 UTC).
GENERATE_TOKENS_S = {
    "Llama, run 16:40": {"SDPA + inductor": "341.8", "eager + fa3": "249.8"},
    "Llama, run 16:24": {"SDPA + inductor": "397.3", "eager + fa3": "333.4"},
}

# BENCHMARKS.md "Host cost per call" table. Source: benchmarks/results/op_overhead-h200-2026-11-29.txt
# (2026-11-29 16:40 UTC), figures as BENCHMARKS.md gives them. Per shape: (host µs, GPU µs).
OP_OVERHEAD = {
    "GPT-2 B4 N2048 d64\ncausal": {
        "fa3.attention\n(dispatch)": ("76.5", "92.0"),
        "its adapter\nalone": ("55.3", MISSING),
        "F.sdpa\n(K/V repeated)": ("19.4", "100.3"),
        "forced\ncuDNN": ("89", "101"),
        "forced\nFA3": ("77", "93"),
        "forced\ntriton": ("174", "117"),
        "forced\nFA2": ("81", "155"),
    },
    "decode B2 Nk320 d128\nkey lengths": {
        "fa3.attention\n(dispatch)": ("169", "21.8"),
        "its adapter\nalone": ("115", MISSING),
        "F.sdpa\n(K/V repeated)": ("17.1", "6.6"),
        "forced\ncuDNN": ("267", "24.6"),
        "forced\nFA3": ("225", "22.5"),
        "forced\ntriton": ("180", "7.0"),
        "forced\nFA2": (MISSING, MISSING),
    },
    "decode B2 Nk320 d128\nno mask": {
        "fa3.attention\n(dispatch)": ("71.8", "6.9"),
        "its adapter\nalone": ("49.8", MISSING),
        "F.sdpa\n(K/V repeated)": ("25.4", "6.7"),
        "forced\ncuDNN": ("57", "6.9"),
        "forced\nFA3": ("63", "8.8"),
        "forced\ntriton": ("155", "6.7"),
        "forced\nFA2": ("60", "8.9"),
    },
}

# BENCHMARKS.md "Compile time" section. Source: benchmarks/results/compile_time.md (2026-11-29).
# Per configuration: (pass time s, pass / Inductor compile %).
COMPILE_TIME = {
    "eager\ninference 1": ("0.805", "0.84"),
    "eager\ninference 2": ("0.809", "1.11"),
    "eager\nfwd + bwd": ("0.531", "0.44"),
    "sdpa\ninference 1": ("0.101", "0.16"),
    "sdpa\ninference 2": ("0.070", "0.19"),
    "sdpa\nfwd + bwd": ("0.057", "0.11"),
}

# ---------------------------------------------------------------------------------------------


def load(name: str) -> dict[str, Any]:
    return json.loads((RESULTS / name).read_text())


Figure = float | str | None  # a JSON number, a figure copied as text, or absent


def fmt(v: float | str) -> str:
    """The figure as recorded: text figures verbatim, JSON numbers as Python writes them."""
    return v if isinstance(v, str) else repr(v)


def grouped_bars(ax: Any, groups: dict[str, dict[str, Figure]], ylabel: str,
                 better: str, title: str, colors: dict[str, str]) -> None:
    """Bars of each group's peers side by side, each labelled with its figure; '—' if absent."""
    names = list(colors)
    width = 0.8 / len(names)
    top = max((float(v) for g in groups.values() for v in g.values() if v is not None), default=1.0)
    for i, name in enumerate(names):
        labelled = False
        for j, row in enumerate(groups.values()):
            x = j + (i - (len(names) - 1) / 2) * width
            v = row.get(name)
            if v is None:
                ax.text(x, top * 0.01, "—", ha="center", va="bottom", fontsize=10, color="dimgrey")
                continue
            ax.bar(x, float(v), width, color=colors[name], label=None if labelled else name)
            labelled = True
            ax.text(x, float(v) + top * 0.01, fmt(v), ha="center", va="bottom", fontsize=6.5, rotation=90)
    ax.set_xticks(range(len(groups)), list(groups), fontsize=7.5)
    ax.set_xlim(-0.5, len(groups) - 0.5)
    ax.set_ylabel(ylabel)
    ax.set_ylim(0, top * 1.22)
    ax.set_title(f"{title}\n({better} is better)", fontsize=9.5)
    ax.grid(axis="y", alpha=0.3)


def palette(names: list[str]) -> dict[str, str]:
    cmap = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f"]
    return {n: cmap[i % len(cmap)] for i, n in enumerate(names)}


def chart_models(plt: Any) -> str:
    data = load("models-llama-h200-2026-12-01.json")
    rows = {r["variant"]: r for r in data["rows"]}
    llama = {
        "forward, ms": ("fwd_ms",), "training step, ms": ("train_ms",),
        "peak memory, training, GB": ("peak_GB",),
    }
    panels: dict[str, dict[str, dict[str, Figure]]] = {}
    for panel, (key,) in llama.items():
        panels[panel] = {"Llama\n2026-12-01": {
            "eager + inductor": MISSING,
            "SDPA + inductor": rows["sdpa+inductor"][key],
            "eager + fa3": rows["eager+fa3"][key],
        }}
        panels[panel].update({k.replace(" run", "\nrun").replace(" reduce", "\nreduce"): v
                              for k, v in GPT2_MODELS[panel].items()})
    colors = palette(["eager + inductor", "SDPA + inductor", "eager + fa3"])
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.6), gridspec_kw={"width_ratios": [5, 4, 2.5]})
    for ax, (panel, groups) in zip(axes, panels.items()):
        grouped_bars(ax, groups, panel.split(", ")[-1], "lower", panel.rsplit(", ", 1)[0], colors)
    axes[0].legend(fontsize=8, loc="upper right")
    fig.suptitle("Whole models, NVIDIA H200, bf16 — Llama B2×4096 (2026-12-01), GPT-2 B4×2048 "
                 "(2026-11-29 runs; '—': not measured in that run)", fontsize=10.5)
    return save(fig, "chart-models-h200-2026-12-01.png")


def chart_generate(plt: Any) -> str:
    colors = palette(["SDPA + inductor", "eager + fa3"])
    fig, ax = plt.subplots(figsize=(6, 4.2))
    grouped_bars(ax, GENERATE_TOKENS_S, "tokens/s", "higher", "generate() throughput", colors)
    ax.legend(fontsize=8, loc="upper left")
    fig.suptitle("Llama generate(), NVIDIA H200, bf16, 2026-11-29\n"
                 "greedy, static cache, batch 2, prompt 256, 64 new tokens", fontsize=10)
    return save(fig, "chart-generate-h200-2026-11-29.png")


def chart_op_overhead(plt: Any) -> str:
    impls = list(next(iter(OP_OVERHEAD.values())))
    colors = palette(impls)
    fig, axes = plt.subplots(1, 2, figsize=(15, 4.8))
    for ax, (k, what) in zip(axes, [(0, "host (enqueue) time per call"), (1, "GPU time per call (CUDA-graph replay)")]):
        groups = {shape: {n: v[k] for n, v in row.items()} for shape, row in OP_OVERHEAD.items()}
        grouped_bars(ax, groups, "µs per call", "lower", what, colors)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, [s.replace("\n", " ") for s in labels], fontsize=8, loc="lower center",
               ncol=len(impls), frameon=False)
    fig.suptitle("Host cost per attention call, NVIDIA H200 host, bf16, 2026-11-29 16:40 UTC "
                 "('—': not measured or not applicable)", fontsize=10.5)
    fig.subplots_adjust(left=0.06, right=0.98, bottom=0.22, top=0.84, wspace=0.15)
    return save(fig, "chart-op_overhead-h200-2026-11-29.png", tight=False)


KERNEL_ROWS = {  # BENCHMARKS.md rows -> shape key in kernels-h200-2026-12-01-run-l.json
    "d128\nN 16k": "d128 n16384 b1 h16",
    "d128 N 16k\ncausal": "d128 n16384 b1 h16 causal",
    "d64\nN 16k": "d64 n16384 b1 h32",
    "d64 N 16k\ncausal": "d64 n16384 b1 h32 causal",
    "d256\nN 16k": "d256 n16384 b1 h8",
    "d256 N 16k\ncausal": "d256 n16384 b1 h8 causal",
    "GQA d128\n32/8 heads\nN 4k": "GQA d128 n4096 b4 hq32 hkv8",
    "GQA d128\nN 4k causal": "GQA d128 n4096 b4 hq32 hkv8 causal",
    "float bias\nd128 N 4k": "float bias [1,H,N,N] d128 n4096 b4 h16",
    "bool key mask\nd128 N 4k": "bool mask [B,1,1,N] d128 n4096 b4 h16",
}


def chart_kernels(plt: Any) -> str:
    data = load("kernels-h200-2026-12-01-run-l.json")
    rows = {r["shape"]: r for r in data["rows"]}
    peers = {"ours": "ours", "cuDNN": "cudnn", "FA2": "fa2", "FA3": "fa3", "Flex": "flex"}
    colors = palette(list(peers))
    fig, axes = plt.subplots(2, 1, figsize=(14, 8.4))
    for ax, suffix, what in [(axes[0], "", "forward"), (axes[1], "_bwd", "backward")]:
        groups = {label: {p: rows[key].get(k + suffix) for p, k in peers.items()}
                  for label, key in KERNEL_ROWS.items()}
        if suffix:  # FA3's wheel has no backward: leave it out of the backward panel
            groups = {g: {p: v for p, v in row.items() if p != "FA3"} for g, row in groups.items()}
            grouped_bars(ax, groups, "TFLOP/s", "higher", what,
                         {p: c for p, c in colors.items() if p != "FA3"})
        else:
            grouped_bars(ax, groups, "TFLOP/s", "higher", what, colors)
        ax.legend(fontsize=8, loc="upper right", ncol=5)
    fig.suptitle(f"Attention kernels, {data['env']['gpu']}, bf16, hidden 2048, {data['env']['date']}"
                 " — 16k tokens per batch ('—': no figure recorded)", fontsize=10.5)
    return save(fig, "chart-kernels-h200-2026-12-01.png")


def chart_dispatch(plt: Any) -> str:
    data = load("dispatch_h200.json")
    peers = {"cuDNN": "cudnn", "FA3": "fa3", "triton": "triton", "FA2": "flash"}
    colors = palette(list(peers))
    labels = {
        "llama B2 N4096 16/8 D128 causal": "Llama B2 N4096\n16/8 heads D128",
        "gpt2 B4 N2048 16 D64 causal": "GPT-2 B4 N2048\n16 heads D64",
        "B16 N1024 16 D128 causal": "B16 N1024\n16 heads D128",
        "decode B32 32/8 L4096 D128": "decode B32 32/8 heads\n4096 keys",
    }
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.6), gridspec_kw={"width_ratios": [4, 3]})
    for ax, phase in zip(axes, ["fwd", "bwd"]):
        groups = {labels[t["shape"]]: {p: t.get(f"{k}_{phase}_ms") for p, k in peers.items()}
                  for t in data["timings"]}
        if phase == "bwd":  # no shape of the probe has a decode backward; FA3's wheel has none
            groups = {g: {p: v for p, v in r.items() if p != "FA3"} for g, r in groups.items()
                      if any(v is not None for v in r.values())}
            grouped_bars(ax, groups, "ms per call", "lower", "backward",
                         {p: c for p, c in colors.items() if p != "FA3"})
        else:
            grouped_bars(ax, groups, "ms per call", "lower", "forward", colors)
        ax.legend(fontsize=8, loc="upper right")
    fig.suptitle(f"Each kernel forced, {data['env']['gpu']}, bf16, causal, 2026-12-01 00:59 UTC",
                 fontsize=10.5)
    return save(fig, "chart-dispatch-h200-2026-12-01.png")


def chart_compile_time(plt: Any) -> str:
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    one = {"pass": "#1f77b4"}
    grouped_bars(axes[0], {k: {"pass": v[0]} for k, v in COMPILE_TIME.items()}, "seconds", "lower",
                 "time of the fa3 pass", one)
    grouped_bars(axes[1], {k: {"pass": v[1]} for k, v in COMPILE_TIME.items()},
                 "% of Inductor's compile of the same graph", "lower",
                 "pass time / Inductor compile", one)
    fig.suptitle("Compile-time cost of the pass, CPU (2 threads), fp32, 12-layer GPT-2, batch 1 × 128,"
                 " 2026-11-29", fontsize=10.5)
    return save(fig, "chart-compile_time-cpu-2026-11-29.png")


def chart_cpu_models(plt: Any) -> str:
    data = load("cpu_models-idle-2026-12-01.json")["results"]
    names = {"eager+fa3": "eager + fa3", "eager+fa3-nolower": "eager + fa3, lower=False",
             "sdpa+inductor": "SDPA + inductor"}
    colors = palette(list(names.values()))
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2))
    for ax, (key, what) in zip(axes, [("forward", "forward"), ("train", "training step")]):
        groups = {f"{m}": {names[v]: round(ms[key], 1) for v, ms in data[m]["median_ms"].items()} for m in data}
        grouped_bars(ax, groups, "ms", "lower", what, colors)
    axes[0].legend(fontsize=8, loc="upper right")
    fig.suptitle("Small models on CPU (2 cores, idle), fp32, torch 2.13, 2026-12-01 — GPT-2 B4×256, "
                 "BERT B8×128 padded", fontsize=10)
    return save(fig, "chart-cpu_models-cpu-2026-12-01.png")


def save(fig: Any, name: str, tight: bool = True) -> str:
    if tight:
        fig.tight_layout()
    path = RESULTS / name
    fig.savefig(path, dpi=DPI)
    fig.clf()
    return str(path)


CHARTS: dict[str, Callable[[Any], str]] = {
    "models": chart_models, "generate": chart_generate, "op_overhead": chart_op_overhead,
    "kernels": chart_kernels, "dispatch": chart_dispatch, "compile_time": chart_compile_time,
    "cpu_models": chart_cpu_models,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Redraw the charts of BENCHMARKS.md, one per table, from the results recorded "
                    "in benchmarks/results/ (nothing is measured). Writes chart-<table>-*.png "
                    "there. Needs matplotlib: pip install matplotlib.")
    parser.add_argument("tables", nargs="*", metavar="TABLE",
                        help=f"only these tables (default all): {', '.join(CHARTS)}")
    args = parser.parse_args(argv)
    unknown = [t for t in args.tables if t not in CHARTS]
    if unknown:
        parser.error(f"unknown table(s) {', '.join(unknown)}; choose from {', '.join(CHARTS)}")
    try:
        import matplotlib
    except ImportError:
        print("charts.py needs matplotlib, a benchmark-only dependency: pip install matplotlib",
              file=sys.stderr)
        return 1
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for table in args.tables or list(CHARTS):
        print(CHARTS[table](plt))
        plt.close("all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
