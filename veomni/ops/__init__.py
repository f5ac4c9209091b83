"""Ops: the token-normalised causal LM loss and mixture-of-experts kernels."""

from .loss import IGNORE_INDEX, causal_lm_loss_sum, count_loss_tokens

__all__ = ["IGNORE_INDEX", "causal_lm_loss_sum", "count_loss_tokens"]
