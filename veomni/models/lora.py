"""LoRA through HF PEFT: adapters injected into the HF model before it is sharded and trained alone (exported merged
or as a PEFT adapter folder by veomni/checkpoint/lora_export.py).

`peft.inject_adapter_in_model` (not `get_peft_model`) keeps the model's own class, forward and config, which the
trainer, the loss and the checkpoint code rely on; the adapters are ordinary parameters of the decoder layers, so
FSDP2 shards them with the frozen base weights of their unit (FSDP2 allows frozen and trainable parameters in one
unit: all are gathered, only the trainable ones get gradients reduce-scattered) and DDP replicates them likewise.

Initialisation is PEFT's own (`reset_lora_parameters`: A kaiming-uniform, B zeros), run once on CPU under a seed of
its own, whatever the init device: the full initial adapters are kept and copied into the shards after the model is
materialised, so every rank and every world size starts from the same adapters, and a model built on `meta` (whose
adapters `to_empty` leaves as garbage) too. While the model is materialised its state dict shows the base
checkpoint's names (`q_proj.weight`, not `q_proj.base_layer.weight`) and no adapters, so the weights load unchanged.
"""

import contextlib
import os
import re
from typing import Dict, Iterator, List, Optional

import torch
from torch import nn

from ..utils.logging import get_logger
from .placement import copy_full, tied_sources

logger = get_logger(__name__)

ADAPTER = "default"  # PEFT's adapter name: one adapter per model here
REGEX_PREFIX = "re:"  # target_modules: ["re:<pattern>"] is a regular expression over module paths
_ADAPTER_KEY = re.compile(r"(^|\.)lora_")  # any tensor of a LoRA adapter (lora_A, lora_B, lora_embedding_*, ...)


def lora_config(args, base_model_path: Optional[str] = None):
    """PEFT's `LoraConfig` for the `model.lora` group (veomni/arguments/arguments_types.py `LoraArguments`)."""
    from peft import LoraConfig

    from ..utils.hub import hub_name_of

    # absolute, so `AutoPeftModelForCausalLM.from_pretrained(adapter)` finds the base from any directory; a base
    # that came by hub name (resolved into the hub cache) records that name, and any other name stays as given
    hub_name = hub_name_of(base_model_path)
    if hub_name is None and os.path.isdir(base_model_path or ""):
        base_model_path = os.path.abspath(base_model_path)
    # our list form to PEFT's: names (suffix match), `all-linear`, or one `re:` pattern (full match)
    targets = list(args.target_modules)
    if len(targets) == 1 and (targets[0] == "all-linear" or targets[0].startswith(REGEX_PREFIX)):
        targets = targets[0].removeprefix(REGEX_PREFIX)
    return LoraConfig(
        r=args.r,
        lora_alpha=args.alpha,
        lora_dropout=args.dropout,
        target_modules=targets,
        bias="none",
        task_type="CAUSAL_LM",  # PeftModel.from_pretrained then builds PeftModelForCausalLM around the base model
        base_model_name_or_path=hub_name or base_model_path,
    )


def is_lora_model(model: nn.Module) -> bool:
    return ADAPTER in (getattr(model, "peft_config", None) or {})


def lora_layers(model: nn.Module) -> Iterator:
    from peft.tuners.lora import LoraLayer

    for name, module in model.named_modules():
        if isinstance(module, LoraLayer) and ADAPTER in module.lora_A:
            yield name, module


def attach_lora(model: nn.Module, args, seed: int, base_model_path: Optional[str] = None) -> Dict[str, torch.Tensor]:
    """Inject LoRA adapters in place (base weights frozen); returns the adapters' full initial values, to be placed
    with `place_adapters` once the model is sharded and materialised. {} when `args.enable` is off."""
    if not args.enable:
        return {}
    from peft import inject_adapter_in_model

    try:
        inject_adapter_in_model(lora_config(args, base_model_path), model, adapter_name=ADAPTER)
    except ValueError as err:  # PEFT's "Target modules ... not found": say which key and what there is
        linear = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, nn.Linear)})
        raise ValueError(
            f"model.lora.target_modules={args.target_modules}: {err}. Linear layers of "
            f"{type(model).__name__}: {linear[:8]}"
        ) from err
    _refuse_tied_targets(model, args.target_modules)
    initial = _initial_adapters(model, seed)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    logger.info(
        f"LoRA r={args.r} alpha={args.alpha} on {len(list(lora_layers(model)))} linear modules: {trainable:,} trainable of "
        f"{total:,} parameters ({100 * trainable / max(total, 1):.2f}%)"
    )
    return initial


def _refuse_tied_targets(model: nn.Module, targets: List[str]) -> None:
    """A weight shared with another module (a tied lm_head) cannot be merged alone: the export writes one copy."""
    pairs = tied_sources(model)
    shared = set(pairs) | set(pairs.values())
    tied = [name for name, _ in lora_layers(model) if f"{name}.base_layer.weight" in shared]
    if tied:
        raise ValueError(
            f"model.lora.target_modules={targets} adapts {tied[0]}, whose weight is tied to another module's "
            "(tie_word_embeddings); leave it out"
        )


def _initial_adapters(model: nn.Module, seed: int) -> Dict[str, torch.Tensor]:
    """PEFT's initialisation of every adapter, on CPU under `seed` (in a forked RNG: the training stream is as
    without LoRA), whatever device the model is on; the adapters go back to that device (meta stays meta)."""
    values = {}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for name, layer in lora_layers(model):
            parts = (layer.lora_A[ADAPTER], layer.lora_B[ADAPTER])
            device = parts[0].weight.device
            for part in parts:
                part.to_empty(device="cpu")
            layer.reset_lora_parameters(ADAPTER, True)  # kaiming-uniform A, zero B
            for prefix, part in zip(("lora_A", "lora_B"), parts):
                for key, param in part.named_parameters():
                    values[f"{name}.{prefix}.{ADAPTER}.{key}"] = param.detach().clone()
                part.to(device)
    return values


def base_name(key: str) -> Optional[str]:
    """The base checkpoint's name of a LoRA model's state-dict key; None for an adapter tensor."""
    return None if _ADAPTER_KEY.search(key) else key.replace(".base_layer.", ".")


@contextlib.contextmanager
def base_checkpoint_names(model: nn.Module, initial: Dict[str, torch.Tensor]):
    """While inside: `model.state_dict()` holds only the base tensors, under the base checkpoint's names, so the
    sharding code's weight loading (meta models) reads an unchanged HF checkpoint into the LoRA model."""
    if not initial:
        yield
        return

    def as_base(module, state_dict, prefix, local_metadata):
        renamed = {base_name(k): v for k, v in state_dict.items() if base_name(k) is not None}
        state_dict.clear()
        state_dict.update(renamed)

    handle = model.register_state_dict_post_hook(as_base)
    try:
        yield
    finally:
        handle.remove()


@torch.no_grad()
def place_adapters(model: nn.Module, initial: Dict[str, torch.Tensor]) -> None:
    """Copy the full initial adapters into the (possibly sharded) model: each rank keeps its own slice."""
    params = dict(model.named_parameters())
    for name, full in initial.items():
        copy_full(params[name], full)
