"""`build_processor`: an HF multimodal processor (tokenizer + image/video processors + audio feature extractor +
chat template) from a LOCAL folder, the way `build_tokenizer` loads a tokenizer. No hub look-ups.

transformers 5.x builds every Qwen-VL / Omni processor with a video processor, and its video processors import
torchvision. Where torchvision cannot be imported (a CPU torch without a matching torchvision build), the same
processor class is built and loaded with `video_processor=None` (`without_video_processor`); videos then go
through the image processor frame by frame (veomni.data.multimodal.data_transform)."""

import contextlib
import json
import os

import transformers
from transformers import AutoProcessor

from ..compat.transformers import processor_without_video


def torchvision_available() -> bool:
    try:
        import torchvision  # noqa: F401  (a CUDA torchvision beside a CPU torch fails here, not only a missing one)
    except Exception:
        return False
    return True


def without_video_processor(processor_cls, saving: bool = False, force: bool = False):
    """A context within which `processor_cls` is built, loaded (and with `saving=True` saved) with no video
    processor; a no-op where torchvision works, unless `force` (a folder saved without one)."""
    if (torchvision_available() and not force) or "video_processor" not in processor_cls.get_attributes():
        return contextlib.nullcontext()
    return processor_without_video(processor_cls, saving=saving)


def _saved_without_video_processor(processor_path: str) -> bool:
    """A folder written where torchvision was missing: `"video_processor": null` and no video config file."""
    if os.path.isfile(os.path.join(processor_path, "video_preprocessor_config.json")):
        return False
    path = os.path.join(processor_path, "processor_config.json")
    if not os.path.isfile(path):
        return False
    with open(path) as f:
        config = json.load(f)
    return "video_processor" in config and config["video_processor"] is None


def _processor_class(processor_path: str):
    for name in ("processor_config.json", "preprocessor_config.json", "tokenizer_config.json"):
        path = os.path.join(processor_path, name)
        if os.path.isfile(path):
            with open(path) as f:
                cls_name = json.load(f).get("processor_class")
            if cls_name and hasattr(transformers, cls_name):
                return getattr(transformers, cls_name)
    return None


def build_processor(processor_path: str, trust_remote_code: bool = False, **kwargs):
    """`AutoProcessor.from_pretrained` on a local folder (`processor_config.json`, tokenizer files,
    `chat_template.jinja`). Custom processor code runs only with `trust_remote_code=True`."""
    if processor_path is None or not os.path.isdir(processor_path):
        raise FileNotFoundError(f"processor folder not found: {processor_path}")
    kwargs.setdefault("local_files_only", True)
    processor_cls = _processor_class(processor_path)
    if processor_cls is None:  # a custom processor (remote code) or a folder that names none
        return AutoProcessor.from_pretrained(processor_path, trust_remote_code=trust_remote_code, **kwargs)
    with without_video_processor(processor_cls, force=_saved_without_video_processor(processor_path)):
        processor = processor_cls.from_pretrained(processor_path, **kwargs)
    processor.video_processor = getattr(processor, "video_processor", None)
    return processor
