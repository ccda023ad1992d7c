"""mode="reduce-overhead" (CUDA graphs) with the rewritten attention on the GPU: one attention layer per
lowered kernel family, replayed on fresh inputs, and a Hugging Face static-cache generate(), against
eager. A graph that CUDA graphs cannot capture must still run correctly (Inductor then skips the
capture); what these tests refuse is a crash or a wrong number."""
from __future__ import annotations

import math

import pytest
import torch

import fa_compile
from fa_compile.kernels import triton_family as tf

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or not tf.triton_available(), reason="needs a CUDA GPU")


def _layer(q, k, v, mask):
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) + mask
    return torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype) @ v


def _inputs(seed, b, hq, hkv, nq, nk, d=64, dt=torch.bfloat16, pad=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(b, hq, nq, d, device="cuda", dtype=dt, generator=g)
    k = torch.randn(b, hkv, nk, d, device="cuda", dtype=dt, generator=g)
    v = torch.randn(b, hkv, nk, d, device="cuda", dtype=dt, generator=g)
    keep = torch.ones(b, 1, nq, nk, dtype=torch.bool, device="cuda")
    if nq == nk:
        keep = keep.tril()
    if pad:
        keep[0, ..., nk - pad:] = False
    mask = torch.zeros(keep.shape, device="cuda", dtype=dt).masked_fill(~keep, torch.finfo(dt).min)
    return q, k, v, mask


@pytest.mark.parametrize("kernel, shape", [
    (None, (2, 8, 4, 256, 256)),          # prefill, the default choice
    ("triton", (2, 8, 4, 256, 256)),      # our Triton family through fa3_triton.fwd
    (None, (4, 16, 4, 1, 4096)),          # a decode step with a data mask: the key limit, fa3_decode.fwd
])
def test_reduce_overhead_replays_match_eager(kernel, shape):
    torch._dynamo.reset()
    fn = torch.compile(_layer, backend=fa_compile.backend(kernel=kernel, mode="reduce-overhead"))
    for seed in range(3):  # warm-up, record, replay
        q, k, v, mask = _inputs(seed, *shape, pad=100)
        got = fn(q, k, v, mask).clone()
        want = _layer(q.float(), k.float(), v.float(), mask.float())
        torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)


def test_reduce_overhead_static_cache_generate_matches_eager():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, intermediate_size=512,
                                   num_hidden_layers=2, vocab_size=512, max_position_embeddings=1024, bos_token_id=1,
                                   eos_token_id=2, pad_token_id=0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").cuda().eval()
    ids = torch.randint(3, 512, (2, 32), generator=torch.Generator().manual_seed(1)).cuda()
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=8, min_new_tokens=8, do_sample=False,
              cache_implementation="static")
    with torch.no_grad():
        ref = model.generate(ids, **kw)
        torch._dynamo.reset()
        model.forward = torch.compile(model.forward, backend=fa_compile.backend(mode="reduce-overhead"))
        out = model.generate(ids, **kw)
    assert torch.equal(out, ref)
