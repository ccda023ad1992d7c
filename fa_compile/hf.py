"""`attn_implementation="fa3"` for Hugging Face transformers: every attention of a model runs
`torch.ops.fa3.attention`, eagerly or under any torch.compile backend, with no graph rewrite.

    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="fa3")

Registration. `import fa_compile` calls `install()`, which costs no import of transformers: it
registers at once into the transformers modules that are already imported, and otherwise puts a
one-shot import hook on `sys.meta_path` that registers the moment `transformers.modeling_utils`
(AttentionInterface) and `transformers.masking_utils` (AttentionMaskInterface) finish importing.
Both registries are class-level, so every model (and every later `AttentionInterface()`) sees "fa3".
torch imports fa_compile at `import torch` (the `torch.backends` entry point of `_autoload`), so the
hook is in place without `import fa_compile`, unless TORCH_DEVICE_BACKEND_AUTOLOAD=0; it imports only
the standard library.

The mask reaches the op as structure wherever HF's mask function is one this module knows:
  causal (optionally with HF's sliding window), keys aligned bottom-right  -> a [B, Nk] bool key
      vector (padding; all True without padding) with the causal flag and the window taken from the
      attention call, as HF's FlashAttention integration reads a 2-D mask;
  bidirectional (encoders)                                                   -> a [B, 1, 1, Nk] bool
      key vector, or None without padding;
  a causal mask that needs no mask at all (no padding, Nq == Nk or Nq == 1) -> None, and is_causal.
Anything else (packed sequences, chunked or blockwise overlays, a static cache whose queries do not
sit at the end of the keys) gets HF's own SDPA mask, a dense [B, 1, Nq, Nk] bool tensor the op takes
as its boolean mask: never a guess.

Attention semantics follow HF's SDPA integration (a 4-D mask is used as it is, with no causal flag;
no mask means `is_causal` with SDPA's top-left alignment), plus a 2-D key vector as above. GQA and MQA
run without repeating K/V; `scaling`, `dropout`, `softcap` (Gemma 2) and T5's `position_bias` are
passed to the op, and so are attention sinks (GPT-OSS's per-head `s_aux` / `sinks` logit).
`output_attentions=True` returns no weights (as with "sdpa"), with a warning once. A query whose
every key is masked (a padded query whose sliding window holds only padding) gets 0, as with
FlashAttention; eager's finfo.min mask gives the mean of V there. Either is meaningless for a padded
position, and every other position matches.
"""
from __future__ import annotations

import importlib.machinery
import math
import sys
import warnings
from typing import Any, Callable, Optional

NAME = "fa3"
_HOOKED = ("transformers.modeling_utils", "transformers.masking_utils")


def attention_forward(
    module: Any,
    query: Any,
    key: Any,
    value: Any,
    attention_mask: Any,
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    is_causal: Optional[bool] = None,
    position_bias: Any = None,
    softcap: Optional[float] = None,
    sliding_window: Optional[int] = None,
    **kwargs: Any,
) -> tuple:
    """The AttentionInterface function: q [B, Hq, Nq, D], k / v [B, Hkv, Nk, D] -> ([B, Nq, Hq, Dv], None)."""
    import torch

    from . import ops  # noqa: F401  (registers torch.ops.fa3)

    sinks = kwargs.get("s_aux")
    if sinks is None:
        sinks = kwargs.get("sinks")
    if kwargs.get("output_attentions"):
        _warn_once("attn_implementation='fa3' returns no attention weights (output_attentions=True gets None, "
                   "as with 'sdpa'); use attn_implementation='eager' to get them")
    nq, nk = query.shape[2], key.shape[2]
    causal_wanted = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    causal, offset, window_left, bias = False, 0, -1, None
    if attention_mask is None:  # SDPA's semantics: is_causal, top-left (HF crops a static cache to match)
        causal = bool(causal_wanted) and nq > 1
    elif attention_mask.dim() == 2:  # a key vector from our mask function (or HF's FlashAttention one)
        causal = bool(causal_wanted)
        offset = nk - nq
        if sliding_window is not None and causal:
            window_left = int(sliding_window) - 1  # HF keeps key j for query i iff i - j < sliding_window
        bias = attention_mask[:, None, None, :].to(torch.bool)
    else:  # a 4-D mask (bool: True = attend, or additive float) used as it is, as SDPA does
        bias = attention_mask
    if position_bias is not None:  # T5: the additive position bias, with the mask folded in
        if bias is None:
            bias = position_bias
        elif bias.dtype == torch.bool:
            bias = torch.where(bias, position_bias, float("-inf"))
        else:
            bias = position_bias + bias
    if scaling is None:
        scaling = 1.0 / math.sqrt(query.shape[-1])
    dropout_p = float(dropout or 0.0)
    seed = None
    if dropout_p > 0:
        seed = torch.randint(0, 2**31 - 1, (), dtype=torch.int64, device=query.device)
    out, _ = torch.ops.fa3.attention(
        query, key, value, float(scaling), causal, offset, window_left, -1, bias, None,
        float(softcap or 0.0), dropout_p, seed, None, sinks=sinks,
    )
    return out.transpose(1, 2), None  # [B, Nq, Hq, Dv]: a free view of the op's BSHD storage


def mask_function(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: Any = 0,
    kv_offset: int = 0,
    mask_function: Optional[Callable] = None,
    attention_mask: Any = None,
    **kwargs: Any,
) -> Any:
    """The AttentionMaskInterface function: the mask in the form `attention_forward` reads as structure."""
    import torch
    from transformers import masking_utils as mu

    fn = mask_function if mask_function is not None else mu.causal_mask_function
    device = kwargs.get("device", attention_mask.device if attention_mask is not None else "cpu")

    def key_vector() -> "torch.Tensor":
        pad = mu.prepare_padding_mask(attention_mask, kv_length, kv_offset)
        if pad is None:
            return torch.ones(batch_size, kv_length, dtype=torch.bool, device=device)
        return pad[:, kv_offset:kv_offset + kv_length].to(torch.bool)

    if fn is mu.bidirectional_mask_function:
        if attention_mask is None:
            return None
        return key_vector()[:, None, None, :]
    window = _sliding_window_of(fn, mu)
    if fn is mu.causal_mask_function or window is not None:
        # the key vector carries no causal structure: it is valid only where the op's bottom-right diagonal
        # is HF's (query i at absolute position q_offset + i, key j at kv_offset + j)
        if isinstance(q_offset, int) and q_offset - kv_offset == kv_length - q_length:
            if attention_mask is None and (window is None or window >= kv_length) and (
                    kv_length == q_length or q_length == 1):
                return None  # no mask at all: SDPA's is_causal, which is this diagonal here (or admits every key)
            return key_vector()
    return mu.sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                        kv_offset=kv_offset, mask_function=fn, attention_mask=attention_mask,
                        **{k: v for k, v in kwargs.items() if k != "allow_is_causal_skip"},
                        allow_is_causal_skip=False)


def _sliding_window_of(fn: Callable, mu: Any) -> Optional[int]:
    """The window of HF's `sliding_window_causal_mask_function(w)` (an and_masks of its overlay and the
    causal function), recognised by its code objects; None for any other function."""
    try:
        overlay_code = mu.sliding_window_overlay(1).__code__
        and_code = mu.and_masks(mu.causal_mask_function).__code__
        if fn.__code__ is not and_code:
            return None
        cells = dict(zip(fn.__code__.co_freevars, (c.cell_contents for c in fn.__closure__ or ())))
        parts = cells.get("mask_functions")
        if not isinstance(parts, tuple) or len(parts) != 2 or parts[1] is not mu.causal_mask_function:
            return None
        overlay = parts[0]
        if getattr(overlay, "__code__", None) is not overlay_code:
            return None
        inner = dict(zip(overlay.__code__.co_freevars, (c.cell_contents for c in overlay.__closure__ or ())))
        w = inner.get("sliding_window")
        return w if isinstance(w, int) and w > 0 else None
    except Exception:  # another transformers version spells it differently: the dense mask is used
        return None


_WARNED: set = set()


def _warn_once(msg: str) -> None:
    if msg not in _WARNED:
        _WARNED.add(msg)
        warnings.warn(msg, stacklevel=3)


def register() -> None:
    """Register "fa3" in the transformers registries that are imported (both, once both are)."""
    mods = sys.modules
    if "transformers.modeling_utils" in mods and hasattr(mods["transformers.modeling_utils"], "AttentionInterface"):
        mods["transformers.modeling_utils"].AttentionInterface.register(NAME, attention_forward)
    if "transformers.masking_utils" in mods and hasattr(mods["transformers.masking_utils"], "AttentionMaskInterface"):
        mods["transformers.masking_utils"].AttentionMaskInterface.register(NAME, mask_function)


class _RegisterOnImport:  # a sys.meta_path finder (importlib.abc costs an import of importlib.resources)
    """Wraps the loader of the two transformers modules so that `register()` runs right after each loads."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name not in _HOOKED:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return None  # the normal machinery imports it; register() then runs on the next install()
        exec_module = loader.exec_module

        def exec_and_register(module: Any) -> None:
            exec_module(module)
            try:
                register()
            except Exception as e:  # never break the user's import of transformers
                warnings.warn(f"fa-compile could not register attn_implementation='fa3': {type(e).__name__}: {e}")

        loader.exec_module = exec_and_register
        return spec


def install() -> None:
    """Make "fa3" available to transformers: now for its imported modules, on import for the others."""
    if all(m in sys.modules for m in _HOOKED):
        register()
        return
    register()
    if not any(isinstance(f, _RegisterOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _RegisterOnImport())
