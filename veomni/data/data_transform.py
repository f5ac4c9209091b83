"""Sample transforms: raw records -> token sequences with labels (HF convention: labels aligned to input_ids)."""

from typing import Any, Dict, List, Optional, Sequence, Union

IGNORE_INDEX = -100


class DataFormatError(ValueError):
    """A record that cannot be turned into a training sample; the message names the record."""


def _text_of(example: Dict[str, Any], text_keys: Union[str, Sequence[str]]) -> str:
    keys = [text_keys] if isinstance(text_keys, str) else list(text_keys)
    for key in keys:
        if key in example:
            value = example[key]
            if not isinstance(value, str):
                raise DataFormatError(f"key '{key}' holds {type(value).__name__}, expected a string")
            return value
    raise DataFormatError(f"no text key {keys} in record with keys {sorted(example)}")


def process_pretrain_example(
    example: Dict[str, Any],
    tokenizer,
    max_seq_len: int,
    text_keys: Union[str, Sequence[str]] = "text",
    add_eos: bool = True,
    split_long: bool = True,
    **kwargs,
) -> List[Dict[str, List[int]]]:
    """Tokenise one document; a document longer than `max_seq_len` becomes several samples, none dropped.

    A record that already holds `input_ids` is taken as pre-tokenised. `split_long=False` truncates instead
    (explicitly asked for, never silently).
    """
    if "input_ids" in example:
        ids = list(example["input_ids"])
    else:
        ids = tokenizer.encode(_text_of(example, text_keys), add_special_tokens=False)
        bos = getattr(tokenizer, "bos_token_id", None)
        if bos is not None and getattr(tokenizer, "add_bos_token", False):
            ids = [bos] + ids
        eos: Optional[int] = getattr(tokenizer, "eos_token_id", None)
        if add_eos and eos is not None:
            ids = ids + [eos]
    if not split_long:
        ids = ids[:max_seq_len]
    pieces = [ids[i : i + max_seq_len] for i in range(0, len(ids), max_seq_len)]
    return [{"input_ids": p, "attention_mask": [1] * len(p), "labels": list(p)} for p in pieces if len(p) > 1]
