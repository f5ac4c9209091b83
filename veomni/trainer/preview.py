"""What a run trains on, shown before it trains.

- `python tasks/train_text.py CONFIG --preview N [--key value ...]` (`run_preview`): N samples as the model sees them
  (decoded, the tokens that carry loss between `[[ ]]`, or in colour on a terminal), the packing of the first
  micro-batch (its documents, their tokens and loss tokens), the tokens of a step and the steps of an epoch. It builds
  the tokenizer, the data and the loader exactly as training does (the mapping cache it builds is the one training
  maps), never the model, and exits 0.
- `log_first_sample(trainer)`: the first record's sample, short and marked the same way, logged once (rank 0) at the
  start of a normal run.

A token carries loss when its label is not IGNORE_INDEX and it is not the first token of its document (nothing
predicts that one): exactly what the loss counts.
"""

import itertools
import os
import re
import sys
from typing import Any, Callable, Dict, List, Optional, Sequence, TextIO, Tuple

import torch
import torch.distributed as dist

from ..data.data_transform import IGNORE_INDEX
from ..distributed import destroy_parallel_state
from ..distributed.parallel_state import init_parallel_state_from_config
from ..ops.loss import count_loss_tokens
from ..utils.device import get_device
from ..utils.logging import get_logger
from .preflight import check_first_records
from .step_count import batch_description, close_loader, micro_batch_unit

logger = get_logger(__name__)

MARKS = ("[[", "]]")
ANSI_MARKS = ("\x1b[1;32m", "\x1b[0m")  # bold green on a terminal
_REPEAT = 8  # a run of this many identical tokens (image pads) is shown once, with its count


# ----------------------------------------------------------------------------------------------- rendering
def loss_flags(labels: Sequence[int]) -> List[bool]:
    """Per token of one document: does it carry loss (a label, and not the document's first token)."""
    return [i > 0 and int(lab) != IGNORE_INDEX for i, lab in enumerate(labels)]


def _decode(tokenizer, ids: Sequence[int]) -> str:
    out = []
    for token, run in itertools.groupby(ids):
        count = len(list(run))
        out.append(f"{tokenizer.decode([token])}×{count}" if count >= _REPEAT else tokenizer.decode([token] * count))
    return "".join(out)


def render_sample(tokenizer, input_ids: Sequence[int], labels: Sequence[int], color: bool = False) -> str:
    """The document decoded, with every run of tokens that carry loss between `[[ ]]` (ANSI colour if `color`)."""
    opening, closing = ANSI_MARKS if color else MARKS
    pieces = []
    for carries, run in itertools.groupby(zip((int(t) for t in input_ids), loss_flags(labels)), key=lambda p: p[1]):
        text = _decode(tokenizer, [token for token, _ in run])
        pieces.append(f"{opening}{text}{closing}" if carries else text)
    return "".join(pieces)


def marked_spans(rendered: str) -> List[str]:
    """The texts between `[[` and `]]` of a `render_sample` output (for checks and tests)."""
    return re.findall(re.escape(MARKS[0]) + "(.*?)" + re.escape(MARKS[1]), rendered, flags=re.DOTALL)


def _shorten(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]} [... {len(text) - 2 * half} characters ...] {text[-half:]}"


# ------------------------------------------------------------------------------------------- packed batches
def documents(micro_batch: Dict[str, Any]) -> List[Tuple[int, int]]:
    """(start, end) of each document packed in a collated micro-batch (where its position ids restart at 0)."""
    pos = _row(micro_batch, "position_ids")
    starts = [i for i, p in enumerate(pos) if p == 0] or [0]
    return list(zip(starts, starts[1:] + [len(pos)]))


def _row(micro_batch: Dict[str, Any], key: str) -> List[int]:
    """The micro-batch's first row of `key`; its labels realigned to the input ids (the collator shifts them: the
    label of token t is the target of position t - 1), as `loss_flags` reads a sample's labels."""
    value = micro_batch[key]
    row = value.reshape(-1, value.shape[-1])[0].tolist()
    return [IGNORE_INDEX] + row[:-1] if key == "labels" else row


# ------------------------------------------------------------------------------------------------- preview
def _bare_trainer(build_trainer: Callable[[Any], Any], args):
    """The task's trainer object with its `args` only: `build_trainer` is called with BaseTrainer's set-up (model,
    optimizer, checkpoints) left out, so the task's own build_data_transform / build_dataset / build_dataloader run."""
    from .base import BaseTrainer

    original = BaseTrainer.__init__

    def shell(self, a, *_, **__):  # (a task may hand its trainer callbacks too)
        self.args = a

    BaseTrainer.__init__ = shell
    try:
        return build_trainer(args)
    finally:
        BaseTrainer.__init__ = original


def _one_process(args) -> None:
    """A plain `python` preview is one process: global batches do not depend on the world size, so the data
    parallel and model parallel sizes become 1 and a step's micro-batches all come to this process."""
    acc, train = args.train.accelerator, args.train
    acc.dp_size = acc.dp_replicate_size = acc.dp_shard_size = 1
    acc.tp_size = acc.pp_size = acc.cp_size = acc.ulysses_size = 1
    acc.extra_parallel_sizes, acc.extra_parallel_names, acc.extra_parallel_placement_innermost = [], [], []
    train.dataloader_batch_size = train.global_batch_size // train.micro_batch_size


def run_preview(args, n: int, build_trainer: Callable[[Any], Any], out: Optional[TextIO] = None) -> None:
    """Print n samples as the model sees them, the packing of a micro-batch, tokens per step and steps per epoch."""
    out = out or sys.stdout
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        _one_process(args)
    trainer = _bare_trainer(build_trainer, args)
    trainer.parallel_state = init_parallel_state_from_config(args.train.accelerator)
    trainer.is_main = trainer.parallel_state.is_main_process
    trainer.device = get_device()
    try:
        trainer.train_dataset = trainer.build_dataset()
        check_first_records(trainer.train_dataset, args.data)
        trainer.train_dataloader = trainer.build_dataloader()
        trainer.compute_train_steps()
        steps: List[List[Dict[str, Any]]] = []
        docs_seen = 0
        for micro_batches in trainer.train_dataloader:  # the steps in training order, until n documents are seen
            steps.append(micro_batches)
            docs_seen += sum(len(documents(mb)) for mb in micro_batches)
            if docs_seen >= n or len(steps) >= trainer.total_steps:
                break
        close_loader(trainer.train_dataloader)
        first = steps[0] if steps else []
        totals = torch.tensor(
            [sum(mb["input_ids"].numel() for mb in first), sum(count_loss_tokens(mb["labels"]) for mb in first)],
            dtype=torch.int64,
            device=trainer.device,
        )
        dist.all_reduce(totals, group=trainer.parallel_state.dp_group)
        if trainer.is_main:
            color = hasattr(out, "isatty") and out.isatty() and not os.environ.get("NO_COLOR")
            out.write(_report(trainer, steps, n, totals.tolist(), color, world))
            out.flush()
    finally:
        destroy_parallel_state()


def _report(trainer, steps, n: int, totals: List[int], color: bool, world: int) -> str:
    args, tok = trainer.args, trainer.tokenizer
    train, data = args.train, args.data
    marks = "in colour" if color else "between [[ ]]"
    lines = [f"=== {n} sample(s) as the model sees them (tokens that carry loss {marks}) ==="]
    shown = 0
    for s, micro_batches in enumerate(steps):
        for m, mb in enumerate(micro_batches):
            ids, labels = _row(mb, "input_ids"), _row(mb, "labels")
            for d, (start, end) in enumerate(documents(mb)):
                if shown >= n:
                    break
                shown += 1
                loss = sum(loss_flags(labels[start:end]))
                # a preference micro-batch (veomni.data.preference) packs each pair's chosen, then rejected sequence
                pair = f", pair {d // 2 + 1} {('chosen', 'rejected')[d % 2]}" if "sequence_index" in mb else ""
                lines.append(
                    f"--- sample {shown} (step {s + 1}, micro-batch {m + 1}, document {d + 1}{pair}): "
                    f"{end - start} tokens, {loss} carry loss ---"
                )
                lines.append(render_sample(tok, ids[start:end], labels[start:end], color))
    if shown < n:
        lines.append(f"(the data holds {shown} sample(s) in the steps that run)")
    if steps:
        mb = steps[0][0]
        ids, labels = _row(mb, "input_ids"), _row(mb, "labels")
        spans = documents(mb)
        budget = f", packed up to {train.micro_batch_size * data.max_seq_len:,}" if train.dyn_bsz else ""
        lines.append(
            f"=== packing of micro-batch 1 of step 1: {len(spans)} document(s), {len(ids):,} tokens{budget}; "
            "position ids restart at each document, attention stays within it ==="
        )
        for d, (start, end) in enumerate(spans):
            head = _shorten(tok.decode(ids[start:end]), 70)
            loss = sum(loss_flags(labels[start:end]))
            lines.append(f"  document {d + 1}: tokens {start}..{end - 1} ({end - start} tokens, {loss} loss) {head!r}")
    per_step = f"{batch_description(args, None, None)}; micro-batches of {micro_batch_unit(train, data)}"
    epochs = trainer.epoch_steps
    per_epoch = " + ".join(map(str, epochs)) if len(set(epochs)) > 1 else str(epochs[0])
    lines += [
        "=== steps ===",
        f"  {per_step}",
        f"  step 1: {totals[0]:,} tokens, {totals[1]:,} carry loss",
        f"  {per_epoch} step(s) per epoch, {train.num_train_epochs} epoch(s): {sum(epochs)} step(s)"
        + (f" (train.max_steps {train.max_steps})" if train.max_steps else ""),
    ]
    if world == 1:
        lines.append(
            "  (one process: global batches are the same on any number of ranks; with global_batch_size unset a "
            "step is micro_batch_size per rank, so more ranks make larger steps)"
        )
    lines.append("preview only: no model was built")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------- first sample of a run
def log_first_sample(trainer, limit: int = 1200) -> None:
    """Log the sample of the first record that gives one (the data's `peek`) once, on rank 0, decoded and marked
    (the whole of it when short, else both ends)."""
    dataset = trainer.train_dataset
    if not trainer.is_main or trainer.tokenizer is None or not hasattr(dataset, "peek"):
        return
    try:
        peeked = dataset.peek(8)
    except Exception as err:  # noqa: BLE001 - a courtesy print must never stop a run
        logger.info(f"first sample not shown ({type(err).__name__}: {err})")
        return
    found = [(out[0], where) for where, _, out in peeked if isinstance(out, list) and out and "input_ids" in out[0]]
    if not found:
        return
    sample, where = found[0]
    ids = torch.as_tensor(sample["input_ids"]).reshape(-1).tolist()
    labels = torch.as_tensor(sample["labels"]).reshape(-1).tolist() if "labels" in sample else ids
    text = _shorten(render_sample(trainer.tokenizer, ids, labels), limit)
    logger.info(
        f"first sample ({where}: {len(ids)} tokens, {sum(loss_flags(labels))} carry loss, between [[ ]]; "
        f"--preview N shows more):\n{text}"
    )
