"""Ulysses sequence parallelism: the all-to-all exchanges (comm.py), the attention wrapper (ulysses.py; async:
async_attention.py), and `apply_sp`, the step of `parallelize`. The loss needs nothing of its own: the collator
shifts labels before it slices a row (veomni.ops.loss)."""

from .apply import apply_sp

__all__ = ["apply_sp"]
