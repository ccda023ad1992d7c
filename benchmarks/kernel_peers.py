"""Kernel benchmark: our Triton attention (forward and backward) against its peers, in ONE run.

Peers: SDPA with cuDNN, SDPA with FA2 (torch's flash backend), FlexAttention (compiled), and FA3's
forward (`flash_attn_interface`, from the `tokenspeed-fa3` wheel) when importable.
Grid: the FA3 paper's (16k tokens per batch, hidden 2048, head dims 64/128/256, N 1k..16k, causal
and not), plus GQA and additive-bias shapes. bf16, BSHD storage. Every implementation of a row is timed
three times (five for the bias rows) in alternating order (`in_turn`), each time the median of
triton.testing.do_bench; the row reports the median of those and keeps all of them (`*_runs`).
FLOPs: forward 4*B*H*N*N*D (halved when causal), backward 2.5x forward.

Run on a GPU machine:  python benchmarks/kernel_peers.py [--quick] [--sweep] [--out DIR]
Prints TFLOP/s and ratios, writes kernels.json and kernels.png to --out (default $OUT or /tmp).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from fa_compile.kernels import triton_family as tf


class Args:
    """Duck-typed AttentionArgs for the kernel family."""

    def __init__(self, q, k, v, causal=False, bias=None, **kw):
        self.q, self.k, self.v = q, k, v
        self.scale = q.shape[-1] ** -0.5
        self.causal = causal
        self.diag_offset = 0
        self.window_left = self.window_right = -1
        self.bias = bias
        self.kv_lens = None
        self.softcap = 0.0
        self.dropout_p = 0.0
        self.dropout_seed = None
        self.needs_backward = True
        self.bias_requires_grad = False
        self.__dict__.update(kw)


def bench(fn) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def tflops(flops: float, ms: float) -> float:
    return round(flops / ms / 1e9, 1)


def bshd(b, h, n, d, dtype=torch.bfloat16, requires_grad=False):
    t = torch.randn(b, n, h, d, device="cuda", dtype=dtype).transpose(1, 2)
    return t.requires_grad_(requires_grad)


def kernel_report(name: str) -> dict:
    """Registers, spills and whether the PTX uses wgmma (HGMMA) for the last compiled kernel of that name."""
    hit = tf.LAST_COMPILED.get(name)
    if hit is None:
        return {}
    cfg, h = hit
    rep = {"cfg": [cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages, cfg.qreg]}
    for attr in ("n_regs", "n_spills"):
        rep[attr] = getattr(h, attr, None)
    try:
        ptx = h.asm.get("ptx", "")
        rep["wgmma"] = "wgmma" in ptx
        rep["mma_sync"] = "mma.sync" in ptx
    except Exception:
        pass
    return rep


def ours_fns(q, k, v, causal, bias=None, bwd=True):
    """(forward, backward or None, kernel report) of our kernel family on these inputs. Each is run once here,
    which compiles it and names the kernel that ran; the backward reuses that forward's output and LSE."""
    a = Args(q, k, v, causal=causal, bias=bias)
    fwd = lambda: tf.attention_forward(a)  # noqa: E731
    tf.LAST_COMPILED.pop("attn_fwd_gluon_kernel", None)
    tf.LAST_COMPILED.pop("attn_fwd_kernel", None)
    out, lse = fwd()
    # The forward that ran: the Gluon kernel on Hopper for most shapes, else the tl kernel.
    ran = "attn_fwd_gluon_kernel" if "attn_fwd_gluon_kernel" in tf.LAST_COMPILED else "attn_fwd_kernel"
    rep = {"fwd": {"kernel": ran, **kernel_report(ran)}}
    if not bwd:
        return fwd, None, rep
    dout = torch.randn_like(out)
    for name in ("attn_bwd_gluon_kernel", "attn_bwd_dkdv_kernel", "attn_bwd_dq_kernel"):
        tf.LAST_COMPILED.pop(name, None)
    back = lambda: tf.attention_backward(a, dout, out, lse)  # noqa: E731
    back()
    # The backward that ran: the Gluon kernel on Hopper for structural masks, else the tl pair.
    if "attn_bwd_gluon_kernel" in tf.LAST_COMPILED:
        rep["bwd"] = {"kernel": "attn_bwd_gluon_kernel", **kernel_report("attn_bwd_gluon_kernel")}
    else:
        rep["dkdv"] = kernel_report("attn_bwd_dkdv_kernel")
        rep["dq"] = kernel_report("attn_bwd_dq_kernel")
    return fwd, back, rep


def correctness(q, k, v, causal) -> float:
    out, _ = tf.attention_forward(Args(q, k, v, causal=causal))
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=causal)
    return float((out.float() - ref).norm() / ref.norm())


def sdpa_grads_fp32(q, k, v, causal, dout) -> tuple:
    """dq, dk, dv of fp32 SDPA on the same dout: the reference for our backward's error."""
    qf, kf, vf = (t.detach().float().requires_grad_(True) for t in (q, k, v))
    return torch.autograd.grad(F.scaled_dot_product_attention(qf, kf, vf, is_causal=causal), (qf, kf, vf), dout.float())


def grad_error(got, ref) -> float:
    """Largest relative (norm) error of dq, dk, dv."""
    return max(float((g.float() - r).norm() / r.norm()) for g, r in zip(got, ref))


def bwd_correctness(q, k, v, causal) -> float:
    """Our backward's grad_error against fp32 SDPA's gradients on the same dout."""
    a = Args(q, k, v, causal=causal)
    out, lse = tf.attention_forward(a)
    dout = torch.randn_like(out)
    return grad_error(tf.attention_backward(a, dout, out, lse)[:3], sdpa_grads_fp32(q, k, v, causal, dout))


FWD_SWEEP = {
    64: [(128, 64, 4, 3), (128, 64, 8, 3), (64, 64, 4, 3)],
    128: [(64, 64, 4, 3), (128, 64, 8, 3), (64, 128, 4, 2), (64, 64, 4, 4)],
    256: [(128, 64, 8, 2), (64, 64, 4, 2)],
}
BWD_SWEEP = {
    64: {"dkdv": [(64, 128, 8, 2), (64, 64, 4, 3), (32, 128, 8, 2)], "dq": [(128, 64, 8, 2), (128, 32, 4, 3), (64, 64, 4, 3)]},
    128: {"dkdv": [(64, 128, 8, 2), (32, 128, 8, 2), (64, 128, 8, 3)], "dq": [(128, 32, 4, 3), (128, 64, 8, 2), (64, 64, 4, 3)]},
    256: {"dkdv": [(32, 64, 8, 2), (64, 64, 8, 2), (16, 64, 4, 2), (32, 64, 4, 1)],
          "dq": [(64, 32, 8, 2), (128, 32, 8, 2), (64, 64, 8, 2), (64, 32, 4, 1)]},
}


def sweep(d: int, n: int = 4096, with_bwd: bool = False) -> dict:
    """Time each candidate config at one shape; pin the best in CONFIG_OVERRIDE for the rest of the run."""
    h = 2048 // d
    b = 16384 // n
    q, k, v = bshd(b, h, n, d), bshd(b, h, n, d), bshd(b, h, n, d)
    fl = 4 * b * h * n * n * d
    res = {"fwd": []}
    best = None
    for c in FWD_SWEEP[d]:
        tf.CONFIG_OVERRIDE[("fwd", d)] = tf.BlockConfig(*c)
        try:
            t = bench(lambda: tf.attention_forward(Args(q, k, v)))
            row = {"cfg": c, "tflops": tflops(fl, t), **kernel_report("attn_fwd_kernel")}
            if best is None or t < best[0]:
                best = (t, c)
        except Exception as e:  # a config that does not compile is a finding, not a crash
            row = {"cfg": c, "err": f"{type(e).__name__}: {str(e)[:100]}"}
        res["fwd"].append(row)
        print("sweep fwd", d, row, flush=True)
    tf.CONFIG_OVERRIDE[("fwd", d)] = tf.BlockConfig(*best[1])
    # The best config again: pointer loads instead of TMA, and TMA with warp specialization.
    for label, env in ((("no_tma", {"FA_COMPILE_TRITON_TMA": "0"}),) if d == 128 else ()):
        old = {k_: os.environ.get(k_) for k_ in env}
        os.environ.update(env)
        try:
            t = bench(lambda: tf.attention_forward(Args(q, k, v)))
            row = {"variant": label, "cfg": best[1], "tflops": tflops(fl, t), **kernel_report("attn_fwd_kernel")}
        except Exception as e:
            row = {"variant": label, "err": f"{type(e).__name__}: {str(e)[:160]}"}
        finally:
            for k_, v_ in old.items():
                if v_ is None:
                    os.environ.pop(k_, None)
                else:
                    os.environ[k_] = v_
        res["fwd"].append(row)
        print("sweep fwd", d, row, flush=True)
    if with_bwd:
        a = Args(q, k, v)
        out, lse = tf.attention_forward(a)
        dout = torch.randn_like(out)
        for kind in ("dkdv", "dq"):
            res[kind] = []
            best = None
            for c in BWD_SWEEP[d][kind]:
                tf.CONFIG_OVERRIDE[(kind, d)] = tf.BlockConfig(*c)
                try:
                    t = bench(lambda: tf.attention_backward(a, dout, out, lse))
                    row = {"cfg": c, "bwd_tflops": tflops(2.5 * fl, t), **kernel_report(f"attn_bwd_{kind}_kernel")}
                    if best is None or t < best[0]:
                        best = (t, c)
                except Exception as e:
                    row = {"cfg": c, "err": f"{type(e).__name__}: {str(e)[:100]}"}
                res[kind].append(row)
                print("sweep", kind, d, row, flush=True)
            tf.CONFIG_OVERRIDE[(kind, d)] = tf.BlockConfig(*best[1])
    return res


# --tune: forward variants (head dim, causal, bias, (block_m, block_n, warps, stages[, qreg])) timed at
# 16k tokens (N = 16k, B = 1; bias rows N = 4096, B = 4, H = 16, d128), and backward (dK/dV, dQ) config pairs
# at N = 16k. Every variant of a group is timed twice (forward order, then reverse) and keeps its best, so a
# drift of the clocks over the run does not favour the first ones; the best of each group is then pinned
# (CONFIG_OVERRIDE) for the rest of the run. Rows report the relative error against fp32 SDPA and the compiled
# kernel's registers / spills.
def tune_variants() -> list[dict]:
    v = []

    def add(d, causal, cfgs, bias=None, group=None):
        for c in cfgs:
            v.append({"d": d, "causal": causal, "bias": bias, "cfg": tuple(c),
                      "group": group or ("fwd", d, causal)})

    Q = True  # qreg: Q as the register operand of Q·Kᵀ
    add(128, False, [(64, 64, 4, 3), (64, 64, 4, 3, Q), (64, 64, 4, 2, Q), (128, 128, 8, 3), (128, 128, 8, 3, Q),
                     (128, 64, 8, 3, Q), (64, 128, 4, 2, Q)])
    add(128, True, [(64, 64, 4, 3), (64, 64, 4, 3, Q), (64, 64, 4, 2, Q), (128, 128, 8, 3, Q)])
    add(64, False, [(128, 64, 4, 3), (128, 64, 4, 3, Q), (64, 128, 4, 3, Q), (64, 64, 4, 4, Q), (64, 128, 4, 3)])
    add(64, True, [(128, 64, 4, 3), (128, 64, 4, 3, Q), (64, 128, 4, 3, Q)])
    add(256, False, [(128, 64, 8, 2), (128, 64, 8, 2, Q), (128, 32, 8, 3, Q), (64, 64, 4, 2, Q)])
    add(256, True, [(128, 64, 8, 2), (128, 64, 8, 2, Q), (128, 32, 8, 3, Q)])
    add(128, False, [(64, 64, 4, 3), (64, 64, 4, 3, Q)], bias="none4k", group="none4k")
    add(128, False, [(64, 64, 4, 3), (64, 64, 4, 2), (64, 64, 4, 2, Q), (64, 64, 4, 3, Q)], bias="1hnn",
        group=("fwd_bias", 128))
    add(128, False, [(64, 64, 4, 2), (64, 64, 4, 2, Q)], bias="bhnn", group="bhnn")
    add(128, False, [(64, 64, 4, 2), (64, 64, 4, 2, Q)], bias="11nn", group="11nn")
    add(128, False, [(64, 64, 4, 3), (64, 64, 4, 3, Q)], bias="keymask", group="keymask")
    for d, pairs in ((128, [((64, 128, 8, 2), (128, 32, 4, 3)), ((64, 64, 4, 2), (64, 64, 4, 2)),
                            ((64, 64, 4, 2), (128, 32, 4, 3)), ((64, 128, 8, 2), (64, 64, 4, 2))]),
                     (64, [((64, 64, 4, 3), (128, 32, 4, 3)), ((64, 64, 4, 2), (64, 64, 4, 2))])):
        for dkdv, dq in pairs:
            v.append({"d": d, "causal": False, "bias": None, "bwd": (dkdv, dq), "cfg": dkdv + dq, "group": ("bwd", d)})
    return v


_TUNE_DATA: dict = {}


def _tune_inputs(v) -> tuple:
    """Inputs per (head dim, bias), made once (seeded: every process sees the same data)."""
    bias = v["bias"]
    key = (v["d"], bias)
    if key not in _TUNE_DATA:
        torch.manual_seed(0)
        d = v["d"]
        h = 2048 // d
        b, n = (4, 4096) if bias else (1, 16384)
        q, k, v_ = bshd(b, h, n, d), bshd(b, h, n, d), bshd(b, h, n, d)
        bt = None
        if bias in ("1hnn", "11nn", "bhnn"):
            shape = {"1hnn": (1, h, n, n), "11nn": (1, 1, n, n), "bhnn": (b, h, n, n)}[bias]
            bt = torch.randn(*shape, device="cuda", dtype=torch.bfloat16)
        elif bias == "keymask":
            bt = torch.rand(b, 1, 1, n, device="cuda") > 0.1
        _TUNE_DATA[key] = (q, k, v_, bt)
    return _TUNE_DATA[key]


def _apply(v) -> None:
    """Pin the variant's configs (nothing else pinned)."""
    tf.CONFIG_OVERRIDE.clear()
    if v.get("bwd"):
        tf.CONFIG_OVERRIDE[("dkdv", v["d"])] = tf.BlockConfig(*v["bwd"][0])
        tf.CONFIG_OVERRIDE[("dq", v["d"])] = tf.BlockConfig(*v["bwd"][1])
    else:
        kind = "fwd_bias" if v["bias"] in ("1hnn", "11nn", "bhnn") else "fwd"
        tf.CONFIG_OVERRIDE[(kind, v["d"])] = tf.BlockConfig(*v["cfg"])


def _time_variant(v, refs: dict, warm_only: bool) -> dict:
    q, k, v_, bt = _tune_inputs(v)
    a = Args(q, k, v_, causal=v["causal"], bias=bt)
    _apply(v)
    row = {"d": v["d"], "causal": v["causal"], "bias": v["bias"], "cfg": v["cfg"], "kernel": "bwd" if v.get("bwd") else "fwd"}
    try:
        out, lse = tf.attention_forward(a)
        dout = torch.randn_like(out) if v.get("bwd") else None
        if dout is not None:
            tf.attention_backward(a, dout, out, lse)
        if warm_only:
            return row
        b, h, n, d = q.shape
        fl = 4 * b * h * n * n * d * (0.5 if v["causal"] else 1.0)
        if dout is not None:
            row["tflops"] = tflops(2.5 * fl, bench(lambda: tf.attention_backward(a, dout, out, lse)))
            row["dkdv"] = kernel_report("attn_bwd_dkdv_kernel")
            row["dq"] = kernel_report("attn_bwd_dq_kernel")
        else:
            row["tflops"] = tflops(fl, bench(lambda: tf.attention_forward(a)))
            row["kern"] = kernel_report("attn_fwd_kernel")
            rk = (v["d"], v["causal"], v["bias"])
            if rk not in refs:
                m = None if bt is None else (bt if bt.dtype == torch.bool else bt.float())
                refs[rk] = F.scaled_dot_product_attention(q.float(), k.float(), v_.float(), attn_mask=m,
                                                          is_causal=v["causal"])
            row["err"] = float((out.float() - refs[rk]).norm() / refs[rk].norm())
    except Exception as e:
        row["error"] = f"{type(e).__name__}: {str(e)[:160]}"
    finally:
        tf.CONFIG_OVERRIDE.clear()
    return row


def run_tune(shard: tuple[int, int] | None = None) -> list[dict]:
    """Time every variant twice and pin each group's best; with shard=(i, n) only compile the i-th n-th
    of them (a warm-up process filling Triton's cache for the timing process)."""
    variants = tune_variants()
    if shard is not None:
        for i, v in enumerate(variants):
            if i % shard[1] == shard[0]:
                _time_variant(v, {}, warm_only=True)
        return []
    refs: dict = {}
    groups: dict = {}
    for v in variants:
        groups.setdefault(v["group"], []).append(v)
    rows = []
    pins = {}
    for g, vs in groups.items():
        first = [_time_variant(v, refs, False) for v in vs]
        second = [_time_variant(v, refs, False) for v in reversed(vs)][::-1]
        best = None
        for v, r1, r2 in zip(vs, first, second):
            t = [x.get("tflops") for x in (r1, r2) if isinstance(x.get("tflops"), float)]
            r1["tflops_runs"] = t
            r1["tflops"] = max(t) if t else None
            r1["group"] = str(g)
            rows.append(r1)
            print("tune", r1, flush=True)
            if t and (best is None or max(t) > best[0]) and r1.get("err", 0) < 1e-2:
                best = (max(t), v)
        if best is not None and isinstance(g, tuple):
            v = best[1]
            if g[0] == "bwd":
                pins[("dkdv", v["d"])] = tf.BlockConfig(*v["bwd"][0])
                pins[("dq", v["d"])] = tf.BlockConfig(*v["bwd"][1])
            elif g[0] == "fwd":
                pins[("fwd", v["d"], v["causal"])] = tf.BlockConfig(*v["cfg"])
            else:
                pins[(g[0], v["d"])] = tf.BlockConfig(*v["cfg"])
    tf.CONFIG_OVERRIDE.update(pins)
    print("pinned:", pins, flush=True)
    return rows


# (block_m, block_n, stages, qreg[, pingpong]); block_m 128 = warp-specialized (2 consumer warpgroups)
GLUON_VARIANTS = {
    64: [(128, 128, 2, True), (128, 128, 2, True, True), (128, 128, 3, True, True), (128, 128, 2, False, True)],
    128: [(128, 128, 2, False), (128, 128, 3, False), (128, 128, 2, False, True), (128, 128, 3, False, True),
          (128, 64, 2, False, True), (128, 64, 3, True, True)],
    256: [(128, 64, 2, False), (128, 64, 2, False, True)],
}


def grad_fn(fwd, inputs: tuple, dout):
    """A backward callable: the graph of one forward call, differentiated again on every call."""
    o = fwd()
    return lambda: torch.autograd.grad(o, inputs, dout, retain_graph=True)


def in_turn(fns: dict, rounds: int = 3, measure=bench) -> dict:
    """`measure(fn)` (by default ms) for every entry, `rounds` times, in order then reversed, alternating. The
    H200's clock drifts by up to ~10% over a run (the first timing in a process is the fastest); peers
    timed in one block each would carry that drift into their ratios. An entry whose measure raises maps to
    its error text and is not measured again (as does an error text given in place of an entry)."""
    names = list(fns)
    runs: dict = {n_: fns[n_] if isinstance(fns[n_], str) else [] for n_ in names}
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            if isinstance(runs[name], str):
                continue
            try:
                runs[name].append(measure(fns[name]))
            except Exception as e:
                runs[name] = f"err {type(e).__name__}: {str(e)[:300]}"
    return runs


def fill(row: dict, fl: float, runs: dict, suffix: str = "") -> None:
    """row[name + suffix] = the median TFLOP/s of the rounds, row[... + '_runs'] all of them, sorted."""
    for name, ms in runs.items():
        if isinstance(ms, str):
            row[name + suffix] = ms
        elif ms:
            rates = sorted(tflops(fl, t) for t in ms)
            row[name + suffix] = rates[len(rates) // 2]
            row[name + suffix + "_runs"] = rates


def _compare(label: str, key: dict, runs: list, once, fl: float, rounds: int = 2) -> list[dict]:
    """Time every (name, config) of `runs` `rounds` times (in order, then reversed, alternating) with
    `once(name, c) -> (ms, err, kernel report)`, keep the best, and rank against cuDNN's best: one row per
    variant, printed."""
    res: dict = {}
    for name, got in in_turn({name: (name, c) for name, c in runs}, rounds, lambda nc: once(*nc)).items():
        if isinstance(got, str):
            res[name] = {"tflops_runs": [], "error": got}
        else:
            res[name] = {"tflops_runs": [tflops(fl, t) for t, _, _ in got], "err": got[0][1], "kern": got[0][2]}
    tf.CONFIG_OVERRIDE.clear()
    os.environ.pop("FA_COMPILE_GLUON", None)
    peer = max(res.get("cudnn", {}).get("tflops_runs") or [float("nan")])
    rows = []
    for name, r in res.items():
        best = max(r["tflops_runs"]) if r["tflops_runs"] else None
        row = {**key, "variant": name, "tflops": best, "runs": r["tflops_runs"],
               "vs_cudnn": round(best / peer, 3) if best else None, "err": r.get("err"),
               "kern": r.get("kern"), "error": r.get("error")}
        rows.append(row)
        kk = row["kern"] or {}
        print(f"{label} d{key['d']:<4}{'causal' if key['causal'] else '':<7}{name:<32}{best!s:<8}{row['vs_cudnn']!s:<7}"
              f"{r['tflops_runs']!s:<18} err {row['err']} regs {kk.get('n_regs')} spills {kk.get('n_spills')}"
              + (f" ERROR {row['error']}" if row["error"] else ""), flush=True)
    return rows


def run_gluon_compare(dims: list[int], fa3) -> list[dict]:
    """The Gluon forward's tiles against the `tl` forward, cuDNN and FA3 at 16k tokens, in one process:
    every variant timed twice (forward order, then reverse), best kept."""
    rows = []
    for d in dims:
        h = 2048 // d
        torch.manual_seed(0)
        q, k, v = bshd(1, h, 16384, d), bshd(1, h, 16384, d), bshd(1, h, 16384, d)
        for causal in (False, True):
            fl = 4 * h * 16384 * 16384 * d * (0.5 if causal else 1.0)
            a = Args(q, k, v, causal=causal)
            ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=causal)
            runs: list[tuple[str, object]] = [("tl", None)] + [(f"gluon {c}", c) for c in GLUON_VARIANTS[d]]
            runs += [("cudnn", "cudnn")] + ([("fa3", "fa3")] if fa3 is not None else [])

            def once(name, c):
                tf.CONFIG_OVERRIDE.clear()
                os.environ["FA_COMPILE_GLUON"] = "0" if name == "tl" else "1"
                if isinstance(c, tuple):
                    tf.CONFIG_OVERRIDE[("fwd_gluon", d)] = tf.BlockConfig(c[0], c[1], 4, c[2], qreg=c[3],
                                                                          pingpong=len(c) > 4 and c[4])
                if c == "cudnn":
                    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                        return bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)), None, {}
                if c == "fa3":
                    qs, ks, vs = (t.transpose(1, 2) for t in (q, k, v))
                    return bench(lambda: fa3.flash_attn_func(qs, ks, vs, causal=causal)), None, {}
                out, _ = tf.attention_forward(a)
                err = float((out.float() - ref).norm() / ref.norm())
                t = bench(lambda: tf.attention_forward(a))
                return t, err, kernel_report("attn_fwd_kernel" if name == "tl" else "attn_fwd_gluon_kernel")

            rows += _compare("gluon-compare", {"d": d, "causal": causal}, runs, once, fl)
    return rows


# Gluon backward tiles (query rows per step, Q/dO ring stages); keys per program are 128.
GLUON_BWD_VARIANTS = {64: [(64, 2), (64, 3)], 128: [(64, 2)]}


def run_bwd_compare(dims: list[int], n: int = 16384) -> list[dict]:
    """The Gluon backward's tiles against the `tl` backward pair and cuDNN's backward at 16k tokens
    (hidden 2048), one process, every variant timed twice (forward order, then reverse), best kept.
    err: largest relative (norm) error of dq/dk/dv against fp32 SDPA's gradients."""
    rows = []
    for d in dims:
        h, b = 2048 // d, 16384 // n
        torch.manual_seed(0)
        q, k, v = (bshd(b, h, n, d, requires_grad=True) for _ in range(3))
        qd, kd, vd = q.detach(), k.detach(), v.detach()
        for causal in (False, True):
            fl = 2.5 * 4 * b * h * n * n * d * (0.5 if causal else 1.0)
            a = Args(qd, kd, vd, causal=causal)
            out, lse = tf.attention_forward(a)
            dout = torch.randn_like(out)
            ref = sdpa_grads_fp32(qd, kd, vd, causal, dout)
            runs: list[tuple[str, object]] = [("tl", None)] + [(f"gluon {c}", c) for c in GLUON_BWD_VARIANTS[d]]
            runs += [("cudnn", "cudnn")]

            def once(name, c):
                tf.CONFIG_OVERRIDE.clear()
                os.environ["FA_COMPILE_GLUON"] = "0" if name == "tl" else "1"
                if c == "cudnn":
                    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                        o = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                        return bench(lambda: torch.autograd.grad(o, (q, k, v), dout, retain_graph=True)), None, {}
                if isinstance(c, tuple):
                    tf.CONFIG_OVERRIDE[("bwd_gluon", d)] = tf.BlockConfig(c[0], 128, 8, c[1])
                for kname in ("attn_bwd_gluon_kernel", "attn_bwd_dkdv_kernel", "attn_bwd_dq_kernel"):
                    tf.LAST_COMPILED.pop(kname, None)
                got = tf.attention_backward(a, dout, out, lse)[:3]
                err = grad_error(got, ref)
                t = bench(lambda: tf.attention_backward(a, dout, out, lse))
                if name == "tl":
                    rep = {"dkdv": kernel_report("attn_bwd_dkdv_kernel"), "dq": kernel_report("attn_bwd_dq_kernel")}
                else:
                    if "attn_bwd_gluon_kernel" not in tf.LAST_COMPILED:
                        raise RuntimeError("the Gluon backward did not run")
                    rep = kernel_report("attn_bwd_gluon_kernel")
                return t, err, rep

            rows += _compare("bwd-compare", {"d": d, "n": n, "causal": causal}, runs, once, fl)
    return rows


# Gluon forward tiles with a float bias tile at d128: (BLOCK_N, stages, ping-pong); a 64-key tile halves the
# bias ring and K/V slots, so three or four stages fit in shared memory beside it.
GLUON_BIAS_VARIANTS = [(128, 2, False), (128, 2, True), (64, 3, True)]


def run_bias_compare(shapes: list[str], n: int = 4096, b: int = 4, h: int = 16, d: int = 128) -> list[dict]:
    """The Gluon forward with a float bias tile ([1,H,N,N], [B,H,N,N], [1,1,N,N], bf16) over its tiles and
    both launch orders of a batch-shared bias (bi: batch fastest), beside our no-bias forward and cuDNN with
    the same bias, one process, every variant timed twice (in order, then reversed), best kept."""
    torch.manual_seed(0)
    q, k, v = bshd(b, h, n, d), bshd(b, h, n, d), bshd(b, h, n, d)
    fl = 4 * b * h * n * n * d
    rows = []
    for shape in [{"1h": (1, h, n, n), "bh": (b, h, n, n), "11": (1, 1, n, n)}[x] for x in shapes]:
        bias = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
        a = Args(q, k, v, bias=bias)
        ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=bias.float())
        # No bias with the tile the bias runs on (two stages) as well as the default: what the ring's depth costs.
        runs: list[tuple[str, object]] = [("nobias", "nobias"), ("nobias s2", "nobias s2"), ("cudnn", "cudnn")]
        # Each tile in the launch order a batch-shared bias gets by default (bi), and for [1, H, N, N] the other.
        runs += [(f"gluon {c}", (c, True)) for c in GLUON_BIAS_VARIANTS]
        if shape[0] == 1 and shape[1] > 1:
            runs.append((f"gluon {GLUON_BIAS_VARIANTS[0]}, batch outer", (GLUON_BIAS_VARIANTS[0], False)))

        def once(name, c):
            tf.CONFIG_OVERRIDE.clear()
            if c == "cudnn":
                with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                    return bench(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=bias)), None, {}
            if isinstance(c, str) and c.startswith("nobias"):
                if c.endswith("s2"):
                    tf.CONFIG_OVERRIDE[("fwd_gluon", d)] = tf.BlockConfig(128, 128, 4, 2, pingpong=True)
                an = Args(q, k, v)
                return bench(lambda: tf.attention_forward(an)), None, kernel_report("attn_fwd_gluon_kernel")
            (bn, stages, pp), bi = c
            tf.CONFIG_OVERRIDE[("fwd_gluon_bias", d)] = tf.BlockConfig(128, bn, 4, stages, pingpong=pp)
            tf.GLUON_BIAS_BATCH_INNER = bi
            try:
                tf.LAST_COMPILED.pop("attn_fwd_gluon_kernel", None)
                out, _ = tf.attention_forward(a)
                if "attn_fwd_gluon_kernel" not in tf.LAST_COMPILED:
                    raise RuntimeError("the Gluon forward did not run")
                err = float((out.float() - ref).norm() / ref.norm())
                return bench(lambda: tf.attention_forward(a)), err, kernel_report("attn_fwd_gluon_kernel")
            finally:
                tf.GLUON_BIAS_BATCH_INNER = True

        # Four timings per variant: the clock drifts over a run (see the bias rows in main).
        rows += _compare(f"bias-compare {list(shape)}", {"d": d, "causal": False, "bias": list(shape)}, runs, once, fl,
                         rounds=4)
    return rows


def _cfg_label(c) -> str:
    c = tuple(c)
    if len(c) == 8 and all(isinstance(x, int) for x in c):
        return f"dkdv {c[0]}x{c[1]} w{c[2]} s{c[3]} + dq {c[4]}x{c[5]} w{c[6]} s{c[7]}"
    return f"{c[0]}x{c[1]} w{c[2]} s{c[3]}" + (" qreg" if len(c) > 4 and c[4] else "")


def tune_table(rows) -> None:
    print("\nTUNE (TFLOP/s best of 2; fwd N=16k B=1; bias rows d128 N=4096 B=4 H=16; bwd N=16k)")
    for r in rows:
        if r["kernel"] == "bwd":
            rr = f"dkdv regs {r.get('dkdv', {}).get('n_regs')}/{r.get('dkdv', {}).get('n_spills')} dq regs {r.get('dq', {}).get('n_regs')}/{r.get('dq', {}).get('n_spills')}"
        else:
            kk = r.get("kern", {})
            rr = f"regs {kk.get('n_regs')} spills {kk.get('n_spills')} err {r.get('err', float('nan')):.1e}"
        print(f"{r['kernel']} d{r['d']:<4}{'causal' if r['causal'] else '':<7}{str(r['bias'] or ''):<8}{_cfg_label(r['cfg']):<46}"
              f"{r.get('tflops') or r.get('error', '-')!s:<7} {r.get('tflops_runs', '')!s:<16} {rr}")
    sys.stdout.flush()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog="Needs a CUDA GPU.")
    ap.add_argument("--quick", action="store_true", help="only N=16k and the extra shapes")
    ap.add_argument("--sweep", action="store_true", help="sweep block configs first and pin the best")
    ap.add_argument("--no-flex", action="store_true")
    ap.add_argument("--sweep-dims", default="64,128,256", help="head dims to sweep (with --sweep)")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    ap.add_argument("--tune", action="store_true", help="time the forward/backward variants first (tune_variants)")
    ap.add_argument("--tune-only", action="store_true", help="with --tune: stop after the variants")
    ap.add_argument("--warm", default=None, help="I/N: compile the I-th N-th of the variants and exit")
    ap.add_argument("--bias", default=None, help="bias shapes among 1h,bh,11 ([1,H,N,N], [B,H,N,N], [1,1,N,N]): "
                    "compare the Gluon forward's tiles and launch orders with that float bias (d128, N 4096, B 4, "
                    "H 16)")
    ap.add_argument("--bwd", default=None, help="head dims (e.g. 64,128): compare the Gluon backward's tiles "
                    "with the tl backward and cuDNN")
    ap.add_argument("--bwd-n", type=int, default=16384, help="with --bwd: the sequence length (16k tokens per "
                    "batch, so B = 16384 // N; e.g. 512 for a BERT-sized batch of 32)")
    ap.add_argument("--gluon", default=None, help="head dims (e.g. 64,128,256): compare the Gluon forward's tiles "
                    "with the tl forward, cuDNN and FA3, then exit")
    opt = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/kernel_peers.py: needs a CUDA GPU (it times CUDA kernels) and none is visible here. "
                         "On CPU the kernels' correctness tests run under the Triton interpreter: "
                         "pytest tests/test_kernels_interp.py")
    if opt.warm:
        i, n = (int(x) for x in opt.warm.split("/"))
        run_tune((i, n))
        return
    import triton

    env = {"torch": torch.__version__, "triton": triton.__version__, "cudnn": torch.backends.cudnn.version(),
           "gpu": torch.cuda.get_device_name(), "cap": torch.cuda.get_device_capability(),
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    try:
        import flash_attn_interface as fa3
        env["fa3"] = "flash_attn_interface importable"
    except Exception as e:
        fa3 = None
        env["fa3"] = f"missing ({type(e).__name__})"
    print(env, flush=True)
    result = {"env": env, "sweep": {}, "rows": []}
    if opt.gluon:
        result["gluon"] = run_gluon_compare([int(x) for x in opt.gluon.split(",")], fa3)
        os.makedirs(opt.out, exist_ok=True)
        json.dump(result, open(os.path.join(opt.out, "kernels_gluon.json"), "w"), indent=1, default=str)
        return
    if opt.bias:
        result["bias"] = run_bias_compare(opt.bias.split(","))
        os.makedirs(opt.out, exist_ok=True)
        json.dump(result, open(os.path.join(opt.out, "kernels_bias.json"), "w"), indent=1, default=str)
        return
    if opt.bwd:
        result["bwd"] = run_bwd_compare([int(x) for x in opt.bwd.split(",")], n=opt.bwd_n)
        os.makedirs(opt.out, exist_ok=True)
        json.dump(result, open(os.path.join(opt.out, "kernels_bwd.json"), "w"), indent=1, default=str)
        return
    if opt.tune:
        result["tune"] = run_tune()
        tune_table(result["tune"])
        os.makedirs(opt.out, exist_ok=True)
        json.dump(result, open(os.path.join(opt.out, "kernels.json"), "w"), indent=1, default=str)
        if opt.tune_only:
            return
    if opt.sweep:
        for d in (int(x) for x in opt.sweep_dims.split(",")):
            result["sweep"][d] = sweep(d, with_bwd=True)
        print("pinned configs:", {f"{k[0]}/{k[1]}": v for k, v in tf.CONFIG_OVERRIDE.items()}, flush=True)

    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    # One compiled FlexAttention per shape and mask (dynamic=False): raise Dynamo's recompile limit so the
    # grid's 10+ variants are all compiled rather than the later ones falling back to eager.
    for knob in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, knob):
            setattr(torch._dynamo.config, knob, 64)
    flex_c = torch.compile(flex_attention, dynamic=False)
    rows = result["rows"]
    os.makedirs(opt.out, exist_ok=True)

    def save() -> None:  # after every row, so a run cut short by its time limit still leaves its figures
        json.dump(result, open(os.path.join(opt.out, "kernels.json"), "w"), indent=1, default=str)

    def sdpa(be, q, k, v, **kw):
        def fn():
            with sdpa_kernel([be]):
                return F.scaled_dot_product_attention(q, k, v, **kw)
        return fn

    def causal_mask(n: int, causal: bool):
        return create_block_mask(lambda b_, h_, qi, ki: qi >= ki, None, None, n, n, device="cuda") if causal else None

    def finish(row: dict) -> None:
        rows.append(row)
        save()
        print({k_: v_ for k_, v_ in row.items() if k_ != "ours_kernels" and not k_.endswith("_runs")}, flush=True)

    ns = (16384,) if opt.quick else (1024, 4096, 16384)
    for d in (64, 128, 256):
        h = 2048 // d
        for n in ns:
            b = 16384 // n
            for causal in (False, True):
                q, k, v = (bshd(b, h, n, d, requires_grad=True) for _ in range(3))
                fl = 4 * b * h * n * n * d * (0.5 if causal else 1.0)
                row = {"shape": f"d{d} n{n} b{b} h{h}" + (" causal" if causal else ""), "D": d, "N": n, "causal": causal}
                qd, kd, vd = q.detach(), k.detach(), v.detach()
                fwd, bwd = {}, {}
                try:
                    row["err"] = round(correctness(qd, kd, vd, causal), 5)
                    row["bwd_err"] = round(bwd_correctness(qd, kd, vd, causal), 5)
                    fwd["ours"], bwd["ours"], row["ours_kernels"] = ours_fns(qd, kd, vd, causal)
                except Exception as e:
                    row["ours"] = f"err {type(e).__name__}: {str(e)[:120]}"
                for name, be in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("fa2", SDPBackend.FLASH_ATTENTION)):
                    fwd[name] = sdpa(be, q, k, v, is_causal=causal)
                if fa3 is not None:
                    qs, ks, vs = (t.transpose(1, 2) for t in (qd, kd, vd))  # BSHD contiguous
                    fwd["fa3"] = lambda: fa3.flash_attn_func(qs, ks, vs, causal=causal)  # noqa: E731
                if not opt.no_flex:
                    bm = causal_mask(n, causal)
                    fwd["flex"] = lambda: flex_c(q, k, v, block_mask=bm)  # noqa: E731
                dout = torch.randn_like(q)
                for name in ("cudnn", "fa2", "flex"):
                    if name in fwd:
                        try:
                            bwd[name] = grad_fn(fwd[name], (q, k, v), dout)
                        except Exception as e:
                            bwd[name] = f"err {type(e).__name__}: {str(e)[:80]}"
                fill(row, fl, in_turn(fwd))
                fill(row, 2.5 * fl, in_turn(bwd), "_bwd")
                finish(row)
                del q, k, v, dout, fwd, bwd

    # GQA: 16k tokens, Hq 32 / Hkv 8, d128 (a Llama-style layer).
    for causal in (False, True):
        b, n, hq, hkv, d = 4, 4096, 32, 8, 128
        q, k, v = bshd(b, hq, n, d), bshd(b, hkv, n, d), bshd(b, hkv, n, d)
        fl = 4 * b * hq * n * n * d * (0.5 if causal else 1.0)
        row = {"shape": f"GQA d{d} n{n} b{b} hq{hq} hkv{hkv}" + (" causal" if causal else ""), "D": d, "N": n, "causal": causal}
        fwd, bwd = {}, {}
        fwd["ours"], bwd["ours"], row["ours_kernels"] = ours_fns(q, k, v, causal)
        for name, be in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("fa2", SDPBackend.FLASH_ATTENTION)):
            fwd[name] = sdpa(be, q, k, v, is_causal=causal, enable_gqa=True)
        if fa3 is not None:
            qs, ks, vs = (t.transpose(1, 2) for t in (q, k, v))
            fwd["fa3"] = lambda: fa3.flash_attn_func(qs, ks, vs, causal=causal)  # noqa: E731
        if not opt.no_flex:
            bm = causal_mask(n, causal)
            fwd["flex"] = lambda: flex_c(q, k, v, block_mask=bm, enable_gqa=True)  # noqa: E731
        fill(row, fl, in_turn(fwd))
        fill(row, 2.5 * fl, in_turn(bwd), "_bwd")
        finish(row)

    # Additive bias: [1, H, N, N] bf16 (ALiBi-/relative-position-like) and a bool key mask [B, 1, 1, N], with
    # our no-bias forward timed in the same turns: the ratio BENCHMARKS.md reports (target >= 0.8x).
    b, n, h, d = 4, 4096, 16, 128
    q, k, v = bshd(b, h, n, d), bshd(b, h, n, d), bshd(b, h, n, d)
    fl = 4 * b * h * n * n * d
    for label, bias in (("float bias [1,H,N,N]", torch.randn(1, h, n, n, device="cuda", dtype=torch.bfloat16)),
                        ("bool mask [B,1,1,N]", torch.rand(b, 1, 1, n, device="cuda") > 0.1)):
        row = {"shape": f"{label} d{d} n{n} b{b} h{h}", "D": d, "N": n, "causal": False}
        fwd, bwd = {}, {}
        fwd["ours"], bwd["ours"], row["ours_kernels"] = ours_fns(q, k, v, False, bias=bias)
        fwd["ours_nobias"] = ours_fns(q, k, v, False, bwd=False)[0]
        for name, be in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
            fwd[name] = sdpa(be, q, k, v, attn_mask=bias)
        # FlexAttention with the same tensor: the bias through score_mod, the key mask through a block mask.
        if not opt.no_flex and bias.dtype == torch.bool:
            bm = create_block_mask(lambda b_, h_, qi, ki: bias[b_, 0, 0, ki], b, None, n, n, device="cuda")
            fwd["flex"] = lambda: flex_c(q, k, v, block_mask=bm)  # noqa: E731
        elif not opt.no_flex:
            fwd["flex"] = lambda: flex_c(q, k, v, score_mod=lambda s, b_, h_, qi, ki: s + bias[0, h_, qi, ki])  # noqa: E731
        fill(row, fl, in_turn(fwd, rounds=5))
        fill(row, 2.5 * fl, in_turn(bwd), "_bwd")
        if isinstance(row.get("ours"), float) and isinstance(row.get("ours_nobias"), float):
            row["vs_ours_nobias"] = round(row["ours"] / row["ours_nobias"], 3)
        finish(row)

    save()
    chart(rows, os.path.join(opt.out, "kernels.png"))
    table(rows)


def chart(rows, path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:
        print("no chart:", e)
        return
    impls = ["ours", "cudnn", "fa2", "fa3", "flex"]
    fig, axes = plt.subplots(2, 1, figsize=(max(10, len(rows) * 0.9), 9))
    for ax, suffix, title in ((axes[0], "", "forward"), (axes[1], "_bwd", "backward")):
        width = 0.16
        for i, name in enumerate(impls):
            vals = [r.get(name + suffix) if isinstance(r.get(name + suffix), (int, float)) else 0 for r in rows]
            ax.bar([x + i * width for x in range(len(rows))], vals, width, label=name)
        ax.set_xticks([x + 2 * width for x in range(len(rows))])
        ax.set_xticklabels([r["shape"] for r in rows], rotation=60, ha="right", fontsize=7)
        ax.set_ylabel("TFLOP/s")
        ax.set_title(f"attention {title}, bf16, H200")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def table(rows) -> None:
    def f(x):
        return f"{x:.0f}" if isinstance(x, (int, float)) else "-"

    def ratio(a, b):
        return f"{a / b:.2f}" if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else "-"

    print("\nTFLOP/s (bf16). fwd: ours cudnn fa2 fa3 flex | bwd: ours cudnn fa2 flex | ours/cudnn fwd bwd, ours/fa3, ours/flex fwd")
    for r in rows:
        print(f"{r['shape']:<40} {f(r.get('ours'))} {f(r.get('cudnn'))} {f(r.get('fa2'))} {f(r.get('fa3'))} {f(r.get('flex'))}"
              f" | {f(r.get('ours_bwd'))} {f(r.get('cudnn_bwd'))} {f(r.get('fa2_bwd'))} {f(r.get('flex_bwd'))}"
              f" | {ratio(r.get('ours'), r.get('cudnn'))} {ratio(r.get('ours_bwd'), r.get('cudnn_bwd'))} {ratio(r.get('ours'), r.get('fa3'))} {ratio(r.get('ours'), r.get('flex'))}"
              + (f" bias/nobias {r['vs_ours_nobias']}" if "vs_ours_nobias" in r else ""))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
