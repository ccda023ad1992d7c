"""Bad arguments to `fa_compile.attention` and `torch.ops.fa3.attention`: each raises a TypeError or
ValueError whose message starts with the name of the argument the caller used (or, for the op's
schema types, torch's own error naming it), never a stray IndexError, ZeroDivisionError or a silent
conversion; and kv_lens outside [0, Nk] mean what the docstrings say (clamped)."""
from __future__ import annotations

import re

import pytest
import torch

import fa_compile
import fa_compile.ops  # noqa: F401  (registers torch.ops.fa3)


def rand(*shape, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape)), dtype=dtype)


Q, KV = (2, 4, 5, 8), (2, 2, 7, 8)

# (id, keyword arguments that replace the valid ones, exception type, argument named at the start)
API_CASES = [
    ("q_not_tensor", dict(q="q"), TypeError, "q"),
    ("k_not_tensor", dict(k=[1.0]), TypeError, "k"),
    ("q_3d", dict(q=rand(2, 4, 5)), ValueError, "q"),
    ("k_dtype", dict(k=rand(*KV, dtype=torch.float16)), ValueError, "k, v"),
    ("v_device", dict(v=rand(*KV).to("meta")), ValueError, "k, v"),
    ("layout", dict(layout="BHSD"), ValueError, "layout"),
    ("layout_none", dict(layout=None), ValueError, "layout"),
    ("causal_str", dict(causal="True"), ValueError, "causal"),
    ("causal_int", dict(causal=1), ValueError, "causal"),
    ("window_int", dict(window=4), TypeError, "window"),
    ("window_float", dict(window=(2.5, 0)), TypeError, "window"),
    ("window_three", dict(window=(1, 2, 3)), TypeError, "window"),
    ("window_below_minus_one", dict(window=(-3, 0)), ValueError, "window"),
    ("window_bool", dict(window=(True, 0)), TypeError, "window"),
    ("window_beyond_int64", dict(window=(2**70, 0)), ValueError, "window"),
    ("scale_beyond_float", dict(scale=10**400), ValueError, "scale"),
    ("softcap_beyond_float", dict(softcap=10**400), ValueError, "softcap"),
    ("dropout_beyond_float", dict(dropout_p=10**400), ValueError, "dropout_p"),
    ("scale_nan", dict(scale=float("nan")), ValueError, "scale"),
    ("scale_inf", dict(scale=float("inf")), ValueError, "scale"),
    ("scale_str", dict(scale="0.3"), TypeError, "scale"),
    ("softcap_negative", dict(softcap=-1.0), ValueError, "softcap"),
    ("softcap_nan", dict(softcap=float("nan")), ValueError, "softcap"),
    ("softcap_str", dict(softcap="30"), TypeError, "softcap"),
    ("dropout_one", dict(dropout_p=1.0), ValueError, "dropout_p"),
    ("dropout_negative", dict(dropout_p=-0.1), ValueError, "dropout_p"),
    ("bias_not_tensor", dict(bias="mask"), TypeError, "bias"),
    ("bias_shape", dict(bias=rand(3, 5, 7)), ValueError, "bias"),
    ("bias_dtype", dict(bias=torch.ones(5, 7, dtype=torch.int64)), ValueError, "bias"),
    ("kv_lens_list", dict(kv_lens=[3, 7]), TypeError, "kv_lens"),
    ("kv_lens_float", dict(kv_lens=torch.tensor([1.0, 2.0])), ValueError, "kv_lens"),
    ("kv_lens_shape", dict(kv_lens=torch.tensor([[1, 2]])), ValueError, "kv_lens"),
    ("kernel_unknown", dict(kernel="x"), ValueError, "kernel"),
    ("kernel_not_str", dict(kernel=3), TypeError, "kernel"),
    ("return_lse_int", dict(return_lse=1), TypeError, "return_lse"),
    ("head_dim_zero_default_scale", dict(q=rand(2, 4, 5, 0), k=rand(2, 2, 7, 0), v=rand(*KV)), ValueError, "scale"),
]


@pytest.mark.parametrize("kw, exc, name", [c[1:] for c in API_CASES], ids=[c[0] for c in API_CASES])
def test_public_api_errors_name_the_argument(kw, exc, name):
    args = dict(q=rand(*Q), k=rand(*KV), v=rand(*KV))
    fa_compile.attention(**args)  # valid first: a memoised check must not let the bad one through
    args.update(kw)
    with pytest.raises(exc, match="^" + re.escape(name) + ":"):
        fa_compile.attention(**args)


# Op arguments beyond those of tests/test_op.py::test_invalid_arguments_name_the_argument.
OP_CASES = [
    ("dropout_seed_float", dict(dropout_p=0.1, dropout_seed=torch.tensor(1.5)), ValueError, "dropout_seed"),
    ("dropout_seed_two", dict(dropout_p=0.1, dropout_seed=torch.tensor([1, 2])), ValueError, "dropout_seed"),
    ("dropout_seed_int32", dict(dropout_p=0.1, dropout_seed=torch.tensor(1, dtype=torch.int32)), ValueError,
     "dropout_seed"),
    ("dropout_seed_device", dict(dropout_p=0.1, dropout_seed=torch.tensor(1).to("meta")), ValueError, "dropout_seed"),
    ("force_kernel", dict(force_kernel="x"), ValueError, "force_kernel"),
    ("heads_zero_kv_only", dict(k=rand(2, 0, 7, 8), v=rand(2, 0, 7, 8)), ValueError, "k"),
    ("softcap_inf", dict(softcap=float("inf")), ValueError, "softcap"),
    ("scale_neg_inf", dict(scale=float("-inf")), ValueError, "scale"),
    ("window_right", dict(window_right=-5), ValueError, "window_left, window_right"),
]


@pytest.mark.parametrize("kw, exc, name", [c[1:] for c in OP_CASES], ids=[c[0] for c in OP_CASES])
def test_op_errors_name_the_argument(kw, exc, name):
    args = dict(q=rand(*Q), k=rand(*KV), v=rand(*KV), scale=0.3)
    torch.ops.fa3.attention(**args)
    args.update(kw)
    with pytest.raises(exc, match="^" + re.escape(name) + ":"):
        torch.ops.fa3.attention(**args)


@pytest.mark.parametrize("kw, name", [
    (dict(causal="yes"), "causal"), (dict(scale="0.3"), "scale"), (dict(window_left=2.5), "window_left"),
    (dict(bias=[1]), "bias"), (dict(q="q"), "q"),
])
def test_op_schema_types_name_the_argument(kw, name):
    """The schema's own type check (torch's message) names the argument too."""
    args = dict(q=rand(*Q), k=rand(*KV), v=rand(*KV), scale=0.3)
    args.update(kw)
    with pytest.raises(RuntimeError, match=f"for argument '{name}'"):
        torch.ops.fa3.attention(**args)


def test_backend_kernel_error_is_raised_by_backend_itself():
    with pytest.raises(ValueError, match=r"^kernel: unknown kernel 'nope'; known: "):
        fa_compile.backend("eager", kernel="nope")
    with pytest.raises(TypeError, match=r"^kernel: expected a kernel name"):
        fa_compile.backend("eager", kernel=3)


def test_forced_kernel_error_says_where_the_name_came_from():
    q = rand(*Q)
    with pytest.raises(Exception, match=r"force_kernel: unknown forward kernel 'nope'.*fa_compile\.backend\(kernel="):
        torch.ops.fa3.attention(q, q, q, 0.3, force_kernel="nope")


def test_wrappers_name_their_kernel_argument_when_the_kernel_refuses():
    """A kernel that exists but cannot take these inputs: the wrappers' error names `kernel=`, the argument the caller
    wrote (the ops name their own `force_kernel`), with the same type and the refusal's reasons."""
    from fa_compile.dispatch import NoKernelError

    q = rand(*Q)
    with pytest.raises(NoKernelError, match=r"^kernel: the forced forward kernel 'flash' cannot take these inputs: .*"
                                            r"CUDA only"):
        fa_compile.attention(q, q, q, kernel="flash")  # on a CPU tensor
    with pytest.raises(NoKernelError, match=r"^force_kernel: the forced forward kernel 'flash'"):
        torch.ops.fa3.attention(q, q, q, 0.3, force_kernel="flash")
    qb = q.transpose(1, 2).contiguous()  # [B, N, H, D]
    with pytest.raises(ValueError, match=r"^kernel: 'fa3' cannot take these inputs"):
        fa_compile.paged_attention(qb, qb, qb, 5, kernel="fa3")  # FA3 is CUDA only
    torch.testing.assert_close(fa_compile.attention(q, q, q, kernel="reference"), fa_compile.attention(q, q, q))


def test_kv_lens_outside_zero_to_nk_are_clamped():
    """Documented: keys j >= kv_lens[b] are masked, so a length above Nk admits every key and one
    at or below 0 none (out 0, lse -inf); no check reads the values (a device sync on CUDA)."""
    q, k, v = rand(*Q), rand(*KV), rand(*KV)
    out, lse = fa_compile.attention(q, k, v, kv_lens=torch.tensor([100, -4]), return_lse=True)
    full, full_lse = fa_compile.attention(q, k, v, return_lse=True)
    torch.testing.assert_close(out[0], full[0], atol=0, rtol=0)
    torch.testing.assert_close(lse[0], full_lse[0], atol=0, rtol=0)
    assert (out[1] == 0).all() and torch.isneginf(lse[1]).all()
    clamped = fa_compile.attention(q, k, v, kv_lens=torch.tensor([7, 0]))
    torch.testing.assert_close(out, clamped, atol=0, rtol=0)
