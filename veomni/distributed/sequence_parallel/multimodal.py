"""Ulysses on a vision-language model: each rank keeps the visual embeddings whose placeholders lie in its own
shard of the packed row (installed into the model's `MultimodalAdapter`, veomni.models.multimodal).

Every rank runs the vision tower on all patches, counts the placeholders before its shard in the (gathered) full
input ids, and keeps that slice, so HF's own `masked_scatter` on the local input ids puts each embedding at its
local position.
"""

from functools import partial
from typing import Any, Dict, Optional

import torch
import torch.distributed as dist
from torch import nn

from ...models.multimodal import multimodal_adapter, thinker_config
from ...utils.collectives import gather_seq

# families whose visual embeddings can be sharded (per-token `pooler_output`, and Qwen3-VL's `deepstack_features`);
# the Omni thinkers' audio embeddings are not sharded yet
SEQUENCE_PARALLEL_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")
_PLACEHOLDER_IDS = {"image": ("image_token_id", "image_token_index"), "video": ("video_token_id", "video_token_index")}


def enable_multimodal_sequence_parallel(model: nn.Module, group) -> None:
    """Make the model's adapter shard the visual embeddings over Ulysses group `group` (called by `apply_sp` with
    the text attention made Ulysses); refuses, at build time, the families it cannot shard."""
    model_type = thinker_config(model.config).model_type
    if model_type not in SEQUENCE_PARALLEL_MODEL_TYPES:
        raise NotImplementedError(
            f"Ulysses sequence parallel is not supported for {model_type!r} yet (supported multimodal families: "
            f"{', '.join(SEQUENCE_PARALLEL_MODEL_TYPES)}); set ulysses_size=1"
        )
    adapter = multimodal_adapter(model)
    if adapter is None:
        raise ValueError(
            "sequence parallel on a multimodal model needs the adapter: build it with build_foundation_model"
        )
    adapter.shard_visual_outputs = partial(shard_visual_outputs, group=group)


def _placeholder_id(config, kind: str) -> int:
    return next(getattr(config, key) for key in _PLACEHOLDER_IDS[kind] if getattr(config, key, None) is not None)


def _keep_local_tokens(outputs, start: int, end: int):
    """Keep embeddings [start, end) of an encoder's per-placeholder outputs (one tuple entry: HF concatenates them)."""
    outputs.pooler_output = (torch.cat(outputs.pooler_output, dim=0)[start:end],)
    if getattr(outputs, "deepstack_features", None) is not None:
        outputs.deepstack_features = [(torch.cat(f, dim=0)[start:end],) for f in outputs.deepstack_features]
    return outputs


def shard_visual_outputs(config, ran: Dict[str, Any], input_ids: Optional[torch.Tensor], group) -> None:
    """Replace each visual encoder's outputs by the slice whose placeholders sit in this rank's sequence shard."""
    if input_ids is None:
        raise ValueError("sequence parallel on a multimodal model needs input_ids (to place the visual embeddings)")
    local = input_ids.shape[-1]
    full = gather_seq(input_ids, group, dim=-1)  # every rank, every forward: one all-gather of the ids
    begin = dist.get_rank(group) * local
    for kind in ("image", "video"):
        if kind in ran:
            is_placeholder = full == _placeholder_id(config, kind)
            start = int(is_placeholder[..., :begin].sum())
            end = start + int(is_placeholder[..., begin : begin + local].sum())
            ran[kind] = _keep_local_tokens(ran[kind], start, end)
