"""Sweep Hugging Face architectures through the fa3 pass on CPU: tiny configs, random weights, no downloads.

For every model (attn_implementation="eager", fp32, eval mode, batch 2, short sequences) and, where the
model takes one, also with an attention_mask that has padding: compile with
`fa_compile.backend("aot_eager")` (fullgraph=False), compare every output element to the uncompiled
model (assert_close, atol=rtol=2e-5), then one backward (gradients of every parameter, atol=rtol=1e-4).
Prints one row per model: sites rewritten / total, masks found, missed sites with reasons, max abs
difference of the output and of the gradients, and the error if any.

    python benchmarks/model_sweep.py                 # every model
    python benchmarks/model_sweep.py qwen3 whisper   # only these (substring match)
    python benchmarks/model_sweep.py --no-backward   # forward only
    python benchmarks/model_sweep.py --md FILE       # also write the table as Markdown
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import time
import traceback
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

B, N = 2, 8  # batch, sequence length
VOCAB = 64
TOL = dict(atol=2e-5, rtol=2e-5)
GRAD_TOL = dict(atol=1e-4, rtol=1e-4)


def _t():
    import transformers

    return transformers


def _ids(n: int = N) -> torch.Tensor:
    return torch.randint(3, VOCAB, (B, n), generator=torch.Generator().manual_seed(7))


def _pad_mask(n: int = N, left: bool = True) -> torch.Tensor:
    am = torch.ones(B, n, dtype=torch.long)
    if left:
        am[1, :3] = 0  # left padding: the first queries of row 1 see no key at all under causality
    else:
        am[1, n - 3:] = 0
    return am


# Small dims shared by the decoders: 4 query heads, 2 key/value heads (GQA), head dim 8.
DEC = dict(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
           vocab_size=VOCAB, max_position_embeddings=64, attn_implementation="eager", pad_token_id=0,
           bos_token_id=1, eos_token_id=2)


@dataclass
class Case:
    build: Callable[[], torch.nn.Module]
    inputs: Callable[[], dict]  # keyword inputs without padding
    padded: Optional[Callable[[], dict]] = None  # keyword inputs with a padded attention_mask
    note: str = ""


def decoder(config: str, model: str, note: str = "", left_pad: bool = True, **over) -> Case:
    def build():
        t = _t()
        kw = dict(DEC)
        kw.update(over)
        cfg = getattr(t, config)(**kw)
        return getattr(t, model)(cfg)

    return Case(build, lambda: dict(input_ids=_ids()),
                lambda: dict(input_ids=_ids(), attention_mask=_pad_mask(left=left_pad)), note)


def encoder_text(config: str, model: str, note: str = "", **kw) -> Case:
    def build():
        t = _t()
        cfg = getattr(t, config)(attn_implementation="eager", **kw)
        return getattr(t, model)(cfg)

    return Case(build, lambda: dict(input_ids=_ids()),
                lambda: dict(input_ids=_ids(), attention_mask=_pad_mask(left=False)), note)


def vision(config: str, model: str, image: int, note: str = "", channels: int = 3, **kw) -> Case:
    def build():
        t = _t()
        cfg = getattr(t, config)(attn_implementation="eager", **kw)
        return getattr(t, model)(cfg)

    px = lambda: dict(pixel_values=torch.randn(B, channels, image, image, generator=torch.Generator().manual_seed(5)))
    return Case(build, px, None, note)


def whisper() -> Case:
    def build():
        t = _t()
        cfg = t.WhisperConfig(vocab_size=VOCAB, num_mel_bins=8, encoder_layers=2, decoder_layers=2,
                              encoder_attention_heads=2, decoder_attention_heads=2, d_model=16,
                              encoder_ffn_dim=32, decoder_ffn_dim=32, max_source_positions=8,
                              max_target_positions=16, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                              decoder_start_token_id=1, attn_implementation="eager")
        return t.WhisperModel(cfg)

    feats = lambda: torch.randn(B, 8, 16, generator=torch.Generator().manual_seed(5))
    return Case(build, lambda: dict(input_features=feats(), decoder_input_ids=_ids(6)),
                lambda: dict(input_features=feats(), decoder_input_ids=_ids(6),
                             decoder_attention_mask=_pad_mask(6, left=False)), "enc self + dec self + cross")


def seq2seq(config: str, model: str, note: str = "", **kw) -> Case:
    def build():
        t = _t()
        cfg = getattr(t, config)(vocab_size=VOCAB, d_model=16, encoder_layers=2, decoder_layers=2,
                                 encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
                                 decoder_ffn_dim=32, max_position_embeddings=64, pad_token_id=0, bos_token_id=1,
                                 eos_token_id=2, decoder_start_token_id=1, attn_implementation="eager", **kw)
        return getattr(t, model)(cfg)

    return Case(build, lambda: dict(input_ids=_ids(), decoder_input_ids=_ids(6)),
                lambda: dict(input_ids=_ids(), attention_mask=_pad_mask(left=False), decoder_input_ids=_ids(6),
                             decoder_attention_mask=_pad_mask(6, left=False)), note)


def t5() -> Case:
    def build():
        t = _t()
        cfg = t.T5Config(vocab_size=VOCAB, d_model=16, d_kv=8, d_ff=32, num_layers=2, num_heads=2,
                         relative_attention_num_buckets=8, dropout_rate=0.0, decoder_start_token_id=0,
                         pad_token_id=0, eos_token_id=1, attn_implementation="eager")
        return t.T5Model(cfg)

    return Case(build, lambda: dict(input_ids=_ids(), decoder_input_ids=_ids(6)),
                lambda: dict(input_ids=_ids(), attention_mask=_pad_mask(left=False), decoder_input_ids=_ids(6),
                             decoder_attention_mask=_pad_mask(6, left=True)), "learned position bias, left-padded decoder")


def wav2vec2() -> Case:
    def build():
        t = _t()
        cfg = t.Wav2Vec2Config(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
                               conv_dim=(8, 8), conv_stride=(4, 4), conv_kernel=(4, 4), num_conv_pos_embeddings=4,
                               num_conv_pos_embedding_groups=2, feat_extract_norm="layer", do_stable_layer_norm=True,
                               attn_implementation="eager")
        return t.Wav2Vec2Model(cfg)

    wav = lambda: torch.randn(B, 160, generator=torch.Generator().manual_seed(5))
    am = torch.ones(B, 160, dtype=torch.long)
    am[1, 100:] = 0
    return Case(build, lambda: dict(input_values=wav()), lambda: dict(input_values=wav(), attention_mask=am),
                "audio encoder")


def _gemma3():
    return decoder("Gemma3TextConfig", "Gemma3TextModel", "sliding window 4 on layer 0", head_dim=8,
                   sliding_window=4, layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=8)


MODELS: dict[str, Callable[[], Case]] = {
    "mixtral": lambda: decoder("MixtralConfig", "MixtralModel", "MoE", num_local_experts=4, num_experts_per_tok=2),
    "qwen3": lambda: decoder("Qwen3Config", "Qwen3Model", "q/k norm", head_dim=8),
    "qwen3_moe": lambda: decoder("Qwen3MoeConfig", "Qwen3MoeModel", "MoE", head_dim=8, num_experts=4,
                                 num_experts_per_tok=2, moe_intermediate_size=32),
    "qwen2_moe": lambda: decoder("Qwen2MoeConfig", "Qwen2MoeModel", "MoE", num_experts=4, num_experts_per_tok=2,
                                 moe_intermediate_size=32, shared_expert_intermediate_size=32),
    "gemma": lambda: decoder("GemmaConfig", "GemmaModel", head_dim=8),
    "gemma3_text": _gemma3,
    "cohere": lambda: decoder("CohereConfig", "CohereModel"),
    "cohere2": lambda: decoder("Cohere2Config", "Cohere2Model", "sliding window 4 on layer 0", sliding_window=4,
                               layer_types=["sliding_attention", "full_attention"]),
    "granite": lambda: decoder("GraniteConfig", "GraniteModel", "attention_multiplier scale",
                               attention_multiplier=0.3),
    "nemotron": lambda: decoder("NemotronConfig", "NemotronModel", "partial rotary", head_dim=8),
    "phi": lambda: decoder("PhiConfig", "PhiModel", "partial rotary, qk layernorm", qk_layernorm=True,
                           resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0),
    "gpt_oss": lambda: decoder("GptOssConfig", "GptOssModel", "attention sinks", head_dim=8, num_local_experts=4,
                               num_experts_per_tok=2, sliding_window=4,
                               layer_types=["sliding_attention", "full_attention"]),
    "deepseek_v3": lambda: decoder("DeepseekV3Config", "DeepseekV3Model", "MLA, qk dim 12 != v dim 8",
                                   q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=8,
                                   v_head_dim=8, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
                                   moe_intermediate_size=16, first_k_dense_replace=1, num_key_value_heads=4),
    "deepseek_v2": lambda: decoder("DeepseekV2Config", "DeepseekV2Model", "MLA, no q lora", q_lora_rank=None,
                                   kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8,
                                   n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                   first_k_dense_replace=1, num_key_value_heads=4, n_group=1, topk_group=1),
    "olmo2": lambda: decoder("Olmo2Config", "Olmo2Model"),
    "olmoe": lambda: decoder("OlmoeConfig", "OlmoeModel", "MoE", num_experts=4, num_experts_per_tok=2),
    "glm4": lambda: decoder("Glm4Config", "Glm4Model", head_dim=8),
    "helium": lambda: decoder("HeliumConfig", "HeliumModel", head_dim=8),
    "smollm3": lambda: decoder("SmolLM3Config", "SmolLM3Model", "NoPE layers", no_rope_layer_interval=2),
    "llama4_text": lambda: decoder("Llama4TextConfig", "Llama4TextModel", "chunked attention", head_dim=8,
                                   intermediate_size_mlp=64, num_local_experts=2, attention_chunk_size=4,
                                   interleave_moe_layer_step=2, no_rope_layers=[1, 0]),
    "persimmon": lambda: decoder("PersimmonConfig", "PersimmonModel", "qk layernorm, no GQA",
                                 num_key_value_heads=4),
    "exaone4": lambda: decoder("Exaone4Config", "Exaone4Model", "sliding window", head_dim=8, sliding_window=4,
                               layer_types=["sliding_attention", "full_attention"]),
    "gemma2": lambda: decoder("Gemma2Config", "Gemma2Model", "softcap + sliding window", head_dim=8,
                              sliding_window=4, attn_logit_softcapping=30.0, query_pre_attn_scalar=8,
                              layer_types=["sliding_attention", "full_attention"]),
    "llama_recheck": lambda: decoder("LlamaConfig", "LlamaModel", "swept before; padding + backward"),
    "gpt2_recheck": lambda: decoder("GPT2Config", "GPT2Model", "swept before; padding + backward",
                                    n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
                                    attn_pdrop=0.0),
    "opt_recheck": lambda: decoder("OPTConfig", "OPTModel", "swept before; padding + backward", ffn_dim=64,
                                   word_embed_proj_dim=32, dropout=0.0, attention_dropout=0.0),
    "bloom_recheck": lambda: decoder("BloomConfig", "BloomModel", "swept before; padding + backward",
                                     hidden_dropout=0.0, attention_dropout=0.0),
    "t5_recheck": lambda: t5(),
    "gpt_neo_recheck": lambda: decoder("GPTNeoConfig", "GPTNeoModel", "swept before; causal where() + added mask",
                                       attention_types=[[["global", "local"], 1]], window_size=4,
                                       resid_dropout=0.0, embed_dropout=0.0, attention_dropout=0.0),
    # right padding: padded queries past their window see only padded keys in it but an earlier valid
    # key, the rows where eager's fill cuts the gradient of the local layer's filled scores
    "gpt_neo_right_pad": lambda: decoder("GPTNeoConfig", "GPTNeoModel", "right padding; window fill + added mask",
                                         left_pad=False, attention_types=[[["global", "local"], 1]], window_size=2,
                                         resid_dropout=0.0, embed_dropout=0.0, attention_dropout=0.0),
    "mpt": lambda: decoder("MptConfig", "MptModel", "alibi + finite fill (known miss)", n_layers=2, d_model=32,
                           n_heads=4, max_seq_len=64, vocab_size=VOCAB),
    "whisper": whisper,
    "mbart": lambda: seq2seq("MBartConfig", "MBartModel"),
    "m2m100": lambda: seq2seq("M2M100Config", "M2M100Model"),
    "xlm_roberta": lambda: encoder_text("XLMRobertaConfig", "XLMRobertaModel", num_hidden_layers=2, hidden_size=16,
                                        num_attention_heads=2, intermediate_size=32, vocab_size=VOCAB,
                                        pad_token_id=0),
    "esm": lambda: encoder_text("EsmConfig", "EsmModel", "rotary encoder", num_hidden_layers=2, hidden_size=16,
                                num_attention_heads=2, intermediate_size=32, vocab_size=VOCAB, pad_token_id=0,
                                position_embedding_type="rotary", mask_token_id=3),
    "modernbert": lambda: encoder_text("ModernBertConfig", "ModernBertModel", "local window + global",
                                       num_hidden_layers=2, hidden_size=16, num_attention_heads=2,
                                       intermediate_size=32, vocab_size=VOCAB, pad_token_id=0, local_attention=4,
                                       global_attn_every_n_layers=2),
    "wav2vec2": wav2vec2,
    "siglip_vision": lambda: vision("SiglipVisionConfig", "SiglipVisionModel", 8, hidden_size=16,
                                    intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, image_size=8,
                                    patch_size=4),
    "clip_vision": lambda: vision("CLIPVisionConfig", "CLIPVisionModel", 8, hidden_size=16, intermediate_size=32,
                                  num_hidden_layers=2, num_attention_heads=2, image_size=8, patch_size=4),
    "deit": lambda: vision("DeiTConfig", "DeiTModel", 8, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                           num_attention_heads=2, image_size=8, patch_size=4),
    "dinov2": lambda: vision("Dinov2Config", "Dinov2Model", 8, hidden_size=16, mlp_ratio=2, num_hidden_layers=2,
                             num_attention_heads=2, image_size=8, patch_size=4),
    "beit": lambda: vision("BeitConfig", "BeitModel", 8, "relative position bias", hidden_size=16,
                           intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, image_size=8, patch_size=4,
                           use_relative_position_bias=True),
    "swin": lambda: vision("SwinConfig", "SwinModel", 16, "windows + relative position bias + shift mask",
                           embed_dim=8, depths=[2, 1], num_heads=[2, 2], window_size=2, patch_size=2, image_size=16),
    "pixtral_vision": lambda: vision("PixtralVisionConfig", "PixtralVisionModel", 8, "block-diagonal mask",
                                     hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                                     image_size=8, patch_size=4, head_dim=8),
}


@dataclass
class Row:
    name: str
    sites: int = 0
    rewritten: int = 0
    masks: list = field(default_factory=list)
    missed: list = field(default_factory=list)  # reasons
    diff: Optional[float] = None
    grad_diff: Optional[float] = None
    error: str = ""
    note: str = ""
    train: str = ""  # sites rewritten / total in the training (grad mode) compile
    seconds: float = 0.0


def _tensors(out: Any) -> list:
    """Every tensor of a model output, in a fixed order (ModelOutput, tuple, caches)."""
    if isinstance(out, torch.Tensor):
        return [out]
    if hasattr(out, "to_tuple"):
        out = out.to_tuple()
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _tensors(o)]
    return []


def _max_diff(a: list, b: list) -> float:
    if len(a) != len(b):
        raise AssertionError(f"{len(a)} output tensors compiled, {len(b)} eager")
    d = 0.0
    for x, y in zip(a, b):
        if x.shape != y.shape:
            raise AssertionError(f"shape {tuple(x.shape)} compiled, {tuple(y.shape)} eager")
        both_nan = torch.isnan(x) & torch.isnan(y)
        if x.numel():
            d = max(d, float((x - y).abs().masked_fill(both_nan, 0).max()))
    return d


def run_case(name: str, case: Case, kwargs: dict, backward: bool) -> Row:
    import fa_compile
    from fa_compile.compiler import run_pass

    row = Row(name)
    t0 = time.time()
    try:
        torch.manual_seed(0)
        model = case.build().eval()
        reports: list = []
        inner = fa_compile.backend("aot_eager")

        def capture(gm, example_inputs):
            reports.extend(run_pass(gm))  # marks gm done: the real backend below skips the pass
            return inner(gm, example_inputs)

        torch._dynamo.reset()
        compiled = torch.compile(model, backend=capture, fullgraph=False)
        with torch.no_grad():
            ref = _tensors(model(use_cache=False, **kwargs) if _takes_cache(model) else model(**kwargs))
            got = _tensors(compiled(use_cache=False, **kwargs) if _takes_cache(model) else compiled(**kwargs))
        row.sites = len(reports)
        row.rewritten = sum(r.rewritten for r in reports)
        row.masks = sorted({r.mask for r in reports if r.rewritten})
        row.missed = [r.reason for r in reports if not r.rewritten]
        row.diff = _max_diff(got, ref)
        for a, b in zip(got, ref):
            torch.testing.assert_close(a, b, equal_nan=True, **TOL)
        if backward:
            n0 = len(reports)
            row.grad_diff, row.note = _grad_diff(model, compiled, kwargs)
            # the training graph is a separate compile (grad mode is guarded): its sites may differ
            train = reports[n0:]
            if train:
                row.train = f"{sum(r.rewritten for r in train)}/{len(train)}"
                row.missed += [f"(training graph) {r.reason}" for r in train if not r.rewritten]
    except Exception as e:  # one model's failure must not stop the sweep
        row.error = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        if os.environ.get("SWEEP_TRACE"):
            traceback.print_exc()
    row.seconds = time.time() - t0
    return row


def _takes_cache(model: torch.nn.Module) -> bool:
    import inspect

    return "use_cache" in inspect.signature(model.forward).parameters


def _grad_diff(model: torch.nn.Module, compiled: Callable, kwargs: dict) -> tuple:
    """One backward through the compiled and the eager model with the same cotangent; every
    parameter's gradient compared (None from eager and zeros from AOTAutograd are equal)."""
    params = [p for p in model.parameters() if p.requires_grad]
    extra = dict(use_cache=False) if _takes_cache(model) else {}

    def grads_of(fn, kw):
        outs = [o for o in _tensors(fn(**extra, **kw)) if o.is_floating_point() and o.requires_grad]
        gs = [torch.randn(o.shape, generator=torch.Generator().manual_seed(i + 1)).to(o.dtype)
              for i, o in enumerate(outs)]
        # padded rows of eager may hold NaN (fully masked); keep them out of the loss
        loss = sum((torch.nan_to_num(o) * g).sum() for o, g in zip(outs, gs))
        return torch.autograd.grad(loss, params, allow_unused=True)

    grads = lambda fn: grads_of(fn, kwargs)

    got, ref = grads(compiled), grads(model)
    got = [torch.zeros_like(p) if a is None else a for p, a in zip(params, got)]
    ref = [torch.zeros_like(p) if b is None else b for p, b in zip(params, ref)]
    d = max((float((a - b).abs().max()) for a, b in zip(got, ref) if a.numel()), default=0.0)
    try:
        for a, b in zip(got, ref):
            torch.testing.assert_close(a, b, **GRAD_TOL)
        return d, ""
    except AssertionError:
        pass
    # Large gradients (sums over every position) differ in fp32 rounding beyond 1e-4: the fp64 eager
    # model arbitrates; the rewrite passes when its error is no worse than twice eager's own, plus four fp32 ulps
    # of the gradient's largest element (where eager happens to land within an ulp, twice its error is no bound).
    model.double()
    kw64 = {k: v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in kwargs.items()}
    truth = [torch.zeros_like(p) if t is None else t for p, t in zip(params, grads_of(model, kw64))]
    for i, (a, b, t) in enumerate(zip(got, ref, truth)):
        err_c, err_e = float((a.double() - t).abs().max()), float((b.double() - t).abs().max())
        if err_c > 2 * err_e + max(1e-6, 4 * torch.finfo(torch.float32).eps * float(t.abs().max())):
            raise AssertionError(f"gradient {i}: |compiled - fp64| {err_c:.2e} > 2 x |eager - fp64| {err_e:.2e} "
                                 f"(max |fp64| {float(t.abs().max()):.2e})")
    return d, "grads within fp32 rounding (fp64 check)"


def _fmt(row: Row) -> tuple:
    # one line per distinct reason: node names of later layers (x_1, x_2) and the training copy folded
    reasons = {re.sub(r"_\d+\)", ")", r.removeprefix("(training graph) ")): r.startswith("(training graph)")
               for r in row.missed}
    eval_reasons = {re.sub(r"_\d+\)", ")", r) for r in row.missed if not r.startswith("(training graph)")}
    missed = "; ".join(sorted(r if r in eval_reasons else f"(training only) {r}" for r in reasons))
    return (row.name, f"{row.rewritten}/{row.sites}", row.train or "-", "+".join(row.masks) or "-",
            "-" if row.diff is None else f"{row.diff:.1e}", "-" if row.grad_diff is None else f"{row.grad_diff:.1e}",
            missed or "-", row.error or (f"ok ({row.note})" if row.note else "ok"), f"{row.seconds:.1f}")


HEAD = ("model", "rewritten (eval)", "rewritten (train)", "masks", "max|diff|", "grad |diff|", "missed (reasons)", "result", "s")


def main(argv: Optional[list] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("only", nargs="*", help="substrings of model names to run")
    ap.add_argument("--no-backward", action="store_true")
    ap.add_argument("--md", help="write the table as Markdown to this file")
    a = ap.parse_args(argv)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    rows = []
    for name, make in MODELS.items():
        if a.only and not any(s in name for s in a.only):
            continue
        try:
            case = make()
        except Exception as e:
            rows.append(Row(name, error=f"{type(e).__name__}: {e}"))
            continue
        variants = [("", case.inputs)] + ([("+pad", case.padded)] if case.padded else [])
        for suffix, inputs in variants:
            try:
                kwargs = inputs()
            except Exception as e:
                rows.append(Row(name + suffix, error=f"{type(e).__name__}: {e}"))
                continue
            row = run_case(name + suffix, case, kwargs, not a.no_backward)
            rows.append(row)
            print(" | ".join(_fmt(row)), flush=True)
    bad = [r for r in rows if r.error]
    if a.md:
        import transformers

        with open(a.md, "w") as f:
            f.write(f"torch {torch.__version__}, transformers {transformers.__version__}, CPU fp32, batch {B}\n\n")
            f.write("| " + " | ".join(HEAD) + " |\n|" + "---|" * len(HEAD) + "\n")
            for r in rows:
                f.write("| " + " | ".join(c.replace("|", "\\|") for c in _fmt(r)) + " |\n")
    print(f"\n{len(rows)} runs, {len(bad)} with errors or mismatches", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
