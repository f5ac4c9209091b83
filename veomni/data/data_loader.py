"""The loader: sharded, shuffled, packed micro-batches; `next()` returns one optimizer step's worth.

One path per kind of data:
- sized (MappingDataset, InterleavedMappingDataset, and any user map-style dataset, which becomes a MappingDataset
  over the same memory-mapped sample cache): GlobalBatchStream (global_batches.py);
- streamed (IterativeDataset, InterleavedIterableDataset, and any user iterable): SlotStream (streamed_batches.py).
Either way the global batches do not depend on the world size, and the loader state resumes exactly.
"""

import copy
import gc
import warnings
import weakref
from typing import Any, Callable, Dict, List, Optional

import torch
from torch.utils.data import IterableDataset

from ..compat.torchdata import IteratorSlotLoader
from ..utils.logging import get_logger
from .data_collator import MainCollator
from .data_transform import DataFormatError
from .global_batches import Batching, GlobalBatchStream
from .mapping import MappingDataset
from .streamed_batches import SlotStream, is_end_marker, reshard_slot_states, worker_states

logger = get_logger(__name__)
# torchdata's loader calls a torch API that torch has deprecated, on every iter(): nothing a user can act on
warnings.filterwarnings("ignore", message="'set_vital' is deprecated", category=UserWarning)


def build_loader(
    dataset,
    collate_fn: Callable,
    batching: Batching,
    dp_rank: int,
    dp_size: int,
    num_workers: int = 0,
    pin_memory: bool = False,
    prefetch_factor: Optional[int] = None,
    seed: int = 42,
    shuffle: bool = True,
    allow_changed_data: bool = False,
) -> "MicroBatchLoader":
    """A stateful loader of `dataset` for data-parallel rank `dp_rank` of `dp_size`; `next()` is a list of
    `batching.dataloader_batch_size` collated micro-batches. `seed` and `shuffle` apply to a user's map-style
    dataset (ours carry their own); `allow_changed_data`: see `MicroBatchLoader.load_state_dict`. Collective for
    sized data (its sample cache is opened or built here)."""
    known = isinstance(dataset, IterableDataset) or hasattr(dataset, "epoch_order")  # streamed, or sized of ours
    if not known and hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__"):  # a user's map-style dataset
        dataset = MappingDataset(dataset, seed=seed, shuffle=shuffle, name=type(dataset).__name__)
    if hasattr(dataset, "epoch_order"):  # sized: global batches from the sample cache
        dataset.prepare()
        stream = GlobalBatchStream(dataset, collate_fn, batching, dp_rank, dp_size)
    else:  # streamed: one sub-stream per micro-batch slot of a step
        stream = SlotStream(dataset, collate_fn, batching, dp_rank, dp_size, num_workers)
    extra = {"prefetch_factor": prefetch_factor} if num_workers > 0 and prefetch_factor else {}
    return MicroBatchLoader(
        stream,
        allow_changed_data=allow_changed_data,
        batch_size=batching.dataloader_batch_size,
        collate_fn=list,  # a step: the list of its collated micro-batches
        num_workers=num_workers,
        drop_last=batching.drop_last,
        pin_memory=pin_memory and torch.cuda.is_available(),
        worker_init_fn=_freeze_inherited_objects,
        **extra,
    )


def _freeze_inherited_objects(worker_id: int) -> None:
    """A loader worker is a fork of the training process: its garbage collector must leave what it inherited alone.
    Garbage of the parent's (a destroyed process group still in a reference cycle, an old loader iterator) would be
    finalized here, where the threads, queues and sockets it owns do not exist: a gloo group's destructor then waits
    forever on, or aborts over, the parent's threads (a worker killed by SIGABRT, seen in CI). Frozen, the inherited
    objects are never scanned either, so the collector does not copy the parent's heap into the worker page by page."""
    gc.freeze()


def build_dataloader(
    dataloader_type: str = "native",
    dataset=None,
    micro_batch_size: int = 1,
    global_batch_size: Optional[int] = None,
    dataloader_batch_size: int = 1,
    max_seq_len: int = 2048,
    train_steps: int = 0,
    dyn_bsz: bool = True,
    bsz_warmup_ratio: float = 0.0,
    bsz_warmup_init_mbtoken: int = 200,
    dyn_bsz_buffer_size: int = 200,
    num_workers: int = 0,
    drop_last: bool = True,
    pin_memory: bool = False,
    prefetch_factor: Optional[int] = None,
    seed: int = 42,
    build_collate_fn: bool = True,
    collate_fn_kwargs: Optional[Dict[str, Any]] = None,
    collate_fn: Optional[Callable] = None,
    dp_rank: Optional[int] = None,
    dp_size: Optional[int] = None,
    shuffle: bool = True,
    allow_changed_data: bool = False,
) -> "MicroBatchLoader":
    """The seed's call (its argument names), over `build_loader`: this rank's data-parallel place from the parallel
    state unless given, `global_batch_size` -> micro-batches per rank, the warmup's length from `train_steps *
    bsz_warmup_ratio`, and MainCollator(`collate_fn_kwargs`, the parallel state's Ulysses group) unless a
    `collate_fn` is given."""
    if dataloader_type != "native":
        raise ValueError(f"unknown dataloader type {dataloader_type!r}; only 'native' exists")
    if dp_rank is None or dp_size is None:  # the seed's call gives neither: this rank's place in the parallel state
        from ..distributed.parallel_state import get_parallel_state

        state = get_parallel_state()  # raises, naming init_parallel_state, when it was not initialised
        dp_rank, dp_size = state.dp_rank, state.dp_size
    if collate_fn is None:
        if not build_collate_fn:
            raise ValueError("build_collate_fn=False needs an explicit collate_fn")
        collate_fn = MainCollator(max_seq_len=max_seq_len, **_with_sequence_parallel(collate_fn_kwargs or {}))
    batching = Batching(
        micro_batch_size=micro_batch_size,
        max_seq_len=max_seq_len,
        dataloader_batch_size=_slots_per_rank(global_batch_size, micro_batch_size, dataloader_batch_size, dp_size),
        dyn_bsz=dyn_bsz,
        buffer_size=dyn_bsz_buffer_size,
        warmup_steps=int(train_steps * bsz_warmup_ratio),
        warmup_init_tokens=bsz_warmup_init_mbtoken,
        drop_last=drop_last,
    )
    return build_loader(
        dataset, collate_fn, batching, dp_rank, dp_size, num_workers, pin_memory, prefetch_factor, seed, shuffle,
        allow_changed_data,
    )  # fmt: skip


def reshard_loader_state(states: List[Dict[str, Any]], dp_rank: int, dp_size: int) -> Dict[str, Any]:
    """Loader states saved by the ranks of another data-parallel size -> the state for `dp_rank` of `dp_size`:
    a global position (sized data) is the same on every rank; streamed slots each go to their slot's new rank."""
    saved = worker_states(states[0]).values()
    if any(s.get("global_position") for s in saved):
        return copy.deepcopy(states[0])
    if any(s.get("slot_streams") for s in saved):
        return reshard_slot_states(states, dp_rank, dp_size)
    raise NotImplementedError("this data position cannot be resharded (a loader state of an earlier version)")


class MicroBatchLoader(IteratorSlotLoader):
    """The stateful loader over a micro-batch stream; its worker processes stop as soon as their iterator is
    abandoned (IteratorSlotLoader)."""

    def __init__(self, stream, allow_changed_data: bool = False, **kwargs):
        self.epoch_ended = False  # the last streamed epoch ended at a slot that ran out (not at a stop)
        super().__init__(stream, **kwargs)
        self.stream, self.allow_changed_data = stream, allow_changed_data

    def __iter__(self):
        iterator = super().__iter__()
        self.epoch_ended = False
        return _until_end_marker(iterator, weakref.ref(self)) if isinstance(self.stream, SlotStream) else iterator

    def data_fingerprint(self) -> Optional[Dict[str, Any]]:
        """What the data is made of (files, transform, tokenizer), None when it cannot be told (a user's dataset)."""
        dataset = self.stream.dataset
        return dataset.data_fingerprint() if hasattr(dataset, "data_fingerprint") else None

    def state_dict(self) -> Dict[str, Any]:
        """The position, and what the data was (a resume on other data is refused: `load_state_dict`)."""
        return {**super().state_dict(), _DATA: {"fingerprint": self.data_fingerprint(), "epoch": self.stream.epoch}}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Continue from a saved position, on the data it was saved on. On changed data (files, transform or
        tokenizer) it refuses in one line, or with `allow_changed_data` says so and leaves the position: the
        current epoch's data order starts again, from the new data."""
        state = dict(state)
        saved = state.pop(_DATA, None) or {}
        before, now = saved.get("fingerprint"), self.data_fingerprint()
        parts = _PARTS.items() if before and now else ()  # nothing to compare when either side cannot tell
        changed = " and the ".join(label for part, label in parts if before.get(part) != now.get(part))
        if changed and not self.allow_changed_data:
            raise DataFormatError(
                f"resuming on changed data: the {changed} differ from the checkpoint's (saved at "
                "epoch {epoch}); set --data.allow_changed_data true to train on the data as it is now, its order "
                "restarting at the current epoch".format(epoch=saved.get("epoch"))
            )
        if changed:
            logger.warning(
                f"the {changed} changed since the checkpoint: data.allow_changed_data, so the data "
                f"order restarts at the start of the current epoch ({saved.get('epoch')}), on the data as it is now"
            )
            return
        super().load_state_dict(state)

    def set_warmup_steps(self, steps: int) -> None:
        """The token-budget warmup's length in steps (known once the run's steps are counted)."""
        self.stream.batching.warmup_steps = steps

    def set_epoch(self, epoch: int, first_step: int = 0) -> None:
        """Reshuffle for `epoch` (the trainer calls this before each epoch's iter())."""
        self.stream.set_epoch(epoch, first_step)

    def num_batches(self, limit: Optional[int] = None) -> Optional[int]:
        """Optimizer steps in the epoch set by `set_epoch` (the same on every rank): the global plan's length for
        sized data, None for streamed data (whose length is unknown until it is read); at most `limit`."""
        if not isinstance(self.stream, GlobalBatchStream):
            return None
        steps = len(self.stream.plan(self.stream.epoch))
        return min(steps, limit) if limit else steps


_DATA = "veomni_data"  # the loader state's record of the data it read
_PARTS = {"files": "data files", "transform": "transform", "tokenizer": "tokenizer"}


def _until_end_marker(iterator, loader: "weakref.ref[MicroBatchLoader]"):
    """Ends the epoch at the first step a streamed slot could not fill (its micro-batches are end markers), even
    when other loader workers still have steps: later steps would otherwise come out of order."""
    for step in iterator:
        if any(is_end_marker(mb) for mb in step):
            if (owner := loader()) is not None:  # the trainer then counts the records left unread
                owner.epoch_ended = True
            return
        yield step


def _slots_per_rank(global_batch_size: Optional[int], micro: int, per_rank: int, dp_size: int) -> int:
    """dataloader_batch_size from global_batch_size (when given): a step is global_batch_size / micro_batch_size
    micro-batches over dp_size ranks. A global size that does not split, or that contradicts an explicit
    dataloader_batch_size, is refused rather than ignored."""
    if global_batch_size is None:
        return per_rank
    from ..arguments.arguments_types import batch_split_message

    if global_batch_size % (micro * dp_size):
        raise ValueError(batch_split_message(global_batch_size, micro, dp_size))
    slots = global_batch_size // (micro * dp_size)
    if per_rank not in (1, slots):
        raise ValueError(
            f"global_batch_size={global_batch_size} but micro_batch_size * dataloader_batch_size * dp_size = {micro} "
            f"* {per_rank} * {dp_size} = {micro * per_rank * dp_size}: give one of them (dataloader_batch_size "
            f"{slots} matches)"
        )
    return slots


def _with_sequence_parallel(collate_fn_kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """The collator's sp_size / sp_rank, when the caller gave none: the parallel state's Ulysses group."""
    if "sp_size" in collate_fn_kwargs:
        return collate_fn_kwargs
    from ..distributed.parallel_state import parallel_state_or_none

    state = parallel_state_or_none()
    if state is None:
        return collate_fn_kwargs
    return dict(collate_fn_kwargs, sp_size=state.sp_size, sp_rank=state.sp_rank)
