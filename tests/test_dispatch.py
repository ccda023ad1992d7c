"""Kernel dispatch: each candidate's reasons, the measured order, user settings, forced kernels,
run-time fallback, tuning cache; on a GPU, every candidate against the reference."""
from __future__ import annotations

import math
import types
import warnings
import zlib

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.nn.attention import SDPBackend, sdpa_kernel

import fa_compile
import fa_compile.ops  # noqa: F401  (registers torch.ops.fa3)
from fa_compile import dispatch, tuning
from fa_compile.candidates import common, fa3, fa4, sdpa
from fa_compile.dispatch import AttentionArgs, NoKernelError
from fa_compile.kernels import reference as ref

BF16 = torch.bfloat16


@pytest.fixture
def hopper(monkeypatch):
    """Fake CUDA tensors answer as an sm90 device; FA_COMPILE_* env cleared; tuning off."""
    monkeypatch.setattr(common, "device_capability", lambda device: (9, 0) if device.type == "cuda" else None)
    for var in ("FA_COMPILE_KERNEL", "FA_COMPILE_TUNE", "FA_COMPILE_FA4"):
        monkeypatch.delenv(var, raising=False)
    tuning.enable(None)
    yield


@pytest.fixture
def fake_fa3(monkeypatch):
    """flash_attn_interface 'importable' with the tokenspeed-fa3 build flags (forward only, no softcap, no 96)."""
    flags = {"FLASHATTENTION_DISABLE_BACKWARD": True, "FLASHATTENTION_DISABLE_SOFTCAP": True,
             "FLASHATTENTION_DISABLE_HDIM96": True, "FLASHATTENTION_DISABLE_SM8x": True}
    monkeypatch.setattr(fa3, "_module", lambda: (types.SimpleNamespace(), flags, ""))
    yield


def fake_args(b=2, hq=4, hkv=4, nq=64, nk=64, d=64, dv=None, dtype=BF16, device="cuda", **kw) -> AttentionArgs:
    """AttentionArgs over FakeTensors (no data, no GPU needed): what explain() hands the candidates."""
    mode = FakeTensorMode()
    with mode:
        q = torch.empty(b, nq, hq, d, device=device, dtype=dtype).transpose(1, 2)  # BSHD storage, as models have
        k = torch.empty(b, nk, hkv, d, device=device, dtype=dtype).transpose(1, 2)
        v = torch.empty(b, nk, hkv, d if dv is None else dv, device=device, dtype=dtype).transpose(1, 2)
        if isinstance(kw.get("bias"), tuple):
            shape, bdt = kw["bias"]
            kw["bias"] = torch.empty(shape, device=device, dtype=bdt)
        if kw.get("kv_lens") is True:
            kw["kv_lens"] = torch.empty(b, device=device, dtype=torch.int32)
        if kw.get("dropout_p"):
            kw["dropout_seed"] = torch.empty((), device=device, dtype=torch.int64)
    kw.setdefault("scale", 1 / math.sqrt(d) if d else 1.0)
    return AttentionArgs(q=q, k=k, v=v, **kw)


def reasons(cand, args) -> str:
    return " | ".join(cand.not_supported_reasons(args))


# ---------------------------------------------------------------------------------------------
# reasons per candidate (fake CUDA inputs)
# ---------------------------------------------------------------------------------------------

def test_fake_cuda_inputs_are_plain_fakes_with_cuda_device():
    a = fake_args()
    assert a.q.device.type == "cuda" and a.q.stride(-1) == 1 and dispatch._is_fake(a.q)


@pytest.mark.parametrize("cand", [sdpa.CUDNN, sdpa.FLASH, sdpa.EFFICIENT])
def test_sdpa_candidates_take_plain_and_square_causal_bf16(hopper, cand):
    assert reasons(cand, fake_args()) == ""
    assert reasons(cand, fake_args(causal=True)) == ""
    assert reasons(cand, fake_args(dtype=torch.float16, needs_backward=True)) == ""


@pytest.mark.parametrize("cand", [sdpa.CUDNN, sdpa.FLASH, sdpa.EFFICIENT])
def test_sdpa_candidates_refuse_what_their_kernels_cannot_do(hopper, cand):
    assert "no softcap" in reasons(cand, fake_args(softcap=30.0))
    assert "dropout mask" in reasons(cand, fake_args(dropout_p=0.1))
    assert "sliding window" in reasons(cand, fake_args(window_left=8))
    assert "is_causal is aligned" in reasons(cand, fake_args(causal=True, nq=16, nk=64, diag_offset=7))
    assert "float64" in reasons(cand, fake_args(dtype=torch.float64))
    assert "multiple of 8" in reasons(cand, fake_args(d=100))
    assert "runs on CUDA only" in reasons(cand, fake_args(device="cpu"))


def test_sdpa_causal_alignment_per_kernel(hopper):
    # Nq != Nk, as measured on the H200: cuDNN and mem-efficient top-left, FA2 bottom-right
    top_left = fake_args(causal=True, nq=16, nk=64, diag_offset=0)
    bottom_right = fake_args(causal=True, nq=16, nk=64, diag_offset=48)
    assert reasons(sdpa.EFFICIENT, top_left) == "" and reasons(sdpa.CUDNN, top_left) == ""
    assert "bottom-right (diag_offset Nk - Nq = 48)" in reasons(sdpa.FLASH, top_left)
    assert reasons(sdpa.FLASH, bottom_right) == ""
    assert "top-left" in reasons(sdpa.CUDNN, bottom_right)
    # the non-square alignment was measured for the forward only
    train = fake_args(causal=True, nq=16, nk=64, diag_offset=0, needs_backward=True)
    assert "not verified" in reasons(sdpa.CUDNN, train)
    # decode against a cache, bottom-right: the causal bound admits every key, so no mask is needed
    dec = fake_args(causal=True, nq=1, nk=4096, diag_offset=4095)
    assert not common.effective_causal(dec)
    assert reasons(sdpa.CUDNN, dec) == "" and reasons(sdpa.FLASH, dec) == ""


def test_sdpa_bias_kv_lens_gqa_rules(hopper):
    gqa = fake_args(hq=8, hkv=2)
    assert reasons(sdpa.CUDNN, gqa) == "" and reasons(sdpa.FLASH, gqa) == ""
    assert "repeat K and V 4x" in reasons(sdpa.EFFICIENT, gqa)
    bias_bool = fake_args(bias=((2, 1, 64, 64), torch.bool))
    assert reasons(sdpa.CUDNN, bias_bool) == ""
    assert "no attention bias" in reasons(sdpa.FLASH, bias_bool)
    assert "lse 0" in reasons(sdpa.EFFICIENT, bias_bool)  # its empty-row marker is ambiguous
    assert "kv_lens" in reasons(sdpa.FLASH, fake_args(kv_lens=True))
    assert reasons(sdpa.CUDNN, fake_args(kv_lens=True)) == ""
    assert "rounding it" in reasons(sdpa.CUDNN, fake_args(bias=((64, 64), torch.float32)))
    grad = fake_args(bias=((1, 4, 64, 64), BF16), needs_backward=True, bias_requires_grad=True)
    assert "no bias gradient" in reasons(sdpa.CUDNN, grad)
    assert not sdpa.EFFICIENT.has_backward() and sdpa.CUDNN.has_backward()


def test_user_settings_deterministic_precision_sdpa_kernel(hopper):
    train = fake_args(needs_backward=True)
    prev = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        for cand in (sdpa.CUDNN, sdpa.FLASH, sdpa.EFFICIENT):
            assert "not deterministic" in reasons(cand, train)
        assert reasons(sdpa.CUDNN, fake_args()) == ""  # forward kernels are deterministic
        assert dispatch.select_backward(train).name in ("triton", "reference")
    finally:
        torch.use_deterministic_algorithms(prev)

    f32 = fake_args(dtype=torch.float32)
    prec = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        assert "'highest'" in reasons(sdpa.EFFICIENT, f32)
        assert "float32" in reasons(sdpa.CUDNN, f32)
        torch.set_float32_matmul_precision("high")
        assert reasons(sdpa.EFFICIENT, f32) == ""
    finally:
        torch.set_float32_matmul_precision(prec)

    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        assert "disabled" in reasons(sdpa.CUDNN, fake_args())
        assert "disabled" in reasons(sdpa.EFFICIENT, fake_args())
        assert reasons(sdpa.FLASH, fake_args()) == ""
        # sdpa_kernel governs SDPA's backends only: FA3, when installed, stays ahead of FA2.
        fa3_ok = not reasons(fa3.FA3, fake_args())
        assert dispatch.select_forward(fake_args()).name == ("fa3" if fa3_ok else "flash")
    assert dispatch.select_forward(fake_args()).name == "cudnn"
    with sdpa_kernel([SDPBackend.MATH]):
        chosen, refused = dispatch.explain_choice(fake_args())
        assert chosen == "reference"
        assert refused and all(any("only SDPBackend.MATH" in x for x in r) for _, r in refused)


def test_fa3_not_importable_says_so(hopper, monkeypatch):
    monkeypatch.setattr(fa3, "_module", lambda: (None, {}, "ModuleNotFoundError: No module named 'flash_attn_interface'"))
    assert "not importable" in reasons(fa3.FA3, fake_args())


def test_fa3_build_flags_and_bottom_right_alignment(hopper, fake_fa3):
    assert reasons(fa3.FA3, fake_args(hq=8, hkv=2)) == ""
    assert not fa3.FA3.has_backward()  # forward-only build: absent from the backward list
    assert "head dim 96" in reasons(fa3.FA3, fake_args(d=96))
    assert reasons(fa3.FA3, fake_args(d=128)) == "" and reasons(fa3.FA3, fake_args(d=256)) == ""
    assert "no softcap" in reasons(fa3.FA3, fake_args(softcap=50.0))
    assert "no attention bias" in reasons(fa3.FA3, fake_args(bias=((64, 64), torch.bool)))
    # bottom-right diagonal (KV cache) is FA3's; SDPA's top-left one is not, unless Nq == Nk
    assert reasons(fa3.FA3, fake_args(causal=True, nq=16, nk=64, diag_offset=48)) == ""
    assert "bottom-right" in reasons(fa3.FA3, fake_args(causal=True, nq=16, nk=64, diag_offset=0))
    assert reasons(fa3.FA3, fake_args(window_left=8, window_right=0, nq=16, nk=64, diag_offset=48)) == ""
    assert reasons(fa3.FA3, fake_args(kv_lens=True)) == ""
    assert "seqused_k" in reasons(fa3.FA3, fake_args(kv_lens=True, causal=True))
    assert "float32" in reasons(fa3.FA3, fake_args(dtype=torch.float32))


def _fa3_semantics_forward(q, k, v, seqused_k=None, softmax_scale=None, causal=False, window_size_left=-1,
                           window_size_right=-1, softcap=0.0, num_splits=1):
    """FA3's documented semantics, written independently: BSHD, bounds around i + Nk - Nq."""
    b, nq, hq, d = q.shape
    nk, hkv = k.shape[1], k.shape[2]
    # FA3 reads seqused_k keys of each batch entry: out-of-range lengths must have been clamped
    assert seqused_k is None or (seqused_k.dtype == torch.int32 and 0 <= seqused_k.min() and seqused_k.max() <= nk)
    qh, kh, vh = (t.transpose(1, 2).double() for t in (q, k, v))
    kh, vh = kh.repeat_interleave(hq // hkv, 1), vh.repeat_interleave(hq // hkv, 1)
    s = qh @ kh.transpose(-2, -1) * softmax_scale
    i = torch.arange(nq).view(nq, 1) + (nk - nq)
    j = torch.arange(nk).view(1, nk)
    keep = torch.ones(nq, nk, dtype=torch.bool)
    if causal:
        keep &= j <= i
    if window_size_left >= 0:
        keep &= j >= i - window_size_left
    if window_size_right >= 0:
        keep &= j <= i + window_size_right
    keep = keep.view(1, 1, nq, nk).expand(b, 1, nq, nk)
    if seqused_k is not None:
        keep = keep & (j.view(1, 1, 1, nk) < seqused_k.view(b, 1, 1, 1))
    s = s.masked_fill(~keep, -math.inf)
    lse = torch.logsumexp(s, -1)
    out = torch.softmax(s, -1).nan_to_num(0.0) @ vh
    return out.transpose(1, 2).to(q.dtype), lse.float(), None, None


FA3_PLUMBING = [
    # (Nq, Nk, kwargs in the op's terms)
    (16, 40, dict(causal=True, diag_offset=24)),                      # bottom-right causal (KV cache)
    (16, 40, dict(window_left=5, window_right=2, diag_offset=24)),     # sliding window
    (16, 40, dict(causal=True, window_left=5, diag_offset=24)),        # causal + left window
    (40, 16, dict(causal=True, diag_offset=-24)),                      # Nq > Nk: empty rows
    (1, 40, dict(causal=True, diag_offset=39)),                        # decode: the bound is vacuous
    (16, 40, dict(kv_lens=[40, 7, 0])),                                # key padding, one empty batch
    (16, 40, dict(kv_lens=[55, -3, 7])),                               # out of [0, Nk]: clamped
]


# A CPU stand-in for FA3's C++ forward `flash_attn_3::fwd`, with its schema (hopper/flash_api.cpp,
# FA3 3.0; alias annotations left out), so the direct path's filling of arguments by name is tested on
# every machine, with or without the FA3 wheel.
_FAKE_FA3_LIB = torch.library.Library("fa_compile_test_fa3", "DEF")
_FAKE_FA3_LIB.define(
    "fwd(Tensor q, Tensor k, Tensor v, Tensor? k_new=None, Tensor? v_new=None, Tensor? q_v=None, Tensor? out=None, "
    "Tensor? cu_seqlens_q=None, Tensor? cu_seqlens_k=None, Tensor? cu_seqlens_k_new=None, Tensor? seqused_q=None, "
    "Tensor? seqused_k=None, int? max_seqlen_q=None, int? max_seqlen_k=None, Tensor? page_table=None, "
    "Tensor? kv_batch_idx=None, Tensor? leftpad_k=None, Tensor? rotary_cos=None, Tensor? rotary_sin=None, "
    "Tensor? seqlens_rotary=None, Tensor? q_descale=None, Tensor? k_descale=None, Tensor? v_descale=None, "
    "float? softmax_scale=None, bool is_causal=False, int window_size_left=-1, int window_size_right=-1, "
    "int attention_chunk=0, float softcap=0.0, bool is_rotary_interleaved=False, Tensor? scheduler_metadata=None, "
    "int num_splits=0, bool? pack_gqa=None, int sm_margin=0) -> (Tensor, Tensor, Tensor, Tensor)"
)
_FAKE_FA3_ARGS = torch.ops.fa_compile_test_fa3.fwd.default._schema.arguments
_FA3_WE_FILL = ("q", "k", "v", "seqused_k", "softmax_scale", "is_causal", "window_size_left", "window_size_right",
                "softcap", "num_splits")


def _fake_fa3_fwd(*args, **kwargs):
    # the dispatcher drops trailing arguments equal to their defaults
    a = {x.name: args[i] if i < len(args) else kwargs.get(x.name, x.default_value) for i, x in enumerate(_FAKE_FA3_ARGS)}
    for x in _FAKE_FA3_ARGS:  # everything the adapter does not fill keeps its default
        if x.name not in _FA3_WE_FILL:
            assert a[x.name] == x.default_value, (x.name, a[x.name])
    out, lse, _, _ = _fa3_semantics_forward(
        a["q"], a["k"], a["v"], seqused_k=a["seqused_k"], softmax_scale=a["softmax_scale"], causal=a["is_causal"],
        window_size_left=a["window_size_left"], window_size_right=a["window_size_right"], softcap=a["softcap"],
        num_splits=a["num_splits"])
    return out, lse, lse.new_empty(0), lse.new_empty(0)


_FAKE_FA3_LIB.impl("fwd", _fake_fa3_fwd, "CPU")


@pytest.mark.parametrize("path", ["wrapper", "direct"])
@pytest.mark.parametrize("nq,nk,kw", FA3_PLUMBING)
def test_fa3_translation_of_diagonal_window_and_kv_lens(monkeypatch, nq, nk, kw, path):
    """The FA3 candidate's argument translation against FA3's documented semantics (no GPU needed),
    through each of its two call paths, the Python wrapper and the C++ op called directly: both are
    replaced here, so the test means the same with or without FA3 installed."""
    fake = types.SimpleNamespace(_flash_attn_forward=_fa3_semantics_forward)
    monkeypatch.setattr(fa3, "_module", lambda: (fake, {}, ""))
    direct = fa3.direct_plan(torch.ops.fa_compile_test_fa3.fwd.default) if path == "direct" else None
    assert path == "wrapper" or direct is not None
    monkeypatch.setattr(fa3, "_direct_forward", lambda: direct)
    torch.manual_seed(3)
    b, hq, hkv, d = 3, 4, 2, 8
    q = torch.randn(b, nq, hq, d).transpose(1, 2)
    k = torch.randn(b, nk, hkv, d).transpose(1, 2)
    v = torch.randn(b, nk, hkv, d).transpose(1, 2)
    kw = dict(kw)
    if "kv_lens" in kw:
        kw["kv_lens"] = torch.tensor(kw["kv_lens"])
    args = AttentionArgs(q=q, k=k, v=v, scale=0.35, **kw)
    out, lse = fa3.FA3.forward(args)
    exp, exp_lse = ref.attention_reference(q.double(), k.double(), v.double(), **args.mask_kwargs())
    torch.testing.assert_close(out, exp.float(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, exp_lse.float(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cand", [sdpa.CUDNN, sdpa.FLASH, sdpa.EFFICIENT], ids=lambda c: c.name)
def test_sdpa_calls_match_the_op_schemas_on_meta(cand):
    """Argument order and lse shapes against torch's own meta functions of the private ops."""
    b, hq, hkv, nq, nk, d = 2, 4, 4 if cand is sdpa.EFFICIENT else 2, 24, 24, 64
    mk = lambda n, h: torch.empty(b, n, h, d, device="meta", dtype=BF16).transpose(1, 2)
    q, k, v = mk(nq, hq), mk(nk, hkv), mk(nk, hkv)
    kw = dict(kv_lens=torch.empty(b, device="meta", dtype=torch.int32)) if cand is sdpa.CUDNN else {}
    args = AttentionArgs(q=q, k=k, v=v, scale=0.125, causal=True, needs_backward=True, **kw)
    out, lse = cand.forward(args)
    assert out.shape == (b, hq, nq, d) and lse.shape == (b, hq, nq) and lse.dtype == torch.float32
    if cand.has_backward():
        dq, dk, dv, db = cand.backward(args, torch.empty_like(out), out, lse)
        assert (dq.shape, dk.shape, dv.shape, db) == (q.shape, k.shape, v.shape, None)


def test_fa3_needs_sm90(fake_fa3, monkeypatch):
    monkeypatch.setattr(common, "device_capability", lambda device: (8, 0))
    assert "needs sm90..sm90, device is sm80" in reasons(fa3.FA3, fake_args())


def test_fa4_is_opt_in(hopper, monkeypatch):
    monkeypatch.setattr(fa4, "_module", lambda: (types.SimpleNamespace(_flash_attn_fwd=None), ""))
    assert "opt in" in fa4.FA4.opt_in_reason()
    monkeypatch.setenv("FA_COMPILE_FA4", "1")
    assert fa4.FA4.opt_in_reason() is None
    assert reasons(fa4.FA4, fake_args()) == ""
    assert not fa4.FA4.has_backward()


@pytest.mark.parametrize("dims", [dict(b=0), dict(hq=0, hkv=0), dict(nq=0), dict(nk=0), dict(d=0, dv=64), dict(dv=0)],
                         ids=["batch", "heads", "queries", "keys", "head_dim", "v_head_dim"])
def test_zero_size_cuda_inputs_take_the_trivial_path_before_any_kernel(hopper, fake_fa3, dims, monkeypatch):
    """On a (fake) sm90 device, with every peer 'importable': no kernel is asked, whatever is forced."""
    asked = []
    for cand in dispatch.candidates("forward") + dispatch.candidates("backward"):
        if cand.name != "reference":
            monkeypatch.setattr(cand, "not_supported_reasons", lambda a, n=cand.name: asked.append(n) or [], raising=False)
    args = fake_args(causal=True, needs_backward=True, **dims)
    assert dispatch.select_forward(args).name == "reference"
    assert dispatch.select_backward(args, "cudnn").name == "reference"
    for direction in ("forward", "backward"):
        chosen, refused = dispatch.explain_choice(args, None, direction)
        assert chosen == "reference" and "= 0" in refused[0][1][0]
    assert asked == []


def test_reference_takes_everything(hopper):
    a = fake_args(softcap=5.0, dropout_p=0.2, window_left=3, bias=((64, 64), torch.float32), dtype=torch.float64)
    assert dispatch.ReferenceCandidate().not_supported_reasons(a) == []


# ---------------------------------------------------------------------------------------------
# order, forced kernels, errors
# ---------------------------------------------------------------------------------------------

def test_order_short_prefill_cudnn_first_long_prefill_fa3_first(hopper, fake_fa3):
    short = fake_args(nq=1024, nk=1024, causal=True)
    long = fake_args(nq=2048, nk=2048, causal=True)
    decode = fake_args(nq=1, nk=8192, causal=True, diag_offset=8191)
    assert [c.name for c in dispatch.ordered(short)][:2] == ["cudnn", "fa3"]
    assert [c.name for c in dispatch.ordered(long)][:2] == ["fa3", "cudnn"]
    assert dispatch.select_forward(short).name == "cudnn"
    assert dispatch.select_forward(long).name == "fa3"
    assert dispatch.select_forward(decode).name == "cudnn"
    assert dispatch.candidates("forward")[-1].name == "reference"
    assert dispatch.candidates("backward")[-1].name == "reference"
    assert "fa3" not in [c.name for c in dispatch.candidates("backward")]  # forward-only build
    assert "efficient" not in [c.name for c in dispatch.candidates("backward")]
    if any(c.name == "triton" for c in dispatch.candidates()):
        order = [c.name for c in dispatch.ordered(short)]
        assert order.index("triton") < order.index("flash")  # prefill: ours ahead of FA2
        order = [c.name for c in dispatch.ordered(decode)]
        assert order.index("flash") < order.index("triton")  # decode: FA2 ahead (no split-KV in ours)


def test_backward_chosen_separately_from_forward_only_kernel(hopper, fake_fa3):
    long = fake_args(nq=4096, nk=4096, causal=True, needs_backward=True)
    chosen, refused = dispatch.explain_choice(long, None, "forward")
    assert chosen == "fa3" and refused == []
    chosen_b, _ = dispatch.explain_choice(long, None, "backward")
    assert chosen_b == "cudnn"
    # a forced forward-only kernel leaves the backward to dispatch
    assert dispatch.select_backward(long, forced="fa3").name == "cudnn"


def test_explain_choice_lists_faster_refused_candidates(hopper, fake_fa3):
    a = fake_args(softcap=30.0)
    chosen, refused = dispatch.explain_choice(a, None, "forward")
    names = [n for n, _ in refused]
    assert names[:3] == ["cudnn", "fa3", "fa4"]
    assert all(r for _, r in refused)
    assert chosen in ("triton", "reference")
    assert any("no softcap" in "; ".join(r) for n, r in refused if n == "cudnn")


def test_forced_kernel_errors_name_the_argument(hopper, monkeypatch):
    with pytest.raises(NoKernelError, match=r"kernel: the forced forward kernel 'cudnn' cannot take these inputs: .*no softcap"):
        dispatch.select_forward(fake_args(softcap=30.0), forced="cudnn")
    with pytest.raises(ValueError, match="kernel: unknown forward kernel 'nope'"):
        dispatch.select_forward(fake_args(), forced="nope")
    monkeypatch.setenv("FA_COMPILE_KERNEL", "flash")
    with pytest.raises(NoKernelError, match="FA_COMPILE_KERNEL: the forced forward kernel 'flash'.*no attention bias"):
        dispatch.select_forward(fake_args(bias=((64, 64), torch.bool)))
    assert dispatch.select_forward(fake_args()).name == "flash"
    # the argument wins over the environment
    assert dispatch.select_forward(fake_args(), forced="reference").name == "reference"


def test_forced_fa4_skips_the_opt_in(hopper, monkeypatch):
    monkeypatch.setattr(fa4, "_module", lambda: (types.SimpleNamespace(_flash_attn_fwd=None), ""))
    assert dispatch.select_forward(fake_args(), forced="fa4").name == "fa4"
    assert dispatch.select_forward(fake_args()).name == "cudnn"


def test_every_candidate_refusing_lists_all_reasons(hopper, monkeypatch):
    reg = dispatch.Registry(forward=[sdpa.CUDNN, sdpa.FLASH], backward=[sdpa.CUDNN])
    monkeypatch.setattr(dispatch, "_REGISTRY", reg)
    with pytest.raises(NoKernelError) as e:
        dispatch.select_forward(fake_args(softcap=2.0, dtype=torch.float64))
    msg = str(e.value)
    assert msg.startswith("no forward kernel takes these inputs")
    assert "cudnn: " in msg and "flash: " in msg and "no softcap" in msg and "float64" in msg


def test_cpu_inputs_get_the_reference_and_peers_say_why(hopper):
    a = fake_args(device="cpu")
    chosen, refused = dispatch.explain_choice(a)
    assert chosen == "reference"
    assert dict(refused)["cudnn"] == ["cuDNN (SDPA) runs on CUDA only, inputs are on cpu"]


def _site_with_call(args: AttentionArgs, forced=None):
    """A rewritten SiteReport whose fa3.attention node carries `args` as example values."""
    import torch.fx as fx

    from fa_compile.patterns.site import SiteReport

    g = fx.Graph()
    nodes = []
    for name in ("q", "k", "v"):
        n = g.placeholder(name)
        n.meta["example_value"] = getattr(args, name)
        nodes.append(n)
    call = g.call_function(torch.ops.fa3.attention.default, (
        *nodes, args.scale, args.causal, args.diag_offset, args.window_left, args.window_right, None, None,
        args.softcap, args.dropout_p, None, forced))
    return SiteReport(form="sdpa", rewritten=True, where="attn", q_shape=tuple(args.q.shape), k_shape=tuple(args.k.shape),
                      v_shape=tuple(args.v.shape), dtype=str(args.q.dtype), mask="causal", call=call)


def test_explain_shows_forward_and_backward_kernels_and_faster_refusals(hopper, fake_fa3):
    from fa_compile.report import ExplainReport

    with FakeTensorMode():
        # requires_grad set on the BSHD views (a CUDA fake leaf with autograd aborts on CPU-only builds)
        q = torch.empty(1, 2048, 16, 64, device="cuda", dtype=BF16).transpose(1, 2).requires_grad_()
        k = torch.empty(1, 2048, 16, 64, device="cuda", dtype=BF16).transpose(1, 2).requires_grad_()
    site = _site_with_call(AttentionArgs(q=q, k=k, v=k, scale=0.125, causal=True, softcap=30.0))
    row = ExplainReport.from_reports([site]).rows[0]
    assert row.kernel_fwd in ("triton", "reference") and row.kernel_bwd in ("triton", "reference")
    assert [n for n, _ in row.refused][:3] == ["fa3", "cudnn", "fa4"]  # long prefill: FA3 is tried first
    text = str(ExplainReport.from_reports([site]))
    assert "cudnn (fwd, bwd): cuDNN (SDPA) has no softcap" in text  # refused in both passes, one line
    # without softcap: FA3 forward, cuDNN backward from FA3's lse
    site = _site_with_call(AttentionArgs(q=q, k=k, v=k, scale=0.125, causal=True))
    row = ExplainReport.from_reports([site]).rows[0]
    assert (row.kernel_fwd, row.kernel_bwd) == ("fa3", "cudnn") and row.refused == [] and row.refused_bwd == []
    assert "fa3 / cudnn" in str(ExplainReport.from_reports([site]))


# ---------------------------------------------------------------------------------------------
# run-time fallback, lse helpers, bias building, tuning cache (real CPU tensors)
# ---------------------------------------------------------------------------------------------

class _Broken:
    name = "broken"

    def not_supported_reasons(self, args):
        return []

    def forward(self, args):
        raise RuntimeError("no execution plan for this shape")

    def backward(self, args, dout, out, lse):
        raise RuntimeError("no execution plan for this shape")


def test_runtime_failure_falls_back_with_a_warning(monkeypatch):
    torch.manual_seed(0)
    reg = dispatch.Registry(forward=[_Broken(), dispatch.ReferenceCandidate()], backward=[dispatch.ReferenceCandidate()])
    monkeypatch.setattr(dispatch, "_REGISTRY", reg)
    monkeypatch.delenv("FA_COMPILE_KERNEL", raising=False)
    q, k, v = (torch.randn(1, 2, 5, 8) for _ in range(3))
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        dispatch._WARNED.clear()
        out, lse = torch.ops.fa3.attention(q, k, v, 0.3)
    assert any("'broken' failed" in str(x.message) and "'reference' instead" in str(x.message) for x in w)
    exp, exp_lse = ref.attention_reference(q, k, v, scale=0.3)
    torch.testing.assert_close(out, exp, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(lse, exp_lse, atol=1e-6, rtol=1e-6)
    # forced: the failure is the user's answer, not hidden
    with pytest.raises(RuntimeError, match="no execution plan"):
        torch.ops.fa3.attention(q, k, v, 0.3, force_kernel="broken")


class _Picky:
    """Refuses under torch.use_deterministic_algorithms; counts how often it is asked."""

    name = "picky"
    asked = 0

    def not_supported_reasons(self, args):
        type(self).asked += 1
        return ["not deterministic"] if torch.are_deterministic_algorithms_enabled() else []

    def forward(self, args):
        return ref.attention_reference(args.q, args.k, args.v, **args.mask_kwargs())


def test_choice_is_memoised_per_metadata_and_settings(monkeypatch):
    reg = dispatch.Registry(forward=[_Picky(), dispatch.ReferenceCandidate()], backward=[dispatch.ReferenceCandidate()])
    monkeypatch.setattr(dispatch, "_REGISTRY", reg)
    monkeypatch.delenv("FA_COMPILE_KERNEL", raising=False)
    q = torch.randn(1, 2, 6, 8)
    a = AttentionArgs(q=q, k=q, v=q, scale=0.5)
    _Picky.asked = 0
    assert dispatch.select_forward(a).name == "picky"
    assert dispatch.select_forward(AttentionArgs(q=q.clone(), k=q, v=q, scale=0.1)).name == "picky"
    assert _Picky.asked == 1  # same metadata: asked once
    prev = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        assert dispatch.select_forward(a).name == "reference"  # a setting is part of the key
    finally:
        torch.use_deterministic_algorithms(prev)
    assert dispatch.select_forward(AttentionArgs(q=q, k=q, v=q, scale=0.5, causal=True)).name == "picky"
    assert _Picky.asked == 3


def test_finish_forward_normalises_empty_rows():
    out = torch.ones(1, 1, 3, 2)
    lse = torch.tensor([[[math.inf, 0.5, -math.inf]]])
    o, l = common.finish_forward(out, lse, maybe_empty=True)
    assert l.tolist() == [[[-math.inf, 0.5, -math.inf]]]
    assert o[0, 0, :, 0].tolist() == [0.0, 1.0, 0.0]
    o2, l2 = common.finish_forward(out, lse, maybe_empty=False)
    assert torch.isposinf(l2[0, 0, 0]) and o2[0, 0, 0, 0] == 1.0
    assert common.lse_for_backward(torch.tensor([-math.inf, 1.0])).tolist() == [math.inf, 1.0]


def test_sdpa_bias_matches_the_reference_masking():
    """bool keep-mask and kv_lens become one additive bias whose effect equals the reference's."""
    torch.manual_seed(1)
    b, h, nq, nk, d = 2, 3, 5, 19, 8  # Nk not a multiple of 16: the padded-row path
    q, k, v = (torch.randn(b, h, n, d) for n in (nq, nk, nk))
    keep = torch.rand(b, 1, nq, nk) > 0.3
    kv_lens = torch.tensor([7, 0])
    args = AttentionArgs(q=q, k=k, v=v, scale=0.4, bias=keep, kv_lens=kv_lens)
    bias = sdpa.CUDNN._bias(args)
    assert bias.shape == (b, h, nq, nk) and bias.dtype == q.dtype and bias.stride(-1) == 1
    assert bias.stride(-2) % 16 == 0 or bias.stride(-2) == 0
    s_ref = ref.scores_reference(q, k, scale=0.4, bias=keep, kv_lens=kv_lens)
    s_ours = ref.scores_reference(q, k, scale=0.4) + bias
    torch.testing.assert_close(s_ours, s_ref, atol=0, rtol=0)
    # a bias broadcast along keys is materialised along them (the kernels need a unit last stride)
    col = torch.randn(b, 1, nq, 1)
    bias = sdpa.CUDNN._bias(AttentionArgs(q=q, k=k, v=v, scale=0.4, bias=col))
    assert bias.stride(-1) == 1 and bias.stride(-2) % 16 == 0
    torch.testing.assert_close(bias, col.expand(b, h, nq, nk), atol=0, rtol=0)


def test_tuning_bucket_and_disk_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FA_COMPILE_CACHE_DIR", str(tmp_path))
    a = fake_args(nq=3000, nk=3000, causal=True, hq=16, hkv=8, d=128)
    key = tuning.bucket(a, "forward")
    assert key == "forward|bfloat16|d128/128|g2|nq4096|nk4096|bh32|c"
    tuning._store("H200|sm90|torch2.11", key, "fa3")
    assert tuning._load() == {"H200|sm90|torch2.11": {key: "fa3"}}
    monkeypatch.setenv("FA_COMPILE_TUNE", "1")
    assert tuning.enabled()
    tuning.enable(False)
    assert not tuning.enabled()
    tuning.enable(None)


def test_tuning_without_measurement_keeps_the_static_order(hopper, monkeypatch):
    monkeypatch.setenv("FA_COMPILE_TUNE", "1")
    a = fake_args()
    # fake tensors are never timed: the first eligible candidate stands, and explain says the rest were eligible
    assert dispatch.select_forward(a).name == "cudnn"
    chosen, refused = dispatch.explain_choice(a)
    assert chosen == "cudnn"


# ---------------------------------------------------------------------------------------------
# GPU: each candidate against the reference (skipped without CUDA)
# ---------------------------------------------------------------------------------------------

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

GPU_CASES = [
    # name, B, Hq, Hkv, Nq, Nk, D, kwargs
    ("plain", 2, 4, 4, 128, 128, 64, {}),
    ("causal", 2, 4, 4, 256, 256, 128, dict(causal=True)),
    ("gqa_causal", 1, 8, 2, 192, 192, 128, dict(causal=True)),
    ("nonsquare_noncausal", 2, 4, 4, 64, 320, 64, {}),
    ("top_left_nonsquare", 1, 4, 4, 64, 200, 64, dict(causal=True)),
    ("bottom_right", 1, 4, 4, 64, 200, 64, dict(causal=True, diag_offset=136)),
    ("decode", 4, 8, 2, 1, 1000, 128, dict(causal=True, diag_offset=999)),
    ("window_br", 1, 4, 4, 128, 256, 64, dict(window_left=32, window_right=0, diag_offset=128)),
    ("bool_bias_empty_rows", 2, 4, 4, 96, 96, 64, dict(bias="bool")),
    ("float_bias_grad", 1, 4, 4, 64, 80, 64, dict(bias="float")),
    ("kv_lens", 3, 4, 4, 64, 128, 64, dict(kv_lens=[128, 50, 0])),
    ("kv_lens_fa3", 3, 4, 4, 64, 128, 64, dict(kv_lens=[128, 50, 1])),
    ("d256", 1, 2, 2, 128, 128, 256, dict(causal=True)),
    ("d96", 1, 2, 2, 128, 128, 96, {}),
]

# Our Triton family has its own GPU tests (kernels); here the peers, whose conventions dispatch converts.
GPU_CANDIDATES = ["cudnn", "flash", "efficient", "fa3", "fa4"]


def _poison_allocator(nbytes: int = 1 << 26) -> None:
    """Fill freed cached blocks with NaN so a kernel output that is not fully written shows."""
    t = torch.empty(nbytes // 4, dtype=torch.float32, device="cuda").fill_(float("nan"))
    del t


def _gpu_args(case, dtype, needs_backward, seed):
    name, b, hq, hkv, nq, nk, d, kw = case
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(b, nq, hq, d, device="cuda", dtype=dtype, generator=g).transpose(1, 2)
    k = torch.randn(b, nk, hkv, d, device="cuda", dtype=dtype, generator=g).transpose(1, 2)
    v = torch.randn(b, nk, hkv, d, device="cuda", dtype=dtype, generator=g).transpose(1, 2)
    kw = dict(kw)
    if kw.get("bias") == "bool":
        keep = torch.rand(b, 1, nq, nk, device="cuda", generator=g) > 0.2
        keep[:, :, 3] = False  # a fully masked row: out 0, lse -inf
        kw["bias"] = keep
    elif kw.get("bias") == "float":
        kw["bias"] = torch.randn(1, hq, nq, nk, device="cuda", dtype=dtype, generator=g)
        kw["bias_requires_grad"] = needs_backward
    if "kv_lens" in kw:
        kw["kv_lens"] = torch.tensor(kw["kv_lens"], device="cuda", dtype=torch.int32)
    return AttentionArgs(q=q, k=k, v=v, scale=1 / math.sqrt(d), needs_backward=needs_backward, **kw)


def _tols(dtype):
    return {torch.bfloat16: dict(atol=2e-2, rtol=2e-2), torch.float16: dict(atol=3e-3, rtol=3e-3),
            torch.float32: dict(atol=3e-3, rtol=3e-3)}[dtype]


def _cand(name):
    for c in dispatch.candidates("forward") + dispatch.candidates("backward"):
        if c.name == name:
            return c
    return None


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", GPU_CASES, ids=[c[0] for c in GPU_CASES])
@pytest.mark.parametrize("name", GPU_CANDIDATES)
def test_gpu_candidate_forward_matches_reference(name, case, dtype, monkeypatch):
    monkeypatch.setenv("FA_COMPILE_FA4", "1")
    cand = _cand(name)
    if cand is None:
        pytest.skip(f"{name} not registered here")
    args = _gpu_args(case, dtype, needs_backward=False, seed=zlib.crc32(f'{name}/{case[0]}'.encode()) % 1000)
    why = cand.not_supported_reasons(args)
    if why:
        pytest.skip("; ".join(why))
    _poison_allocator()
    out, lse = cand.forward(args)
    exp, exp_lse = ref.attention_reference(*(t.float() for t in (args.q, args.k, args.v)), **{
        **args.mask_kwargs(), "bias": None if args.bias is None else (args.bias if args.bias.dtype == torch.bool else args.bias.float())})
    assert lse.shape == exp_lse.shape and lse.dtype == torch.float32
    torch.testing.assert_close(out.float(), exp, **_tols(dtype))
    torch.testing.assert_close(lse, exp_lse, atol=2e-3, rtol=2e-3)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16])
@pytest.mark.parametrize("case", GPU_CASES, ids=[c[0] for c in GPU_CASES])
@pytest.mark.parametrize("name", GPU_CANDIDATES)
def test_gpu_candidate_backward_matches_reference(name, case, dtype, monkeypatch):
    """The backward from the reference's saved lse (any forward's lse means the same)."""
    monkeypatch.setenv("FA_COMPILE_FA4", "1")
    cand = next((c for c in dispatch.candidates("backward") if c.name == name), None)
    if cand is None:
        pytest.skip(f"{name} has no backward here")
    args = _gpu_args(case, dtype, needs_backward=True, seed=zlib.crc32(f'{name}/{case[0]}/b'.encode()) % 1000)
    why = cand.not_supported_reasons(args)
    if why:
        pytest.skip("; ".join(why))
    out, lse = ref.attention_reference(args.q, args.k, args.v, **args.mask_kwargs())
    dout = torch.randn_like(out)
    _poison_allocator()
    dq, dk, dv, db = cand.backward(args, dout, out, lse)
    up = lambda t: None if t is None else (t if t.dtype == torch.bool else t.float())
    e = ref.attention_backward_reference(dout.float(), args.q.float(), args.k.float(), args.v.float(),
                                         bias_requires_grad=args.bias_requires_grad,
                                         **{**args.mask_kwargs(), "bias": up(args.bias)})
    for got, want in zip((dq, dk, dv, db), e):
        if want is None:
            assert got is None or not args.bias_requires_grad
            continue
        scale = want.abs().max().item() or 1.0
        torch.testing.assert_close(got.float(), want, atol=2e-2 * scale, rtol=2e-2)


@gpu
@pytest.mark.gpu
def test_gpu_op_end_to_end_with_autograd_and_kernel_choice():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 8, 1024, 128, device="cuda", dtype=BF16, requires_grad=True) for _ in range(3))
    args = AttentionArgs(q=q, k=k, v=v, scale=0.088, causal=True, needs_backward=True)
    assert dispatch.select_forward(args).name == "cudnn"
    out, lse = torch.ops.fa3.attention(q, k, v, 0.088, True)
    exp, _ = ref.attention_reference(q.detach().float(), k.detach().float(), v.detach().float(), scale=0.088, causal=True)
    torch.testing.assert_close(out.float(), exp, atol=2e-2, rtol=2e-2)
    out.float().square().sum().backward()
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in (q, k, v))


@gpu
@pytest.mark.gpu
def test_gpu_fp32_goes_to_tf32_kernels_only_when_precision_allows():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 128, 64, device="cuda") for _ in range(3))
    args = AttentionArgs(q=q, k=k, v=v, scale=0.125, causal=True)
    prec = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        assert "'highest'" in reasons(sdpa.EFFICIENT, args)
        torch.set_float32_matmul_precision("high")
        assert reasons(sdpa.EFFICIENT, args) == ""
        _poison_allocator()
        out, lse = sdpa.EFFICIENT.forward(args)
    finally:
        torch.set_float32_matmul_precision(prec)
    exp, exp_lse = ref.attention_reference(q.double(), k.double(), v.double(), scale=0.125, causal=True)
    # TF32 operands carry 10 mantissa bits, about fp16's precision
    torch.testing.assert_close(out.double(), exp, atol=5e-3, rtol=5e-3)
    torch.testing.assert_close(lse.double(), exp_lse, atol=5e-3, rtol=5e-3)


@gpu
@pytest.mark.gpu
def test_gpu_forward_only_fa3_then_cudnn_backward_through_the_op():
    """Issue 4 item 4: FA3 (forward-only build) forward, the backward from another kernel on its lse."""
    torch.manual_seed(0)
    q = torch.randn(1, 2048, 4, 64, device="cuda", dtype=BF16).transpose(1, 2).requires_grad_()
    k = torch.randn(1, 2048, 2, 64, device="cuda", dtype=BF16).transpose(1, 2).requires_grad_()
    v = torch.randn(1, 2048, 2, 64, device="cuda", dtype=BF16).transpose(1, 2).requires_grad_()
    args = AttentionArgs(q=q, k=k, v=v, scale=0.125, causal=True, needs_backward=True)
    fwd, bwd = dispatch.select_forward(args).name, dispatch.select_backward(args).name
    if fwd != "fa3":
        pytest.skip(f"FA3 not chosen here: {dispatch.explain_choice(args)}")
    assert bwd != "fa3"
    out, _lse = torch.ops.fa3.attention(q, k, v, 0.125, True)
    dout = torch.randn_like(out)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
    exp, _ = ref.attention_reference(qf, kf, vf, scale=0.125, causal=True)
    eq, ek, ev = torch.autograd.grad(exp, (qf, kf, vf), dout.float())
    torch.testing.assert_close(out.float(), exp, atol=2e-2, rtol=2e-2)
    for got, want in ((dq, eq), (dk, ek), (dv, ev)):
        torch.testing.assert_close(got.float(), want, atol=2e-2 * want.abs().max().item(), rtol=2e-2)


def test_backward_order_puts_gluon_backward_ahead_of_fa2(hopper, monkeypatch):
    # On Hopper our backward runs the Gluon kernel for structural masks at head dims 33..128 and then
    # leads FA2 (dispatch probe 2026-12-01); elsewhere FA2 keeps its place ahead of our `tl` pair.
    names = [c.name for c in dispatch.candidates("backward")]
    if "triton" not in names or "flash" not in names:
        pytest.skip("needs the triton and FA2 candidates registered")

    def order(**kw):
        got = [c.name for c in dispatch.ordered(fake_args(needs_backward=True, **kw), "backward")]
        return got.index("triton") < got.index("flash")

    assert order(d=128, causal=True) and order(d=64, hkv=2) and order(d=96)
    assert dispatch.ordered(fake_args(d=128, needs_backward=True), "backward")[0].name == "cudnn"
    assert not order(d=256)  # the tl backward
    assert not order(d=128, bias=((2, 1, 64, 64), BF16))
    assert not order(d=128, softcap=30.0)
    assert not order(d=36)  # not a multiple of 8
    monkeypatch.setenv("FA_COMPILE_GLUON", "0")
    assert not order(d=128)
    monkeypatch.delenv("FA_COMPILE_GLUON")
    torch.use_deterministic_algorithms(True)
    try:
        assert not order(d=128)
    finally:
        torch.use_deterministic_algorithms(False)
    monkeypatch.setattr(common, "device_capability", lambda device: (8, 0))
    assert not order(d=128)


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
@pytest.mark.parametrize("causal", [False, "bottom_right"])
def test_nothing_past_kv_lens_is_read_through_dispatch(dtype, causal):
    # A cache's unused slots (NaN / inf past each length) change no output or gradient bit, on whatever kernel
    # dispatch picks here (the reference on CPU, which multiplies a value by its probability of 0 unless
    # dispatch zeroes it first): the same contract as the kernels that never load those rows.
    torch.manual_seed(0)
    lens = torch.tensor([40, 13, 0])
    q = torch.randn(3, 4, 6, 32, dtype=dtype)
    k, v = torch.randn(3, 2, 40, 32, dtype=dtype), torch.randn(3, 2, 40, 24, dtype=dtype)
    from fa_compile.kernels.triton_testing import past_lens_filled

    results = []
    for poison in (False, True):
        kk, vv = past_lens_filled(k, v, lens, poison)
        qg, kg, vg = (t.clone().requires_grad_() for t in (q, kk, vv))
        out = fa_compile.attention(qg, kg, vg, kv_lens=lens, causal=causal)
        results.append((out, *torch.autograd.grad(out.float().sum(), (qg, kg, vg))))
    for name, clean, poisoned in zip(("out", "dq", "dk", "dv"), *results):
        assert torch.isfinite(poisoned).all(), name
        assert torch.equal(poisoned, clean), name
    assert (results[1][2][1, :, 13:] == 0).all() and (results[1][3][1, :, 13:] == 0).all()


def test_kv_lens_zeroed_only_for_kernels_that_would_read_them():
    # dispatch zeroes K and V past kv_lens (copies) for a kernel that masks scores but reads every value, and
    # hands the inputs through untouched to one that never loads those rows.
    q, k, v = torch.randn(2, 2, 4, 8), torch.randn(2, 2, 9, 8), torch.randn(2, 2, 9, 8)
    args = AttentionArgs(q, k, v, 0.5, False, kv_lens=torch.tensor([9, 3]))
    reader = types.SimpleNamespace(name="reads_all")
    skipper = types.SimpleNamespace(name="skips", never_reads_past_kv_lens=True)
    got = dispatch._within_kv_lens(reader, args)
    assert torch.equal(got.k[1, :, 3:], torch.zeros(2, 6, 8)) and torch.equal(got.v[1, :, :3], v[1, :, :3])
    assert torch.equal(got.k[0], k[0]) and k[1, :, 3:].abs().sum() > 0  # the caller's tensors are not written
    assert dispatch._within_kv_lens(skipper, args) is args
    no_lens = AttentionArgs(q, k, v, 0.5, False)
    assert dispatch._within_kv_lens(reader, no_lens) is no_lens
    from fa_compile.kernels import decode, triton_family

    assert triton_family.TRITON.never_reads_past_kv_lens and decode.DECODE.never_reads_past_kv_lens
    assert not getattr(sdpa.CUDNN, "never_reads_past_kv_lens", False)


@pytest.mark.parametrize("nq,nk,kw", FA3_PLUMBING)
def test_fa3_lowered_forward_fills_the_cpp_call_by_position(monkeypatch, nq, nk, kw):
    """The lowered node's body (lowering/fa3.py `_forward`) fills FA3's C++ forward by position from a plan made once;
    against FA3's documented semantics through the CPU stand-in, which also checks that every other argument keeps
    its default."""
    from fa_compile.lowering import fa3 as fa3_lowered

    fake = types.SimpleNamespace(_flash_attn_forward=_fa3_semantics_forward)
    monkeypatch.setattr(fa3, "_module", lambda: (fake, {}, ""))
    monkeypatch.setattr(fa3, "_direct_forward", lambda: fa3.direct_plan(torch.ops.fa_compile_test_fa3.fwd.default))
    fa3_lowered._plan.cache_clear()
    try:
        torch.manual_seed(5)
        b, hq, hkv, d = 3, 4, 2, 8
        q, k, v = torch.randn(b, nq, hq, d), torch.randn(b, nk, hkv, d), torch.randn(b, nk, hkv, d)  # BSHD
        kw = dict(kw)
        if "kv_lens" in kw:
            kw["kv_lens"] = torch.tensor(kw["kv_lens"])
        args = AttentionArgs(q=q.transpose(1, 2), k=k.transpose(1, 2), v=v.transpose(1, 2), scale=0.35, **kw)
        causal, wl, wr = fa3.FA3._window(args)
        seqused = None if args.kv_lens is None else args.kv_lens.clamp(0, nk).to(torch.int32)
        out, lse = fa3_lowered._forward(q, k, v, seqused, 0.35, causal, wl, wr, 0.0, 0)
        exp, exp_lse = ref.attention_reference(args.q.double(), args.k.double(), args.v.double(), **args.mask_kwargs())
        torch.testing.assert_close(out.transpose(1, 2), exp.float(), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(lse, exp_lse.float(), atol=1e-5, rtol=1e-5)
    finally:
        fa3_lowered._plan.cache_clear()
