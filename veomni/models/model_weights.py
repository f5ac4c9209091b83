"""`save_model_weights`: a state dict written as an HF safetensors folder under the names it has, plus the model's
assets (config, tokenizer, processor): VeOmni's function, which the seed's checkpoint conversion scripts
(moe_merge.py / moe_split.py) call as

    save_model_weights(output_dir, state_dict, model_assets=[config, tokenizer])

The tensors are written as given (no key renaming: converting layouts is the caller's business, e.g. stacking or
splitting experts), cast to `save_dtype` (VeOmni's default: bfloat16; None keeps each tensor's dtype), in shards of at
most `shard_size` bytes with the `model.safetensors.index.json` transformers reads, through huggingface_hub's writer
(the one `save_pretrained` shards with). A model's own export, with transformers' key layout, is `save_hf_model` in
veomni.checkpoint.
"""

import os
from typing import Dict, Optional, Sequence, Union

import torch
from huggingface_hub import save_torch_state_dict
from torch.distributed.tensor import DTensor

from ..utils.logging import get_logger
from .auto import to_dtype

logger = get_logger(__name__)


@torch.no_grad()
def save_model_weights(
    output_dir: Union[str, "os.PathLike"],
    state_dict: Dict[str, torch.Tensor],
    global_rank: Optional[int] = None,
    save_dtype: Optional[Union[str, torch.dtype]] = "bfloat16",
    shard_size: int = 5_000_000_000,
    safe_serialization: bool = True,
    model_assets: Optional[Sequence[object]] = None,
) -> None:
    """Write `state_dict` (tensors or DTensors, under the names given) and `model_assets` (anything with
    `save_pretrained`: a config, tokenizer, processor) to `output_dir`.

    `global_rank`: when given, every rank calls this (DTensors are gathered collectively) and rank 0 writes; when
    None, this process writes alone. Only safetensors are written (`safe_serialization=False` is refused).
    """
    if not safe_serialization:
        raise ValueError("save_model_weights writes safetensors only: safe_serialization=False is not supported")
    dtype = None if save_dtype is None else to_dtype(save_dtype)
    writes = global_rank is None or global_rank == 0
    tensors = {}
    for name, tensor in state_dict.items():  # every rank gathers every DTensor (a collective), in the same order
        full = (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach()
        if dtype is not None and full.is_floating_point():
            full = full.to(dtype)
        if writes:  # a copy: views of one stacked tensor (as moe_split makes them) cannot be written side by side
            tensors[name] = full.to("cpu", copy=True).contiguous()
    if not writes:
        return
    output_dir = os.fspath(output_dir)
    os.makedirs(output_dir, exist_ok=True)
    save_torch_state_dict(tensors, output_dir, max_shard_size=shard_size)
    for asset in model_assets or ():
        if not hasattr(asset, "save_pretrained"):
            raise TypeError(
                f"model asset {type(asset).__name__} has no save_pretrained: cannot save it to {output_dir}"
            )
        asset.save_pretrained(output_dir)
    logger.info(f"saved {len(tensors)} tensors and {len(model_assets or ())} assets to {output_dir}")
