"""A LoRA model's exports, written by every rank like any HF export (hf_export.py): merged into the base weights
(an HF folder plain `from_pretrained` loads) or as a PEFT adapter folder (`PeftModel.from_pretrained(base, folder)`).

The merge is PEFT's, W + scaling * B @ A, computed in fp32 on the gathered weight of one adapted layer at a time by
the rank whose turn it is; every other base weight is written from the shards as they are."""

from typing import Dict, List, Optional

import torch
from torch import nn

from ..models.lora import ADAPTER, base_name, lora_layers
from .hf_export import Item, copy_tokenizer, hf_folder_finish, hub_items, live_state, live_writer, write_folder

ADAPTER_FILE = "adapter_model.safetensors"


def _merge(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    delta = (b.float() @ a.float()) * scaling  # in fp32: a bf16 product would round twice
    return (weight.float() + delta).to(weight.dtype)


def merged_items(model: nn.Module, shapes) -> List[Item]:
    """The base model's items under the base checkpoint's names (`q_proj.weight`, not `q_proj.base_layer.weight`),
    each adapted weight made by merging its adapter into it."""
    keys = {base_name(k): k for k in shapes if base_name(k) is not None}
    adapted = {f"{name}.weight": (name, layer.scaling[ADAPTER]) for name, layer in lora_layers(model)}
    items = hub_items(model, {name: shapes[key] for name, key in keys.items()})
    for item in items:
        if item.convert is None and item.keys[0] in adapted:
            module, scaling = adapted[item.keys[0]]
            parts = [keys[item.keys[0]], f"{module}.lora_A.{ADAPTER}.weight", f"{module}.lora_B.{ADAPTER}.weight"]
            item.keys, item.convert = parts, _merger(item.outputs[0][0], parts, scaling)
        elif item.convert is None:
            item.keys = [keys[item.keys[0]]]
        elif any(key in adapted for key in item.keys):
            raise ValueError(
                f"model.lora.export=merged: {item.keys[0]} is adapted and converted on export; unsupported"
            )
        else:  # a converted group (MoE experts) reads the model's own names
            item.convert = _renamed(item.convert, {keys[k]: k for k in item.keys})
            item.keys = [keys[k] for k in item.keys]
    return items


def _merger(name: str, parts: List[str], scaling: float):
    return lambda tensors: {name: _merge(*(tensors[p] for p in parts), scaling)}


def _renamed(convert, names: Dict[str, str]):
    return lambda tensors: convert({names[k]: v for k, v in tensors.items()})


def adapter_items(model: nn.Module, shapes) -> List[Item]:
    """The adapter tensors under the names `PeftModel.save_pretrained` writes (`base_model.model.<path>.lora_A.weight`),
    as PEFT's own `get_peft_model_state_dict` names them (asked on stand-ins: no tensor is read)."""
    from peft import get_peft_model_state_dict

    stand_ins = {key: torch.empty(0, device="meta") for key in shapes}
    named = get_peft_model_state_dict(model, state_dict=stand_ins, adapter_name=ADAPTER, save_embedding_layers=False)
    key_of = {id(t): key for key, t in stand_ins.items()}
    items = []
    for name, stand_in in sorted(named.items()):
        key = key_of[id(stand_in)]
        items.append(Item([key], [(f"base_model.model.{name}", *shapes[key])]))
    return items


def save_lora_model(
    model: nn.Module, out_dir: str, tokenizer_dir: Optional[str], export: str, max_shard_bytes: int = 5 * 2**30
) -> None:
    """Call on all ranks. `export="merged"`: an HF folder of the merged weights in the hub layout (plain
    `from_pretrained` loads it); `"adapter"`: a PEFT adapter folder (adapter_config.json, adapter_model.safetensors)."""
    state, shapes = live_state(model)
    if export == "merged":
        finish = hf_folder_finish(model, model.config, tokenizer_dir)
        write_folder(merged_items(model, shapes), live_writer(state), out_dir, finish, max_shard_bytes)
    elif export == "adapter":

        def finish(folder: str) -> None:
            model.peft_config[ADAPTER].save_pretrained(folder)  # adapter_config.json
            copy_tokenizer(tokenizer_dir, folder)

        write_folder(adapter_items(model, shapes), live_writer(state), out_dir, finish, single=ADAPTER_FILE)
    else:
        raise ValueError(f"model.lora.export={export!r}: choose merged or adapter")
