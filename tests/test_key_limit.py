"""A decode site whose mask is a data tensor (generate()'s 4-d attention_mask over a long static cache)
gets kv_lens = 1 + its last admissible key per batch row, computed in the graph (patterns/key_limit.py):
outputs and gradients equal eager's on fresh inputs, with left padding, holes (the limit is the last
admissible key, not their count), rows with no admissible key, bool and additive masks, fp32 and fp16;
a given kv_lens is combined by minimum; prefill sites and short caches are left alone."""
from __future__ import annotations

import math

import expecttest
import pytest
import torch
import torch.nn.functional as F

from fa_compile import ops  # noqa: F401  (registers torch.ops.fa3)
from fa_compile.patterns import key_limit
from conftest import Compiled
from eager_diff import check, rand
from fa_compile.patterns.emit import example_value

B, H, D = 4, 2, 8
NK = key_limit.MIN_KEYS + 52  # a cache just long enough for the limit
# Admissible keys of each batch row: a prefix, left padding, holes (limit 1001 from 11 keys), none.
VALID = [range(0, 300), range(40, 500), [*range(10), 1000], []]
LIMITS = [300, 500, 1001, 0]


def keep_mask(nq: int = 1, nk: int = NK) -> torch.Tensor:
    keep = torch.zeros(B, 1, nq, nk, dtype=torch.bool)
    for b, keys in enumerate(VALID):
        keep[b, ..., list(keys)] = True
    return keep


def qkv(nq: int = 1, nk: int = NK, dtype=torch.float32, grad: bool = True) -> list:
    return [rand(B, H, nq, D, dtype=dtype, seed=1, requires_grad=grad),
            rand(B, H, nk, D, dtype=dtype, seed=2, requires_grad=grad),
            rand(B, H, nk, D, dtype=dtype, seed=3, requires_grad=grad)]


def _scores(q, k):
    return q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])


def additive(q, k, v, mask):  # Hugging Face's eager attention: a float mask added to the scores
    return (_scores(q, k) + mask).softmax(-1) @ v


def where_min(q, k, v, keep):
    return torch.where(keep, _scores(q, k), torch.finfo(q.dtype).min).softmax(-1) @ v


def fill_neginf(q, k, v, keep):
    return _scores(q, k).masked_fill(~keep, float("-inf")).softmax(-1) @ v


def sdpa(q, k, v, keep):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=keep)


def as_additive(keep: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    return torch.zeros(keep.shape, dtype=dtype).masked_fill(~keep, torch.finfo(dtype).min)


class Recorded(Compiled):
    """Compiled through the fa3 pass, the rewritten graphs run by an FX interpreter that records what
    each fa3.attention call receives: `.calls` holds (Nq, kv_lens as a list or None) per call."""

    def __init__(self, fn, **kw):
        super().__init__(fn, **kw)
        from fa_compile.compiler import run_pass

        self.calls: list = []
        calls = self.calls

        class _Run(torch.fx.Interpreter):
            def call_function(self, target, args, kwargs):
                if target is torch.ops.fa3.attention.default:
                    calls.append((args[0].shape[2], None if args[9] is None else args[9].tolist()))
                return super().call_function(target, args, kwargs)

        def backend(gm, example_inputs):
            self.reports.extend(run_pass(gm))
            self.graphs.append(gm)
            return lambda *args: _Run(gm).run(*args)

        torch._dynamo.reset()
        self.fn = torch.compile(fn, backend=backend, dynamic=kw.get("dynamic"), fullgraph=kw.get("fullgraph", True))


def lengths_passed(fn, args: list) -> list:
    c = Recorded(fn)
    with torch.no_grad():
        c(*[a.detach() for a in args])
    assert c.rewritten and not c.missed, c.reports
    return [kl for _, kl in c.calls]


# A float mask keeps every key of a batch row where some query has no admissible key (eager weighs
# that row's finfo.min keys uniformly over the whole cache); a bool mask's empty row stays empty.
SPELLINGS = {"additive": (additive, [300, 500, 1001, NK]), "where_min": (where_min, LIMITS),
             "fill_neginf": (fill_neginf, LIMITS), "sdpa": (sdpa, LIMITS)}


@pytest.mark.parametrize("spelling", SPELLINGS)
def test_decode_data_mask_gets_the_last_admissible_key(spelling):
    fn, limits = SPELLINGS[spelling]
    mask = keep_mask()
    if spelling == "additive":
        mask = as_additive(mask)
    args = qkv(grad=spelling != "fill_neginf") + [mask]
    # -inf fills: eager's empty row is NaN and so is its gradient into every V row, which the rewrite
    # (limit or not) does not reproduce: outputs only there
    res = check(fn, args, rewritten=1, grad=spelling != "fill_neginf")
    assert "bias" in res.reports[0].mask or "bool-mask" in res.reports[0].mask, res.reports[0].mask
    assert lengths_passed(fn, args) == [limits]


def test_explain_names_the_key_limit():
    import fa_compile

    args = qkv(grad=False) + [as_additive(keep_mask())]
    torch._dynamo.reset()
    report = fa_compile.explain(additive, *args)
    assert "with key limit read from the mask at run time" in report.table(), report.table()
    torch._dynamo.reset()
    short = qkv(nq=32, grad=False) + [as_additive(keep_mask(nq=32))]  # a prefill: no limit
    assert "key limit" not in fa_compile.explain(additive, *short).table()


@pytest.mark.parametrize("spelling", ["additive", "where_min"])
def test_queries_of_a_step_share_the_limit_and_an_empty_query_row_keeps_eager(spelling):
    # Four query tokens (a speculative step); in batch row 0 the first token admits no key at all.
    fn = additive if spelling == "additive" else where_min
    mask = keep_mask(nq=4)
    mask[0, :, 1:, 700] = True  # the later tokens of row 0 see key 700 too: its limit is 701
    mask[0, :, 0] = False
    if spelling == "additive":
        mask = as_additive(mask)
    args = qkv(nq=4) + [mask]
    check(fn, args, rewritten=1)
    want = [NK, 500, 1001, NK] if spelling == "additive" else [701, 500, 1001, 0]
    assert lengths_passed(fn, args) == [want]


def test_fp16_additive_mask_with_fp16_min():
    # (no empty row: eager's fp16 s + finfo.min rounds to a uniform row, the op adds in fp32, a known limit)
    keep = keep_mask()
    keep[3, ..., 5] = True
    args = qkv(dtype=torch.float16) + [as_additive(keep, torch.float16)]
    check(additive, args, dtype=torch.float16, rewritten=1)
    assert lengths_passed(additive, args) == [[300, 500, 1001, 6]]


def test_nan_in_the_mask_is_admissible():
    mask = as_additive(keep_mask())
    mask[0, ..., 2000] = float("nan")  # eager's row 0 is NaN: that key must stay
    args = qkv() + [mask]
    check(additive, args, rewritten=1)
    assert lengths_passed(additive, args) == [[2001, 500, 1001, NK]]


def test_given_key_lengths_are_combined_by_minimum():
    def fn(q, k, v, lens, mask):
        pad = torch.arange(k.shape[-2])[None, None, None, :] < lens[:, None, None, None]
        return (_scores(q, k).masked_fill(~pad, float("-inf")) + mask).softmax(-1) @ v

    lens = torch.tensor([200, 1500, 5, NK])
    mask = as_additive(keep_mask())
    mask[3, ..., 7] = 0.0  # row 3 admits key 7 only
    args = qkv() + [lens, mask]
    check(fn, args, rewritten=1)
    assert lengths_passed(fn, args) == [[200, 500, 5, 8]]


def test_prefill_and_short_cache_sites_get_no_limit():
    n = key_limit.MAX_QUERIES + 1
    mask = as_additive(torch.ones(B, 1, n, NK, dtype=torch.bool).tril(NK - n))
    assert lengths_passed(additive, qkv(nq=n) + [mask]) == [None]
    short = key_limit.MIN_KEYS
    assert lengths_passed(additive, qkv(nk=short) + [as_additive(keep_mask(nk=short))]) == [None]


def test_pinned_graph_decode_additive_mask():
    c = Compiled(additive)
    c(*qkv(grad=False), as_additive(keep_mask()))
    expecttest.assert_expected_inline(c.graphs[-1].code.strip(), """\
def forward(self, L_k_ : torch.Tensor, L_q_ : torch.Tensor, L_mask_ : torch.Tensor, L_v_ : torch.Tensor):
    l_k_ = L_k_
    l_q_ = L_q_
    l_mask_ = L_mask_
    l_v_ = L_v_
    getitem = l_mask_[(slice(None, None, None), 0, 0)]
    key_limit_default = torch.ops.fa3.key_limit.default(getitem, -1e+30);  getitem = None
    attention_default = torch.ops.fa3.attention.default(l_q_, l_k_, l_v_, 0.35355339059327373, False, 0, -1, -1, l_mask_, key_limit_default, 0.0, 0.0, None, None);  l_q_ = l_k_ = l_v_ = l_mask_ = key_limit_default = None
    getitem_1 = attention_default[0]
    getitem_2 = attention_default[1];  attention_default = None
    isneginf = torch.isneginf(getitem_2);  getitem_2 = None
    unsqueeze = torch.unsqueeze(isneginf, -1);  isneginf = None
    full_like = torch.full_like(getitem_1, nan)
    where = torch.where(unsqueeze, full_like, getitem_1);  unsqueeze = full_like = getitem_1 = None
    return (where,)""")


# ----------------------------------------------------------------------------- Hugging Face generate()

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_generate_with_a_static_cache_longer_than_needed(impl):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
                                   num_hidden_layers=2, vocab_size=97, max_position_embeddings=NK, bos_token_id=1,
                                   eos_token_id=2, pad_token_id=0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=impl).eval()
    ids = torch.randint(3, 97, (2, 7), generator=torch.Generator().manual_seed(1))
    am = torch.ones_like(ids)
    am[0, :2] = 0  # left padding

    def greedy():
        cache = transformers.StaticCache(config=model.config, max_cache_len=NK)
        return model.generate(ids, attention_mask=am, past_key_values=cache, max_new_tokens=4, min_new_tokens=4,
                              do_sample=False)

    ref = greedy()
    c = Recorded(model.forward, fullgraph=False, dynamic=False)
    model.forward = c
    out = greedy()
    assert torch.equal(out, ref)
    assert c.rewritten and not c.missed, c.reports
    decode = [n for gm in c.graphs for n in gm.graph.nodes if n.target is torch.ops.fa3.attention.default
              and example_value(n.args[0]).shape[2] == 1]
    assert decode and all(n.args[9] is not None for n in decode)
    # the decode steps read up to the last written slot: prompt 7 + the tokens so far
    steps = [kl for nq, kl in c.calls if nq == 1]
    assert steps == [[n, n] for n in (8, 9, 10) for _layer in range(2)], c.calls


def test_key_limit_starts_where_the_decode_step_math_ends():
    # shorter caches are lowered on CUDA to the decode-step math over every key: a limit would not pay there
    from fa_compile.lowering import decomposed

    assert key_limit.MIN_KEYS == decomposed.DECODE_MAX_KEYS


def test_dispatch_order_puts_the_decode_kernel_ahead_of_cudnn_for_limited_decode():
    # (the order only: which candidates then refuse depends on the machine)
    from fa_compile import dispatch

    def order(nq: int, nk: int, lens: bool, bias: bool) -> list:
        q, k = torch.empty(2, 8, nq, 64, device="meta"), torch.empty(2, 2, nk, 64, device="meta")
        args = dispatch.AttentionArgs(q, k, k, 0.125, kv_lens=torch.empty(2, dtype=torch.int32) if lens else None,
                                      bias=torch.empty(2, 1, nq, nk, device="meta") if bias else None)
        return [c.name for c in dispatch.ordered(args)]

    names = order(1, NK, True, True)
    if "decode" not in names:
        pytest.skip("no decode candidate (triton not installed)")
    assert names.index("decode") < names.index("cudnn")
    for case in ((32, NK, True, True), (1, key_limit.MIN_KEYS, True, True), (1, NK, False, True), (1, NK, True, False)):
        names = order(*case)
        assert names.index("decode") > names.index("cudnn"), case


def test_layers_sharing_a_mask_share_one_key_limit():
    # each layer of a decode step slices the same mask: one limit per step, not one per layer; a different
    # mask, or another view of it, keeps its own; results equal eager's
    from torch.fx.experimental.proxy_tensor import make_fx

    from fa_compile.key_limit_op import key_limit_math
    from fa_compile.lowering import key_limit as key_limit_lowering
    from fa_compile.lowering import share

    t = key_limit.absorb_threshold(torch.float32)
    bias = torch.zeros(B, 1, 1, NK).masked_fill(~keep_mask(), torch.finfo(torch.float32).min)
    other = bias.flip(-1)

    def step(m, m2):
        a = torch.ops.fa3.key_limit(m[:, 0, 0], t)
        b = torch.ops.fa3.key_limit(m[:, :, :, :NK][:, 0, 0], t) * 2  # the same value through another view
        c = torch.ops.fa3.key_limit(m2[:, 0, 0], t) * 3  # another mask
        d = torch.ops.fa3.key_limit(m[:, 0, 0], t / 2) * 5  # another threshold
        e = torch.ops.fa3.key_limit(m[1:, 0, 0], t) * 7  # another view
        return a + b + c + d + torch.nn.functional.pad(e, (1, 0))

    g = make_fx(step)(bias, other)
    before = [n for n in g.graph.nodes if key_limit_lowering.is_key_limit(n)]
    assert len(before) == 5
    assert share.share(g.graph) == 1
    g.graph.lint()
    g.recompile()
    assert len([n for n in g.graph.nodes if key_limit_lowering.is_key_limit(n)]) == 4
    limits = [key_limit_math(bias[:, 0, 0], t), key_limit_math(other[:, 0, 0], t),
              key_limit_math(bias[:, 0, 0], t / 2), key_limit_math(bias[1:, 0, 0], t)]
    want = limits[0] * 3 + limits[1] * 3 + limits[2] * 5 + torch.nn.functional.pad(limits[3] * 7, (1, 0))
    assert torch.equal(g(bias, other), want)
    assert torch.equal(g(bias, other), step(bias, other))


def test_a_two_layer_decode_step_computes_its_limit_once(monkeypatch):
    from fa_compile.lowering import key_limit as key_limit_lowering

    lowered = []
    real = key_limit_lowering.lower
    monkeypatch.setattr(key_limit_lowering, "lower", lambda g, n: lowered.append(n.name) or real(g, n))
    bias = torch.zeros(B, 1, 1, NK).masked_fill(~keep_mask(), torch.finfo(torch.float32).min)
    q, k, v = qkv(grad=False)
    k2, v2 = rand(B, H, NK, D, seed=4), rand(B, H, NK, D, seed=5)

    def attend(q, k, v, m):
        w = q @ k.transpose(2, 3) / math.sqrt(D) + m[:, :, :, : k.shape[-2]]
        return F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype) @ v

    def step(q, k, v, k2, v2, m):
        return attend(attend(q, k, v, m), k2, v2, m)

    import torch._inductor.config as inductor_config

    torch._dynamo.reset()
    with torch.no_grad(), inductor_config.patch(fx_graph_cache=False):  # a cache hit lowers nothing
        got = torch.compile(step, backend="fa3", fullgraph=True)(q, k, v, k2, v2, bias)
        want = step(q.double(), k.double(), v.double(), k2.double(), v2.double(), bias.double())
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)
    assert lowered == ["key_limit"], lowered
