"""Hand-made multimodal samples for the tiny VL / Omni models: random text ids around image placeholders, random
patch pixels, and the model's own `get_rope_index` for the (3, L) M-RoPE ids (what the transform must produce)."""

import os
from typing import Dict, List, Sequence, Tuple

import torch

from veomni.data.data_collator import MainCollator
from veomni.trainer.vlm_trainer import build_data_collate_info

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = {name: os.path.join(REPO, "configs", "multimodal", "tiny", name) for name in (
    "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen2_5_omni_thinker", "qwen3_omni_moe_thinker"
)}  # fmt: skip
TEXT_VOCAB = 1000  # the tiny configs' special ids sit above this


def _image_token_id(config) -> int:
    return getattr(config, "image_token_id", None) or config.image_token_index


def make_sample(model, n_text: int, images: Sequence[Tuple[int, int]], generator: torch.Generator) -> Dict:
    """Text, then for each (h, w) patch grid: <vision_start> image tokens <vision_end> text; labels = input ids."""
    config = model.config
    vision = config.vision_config
    merge = vision.spatial_merge_size
    dim = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    ids: List[int] = []
    types: List[int] = []
    pixels, grids = [], []

    def text(n):
        ids.extend(torch.randint(0, TEXT_VOCAB, (n,), generator=generator).tolist())
        types.extend([0] * n)

    for h, w in images:
        text(n_text)
        n = h * w // merge**2
        ids.extend([config.vision_start_token_id] + [_image_token_id(config)] * n + [config.vision_end_token_id])
        types.extend([0] + [1] * n + [0])
        pixels.append(torch.randn(h * w, dim, generator=generator))
        grids.append([1, h, w])
    text(n_text)
    input_ids = torch.tensor(ids)
    grid = torch.tensor(grids) if grids else None
    if "omni" in config.model_type:
        position_ids, _ = model.model.get_rope_index(input_ids[None], grid, None, torch.ones(1, len(ids)).long())
    else:
        position_ids, _ = model.model.get_rope_index(
            input_ids[None], mm_token_type_ids=torch.tensor(types)[None], image_grid_thw=grid
        )
    sample = {"input_ids": input_ids, "labels": input_ids.clone(), "position_ids": position_ids[:, 0]}
    if pixels:
        sample.update(pixel_values=torch.cat(pixels), image_grid_thw=grid)
    return sample


def one_sample_batch(sample: Dict) -> Dict:
    """A sample as a batch of one, unpacked: (1, L) ids, HF's (3, 1, L) position ids."""
    batch = {k: v for k, v in sample.items() if k not in ("labels", "position_ids", "input_ids")}
    batch.update(input_ids=sample["input_ids"][None], position_ids=sample["position_ids"][:, None])
    return batch


def pack(samples: Sequence[Dict]) -> Dict:
    """MainCollator's packed row with the VLM trainer's collate infos: (1, 3, L) position ids, cu_seq_lens, and the
    visual inputs of the samples that have any (text-only samples may come first), concatenated in order."""
    return MainCollator(collate_infos=build_data_collate_info())(samples)
