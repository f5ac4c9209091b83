"""A LoRA run's checkpoints hold what it trains: the adapters, their optimizer state and the run state. The frozen
base weights are not copied into every checkpoint (at 70B that is 140 GB a save for megabytes of adapters): meta.json
references the base model folder the run loaded and the CRC-32 of each of its weight files, and a resume, which
loads the base from `model.model_path` as any run does, is refused when those files are not the same.

A LoRA model without a base folder (initialised from scratch) saves its whole state, as any model."""

import os
from typing import Any, Dict, Optional

import torch
from torch import nn

from ..models.loader import safetensors_files
from ..models.lora import ADAPTER, base_name, is_lora_model
from ..utils.hub import folder_of_hub_name
from .integrity import shared_crcs

BASE = "lora_base_model"  # meta.json's record: {"path": folder, "checksums": {weight file: CRC-32}}


def lora_base(model: nn.Module) -> Optional[str]:
    """The base model folder a LoRA model was loaded from (None: not LoRA, or no folder to reference)."""
    if not is_lora_model(model):
        return None
    path = model.peft_config[ADAPTER].base_model_name_or_path
    path = folder_of_hub_name(path) or path  # a base that came by hub name: its folder in the hub cache
    return os.path.abspath(path) if path and os.path.isdir(path) else None


def trained_state(state: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """The adapter tensors of a LoRA model's state dict."""
    return {key: value for key, value in state.items() if base_name(key) is None}


class BaseRecords:
    """The base folder's record, computed once per folder (collective: the ranks share the reading)."""

    def __init__(self):
        self._records: Dict[str, Dict[str, Any]] = {}

    def __call__(self, folder: str) -> Dict[str, Any]:
        if folder not in self._records:
            names = sorted(os.path.relpath(f, folder) for f in safetensors_files(folder))
            self._records[folder] = {"path": folder, "checksums": shared_crcs(folder, names)}
        return self._records[folder]

    def mismatch(self, saved: Dict[str, Any], folder: Optional[str]) -> Optional[str]:
        """Why this run's base (`folder`) is not the one `saved` records, in words; None when it is."""
        if folder is None:
            return f"this run loads no base model folder (model.model_path); it was trained on {saved['path']}"
        ours = self(folder)["checksums"]
        for name, crc in sorted(saved["checksums"].items()):
            if ours.get(name) != crc:
                state = "is missing" if name not in ours else "differs (CRC-32)"
                return f"{os.path.join(folder, name)} {state} from the base it was trained on ({saved['path']})"
        extra = sorted(set(ours) - set(saved["checksums"]))
        if extra:
            return f"{os.path.join(folder, extra[0])} is not in the base it was trained on ({saved['path']})"
        return None
