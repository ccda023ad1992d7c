"""Context-parallel scaling of a Llama layer stack at long sequences: tokens/s and memory per GPU of
`fa_compile.context_parallel` (ring attention on the fa3 op) against torch's SDPA-based `context_parallel`.

On a machine with 2+ GPUs (NCCL, one process per GPU, spawned by the script over a FileStore):

    python benchmarks/context_parallel.py --nproc 2              # 32k / 64k / 128k tokens, 4 layers
    python benchmarks/context_parallel.py --nproc 2 --lengths 65536 --modes train --steps 3
    torchrun --nproc-per-node 2 benchmarks/context_parallel.py   # or torchrun's ranks

It needs transformers (5.x) and fa_compile importable. Measurements not started within --budget-s
(default 420 s) are skipped, so a run fits a 10-minute limit; train runs first, then forward.

It prints one table and writes context_parallel.json to $OUT (else --out, else .), rewritten after each
measurement, so a run cut short keeps what it measured. `--smoke`: the same code on CPU, 2 gloo ranks,
a tiny fp32 Llama (hidden 64, 2 layers) at 64 / 128 tokens.

Variants (one model and one set of weights, switched between HF attention implementations):
  ours-1gpu  rank 0: attn_implementation="fa3" (HF's attention interface calling the fa3 op, uncompiled:
             compiling per length and mode costs minutes a run does not have, and the SDPA variants run
             uncompiled too); `--ours compiled`: "eager" under torch.compile(backend="fa3")
  ours-cp    every rank: the same inside fa_compile.context_parallel(mesh, buffers=(ids, positions))
  torch-cp   every rank: "sdpa" inside torch.distributed.tensor.experimental.context_parallel, rotate
             method `--rotate` (default allgather, torch's default)
  sdpa-1gpu  rank 0: "sdpa", the reference for torch-cp's scaling
Position ids are passed and sharded with the ids, so RoPE sees global positions; use_cache=True (HF's
default) is passed, as without a cache HF reads the head-tail shard's jump in positions as two packed
documents and masks across it.

Step (batch 1): the stack's forward and a loss on the last hidden state (the mean square of its
projection on a fixed random direction), and in "train" mode its backward; gradients are not reduced
across ranks (in both CP variants). Per variant, mode and length: the median of --steps steps after
--warmup (each between device synchronize and a barrier); tokens/s = global tokens / step time; peak
memory per GPU (max_memory_allocated, reset per measurement, max over ranks); K/V activation memory per
GPU, a direct count: the bytes of the K/V-shaped tensors ([B, Hkv, N_local, D] in any order; DTensors by
their local shard) autograd saves for backward in the first warm-up step, each once. A variant that runs
out of memory or fails is reported with its error's first line and not tried at longer lengths. First,
ours-cp's train step is compared with ours-1gpu's (loss, hidden states, every gradient averaged over the
ranks, each relative to its largest entry); under --smoke (fp32) a difference beyond fp32 rounding fails
the run. On CPU torch-cp reports a failure: torch rings only the CUDA SDPA kernels.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist

VARIANTS = ("ours-1gpu", "ours-cp", "torch-cp", "sdpa-1gpu")
MODES = ("train", "forward")
FP32_TOL = dict(atol=2e-5, rtol=2e-5)  # the test suite's fp32 tolerance
SMOKE = dict(lengths="64,128", layers=2, hidden=64, intermediate=128, heads=4, kv_heads=2, head_dim=16,
             vocab=128, steps=2, warmup=1, nproc=2)


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="CPU, gloo, tiny fp32 Llama, 2 ranks")
    p.add_argument("--nproc", type=int, default=2, help="ranks to spawn, one per GPU (ignored under torchrun)")
    p.add_argument("--lengths", default="32768,65536,131072", help="comma-separated global sequence lengths")
    p.add_argument("--modes", default=",".join(MODES), help="train and/or forward")
    p.add_argument("--variants", default=",".join(VARIANTS))
    for name, default in (("layers", 4), ("hidden", 4096), ("intermediate", 14336), ("heads", 32),
                          ("kv-heads", 8), ("head-dim", 128), ("vocab", 32000)):
        p.add_argument(f"--{name}", type=int, default=default, help="Llama config")
    p.add_argument("--steps", type=int, default=5, help="timed steps (their median is reported)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--ours", choices=("fa3", "compiled"), default="fa3",
                   help='fa3: attn_implementation="fa3"; compiled: "eager" under torch.compile(backend="fa3")')
    p.add_argument("--rotate", choices=("allgather", "alltoall"), default="allgather",
                   help="torch-cp's K/V rotate method (torch's set_rotate_method)")
    p.add_argument("--sdpa-gqa", choices=("native", "repeat"), default="native",
                   help="SDPA variants: HF's enable_gqa=True (native) or K/V repeated to every query head")
    p.add_argument("--budget-s", type=float, default=420.0,
                   help="measurements not started within this many seconds are skipped")
    p.add_argument("--out", default=os.environ.get("OUT", "."), help="directory for context_parallel.json")
    if "--smoke" in (sys.argv[1:] if argv is None else argv):
        p.set_defaults(**SMOKE)
    a = p.parse_args(argv)
    a.lengths = [int(x) for x in str(a.lengths).split(",") if x]
    a.modes = [m for m in a.modes.split(",") if m]
    a.variants = [v for v in a.variants.split(",") if v]
    world = int(os.environ.get("WORLD_SIZE", a.nproc))
    for bad, msg in ((world < 2, f"--nproc: context parallelism needs 2 or more ranks, got {world}"),
                     (not a.lengths or any(n <= 0 or n % (2 * world) for n in a.lengths),
                      f"--lengths: each must be a positive multiple of 2 x {world} ranks (the load-balanced layout)"),
                     (not a.modes or set(a.modes) - set(MODES), f"--modes: expected some of {MODES}, got {a.modes}"),
                     (not a.variants or set(a.variants) - set(VARIANTS),
                      f"--variants: expected some of {VARIANTS}, got {a.variants}"),
                     (a.steps < 1 or a.warmup < 1, "--steps, --warmup: at least 1 each (K/V are counted in warm-up)"),
                     (a.kv_heads >= a.heads or a.heads % a.kv_heads,
                      "--kv-heads: must divide --heads and be fewer (the K/V count tells K/V from Q by head count)")):
        if bad:
            p.error(msg)
    return a


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]


class _KVCounter:
    """Bytes of the K/V-shaped tensors autograd saves (pack hook of saved_tensors_hooks), each once."""

    def __init__(self, b: int, kv_heads: int, n_local: int, d: int):
        self.dims = sorted((b, kv_heads, n_local, d))
        self.seen: dict[tuple[int, int], int] = {}

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        local = getattr(t, "_local_tensor", t)  # torch-cp saves DTensors: count their local shard
        if isinstance(local, torch.Tensor) and local.dim() == 4 and sorted(local.shape) == self.dims:
            key = (local.untyped_storage().data_ptr(), local.storage_offset())
            self.seen[key] = local.numel() * local.element_size()
        return t

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)


class Bench:
    def __init__(self, args: argparse.Namespace, rank: int, world: int, device: torch.device, ctrl, mesh):
        self.a, self.rank, self.world, self.device, self.ctrl, self.mesh = args, rank, world, device, ctrl, mesh
        self.cuda, self.start, self.rows, self.check = device.type == "cuda", time.monotonic(), [], {}
        self.dtype = torch.bfloat16 if self.cuda else torch.float32
        self.model = self._build()
        g = torch.Generator(device).manual_seed(1)
        self.probe = torch.randn(args.hidden, generator=g, device=device) / args.hidden**0.5

    def _build(self) -> torch.nn.Module:
        import fa_compile  # noqa: F401  (registers attn_implementation="fa3")
        from transformers import AutoModel, LlamaConfig

        a = self.a
        cfg = LlamaConfig(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.intermediate,
                          num_hidden_layers=a.layers, num_attention_heads=a.heads, num_key_value_heads=a.kv_heads,
                          head_dim=a.head_dim, max_position_embeddings=max(a.lengths))
        torch.manual_seed(0)
        with self.device:
            model = AutoModel.from_config(cfg, attn_implementation="sdpa", dtype=self.dtype)
        with torch.no_grad():  # identical weights on every rank, whatever the initialisation does
            for t in list(model.parameters()) + list(model.buffers()):
                dist.broadcast(t, src=0)
        if a.sdpa_gqa == "repeat":
            from transformers.integrations import sdpa_attention

            sdpa_attention.use_gqa_in_sdpa = lambda *args, **kwargs: False
        return model

    # -- one step ------------------------------------------------------------------------------------
    def _fn(self, variant: str):
        ours = variant.startswith("ours")
        if ours and self.a.ours == "compiled":
            self.model.set_attn_implementation("eager")
            torch._dynamo.reset()
            return torch.compile(self.model, backend="fa3", dynamic=False)
        self.model.set_attn_implementation("fa3" if ours else "sdpa")
        return self.model

    def _context(self, variant: str, bufs: list[torch.Tensor]):
        if variant == "ours-cp":
            import fa_compile

            return fa_compile.context_parallel(self.mesh, buffers=bufs, buffer_seq_dims=(1, 1))
        if variant == "torch-cp":
            from torch.distributed.tensor.experimental import context_parallel
            try:
                from torch.distributed.tensor.experimental._attention import set_rotate_method
            except ImportError:  # where the private module moved
                from torch.distributed.tensor.experimental._context_parallel._attention import set_rotate_method
            set_rotate_method(self.a.rotate)
            return context_parallel(self.mesh, buffers=bufs, buffer_seq_dims=[1, 1])
        return contextlib.nullcontext()

    def _step(self, fn, ids: torch.Tensor, pos: torch.Tensor, train: bool) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.set_grad_enabled(train):
            h = fn(input_ids=ids, position_ids=pos, use_cache=True).last_hidden_state
            # a random direction's square: (RMS-normed h)**2's mean would be constant, its gradient rounding noise
            loss = (h.float() @ self.probe).square().mean()
            if train:
                loss.backward()
        return loss.detach(), h.detach()

    def _inputs(self, n: int) -> list[torch.Tensor]:
        g = torch.Generator(self.device).manual_seed(n)
        ids = torch.randint(0, self.a.vocab, (1, n), generator=g, device=self.device)
        return [ids, torch.arange(n, device=self.device)[None]]

    def _sync(self, cp: bool) -> None:
        if self.cuda:
            torch.cuda.synchronize()
        if cp:
            dist.barrier(group=self.ctrl)

    def check_equal(self, n: int) -> dict:
        import fa_compile

        params = list(self.model.parameters())
        ids, pos = self._inputs(n)
        self.model.zero_grad(set_to_none=True)
        ref_loss, ref_h = self._step(self._fn("ours-1gpu"), ids, pos, True)
        ref_grads = [p.grad.clone() for p in params]
        self.model.zero_grad(set_to_none=True)
        bufs = [ids.clone(), pos.clone()]
        fn = self._fn("ours-cp")
        with self._context("ours-cp", bufs):
            loss, h = self._step(fn, *bufs, True)
        (h,) = fa_compile.context_parallel_unshard(self.mesh, [h], [1])
        dist.all_reduce(loss)
        loss /= self.world  # the global mean of equal shards' means
        for p in params:  # the global loss's gradient: the mean of the ranks'
            dist.all_reduce(p.grad)
            p.grad /= self.world
        pairs = [("loss", loss, ref_loss), ("hidden", h, ref_h)]
        pairs += [(f"grad {name}", p.grad, g) for (name, p), g in zip(self.model.named_parameters(), ref_grads)]
        out: dict[str, Any] = {"length": n, "dtype": str(self.dtype), "max_rel_diff": {}}
        bad: list[str] = []
        for name, got, want in pairs:  # each relative to its largest entry (gradients here are ~1e-5)
            scale = want.float().abs().max().clamp_min(torch.finfo(torch.float32).tiny)
            got, want = got.float() / scale, want.float() / scale
            out["max_rel_diff"][name] = (got - want).abs().max().item()
            try:
                torch.testing.assert_close(got, want, **FP32_TOL)
            except AssertionError as e:
                bad.append(f"{name}: {_first_line(e)}")
        self.model.zero_grad(set_to_none=True)
        fp32 = self.dtype == torch.float32  # in bf16 the differences are reported, not judged
        return {**out, "within_fp32_tolerance": (not bad) if fp32 else None, "failures": bad if fp32 else []}

    def measure(self, variant: str, mode: str, n: int) -> dict:
        a, cp, train = self.a, variant.endswith("-cp"), mode == "train"
        bufs = self._inputs(n)
        fn = self._fn(variant)
        counter = _KVCounter(1, a.kv_heads, n // self.world if cp else n, a.head_dim)
        times: list[float] = []
        self.model.zero_grad(set_to_none=True)
        if self.cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        with self._context(variant, bufs):
            for i in range(a.warmup + a.steps):
                self.model.zero_grad(set_to_none=True)
                self._sync(cp)
                t0 = time.perf_counter()
                with counter.hooks() if (i == 0 and train) else contextlib.nullcontext():
                    self._step(fn, *bufs, train)
                self._sync(cp)
                if i >= a.warmup:
                    times.append(time.perf_counter() - t0)
        self.model.zero_grad(set_to_none=True)
        step_s = statistics.median(times)
        # None where the hooks see no saved K/V: compiled graphs save theirs inside AOTAutograd's function
        kv = sum(counter.seen.values()) / 2**20 if counter.seen else None
        return {"status": "ok", "step_ms": 1e3 * step_s, "tokens_per_s": n / step_s,
                "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if self.cuda else None, "kv_saved_mib": kv}

    def _agree(self, value: Any) -> Any:
        """Rank 0's value, on every rank (decisions that all ranks must take alike)."""
        box = [value]
        dist.broadcast_object_list(box, src=0, group=self.ctrl)
        return box[0]

    def run(self) -> None:
        a = self.a
        if "ours-1gpu" in a.variants and "ours-cp" in a.variants and "train" in a.modes:
            try:
                self.check = self.check_equal(min(a.lengths))
            except Exception as e:  # noqa: BLE001  (reported; the smoke run fails on it below)
                self.check = {"length": min(a.lengths), "dtype": str(self.dtype), "max_rel_diff": {},
                              "within_fp32_tolerance": False, "failures": ["failed: " + _first_line(e)]}
        self._write()
        failed: dict[tuple[str, str], str] = {}
        for mode in a.modes:
            for n in a.lengths:
                for variant in a.variants:
                    cp = variant.endswith("-cp")
                    row = {"variant": variant, "mode": mode, "length": n, "ranks": self.world if cp else 1}
                    skip = failed.get((variant, mode))
                    if skip is None and time.monotonic() - self.start > a.budget_s:
                        skip = f"skipped: past --budget-s {a.budget_s:.0f}"
                    skip = self._agree(skip)
                    if skip is None:
                        row.update(self._measure_safely(variant, mode, n, cp))
                    else:
                        row["status"] = skip
                    if row["status"] != "ok" and not row["status"].startswith("skipped"):
                        failed[(variant, mode)] = f"skipped: failed at {n}"
                    self.rows.append(row)
                    self._write()
        if self.rank == 0:
            print(self.table(), flush=True)
        if a.smoke and self.check and self.check["within_fp32_tolerance"] is not True:
            raise AssertionError("ours-cp differs from ours-1gpu beyond fp32 rounding: "
                                 + "; ".join(self.check["failures"]))

    def _measure_safely(self, variant: str, mode: str, n: int, cp: bool) -> dict:
        result: dict = {}
        if cp or self.rank == 0:
            try:
                result = self.measure(variant, mode, n)
            except Exception as e:  # noqa: BLE001  (reported in the table, never fatal)
                oom = isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in str(e)
                result = {"status": ("OOM: " if oom else "failed: ") + _first_line(e)}
            self.model.zero_grad(set_to_none=True)
            if self.cuda:
                torch.cuda.empty_cache()
        parts: list = [None] * self.world
        dist.all_gather_object(parts, result, group=self.ctrl)  # the 1-GPU variants: the other ranks wait here
        if not cp:
            return parts[0]
        bad = [p["status"] for p in parts if p["status"] != "ok"]
        if bad:
            return {"status": bad[0]}
        merged = dict(parts[0])  # rank 0's time (the barriers make every rank's alike); memory: the max
        for key in ("peak_mem_gib", "kv_saved_mib"):
            vals = [p[key] for p in parts if p[key] is not None]
            merged[key] = max(vals) if vals else None
        return merged

    def ratios(self) -> list[dict]:
        def get(v: str, mode: str, n: int) -> Optional[dict]:
            return next((r for r in self.rows if (r["variant"], r["mode"], r["length"]) == (v, mode, n)
                         and r["status"] == "ok"), None)

        def ratio(x: Optional[dict], y: Optional[dict], key: str) -> Optional[float]:
            return x[key] / y[key] if x and y and x.get(key) and y.get(key) else None

        out = []
        for mode in self.a.modes:
            for n in self.a.lengths:
                o1, oc, tc, s1 = (get(v, mode, n) for v in VARIANTS)
                out.append({"mode": mode, "length": n,
                            "ours_cp_over_ours_1gpu": ratio(oc, o1, "tokens_per_s"),
                            "ours_cp_over_torch_cp": ratio(oc, tc, "tokens_per_s"),
                            "torch_cp_over_sdpa_1gpu": ratio(tc, s1, "tokens_per_s"),
                            "kv_per_gpu_ours_cp_over_ours_1gpu": ratio(oc, o1, "kv_saved_mib"),
                            "peak_mem_ours_cp_over_ours_1gpu": ratio(oc, o1, "peak_mem_gib")})
        return out

    def table(self) -> str:
        f = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
        lines = [f"{'mode':8}{'tokens':>8} {'variant':10}{'ranks':>6}{'step ms':>10}{'tokens/s':>11}"
                 f"{'peak GiB/GPU':>13}{'K/V MiB/GPU':>12}  status"]
        for r in self.rows:
            lines.append(f"{r['mode']:8}{r['length']:>8} {r['variant']:10}{r['ranks']:>6}"
                         f"{f(r.get('step_ms'), '.1f'):>10}"
                         f"{f(r.get('tokens_per_s'), '.0f'):>11}{f(r.get('peak_mem_gib'), '.2f'):>13}"
                         f"{f(r.get('kv_saved_mib'), '.1f'):>12}  {r['status']}")
        lines.append("\nratios (targets: ours-cp/ours-1gpu >= 1.8 at 64k on 2 GPUs; ours-cp/torch-cp >= 1.0; "
                     "K/V per GPU ours-cp/ours-1gpu = 1/ranks)")
        for q in self.ratios():
            lines.append(f"{q['mode']:8}{q['length']:>8}  ours-cp/ours-1gpu {f(q['ours_cp_over_ours_1gpu'], '.2f')}"
                         f"  ours-cp/torch-cp {f(q['ours_cp_over_torch_cp'], '.2f')}"
                         f"  torch-cp/sdpa-1gpu {f(q['torch_cp_over_sdpa_1gpu'], '.2f')}"
                         f"  K/V ours-cp/ours-1gpu {f(q['kv_per_gpu_ours_cp_over_ours_1gpu'], '.3f')}")
        if self.check:
            c, d = self.check, self.check["max_rel_diff"]
            grad = max((v for k, v in d.items() if k.startswith("grad")), default=None)
            ok = c["within_fp32_tolerance"]
            verdict = f"not judged in {c['dtype']}" if ok is None else f"{ok} {'; '.join(c['failures'][:3])}"
            lines.append(f"\nours-cp vs ours-1gpu, train step at {c['length']} tokens ({c['dtype']}), "
                         "max |diff| / max |ref|:"
                         f" loss {f(d.get('loss'), '.1e')}, hidden states {f(d.get('hidden'), '.1e')}, gradients "
                         f"{f(grad, '.1e')}; within fp32 tolerance: {verdict}")
        return "\n".join(lines)

    def _write(self) -> None:
        if self.rank != 0:
            return
        a = self.a
        doc = {"config": {k: v for k, v in vars(a).items()}, "ranks": self.world, "device": str(self.device),
               "gpu": torch.cuda.get_device_name(self.device) if self.cuda else None, "dtype": str(self.dtype),
               "torch": torch.__version__, "check": self.check, "rows": self.rows, "ratios": self.ratios()}
        os.makedirs(a.out, exist_ok=True)
        path = os.path.join(a.out, "context_parallel.json")
        with open(path + ".tmp", "w") as fh:
            json.dump(doc, fh, indent=1)
        os.replace(path + ".tmp", path)


def _rank_main(rank: int, world: int, args: argparse.Namespace, store: Optional[str]) -> None:
    cuda = torch.cuda.is_available() and not args.smoke
    if cuda:
        local = int(os.environ.get("LOCAL_RANK", rank))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    init = {"init_method": f"file://{store}"} if store else {}
    # a rank stuck in a collective (its peer failed mid-ring) aborts after this rather than hanging
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world,
                            timeout=timedelta(minutes=5), **init)
    try:
        from torch.distributed.device_mesh import init_device_mesh

        ctrl = dist.new_group(backend="gloo", timeout=timedelta(minutes=5)) if cuda else dist.group.WORLD
        mesh = init_device_mesh(device.type, (world,))
        Bench(args, rank, world, device, ctrl, mesh).run()
        dist.barrier(group=ctrl)  # no rank tears the group down while its peer still writes or reduces
    finally:
        dist.destroy_process_group()


def _spawned(rank: int, args: argparse.Namespace, store: str) -> None:
    _rank_main(rank, args.nproc, args, store)
    # The work is done and written; skip interpreter teardown, where a C++ thread of the destroyed gloo
    # group is at times destructed while joinable ("terminate called without an active exception",
    # SIGABRT), which would turn a finished run into a failed one. A failure above still raises first.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    for var in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
        os.environ.setdefault(var, "0" if var == "NCCL_NVLS_ENABLE" else "1")  # no NVLink multicast: not needed
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # launched by torchrun
        _rank_main(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args, None)
        return
    if torch.cuda.is_available() and not args.smoke and torch.cuda.device_count() < args.nproc:
        raise SystemExit(f"--nproc: {args.nproc} ranks need as many GPUs, found {torch.cuda.device_count()}")
    with tempfile.TemporaryDirectory() as tmp:
        torch.multiprocessing.spawn(_spawned, args=(args, os.path.join(tmp, "store")), nprocs=args.nproc, join=True)


if __name__ == "__main__":
    main()
