"""How MainCollator packs multimodal samples: the `DataCollateInfo`s the fields of the multimodal transforms need.

Per-token fields (`input_ids`, `labels`, `position_ids`, the modality masks) are concatenated along the sequence,
with the batch dim inserted before it: `input_ids` (1, L), M-RoPE `position_ids` (3, 1, L) -- the layout Qwen-VL
models take. Per-item fields are concatenated on dim 0 in sample order, which is the order the placeholders
appear in the packed row: vision patches `pixel_values(_videos)` (sum of patches, patch_dim), `image_grid_thw` /
`video_grid_thw` (n, 3), `second_per_grid_ts` (n,), audio `input_features` (n, mel, frames) and
`feature_attention_mask` (n, frames); the grids, seconds and audio fields need no info of their own (MainCollator's
default), nor do the text fields (MainCollator adds theirs). The modality masks are never sliced for sequence
parallelism: every SP rank needs the full-sequence masks to scatter the visual/audio embeddings before the Ulysses
exchange.
"""

from typing import Dict

from ..data_collator import DataCollateInfo
from .preprocess import MEDIA_TYPES


def multimodal_collate_infos(merge_size: int = 2, vision_sp_slice: bool = False) -> Dict[str, DataCollateInfo]:
    """Collate infos for the fields of `process_sample_qwen2_5_vl` / `_qwen3_vl` / `_qwen_omni`; pass them as
    `MainCollator(collate_infos=...)` (or `collate_fn_kwargs={"collate_infos": ...}` to build_dataloader).

    `vision_sp_slice=True` also slices the vision patches across SP ranks (a vision tower run under sequence
    parallelism), padding them to a multiple of `sp_size * merge_size**2` so every rank holds whole merged
    tokens; by default every rank keeps all patches (the vision tower runs whole, SP applies to the LM)."""
    vision = DataCollateInfo(
        pack_dim=0,
        sp_slice=vision_sp_slice,
        sp_pad_value=0 if vision_sp_slice else None,
        sp_pad_scale=merge_size**2,
    )
    masks = {f"{kind}_mask": DataCollateInfo(pack_dim=-1, sp_slice=False, sp_pad_value=0) for kind in MEDIA_TYPES}
    return {**masks, "pixel_values": vision, "pixel_values_videos": vision}
