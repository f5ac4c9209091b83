"""Ulysses sequence parallelism: the all-to-all exchanges, the attention wrapper (sync and async), and the loss
helpers for a sequence sharded over the sp group."""

from .apply import apply_sp
from .comm import gather_seq, heads_to_seq, launch_seq_to_heads, seq_to_heads
from .loss import count_loss_tokens_shifted, shifted_lm_loss_sum, sp_load_balancing_loss_sum
from .ulysses import PREFIX, apply_ulysses, ulysses_name

__all__ = [
    "PREFIX",
    "apply_sp",
    "apply_ulysses",
    "count_loss_tokens_shifted",
    "gather_seq",
    "heads_to_seq",
    "launch_seq_to_heads",
    "seq_to_heads",
    "shifted_lm_loss_sum",
    "sp_load_balancing_loss_sum",
    "ulysses_name",
]
