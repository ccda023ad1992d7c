"""Hugging Face models with attn_implementation="sdpa" (tiny configs, random weights, no downloads):
every attention site rewritten to fa3.attention, outputs and gradients equal to eager."""
from __future__ import annotations

import pytest
import torch

from fused_helpers import Capture, assert_same

transformers = pytest.importorskip("transformers")

LAYERS = 2
TOL_OUT = dict(atol=2e-5, rtol=2e-5)
TOL_GRAD = dict(atol=5e-5, rtol=5e-5)  # fp32 through two layers and a vocab projection


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def gpt2():
    cfg = transformers.GPT2Config(n_layer=LAYERS, n_embd=32, n_head=4, vocab_size=97, n_positions=64,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
                                  attn_implementation="sdpa")
    return transformers.GPT2LMHeadModel(cfg)


def llama():
    cfg = transformers.LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
                                   num_hidden_layers=LAYERS, vocab_size=97, max_position_embeddings=64, bos_token_id=0,
                                   eos_token_id=0, pad_token_id=0, attn_implementation="sdpa")
    return transformers.LlamaForCausalLM(cfg)


def bert():
    cfg = transformers.BertConfig(hidden_size=32, num_attention_heads=4, intermediate_size=64,
                                  num_hidden_layers=LAYERS, vocab_size=97, max_position_embeddings=64,
                                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pad_token_id=0,
                                  attn_implementation="sdpa")
    return transformers.BertModel(cfg)


def vit():
    cfg = transformers.ViTConfig(image_size=16, patch_size=4, hidden_size=32, num_hidden_layers=LAYERS,
                                 num_attention_heads=4, intermediate_size=64, hidden_dropout_prob=0.0,
                                 attention_probs_dropout_prob=0.0, attn_implementation="sdpa")
    return transformers.ViTModel(cfg)


def padding_mask():
    am = torch.ones(2, 9, dtype=torch.long)
    am[1, 6:] = 0
    return am


def inputs(name):
    g = torch.Generator().manual_seed(1)
    if name == "vit":
        return dict(pixel_values=torch.randn(2, 3, 16, 16, generator=g))
    ids = torch.randint(1, 97, (2, 9), generator=g)
    if name in ("bert", "llama_padded", "gpt2_padded"):
        return dict(input_ids=ids, attention_mask=padding_mask())
    return dict(input_ids=ids)


MODELS = {"gpt2": gpt2, "gpt2_padded": gpt2, "llama": llama, "llama_padded": llama, "bert": bert, "vit": vit}
EXPECTED_GQA = {"llama": "Hq=4/Hkv=2 (enable_gqa)", "llama_padded": "Hq=4/Hkv=2 (repeat_kv removed)"}


def main_output(out):
    return out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state


def build(name):
    torch.manual_seed(0)
    return MODELS[name]()


def check_sites(cap, name):
    assert len(cap.reports) == LAYERS, cap.reports
    for rep in cap.reports:
        assert rep.form == "sdpa" and rep.rewritten, rep.reason
        if name in EXPECTED_GQA:
            assert rep.gqa == EXPECTED_GQA[name]
    assert cap.n_attention == LAYERS
    for gm in cap.graphs:  # no SDPA call left
        assert not any("scaled_dot_product_attention" in str(n.target) for n in gm.graph.nodes)


@pytest.mark.parametrize("name", list(MODELS))
def test_inference_every_site_rewritten_and_matches_eager(name):
    model = build(name).eval()
    kw = inputs(name)
    cap = Capture()
    with torch.no_grad():
        out = main_output(torch.compile(model, backend=cap)(**kw))
        ref = main_output(model(**kw))
    check_sites(cap, name)
    assert_same(out, ref, **TOL_OUT)


@pytest.mark.parametrize("name", list(MODELS))
def test_training_gradients_match_eager(name):
    model = build(name).train()  # every dropout probability is 0 in these configs: exact comparison
    kw = inputs(name)
    cap = Capture(inner="aot_eager")
    out = main_output(torch.compile(model, backend=cap)(**kw))
    check_sites(cap, name)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(5))
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad((out * w).sum(), params, allow_unused=True)
    ref = main_output(model(**kw))
    ref_grads = torch.autograd.grad((ref * w).sum(), params, allow_unused=True)
    assert_same(out, ref, **TOL_OUT)
    for (pname, _), g, r in zip(model.named_parameters(), grads, ref_grads):
        if r is None:  # unused parameter (e.g. BERT's pooler): None eagerly, zeros from aot_autograd
            assert g is None or not g.any(), pname
            continue
        torch.testing.assert_close(g, r, **TOL_GRAD, msg=lambda m: f"{pname}: {m}")


def test_explain_names_every_site():
    import fa_compile

    model = build("bert").eval()
    with torch.no_grad():
        report = fa_compile.explain(model, **inputs("bert"))
    assert len(report.rewritten) == LAYERS and not report.missed
    assert str(report).startswith(f"fa-compile: {LAYERS} of {LAYERS} attention sites rewritten")
