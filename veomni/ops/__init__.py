"""Ops: packed (varlen) attention, the language-model loss (shifted labels, token sums, the chunked head loss),
mixture-of-experts kernels."""

from .attention import VARLEN, resolve_attn_implementation, varlen_attention_forward, varlen_backend
from .loss import (
    IGNORE_INDEX,
    CausalLMLoss,
    LossOutput,
    chunked_head_loss_sum,
    count_loss_tokens,
    lm_loss_sum,
    register_head_loss_backend,
    shift_labels,
)

__all__ = [
    "IGNORE_INDEX",
    "VARLEN",
    "CausalLMLoss",
    "LossOutput",
    "chunked_head_loss_sum",
    "count_loss_tokens",
    "lm_loss_sum",
    "register_head_loss_backend",
    "resolve_attn_implementation",
    "shift_labels",
    "varlen_attention_forward",
    "varlen_backend",
]
