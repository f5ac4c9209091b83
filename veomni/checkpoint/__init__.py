from .checkpointer import (
    Checkpointer,
    CheckpointError,
    list_checkpoints,
    named_optimizers,
    resolve_checkpoint,
    rng_state,
    set_rng_state,
)
from .hf_export import dcp_to_hf, save_hf_model

__all__ = [
    "CheckpointError",
    "Checkpointer",
    "dcp_to_hf",
    "list_checkpoints",
    "named_optimizers",
    "resolve_checkpoint",
    "rng_state",
    "save_hf_model",
    "set_rng_state",
]
