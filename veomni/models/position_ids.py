"""M-RoPE position ids for one sample, computed by the model's own `get_rope_index` without a model instance.

`build_position_id_func(config)` returns a small picklable callable (it holds only the config: dataloader workers
pickle it) that runs transformers' `get_rope_index` of the model class on the config, so the ids the data pipeline
attaches are the ones the model would compute itself:

    position_id_func(input_ids (L,), image_grid_thw=None, video_grid_thw=None, second_per_grid_ts=None,
                     audio_seqlens=None) -> position_ids (3, L)

`get_rope_index` reads only `self.config` (and, for Omni thinkers, `self.spatial_merge_size`) and calls a few
helper methods of its class; `_RopeIndex` supplies `config` and resolves every other attribute on the HF class,
bound to itself -- an adapter, not a copy of the HF code.
"""

import types
from typing import Optional

import torch
import transformers

# model_type -> the transformers class whose get_rope_index is used (a `*_thinker` one takes the Omni arguments);
# veomni.models.multimodal adapts exactly these families
ROPE_INDEX_CLASSES = {
    "qwen2_vl": "Qwen2VLModel",
    "qwen2_5_vl": "Qwen2_5_VLModel",
    "qwen3_vl": "Qwen3VLModel",
    "qwen3_vl_moe": "Qwen3VLMoeModel",
    "qwen2_5_omni_thinker": "Qwen2_5OmniThinkerForConditionalGeneration",
    "qwen3_omni_moe_thinker": "Qwen3OmniMoeThinkerForConditionalGeneration",
}
# full Omni configs (thinker + talker + vocoder): training uses the thinker only
_OMNI_MODEL_TYPES = ("qwen2_5_omni", "qwen3_omni_moe")


def thinker_config(config):
    """A full Omni config trains its thinker (which owns the M-RoPE): return that sub-config (other configs
    unchanged)."""
    return config.thinker_config if getattr(config, "model_type", "") in _OMNI_MODEL_TYPES else config


class _RopeIndex:
    """Picklable `(input_ids, grids...) -> (3, L)` position ids through the model class's `get_rope_index`."""

    def __init__(self, config):
        config = thinker_config(config)
        if config.model_type not in ROPE_INDEX_CLASSES:
            raise ValueError(
                f"no M-RoPE position ids for model type {config.model_type!r}; known: {sorted(ROPE_INDEX_CLASSES)}"
            )
        self.config = config
        self.spatial_merge_size = config.vision_config.spatial_merge_size

    def _hf_class(self):
        return getattr(transformers, ROPE_INDEX_CLASSES[self.config.model_type])

    def __getattr__(self, name):  # the HF class's helpers (get_vision_position_ids, ...), bound to this object
        if name.startswith("__") or name in ("config", "spatial_merge_size"):
            raise AttributeError(name)
        return types.MethodType(getattr(self._hf_class(), name), self)

    def token_types(self, input_ids: torch.Tensor) -> torch.Tensor:
        """`mm_token_type_ids` as transformers' processors return them: 0 text, 1 image, 2 video."""
        types_ = torch.zeros_like(input_ids, dtype=torch.int32)
        types_[input_ids == self.config.image_token_id] = 1
        types_[input_ids == self.config.video_token_id] = 2
        return types_

    @torch.no_grad()
    def __call__(
        self,
        input_ids,
        image_grid_thw: Optional[torch.Tensor] = None,
        video_grid_thw: Optional[torch.Tensor] = None,
        second_per_grid_ts: Optional[torch.Tensor] = None,
        audio_seqlens: Optional[torch.Tensor] = None,
        **unused,
    ) -> torch.Tensor:
        ids = torch.as_tensor(input_ids, dtype=torch.long).reshape(1, -1)
        get_rope_index = types.MethodType(self._hf_class().get_rope_index, self)
        if not self.config.model_type.endswith("_thinker"):
            kwargs = {"image_grid_thw": image_grid_thw, "video_grid_thw": video_grid_thw}
            if second_per_grid_ts is not None:
                kwargs["second_per_grid_ts"] = torch.as_tensor(second_per_grid_ts, dtype=torch.float)
            position_ids, _ = get_rope_index(ids, self.token_types(ids), **kwargs)
        else:
            position_ids, _ = get_rope_index(
                ids,
                image_grid_thw=image_grid_thw,
                video_grid_thw=video_grid_thw,
                attention_mask=torch.ones_like(ids),
                use_audio_in_video=False,
                audio_seqlens=audio_seqlens,
                second_per_grids=None if second_per_grid_ts is None else torch.as_tensor(second_per_grid_ts),
            )
        return position_ids[:, 0].long()  # (3, L)


def build_position_id_func(config) -> _RopeIndex:
    """The M-RoPE position-id function of a Qwen2-VL / Qwen2.5-VL / Qwen3-VL(-MoE) / Qwen2.5-Omni / Qwen3-Omni-MoE
    config (an Omni config's thinker), equal to the model's own `get_rope_index`."""
    return _RopeIndex(config)
