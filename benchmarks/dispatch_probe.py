"""On the GPU: the conventions dispatch relies on, and the timings its order rests on.

1. Each SDPA private op's lse (shape, natural log?), what it does on a row with no admissible key,
   its causal alignment when Nq != Nk, native GQA, cuDNN's bias; FA3's lse and empty rows.
2. Forward / backward time of every eligible candidate at model-like shapes (bf16), so the
   priority order in fa_compile/candidates/__init__.py can cite a measurement.
Prints a table; writes $OUT/dispatch_probe.json.
"""
from __future__ import annotations

import json
import math
import os
import traceback

import torch

import fa_compile.ops  # noqa: F401
from fa_compile import dispatch
from fa_compile.kernels import reference as ref

dev = "cuda"
res: dict = {"env": {}, "conventions": {}, "timings": []}


def note(key, val):
    res["conventions"][key] = val
    print(f"{key}: {val}", flush=True)


def err(x, y):
    return round(float((x.float() - y.float()).abs().nan_to_num(99.0).max()), 5)


def env():
    e = res["env"]
    e["torch"], e["cuda"], e["cudnn"] = torch.__version__, torch.version.cuda, torch.backends.cudnn.version()
    e["gpu"], e["cap"] = torch.cuda.get_device_name(), torch.cuda.get_device_capability()
    for n in ("_scaled_dot_product_cudnn_attention", "_scaled_dot_product_cudnn_attention_backward",
              "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward",
              "_scaled_dot_product_efficient_attention", "_scaled_dot_product_efficient_attention_backward"):
        e[n] = str(getattr(torch.ops.aten, n).default._schema)
    try:
        import flash_attn_interface  # noqa: F401
        e["fa3"] = "importable"
    except Exception as ex:
        e["fa3"] = repr(ex)[:200]
    e["forward"] = [c.name for c in dispatch.candidates("forward")]
    e["backward"] = [c.name for c in dispatch.candidates("backward")]
    print(json.dumps(e, indent=1), flush=True)


def conventions():
    torch.manual_seed(0)
    b, h, n, d = 1, 2, 64, 64
    q, k, v = (torch.randn(b, h, n, d, device=dev, dtype=torch.bfloat16) for _ in range(3))
    s = 1 / math.sqrt(d)
    _, lse_ref = ref.attention_reference(q.float(), k.float(), v.float(), scale=s)
    A = torch.ops.aten
    for name, call in (
        ("flash", lambda: A._scaled_dot_product_flash_attention(q, k, v, 0.0, False, False, scale=s)),
        ("cudnn", lambda: A._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, False, False, scale=s)),
        ("efficient", lambda: A._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, False, scale=s)),
    ):
        try:
            r = call()
            lse = r[1]
            flat = lse.reshape(b, h, -1)[:, :, :n]
            note(f"{name}.lse", dict(shape=list(lse.shape), err_natural=err(flat, lse_ref),
                                     err_log2=err(flat, lse_ref / math.log(2))))
        except Exception as ex:
            note(f"{name}.lse", f"ERR {type(ex).__name__}: {str(ex)[:200]}")
    # empty row through a -inf bias row
    bias = torch.zeros(b, h, n, n, device=dev, dtype=torch.bfloat16)
    bias[:, :, 3] = -math.inf
    for name, call in (
        ("cudnn", lambda: A._scaled_dot_product_cudnn_attention(q, k, v, bias, True, 0.0, False, False, scale=s)),
        ("efficient", lambda: A._scaled_dot_product_efficient_attention(q, k, v, bias, True, 0.0, False, scale=s)),
    ):
        try:
            r = call()
            note(f"{name}.empty_row", dict(lse=float(r[1].reshape(b, h, -1)[0, 0, 3]), out_abs_max=float(r[0][0, 0, 3].float().abs().max()),
                                          out_has_nan=bool(r[0][0, 0, 3].isnan().any())))
        except Exception as ex:
            note(f"{name}.empty_row", f"ERR {type(ex).__name__}: {str(ex)[:200]}")
    # causal alignment, Nq != Nk
    nq, nk = 64, 200
    qs = torch.randn(b, h, nq, d, device=dev, dtype=torch.bfloat16)
    kl, vl = (torch.randn(b, h, nk, d, device=dev, dtype=torch.bfloat16) for _ in range(2))
    tl, _ = ref.attention_reference(qs.float(), kl.float(), vl.float(), scale=s, causal=True, diag_offset=0)
    br, _ = ref.attention_reference(qs.float(), kl.float(), vl.float(), scale=s, causal=True, diag_offset=nk - nq)
    for name, call in (
        ("flash", lambda: A._scaled_dot_product_flash_attention(qs, kl, vl, 0.0, True, False, scale=s)),
        ("cudnn", lambda: A._scaled_dot_product_cudnn_attention(qs, kl, vl, None, True, 0.0, True, False, scale=s)),
        ("efficient", lambda: A._scaled_dot_product_efficient_attention(qs, kl, vl, None, True, 0.0, True, scale=s)),
    ):
        try:
            o = call()[0]
            note(f"{name}.causal_nonsquare", dict(err_top_left=err(o, tl), err_bottom_right=err(o, br)))
        except Exception as ex:
            note(f"{name}.causal_nonsquare", f"ERR {type(ex).__name__}: {str(ex)[:200]}")
    # native GQA and cuDNN broadcast bias
    kg, vg = k[:, :1], v[:, :1]
    og, _ = ref.attention_reference(q.float(), kg.float(), vg.float(), scale=s)
    for name, call in (
        ("flash", lambda: A._scaled_dot_product_flash_attention(q, kg, vg, 0.0, False, False, scale=s)),
        ("cudnn", lambda: A._scaled_dot_product_cudnn_attention(q, kg, vg, None, True, 0.0, False, False, scale=s)),
    ):
        try:
            note(f"{name}.gqa", dict(err=err(call()[0], og)))
        except Exception as ex:
            note(f"{name}.gqa", f"ERR {type(ex).__name__}: {str(ex)[:200]}")
    for shape in ((1, 1, n, n), (b, 1, 1, n)):
        bb = torch.randn(shape, device=dev, dtype=torch.bfloat16)
        ob, _ = ref.attention_reference(q.float(), k.float(), v.float(), scale=s, bias=bb.float())
        try:
            o = A._scaled_dot_product_cudnn_attention(q, k, v, bb.expand(b, h, n, n), True, 0.0, False, False, scale=s)[0]
            note(f"cudnn.bias{list(shape)}", dict(err=err(o, ob)))
        except Exception as ex:
            note(f"cudnn.bias{list(shape)}", f"ERR {type(ex).__name__}: {str(ex)[:200]}")
    # FA3: lse and empty rows (bottom-right causal with Nq > Nk)
    try:
        import flash_attn_interface as fai
        qq = torch.randn(1, 96, 2, 64, device=dev, dtype=torch.bfloat16)
        kk, vv = (torch.randn(1, 40, 2, 64, device=dev, dtype=torch.bfloat16) for _ in range(2))
        out, lse = fai._flash_attn_forward(qq, kk, vv, softmax_scale=s, causal=True)[:2]
        e_out, e_lse = ref.attention_reference(*(t.transpose(1, 2).float() for t in (qq, kk, vv)), scale=s, causal=True, diag_offset=40 - 96)
        note("fa3.lse", dict(shape=list(lse.shape), empty_row_lse=float(lse[0, 0, 0]), empty_row_out=float(out[0, 0].float().abs().max()),
                             err_lse_rows_ok=err(lse[:, :, 60:], e_lse[:, :, 60:]), err_out=err(out.transpose(1, 2), e_out)))
    except Exception as ex:
        note("fa3.lse", f"ERR {type(ex).__name__}: {str(ex)[:200]}")


def timings():
    from triton.testing import do_bench

    shapes = [
        ("llama B2 N4096 16/8 D128 causal", 2, 16, 8, 4096, 4096, 128, dict(causal=True)),
        ("gpt2 B4 N2048 16 D64 causal", 4, 16, 16, 2048, 2048, 64, dict(causal=True)),
        ("B16 N1024 16 D128 causal", 16, 16, 16, 1024, 1024, 128, dict(causal=True)),
        ("decode B32 32/8 L4096 D128", 32, 32, 8, 1, 4096, 128, dict(causal=True, diag_offset=4095)),
    ]
    for label, b, hq, hkv, nq, nk, d, kw in shapes:
        q = torch.randn(b, nq, hq, d, device=dev, dtype=torch.bfloat16).transpose(1, 2)
        k = torch.randn(b, nk, hkv, d, device=dev, dtype=torch.bfloat16).transpose(1, 2)
        v = torch.randn(b, nk, hkv, d, device=dev, dtype=torch.bfloat16).transpose(1, 2)
        args = dispatch.AttentionArgs(q=q, k=k, v=v, scale=1 / math.sqrt(d), **kw)
        bargs = dispatch.AttentionArgs(q=q, k=k, v=v, scale=1 / math.sqrt(d), needs_backward=True, **kw)
        off = kw.get("diag_offset", 0)
        pairs = sum(max(0, min(nk, i + off + 1)) for i in range(nq)) if kw.get("causal") else nq * nk
        flops = 4 * b * hq * pairs * d
        row = {"shape": label, "chosen_fwd": dispatch.select_forward(args).name,
               "chosen_bwd": dispatch.select_backward(bargs).name}
        out, lse = ref.attention_reference(q[:1, :1], k[:1, :1], v[:1, :1], **args.mask_kwargs())  # warm
        out, lse = dispatch.select_forward(args).forward(args)
        dout = torch.randn_like(out)
        for c in dispatch.candidates("forward"):
            if c.name == "reference" or c.not_supported_reasons(args):
                continue
            try:
                t = do_bench(lambda: c.forward(args), warmup=10, rep=40, return_mode="median")
                row[f"{c.name}_fwd_ms"] = round(t, 3)
                row[f"{c.name}_fwd_tflops"] = round(flops / t / 1e9, 1)
            except Exception as ex:
                row[f"{c.name}_fwd"] = f"ERR {type(ex).__name__}: {str(ex)[:120]}"
        if nq > 1:
            for c in dispatch.candidates("backward"):
                if c.name == "reference" or c.not_supported_reasons(bargs):
                    continue
                try:
                    t = do_bench(lambda: c.backward(bargs, dout, out, lse), warmup=5, rep=30, return_mode="median")
                    row[f"{c.name}_bwd_ms"] = round(t, 3)
                    row[f"{c.name}_bwd_tflops"] = round(2.5 * flops / t / 1e9, 1)
                except Exception as ex:
                    row[f"{c.name}_bwd"] = f"ERR {type(ex).__name__}: {str(ex)[:120]}"
        res["timings"].append(row)
        print(row, flush=True)
        del q, k, v, out, lse, dout
        torch.cuda.empty_cache()


def tune_smoke():
    """FA_COMPILE_TUNE on real inputs: measures once per bucket, caches on disk, reuses."""
    import tempfile

    from fa_compile import tuning

    os.environ["FA_COMPILE_CACHE_DIR"] = tempfile.mkdtemp()
    tuning.enable(True)
    try:
        for n in (1024, 4096):
            q = torch.randn(2, n, 16, 128, device=dev, dtype=torch.bfloat16).transpose(1, 2)
            k = torch.randn(2, n, 8, 128, device=dev, dtype=torch.bfloat16).transpose(1, 2)
            a = dispatch.AttentionArgs(q=q, k=k, v=k, scale=0.088, causal=True)
            ab = dispatch.AttentionArgs(q=q, k=k, v=k, scale=0.088, causal=True, needs_backward=True)
            times = tuning.measure(a, "forward", [c for c in dispatch.candidates("forward") if c.name != "reference" and not c.not_supported_reasons(a)])
            note(f"tune.N{n}.forward_ms", {k_: round(v_, 3) for k_, v_ in times.items()})
            note(f"tune.N{n}.chosen", [dispatch.select_forward(a).name, dispatch.select_backward(ab).name])
        with open(tuning.cache_path()) as f:
            note("tune.cache", json.load(f))
    finally:
        tuning.enable(None)


if __name__ == "__main__":
    import argparse

    argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog="Needs a CUDA GPU; writes "
                            "$OUT/dispatch_probe.json ($OUT defaults to the current folder).").parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/dispatch_probe.py: needs a CUDA GPU (it times CUDA kernels) and none is visible here")
    for step in (env, conventions, tune_smoke, timings):
        try:
            step()
        except Exception:
            traceback.print_exc()
    out_dir = os.environ.get("OUT", ".")
    with open(os.path.join(out_dir, "dispatch_probe.json"), "w") as f:
        json.dump(res, f, indent=1)
