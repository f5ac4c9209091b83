"""Preference pairs -> packed samples: one sample per pair, its chosen sequence then its rejected one.

Records, as TRL and LLaMA-Factory read them:
    {"prompt": str, "chosen": str, "rejected": str}                    plain text: prompt + response (+ EOS), TRL's rule
    {"prompt": [messages], "chosen": [messages], "rejected": [...]}     conversational: the model's chat template
    {"messages"|"conversations": [...], "chosen": ..., "rejected": ...}  a conversation, then the final pair (a message,
                                                                         a list of messages, or the reply's text)
    {"prompt_ids": [...], "chosen_ids": [...], "rejected_ids": [...]}   already tokenised (TRL's own columns)
Loss-bearing tokens are the final response's only (labels elsewhere IGNORE_INDEX). A pair with an empty response,
identical chosen and rejected sequences, or more than `max_seq_len` tokens (chosen and rejected together: they pack
into one micro-batch) is a DataFormatError, which the dataset names by file and line and skips or refuses per
`data.skip_bad_samples`.

The sample is `input_ids`/`labels`/`attention_mask` of chosen + rejected, and `dpo_part` (0 chosen, 1 rejected):
all per-token integer fields, so the data cache stores it like any other. The packer sees one sample of
len(chosen) + len(rejected) tokens: a pair never straddles micro-batches or ranks. `PreferenceCollator` then makes
the two sequences separate documents (position ids restart at each, labels shifted within each) and adds
`sequence_index` (2p chosen, 2p + 1 rejected of the micro-batch's pair p) for the per-sequence sums
(veomni.ops.preference_loss).
"""

import hashlib
import os
from dataclasses import dataclass
from typing import Any, Dict, List, Sequence

import numpy as np
import torch

from .data_collator import DataCollateInfo, MainCollator
from .data_transform import IGNORE_INDEX, DataFormatError, normalise_message

PAIR_KEYS = ("chosen", "rejected")


def _as_messages(value: Any, key: str, role: str = "assistant") -> List[Dict[str, Any]]:
    """Text (a `role` message), one message or a list of messages -> messages (role/content)."""
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if isinstance(value, dict):
        value = [value]
    if not isinstance(value, list) or not value:
        raise DataFormatError(f"'{key}' must be a string, a message or a list of messages, got {value!r:.60}")
    return [normalise_message(m, f"'{key}' message {i}") for i, m in enumerate(value)]


def _encode_text(example: Dict[str, Any], tokenizer) -> List[Dict[str, List[int]]]:
    """TRL's rule for plain-text pairs: tokenise prompt and prompt + response (+ EOS unless it ends with it); the
    response is what follows the longest common prefix of the prompt's ids."""
    eos = tokenizer.eos_token or ""
    prompt_ids = tokenizer(example["prompt"])["input_ids"]
    pairs = []
    for key in PAIR_KEYS:
        text = example[key] if example[key].endswith(eos) else example[key] + eos
        pairs.append(tokenizer(example["prompt"] + text)["input_ids"])
    # the same prompt for both, as TRL cuts it (os.path.commonprefix compares any sequences item by item)
    shared = min(len(os.path.commonprefix([prompt_ids, ids])) for ids in pairs)
    return [_labelled(ids, shared) for ids in pairs]


def _labelled(ids: List[int], prompt_len: int) -> Dict[str, List[int]]:
    return {"input_ids": list(ids), "labels": [IGNORE_INDEX] * prompt_len + list(ids[prompt_len:])}


def _encode_ids(example: Dict[str, Any]) -> List[Dict[str, List[int]]]:
    prompt = [int(t) for t in example["prompt_ids"]]
    return [_labelled(prompt + [int(t) for t in example[f"{key}_ids"]], len(prompt)) for key in PAIR_KEYS]


def _encode_messages(example: Dict[str, Any], chat_template, text_keys) -> List[Dict[str, List[int]]]:
    """Conversational pairs through the chat template, loss on the last assistant turn (the response) only."""
    keys = [text_keys] if isinstance(text_keys, str) else list(text_keys)
    key = next((k for k in ["prompt", *keys, "messages", "conversations"] if k in example), None)
    if key is None:
        raise DataFormatError(f"no prompt: neither 'prompt' nor a conversation under {keys} in {sorted(example)}")
    history = _as_messages(example[key], key, "user" if key == "prompt" else "assistant")  # a text prompt: the user's
    out = []
    for key in PAIR_KEYS:
        response = _as_messages(example[key], key)
        if response[-1]["role"] != "assistant":
            raise DataFormatError(f"'{key}' must end with an assistant message, got role {response[-1]['role']!r}")
        out.append(chat_template.encode_messages(history + response, max_seq_len=1 << 30))
    return out


def _check_pair(chosen: Dict[str, List[int]], rejected: Dict[str, List[int]], max_seq_len: int) -> None:
    for key, seq in zip(PAIR_KEYS, (chosen, rejected)):
        if all(label == IGNORE_INDEX for label in seq["labels"]):
            raise DataFormatError(f"empty '{key}' response: no token to score")
    if chosen["input_ids"] == rejected["input_ids"]:
        raise DataFormatError("'chosen' and 'rejected' are identical: the pair prefers nothing")
    total = len(chosen["input_ids"]) + len(rejected["input_ids"])
    if total > max_seq_len:
        raise DataFormatError(
            f"pair has {len(chosen['input_ids'])} + {len(rejected['input_ids'])} = {total} tokens, more than "
            f"max_seq_len={max_seq_len} (chosen and rejected pack into one micro-batch)"
        )


def process_preference_example(
    example: Dict[str, Any], tokenizer, chat_template, max_seq_len: int, text_keys="messages", **kwargs
) -> List[Dict[str, List[int]]]:
    """One preference record -> one packed pair sample (see the module doc)."""
    if "prompt_ids" in example:
        chosen, rejected = _encode_ids(example)
    else:
        missing = [k for k in PAIR_KEYS if k not in example]
        if missing:
            raise DataFormatError(f"preference record lacks {missing}: it holds fields {sorted(example)}")
        plain = isinstance(example.get("prompt"), str) and all(isinstance(example[k], str) for k in PAIR_KEYS)
        if plain and not any(k in example for k in ("messages", "conversations")):
            chosen, rejected = _encode_text(example, tokenizer)
        else:
            chosen, rejected = _encode_messages(example, chat_template, text_keys)
    _check_pair(chosen, rejected, max_seq_len)
    ids, labels = chosen["input_ids"] + rejected["input_ids"], chosen["labels"] + rejected["labels"]
    part = [0] * len(chosen["input_ids"]) + [1] * len(rejected["input_ids"])
    return [{"input_ids": ids, "attention_mask": [1] * len(ids), "labels": labels, "dpo_part": part}]


def pair_key(sample: Dict[str, Any]) -> str:
    """A pair's identity by content (its token ids, labels and split): the precomputed reference's lookup key."""
    digest = hashlib.blake2b(digest_size=16)
    for name in ("input_ids", "labels", "dpo_part"):
        digest.update(np.asarray(sample[name], dtype=np.int64).tobytes())
    return digest.hexdigest()


def split_pair(sample: Dict[str, Any]) -> List[Dict[str, Any]]:
    """A pair sample -> its chosen and rejected documents (input_ids, labels)."""
    part = torch.as_tensor(sample["dpo_part"])
    n = int((part == 0).sum())
    ids, labels = torch.as_tensor(sample["input_ids"]), torch.as_tensor(sample["labels"])
    return [{"input_ids": ids[:n], "labels": labels[:n]}, {"input_ids": ids[n:], "labels": labels[n:]}]


SEQUENCE_INDEX = "sequence_index"


@dataclass
class PreferenceCollator:
    """Pair samples -> one packed micro-batch of 2P documents through MainCollator, with `sequence_index`,
    `num_pairs` (P) and `loss_units`: the pairs this rank counts for the step's normalisation (P on the first rank of
    a sequence-parallel group, 0 on the others, which hold other slices of the same pairs)."""

    main: MainCollator

    def __post_init__(self):
        self.main.collate_infos.setdefault(SEQUENCE_INDEX, DataCollateInfo(pack_dim=-1, sp_slice=True, sp_pad_value=-1))

    def __call__(self, samples: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
        docs = []
        for sample in samples:
            for doc in split_pair(sample):
                doc[SEQUENCE_INDEX] = torch.full((len(doc["input_ids"]),), len(docs), dtype=torch.long)
                docs.append(doc)
        batch = self.main(docs)
        batch["num_pairs"] = len(samples)
        batch["pair_keys"] = [pair_key(sample) for sample in samples]
        batch["loss_units"] = len(samples) if self.main.sp_rank == 0 else 0
        batch["num_targets"] = int((batch["labels"] != IGNORE_INDEX).sum())  # this rank's scored tokens (host)
        return batch
