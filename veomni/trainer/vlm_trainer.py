"""VLMTrainer: vision/audio-language models (Qwen2.5-VL, Qwen3-VL(-MoE), Qwen2.5-Omni / Qwen3-Omni-MoE thinkers)
on conversations with images, videos and audio, packed like text (see veomni/models/multimodal.py).

As the seed's `train_vlm.py`: `build_processor` -> `build_multimodal_chat_template` -> the model family's
`process_sample_*` transform with `position_id_func` (M-RoPE) -> MainCollator with per-key `DataCollateInfo`
(`build_data_collate_info`). Metrics count text, visual and audio tokens apart (`text_tokens`, `visual_tokens`,
`audio_tokens` and their `*_per_sec`).
"""

from functools import partial
from typing import Any, Dict

import torch
import torch.distributed as dist

from ..data.data_collator import DataCollateInfo
from ..data.multimodal import (
    MULTIMODAL_CHAT_TEMPLATE_REGISTRY,
    build_multimodal_chat_template,
    multimodal_collate_infos,
    process_sample_qwen2_5_vl,
    process_sample_qwen3_vl,
    process_sample_qwen_omni,
)
from ..models import build_config, build_processor
from ..models.multimodal import freeze_encoders, thinker_config
from ..models.position_ids import build_position_id_func
from ..utils.logging import get_logger
from .text_trainer import TextTrainer

logger = get_logger(__name__)

# config.model_type -> (sample transform, default chat template name)
TRANSFORMS = {
    "qwen2_vl": (process_sample_qwen2_5_vl, "qwen2_vl"),
    "qwen2_5_vl": (process_sample_qwen2_5_vl, "qwen2_5_vl"),
    "qwen3_vl": (process_sample_qwen3_vl, "qwen3_vl"),
    "qwen3_vl_moe": (process_sample_qwen3_vl, "qwen3_vl"),
    "qwen2_5_omni_thinker": (process_sample_qwen_omni, "qwen2_5_omni"),
    "qwen3_omni_moe_thinker": (process_sample_qwen_omni, "qwen2_5_omni"),
}
# per-token masks the transform emits: counted for the metrics, never given to the model
_TOKEN_MASKS = {"image_mask": "visual", "video_mask": "visual", "audio_mask": "audio"}
# the model's special ids that must be the processor tokenizer's ids (name in config -> tokenizer attribute)
_SPECIAL_IDS = {
    f"{kind}_token_{key}": f"{kind}_token_id" for kind in ("image", "video", "audio") for key in ("id", "index")
}


def build_data_collate_info(merge_size: int = 2) -> Dict[str, DataCollateInfo]:
    """How MainCollator packs each multimodal key (veomni/data/multimodal/collate.py): sequence keys along the
    sequence, M-RoPE ids to (3, 1, L), vision patches / grids / audio features on dim 0 in sample order."""
    return multimodal_collate_infos(merge_size)


def multimodal_template_name(requested: str, family_template: str) -> str:
    """The multimodal template `data.chat_template` names (`auto` / `default`: the model family's). A text template
    (chatml, tokenizer, a custom jinja) is refused here: the sample transforms hand it the expanded media
    placeholders, which only a multimodal template takes, so every sample would fail."""
    if requested in ("default", "auto"):
        return family_template
    if requested not in MULTIMODAL_CHAT_TEMPLATE_REGISTRY:
        raise ValueError(
            f"data.chat_template={requested if len(requested) <= 60 else requested[:57] + '...'!r}: VLMTrainer needs "
            f"a multimodal chat template (one of MULTIMODAL_CHAT_TEMPLATE_REGISTRY's: "
            f"{', '.join(MULTIMODAL_CHAT_TEMPLATE_REGISTRY.names())}) or auto (this model's own: {family_template})"
        )
    return requested


class VLMTrainer(TextTrainer):
    non_model_keys = (*TextTrainer.non_model_keys, *_TOKEN_MASKS)  # the masks are counted, never given to the model

    def build_data_transform(self):
        args = self.args
        self.processor = build_processor(args.model.tokenizer_path, trust_remote_code=args.model.trust_remote_code)
        self.tokenizer = self.processor.tokenizer
        config = thinker_config(build_config(args.model.config_path, trust_remote_code=args.model.trust_remote_code))
        if config.model_type not in TRANSFORMS:
            raise ValueError(f"VLMTrainer: no multimodal transform for model_type {config.model_type!r}")
        self._check_special_ids(config)
        transform, template = TRANSFORMS[config.model_type]
        chat_template = build_multimodal_chat_template(
            multimodal_template_name(args.data.chat_template, template), self.tokenizer
        )
        # the same function get_position_id_func(model) returns; built from the config, as the data comes first
        position_id_func = build_position_id_func(config)
        mm_configs = dict(args.data.mm_configs or {})
        mm_configs.setdefault("max_seq_len", args.data.max_seq_len)
        return partial(
            transform,
            processor=self.processor,
            chat_template=chat_template,
            position_id_func=position_id_func,
            **mm_configs,
        )

    def _check_special_ids(self, config) -> None:
        """A model whose image/video/audio token ids are not the tokenizer's would fail deep in the forward with
        'features and tokens do not match'; say it here instead."""
        for key, attribute in _SPECIAL_IDS.items():
            want, have = getattr(config, key, None), getattr(self.processor, attribute, None)
            if want is not None and have is not None and want != have:
                raise ValueError(
                    f"model config {key}={want} but the processor's tokenizer ({self.args.model.tokenizer_path}) "
                    f"has {attribute}={have}: the model and the processor do not belong together"
                )

    def collate_fn_kwargs(self) -> Dict[str, Any]:
        merge_size = getattr(self.processor.image_processor, "merge_size", 2)
        return dict(super().collate_fn_kwargs(), collate_infos=build_data_collate_info(merge_size))

    def prepare_model(self, model):
        frozen = freeze_encoders(model, self.args.model.freeze_vit, self.args.model.freeze_audio_tower)
        if frozen:
            logger.info(f"frozen: {', '.join(frozen)}")
        return model

    # ---------------------------------------------------------------------------------------------- step
    def train_step(self, micro_batches, totals):
        host = [0, 0]  # visual, audio tokens on this rank, counted on the loader's CPU masks (no device read)
        for mb in micro_batches:
            for key, kind in _TOKEN_MASKS.items():
                if key in mb:
                    host[0 if kind == "visual" else 1] += int(mb[key].sum())
        counts = torch.tensor(host, dtype=torch.int64)
        pin = self.device.type == "cuda"  # (pinned: the copy does not wait for the device)
        counts = (counts.pin_memory() if pin else counts).to(self.device, non_blocking=True)
        metrics = super().train_step(micro_batches, totals)
        dist.all_reduce(counts, group=self.parallel_state.dp_group)  # every rank, every step: same collectives
        # device values, read with the step's other metrics a step later
        visual, audio = counts[0], counts[1]
        metrics.update(visual_tokens=visual, audio_tokens=audio, text_tokens=totals["tokens"] - visual - audio)
        return metrics

    def _finish_metrics(self, metrics: Dict[str, Any], totals: Dict[str, Any]) -> None:
        super()._finish_metrics(metrics, totals)
        for kind in ("text", "visual", "audio"):
            metrics[f"{kind}_tokens_per_sec"] = metrics[f"{kind}_tokens"] / metrics["step_time"]
