"""The README's generate() recipes: compiling `model.forward` and HF's CompileConfig both put every
attention of the decoding graphs through the rewrite, and greedy tokens equal eager's."""
from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

import fa_compile

transformers = pytest.importorskip("transformers")

NEW_TOKENS = 5


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    counters["fa_compile"].clear()
    yield
    torch._dynamo.reset()


def tiny_llama(impl: str = "sdpa"):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
                                   num_hidden_layers=2, vocab_size=97, max_position_embeddings=64, bos_token_id=1,
                                   eos_token_id=2, pad_token_id=0)
    return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=impl).eval()


def prompt():
    return torch.randint(3, 97, (2, 7), generator=torch.Generator().manual_seed(1))


def greedy(model, ids, **kw):
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False,
                          min_new_tokens=NEW_TOKENS, **kw)


# The recipes as the README writes them, with backend="fa3"; the tests use the same backend with the
# eager inner compiler, which keeps the rewrite and skips Inductor's C++ build on a CPU runner.
BACKEND = fa_compile.backend("eager")


def test_compiled_forward_generates_eager_tokens():
    model = tiny_llama()
    ids = prompt()
    ref = greedy(model, ids)
    model.forward = torch.compile(model.forward, backend=BACKEND)
    out = greedy(model, ids)
    assert torch.equal(out, ref)
    c = counters["fa_compile"]
    assert c["graphs"] >= 1 and c["sites_rewritten"] >= 2 and c["sites_missed"] == 0


def test_compile_config_generates_eager_tokens():
    from transformers import CompileConfig

    model = tiny_llama()
    ids = prompt()
    ref = greedy(model, ids)
    model.generation_config.compile_config = CompileConfig(backend=BACKEND, mode=None)
    model.generation_config.compile_config._compile_all_devices = True  # HF compiles on CUDA only otherwise
    out = greedy(model, ids, cache_implementation="static")
    assert torch.equal(out, ref)
    c = counters["fa_compile"]
    assert c["graphs"] >= 1 and c["sites_rewritten"] >= 2 and c["sites_missed"] == 0


def tiny_gpt2():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=97, n_positions=64, bos_token_id=1,
                                  eos_token_id=2, pad_token_id=0)
    return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()


def test_static_cache_filled_in_place_generates_eager_tokens():
    # The cache is written in place (index_copy_) inside each layer's graph, after the queries are
    # viewed and before the scores read it: every site of the prefill and decode graphs is rewritten.
    model = tiny_gpt2()
    ids = prompt()
    ref = greedy(model, ids, cache_implementation="static")
    model.forward = torch.compile(model.forward, backend=BACKEND, dynamic=False)
    out = greedy(model, ids, cache_implementation="static")
    assert torch.equal(out, ref)
    c = counters["fa_compile"]
    assert c["graphs"] >= 2 and c["sites_rewritten"] >= 4 and c["sites_missed"] == 0


def test_attn_implementation_fa3_generates_eager_tokens():
    ids = prompt()
    ref = greedy(tiny_llama("eager"), ids)
    assert torch.equal(greedy(tiny_llama("fa3"), ids), ref)
