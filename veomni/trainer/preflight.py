"""Checks that run before the model is built, so that a user's mistake fails in seconds, not after set-up.

- `check_paths`: hub names resolved into the hub cache (veomni.utils.hub), then every path the config names exists
  (model config, weights, tokenizer, data).
- `check_first_records`: the data transform on the first records of each source. When they all fail the same
  way, the message says so and names the fix (for a missing text key: the fields the records do hold).
- `check_vocab`: a tokenizer with more tokens than the model's embedding has rows, before the model is built.
"""

import os
from collections import Counter
from typing import Any, List, Optional, Tuple

from ..arguments import ConfigError
from ..data.data_transform import DataFormatError
from ..data.hub_datasets import prepare_split
from ..utils.hub import HubNameError, dataset_reference, resolve_on_every_rank

_DEMO_HINT = " (the demo's assets are built by `python -m veomni.utils.demo_assets`; train.sh does it)"


def check_paths(args) -> None:
    """Resolve the hub names among the paths (in place, on every rank alike), then raise ConfigError naming the key
    of the first path that does not exist."""
    model, data = args.model, args.data
    resolve_hub_names(args)
    if not data.train_path:
        raise ConfigError("data.train_path is not set: give a jsonl/json/parquet/arrow file, a glob, or a folder")
    checks = [(f"model.{k}", getattr(model, k)) for k in ("config_path", "model_path", "tokenizer_path")]
    checks += [(f"data.{k}", getattr(data, k)) for k in ("train_path", "eval_path") if _local(getattr(data, k) or "")]
    for key, path in checks:
        if path and not os.path.exists(path):
            hint = _DEMO_HINT if ".assets" in path else ""
            raise ConfigError(f"{key}: {path} does not exist{hint}")
    train = args.train
    for key, asked in (
        ("checkpoint.keep_best", train.checkpoint.keep_best),
        ("early_stopping_patience", train.early_stopping_patience),
    ):
        if asked and not data.eval_path:
            raise ConfigError(f"train.{key} compares eval losses: it needs data.eval_path (held-out data)")


def _local(path: str) -> bool:
    """A path that names one local file or folder (not a glob, not a hub dataset read through `datasets`)."""
    return not any(c in path for c in "*?[") and dataset_reference(path) is None


def resolve_hub_names(args) -> None:
    """`org/name[@rev]` model paths and `hf://datasets/...` data paths replaced by their folders in the hub cache
    (downloaded by local rank 0 of each node), or for data read through `datasets` (`...:split`), by the path
    pinned to its commit (its split prepared by local rank 0, unless streamed); the hub name stays known for what
    records it (a LoRA adapter)."""
    streamed = "iterable" if args.data.datasets_type == "iterable" else True
    keys = [("model", k, False) for k in ("config_path", "model_path", "tokenizer_path")]
    keys += [("data", "train_path", streamed), ("data", "eval_path", True)]
    items = [(f"{group}.{k}", getattr(getattr(args, group), k), data) for group, k, data in keys]
    try:
        found = resolve_on_every_rank(items, prepare_split)
    except HubNameError as err:
        raise ConfigError(str(err)) from None
    for dotted, local in found.items():
        group, key = dotted.split(".")
        setattr(getattr(args, group), key, local)


# ------------------------------------------------------------------------------------------- first records
def check_first_records(dataset, data_args, n: int = 16) -> None:
    """Run the transform on the first `n` records of each source (`peek`: a user's dataset without it is not
    checked); raise when every one of them fails.

    Some failures among successes are left to the training policy (`data.skip_bad_samples`); all failing means
    the configuration does not fit the data, and no skipping would help: the run would train nothing.
    """
    for source in getattr(dataset, "sources", None) or [dataset]:
        if not hasattr(source, "peek"):
            continue
        errors = []
        for where, record, outcome in source.peek(n):
            if not isinstance(outcome, DataFormatError) and outcome:
                break  # one record that works is enough: the configuration fits the data
            error = outcome or DataFormatError(f"{where}: the record gives no sample (too short?)")
            errors.append((str(error), where, record))
        else:
            if errors:
                raise DataFormatError(_all_failed_message(errors, data_args))


def _all_failed_message(errors: List[Tuple[str, str, Any]], data_args) -> str:
    reasons = Counter(message.removeprefix(f"{where}: ") for message, where, _ in errors)
    reason, count = reasons.most_common(1)[0]
    same = "the same way" if count == len(errors) else f"({count} of them the same way)"
    message = f"all of the first {len(errors)} records fail {same}: {reason} (e.g. {errors[0][1]})"
    fix = suggest_fix([record for _, _, record in errors], data_args)
    return f"{message}; {fix}" if fix else message


def suggest_fix(records: List[Any], data_args) -> Optional[str]:
    """The setting that would make these records usable, from the fields they hold."""
    dicts = [r for r in records if isinstance(r, dict)]
    if not dicts:
        return None
    fields = sorted(set.intersection(*(set(r) for r in dicts)))
    conversation = data_args.data_type == "conversation"

    def chat(value) -> bool:
        return isinstance(value, list) and bool(value) and all(isinstance(m, dict) for m in value)

    fits = chat if conversation else (lambda value: isinstance(value, str))
    candidates = [k for k in fields if all(fits(r[k]) for r in dicts)]
    if not candidates:
        if not conversation and any(all(chat(r[k]) for r in dicts) for k in fields):
            return f"the records hold conversations (fields {fields}): set --data.data_type conversation"
        kind = "a list of messages" if conversation else "a string"
        return f"the records hold fields {fields}, none of which is {kind} in every record"
    # the field with the most text is the likely document (an `id` or `title` is a string too)
    best = max(candidates, key=lambda k: sum(len(str(r[k])) for r in dicts))
    already = {data_args.text_keys} | ({"messages", "conversations"} if conversation else set())
    if best in already:
        return None  # the key is right; the records fail for another reason, which the message gives
    others = f" (fields of that kind: {candidates})" if len(candidates) > 1 else ""
    return f"the records hold fields {fields}: set --data.text_keys {best}{others}"


def check_vocab(tokenizer, model_args) -> None:
    """Raise ConfigError when the tokenizer can produce ids the model has no embedding row for (an IndexError at
    step 1 otherwise, after the model is built)."""
    from ..models import build_config
    from ..models.multimodal import thinker_config

    path = model_args.config_path or model_args.model_path
    if tokenizer is None or path is None:
        return
    config = thinker_config(build_config(path, trust_remote_code=model_args.trust_remote_code))
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    vocab = getattr(text, "vocab_size", None)
    if isinstance(vocab, int) and len(tokenizer) > vocab:
        raise ConfigError(
            f"the tokenizer ({model_args.tokenizer_path}) has {len(tokenizer)} tokens but the model's vocab_size is "
            f"{vocab} ({path}): ids from {vocab} on have no embedding row. Use the model's own tokenizer, or a "
            f"model config with vocab_size >= {len(tokenizer)}"
        )
