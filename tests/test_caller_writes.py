"""Attention whose products or intermediates write into tensors the caller sees (`out=`, `copy_`,
in-place updates, slice assignment): the rewrite keeps every write eager makes, or leaves the site
alone and says why. Each case runs eagerly and compiled on clones of the same inputs and compares
the output, every input afterwards, and (where eager allows it) the gradients."""
from __future__ import annotations

import pytest
import torch

import fa_compile
from eager_diff import check, rand
from fa_compile.compiler import run_pass

B, H, N, D = 2, 2, 8, 16


def qkv(requires_grad: bool = False, dtype: torch.dtype = torch.float32, seed: int = 0) -> list:
    return [rand(B, H, N, D, dtype=dtype, seed=seed + i, requires_grad=requires_grad) for i in range(3)]


def probs(q, k):
    return (q @ k.mT * 0.25).softmax(-1)


# ------------------------------------------------------------------------------- the P·V result kept


def matmul_out(q, k, v, buf):
    torch.matmul(probs(q, k), v, out=buf)
    return buf


def matmul_out_result_used(q, k, v, buf):
    r = torch.matmul(probs(q, k), v, out=buf)
    return r * 2


def bmm_out_3d(q, k, v, buf):
    q3, k3, v3 = (t.flatten(0, 1) for t in (q, k, v))
    torch.bmm(torch.softmax(torch.bmm(q3, k3.transpose(1, 2)) / 4.0, -1), v3, out=buf)
    return buf


def bmm_out_view_of_buffer(q, k, v, buf):
    q3, k3, v3 = (t.flatten(0, 1) for t in (q, k, v))
    torch.bmm(torch.softmax(torch.bmm(q3, k3.transpose(1, 2)) / 4.0, -1), v3, out=buf.view(B * H, N, D))
    return buf


def copy_into(q, k, v, buf):
    buf.copy_(probs(q, k) @ v)
    return buf


def slice_assign(q, k, v, buf):
    buf[:] = probs(q, k) @ v
    return buf


def slice_assign_part(q, k, v, buf):
    buf[:, 1:] = (probs(q, k) @ v)[:, 1:]
    return buf


OUT_WRITES = {
    "matmul_out": (matmul_out, (B, H, N, D)),
    "matmul_out_result_used": (matmul_out_result_used, (B, H, N, D)),
    "bmm_out_3d": (bmm_out_3d, (B * H, N, D)),
    "bmm_out_view_of_buffer": (bmm_out_view_of_buffer, (B, H, N, D)),
    "copy_into": (copy_into, (B, H, N, D)),
    "slice_assign": (slice_assign, (B, H, N, D)),
    "slice_assign_part": (slice_assign_part, (B, H, N, D)),
}


@pytest.mark.parametrize("form", list(OUT_WRITES))
def test_pv_result_written_into_a_caller_tensor(form):
    fn, shape = OUT_WRITES[form]
    buf = torch.full(shape, 7.0)  # not zeros: an unwritten buffer must show
    check(fn, qkv() + [buf], rewritten=1)


def test_out_write_kept_in_fp16():
    res = check(matmul_out, qkv(dtype=torch.float16) + [torch.full((B, H, N, D), 7.0, dtype=torch.float16)],
                dtype=torch.float16)
    assert len(res.rewritten) == 1, res.reasons


def test_out_write_kept_with_inductor():
    check(matmul_out, qkv() + [torch.full((B, H, N, D), 7.0)], inner="inductor", rewritten=1)


@pytest.mark.parametrize("form", ["copy_into", "slice_assign"])
def test_written_copy_keeps_gradients(form):
    fn, shape = OUT_WRITES[form]
    check(fn, qkv(requires_grad=True) + [torch.zeros(shape)], rewritten=1)


# ---------------------------------------------------------------------- in-place updates of the result


def result_iadd(q, k, v):
    o = probs(q, k) @ v
    o += 1
    return o


def result_mul_(q, k, v):
    o = probs(q, k) @ v
    o.mul_(2)
    return o


def result_setitem(q, k, v):
    o = probs(q, k) @ v
    o[..., 0] = 0
    return o


def result_view_mul_(q, k, v):
    o = probs(q, k) @ v
    o.transpose(1, 2).mul_(3)
    return o


def sdpa_result_iadd(q, k, v):
    o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    o += 1
    return o


def sdpa_3d_result_mul_(q, k, v):
    o = torch.nn.functional.scaled_dot_product_attention(q[0], k[0], v[0])
    o.mul_(2)
    return o


INPLACE_RESULT = {"iadd": result_iadd, "mul_": result_mul_, "setitem": result_setitem, "view_mul_": result_view_mul_,
                  "sdpa_3d_mul_": sdpa_3d_result_mul_}


@pytest.mark.parametrize("inner", ["eager", "aot_eager"])
@pytest.mark.parametrize("form", list(INPLACE_RESULT))
def test_result_updated_in_place_trains(form, inner):
    check(INPLACE_RESULT[form], qkv(requires_grad=True), inner=inner, rewritten=1)


@pytest.mark.parametrize("inner", ["eager", "aot_eager"])
def test_sdpa_result_updated_in_place(inner):
    # eager's CPU flash kernel saves its output for backward, so eager itself refuses this in training
    check(sdpa_result_iadd, qkv(), inner=inner, rewritten=1)


# ------------------------------------------------------------ in-place updates of the inputs and scores


def q_imul(q, k, v):
    q *= 0.5
    return (q @ k.mT).softmax(-1) @ v


def q_mul_(q, k, v):
    q.mul_(0.5)
    return (q @ k.mT).softmax(-1) @ v


def q_scaled_copy_then_q_mutated(q, k, v):
    q2 = q * 0.5
    q.add_(1.0)
    return (q2 @ k.mT).softmax(-1) @ v


def q_scaled_copy_then_q_aten_add_(q, k, v):
    q2 = q * 0.5
    torch.ops.aten.add_.Tensor(q, torch.ones_like(q))  # the OpOverload spelling of `q.add_(1)`
    return (q2 @ k.mT).softmax(-1) @ v


def q_scaled_copy_then_q_out(q, k, v):
    q2 = q * 0.5
    torch.add(q, 1.0, out=q)
    return (q2 @ k.mT).softmax(-1) @ v


def q_scaled_copy_then_q_relu_inplace(q, k, v):
    q2 = q * 0.5
    torch.nn.functional.relu(q, inplace=True)
    return (q2 @ k.mT).softmax(-1) @ v


def scores_scaled_in_place(q, k, v):
    s = q @ k.mT
    s *= 0.25
    return s.softmax(-1) @ v


@pytest.mark.parametrize("fn", [q_imul, q_mul_, q_scaled_copy_then_q_mutated, q_scaled_copy_then_q_aten_add_,
                                q_scaled_copy_then_q_out, q_scaled_copy_then_q_relu_inplace, scores_scaled_in_place],
                         ids=lambda f: f.__name__)
def test_inputs_and_scores_updated_in_place(fn):
    res = check(fn, qkv())
    if fn is scores_scaled_in_place:
        assert len(res.rewritten) == 1, res.reasons


# ---------------------------------------------------------------------------- writes that are refused


def bias_updated_by_scores(q, k, v, bias):
    bias += q @ k.mT * 0.25
    return bias.softmax(-1) @ v


def scores_into_out(q, k, v, sbuf):
    torch.matmul(q, k.mT, out=sbuf)
    return (sbuf * 0.25).softmax(-1) @ v


def scaled_scores_into_out(q, k, v, sbuf):
    torch.mul(q @ k.mT, 0.25, out=sbuf)
    return sbuf.softmax(-1) @ v


def probs_into_out(q, k, v, sbuf):
    torch.softmax(q @ k.mT * 0.25, -1, out=sbuf)
    return sbuf @ v


def scores_copied_out(q, k, v, sbuf):
    s = q @ k.mT * 0.25
    sbuf.copy_(s)
    return s.softmax(-1) @ v


REFUSED = {
    bias_updated_by_scores: "writes in place into",
    scores_into_out: "not a Q·Kᵀ contraction",
    scaled_scores_into_out: "not a Q·Kᵀ contraction",
    probs_into_out: "written into a caller's tensor (out=",
    scores_copied_out: "also used outside the attention",
}


@pytest.mark.parametrize("fn", list(REFUSED), ids=lambda f: f.__name__)
def test_writes_of_the_scores_are_kept_by_leaving_the_site(fn):
    res = check(fn, qkv() + [rand(B, H, N, N, seed=5)], rewritten=0)
    assert any(REFUSED[fn] in r for r in res.reasons), res.reasons



# ------------------------------------------------ caches written in place before the attention reads them


def cache_filled_then_read(q, k, v, k_cache, v_cache):
    # A static cache: the new keys / values written at a position, then the whole cache attended over;
    # q is viewed before the writes, which touch other memory.
    qh = q.transpose(1, 2).transpose(1, 2)
    pos = torch.tensor([N - 1])
    k_cache.index_copy_(2, pos, k[:, :, :1])
    v_cache.index_copy_(2, pos, v[:, :, :1])
    return (qh @ k_cache.mT * 0.25).softmax(-1) @ v_cache


def view_taken_before_write(q, k, v):
    kt = k.mT
    k.add_(1.0)  # eager's Q·Kᵀ reads the written values through the view
    return (q @ kt * 0.25).softmax(-1) @ v


def copy_taken_before_write(q, k, v):
    kc = k.clone()
    k.add_(1.0)  # eager's Q·Kᵀ reads the copy: the values from before the write
    return (q @ kc.mT * 0.25).softmax(-1) @ v


def test_cache_written_in_place_before_the_attention_is_rewritten():
    res = check(cache_filled_then_read, qkv() + [rand(B, H, N, D, seed=7), rand(B, H, N, D, seed=8)])
    assert len(res.rewritten) == 1, res.reasons


@pytest.mark.parametrize("fn", [view_taken_before_write, copy_taken_before_write], ids=lambda f: f.__name__)
def test_writes_between_a_view_or_copy_and_the_read(fn):
    check(fn, qkv())  # compared with eager on every element, whether rewritten or left alone


# ------------------------------------------------------------------- a mask written after the attention


def additive_mask_then_scaled(q, k, v, m):
    out = (q @ k.mT * 0.25 + m).softmax(-1) @ v
    m.mul_(2.0)  # the bias updated for its next use
    return out


def bool_mask_then_filled(q, k, v, m):
    out = (q @ k.mT * 0.25).masked_fill(~m, float("-inf")).softmax(-1) @ v
    m.fill_(True)
    return out


def sdpa_mask_then_filled(q, k, v, m):
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=m)
    m.fill_(True)
    return out


def _mask_for(fn):
    if fn is additive_mask_then_scaled:
        return rand(B, 1, N, N, seed=7)
    m = rand(B, 1, N, N, seed=7) > -0.5
    m[..., 0] = True
    return m


@pytest.mark.parametrize("inner", ["aot_eager", "inductor"])
@pytest.mark.parametrize("fn", [additive_mask_then_scaled, bool_mask_then_filled, sdpa_mask_then_filled],
                         ids=lambda f: f.__name__)
def test_a_mask_written_after_the_attention(fn, inner):
    """Inference reads the mask before the write and is rewritten. Training would save the mask for the
    backward, and AOTAutograd saves a graph input that is written later as the written tensor (a copy does
    not help): the site is left to eager's ops, whose backward needs no mask."""
    res = check(fn, qkv() + [_mask_for(fn)], inner=inner, grad=False)
    assert len(res.rewritten) == 1, res.reasons
    res = check(fn, qkv(requires_grad=True) + [_mask_for(fn)], inner=inner)
    assert not res.rewritten and any("written in place later" in r for r in res.reasons), res.reasons


# ------------------------------------------------------- a mask read, then written in place before the site
# Eager's bias (or negated mask) holds the values from before the write; the op reads the mask at the site. So the
# site is left alone, or takes a copy from before the write: compared with eager on every element.

def bias_from_mask_then_filled(q, k, v, m):
    bias = torch.where(m, 0.0, float("-inf"))
    m.fill_(True)  # updated for a later use
    return torch.softmax(q @ k.mT * 0.25 + bias, -1) @ v


def negated_mask_then_zeroed(q, k, v, m):
    c = ~m
    m.zero_()
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=~c)


def padding_then_filled(q, k, v, m):  # m: [B, N] keep
    pad = ~m[:, None, None, :]
    m.fill_(True)
    return torch.softmax((q @ k.mT * 0.25).masked_fill(pad, -1e9), -1) @ v


def made_here_then_filled(q, k, v, m):
    keep = torch.ones(N, N, dtype=torch.bool).tril()
    c = ~keep
    keep.fill_(True)
    return torch.softmax((q @ k.mT * 0.25).masked_fill(c, float("-inf")), -1) @ v


def mask_written_before_it_is_read(q, k, v, m):
    m[..., 0] = True  # every row keeps its first key: eager reads the written mask, and so does the op
    return torch.softmax(q @ k.mT * 0.25 + torch.where(m, 0.0, float("-inf")), -1) @ v


def _keep(fn):
    if fn is padding_then_filled:
        m = torch.ones(B, N, dtype=torch.bool)
        m[1, 5:] = False
        return m
    m = rand(B, 1, N, N, seed=7) > 0.0
    m[..., 0] = True
    return m


@pytest.mark.parametrize("inner", ["aot_eager", "inductor"])
@pytest.mark.parametrize("fn", [bias_from_mask_then_filled, negated_mask_then_zeroed, padding_then_filled,
                                made_here_then_filled], ids=lambda f: f.__name__)
def test_a_mask_written_after_it_is_read_before_the_site(fn, inner):
    check(fn, qkv() + [_keep(fn)], inner=inner, grad=False)


def test_a_mask_written_before_it_is_read_is_rewritten():
    m = rand(B, 1, N, N, seed=7) > 0.0
    check(mask_written_before_it_is_read, qkv() + [m], grad=False, rewritten=1)


# ------------------------------------------------------------------------------- inputs written after the site

# Only v needs a gradient, so eager saves P, not k: writing k after the attention is legal eager code. The op would
# save k for its backward, which would then read the written k (wrong gradients, or autograd's version-counter
# error at compile time): every spelling of such a write leaves the site alone.
def _attend(q, k, v):
    return torch.softmax(q @ k.transpose(-1, -2) * 0.25, -1) @ v


def foreach_add_after(q, k, v):
    o = _attend(q, k, v)
    torch._foreach_add_([k], 1.0)
    return o


def foreach_copy_after(q, k, v):
    o = _attend(q, k, v)
    torch._foreach_copy_([k], [v.detach()])
    return o


def chunk_view_write_after(x, v):
    q, k = x.chunk(2, dim=-1)
    o = _attend(q, k, v)
    k.mul_(3.0)
    return o


def unbind_view_write_after(x, v):
    q, k = x.unbind(0)
    o = _attend(q, k, v)
    q.mul_(3.0)
    return o


def out_write_after(q, k, v):
    o = _attend(q, k, v)
    torch.mul(k, 2.0, out=k)
    return o


def relu_inplace_after(q, k, v):
    o = _attend(q, k, v)
    torch.nn.functional.relu(k, inplace=True)
    return o


def aten_add_after(q, k, v):
    o = _attend(q, k, v)
    torch.ops.aten.add_(k, 1.0)
    return o


def deep_view_write_after(q, k, v):
    o = _attend(q, k, v)
    t = k.view(B * H, N, D).view(B, H, N, D)
    for _ in range(4):
        t = t.unsqueeze(0)
    for _ in range(4):
        t = t.squeeze(0)
    t.add_(1.0)  # through 10 views of k
    return o


def aten_add_overload_after(q, k, v):
    o = _attend(q, k, v)
    torch.ops.aten.add_.Tensor(k, torch.ones_like(k))
    return o


def mt_slice_write_after(q, k, v):
    o = _attend(q, k, v)
    k.mT[..., :2].mul_(0.0)
    return o


def dropout_alias_written_after(q, k, v):
    o = _attend(q, torch.nn.functional.dropout(k, 0.1, training=False), v)  # dropout in eval returns k itself
    k.mul_(2.0)
    return o


def einsum_alias_written_after(x, y, wk, wv):
    k, v = y @ wk, y @ wv
    q = torch.einsum("bhnd->bhnd", x)  # an einsum of one operand may return a view of it
    o = torch.softmax((q * 0.25) @ k.transpose(-1, -2), -1) @ v  # eager saves the scaled copy, not q
    x.mul_(2.0)
    return o


def unsafe_split_view_written_after(x, v):
    q, k = torch.unsafe_split(x, D, -1)
    o = _attend(q, k, v)
    x.mul_(2.0)
    return o


def data_alias_written_after(q, k, v):
    q2 = q * 1.0
    o = _attend(q2, k, v)
    q2.data.mul_(2.0)  # q2's memory, written without autograd seeing it
    return o


def as_tensor_alias_written_after(q, k, v):
    o = _attend(q, k, v)
    torch.as_tensor(k).mul_(2.0)  # as_tensor of a tensor returns the tensor itself
    return o


def asarray_alias_written_after(q, k, v):
    o = _attend(q, k, v)
    torch.asarray(q).mul_(2.0)
    return o


def unary_plus_alias_written_after(q, k, v):
    o = _attend(q, k, v)
    (+k).mul_(2.0)  # operator.pos returns its operand
    return o


def _v_grad_only() -> list:
    q, k, v = qkv()
    return [q, k, v.requires_grad_()]


WRITES_AFTER = {
    "foreach_add": (foreach_add_after, _v_grad_only), "foreach_copy": (foreach_copy_after, _v_grad_only),
    "chunk_view": (chunk_view_write_after,
                   lambda: [rand(B, H, N, 2 * D, seed=5), rand(B, H, N, D, seed=6, requires_grad=True)]),
    "unbind_view": (unbind_view_write_after,
                    lambda: [rand(2, B, H, N, D, seed=5), rand(B, H, N, D, seed=6, requires_grad=True)]),
    "out": (out_write_after, _v_grad_only), "relu_inplace": (relu_inplace_after, _v_grad_only),
    "aten_add_": (aten_add_after, _v_grad_only), "mT_slice": (mt_slice_write_after, _v_grad_only),
    "deep_view": (deep_view_write_after, _v_grad_only), "aten_add_Tensor": (aten_add_overload_after, _v_grad_only),
    "dropout_alias": (dropout_alias_written_after, _v_grad_only),
    "einsum_alias": (einsum_alias_written_after, lambda: [rand(B, H, N, D, seed=5), rand(B, H, N, D, seed=6)] + [
        rand(D, D, seed=7 + i, requires_grad=True) for i in range(2)]),
    "unsafe_split": (unsafe_split_view_written_after,
                     lambda: [rand(B, H, N, 2 * D, seed=5), rand(B, H, N, D, seed=6, requires_grad=True)]),
    "data_alias": (data_alias_written_after, _v_grad_only),
    "as_tensor": (as_tensor_alias_written_after, _v_grad_only),
    "asarray": (asarray_alias_written_after, _v_grad_only),
    "unary_plus": (unary_plus_alias_written_after, _v_grad_only),
}


@pytest.mark.parametrize("inner", ["eager", "aot_eager"])
@pytest.mark.parametrize("form", list(WRITES_AFTER))
def test_inputs_written_after_the_site_are_not_saved(form, inner):
    fn, make = WRITES_AFTER[form]
    res = check(fn, make(), inner=inner, rewritten=0)
    assert any("written in place later" in r for r in res.reasons), res.reasons


def test_input_written_through_many_views_with_the_fa3_backend():
    res = check(deep_view_write_after, _v_grad_only(), inner="inductor", rewritten=0)
    assert any("written in place later" in r for r in res.reasons), res.reasons


def test_inputs_made_under_no_grad_then_written_with_a_bias_gradient():
    # q, k, v computed under no_grad, the site under grad with a bias that needs one: the op saves q for the bias's
    # gradient, so a write into q afterwards must still leave the site alone.
    def fn(x, bias):
        with torch.no_grad():
            q, k, v = x * 1.0, x * 2.0, x * 0.5
        o = torch.softmax(q @ k.transpose(-1, -2) * 0.25 + bias, -1) @ v
        q.add_(1.0)
        return o

    res = check(fn, [rand(B, H, N, D, seed=3), rand(B, H, N, N, seed=4, requires_grad=True)], rewritten=0)
    assert any("written in place later" in r for r in res.reasons), res.reasons


# ------------------------------------------------------------------- a mask the graph builds by writing slices

def block_mask_built_by_slice_writes(q, k, v):
    """Pixtral's block-diagonal mask: a finfo.min matrix with one block of zeros written per image."""
    m = torch.full((N, N), torch.finfo(q.dtype).min)
    m[0:2, 0:2] = 0
    m[2:, 2:] = 0
    return torch.softmax(q @ k.transpose(-1, -2) * 0.25 + m[None, None].expand(B, 1, -1, -1), -1) @ v


def block_mask_written_again_after(q, k, v):
    m = torch.full((N, N), torch.finfo(q.dtype).min)
    m[0:2, 0:2] = 0
    m[2:, 2:] = 0
    o = torch.softmax(q @ k.transpose(-1, -2) * 0.25 + m, -1) @ v
    m[:, 0] = 0  # the op would have saved m for the backward
    return o + m.sum()


@pytest.mark.parametrize("inner", ["aot_eager", "inductor"])
def test_a_mask_built_by_writes_before_the_site_trains_rewritten(inner):
    """The writes made the value the site reads; functionalization gives the op the finished mask to save."""
    res = check(block_mask_built_by_slice_writes, qkv(requires_grad=True), inner=inner)
    assert len(res.rewritten) == 1, res.reasons


def test_a_mask_built_by_writes_and_written_after_the_site_is_left_alone_in_training():
    res = check(block_mask_written_again_after, qkv(requires_grad=True), rewritten=0)
    assert any("written in place later" in r for r in res.reasons), res.reasons


# ----------------------------------------------- a constant mask written through a view or by out= before the site
# The mask's value at the site is not its definition's: the writes (through another view of its memory, or as an
# op's out=) must be seen, or the site would get the structure of the mask as first built.

def tril_written_through_a_view(q, k, v):
    m = torch.ones(N, N).tril()
    m.view(-1)[1] = 1.0  # row 0 now keeps key 1: not causal
    return torch.softmax((q @ k.mT * 0.25).masked_fill(m == 0, float("-inf")), -1) @ v


def tril_overwritten_by_out(q, k, v):
    m = torch.ones(N, N).tril()
    torch.ones(N, N, out=m)  # every key kept
    return torch.softmax((q @ k.mT * 0.25).masked_fill(m == 0, float("-inf")), -1) @ v


def min_mask_written_through_a_view(q, k, v):
    m = torch.full((N, N), torch.finfo(q.dtype).min)
    m4 = m[None, None]
    m4[..., :4, :4] = 0
    m4[..., 4:, :] = 0
    return torch.softmax(q @ k.mT * 0.25 + m, -1) @ v


class BufferWrittenThroughAView(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("bias", torch.tril(torch.ones(N, N)).view(1, 1, N, N))

    def forward(self, q, k, v):
        self.bias.view(N, N)[0, 1] = 1.0
        return torch.softmax((q @ k.mT * 0.25).masked_fill(self.bias == 0, float("-inf")), -1) @ v


@pytest.mark.parametrize("fn", [tril_written_through_a_view, tril_overwritten_by_out, min_mask_written_through_a_view,
                                BufferWrittenThroughAView()], ids=lambda f: getattr(f, "__name__", type(f).__name__))
@pytest.mark.parametrize("grad", [False, True])
def test_a_constant_mask_written_before_the_site_is_read_as_written(fn, grad):
    res = check(fn, qkv(requires_grad=grad), grad=grad)
    assert all(r.mask not in ("causal", "none") for r in res.rewritten), [(r.mask, r.reason) for r in res.reports]


# ------------------------------------------------------------------------------- the result written by the caller


def returned_as_is(q, k, v):
    return _attend(q, k, v)


def returned_heads_merged(q, k, v):
    return _attend(q, k, v).transpose(1, 2).reshape(B, N, H * D)  # a view of the op's [B, N, H, D] output


def sdpa_returned_heads_merged(q, k, v):
    o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    return o.transpose(1, 2).reshape(B, N, H * D)


def residual_after_graph_break(q, k, v, x):
    o = _attend(q, k, v).transpose(1, 2).reshape(B, N, H * D)
    torch._dynamo.graph_break()
    o += x  # the next graph writes into the first one's output
    return o


RETURNED = {"as_is": returned_as_is, "heads_merged": returned_heads_merged,
            "sdpa_heads_merged": sdpa_returned_heads_merged}


def _written_by_caller(fn, inputs: list, compiled) -> tuple:
    args = [a.detach().clone().requires_grad_(a.requires_grad) for a in inputs]
    out = compiled(*args)
    out.add_(rand(*out.shape, seed=31))  # the caller's residual, in place, before the backward
    grads = torch.autograd.grad((out * out).sum(), [a for a in args if a.requires_grad])
    return out.detach(), grads


@pytest.mark.parametrize("inner", ["aot_eager", "inductor"])
@pytest.mark.parametrize("form", list(RETURNED) + ["graph_break"])
def test_output_written_by_the_caller_leaves_the_saved_output_alone(form, inner):
    # The op saves its output for the backward; eager's products save P and V. A result the graph returns, or a view
    # of it, that the caller (or the next graph) then writes into must not be the memory the backward reads.
    fn = residual_after_graph_break if form == "graph_break" else RETURNED[form]
    inputs = qkv(requires_grad=True) + ([rand(B, N, H * D, seed=7)] if form == "graph_break" else [])
    torch._dynamo.reset()
    reports: list = []
    be = fa_compile.backend(inner)

    def backend(gm, example_inputs):
        reports.extend(run_pass(gm))
        return be(gm, example_inputs)

    got, got_grads = _written_by_caller(fn, inputs, torch.compile(fn, backend=backend))
    want, want_grads = _written_by_caller(fn, inputs, fn)
    assert [r.rewritten for r in reports] == [True]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for name, g, w in zip("qkv", got_grads, want_grads):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4, msg=lambda m: f"{name}.grad: {m}")


# ------------------------------------------------------------------------------- view or copy by strides


def contiguous_written(q, k, v):
    o = _attend(q, k, v)
    o.contiguous().mul_(2.0)  # eager's o is contiguous: .contiguous() is o itself
    return o + 0.0


def reshape_written(q, k, v):
    o = _attend(q, k, v)
    o.reshape(B * H, N, D).add_(1.0)  # a view of eager's o
    return o + 0.0


def flatten_written(q, k, v):
    o = _attend(q, k, v)
    o.flatten(2).zero_()
    return o + 0.0


def merged_heads_written(q, k, v):
    o = _attend(q, k, v)
    o.transpose(1, 2).reshape(B, N, H * D).zero_()  # a copy in eager: o keeps its values
    return o + 0.0


def reshaped_then_written(q, k, v):
    o = _attend(q, k, v)
    y = o.reshape(B * H, N, D)
    o.mul_(3.0)  # reaches y in eager, where y is a view
    return y + 0.0


@pytest.mark.parametrize("fn", [contiguous_written, reshape_written, flatten_written, merged_heads_written,
                                reshaped_then_written], ids=lambda f: f.__name__)
@pytest.mark.parametrize("inner", ["aot_eager", "inductor"])
def test_writes_through_a_view_or_a_copy_land_as_in_eager(fn, inner):
    # .contiguous(), .reshape(), .flatten() give a view or a copy by the strides of their input: the op's output
    # has its own ([B, N, H, D]), so a write through their result reached o where eager's did not, or missed it
    # (1.0-3.6 off). A written output now takes eager's strides.
    check(fn, qkv(requires_grad=True), inner=inner, rewritten=1)


# ------------------------------------------------------------------------------- memory shared across inputs


class _BufferViewOfBuffer(torch.nn.Module):
    """A causal mask buffer registered as a slice of a larger one, which forward writes through the larger one."""

    def __init__(self):
        super().__init__()
        self.register_buffer("full", torch.ones(2 * N, 2 * N, dtype=torch.bool).tril())
        self.register_buffer("mask", self.full[:N, :N])

    def forward(self, q, k, v):
        self.full[3, :4] = False
        self.full[3, 0] = True  # row 3 keeps key 0 only
        return torch.softmax((q @ k.mT * 0.25).masked_fill(~self.mask, float("-inf")), -1) @ v


def _lens_written_through_an_alias(q, k, v, lens, lens_alias):
    keep = (lens[:, None] > torch.arange(N))[:, None, None]  # eager reads the lengths here
    lens_alias.fill_(2)  # the same memory, another input
    return torch.softmax((q @ k.mT * 0.25).masked_fill(~keep, float("-inf")), -1) @ v


def _mask_written_through_conj_physical(q, k, v):
    m = torch.ones(N, N, dtype=torch.bool).tril()
    c = m.conj_physical()  # a real tensor: m itself
    c[3] = False
    c[3, 0] = True
    return torch.softmax((q @ k.mT * 0.25).masked_fill(~m, float("-inf")), -1) @ v


def _keep_written_after_through_an_alias(q, k, v, keep, keep_alias):
    o = torch.softmax((q @ k.mT * 0.25).masked_fill(~keep[:, None], float("-inf")), -1) @ v
    keep_alias.fill_(True)  # after the attention, through another input sharing the mask's memory
    return o


def test_a_buffer_written_through_the_buffer_it_views_is_not_read_as_its_definition():
    """Dynamo's inputs keep the module's aliasing: the write into `full` reaches `mask`, which is then no causal
    band (the site passes it as the data mask it is)."""
    torch._dynamo.reset()
    args = qkv()
    got = torch.compile(_BufferViewOfBuffer(), backend="fa3", dynamic=False)(*args)
    torch.testing.assert_close(got, _BufferViewOfBuffer()(*args))


def test_lengths_written_through_another_input_sharing_their_memory():
    """Eager reads the lengths before the write through the alias; the op would read them at the attention."""
    for dynamic in (False, True):
        torch._dynamo.reset()
        args = qkv()
        lens, lens_ref = torch.tensor([5, 8]), torch.tensor([5, 8])
        got = torch.compile(_lens_written_through_an_alias, backend="fa3", dynamic=dynamic)(*args, lens,
                                                                                            lens.view(-1))
        want = _lens_written_through_an_alias(*args, lens_ref, lens_ref.view(-1))
        torch.testing.assert_close(got, want)
        assert torch.equal(lens, lens_ref)


def test_a_mask_written_through_conj_physical_of_it():
    check(_mask_written_through_conj_physical, qkv())


def test_a_mask_written_after_the_site_through_another_input_does_not_fail_the_compile():
    """The op would save the mask for the backward, and the write after it through an aliasing input bumps its
    version: the site is left alone (written later), which eager's program and its gradients then are."""
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(4)
    keep = torch.rand(B, N, N, generator=g) > 0.3
    keep[..., 0] = True
    args = qkv(requires_grad=True)
    ref_args = [a.detach().clone().requires_grad_() for a in args]
    kc, kr = keep.clone(), keep.clone()
    got = torch.compile(_keep_written_after_through_an_alias, backend="fa3", dynamic=False)(
        *args, kc, kc.view(B, N * N))
    want = _keep_written_after_through_an_alias(*ref_args, kr, kr.view(B, N * N))
    torch.testing.assert_close(got, want)
    assert torch.equal(kc, kr)
    got.sum().backward()
    want.sum().backward()
    for a, r in zip(args, ref_args):
        torch.testing.assert_close(a.grad, r.grad)
