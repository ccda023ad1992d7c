"""attn_implementation="fa3": Hugging Face models built from tiny configs (random weights, no downloads)
run torch.ops.fa3.attention with no torch.compile; outputs and parameter gradients equal to the same
model with attn_implementation="eager" (and "sdpa" where the model supports it), with padding."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fused_helpers import assert_same

import fa_compile  # noqa: F401  (registers "fa3" with transformers)
import fa_compile.ops  # noqa: F401  (torch.ops.fa3, which CountOps compares with)

transformers = pytest.importorskip("transformers")

TOL_OUT = dict(atol=2e-5, rtol=2e-5)
TOL_GRAD = dict(atol=5e-5, rtol=5e-5)  # fp32 through two layers and a vocab projection
VOCAB = 97


class CountOps(TorchDispatchMode):
    """Counts the fa3 ops that run (forward and backward)."""

    def __init__(self):
        super().__init__()
        self.fwd = self.bwd = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.fwd += func is torch.ops.fa3.attention.default
        self.bwd += func is torch.ops.fa3.attention_backward.default
        return func(*args, **(kwargs or {}))


def llama():
    return transformers.LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
                                    num_hidden_layers=2, vocab_size=VOCAB, max_position_embeddings=64, pad_token_id=0)


def gpt2():
    return transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=64, resid_pdrop=0.0,
                                   embd_pdrop=0.0, attn_pdrop=0.0)


def bert():
    return transformers.BertConfig(hidden_size=32, num_attention_heads=4, intermediate_size=64, num_hidden_layers=2,
                                   vocab_size=VOCAB, max_position_embeddings=64, hidden_dropout_prob=0.0,
                                   attention_probs_dropout_prob=0.0, pad_token_id=0)


def mistral():  # a sliding window shorter than the sequence
    return transformers.MistralConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                                      intermediate_size=64, num_hidden_layers=2, vocab_size=VOCAB,
                                      max_position_embeddings=64, sliding_window=4, pad_token_id=0)


def qwen2():  # sliding layers mixed with full ones
    return transformers.Qwen2Config(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
                                    num_hidden_layers=2, vocab_size=VOCAB, max_position_embeddings=64,
                                    use_sliding_window=True, sliding_window=4, max_window_layers=1,
                                    layer_types=["full_attention", "sliding_attention"], pad_token_id=0)


def gemma2():  # logit softcap, query_pre_attn_scalar scaling, alternating sliding / full layers
    return transformers.Gemma2Config(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                     intermediate_size=64, num_hidden_layers=2, vocab_size=VOCAB,
                                     max_position_embeddings=64, sliding_window=4, attn_logit_softcapping=5.0,
                                     final_logit_softcapping=None, query_pre_attn_scalar=16, pad_token_id=0)


def t5():  # relative position bias, encoder-decoder with cross attention
    return transformers.T5Config(d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, vocab_size=VOCAB,
                                 dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0)


CONFIGS = {"llama": llama, "gpt2": gpt2, "bert": bert, "mistral": mistral, "qwen2": qwen2, "gemma2": gemma2, "t5": t5}
NO_SDPA = {"gemma2"}  # HF's SDPA refuses a softcap


def build(name: str, impl: str):
    torch.manual_seed(0)
    cls = {"bert": transformers.AutoModel, "t5": transformers.AutoModelForSeq2SeqLM}.get(
        name, transformers.AutoModelForCausalLM)
    return cls.from_config(CONFIGS[name](), attn_implementation=impl)


def inputs(name: str, padded: bool) -> dict:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, VOCAB, (2, 9), generator=g)
    kw = dict(input_ids=ids)
    if padded:
        am = torch.ones(2, 9, dtype=torch.long)
        am[1, 6:] = 0  # right padding: every query keeps a key, so every row is defined in each implementation
        kw["attention_mask"] = am
    if name == "t5":
        kw["decoder_input_ids"] = torch.randint(1, VOCAB, (2, 7), generator=g)
    return kw


def main_output(out):
    return out.logits if getattr(out, "logits", None) is not None else out.last_hidden_state


def run(model, kw: dict):
    model.zero_grad()
    out = main_output(model(**kw))
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(2)))
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_model_equal(name: str, kw: dict, ours, ref_impl: str) -> None:
    ref = build(name, ref_impl)
    out_ref, grads_ref = run(ref, kw)
    out, grads = ours
    assert_same(out, out_ref, **TOL_OUT)
    assert grads.keys() == grads_ref.keys()
    for n in grads_ref:
        assert_same(grads[n], grads_ref[n], **TOL_GRAD)


@pytest.mark.parametrize("padded", [False, True], ids=["dense", "padded"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_attn_implementation_fa3_matches_eager_and_sdpa(name, padded):
    kw = inputs(name, padded)
    model = build(name, "fa3")
    assert model.config._attn_implementation == "fa3"
    with CountOps() as ops:
        ours = run(model, kw)
    assert ops.fwd > 0 and ops.bwd == ops.fwd  # every attention ran the op, forward and backward
    assert_model_equal(name, kw, ours, "eager")
    if name not in NO_SDPA:
        assert_model_equal(name, kw, ours, "sdpa")


@pytest.mark.parametrize("name", ["llama", "gemma2"])
def test_attn_implementation_fa3_under_torch_compile(name):
    torch._dynamo.reset()
    kw = inputs(name, padded=True)
    model = build(name, "fa3")
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    out = main_output(compiled(**kw))
    ref = main_output(build(name, "eager")(**kw))
    assert_same(out, ref, **TOL_OUT)
    torch._dynamo.reset()


def test_mask_reaches_the_op_as_structure():
    """Causal + padding arrive as a key vector and the causal flag, a sliding window as the window."""
    from fa_compile import hf

    seen = []
    real = hf.attention_forward

    def spy(module, q, k, v, mask, **kw):
        seen.append((None if mask is None else tuple(mask.shape), kw.get("sliding_window")))
        return real(module, q, k, v, mask, **kw)

    from transformers.modeling_utils import AttentionInterface

    AttentionInterface.register("fa3", spy)
    try:
        build("mistral", "fa3")(**inputs("mistral", padded=True))
        build("llama", "fa3")(**inputs("llama", padded=False))
    finally:
        AttentionInterface.register("fa3", real)
    assert seen == [((2, 9), 4)] * 2 + [(None, None)] * 2


@pytest.mark.parametrize("name", ["s_aux", "sinks"])
def test_sinks_reach_the_op(name):
    # GPT-OSS's per-head sink logit joins the softmax denominator only: eager's spelling is a column
    # of the sink logit appended to the scores, dropped after the softmax.
    from fa_compile import hf

    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, 4, 5, 8, generator=g, requires_grad=True) for _ in range(3))
    sink = torch.randn(4, generator=g, requires_grad=True)
    mod = torch.nn.Module()
    mod.is_causal = True
    out, _ = hf.attention_forward(mod, q, k, v, None, scaling=0.3, **{name: sink})
    s = (q @ k.mT) * 0.3
    s = s.masked_fill(torch.ones(5, 5, dtype=torch.bool).triu(1), float("-inf"))
    col = sink.reshape(1, 4, 1, 1).expand(2, 4, 5, 1)
    p = torch.cat([s, col], dim=-1).softmax(-1)[..., :-1]
    want = (p @ v).transpose(1, 2)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    g_out = torch.randn(out.shape, generator=g)
    got = torch.autograd.grad(out, (q, k, v, sink), g_out)
    ref = torch.autograd.grad(want, (q, k, v, sink), g_out)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_import_registers_without_importing_transformers():
    code = ("import sys, fa_compile; assert 'transformers' not in sys.modules; "
            "from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS as A; "
            "from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS as M; "
            "assert 'fa3' in A and 'fa3' in M; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


@pytest.mark.parametrize("name", ["llama", "mistral", "gpt2"])
def test_attn_implementation_fa3_under_autocast(name):
    # Under autocast the rotary step leaves q and k in fp32 beside a bf16 V: the op, like SDPA, computes in the
    # region's dtype (its autocast kernel casts q, k and v), eagerly and compiled
    kw = inputs(name, padded=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = main_output(build(name, "sdpa")(**kw)).float()
        with CountOps() as ops:
            out = main_output(build(name, "fa3")(**kw)).float()
        torch._dynamo.reset()
        compiled = main_output(torch.compile(build(name, "fa3"), backend="aot_eager", fullgraph=True)(**kw)).float()
    torch._dynamo.reset()
    assert ops.fwd > 0
    # bf16 products through two layers and a vocab projection: SDPA and the op round differently
    assert_same(out, ref, atol=3e-2, rtol=3e-2)
    assert_same(compiled, out, atol=3e-2, rtol=3e-2)
