"""Ops: packed (varlen) attention, the token-normalised and chunked causal LM losses, mixture-of-experts kernels."""

from .attention import VARLEN, resolve_attn_implementation, varlen_attention_forward, varlen_backend
from .loss import IGNORE_INDEX, causal_lm_loss_sum, chunked_head_loss_sum, chunked_lm_head_loss, count_loss_tokens

__all__ = [
    "IGNORE_INDEX",
    "VARLEN",
    "causal_lm_loss_sum",
    "chunked_head_loss_sum",
    "chunked_lm_head_loss",
    "count_loss_tokens",
    "resolve_attn_implementation",
    "varlen_attention_forward",
    "varlen_backend",
]
