"""Sample transforms: raw records -> token sequences with labels (HF convention: labels aligned to input_ids), and
`Transforming`, what every dataset of records shares: the transform applied with the bad-data policy, and `peek(n)`."""

import json
import sys
from functools import partial
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

from ..utils.logging import EVERY_RANK, get_logger

logger = get_logger(__name__)
IGNORE_INDEX = -100
Key = Tuple[int, ...]


class DataFormatError(ValueError):
    """A record that cannot be turned into a training sample; the message names the record."""


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
    [samples] = process_pretrain_batch([example], tokenizer, max_seq_len, text_keys, add_eos, split_long)
    if isinstance(samples, DataFormatError):
        raise samples
    return samples


def _pieces(ids: List[int], max_seq_len: int, split_long: bool) -> List[Dict[str, List[int]]]:
    if not split_long:
        ids = ids[:max_seq_len]
    pieces = [ids[i : i + max_seq_len] for i in range(0, len(ids), max_seq_len)]
    return [{"input_ids": p, "attention_mask": [1] * len(p), "labels": p} for p in pieces if len(p) > 1]


def process_pretrain_batch(
    examples: List[Dict[str, Any]],
    tokenizer,
    max_seq_len: int,
    text_keys: Union[str, Sequence[str]] = "text",
    add_eos: bool = True,
    split_long: bool = True,
    **kwargs,
) -> List[Union[List[Dict[str, List[int]]], DataFormatError]]:
    """`process_pretrain_example` over many records with one (multi-threaded) tokenizer call: for each record, its
    samples or the DataFormatError it raised."""
    keys = [text_keys] if isinstance(text_keys, str) else list(text_keys)
    out: List[Any] = [None] * len(examples)
    texts, where = [], []
    for i, example in enumerate(examples):
        key = next((k for k in keys if k in example), None)
        if "input_ids" in example:
            out[i] = _pieces(list(example["input_ids"]), max_seq_len, split_long)
        elif key is None:
            out[i] = DataFormatError(f"no text key {keys} in record with keys {sorted(example)}")
        elif not isinstance(example[key], str):
            out[i] = DataFormatError(f"key '{key}' holds {type(example[key]).__name__}, expected a string")
        else:
            texts.append(example[key])
            where.append(i)
    if texts:
        bos, eos = getattr(tokenizer, "bos_token_id", None), getattr(tokenizer, "eos_token_id", None)
        head = [bos] if bos is not None and getattr(tokenizer, "add_bos_token", False) else []
        tail = [eos] if add_eos and eos is not None else []
        for i, ids in zip(where, encode_many(tokenizer, texts)):
            out[i] = _pieces(head + ids + tail, max_seq_len, split_long)
    return out


def encode_many(tokenizer, texts: List[str]) -> List[List[int]]:
    """Token ids of many texts without special tokens, in one call where the tokenizer allows.

    A fast tokenizer's Rust backend is called directly, without character offsets (`encode_batch_fast`: 15% less
    CPU than `tokenizer(texts)`, the same ids), unless its tokenizer.json turns on truncation or padding, which
    transformers turns off for a call like ours.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    fast = getattr(backend, "encode_batch_fast", None)
    if fast is not None and backend.truncation is None and backend.padding is None:
        return [encoding.ids for encoding in fast(texts, add_special_tokens=False)]
    if callable(tokenizer):  # HF tokenizers encode a batch in parallel threads
        return tokenizer(texts, add_special_tokens=False, return_attention_mask=False)["input_ids"]
    return [tokenizer.encode(text, add_special_tokens=False) for text in texts]


# A transform may offer `.batched`: the same function over a list of records, called with the same keywords.
process_pretrain_example.batched = process_pretrain_batch


_ROLES = {"human": "user", "gpt": "assistant", "function": "tool"}  # ShareGPT's role names -> OpenAI's
_ROLES.update({role: role for role in ("user", "assistant", "system", "tool")})
CONVERSATION_FORMATS = ("auto", "messages", "alpaca")
ALPACA_NEEDED, ALPACA_OPTIONAL = ("instruction", "output"), ("input", "system", "history")


def _messages_of(
    example: Dict[str, Any], text_keys: Union[str, Sequence[str]], conversation_format: str = "auto"
) -> List[Dict[str, Any]]:
    """OpenAI messages pass through with all their keys (tool_calls, tool_call_id, reasoning_content, ...);
    ShareGPT `from/value` become `role/content`; an Alpaca record becomes a one-turn conversation (`auto`: a record
    with `instruction` or `output` and no conversation key is read as Alpaca)."""
    if conversation_format not in CONVERSATION_FORMATS:
        raise ValueError(f"conversation_format={conversation_format!r}; expected one of {list(CONVERSATION_FORMATS)}")
    keys = [text_keys] if isinstance(text_keys, str) else list(text_keys)
    keys += [k for k in ("messages", "conversations") if k not in keys]
    raw = next((example[k] for k in keys if k in example), None)
    if conversation_format == "alpaca" or (
        conversation_format == "auto" and raw is None and any(k in example for k in ALPACA_NEEDED)
    ):
        return _alpaca_messages(example)
    if raw is None:
        alpaca = " or Alpaca fields ['instruction', 'output']" if conversation_format == "auto" else ""
        raise DataFormatError(f"no conversation under {keys}{alpaca} in record with keys {sorted(example)}")
    if not isinstance(raw, list) or not raw:
        raise DataFormatError("empty conversation")
    messages = [normalise_message(m, f"message {i}") for i, m in enumerate(raw)]
    if not any(m["role"] == "assistant" for m in messages):
        raise DataFormatError("conversation has no assistant message: nothing to train on")
    return messages


def normalise_message(m: Any, where: str) -> Dict[str, Any]:
    """One OpenAI (`role/content`, other keys kept) or ShareGPT (`from/value`) message -> OpenAI form; `where`
    names it in the error. An assistant message may have null content when it has tool_calls."""
    if not isinstance(m, dict):
        raise DataFormatError(f"{where} is {type(m).__name__}, expected an object")
    role = m.get("role", m.get("from"))
    content = m.get("content", m.get("value"))
    tool_call = role in ("assistant", "gpt") and content is None and m.get("tool_calls")
    if role not in _ROLES or not (isinstance(content, str) or tool_call):
        raise DataFormatError(f"{where} needs a known role and string content, got {sorted(m)}")
    rest = {k: v for k, v in m.items() if k not in ("from", "value", "role", "content")}
    return {"role": _ROLES[role], "content": content, **rest}


def _alpaca_messages(example: Dict[str, Any]) -> List[Dict[str, Any]]:
    """`{instruction, input?, output, system?, history?}` -> [system], [history turns], user, assistant: the user
    turn is the instruction, then a newline and the input when there is one; the output is what is trained on (with
    the answers of `history`, a list of [instruction, answer] pairs, as LLaMA-Factory's Alpaca format has it)."""
    expected = f"an Alpaca record needs {list(ALPACA_NEEDED)} (strings; optional {list(ALPACA_OPTIONAL)})"
    missing = [k for k in ALPACA_NEEDED if k not in example]
    if missing:
        raise DataFormatError(f"Alpaca record lacks {missing}: it holds fields {sorted(example)}; {expected}")
    for key in ALPACA_NEEDED + ("input", "system"):
        if not isinstance(example.get(key), (str, type(None))):
            raise DataFormatError(f"Alpaca field '{key}' holds {type(example[key]).__name__}; {expected}")
    if not example["output"].strip():
        raise DataFormatError(f"Alpaca field 'output' is empty: nothing to train on (fields {sorted(example)})")
    messages = [{"role": "system", "content": example["system"]}] if example.get("system") else []
    history = example.get("history") or []
    if not isinstance(history, list) or not all(isinstance(t, (list, tuple)) and len(t) == 2 for t in history):
        raise DataFormatError(f"Alpaca field 'history' must be a list of [instruction, answer] pairs; {expected}")
    for question, answer in history:
        messages += [{"role": "user", "content": str(question)}, {"role": "assistant", "content": str(answer)}]
    prompt = example["instruction"] + (f"\n{example['input']}" if example.get("input") else "")
    messages += [{"role": "user", "content": prompt}, {"role": "assistant", "content": example["output"]}]
    return messages


def _tools_of(example: Dict[str, Any]) -> Dict[str, List[Any]]:
    """`{"tools": [function schemas]}` to pass to the chat template, or {} when the record has none."""
    tools = example.get("tools")
    if isinstance(tools, str):  # datasets often store the schemas as a JSON string
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as err:
            raise DataFormatError(f"'tools' is not valid JSON ({err.msg})") from None
    if tools is not None and not isinstance(tools, list):
        raise DataFormatError(f"'tools' must be a list of function schemas, got {type(tools).__name__}")
    return {"tools": tools} if tools else {}


def process_sft_example(
    example: Dict[str, Any],
    chat_template,
    max_seq_len: int,
    text_keys: Union[str, Sequence[str]] = "messages",
    truncate: bool = False,
    conversation_format: str = "auto",
    **kwargs,
) -> List[Dict[str, List[int]]]:
    """Encode one conversation (OpenAI `role/content` with optional `tools` and `tool_calls`, ShareGPT
    `from/value`, or an Alpaca `instruction/input/output` record); loss on assistant tokens only.

    `conversation_format`: `auto` (a conversation under `text_keys`/`messages`/`conversations`, else an Alpaca record
    when it has `instruction` or `output`), `messages` or `alpaca`. A conversation longer than `max_seq_len` is an
    error by default (skip such samples with `data.skip_bad_samples`); `truncate=True` keeps its first
    `max_seq_len` tokens, labelled as in the full conversation (an error if no assistant token is left).
    """
    tools = _tools_of(example)
    messages = _messages_of(example, text_keys, conversation_format)
    enc = chat_template.encode_messages(messages, max_seq_len=sys.maxsize if truncate else max_seq_len, **tools)
    if truncate:
        enc = {k: v[:max_seq_len] for k, v in enc.items()}
        if all(lab == IGNORE_INDEX for lab in enc["labels"]):
            raise DataFormatError(f"no assistant token in the first max_seq_len={max_seq_len} tokens")
    return [enc]


class Transforming:
    """Applies `self.transform` to records of `self.reader`: a bad record raises naming it, or is skipped and
    counted (`data.skip_bad_samples`)."""

    transform: Optional[Callable]
    skip_bad_samples: bool
    skipped: int = 0  # bad records skipped
    empty: int = 0  # records that gave no sample (empty text, a one-token document): counted, not errors

    def _reject(self, err: DataFormatError, where: Optional[Any]) -> List[Dict[str, Any]]:
        """Raise the bad record's error, or skip it. `where` (a lazy location: counting a jsonl line reads the
        file up to it) becomes text only when the message is shown, so skipping stays linear in the data."""

        def message() -> str:
            return str(err) if where is None else f"{where}: {err}"

        if not self.skip_bad_samples:
            raise DataFormatError(message() + " (set data.skip_bad_samples to skip such samples)") from None
        self.skipped += 1
        if self.skipped <= 5:
            logger.warning(f"skipped bad sample: {message()}", extra=EVERY_RANK)
        return []

    def _apply_many(self, records: List[Any], wheres: List[Any]) -> List[List[Dict[str, Any]]]:
        """Each record's samples, through the transform's batched form when it has one; a bad record (the reader's
        error, which already names its place, or the transform's, given the record's `where`) is `_reject`ed."""
        ok = [i for i, record in enumerate(records) if not isinstance(record, DataFormatError)]
        batched = _batched_form(self.transform)
        todo = [records[i] for i in ok]
        results = dict(zip(ok, batched(todo) if batched else [_transform(self.transform, r) for r in todo]))
        out = []
        for i, record in enumerate(records):
            res = results.get(i, record)
            if isinstance(res, DataFormatError):
                out.append(self._reject(res, wheres[i] if i in results else None))
            else:
                self.empty += not res
                out.append(res)
        return out

    def peek(self, n: int) -> List[Tuple[str, Any, Any]]:
        """The first `n` records as `(location, record, samples or the DataFormatError it gives)`, read from the
        start of the data without building or counting anything (pre-flight checks and the preview)."""
        return [
            (str(where), record, record if isinstance(record, DataFormatError) else _transform(self.transform, record))
            for record, where in self.reader.first(n)
        ]


def _transform(transform: Optional[Callable], record: Any) -> Any:
    """The record's samples (a list), or the DataFormatError the transform raised for it."""
    try:
        out = transform(record) if transform is not None else record
    except DataFormatError as err:
        return err
    return out if isinstance(out, list) else [out]


def _batched_form(transform: Optional[Callable]) -> Optional[Callable]:
    """The batched version of a transform (`fn.batched`, also through functools.partial), or None."""
    if isinstance(transform, partial):
        inner = getattr(transform.func, "batched", None)
        return partial(inner, *transform.args, **transform.keywords) if inner else None
    return getattr(transform, "batched", None)
