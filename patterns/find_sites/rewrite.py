"""One site end to end (walk back, walk forward, masks, effects, the rewrite) and the pass over every
softmax of a graph (the "rewrite" and "effects" steps of find_sites)."""
from __future__ import annotations

import math
import operator
from typing import Any

import torch
import torch.fx as fx

from .. import emit, sinks
from ..aliasing import escapes, may_be_view_of, writes, written_args, written_in_place
from ..canonicalize import exp_lse_of, exp_sum_of, kind, log_softmax_of, softmax_args, tensor_of
from ..effects import (
    GradFlow, chain_write, grad_flow, out_target, path_to, private_storage, read_path,
)
from ..emit import example_value
from ..gqa import unrepeat
from ..layout import View, eager_layout, fold, fresh_copy_kwargs, identity
from ..regions import Regions
from ..shapes import known_eq, known_one
from ..site import MaskSpec, MaskTerm, PassOptions, SiteReport
from .build import (
    _Builder, _Out, _absorb_scale, _canon_out_shape, _choose_layout, _erase_dead, _materialize, needs_contiguous,
    _padded_batch, _regroup, _same, _shape, _where,
)
from .empty_row_test import score_readers
from .probs import Probs, walk_probs, zeroed_rows
from .scores import Miss, Scores, narrows, walk_scores


def _analyze_mask(gm: fx.GraphModule, terms: list, bd: list, st: torch.Tensor, insert_before: fx.Node) -> MaskSpec:
    """masks.analyze_mask on the site's terms (given in eager's order), or Miss with its reason."""
    if not terms:
        return MaskSpec()
    try:
        from ..masks import analyze_mask
    except ImportError:
        raise Miss("masked attention: mask analysis is not available") from None
    nb = len(bd)
    res = analyze_mask(
        gm, list(reversed(terms)), batch=bd[0] if nb >= 1 else 1, q_heads=bd[-1] if nb >= 2 else 1,
        q_len=st.shape[-2], k_len=st.shape[-1], scores_dtype=st.dtype, insert_before=insert_before,
        # a mask of the scores' own rank (5-D scores: ProphetNet's n-gram stream, LongT5's blocks) is
        # flattened with their batch dims into the op's (build.bias_to_op)
        bias_rank=max(4, nb + 2),
    )
    if isinstance(res, str):
        raise Miss(res)
    return res


def _reads_values(node: fx.Node) -> bool:
    """False when `node` only views its input (its result aliases the input's memory) and writes
    nothing; True otherwise, and whenever that cannot be told."""
    if node.op in ("placeholder", "get_attr"):
        return False
    if node.op not in ("call_function", "call_method") or writes(node):
        return True
    val = example_value(node)
    if not isinstance(val, torch.Tensor) or not node.args or not isinstance(node.args[0], fx.Node):
        return True
    src = example_value(node.args[0])
    srcs = [t for t in src if isinstance(t, torch.Tensor)] if isinstance(src, (tuple, list)) else [src]
    try:
        return not any(isinstance(t, torch.Tensor) and torch._C._is_alias_of(val, t) for t in srcs)
    except Exception:
        return True


def _effects(ctx: "_Ctx", scores: Scores, probs: Probs, q: View, k: View, v: View,
             own: set) -> tuple[GradFlow, set]:
    """The site's writes and grad-mode regions (see effects.py): Miss when they cannot be kept, else
    which of the op's inputs eager's gradient does not reach, and the nodes whose memory is written in
    place while the site runs (memory allocated after its first read: the rewritten site may read none
    of them, which the rewrite checks once its glue exists)."""
    qk, pv = scores.contraction, probs.pv
    o_node = pv.node
    regions = ctx.regions
    paths = [path_to(qk.lhs.node, q.node), path_to(qk.rhs.node, k.node), path_to(pv.rhs.node, v.node)]
    if any(p is None for p in paths):
        if regions.markers:
            raise Miss("cannot tell which nodes q, k, v are read through, and the graph changes global state")
        paths = [[], [], []]
    q_path, k_path, v_path = paths
    read = set(q_path) | set(k_path) | set(v_path)
    # Eager reads the inputs' values where a node of these paths computes from them, not where a view
    # of them is taken: a write before that point (a cache filled in place, then viewed) is seen alike
    # by eager and by the op, which reads the same memory later still.
    readers = {n for n in read if _reads_values(n)} | {qk.node}
    first = min((n for n in readers if n in ctx.pos), key=ctx.pos.get, default=qk.node)
    chain = [qk.node] + list(reversed(scores.nodes)) + probs.nodes  # Q·Kᵀ .. P·V, in program order
    site_nodes = chain + q_path + k_path + v_path
    written: set = set()
    for m in ctx.mutations_between(first, o_node, own | read):
        # memory made after the site's first read (an index table built between Q·Kᵀ and P·V, as
        # Data2VecVision does) holds no value eager read before the write: harmless unless the op reads it
        after = ctx.pos.get(first)
        for dst in written_args(m) or [None]:  # (a write into an argument that is not a node: unknown memory)
            private = None if after is None else private_storage(dst, ctx.pos, after)
            if private is None:
                raise Miss("a tensor is modified in place between the scores and the P·V product")
            # written before the site first reads it (`k = k.clone(); k[..., :2] = rotated`, then Q·Kᵀ): eager
            # reads the written value, and so does the op, which runs after every node it replaces
            readers = [ctx.pos.get(n) for n in site_nodes if any(a in private for a in n.all_input_nodes)]
            if readers and all(r is not None and r > ctx.pos[m] for r in readers):
                continue
            written |= private
    why = chain_write(q_path + k_path + v_path + chain, own, keep_out=o_node)
    if why:
        raise Miss(why)
    o_out = out_target(o_node)
    if o_out is not None:
        ov, o_val = tensor_of(o_out), tensor_of(o_node)
        if ov is None or o_val is None or ov.dtype != o_val.dtype or not _same(list(ov.shape), list(o_val.shape)):
            raise Miss("the P·V product writes into an out= tensor of another shape or dtype")
        if any(tensor_of(t.node) is not None and tensor_of(t.node).requires_grad for t in (q, k, v)):
            raise Miss("the P·V product writes into out= while its inputs require grad (eager raises)")
    # no early return without grad-mode markers: a term read through `.detach()` is a cut too
    why = regions.grad_cut(q_path + k_path + v_path + chain)
    if why:
        raise Miss(why)
    entries = [(t.tensor, _entry(t.tensor, chain)) for t in scores.terms]
    entries += [(f, _entry(f, chain)) for f, _, _ in scores.factors]
    try:
        return grad_flow(regions, chain, read_path(q_path, q.node), read_path(k_path, k.node),
                         read_path(v_path, v.node), entries), written
    except ValueError as e:
        raise Miss(str(e)) from None


def _entry(t: Any, chain: list) -> fx.Node:
    """The chain node where a mask term or scale factor enters the scores."""
    if not isinstance(t, fx.Node):
        return chain[0]
    for n in chain:
        if t in n.all_input_nodes:
            return n
    raise Miss(f"cannot tell where {t.name} enters the scores")


def _grad_source_below(node: Any, depth: int = 16) -> bool:
    """Is `node` computed, along its chain of one-tensor ops, from a tensor that needs a gradient?"""
    n = node
    for _ in range(depth):
        ins = [a for a in n.all_input_nodes if tensor_of(a) is not None] if isinstance(n, fx.Node) else []
        if len(ins) != 1:
            return False
        n = ins[0]
        if tensor_of(n).requires_grad:
            return True
    return False


def _bias_cut(scores: Scores, flow: GradFlow) -> bool:
    """Whether the op's bias is detached: when eager's gradient reaches none of the mask terms (the
    mask analysis may read a term through its views down to a tensor that needs one, e.g.
    `bias.reshape(B*H, N, N)` made under no_grad read as `bias`). Miss when it reaches some terms and
    is cut before others that lead to a tensor needing one (they are one bias in the op)."""
    tensors = [t.tensor for t in scores.terms if tensor_of(t.tensor) is not None]
    live = [t for t in tensors if tensor_of(t).requires_grad and t not in flow.detach_entries]
    if not live:
        return True
    if any(t in flow.detach_entries and (tensor_of(t).requires_grad or _grad_source_below(t)) for t in tensors):
        raise Miss("mask terms that need a gradient are combined with one whose gradient is cut "
                   "(a grad-mode change or detach) before a tensor that needs one: they are one bias in the op")
    return False


def _detached(o: "_Out", node: Any) -> Any:
    """node.detach() where it carries a gradient: eager computed with it under no_grad."""
    t = tensor_of(node)
    return o.call("detach", node, method=True) if t is not None and t.requires_grad else node


class _Ctx:
    """Per-graph facts computed once: node order, the nodes that write into a tensor, global-state regions."""

    def __init__(self, gm: fx.GraphModule):
        self.regions = Regions(gm)
        self.pos: dict = {}
        self.mutations: list[fx.Node] = []
        for i, n in enumerate(gm.graph.nodes):
            self.pos[n] = i
            if writes(n):
                self.mutations.append(n)

    def mutations_between(self, a: fx.Node, b: fx.Node, own: set) -> list:
        """The writing nodes strictly between a and b, other than `own`."""
        lo, hi = self.pos.get(a, 0), self.pos.get(b, 0)
        return [m for m in self.mutations
                if lo < self.pos[m] < hi and m not in own and not getattr(m, "_erased", False)]


def _reader_first(chain: list, shadows: list) -> list:
    """`chain` (users before their inputs) with each shadow copy placed after the nodes that read it and before the
    node it copies, so that erasing in this order frees every node."""
    out = list(chain)
    for sh in shadows:
        src = sh.args[0]
        out.insert(out.index(src) if src in out else len(out), sh)
    return out


def _site(gm: fx.GraphModule, sm: fx.Node, ctx: _Ctx, options: PassOptions) -> SiteReport:
    rep = SiteReport(form="softmax", rewritten=False, where=_where(sm))
    why = emit.inside_vmap(sm)
    if why is not None:
        raise Miss(why)
    x, dim, _ = softmax_args(sm)  # a dtype= argument is a cast before the softmax: nothing to keep
    if not isinstance(x, fx.Node) or tensor_of(x) is None:
        raise Miss("softmax input is not a tensor of the graph")
    st = tensor_of(x)
    if dim is None:
        raise Miss("softmax dim is not a constant")
    if st.dim() < 2:
        raise Miss(f"softmax over a {st.dim()}-d tensor")
    if dim != st.dim() - 1:
        raise Miss(f"softmax is over dim {dim}, not the last dim ({st.dim() - 1}): the pass reads the keys on the "
                   "last axis of the scores")
    sink = sinks.peel(sm, x)
    gate = sinks.peel_gate(sm, x) if sink is None else None
    if sink is not None:
        x, st = sink.scores, tensor_of(sink.scores)
    barrier = ("a sink column is concatenated to them (the shift does not reach it)" if sink is not None else
               "the sink gate's logsumexp reads them (the shift moves it)" if gate is not None else None)
    el = exp_lse_of(sm)  # exp(x - logsumexp(x)): the logsumexp reads x as part of the softmax
    # a safe softmax's test of the rows of x for all -inf (empty_row_test.py), of a softmax spelled as one call
    plain = sink is None and gate is None and el is None and exp_sum_of(sm) is None and log_softmax_of(sm) is None
    tests = score_readers(x) if plain else ()
    also = ((gate.lse,) if gate is not None else ()) + ((el[1],) if el is not None else ()) + tests
    scores = walk_scores(x, gm, shift_barrier=barrier, also_read_by=also)
    probs = walk_probs(sm, options, gm, through=sink.drop if sink is not None else None,
                       scores_in=x if tests else None)
    row_test = probs.zeroed.row_test if probs.zeroed is not None else []
    if any(t not in row_test for t in tests):
        raise Miss(f"the scores ({x.name}) are also used outside the attention")
    has_sinks = sink is not None or gate is not None
    if gate is not None:
        if gate.mul.args[0] is not probs.pv.node and gate.mul.args[1] is not probs.pv.node:
            raise Miss("the scores' logsumexp gates another tensor than this site's P·V product")
        if len(probs.pv.node.users) != 1:
            raise Miss("the P·V product is read besides the sink gate that multiplies it")
        scores.nodes[:0] = gate.nodes
    ref = tensor_of(scores.contraction.node).dtype
    narrowed = []  # casts of the probabilities narrower than the scores: exact only as the op's own rounding of P
    for n in [sm] + [n for n in probs.nodes if kind(n) == "cast"]:
        if tensor_of(n) is not None and narrows(tensor_of(n).dtype, ref):
            if n is sm:
                raise Miss(f"the probabilities are computed in {tensor_of(n).dtype} ({n.name}), narrower than the "
                           f"{ref} of the scores: a rounding the op would not make")
            narrowed.append(n)
    if sink is not None:
        scores.nodes[:0] = sink.nodes
    qk, pv = scores.contraction, probs.pv
    rep.form = f"{qk.spelling}-softmax-{pv.spelling}"
    bd = list(st.shape[:-2])
    nb = len(bd)
    o_node = pv.node if gate is None else gate.mul
    o_val = tensor_of(o_node)
    inner_bd = list(_canon_out_shape(qk, tensor_of(qk.node))[:-2])  # where the scores are computed
    p_bd = list(tensor_of(probs.end).shape[:-2])  # where the probabilities meet V
    o_bd = list(_canon_out_shape(pv, o_val)[:-2])
    if len(o_bd) != len(p_bd) or not _same(o_bd, p_bd):
        raise Miss("the P·V contraction broadcasts the probabilities to more batch dims")
    qk_regroup, v_regroup = not _same(inner_bd, bd), not _same(p_bd, bd)
    own = set(scores.nodes) | set(probs.nodes) | set(probs.shadows) | set(row_test) | {qk.node}

    q = fold(qk.lhs)
    k = fold(qk.rhs.swap_last())
    v = fold(pv.rhs)
    scale = scores.scale
    q, scale = _absorb_scale(q, scale, tensor_of(qk.node).dtype)
    k, scale = _absorb_scale(k, scale, tensor_of(qk.node).dtype)
    if (not qk_regroup and (q.rank > nb + 2 or k.rank > nb + 2)) or (not v_regroup and v.rank > nb + 2):
        raise Miss("q/k/v have more batch dims than the scores")
    # GQA: the last batch dim is the head axis when the layout keeps it as H
    group = 1
    if nb >= 2 and k.rank >= 3 and v.rank >= 3 and not qk_regroup and not v_regroup:
        k2 = fold(unrepeat(k, k.rank - 3))
        v2 = fold(unrepeat(v, v.rank - 3))
        if k2.group == v2.group:
            k, v, group = k2, v2, k2.group
        elif k2.group == 1 and v2.group == 1:
            k, v = k2, v2
    qb, kb, vb = (_padded_batch(t.shape, nb) for t in (q, k, v))
    if qk_regroup:
        qb, kb = list(bd), list(bd)  # regrouped from the full (expanded) inner batch
    if v_regroup:
        vb = list(bd)
    layout = _choose_layout(bd, qb, kb, vb)
    if group > 1 and layout.mode != "std":
        raise Miss("repeated K/V heads in a layout where the head axis is not the last batch dim")
    # the un-repeated head axis: Hkv * group must be the scores' head count, or 1 (broadcast)
    for name, b in (("k", kb), ("v", vb)):
        for i in range(nb):
            if not (known_one(b[i]) or known_eq(b[i] * (group if i == nb - 1 else 1), bd[i])):
                raise Miss(f"{name}'s batch dim {i} ({b[i]}) does not match the scores' ({bd[i]})")
    for i in range(nb):
        if not (known_one(qb[i]) or known_eq(qb[i], bd[i])):
            raise Miss(f"q's batch dim {i} does not match the scores'")
    if not math.isfinite(scale):
        raise Miss(f"the scores' scale is not finite ({scale})")
    flow, written = _effects(ctx, scores, probs, q, k, v, own)

    # dtypes: eager's products run in their operands' (logical) dtype. An upcast of q and k is lossless for Q·Kᵀ
    # (a product of two bf16 / fp16 numbers is exact in fp32, where the kernels accumulate), so where P·V comes out
    # in the inputs' own dtype the site runs in it. Where P·V runs wider (V upcast with the probabilities kept wide)
    # the site runs wide too: rounding P and the output to the narrow dtype would lose what eager keeps.
    base = [tensor_of(t.node).dtype for t in (q, k, v)]
    logical = [t.dtype for t in (q, k, v)]
    if len(set(base)) == 1 and o_val.dtype == base[0]:
        dtype = base[0]
    elif len(set(logical)) == 1:
        dtype = logical[0]
    else:
        dtype = torch.promote_types(torch.promote_types(logical[0], logical[1]), logical[2])
    qk_dt = tensor_of(qk.node).dtype
    if qk_dt != qk.lhs.dtype or qk_dt != qk.rhs.dtype or o_val.dtype != pv.lhs.dtype or o_val.dtype != pv.rhs.dtype:
        # autocast: eager's products computed in their output dtype, whatever their operands' dtype
        if qk_dt != o_val.dtype:
            raise Miss(f"the Q·Kᵀ and P·V products compute in different dtypes ({qk_dt}, {o_val.dtype}: autocast)")
        dtype = qk_dt
    if narrows(ref, dtype):
        # eager's result is P·V in `dtype` of scores (and probabilities) rounded to `ref`: its error is ref's, which
        # the op in `dtype` would not make, and at that dtype's tolerance it is not rounding
        raise Miss(f"the scores are computed in {ref}, narrower than the {dtype} of the P·V product: eager's result "
                   f"carries a {ref} rounding the op would not make")
    # A bf16 / fp16 site computes fp32 scores and rounds P to its dtype for P·V: eager's fp32 scores of upcast q and k
    # (exact products) with P cast to the site's dtype just before P·V (GPT-2's reorder_and_upcast_attn) is that.
    for n in narrowed:
        if not (tensor_of(n).dtype == dtype == pv.lhs.dtype and dtype in (torch.bfloat16, torch.float16)
                and ref == torch.float32):
            raise Miss(f"the probabilities are cast in {tensor_of(n).dtype} ({n.name}), narrower than the {ref} of "
                       "the scores: a rounding the op would not make")
    o_out = out_target(o_node)

    graph = gm.graph
    o = _Out(graph, o_node)
    try:
        terms = scores.terms
        with graph.inserting_before(o_node):
            terms = [MaskTerm("add", o.call(operator.neg, t.tensor), dtype=t.dtype) if t.op == "sub" else t
                     for t in terms]
            terms = [MaskTerm("fill", o.call(operator.eq, t.tensor, 0), t.fill, t.dtype) if t.op == "fill_zero"
                     else t for t in terms]
            terms = [MaskTerm("add", o.call(operator.mul, t.tensor, t.fill if t.op == "add_scaled" else -t.fill),
                              dtype=t.dtype) if t.op in ("add_scaled", "sub_scaled") else t for t in terms]
            terms = [t if _same(tb, bd) else MaskTerm(t.op, _regroup(o, t.tensor, tb, bd), t.fill, t.dtype)
                     for t, tb in zip(terms, scores.term_batches)]
        spec = _analyze_mask(gm, terms, bd, st, o_node)
        bt = tensor_of(spec.bias) if spec.bias is not None else None
        if bt is not None and bt.is_floating_point() and st.dtype == torch.float64 and dtype != torch.float64:
            raise Miss(f"a float64 mask widens the {dtype} scores to float64: eager adds it and takes the softmax in "
                       "float64, the kernels in float32 (a large mask value would round the scores away)")
        if probs.zeroed is not None:
            if has_sinks:
                raise Miss("probabilities set to 0 after a softmax with attention sinks: not analysed")
            spec.empty_rows = zeroed_rows(probs.zeroed, scores, spec, gm, st, terms)
        if el is not None and spec.empty_rows not in ("impossible", "nan", "zero") and not spec.rows_admit:
            raise Miss("softmax written as exp(s - logsumexp(s)) where a finite fill may set the logsumexp (a row "
                       "with every key masked, or a fill above 0): eager's logsumexp rounds at the fill's magnitude "
                       "there, so its weights need not sum to 1 (a row of -1e9 gives each key weight 1)")
        if scores.clamped and spec.empty_rows == "nan":
            spec.empty_rows = "mean_v"  # -inf became finfo.min: a fully masked row is uniform
        clamp_tied = False
        if scores.clamped and scores.tie_halves and st.requires_grad:
            # max(s, finfo.min) after the mask: a score the mask absorbed equals the clamp, and torch.maximum's
            # backward gives each of two equal operands half the gradient. Only a row whose every score was
            # absorbed has weights there: emit's uniform-row gradient is halved, and so is the op's own
            # gradient on such rows of a float bias it adds itself.
            if spec.empty_rows == "mean_v_add":
                spec.empty_rows = "mean_v_add_tied"
            bt = tensor_of(spec.bias) if spec.bias is not None else None
            if bt is not None and bt.is_floating_point():
                structured = spec.causal or spec.window_left >= 0 or spec.window_right >= 0 or any(
                    x is not None for x in (spec.kv_lens, spec.q_pos, spec.q_seg, spec.k_seg, spec.filled))
                if structured or probs.dropout_p or has_sinks or (bt.requires_grad and not _bias_cut(scores, flow)):
                    raise Miss("scores clamped by max(s, finfo.min) over a float mask, with structure, dropout, "
                               "sinks or a mask gradient: eager's halved gradient of the scores that tie the clamp "
                               "cannot be kept there")
                clamp_tied = True
        if spec.empty_rows == "unknown":
            raise Miss("cannot keep eager's value on fully masked rows for this mask")
        if gate is not None and spec.empty_rows == "nan":
            raise Miss("a sink gate over rows that may have no admissible key: eager's NaN there times the gate stays "
                       "NaN, where the op's sink takes the row (0)")
        if has_sinks and spec.empty_rows == "fill":
            raise Miss(f"attention sinks with a finite mask fill {spec.fill}: eager's fully masked rows share "
                       "their weight between the filled keys and the sink, which the rewrite cannot keep")
        if spec.empty_rows == "fill" and probs.dropout_p and not emit.fill_keeps_dropout(
                spec.causal, spec.window_left, spec.window_right, spec.bias, spec.kv_lens, spec.q_pos, spec.q_seg,
                spec.k_seg):
            raise Miss(f"a finite fill {spec.fill} with dropout over masked keys that vary along queries (a diagonal, "
                       "window or per-query mask): eager drops the masked keys' weights too, which the rewrite keeps "
                       "for key-padding masks only")
        with graph.inserting_before(o_node):
            qn, kn, vn = _materialize(o, q, dtype), _materialize(o, k, dtype), _materialize(o, v, dtype)
            qn = _detached(o, qn) if flow.detach_q else qn
            kn = _detached(o, kn) if flow.detach_k else kn
            vn = _detached(o, vn) if flow.detach_v else vn
            # a regroup may read x for x.reshape(B*H, N, D): not where the gradient is cut at the reshape
            if qk_regroup:
                qn = _regroup(o, qn, inner_bd, bd, full=True, see_through=not flow.detach_q)
                kn = _regroup(o, kn, inner_bd, bd, full=True, see_through=not flow.detach_k)
            if v_regroup:
                vn = _regroup(o, vn, p_bd, bd, full=True, see_through=not flow.detach_v)
            while tensor_of(qn).dim() < nb + 2:
                qn = o.call(torch.unsqueeze, qn, 0)
            while tensor_of(kn).dim() < nb + 2:
                kn = o.call(torch.unsqueeze, kn, 0)
            while tensor_of(vn).dim() < nb + 2:
                vn = o.call(torch.unsqueeze, vn, 0)
            b = _Builder(o, bd, layout, [(qn, qb), (kn, kb), (vn, vb)])
            # a K/V head axis that is 1 while the other has Hkv: broadcast it (the op needs equal heads)
            if nb >= 1:
                hk, hv = tensor_of(kn).shape[nb - 1], tensor_of(vn).shape[nb - 1]
                if known_one(hk) and not known_one(hv):
                    kn = o.call("expand", kn, *[-1] * (nb - 1), hv, -1, -1, method=True)
                elif known_one(hv) and not known_one(hk):
                    vn = o.call("expand", vn, *[-1] * (nb - 1), hk, -1, -1, method=True)
            q_padded = qn
            qo, ko, vo = b.to_op(qn, False), b.to_op(kn, True), b.to_op(vn, True)
            if nb >= 1 and layout.mode in ("std", "grouped", "bh1"):
                # batch (B') must match exactly: broadcast k/v (a view) when they were broadcast
                Bq = tensor_of(qo).shape[0]
                if not known_eq(tensor_of(ko).shape[0], Bq):
                    ko = o.call("expand", ko, o.size(qo, 0), -1, -1, -1, method=True)
                if not known_eq(tensor_of(vo).shape[0], Bq):
                    vo = o.call("expand", vo, o.size(qo, 0), -1, -1, -1, method=True)
            if scores.factors and narrows(dtype, ref):
                # eager scales exact fp32 scores; the op would scale q and round it to the site's dtype (a learnable
                # temperature's gradient came out 70% off in bf16)
                raise Miss(f"the {ref} scores are scaled by a tensor at a {dtype} site: the op would round the "
                           f"scaled q to {dtype}")
            for node, how, fb in scores.factors:
                f = _detached(o, node) if node in flow.detach_entries else node
                ft = tensor_of(f)
                wide = None  # a factor wider than the site multiplies in its own dtype: its gradient sums there
                if isinstance(ft, torch.Tensor):
                    if ft.dim() > 0:
                        if not _same(fb, bd):
                            f = _regroup(o, f, fb, bd)
                        f = b.bias_to_op(f)
                    if narrows(dtype, ft.dtype):
                        wide = ft.dtype
                    elif ft.dtype != dtype:
                        f = o.call("to", f, dtype, method=True)
                if wide is not None:
                    qw = o.call(operator.mul if how == "mul" else operator.truediv, o.call("to", qo, wide, method=True), f)
                    qo = o.call("to", qw, dtype, method=True)
                else:
                    qo = o.call(operator.mul if how == "mul" else operator.truediv, qo, f)
            bias = spec.bias
            if bias is not None:
                bias = b.bias_to_op(_detached(o, bias) if _bias_cut(scores, flow) else bias)
            kv_lens = spec.kv_lens
            if kv_lens is not None:
                kl = tensor_of(kv_lens)
                if kl is None or kl.dim() != 1 or layout.mode != "std" or layout.lead != 1:
                    raise Miss("key-padding lengths do not map to the op's batch axis")
                if not known_eq(kl.shape[0], tensor_of(qo).shape[0]):
                    if not known_one(kl.shape[0]):
                        raise Miss("key-padding lengths do not map to the op's batch axis")
                    # one length for every batch row (a static cache's decode position): broadcast it
                    kv_lens = o.call("expand", kv_lens, o.size(qo, 0), method=True)
            runtime = dict(q_pos=spec.q_pos, q_seg=spec.q_seg, k_seg=spec.k_seg)
            for name, t in runtime.items():  # [N] or [B, N] run-time structure: its batch must be the op's
                tv = tensor_of(t) if t is not None else None
                if tv is not None and (layout.mode != "std" or layout.lead != 1 or (
                        tv.dim() == 2 and not known_one(tv.shape[0])
                        and not known_eq(tv.shape[0], tensor_of(qo).shape[0]))):
                    raise Miss(f"{name} does not map to the op's batch axis")
            filled = spec.filled
            if filled is not None and emit.needs_qk_grad(qo, ko):
                if probs.dropout_p > 0 or has_sinks:
                    raise Miss("a fill before an additive mask with dropout or sinks: eager's cut gradient of the "
                               "filled scores on fully masked rows cannot be kept there")
                filled = b.bias_to_op(filled)
            sink_arg = None
            if has_sinks:
                if nb != 2 or layout.mode != "std" or not (known_eq(tensor_of(qo).shape[1], bd[1])):
                    raise Miss("attention sinks: the scores' head axis does not map to the op's")
                sink_arg = sinks.head_logits_for_op(graph, sink) if sink is not None else \
                    sinks.gate_logits_for_op(graph, gate)
                o.made.append(sink_arg)
            out, call = emit.emit_attention(
                graph, qo, ko, vo, scale=scale, causal=spec.causal, diag_offset=spec.diag_offset,
                window_left=spec.window_left, window_right=spec.window_right, bias=bias, kv_lens=kv_lens,
                softcap=scores.softcap, dropout_p=probs.dropout_p, kernel=options.kernel, empty_rows=spec.empty_rows,
                fill=spec.fill, sinks=sink_arg, filled=filled, clamp_tied=clamp_tied, nan_grads=spec.nan_grads,
                **runtime,
            )
            o.made.append(out)
            res = b.out_from_op(out, q_padded)
            if v_regroup:
                res = _regroup(o, res, bd, p_bd, full=True)
            if pv.out_perm != identity(len(pv.out_perm)):
                res = o.call(torch.permute, res, pv.out_perm)
            if tensor_of(res).dtype != o_val.dtype:
                res = o.call("to", res, o_val.dtype, method=True)
            if o_out is None and written_in_place(o_node):
                # `o += x` must not write into the op's saved output; and eager's strides, so that `.contiguous()`,
                # `.reshape()`, `.flatten()` give a view or a copy as in eager and a write through them lands there too
                layout = eager_layout(o_val, tensor_of(res))
                if layout is None:
                    raise Miss("the output is written in place and eager's layout of it is neither contiguous nor the "
                               "op's: a view of it may alias where eager's is a copy")
                res = o.call("clone", res, method=True, **layout)
            elif o_out is None and o_val.requires_grad and escapes(o_node) and may_be_view_of(res, call):
                # Nor the caller's `o += x` after the call, where the graph returns o or a view of it (eager's
                # products save P and V, not o). Inductor drops a clone that keeps the strides as a no-op in the
                # joint graph (where the saved output is not yet an output it would alias): a contiguous one, or
                # `* 1.0` (exact for every value) where the result is contiguous already.
                copy = fresh_copy_kwargs(tensor_of(res))
                res = o.call("clone", res, method=True, **copy) if copy is not None else \
                    o.call("mul", res, 1.0, method=True)
            if needs_contiguous(o_node, tensor_of(res)):
                res = o.call("contiguous", res, method=True)
            if o_out is not None:
                res = o.call("copy_", o_out, res, method=True)  # `out=`: the caller's tensor gets the result

        qv, kv_, vv = tensor_of(qo), tensor_of(ko), tensor_of(vo)
        rep.q_shape, rep.k_shape, rep.v_shape = _shape(qv), _shape(kv_), _shape(vv)
        rep.dtype = str(dtype)
        rep.mask = spec.kind if scores.terms else "none"
        hq, hkv = qv.shape[1], kv_.shape[1]
        if not known_eq(hq, hkv):
            how = "repeat removed" if group > 1 else "broadcast"
            rep.gqa = f"Hq={hq}/Hkv={hkv} ({how})"
        rep.softcap = scores.softcap
        rep.dropout_p = probs.dropout_p
        rep.scale = scale if not scores.factors else f"{scale:g} * tensor factors"
        if written:
            n = o.start.next
            while n is not o_node:
                if any(a in written for a in n.all_input_nodes):
                    raise Miss("the rewritten attention would read a tensor that is modified in place between "
                               "the scores and the P·V product")
                n = n.next
    except Miss:
        o.rollback()
        raise
    except Exception as e:  # a fake run rejected the glue, or an unforeseen failure: leave the site alone
        o.rollback()
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise Miss(f"rewrite failed: {type(e).__name__}: {msg}") from e
    # the commit: nothing below raises (_erase_dead skips what it cannot erase)
    o_node.replace_all_uses_with(res)
    _erase_dead(graph, [o_node] + _reader_first(list(reversed(probs.nodes)), probs.shadows) + row_test + scores.nodes
                + [qk.node])
    rep.rewritten = True
    rep.call = call
    return rep


def rewrite_softmax_sites(gm: fx.GraphModule, options: PassOptions) -> list[SiteReport]:
    softmaxes = [n for n in gm.graph.nodes if kind(n) == "softmax"]
    if not softmaxes:
        return []
    ctx = _Ctx(gm)
    reports = []
    for sm in softmaxes:
        try:
            reports.append(_site(gm, sm, ctx, options))
        except Exception as e:  # Miss, or a spelling this code did not foresee: never break the compile
            reason = str(e) if isinstance(e, Miss) else f"not analysed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            reports.append(SiteReport(form="softmax", rewritten=False, reason=reason, where=_where(sm),
                                      dtype=str(tensor_of(sm).dtype) if tensor_of(sm) is not None else None))
    return reports
