"""Multimodal sample transforms: one conversation -> the tensors a Qwen-VL / Qwen-Omni model trains on.

    transform = partial(process_sample_qwen2_5_vl, processor=processor, chat_template=chat_template,
                        position_id_func=get_position_id_func(model), **mm_configs)
    features = transform(sample)

Steps: (1) normalise the conversation and load its media (preprocess.py); (2) run the processor's parts on the
media: `image_processor` -> `pixel_values` (num_patches, patch_dim) + `image_grid_thw` (n_images, 3), videos as
frames -> `pixel_values_videos` + `video_grid_thw` (+ seconds per temporal grid), `feature_extractor` ->
`input_features` + `feature_attention_mask`; (3) expand each placeholder exactly as the HF processor does (one
token per merged patch / per audio frame after the encoder's downsampling) and tokenise the conversation through
the chat template (labels on assistant text only); (4) M-RoPE `position_ids` (3, L) from `position_id_func` and
bool `image_mask` / `video_mask` / `audio_mask` (L,).

`mm_configs` keys: `media_dir` (relative media paths), `video_fps` (frame rate of frame-list videos, default
2.0; a sample's own `video_fps` wins), `max_seq_len`, `image_kwargs` / `audio_kwargs` (extra processor kwargs).
Videos are lists of frames: transformers' video processor patches them where torchvision is installed; otherwise
each frame goes through the image processor and consecutive frames are paired into temporal patches -- the same
patch layout (t, h/m, w/m, m, m) x (C, temporal_patch, p, p), with the image processor's resizing.
"""

from typing import Any, Dict, Optional

import numpy as np
import torch

from ...compat.transformers import calculate_timestamps, feat_extract_output_lengths
from ..data_transform import DataFormatError
from .preprocess import AUDIO_SAMPLING_RATE, MEDIA_TYPES, conversation_from_sample, media_of


def _frames_to_patches(image_processor, frames) -> tuple:
    """One video's (patches, grid_thw) through the image processor: each frame is patched alone (the processor
    repeats it over the temporal patch), then the frames of each temporal patch are put side by side."""
    tp = image_processor.temporal_patch_size
    frames = list(frames) + [frames[-1]] * (-len(frames) % tp)  # pad by repeating the last frame, as HF does
    out = image_processor(images=frames, return_tensors="pt")
    grids = out["image_grid_thw"]
    if not bool((grids == grids[0]).all()):
        raise DataFormatError("all frames of a video must have the same size")
    t, n = len(frames) // tp, int(grids[0].prod())
    per_frame = out["pixel_values"].reshape(len(frames), n, 3, tp, -1)[:, :, :, 0]  # (F, n, C=3 RGB, p*p)
    paired = per_frame.reshape(t, tp, n, 3, -1).permute(0, 2, 3, 1, 4)  # (T, n, C, tp, p*p)
    return paired.reshape(t * n, -1), torch.tensor([t, int(grids[0][1]), int(grids[0][2])])


def _video_features(processor, videos, fps: float) -> Dict[str, torch.Tensor]:
    video_processor = getattr(processor, "video_processor", None)
    if video_processor is not None:
        arrays = [np.stack([np.asarray(f) for f in frames]) for frames in videos]
        out = video_processor(videos=arrays, do_sample_frames=False, return_tensors="pt")
        pixels, grids = out["pixel_values_videos"], out["video_grid_thw"].long()
        temporal_patch = video_processor.temporal_patch_size
    else:
        pieces = [_frames_to_patches(processor.image_processor, frames) for frames in videos]
        pixels = torch.cat([p for p, _ in pieces])
        grids = torch.stack([g for _, g in pieces]).long()
        temporal_patch = processor.image_processor.temporal_patch_size
    seconds = torch.tensor([temporal_patch / fps] * len(videos), dtype=torch.float)
    return {"pixel_values_videos": pixels, "video_grid_thw": grids, "second_per_grid_ts": seconds}


def _video_replacement(processor, grid: torch.Tensor, style: str, fps: float) -> str:
    merge = processor.image_processor.merge_size**2
    if style != "qwen3":
        return processor.video_token * int(grid.prod() // merge)
    # one `<t seconds>` + vision block per temporal patch (Qwen3VLProcessor's layout)
    temporal_patch = processor.image_processor.temporal_patch_size
    stamps = calculate_timestamps(processor, list(range(int(grid[0]) * temporal_patch)), fps, merge_size=temporal_patch)
    block = processor.vision_start_token + processor.video_token * int(grid[1:].prod() // merge)
    return "".join(f"<{t:.1f} seconds>{block}{processor.vision_end_token}" for t in stamps)


def _process_sample(
    sample: Dict[str, Any],
    processor,
    chat_template,
    position_id_func,
    style: str,
    media_dir: Optional[str] = None,
    video_fps: float = 2.0,
    max_seq_len: int = 8192,
    image_kwargs: Optional[Dict[str, Any]] = None,
    audio_kwargs: Optional[Dict[str, Any]] = None,
    max_image_pixels: Optional[int] = None,
    **unused,
) -> Dict[str, torch.Tensor]:
    conversation = conversation_from_sample(sample, media_dir=media_dir, max_image_pixels=max_image_pixels)
    media = media_of(conversation)
    fps = float(sample.get("video_fps") or video_fps)
    merge = processor.image_processor.merge_size**2
    features, replacements = {}, {}  # the processor's outputs; each media part's expanded placeholder
    if media["image"]:
        processed = processor.image_processor(images=media["image"], return_tensors="pt", **(image_kwargs or {}))
        features.update(pixel_values=processed["pixel_values"], image_grid_thw=processed["image_grid_thw"].long())
        replacements["image"] = [processor.image_token * int(g.prod() // merge) for g in features["image_grid_thw"]]
    if media["video"]:
        features.update(_video_features(processor, media["video"], fps))
        replacements["video"] = [_video_replacement(processor, g, style, fps) for g in features["video_grid_thw"]]
    if media["audio"]:
        if getattr(processor, "feature_extractor", None) is None:
            raise DataFormatError("the sample has audio but the processor has no audio feature extractor")
        kwargs = dict(sampling_rate=AUDIO_SAMPLING_RATE, padding="max_length", return_attention_mask=True)
        kwargs.update(audio_kwargs or {})  # Qwen-Omni processors pad to the extractor's 30 s window ("max_length")
        processed = processor.feature_extractor(media["audio"], return_tensors="pt", **kwargs)
        mask = processed["attention_mask"].long()
        features.update(input_features=processed["input_features"], feature_attention_mask=mask)
        lengths = mask.sum(-1)
        # the processor module's own rule (Qwen2.5-Omni: conv stride 2 then 2x pooling; Qwen3-Omni: per 100-frame
        # chunk); Qwen2.5-Omni's if the module has none
        own_rule = feat_extract_output_lengths(processor)
        counts = own_rule(lengths) if own_rule is not None else ((lengths - 1) // 2 + 1 - 2) // 2 + 1
        replacements["audio"] = [processor.audio_token * int(n) for n in counts]
    encoded = chat_template.encode_messages(conversation, max_seq_len=max_seq_len, replacements=replacements)
    out = {key: torch.tensor(value, dtype=torch.long) for key, value in encoded.items()}  # ids, attention mask, labels
    input_ids = out["input_ids"]
    if style == "qwen3":  # Qwen3-VL's M-RoPE uses the timestamps in the text, not seconds per grid
        features.pop("second_per_grid_ts", None)
    audio_seqlens = features["feature_attention_mask"].sum(-1) if "feature_attention_mask" in features else None
    out["position_ids"] = position_id_func(
        input_ids,
        image_grid_thw=features.get("image_grid_thw"),
        video_grid_thw=features.get("video_grid_thw"),
        second_per_grid_ts=features.get("second_per_grid_ts"),
        audio_seqlens=audio_seqlens,
    )
    if style == "omni" and "second_per_grid_ts" in features:  # the Omni thinker's forward keyword
        features["video_second_per_grid"] = features.pop("second_per_grid_ts")
    out.update(features)
    for kind in MEDIA_TYPES:
        token_id = getattr(processor, f"{kind}_token_id", None)
        if token_id is not None:
            out[f"{kind}_mask"] = input_ids == token_id
    return out


def process_sample_qwen2_5_vl(sample, processor, chat_template, position_id_func, **mm_configs):
    """Qwen2-VL and Qwen2.5-VL: images, videos as frames (`second_per_grid_ts` for Qwen2.5-VL's M-RoPE)."""
    return _process_sample(sample, processor, chat_template, position_id_func, style="qwen2", **mm_configs)


def process_sample_qwen3_vl(sample, processor, chat_template, position_id_func, **mm_configs):
    """Qwen3-VL dense and MoE: images, videos as frames with `<t seconds>` timestamps per temporal patch."""
    return _process_sample(sample, processor, chat_template, position_id_func, style="qwen3", **mm_configs)


def process_sample_qwen_omni(sample, processor, chat_template, position_id_func, **mm_configs):
    """Qwen2.5-Omni and Qwen3-Omni-MoE thinkers: images, videos as frames, and audio (Whisper features)."""
    return _process_sample(sample, processor, chat_template, position_id_func, style="omni", **mm_configs)
