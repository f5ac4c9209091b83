"""Ulysses sequence parallelism: the all-to-all exchanges and the attention wrapper (sync and async). The loss needs
nothing of its own: the collator shifts labels before it slices a row (veomni.ops.loss)."""

from .apply import apply_sp
from .comm import heads_to_seq, launch_seq_to_heads
from .ulysses import PREFIX, apply_ulysses, ulysses_name

__all__ = [
    "PREFIX",
    "apply_sp",
    "apply_ulysses",
    "heads_to_seq",
    "launch_seq_to_heads",
    "ulysses_name",
]
