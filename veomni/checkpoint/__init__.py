"""Checkpoints: DCP save/load with atomic publish, resume-by-default planning of output_dir, HF (and LoRA) export."""

from .checkpointer import Checkpointer, CheckpointError, list_checkpoints, resolve_checkpoint
from .hf_export import dcp_to_hf, save_hf_model
from .lora_export import save_lora_model
from .rng import rng_state, set_rng_state
from .run_dir import RunDirError, RunPlan, move_run_aside, plan_run

__all__ = [
    "CheckpointError",
    "Checkpointer",
    "RunDirError",
    "RunPlan",
    "dcp_to_hf",
    "list_checkpoints",
    "move_run_aside",
    "plan_run",
    "resolve_checkpoint",
    "rng_state",
    "save_hf_model",
    "save_lora_model",
    "set_rng_state",
]
