"""The step plan: how many optimizer steps each epoch of a run takes, computed once before training.

Sized data: counted from the loader's own global batch plan (the count equals the steps that run). Streamed data:
estimated from data.train_size / train_sample / max_steps; an epoch that runs out earlier ends there. The LR
schedule spans the planned steps. The loader is never rebuilt: a token-budget warmup, whose length follows the
counted steps, is set on it (`set_warmup_steps`) until the count no longer moves.
"""

import inspect
from typing import Callable, List, Optional, Tuple

from ..arguments import ConfigError
from ..utils.logging import get_logger

logger = get_logger(__name__)


def plan_steps(args, loader, dataset, count_steps: Callable[[Optional[int]], Optional[int]]) -> Tuple[List[int], bool]:
    """The run's step plan: the optimizer steps of each epoch, and whether every epoch runs to the end of its data
    (not cut by max_steps). Sets `args.train.train_steps` (steps of the first epoch) and the loader's warmup.
    `count_steps(limit)`: steps every data-parallel rank's loader yields this epoch (None for streamed data)."""
    train = args.train
    for _ in range(3):  # a token-budget warmup changes the batches, and the warmup length follows the steps
        counted = count_steps(train.max_steps)
        if counted is None:
            args.compute_train_steps(None)
            _set_warmup(loader, train)
            how = "estimated (streamed data: an epoch that runs out of data earlier ends there)"
            break
        if counted == 0:
            raise ConfigError(zero_steps_message(args, dataset))
        before, train.train_steps = train.train_steps, min(counted, train.max_steps or counted)
        how = "counted from the data as it will be batched"
        if train.max_steps and counted >= train.max_steps:
            how = "train.max_steps; the data holds at least that many"
        if not train.bsz_warmup_ratio or train.train_steps == before:
            break
        _set_warmup(loader, train)
    epoch_steps = [train.train_steps] * train.num_train_epochs
    if counted is not None and train.dyn_bsz:
        epoch_steps = _count_later_epochs(train, loader, count_steps)
    held = sum(epoch_steps)  # what the epochs hold (each counted up to max_steps at most)
    epoch_steps = _stop_at(epoch_steps, train.max_steps)
    whole = counted if counted and not (train.max_steps and counted >= train.max_steps) else None  # (not capped)
    total = sum(epoch_steps)
    if train.max_steps and held < train.max_steps:
        logger.warning(
            f"train.max_steps={train.max_steps} but {train.num_train_epochs} epoch(s) of the data hold {held} steps: "
            f"training runs {held}; for {train.max_steps} steps set --train.num_train_epochs "
            f"{-(-train.max_steps // train.train_steps)}"
        )
    per_epoch = " + ".join(map(str, epoch_steps)) if len(set(epoch_steps)) > 1 else train.train_steps
    holds = "; " + batch_description(args, dataset, whole) if getattr(args, "data", None) is not None else ""
    stop = f" (train.max_steps {train.max_steps} stops the run there)" if total < held else ""
    logger.info(f"{per_epoch} steps per epoch ({how}), {total} in total{stop}; the LR schedule spans {total}{holds}")
    return epoch_steps, whole is not None and total == held


def _stop_at(epoch_steps: List[int], max_steps: Optional[int]) -> List[int]:
    """`train.max_steps` is the run's total, as in HF Trainer and torchtitan: the epochs' steps up to it, the
    epochs after it empty ([31, 31] and 5 -> [5, 0]; 40 -> [31, 9])."""
    if not max_steps:
        return epoch_steps
    left, capped = max_steps, []
    for steps in epoch_steps:
        capped.append(min(steps, left))
        left -= capped[-1]
    return capped


def _set_warmup(loader, train) -> None:
    if hasattr(loader, "set_warmup_steps"):
        loader.set_warmup_steps(int(train.train_steps * train.bsz_warmup_ratio))


def _count_later_epochs(train, loader, count_steps) -> List[int]:
    """Steps of every epoch, each counted from its own batching plan (and capped by max_steps): dynamic batching
    packs each epoch's shuffle into a different number of micro-batches, and a token-budget warmup that follows
    the global step leaves the budgets of later epochs full. Collective (one all-reduce per epoch)."""
    steps = [train.train_steps]
    for epoch in range(1, train.num_train_epochs):
        set_epoch(loader, epoch, sum(steps))
        counted = count_steps(train.max_steps)
        steps.append(min(counted, train.max_steps) if train.max_steps else counted)
    set_epoch(loader, 0, 0)
    return steps


def set_epoch(loader, epoch: int, first_step: int) -> None:
    """Reshuffle for `epoch`; loaders that take it also learn the run's steps before the epoch (bsz warmup). A
    loader of a user's own `build_dataloader` (a benchmark's, say) may take the epoch only."""
    if "first_step" in inspect.signature(loader.set_epoch).parameters:
        loader.set_epoch(epoch, first_step=first_step)
    else:
        loader.set_epoch(epoch)


def close_loader(loader) -> None:
    """Stop the worker processes of the loader's current iterator now (loaders without `close()` keep theirs until
    their iterator is collected)."""
    if hasattr(loader, "close"):
        loader.close()


def batch_description(args, dataset, steps_per_epoch: Optional[int]) -> str:
    """What one optimizer step holds, in samples and tokens (a token budget under dyn_bsz)."""
    train, data = args.train, args.data
    if train.dyn_bsz:
        text = (
            f"a step packs up to {train.global_batch_size * data.max_seq_len:,} tokens (dyn_bsz: global_batch_size "
            f"{train.global_batch_size} x max_seq_len {data.max_seq_len}), however many samples that takes"
        )
    else:
        text = f"a step takes {train.global_batch_size} samples of up to {data.max_seq_len} tokens"
    try:
        records = len(dataset)
    except TypeError:
        return text
    if steps_per_epoch:
        text += f"; about {records / steps_per_epoch:,.1f} records a step here"
    return text


def micro_batch_unit(train, data) -> str:
    """What one micro-batch holds: a token budget under dyn_bsz, else a number of samples."""
    if train.dyn_bsz:
        return f"up to {train.micro_batch_size * data.max_seq_len:,} tokens"
    return f"{train.micro_batch_size} samples"


def zero_steps_message(args, dataset) -> str:
    train, data = args.train, args.data
    try:
        records = f"the {len(dataset)} records"
    except TypeError:
        records = "the data"
    return (
        f"this run would train 0 steps: {records} ({data.train_path}) do not fill one global batch on every "
        f"data-parallel rank ({train.dataloader_batch_size} micro-batches of {micro_batch_unit(train, data)} per "
        f"rank, {train.accelerator.dp_size} ranks). "
        "Use more data, or a smaller train.global_batch_size / train.micro_batch_size"
        + (" (check the warnings above: data.skip_bad_samples skipped bad records)" if data.skip_bad_samples else "")
    )
