"""Conversations with images, videos and audio, from OpenAI or ShareGPT form, normalised to one structure.

Accepted sample forms (one row of a jsonl / parquet file):
- OpenAI: `{"messages": [{"role", "content": str | [part, ...]}]}`, a part being `{"type": "text", "text"}`,
  `{"type": "image", "image": src}`, `{"type": "image_url", "image_url": {"url": src}}`,
  `{"type": "video", "video": [frame src, ...] | folder of frames}`, `{"type": "audio", "audio": src}` or
  `{"type": "input_audio", "input_audio": {"data": base64}}`;
- ShareGPT: `{"conversations": [{"from": "human"|"gpt"|"system", "value": "...<image>..."}], "images": [src],
  "videos": [[frame src, ...]], "audios": [src]}` (or LLaVA's singular `"image": src` / `"video": frames`,
  as ShareGPT4V and LLaVA-Video ship them); each `<image>` / `<video>` / `<audio>` marker takes the next item of
  its list.

Normalised form: `[{"role": "system"|"user"|"assistant", "content": [{"type": "text", "text"} |
{"type": "image", "image": PIL.Image} | {"type": "video", "video": [PIL.Image, ...]} |
{"type": "audio", "audio": float32 array at 16 kHz}]}]` -- exactly what HF processors' `apply_chat_template`
takes. A media source is a local path (absolute, or relative to `media_dir`), raw bytes, a `data:` URI or plain
base64 text, an HF-datasets `{"bytes", "path"}` struct (parquet image columns), a PIL image, or (audio) an array.
"""

import base64
import io
import os
import re
import warnings
import wave
from typing import Any, Dict, List, Optional

import numpy as np

from ..data_transform import DataFormatError

MEDIA_TYPES = ("image", "video", "audio")
_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
_MARKER = re.compile(r"(<image>|<video>|<audio>)")
AUDIO_SAMPLING_RATE = 16000  # Whisper feature extractors (Qwen-Omni audio towers) take 16 kHz audio


def _read_bytes(src, media_dir: Optional[str]) -> bytes:
    if isinstance(src, (bytes, bytearray)):
        return bytes(src)
    if isinstance(src, dict):  # HF datasets' Image/Audio struct in parquet
        if src.get("bytes") is not None:
            return bytes(src["bytes"])
        return _read_bytes(src.get("path") or src.get("url"), media_dir)
    if not isinstance(src, str):
        raise DataFormatError(f"unsupported media source of type {type(src).__name__}")
    if src.startswith("data:"):
        return base64.b64decode(src.split(",", 1)[1])
    path = src[len("file://") :] if src.startswith("file://") else src
    if media_dir and not os.path.isabs(path):
        path = os.path.join(media_dir, path)
    if os.path.isfile(path):
        with open(path, "rb") as f:
            return f.read()
    if re.fullmatch(r"[A-Za-z0-9+/=\s]{16,}", src):
        return base64.b64decode(src)
    raise DataFormatError(f"media file not found (and not base64): {src[:120]}")


# The most pixels an image may have before it is decoded: a small file can hold a huge image (a 17 KB PNG of 12000 x
# 12000 pixels decodes to 0.4 GB and takes 30 s). 64M pixels is 8000 x 8000; data.mm_configs.max_image_pixels sets it.
MAX_IMAGE_PIXELS = 64_000_000


def _describe_source(src) -> str:
    if isinstance(src, str):
        return src[:120] if not src.startswith("data:") else "a data: URI"
    if isinstance(src, dict):
        return str(src.get("path") or src.get("url") or "embedded bytes")[:120]
    return f"{type(src).__name__} bytes"


def load_image(src, media_dir: Optional[str] = None, max_pixels: Optional[int] = None):
    """An RGB PIL image. An unreadable, truncated or not-an-image file, or one over `max_pixels` (checked from its
    header, before decoding), is a DataFormatError naming it: skipped with data.skip_bad_samples like any bad
    record."""
    from PIL import Image

    if isinstance(src, Image.Image):
        return src.convert("RGB")
    limit = max_pixels or MAX_IMAGE_PIXELS
    try:
        with warnings.catch_warnings():  # PIL's decompression-bomb warning: the limit below says it, per record
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(_read_bytes(src, media_dir)))
        with image:
            width, height = image.size
            if width * height > limit:
                raise DataFormatError(
                    f"image {_describe_source(src)} is {width} x {height} pixels, over the limit of {limit:,} "
                    "(data.mm_configs.max_image_pixels)"
                )
            return image.convert("RGB")
    except DataFormatError:
        raise
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as err:  # PIL's ways of saying "bad file"
        raise DataFormatError(f"unreadable image {_describe_source(src)}: {type(err).__name__}: {err}") from None


def load_video(src, media_dir: Optional[str] = None, max_pixels: Optional[int] = None) -> List[Any]:
    """A video as its frames (a list of images, or a folder of image files in name order); decoding video files
    needs a video library and is left to the data preparation step."""
    if isinstance(src, str):
        folder = os.path.join(media_dir, src) if media_dir and not os.path.isabs(src) else src
        if not os.path.isdir(folder):
            raise DataFormatError(f"a video must be a list of frames or a folder of frames: {src[:120]}")
        src = [os.path.join(folder, name) for name in sorted(os.listdir(folder))]
    frames = [load_image(frame, media_dir, max_pixels) for frame in src]
    if not frames:
        raise DataFormatError("a video without frames")
    return frames


def load_audio(src, media_dir: Optional[str] = None) -> np.ndarray:
    """Mono float32 samples at AUDIO_SAMPLING_RATE; an array is taken as already at that rate, a WAV file (path,
    bytes, base64) is read with the standard library and resampled linearly."""
    if isinstance(src, (np.ndarray, list)):
        return np.asarray(src, dtype=np.float32)
    if isinstance(src, dict) and "array" in src:  # HF datasets' decoded Audio
        return resample(np.asarray(src["array"], np.float32), int(src["sampling_rate"]), AUDIO_SAMPLING_RATE)
    try:
        with wave.open(io.BytesIO(_read_bytes(src, media_dir))) as w:
            width, channels, rate = w.getsampwidth(), w.getnchannels(), w.getframerate()
            raw = w.readframes(w.getnframes())
    except (wave.Error, EOFError, OSError) as err:
        raise DataFormatError(f"unreadable audio {_describe_source(src)}: {type(err).__name__}: {err}") from None
    if width != 2:
        raise DataFormatError(f"only 16-bit PCM WAV audio is read here, got {8 * width}-bit")
    samples = np.frombuffer(raw, dtype="<i2").astype(np.float32) / 32768.0
    samples = samples.reshape(-1, channels).mean(axis=1)
    return resample(samples, rate, AUDIO_SAMPLING_RATE)


def resample(samples: np.ndarray, rate: int, target: int) -> np.ndarray:
    if rate == target:
        return samples.astype(np.float32)
    n = int(round(len(samples) * target / rate))
    return np.interp(np.arange(n) * (rate / target), np.arange(len(samples)), samples).astype(np.float32)


def _openai_part(part, media_dir: Optional[str], max_image_pixels: Optional[int]) -> Dict[str, Any]:
    if isinstance(part, str):
        return {"type": "text", "text": part}
    kind = part.get("type") or next((k for k in ("text", *MEDIA_TYPES, "image_url") if k in part), None)
    if kind == "text":
        return {"type": "text", "text": part["text"]}
    if kind in ("image_url", "audio_url", "video_url"):
        url = part[kind]
        src = url.get("url") if isinstance(url, dict) else url
        kind = kind[: -len("_url")]
    elif kind == "input_audio":
        src, kind = part["input_audio"]["data"], "audio"
    elif kind in MEDIA_TYPES:
        src = part.get(kind) if part.get(kind) is not None else part.get("url", part.get("path"))
    else:
        raise DataFormatError(f"unsupported content part type {kind!r}")
    if kind == "audio":
        return {"type": kind, kind: load_audio(src, media_dir)}
    load = load_image if kind == "image" else load_video
    return {"type": kind, kind: load(src, media_dir, max_image_pixels)}


def _pool(sample, kind: str) -> List[Any]:
    if sample.get(f"{kind}s") is not None:
        return list(sample[f"{kind}s"])
    return [sample[kind]] if sample.get(kind) is not None else []


def _sharegpt_messages(sample) -> List[Dict[str, Any]]:
    """The ShareGPT turns as OpenAI messages, each marker a part holding the next item of its list (`images`, or
    LLaVA's singular `image` / `video`, as ShareGPT4V and LLaVA-Video ship them)."""
    pools = {kind: _pool(sample, kind) for kind in MEDIA_TYPES}
    used = dict.fromkeys(MEDIA_TYPES, 0)
    messages = []
    for turn in sample["conversations"]:
        parts = []
        for piece in _MARKER.split(turn.get("value", turn.get("content", ""))):
            if piece in ("<image>", "<video>", "<audio>"):
                kind = piece[1:-1]
                if used[kind] >= len(pools[kind]):
                    raise DataFormatError(f"more {piece} markers than {kind}s in the sample")
                parts.append({"type": kind, kind: pools[kind][used[kind]]})
                used[kind] += 1
            elif piece:
                parts.append(piece)
        messages.append({"role": turn.get("from", turn.get("role")), "content": parts})
    for kind in MEDIA_TYPES:
        if used[kind] != len(pools[kind]):
            raise DataFormatError(f"{len(pools[kind])} {kind}s but {used[kind]} <{kind}> markers")
    return messages


def conversation_from_sample(
    sample: Dict[str, Any], media_dir: Optional[str] = None, max_image_pixels: Optional[int] = None
) -> List[Dict[str, Any]]:
    """The sample's conversation in the normalised form above, media loaded (images of at most `max_image_pixels`,
    default MAX_IMAGE_PIXELS)."""
    if "messages" in sample:
        messages = sample["messages"]
    elif "conversations" in sample:
        messages = _sharegpt_messages(sample)
    else:
        raise DataFormatError(f"a multimodal sample needs 'messages' or 'conversations', got keys {sorted(sample)}")
    out = []
    for i, m in enumerate(messages):
        role = _ROLES.get(m.get("role"))
        if role is None:
            raise DataFormatError(
                f"message {i} has role {m.get('role')!r}; expected system, user or assistant (ShareGPT: human, gpt)"
            )
        content = m.get("content")
        parts = [content] if isinstance(content, str) else list(content or [])
        out.append({"role": role, "content": [_openai_part(p, media_dir, max_image_pixels) for p in parts]})
    return out


def media_of(conversation) -> Dict[str, List[Any]]:
    """The conversation's images, videos and audio clips, each list in order of appearance."""
    media = {kind: [] for kind in MEDIA_TYPES}
    for message in conversation:
        for part in message["content"]:
            if part["type"] in media:
                media[part["type"]].append(part[part["type"]])
    return media
