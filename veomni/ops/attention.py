"""Packed (varlen) causal attention that never builds an (S x S) mask, registered with transformers.

`attn_implementation="veomni_varlen"` (the default) reads the document boundaries of a packed row from
`cu_seq_lens_q/k` (emitted by `MainCollator`) or, failing that, from restarts in `position_ids`, and attends
within each document only. The kernel is chosen per call from what the device offers:

    CUDA, `flash_attn` installed, bf16/fp16   -> flash_attn_varlen_func
    CUDA otherwise, bf16/fp16                  -> torch varlen_attn (cuDNN / flash inside torch, torch >= 2.11)
    anywhere else (CPU, fp32)                  -> causal SDPA per document, documents of equal length batched

On CPU the per-document path is exact and ~4x faster than SDPA over a block-diagonal mask (which computes every
masked-out block). A row without packing (one document, or a padded batch) goes to transformers' own SDPA.

`resolve_attn_implementation` maps the names users write to what can run here: `flash_attention_2/3` without the
`flash_attn` package run `veomni_varlen` instead, with one log line saying so.
"""

import functools
import importlib.util
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

from ..compat.transformers import skip_packed_sequence_detection
from ..utils.logging import get_logger

logger = get_logger(__name__)

VARLEN = "veomni_varlen"
_FLASH_PACKAGES = {"flash_attention_2": "flash_attn", "flash_attention_3": "flash_attn_interface"}


def _has_package(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


@functools.lru_cache(maxsize=None)
def _log_once(message: str) -> None:
    logger.info(message)


# VeOmni's names for its flash attention with Ulysses built in (verl's VeOmni engine sends them): here the varlen
# kernel, which reads cu_seq_lens like flash attention; `build_parallelize_model` wraps it in Ulysses when the parallel
# state has ulysses_size > 1, as it wraps any other attention
WITH_SP_NAMES = tuple(f"veomni_flash_attention_{v}_with_sp" for v in (2, 3, 4))


def resolve_attn_implementation(name: Optional[str]) -> Optional[str]:
    """The implementation that will run for `name`: a flash kernel whose package is missing becomes veomni_varlen,
    and so does each of VeOmni's `veomni_flash_attention_{2,3,4}_with_sp`."""
    if name in WITH_SP_NAMES:
        _log_once(f"attn_implementation={name}: running {VARLEN} (Ulysses-wrapped when ulysses_size > 1)")
        return VARLEN
    package = _FLASH_PACKAGES.get(name)
    if package is not None and not _has_package(package):
        _log_once(f"attn_implementation={name}: package `{package}` is not installed; running {VARLEN} instead")
        return VARLEN
    return name


def varlen_backend(device: torch.device, dtype: torch.dtype) -> str:
    """Which kernel `veomni_varlen` uses for tensors on `device` of `dtype` (see the module docstring)."""
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
        return "sdpa_per_document"
    return "flash_attn" if _has_package("flash_attn") else "torch_varlen"


# ----------------------------------------------------------------------------------------------- boundaries
def _cu_seqlens_from_position_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """Document starts where a position does not continue the previous one (and at every row start)."""
    flat = position_ids.reshape(-1)
    starts = torch.ones_like(flat, dtype=torch.bool)
    starts[1:] = flat[1:] != flat[:-1] + 1
    starts[:: position_ids.shape[-1]] = True
    idx = torch.nonzero(starts).flatten().to(torch.int32)
    return torch.cat([idx, idx.new_tensor([flat.numel()])])


def _document_bounds(query: torch.Tensor, attention_mask, kwargs) -> Optional[torch.Tensor]:
    """cu_seqlens over the flattened (batch * seq) tokens of a packed batch; None when there is no packing."""
    batch, _, q_len, _ = query.shape
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None:
        position_ids = kwargs.get("position_ids")
        if position_ids is None or position_ids.shape[-1] != q_len or q_len == 1:
            return None
        if attention_mask is not None and not bool(attention_mask.all()):
            return None  # a padded batch: transformers' padding path handles it
        cu = _cu_seqlens_from_position_ids(position_ids.expand(batch, -1))
    return cu if cu.numel() > 2 or batch > 1 else None


# ------------------------------------------------------------------------------------------------ kernels
def _sdpa_per_document(q, k, v, lengths: List[int], scaling, dropout, window: Optional[int]) -> torch.Tensor:
    """q/k/v [1, H, T, D] -> [1, H, T, D]; one causal SDPA per document, equal lengths batched into one call.

    Documents are cut with `split` (its backward is one `cat`), not slicing: each slice's backward would write a
    zero-filled [1, H, T, D] gradient, i.e. O(documents x T) memory traffic per layer."""
    gqa = q.shape[1] != k.shape[1]
    q_docs, k_docs, v_docs = (t.split(lengths, dim=2) for t in (q, k, v))
    by_length = {}
    for i, n in enumerate(lengths):
        by_length.setdefault(n, []).append(i)
    pieces: List[Optional[torch.Tensor]] = [None] * len(lengths)
    for n, docs in by_length.items():
        qs, ks, vs = (docs_of[docs[0]] if len(docs) == 1 else torch.cat([docs_of[d] for d in docs])
                      for docs_of in (q_docs, k_docs, v_docs))  # fmt: skip
        mask, causal = None, True
        if window is not None and window < n:  # sliding window: a small per-document band, not an S x S mask
            i = torch.arange(n, device=q.device)
            mask, causal = (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < window), False
        out = F.scaled_dot_product_attention(
            qs, ks, vs, attn_mask=mask, dropout_p=dropout, is_causal=causal, scale=scaling, enable_gqa=gqa
        )
        if len(docs) == 1:
            pieces[docs[0]] = out
        else:
            for d, piece in zip(docs, out.split(1)):
                pieces[d] = piece
    return torch.cat(pieces, dim=2)


def _flash_attn(q, k, v, cu, max_len, scaling, dropout, window):  # [T, H, D] layout
    from flash_attn import flash_attn_varlen_func

    return flash_attn_varlen_func(
        q, k, v, cu, cu, max_len, max_len, dropout_p=dropout, softmax_scale=scaling, causal=True,
        window_size=(window - 1, 0) if window else (-1, -1),
    )  # fmt: skip


@functools.lru_cache(maxsize=None)
def _torch_varlen_has_gqa() -> bool:
    """Whether torch's varlen_attn takes `enable_gqa` (not every torch >= 2.11 does)."""
    import inspect

    from torch.nn.attention.varlen import varlen_attn

    return "enable_gqa" in inspect.signature(varlen_attn).parameters


def _torch_varlen(q, k, v, cu, max_len, scaling, dropout, window):  # [T, H, D] layout; dropout is 0 (the caller's)
    from torch.nn.attention.varlen import varlen_attn

    options = {"scale": scaling, "window_size": (window - 1 if window else -1, 0)}  # (-1, 0): causal, unbounded left
    if q.shape[1] != k.shape[1]:
        if _torch_varlen_has_gqa():
            options["enable_gqa"] = True
        else:  # no GQA in the kernel: copy each KV head for its query heads
            k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    return varlen_attn(q, k, v, cu, cu, max_len, max_len, **options)


_VARLEN_KERNELS = {"flash_attn": _flash_attn, "torch_varlen": _torch_varlen}


# ------------------------------------------------------------------------------------------ the interface
# compiled decoder layers (ops_implementation.compile) call it eagerly: its kernels are fused already and its
# document bookkeeping is Python
@torch.compiler.disable
def varlen_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    sliding_window: Optional[int] = None,
    **kwargs,
) -> Tuple[torch.Tensor, None]:
    """transformers attention function: query [B, H, S, D], key/value [B, Hkv, S, D] -> ([B, S, H, D], None)."""
    if torch.is_autocast_enabled(query.device.type):  # as SDPA under autocast (Qwen3's q/k norms return fp32)
        dtype = torch.get_autocast_dtype(query.device.type)
        query, key, value = (t.to(dtype) for t in (query, key, value))
    cu = _document_bounds(query, attention_mask, kwargs)
    if cu is None:
        return _unpacked_forward(module, query, key, value, attention_mask, dropout, scaling, sliding_window, kwargs)
    batch, heads, seq, dim = query.shape
    # flatten the batch into one row of documents: [1, H, B*S, D]
    q, k, v = (t.transpose(0, 1).reshape(1, t.shape[1], batch * seq, dim) for t in (query, key, value))
    backend = varlen_backend(query.device, query.dtype)
    if dropout and backend == "torch_varlen":  # the kernel takes no attention dropout
        _log_once(f"attention dropout {dropout}: {backend} has none; running causal SDPA per document instead")
        backend = "sdpa_per_document"
    _log_once(f"{VARLEN}: packed documents attend through {backend} ({query.device.type}, {query.dtype})")
    max_len = kwargs.get("max_length_q")
    if backend in _VARLEN_KERNELS:
        cu32 = cu.to(device=query.device, dtype=torch.int32)
        max_len = int(max_len) if max_len is not None else int((cu32[1:] - cu32[:-1]).max())
        qt, kt, vt = (t[0].transpose(0, 1) for t in (q, k, v))  # [T, H, D]
        out = _VARLEN_KERNELS[backend](qt, kt, vt, cu32, max_len, scaling, dropout, sliding_window)
        out = out.reshape(batch, seq, heads, dim)
    else:
        lengths = (cu[1:] - cu[:-1]).tolist()
        if sum(lengths) != batch * seq:
            raise ValueError(f"cu_seq_lens cover {sum(lengths)} tokens but the attention sees {batch * seq}")
        out = _sdpa_per_document(q, k, v, lengths, scaling, dropout, sliding_window)
        out = out[0].reshape(heads, batch, seq, dim).permute(1, 2, 0, 3)
    return out, None


def _unpacked_forward(module, query, key, value, attention_mask, dropout, scaling, sliding_window, kwargs):
    """No packing: transformers' SDPA, with the 2-D padding mask (if any) made into a causal boolean mask."""
    q_len, kv_len = query.shape[2], key.shape[2]
    if attention_mask is not None or q_len != kv_len or sliding_window:
        i = torch.arange(q_len, device=query.device)[:, None] + (kv_len - q_len)
        j = torch.arange(kv_len, device=query.device)[None, :]
        mask = j <= i
        if sliding_window:
            mask = mask & (i - j < sliding_window)
        mask = mask[None, None]
        if attention_mask is not None:
            mask = mask & attention_mask[:, None, None, -kv_len:].bool()
        attention_mask = mask
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling)


AttentionInterface.register(VARLEN, varlen_attention_forward)
AttentionMaskInterface.register(VARLEN, flash_attention_mask)  # no (S x S) mask: at most the 2-D padding mask
skip_packed_sequence_detection(VARLEN)  # it finds the documents itself: transformers' search would read the device
