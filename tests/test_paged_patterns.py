"""Paged KV caches in the graph: K/V gathered from a pool of pages through a block table and fed to
attention become one fa3.paged_attention call reading the pool in place (patterns/paged.py).

Every spelling of the gather (advanced indexing, index_select, torch.gather), both pool layouts,
page sizes 1 / 16 / 256, int32 / int64 tables (shuffled, pages shared between sequences, unused
entries -1 or negative aliases of blocks), lengths 1, not multiples of the page and 0, masks by
lengths / causality / per-sequence positions of one new token / none, dynamic shapes: the compiled
graph holds the paged op and no gather of the pool, outputs and gradients (q and both pools) equal
eager's. A gathered copy that is also read elsewhere, a pool written after the gather, a view that
is not the pages' key order, or a mask the paged op cannot express keeps the gather and the
ordinary fa3.attention rewrite, still equal to eager.
"""
from __future__ import annotations

import expecttest
import pytest
import torch
import torch.nn.functional as F

import fa_compile
from fa_compile import ops, paged  # noqa: F401  (register torch.ops.fa3.attention and paged_attention)
from conftest import Compiled
from eager_diff import check
from fused_helpers import graph_summary
from test_paged_attention import make_cache


def _paged_op():
    return torch.ops.fa3.paged_attention.default


def gather(pool: torch.Tensor, table: torch.Tensor, spelling: str, layout: str) -> torch.Tensor:
    """The pages of every sequence as [B, Hkv, M * page, D], spelled as serving code does."""
    b, m = table.shape
    if spelling == "index":
        g = pool[table]  # [B, M, *pool.shape[1:]]
    elif spelling == "index_select":
        g = pool.index_select(0, table.flatten()).view(b, m, *pool.shape[1:])
    else:
        idx = table.flatten().long().view(-1, 1, 1, 1).expand(-1, *pool.shape[1:])
        g = torch.gather(pool, 0, idx).view(b, m, *pool.shape[1:])
    if layout == "bshd":  # (blocks, page, Hkv, D)
        return g.reshape(b, m * pool.shape[1], pool.shape[2], pool.shape[3]).transpose(1, 2)
    return g.permute(0, 2, 1, 3, 4).reshape(b, pool.shape[1], m * pool.shape[2], pool.shape[3])


def attend(q, k, v, keep=None, form="matmul", fill=float("-inf")):
    """q [B, Hq, Nq, D] against k/v [B, Hkv, L, D] (repeated for GQA), keep a bool mask or None."""
    rep = q.shape[1] // k.shape[1]
    if form == "sdpa":
        return F.scaled_dot_product_attention(q, k, v, attn_mask=keep, enable_gqa=True)
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    if keep is not None:
        s = s.masked_fill(~keep, fill)
    return s.softmax(-1) @ v


def decode(spelling: str, layout: str, mask: str, form: str = "matmul"):
    def fn(q, kc, vc, table, lens):
        k, v = gather(kc, table, spelling, layout), gather(vc, table, spelling, layout)
        L, nq = k.shape[2], q.shape[2]
        pos = torch.arange(L, device=q.device)
        if mask == "lens":  # key padding: the valid length of each sequence
            keep = (pos[None, :] < lens[:, None])[:, None, None, :]
        elif mask == "causal":  # every page full: bottom-right causality of the new tokens
            keep = pos[None, :] <= torch.arange(nq, device=q.device)[:, None] + (L - nq)
        else:
            keep = None
        return attend(q, k, v, keep, form)
    return fn


def inputs(*, lens, nq=1, hq=4, hkv=2, d=16, page=16, layout="bshd", table_dtype=torch.int32, share_prefix=0,
           dtype=torch.float32, grad=False, fill_unused=False, seed=0):
    """q [B, Hq, Nq, D], the pools, the table (unused entries -1, or a valid block with fill_unused:
    index_select and gather reject -1 where advanced indexing wraps it), the lengths."""
    c = make_cache(lens=lens, nq=nq, hq=hq, hkv=hkv, d=d, page=page, layout=layout, table_dtype=table_dtype,
                   share_prefix=share_prefix, dtype=dtype, seed=seed)
    table = c.table.clamp(min=0) if fill_unused else c.table
    q = c.q.transpose(1, 2).contiguous()
    return [t.requires_grad_(grad) for t in (q, c.k, c.v)] + [table, c.seqlens]


def paged_sites(res) -> list:
    return [r for r in res.reports if r.rewritten and getattr(r.call, "target", None) is _paged_op()]


def assert_paged(res) -> None:
    """Every site reads the pool in place: the paged op, and no gather of a pool left in its graph."""
    sites = paged_sites(res)
    assert sites and len(sites) == len(res.reports), [r.cache or r.reason for r in res.reports]
    for r in sites:
        for n in r.call.graph.nodes:
            name = n.target if n.op == "call_method" else getattr(n.target, "__name__", "")
            assert name not in ("index_select", "gather"), n.format_node()
            assert not (name == "getitem" and isinstance(n.args[1], torch.fx.Node)), n.format_node()


# ------------------------------------------------------------------------------------------ rewritten
@pytest.mark.parametrize("spelling", ["index", "index_select", "gather"])
@pytest.mark.parametrize("layout", ["bshd", "bhsd"])
def test_spellings_and_layouts_read_the_pool_in_place(spelling, layout):
    args = inputs(lens=[1, 37, 2, 16], layout=layout, fill_unused=spelling != "index", grad=True)
    assert_paged(check(decode(spelling, layout, "lens"), args))


@pytest.mark.parametrize("form", ["matmul", "sdpa"])
def test_empty_sequence(form):
    # eager's row is NaN (-inf fills) or 0 (SDPA); the paged op's lse is -inf there, which the fix-up reads.
    # Gradients with SDPA only: eager's NaN row sends NaN into every gathered V, the rewrite does not.
    args = inputs(lens=[0, 21, 0], grad=form == "sdpa")
    res = check(decode("index", "bshd", "lens", form), args)
    assert_paged(res)
    assert res.ref[0].isnan().all() == (form == "matmul")


@pytest.mark.parametrize("page,table_dtype", [(1, torch.int64), (16, torch.int32), (256, torch.int64)])
def test_page_sizes_and_table_dtypes(page, table_dtype):
    args = inputs(lens=[1, 5, 300 if page == 256 else 19], page=page, table_dtype=table_dtype, hq=2, hkv=1, d=8)
    assert_paged(check(decode("index", "bshd", "lens"), args))


@pytest.mark.parametrize("form", ["matmul", "sdpa"])
def test_shared_prefix_pages_and_gradients_of_both_pools(form):
    args = inputs(lens=[40, 35, 48], share_prefix=2, nq=2, grad=True, layout="bhsd", fill_unused=True)
    assert_paged(check(decode("index_select", "bhsd", "lens", form), args))


@pytest.mark.parametrize("form", ["matmul", "sdpa"])
def test_causal_new_tokens_over_full_pages(form):
    # every page full: the mask is bottom-right causality over the gathered length
    args = inputs(lens=[32, 32], nq=4, page=8, grad=True)
    args[3] = args[3].clamp(min=0)
    res = check(decode("index", "bshd", "causal", form), args)
    assert_paged(res)
    assert paged_sites(res)[0].call.kwargs["causal"] is True


def test_no_mask_attends_every_gathered_key():
    res = check(decode("gather", "bshd", "none"), inputs(lens=[48, 48], page=16, fill_unused=True, grad=True))
    assert_paged(res)


def test_an_empty_sequence_in_training_still_reads_the_pool_in_place():
    """A sequence of length 0 under a -inf fill: eager's row is NaN and so is the gradient of every value of its pages
    (the NaN row times dO). The site keeps emit's NaN-gradient term until the paged rewrite, which drops it (the README's
    known difference): the pool is read in place, the output and q's and the K pool's gradients are eager's, and the V
    pool's gradient is eager's wherever eager's is finite, finite where eager's is NaN."""
    args = inputs(lens=[0, 35, 48], grad=True, layout="bshd")
    fn = decode("index", "bshd", "lens", "matmul")
    ref_args = [a.detach().clone().requires_grad_(a.requires_grad) for a in args]
    got_args = [a.detach().clone().requires_grad_(a.requires_grad) for a in args]
    c = Compiled(fn, inner="aot_eager")
    out, ref = c(*got_args), fn(*ref_args)
    assert paged_sites(type("R", (), {"reports": c.reports})()), [r.cache or r.reason for r in c.reports]
    assert ref[0].isnan().all() and not ref[1:].isnan().any()
    torch.testing.assert_close(out, ref, equal_nan=True)
    g = torch.randn(ref.shape, generator=torch.Generator().manual_seed(3))
    ref.backward(g)
    out.backward(g)
    torch.testing.assert_close(got_args[0].grad, ref_args[0].grad)  # q
    torch.testing.assert_close(got_args[1].grad, ref_args[1].grad)  # the K pool
    dv, want = got_args[2].grad, ref_args[2].grad
    assert want.isnan().any() and not dv.isnan().any()
    torch.testing.assert_close(dv[~want.isnan()], want[~want.isnan()])


def test_fp16_and_gqa():
    args = inputs(lens=[3, 70, 0], hq=8, hkv=2, dtype=torch.float16, nq=3, layout="bhsd")
    assert_paged(check(decode("index", "bhsd", "lens", "sdpa"), args, dtype=torch.float16))


def test_sliced_to_the_valid_length():
    def fn(q, kc, vc, table, lens):
        n = 40
        k, v = gather(kc, table, "index", "bshd")[:, :, :n], gather(vc, table, "index", "bshd")[:, :, :n]
        keep = (torch.arange(n)[None, :] < lens[:, None])[:, None, None, :]
        return attend(q, k, v, keep, "sdpa")

    assert_paged(check(fn, inputs(lens=[40, 7, 33])))


def test_rewritten_graph_pinned():
    q, kc, vc, table, lens = inputs(lens=[5, 20], page=8)
    c = Compiled(decode("index", "bshd", "lens", "sdpa"))
    c(q, kc, vc, table, lens)
    expecttest.assert_expected_inline(graph_summary(c.graphs[0]), """\
getitem(%, (slice(None, None, None), None))
reshape(%, (-1,))
clamp(%, 0, 32)
lt(%, 0)
add(%, 7)
where(%, %, %)
transpose(%, 1, 2)
fa3.paged_attention(%, %, %, %, %, None, scale=0.25, causal=False, layout='bshd', force_kernel=None)
getitem(%, 0)
transpose(%, 1, 2)""")


def test_explain_names_the_paged_site():
    q, kc, vc, table, lens = inputs(lens=[5, 20], page=8, layout="bhsd")
    torch._dynamo.reset()  # shapes seen by earlier tests would make these dynamic
    rep = fa_compile.explain(decode("index", "bhsd", "lens"), q, kc, vc, table, lens)
    (site,) = rep.sites
    assert site.rewritten and "paged cache" in site.form, site
    assert site.cache.startswith("paged: pool (blocks, Hkv, page, D) page 8, table int32 [2, 4]"), site.cache
    assert "reference" in str(rep) and "paged: pool" in str(rep)


def test_backend_fa3_with_inductor_and_training():
    args = inputs(lens=[9, 31], page=16, layout="bhsd", grad=True)
    assert_paged(check(decode("index", "bhsd", "lens", "sdpa"), args, inner="inductor"))


# -------------------------------------------------------------------------------------------- kept
def test_gathered_copy_also_returned_is_kept():
    def fn(q, kc, vc, table, lens):
        k, v = gather(kc, table, "index", "bshd"), gather(vc, table, "index", "bshd")
        keep = (torch.arange(k.shape[2])[None, :] < lens[:, None])[:, None, None, :]
        return attend(q, k, v, keep), k

    res = check(fn, inputs(lens=[3, 30], grad=True))
    (site,) = res.reports
    assert site.rewritten and site.call.target is torch.ops.fa3.attention.default
    assert "gathered K/V kept: the gathered copy" in site.cache, site.cache


def test_mask_the_paged_op_cannot_express_is_kept():
    # a sliding window over the gathered keys: fa3.attention takes it, the paged op has none
    def fn(q, kc, vc, table, lens):
        k, v = gather(kc, table, "index", "bshd"), gather(vc, table, "index", "bshd")
        pos = torch.arange(k.shape[2])
        keep = (pos[None, :] <= pos[-1]) & (pos[None, :] > pos[-1] - 8)
        return attend(q, k, v, keep)

    args = inputs(lens=[32, 32], nq=1)
    args[3] = args[3].clamp(min=0)
    res = check(fn, args)
    (site,) = res.reports
    assert site.rewritten and site.call.target is torch.ops.fa3.attention.default, site
    assert site.cache.startswith("gathered K/V kept"), site.cache


def test_pool_written_between_gather_and_attention_is_kept():
    def fn(q, kc, vc, table, lens):
        k, v = gather(kc, table, "index", "bshd"), gather(vc, table, "index", "bshd")
        kc.mul_(2)  # the copy holds the old values, the pool the new ones
        keep = (torch.arange(k.shape[2])[None, :] < lens[:, None])[:, None, None, :]
        return attend(q, k, v, keep)

    res = check(fn, inputs(lens=[3, 30]), grad=False)
    (site,) = res.reports
    assert site.rewritten and site.call.target is torch.ops.fa3.attention.default, site
    assert "may write into the pool or the table" in site.cache, site.cache


def _table_source_written_after_its_cast(table):
    t = table.long()  # a copy of the int32 table, which the gathers read
    table[:, 0] = table[:, 1]
    return t


def _table_copy_written_before_the_gather(table):
    t = table.long()
    t[:, 0] = t[:, 1]
    return t


def _table_copied_then_source_zeroed(table):
    t = table.to(torch.int64, copy=True)
    table.zero_()
    return t


@pytest.mark.parametrize("spelling", ["index", "index_select"])
@pytest.mark.parametrize("edit", [_table_source_written_after_its_cast, _table_copy_written_before_the_gather,
                                  _table_copied_then_source_zeroed], ids=lambda f: f.__name__.strip("_"))
def test_a_table_cast_is_a_copy_the_writes_around_it_keep_the_gather(edit, spelling):
    # The paged op would read the table itself at the attention, while eager's gather read the cast's copy: a write
    # into either, from the cast on, keeps the gathered K/V.
    def fn(q, kc, vc, table, lens):
        t = edit(table)
        k, v = gather(kc, t, spelling, "bshd"), gather(vc, t, spelling, "bshd")
        keep = (torch.arange(k.shape[2])[None, :] < lens[:, None])[:, None, None, :]
        return attend(q, k, v, keep)

    args = inputs(lens=[20, 30], fill_unused=True)
    if edit is _table_copied_then_source_zeroed:
        args[3] = args[3].long()
    res = check(fn, args, grad=False)
    (site,) = res.reports
    assert site.rewritten and site.call.target is torch.ops.fa3.attention.default, site
    assert "may write into" in site.cache, site.cache


@pytest.mark.parametrize("mask", ["lens", "causal"])
def test_dynamic_shapes(mask):
    # a serving loop: the pools keep their size, the batch and the table's width change from call to
    # call (automatic dynamic shapes): the lengths and the table's wrap come from sizes at run time
    fn = decode("index", "bshd", mask, "sdpa")
    c = Compiled(fn, dynamic=None)
    for i, lens in enumerate(([3, 40], [17, 1, 64], [5, 9, 30, 12])):
        nq = 1 if mask == "lens" else 2
        if mask == "causal":
            lens = [max(lens)] * len(lens)
        q, kc, vc, table, lens = inputs(lens=lens, nq=nq, page=8, seed=i)
        kc, vc = (torch.cat([t, torch.randn(40 - t.shape[0], *t.shape[1:])]) for t in (kc, vc))
        if mask == "causal":
            table = table.clamp(min=0)
        torch.testing.assert_close(c(q, kc, vc, table, lens), fn(q, kc, vc, table, lens), atol=2e-5, rtol=2e-5)
    assert len(c.reports) == 2 and all(r.call.target is _paged_op() for r in c.reports), [r.cache for r in c.reports]
    assert any(not isinstance(r.k_shape[2], int) for r in c.reports)  # the recompile's length is symbolic


def test_negative_table_entries_wrap_as_in_eager():
    # pool[table] reads block blocks + e for a negative entry e: the op gets the table wrapped the same way
    q, kc, vc, table, lens = inputs(lens=[20, 33], page=8)
    used = table[:, :3].clone()
    table[:, :3] = torch.where(torch.arange(3) % 2 == 0, used - kc.shape[0], used)
    assert (table[:, :3] < 0).any()
    assert_paged(check(decode("index", "bshd", "lens"), [q, kc, vc, table, lens]))


def test_finite_fill_reading_every_gathered_key_is_kept():
    # finfo.min fills: eager's fully masked row is the mean of V over every gathered key, which the
    # rewrite computes from the gathered V: a second reader of the copy, so the gather stays
    def fn(q, kc, vc, table, lens):
        k, v = gather(kc, table, "index", "bshd"), gather(vc, table, "index", "bshd")
        keep = (torch.arange(k.shape[2])[None, :] < lens[:, None])[:, None, None, :]
        return attend(q, k, v, keep, fill=torch.finfo(q.dtype).min)

    res = check(fn, inputs(lens=[0, 30]))
    (site,) = res.reports
    assert site.rewritten and site.call.target is torch.ops.fa3.attention.default, site
    assert "is also read by" in site.cache, site.cache


@pytest.mark.parametrize("form", ["matmul", "sdpa"])
def test_one_new_token_at_per_sequence_positions(form):
    # the new token of sequence b sits at lens[b] - 1 (positions read at run time): keys j <= that
    def fn(q, kc, vc, table, lens):
        k, v = gather(kc, table, "index", "bhsd"), gather(vc, table, "index", "bhsd")
        qpos = lens[:, None] - 1 + torch.arange(q.shape[2])[None, :]
        keep = torch.arange(k.shape[2])[None, None, :] <= qpos[:, :, None]
        return attend(q, k, v, keep[:, None], form)

    res = check(fn, inputs(lens=[1, 30, 17, 64], layout="bhsd", grad=True))
    assert_paged(res)


def test_several_new_tokens_at_per_sequence_positions_are_kept():
    def fn(q, kc, vc, table, lens):
        k, v = gather(kc, table, "index", "bshd"), gather(vc, table, "index", "bshd")
        qpos = lens[:, None] - q.shape[2] + torch.arange(q.shape[2])[None, :]
        keep = torch.arange(k.shape[2])[None, None, :] <= qpos[:, :, None]
        return attend(q, k, v, keep[:, None], "sdpa")

    res = check(fn, inputs(lens=[5, 30, 17], nq=3, page=8))
    (site,) = res.reports
    assert site.rewritten and site.call.target is torch.ops.fa3.attention.default, site
    assert site.cache.startswith("gathered K/V kept"), site.cache


def _rewrite_direct_call(fn, *args):
    """fn's Dynamo graph (fn calls fa3.attention on gathered pages itself), its one call turned paged."""
    from fa_compile.patterns.paged import rewrite_paged_caches
    from fa_compile.patterns.site import SiteReport

    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=backend, fullgraph=True)(*args)
    (gm,) = graphs
    (node,) = [n for n in gm.graph.nodes if n.target is torch.ops.fa3.attention]
    node.target = torch.ops.fa3.attention.default  # the overload the pass emits
    rep = SiteReport(form="fa3.attention", rewritten=True, call=node)
    rewrite_paged_caches(gm, [rep])
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return gm, rep


@pytest.mark.parametrize("qpos_shape", ["[1]", "[B, 1]"])
@pytest.mark.parametrize("causal", [False, True])
def test_one_token_limits_combine_exactly(qpos_shape, causal):
    # fa3.attention's q_pos, kv_lens and causal offset on one new token: the end of its key prefix,
    # with values below 0 and past the gathered length
    def fn(q, kc, vc, table, lens, qpos):
        k, v = gather(kc, table, "index", "bshd"), gather(vc, table, "index", "bshd")
        out, _ = torch.ops.fa3.attention(q, k, v, 0.25, causal, 50, -1, -1, None, lens, q_pos=qpos)
        return out

    q, kc, vc, table, lens = inputs(lens=[1, 30, 17, 64], fill_unused=True)
    lens = torch.tensor([0, 30, 70, 64])
    qpos = torch.tensor([40]) if qpos_shape == "[1]" else torch.tensor([[-2], [12], [100], [60]])
    gm, rep = _rewrite_direct_call(fn, q, kc, vc, table, lens, qpos)
    assert rep.call.target is _paged_op(), rep.cache
    torch.testing.assert_close(gm(table, kc, vc, q, lens, qpos)[0], fn(q, kc, vc, table, lens, qpos))


def test_front_door_check_keeps_the_gather():
    # a paged call no fused kernel would take (here: every one refused) keeps the gathered attention
    from fa_compile.patterns.pipeline import rewrite_attention
    from fa_compile.patterns.site import PassOptions

    reports = []

    def backend(gm, example_inputs):
        reports.extend(rewrite_attention(gm, PassOptions(paged_check=lambda node: "no kernel for it")))
        return gm.forward

    fn = decode("index", "bshd", "lens", "sdpa")
    args = inputs(lens=[3, 30])
    torch._dynamo.reset()
    out = torch.compile(fn, backend=backend, fullgraph=True)(*args)
    torch.testing.assert_close(out, fn(*args), atol=2e-5, rtol=2e-5)
    (site,) = reports
    assert site.call.target is torch.ops.fa3.attention.default and site.cache == "gathered K/V kept: no kernel for it"


def test_paged_refusal_names_every_kernel_off_the_cpu():
    from fa_compile.compiler import paged_refusal

    g = torch.fx.Graph()
    vals = (torch.empty(2, 1, 4, 16, device="meta"), torch.empty(9, 16, 2, 16, device="meta"),
            torch.empty(9, 16, 2, 16, device="meta"), torch.empty(2, dtype=torch.int32, device="meta"),
            torch.empty(2, 3, dtype=torch.int32, device="meta"))
    ins = []
    for i, v in enumerate(vals):
        ins.append(g.placeholder(f"x{i}"))
        ins[-1].meta["example_value"] = v
    node = g.call_function(_paged_op(), (*ins, None), dict(scale=0.25, causal=False, layout="bshd", force_kernel=None))
    why = paged_refusal(node)
    assert why.startswith("no fused paged kernel takes these inputs (triton: ") and "fa3: " in why, why
    cpu = [g.placeholder(f"c{i}") for i in range(5)]
    for n, v in zip(cpu, vals):
        n.meta["example_value"] = torch.empty_like(v, device="cpu")
    assert paged_refusal(g.call_function(_paged_op(), (*cpu, None), dict(scale=0.25))) is None


def test_two_layers_share_one_wrapped_table():
    def fn(q, kc, vc, table, lens):
        o = decode("index", "bshd", "lens", "sdpa")(q, kc, vc, table, lens)
        return decode("index", "bshd", "lens", "sdpa")(o, kc * 2, vc.flip(0), table, lens)

    q, kc, vc, table, lens = inputs(lens=[3, 30, 1], hq=2, hkv=2)
    c = Compiled(fn)
    torch.testing.assert_close(c(q, kc, vc, table, lens), fn(q, kc, vc, table, lens), atol=2e-5, rtol=2e-5)
    assert len(c.reports) == 2 and all(r.call.target is _paged_op() for r in c.reports), c.reports
    assert sum(1 for n in c.graphs[0].graph.nodes if n.target is torch.where) == 1


def test_view_mixing_pages_and_heads_is_kept():
    # [B, M, page, Hkv, D] reshaped straight to [B, Hkv, M * page, D]: not the pages' key order
    def fn(q, kc, vc, table, lens):
        b, m = table.shape
        k, v = (c[table].reshape(b, c.shape[2], m * c.shape[1], c.shape[3]) for c in (kc, vc))
        keep = (torch.arange(k.shape[2])[None, :] < lens[:, None])[:, None, None, :]
        return attend(q, k, v, keep, "sdpa")

    res = check(fn, inputs(lens=[3, 30], grad=True))
    (site,) = res.reports
    assert site.rewritten and site.call.target is torch.ops.fa3.attention.default, site
    assert "regroups it across pages or heads" in site.cache, site.cache


def test_serving_step_writes_the_new_token_then_reads_pages():
    # one pool for every layer, [layers, 2, blocks, page, Hkv, D]; each layer writes its new token's K/V
    # into its slot, then attends over its pages: the write precedes the gather, so the pages are read in place
    def step(x, cache, table, lens, slot_block, slot_off):
        for layer in range(cache.shape[0]):
            kc, vc = cache[layer, 0], cache[layer, 1]
            kc[slot_block, slot_off] = x.transpose(1, 2)[:, 0] * (layer + 1)
            vc[slot_block, slot_off] = x.transpose(1, 2)[:, 0] - layer
            k, v = gather(kc, table, "index", "bshd"), gather(vc, table, "index", "bshd")
            keep = (torch.arange(k.shape[2])[None, :] < lens[:, None])[:, None, None, :]
            x = attend(x, k, v, keep, "sdpa")
        return x

    q, kc, vc, table, lens = inputs(lens=[3, 30, 17], hq=2, hkv=2, fill_unused=True)
    cache = torch.stack([torch.stack([kc, vc * (i + 1)]) for i in range(2)])
    pos = lens.long() - 1
    slot_block, slot_off = table.long().gather(1, (pos // kc.shape[1])[:, None])[:, 0], pos % kc.shape[1]
    res = check(step, [q, cache, table, lens, slot_block, slot_off], grad=False)
    assert_paged(res)
    assert len(res.reports) == 2
