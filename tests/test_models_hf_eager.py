"""Hugging Face models with attn_implementation="eager", tiny configs and random weights (no downloads):
every attention site rewritten, outputs and gradients equal to eager."""
from __future__ import annotations

import pytest
import torch

from conftest import TOL, Compiled

transformers = pytest.importorskip("transformers")

LAYERS = 2


def gpt2():
    cfg = transformers.GPT2Config(n_layer=LAYERS, n_head=2, n_embd=16, vocab_size=50, n_positions=32,
                                  bos_token_id=0, eos_token_id=0, attn_implementation="eager",
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2Model(cfg), (torch.randint(0, 50, (2, 8)),), {}, "causal"


def llama_gqa():
    cfg = transformers.LlamaConfig(num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
                                   hidden_size=32, intermediate_size=64, vocab_size=50, attn_implementation="eager")
    return transformers.LlamaModel(cfg), (torch.randint(0, 50, (2, 8)),), {}, "causal"


def bert_padding():
    cfg = transformers.BertConfig(num_hidden_layers=LAYERS, num_attention_heads=2, hidden_size=16,
                                  intermediate_size=32, vocab_size=50, attn_implementation="eager",
                                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    am = torch.ones(2, 8, dtype=torch.long)
    am[1, 5:] = 0
    return transformers.BertModel(cfg), (torch.randint(0, 50, (2, 8)),), dict(attention_mask=am), None


def vit():
    cfg = transformers.ViTConfig(num_hidden_layers=LAYERS, num_attention_heads=2, hidden_size=16, intermediate_size=32,
                                 image_size=8, patch_size=4, attn_implementation="eager")
    return transformers.ViTModel(cfg), (torch.randn(2, 3, 8, 8),), {}, "none"


def bloom_alibi():
    """baddbmm(alibi, q, k^T) in [B*H, N, N], viewed to [B, H, N, N] for the mask, back to 3-D for bmm."""
    cfg = transformers.BloomConfig(n_layer=LAYERS, n_head=2, hidden_size=16, vocab_size=50, attn_implementation="eager",
                                   hidden_dropout=0.0, attention_dropout=0.0)
    am = torch.ones(2, 8, dtype=torch.long)
    am[1, :3] = 0
    return transformers.BloomModel(cfg), (torch.randint(0, 50, (2, 8)),), dict(attention_mask=am), None


def llama_gqa_left_padding():
    """Left padding: the padded queries of row 1 see no key, eager's additive finfo.min mask makes
    them uniform and still passes q and k a gradient from them (the rewrite must keep it)."""
    model, args, _, _ = llama_gqa()
    am = torch.ones(2, 8, dtype=torch.long)
    am[1, :3] = 0
    return model, args, dict(attention_mask=am), "causal+bool-mask"


def _deberta(config_cls, model_cls):
    """DeBERTa's mask keep[i] & keep[j]: the padded queries of row 1 see no key (finfo.min fill, then softmax)."""
    cfg = config_cls(num_hidden_layers=LAYERS, num_attention_heads=4, hidden_size=64, intermediate_size=128,
                     vocab_size=100, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    am = torch.ones(2, 8, dtype=torch.long)
    am[1, 5:] = 0
    return model_cls(cfg), (torch.randint(0, 100, (2, 8)),), dict(attention_mask=am), None


def deberta_v2():
    return _deberta(transformers.DebertaV2Config, transformers.DebertaV2Model)


def deberta():
    return _deberta(transformers.DebertaConfig, transformers.DebertaModel)


MODELS = {"gpt2": gpt2, "llama_gqa": llama_gqa, "llama_gqa_left_padding": llama_gqa_left_padding,
          "bert_padding": bert_padding, "vit": vit, "bloom_alibi": bloom_alibi, "deberta_v2": deberta_v2,
          "deberta": deberta}


def _first(out):
    return out[0] if isinstance(out, (tuple, list)) else out.last_hidden_state


@pytest.mark.parametrize("name", list(MODELS))
def test_hf_eager_attention_is_rewritten_and_trains(name):
    torch.manual_seed(0)
    model, args, kwargs, mask_kind = MODELS[name]()
    model.train()  # dropout probabilities are 0 in these configs: outputs are deterministic
    c = Compiled(model, inner="aot_eager", fullgraph=False)
    out = _first(c(*args, **kwargs))
    assert len(c.reports) == LAYERS, c.reports
    assert len(c.rewritten) == LAYERS, [r.reason for r in c.missed]
    assert c.op_calls() == LAYERS
    if mask_kind is not None:
        assert all(r.mask == mask_kind for r in c.rewritten), [r.mask for r in c.rewritten]
    if name.startswith("llama_gqa"):
        assert all(r.q_shape[1] == 4 and r.k_shape[1] == 2 for r in c.rewritten)  # native GQA, no repeat
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    grads = torch.autograd.grad(out, list(model.parameters()), g, allow_unused=True)
    ref = _first(model(*args, **kwargs))
    torch.testing.assert_close(out, ref, **TOL[torch.float32])
    ref_grads = torch.autograd.grad(ref, list(model.parameters()), g, allow_unused=True)
    for (pname, p), a, b in zip(model.named_parameters(), grads, ref_grads):
        # an unused parameter (the pooler) gets None from eager and zeros from AOTAutograd
        a = torch.zeros_like(p) if a is None else a
        b = torch.zeros_like(p) if b is None else b
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4, msg=pname)


def test_hf_output_attentions_is_left_alone_with_reason():
    torch.manual_seed(0)
    model, args, kwargs, _ = gpt2()
    model.eval()
    c = Compiled(lambda ids: model(ids, output_attentions=True), fullgraph=False)
    out = c(*args)
    ref = model(*args, output_attentions=True)
    torch.testing.assert_close(out.last_hidden_state, ref.last_hidden_state, **TOL[torch.float32])
    assert len(c.missed) == LAYERS and not c.rewritten
    assert all("output_attentions" in r.reason for r in c.missed)


@pytest.mark.parametrize("how", ["dynamic=True", "mark_dynamic"])
def test_hf_llama_dynamic_sequence_length_one_graph(how):
    torch.manual_seed(0)
    model, _, _, _ = llama_gqa()
    model.eval()
    c = Compiled(model, dynamic=True if how == "dynamic=True" else None, fullgraph=False)
    for n in (8, 11, 17):
        ids = torch.randint(0, 50, (2, n), generator=torch.Generator().manual_seed(n))
        if how == "mark_dynamic":
            torch._dynamo.mark_dynamic(ids, 1)
        torch.testing.assert_close(_first(c(ids)), _first(model(ids)), **TOL[torch.float32])
    assert len(c.graphs) == 1  # one compile serves every length
    assert len(c.rewritten) == LAYERS and all(r.mask == "causal" for r in c.rewritten)


def test_hf_llama_static_cache_prefill_and_decode():
    """generate()'s static cache: the prefill mask is causal, a decode step's (one query, every
    key up to the cache position, one position for the whole batch) is a key length broadcast
    over the batch; both are rewritten and every step's logits equal eager's."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
                                   hidden_size=32, intermediate_size=64, vocab_size=50, attn_implementation="eager")
    model = transformers.LlamaForCausalLM(cfg).eval()
    prompt, steps = 6, 3

    def run(fn):
        cache = transformers.StaticCache(config=cfg, max_cache_len=prompt + steps + 2)
        ids = torch.randint(0, 50, (2, prompt), generator=torch.Generator().manual_seed(3))
        logits = [fn(input_ids=ids, past_key_values=cache, cache_position=torch.arange(prompt), use_cache=True).logits]
        for i in range(steps):
            tok = logits[-1][:, -1:].argmax(-1)
            pos = torch.tensor([prompt + i])
            logits.append(fn(input_ids=tok, past_key_values=cache, cache_position=pos, use_cache=True).logits)
        return logits

    c = Compiled(model, fullgraph=False)
    with torch.no_grad():
        got, ref = run(c), run(model)
    for step, (a, b) in enumerate(zip(got, ref)):
        torch.testing.assert_close(a, b, **TOL[torch.float32], msg=f"step {step}")
    assert not c.missed, [r.reason for r in c.missed]
    masks = [r.mask for r in c.rewritten]
    assert len(masks) == 2 * LAYERS and set(masks) == {"causal", "key-padding"}, masks


def sew_d():
    """SEW-D's XSoftmax: masked_fill(rmask, finfo.min), softmax, masked_fill_(rmask, 0), with the relative-position
    bias added before the fill; padded frames of row 1 see no key."""
    cfg = transformers.SEWDConfig(hidden_size=32, num_hidden_layers=LAYERS, num_attention_heads=2, intermediate_size=64,
                                  conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16,
                                  num_conv_pos_embedding_groups=2, squeeze_factor=1, hidden_dropout=0.0,
                                  attention_dropout=0.0, activation_dropout=0.0, feat_proj_dropout=0.0, layerdrop=0.0,
                                  mask_time_prob=0.0)
    am = torch.ones(2, 400, dtype=torch.long)
    am[1, 300:] = 0
    return transformers.SEWDModel(cfg), (torch.randn(2, 400, generator=torch.Generator().manual_seed(2)),), \
        dict(attention_mask=am)


def test_hf_sew_d_xsoftmax_is_rewritten_in_inference():
    torch.manual_seed(0)
    model, args, kwargs = sew_d()
    model.eval()
    c = Compiled(model, fullgraph=False)
    with torch.no_grad():  # Dynamo inlines XSoftmax.forward only where no input needs a gradient
        out, ref = _first(c(*args, **kwargs)), _first(model(*args, **kwargs))
    assert len(c.rewritten) == LAYERS and c.op_calls() == LAYERS, [r.reason for r in c.missed]
    torch.testing.assert_close(out, ref, **TOL[torch.float32])


def test_hf_sew_d_xsoftmax_autograd_function_is_left_alone_with_reason():
    """With gradients, XSoftmax is an autograd.Function: a higher-order op whose own backward the pass does not
    prove to be its forward's, and whose body starts at the scores."""
    torch.manual_seed(0)
    model, args, kwargs = sew_d()
    model.train()
    c = Compiled(model, inner="aot_eager", fullgraph=False)
    torch.testing.assert_close(_first(c(*args, **kwargs)), _first(model(*args, **kwargs)), **TOL[torch.float32])
    assert len(c.missed) == LAYERS and not c.rewritten
    assert all("autograd_function_apply" in r.reason for r in c.missed), [r.reason for r in c.missed]


def reformer_local(**kw):
    """Reformer's local attention: exp(s - logsumexp(s)), chunked keys (previous chunk concatenated)."""
    cfg = transformers.ReformerConfig(hidden_size=32, num_attention_heads=2, attention_head_size=16,
                                      feed_forward_size=64, vocab_size=100, attn_layers=["local"] * LAYERS,
                                      axial_pos_embds=False, max_position_embeddings=64, local_attn_chunk_length=4,
                                      hidden_dropout_prob=0.0, local_attention_probs_dropout_prob=0.0, **kw)
    return transformers.ReformerModel(cfg), (torch.randint(0, 100, (2, 16)),)


@pytest.mark.parametrize("is_decoder", [False, True], ids=["encoder", "decoder"])
def test_hf_reformer_local_attention_is_rewritten_and_trains(is_decoder):
    """The decoder's mask fills -1e9 (a buffer), and over a row with no admissible key eager's logsumexp rounds to
    -1e9. Its causal mask over chunks that look one back is a compile-time constant (index arithmetic of static
    shapes): evaluated, it leaves every query its own key, so no row is empty."""
    torch.manual_seed(0)
    model, args = reformer_local(is_decoder=is_decoder)
    model.train()
    c = Compiled(model, inner="aot_eager", fullgraph=False)
    out, ref = _first(c(*args)), _first(model(*args))
    assert len(c.rewritten) == LAYERS and c.op_calls() == LAYERS, [r.reason for r in c.missed]
    torch.testing.assert_close(out, ref, **TOL[torch.float32])
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    params = list(model.parameters())
    for p, a, b in zip(params, torch.autograd.grad(out, params, g, allow_unused=True),
                       torch.autograd.grad(ref, params, g, allow_unused=True)):
        if a is not None or b is not None:
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("how", ["padding", "decoder_padding"])
def test_hf_reformer_masked_local_attention_is_left_alone_with_reason(how):
    """Padding can empty a row (the mask comes from the inputs): over a row with no admissible key eager's
    logsumexp of the -1e9 fill rounds to -1e9, and every key gets weight 1."""
    torch.manual_seed(0)
    model, (ids,) = reformer_local(is_decoder=how == "decoder_padding")
    kwargs = {"attention_mask": torch.ones(2, 16, dtype=torch.long)}
    kwargs["attention_mask"][1, 8:] = 0  # the last two chunks of row 1: their queries see no key
    model.eval()
    c = Compiled(model, fullgraph=False)
    with torch.no_grad():
        torch.testing.assert_close(_first(c(ids, **kwargs)), _first(model(ids, **kwargs)), **TOL[torch.float32])
    assert len(c.missed) == LAYERS and not c.rewritten
    assert all("eager's logsumexp rounds at the fill's magnitude" in r.reason for r in c.missed)


def pegasus_x():
    """Global-local attention: each block of queries scores the global tokens and its own block apart, one softmax over
    the concatenation, the two slices of the probabilities applied to their values apart and summed."""
    cfg = transformers.PegasusXConfig(vocab_size=100, d_model=32, encoder_layers=LAYERS, decoder_layers=1,
                                      encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64,
                                      decoder_ffn_dim=64, num_global_tokens=4, block_size=8,
                                      max_position_embeddings=64, dropout=0.0, attention_dropout=0.0,
                                      activation_dropout=0.0, attn_implementation="eager")
    am = torch.ones(2, 20, dtype=torch.long)
    am[1, 14:] = 0  # the last block of row 1 is partly padding (the sequence is padded to 24 inside the model)
    return transformers.PegasusXModel(cfg).get_encoder(), (torch.randint(0, 100, (2, 20)),), dict(attention_mask=am)


def test_hf_pegasus_x_global_local_attention_is_rewritten_and_trains():
    torch.manual_seed(0)
    model, args, kwargs = pegasus_x()
    model.train()
    c = Compiled(model, inner="aot_eager", fullgraph=False)
    out = _first(c(*args, **kwargs))
    assert len(c.reports) == 2 * LAYERS and len(c.rewritten) == 2 * LAYERS, [r.reason for r in c.missed]
    assert c.op_calls() == 2 * LAYERS - 1  # the encoder drops the global tokens' states: the last layer's are dead
    ref = _first(model(*args, **kwargs))
    torch.testing.assert_close(out, ref, **TOL[torch.float32])
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    params = list(model.parameters())
    for (pname, p), a, b in zip(model.named_parameters(), torch.autograd.grad(out, params, g, allow_unused=True),
                                torch.autograd.grad(ref, params, g, allow_unused=True)):
        a = torch.zeros_like(p) if a is None else a
        b = torch.zeros_like(p) if b is None else b
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4, msg=pname)
