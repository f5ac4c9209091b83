"""Each rank's random generators in a checkpoint: saved and restored exactly, or seeded afresh for a rank that no
saved state belongs to."""

import random
from typing import Any, Dict

import numpy as np
import torch


def rng_state() -> Dict[str, Any]:
    """This rank's generators: CPU, Python, NumPy, and its own accelerator's (only the device it uses: a resume may
    see another number of devices)."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    state["numpy"] = [name, torch.from_numpy(keys.astype("int64")), pos, has_gauss, gauss]
    return state


def set_rng_state(state: Dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(tuple(x if not isinstance(x, list) else tuple(x) for x in state["python"]))
    if "cuda" in state and torch.cuda.is_available():
        cuda = state["cuda"]
        if isinstance(cuda, (list, tuple)):  # saved by an earlier version: every visible device's state
            cuda = cuda[torch.cuda.current_device()] if torch.cuda.current_device() < len(cuda) else None
        if cuda is not None:
            torch.cuda.set_rng_state(cuda)
    if "numpy" in state:
        name, keys, pos, has_gauss, gauss = state["numpy"]
        np.random.set_state((name, keys.numpy().astype("uint32"), pos, has_gauss, gauss))


def reseed(seed: int, rank: int, step: int) -> None:
    """Generators of a rank that no saved state belongs to (a resume on more ranks): seeded from (seed, rank, step)."""
    value = (seed * 1_000_003 + rank * 10_007 + step) % 2**32
    torch.manual_seed(value)
    random.seed(value)
    np.random.seed(value)
