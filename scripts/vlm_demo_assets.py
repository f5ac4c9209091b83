"""The VL demo's real assets, from package registries (nothing committed; see veomni/data/multimodal/demo_data.py):

<root>/vlm/processor/         Qwen2.5-VL processor: the real Qwen tokenizer (npm), Qwen2VLImageProcessor with every
                              image resized to 112x112 (8x8 patches of 14 px -> 16 visual tokens), chat template
<root>/vlm/easy_vqa.jsonl     easy-vqa (PyPI, MIT): one question about one 64x64 shape image per line
<root>/vlm/skimage.jsonl      scikit-image's sample photos (PyPI, public domain / CC0) with their captions

python scripts/vlm_demo_assets.py [--root .assets] [--limit 4000]
"""

import argparse
import json
import os

PIXELS = 112 * 112


def ensure_vlm_demo_assets(root: str = ".assets", limit: int = 4000) -> str:
    folder = os.path.join(root, "vlm")
    done = os.path.join(folder, "READY")
    if os.path.isfile(done):  # before any heavy import: train.sh calls this on every launch
        return folder
    from veomni.data.multimodal.demo_data import skimage_images, write_easy_vqa_jsonl
    from veomni.data.multimodal.processor_builder import build_qwen_processor_folder

    print(
        f"[veomni] building the VL demo assets under {folder} (easy-vqa, scikit-image, Qwen tokenizer) ...", flush=True
    )
    os.makedirs(folder, exist_ok=True)
    build_qwen_processor_folder("qwen2_5_vl", os.path.join(folder, "processor"), min_pixels=PIXELS, max_pixels=PIXELS)
    write_easy_vqa_jsonl(os.path.join(folder, "easy_vqa.jsonl"), "train", limit=limit)
    with open(os.path.join(folder, "skimage.jsonl"), "w") as f:
        for item in skimage_images().values():
            user = [{"type": "image", "image": item["path"]}, {"type": "text", "text": "What does this picture show?"}]
            messages = [{"role": "user", "content": user}, {"role": "assistant", "content": item["caption"]}]
            f.write(json.dumps({"messages": messages}) + "\n")
    open(done, "w").close()
    return folder


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", default=".assets")
    parser.add_argument("--limit", type=int, default=4000)
    a = parser.parse_args()
    ensure_vlm_demo_assets(a.root, a.limit)
