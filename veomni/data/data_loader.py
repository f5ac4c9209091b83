"""`build_dataloader`: sharded, shuffled, packed micro-batches; `next()` returns one optimizer step's worth.

The pipeline per data-parallel rank (and per worker):
    record order (seeded per epoch) -> rank/worker shard -> transform -> micro-batcher -> MainCollator
The micro-batcher fills each micro-batch either with `micro_batch_size` samples or, with dyn_bsz, with as many
samples as fit in a token budget of `micro_batch_size * max_seq_len` (chosen first-fit from a buffer, so
micro-batches come out nearly full). Its state is a handful of integers plus the buffered sample ids, so a
resumed run reproduces exactly the batches the uninterrupted run would have seen.
"""

import copy
import itertools
import logging
import warnings
import weakref
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
from torch.utils.data import IterableDataset, get_worker_info

from ..compat.torchdata import (
    IteratorSlotLoader,
    iterator_shut_down,
    keep_unstarted_iterator_state,
    shutdown_iterator_workers,
)
from ..utils.logging import get_logger
from .cached_dataset import CachedSampleIndex, cached_sources
from .data_collator import MainCollator
from .dataset import samples_many, shuffled_shard_keys
from .global_batches import BatchingStream, GlobalBatchStream, SampleIndex, first_fit
from .streamed_batches import SlotStream, is_end_marker, reshard_slot_states, supports_slots

logger = get_logger(__name__)
# torchdata's loader calls a torch API that torch has deprecated, on every iter(): nothing a user can act on
warnings.filterwarnings("ignore", message="'set_vital' is deprecated", category=UserWarning)


class _MapStyle:
    """A user's map-style dataset seen through the resumable protocol (keys are indices)."""

    def __init__(self, dataset, seed: int, shuffle: bool):
        self.dataset, self.seed, self.shuffle = dataset, seed, shuffle

    def iter_keys(self, epoch, shard, num_shards, state):
        return shuffled_shard_keys(len(self.dataset), self.seed, epoch, self.shuffle, shard, num_shards, state)

    def samples(self, key):
        return _as_list(self.dataset[key[0]])


class _PlainIterable:
    """A user's iterable dataset without keys or state: shard by position. A resume re-iterates the dataset from
    its start and skips what was consumed (so it must be re-iterable and yield the same items in order)."""

    def __init__(self, dataset):
        self.dataset, self._items, self._expected = dataset, {}, set()

    def expect(self, keys) -> None:
        """Keys of a resumed buffer: keep their items while skipping ahead."""
        self._expected |= set(keys)

    def iter_keys(self, epoch, shard, num_shards, state):
        state.setdefault("count", 0)
        resume_at, i = state["count"], -1
        for i, item in enumerate(self.dataset):
            if i < resume_at:
                if (i,) in self._expected:
                    self._items[(i,)] = item
                continue
            state["count"] = i + 1
            if i % num_shards == shard:
                self._items[(i,)] = item
                yield (i,)
        if i + 1 < resume_at:
            raise RuntimeError(
                f"cannot resume {type(self.dataset).__name__}: it yielded {i + 1} items, fewer than the {resume_at} "
                "already consumed. A plain IterableDataset is resumed by iterating it again from the start and "
                "skipping; make it re-iterable in the same order, or give it iter_keys/samples (see dataset.py)"
            )

    def samples(self, key):
        return _as_list(self._items.pop(tuple(key)))


def as_resumable(dataset, seed: int = 42, shuffle: bool = True):
    if hasattr(dataset, "iter_keys") and hasattr(dataset, "samples"):
        return dataset
    if hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__"):
        return _MapStyle(dataset, seed, shuffle)
    return _PlainIterable(dataset)


class MicroBatchStream(BatchingStream):
    """Yields collated micro-batches for one shard (data-parallel rank x worker) of a dataset."""

    def __init__(self, dataset, collate_fn: Callable, seed: int, shuffle: bool = True, **batching):
        super().__init__(collate_fn, **batching)
        self.source = as_resumable(dataset, seed, shuffle)
        self.read_ahead = 64

    # ---------------------------------------------------------------------------------------- iteration
    def __iter__(self) -> Iterator[Dict[str, torch.Tensor]]:
        info = get_worker_info()
        worker_id, num_workers = (info.id, info.num_workers) if info else (0, 1)
        return self._micro_batches(worker_id, num_workers, self.collate_fn)

    def _micro_batches(self, worker_id: int, num_workers: int, collate_fn: Callable) -> Iterator[Any]:
        """The batching plan of one worker; `count_loader_steps` runs it with a collate that only counts."""
        shard, num_shards = worker_id * self.dp_size + self.dp_rank, num_workers * self.dp_size
        state = {"epoch": self.epoch, "source": {}, "buffer": [], "produced": 0, "skipped": 0, "empty": 0}
        state.update(samples=0, group=0, dropped=0)
        if self._resume is not None and self._resume.get("epoch") == self.epoch:
            state.update(self._resume)
        self._resume = None
        self._state = state
        source = self.source
        # the source's counters run over its lifetime: the state holds this epoch's share
        base = {c: getattr(source, c, 0) - state[c] for c in ("skipped", "empty")}
        buffer = state["buffer"]  # entries: [*key, piece index, length]
        if buffer and hasattr(source, "expect"):
            source.expect({tuple(e[:-2]) for e in buffer})  # a resumed buffer: its records must be read again
        keys = source.iter_keys(self.epoch, shard, num_shards, state["source"])
        cache: Dict[Tuple[int, ...], List[Dict[str, Any]]] = {}

        def pieces(key):
            if key not in cache:
                cache[key] = source.samples(key)
            return cache[key]

        while True:
            exhausted = False
            while len(buffer) < self.buffer_size and not exhausted:
                chunk = list(itertools.islice(keys, self.read_ahead))  # many records per (batched) transform
                exhausted = len(chunk) < self.read_ahead
                for key, samples in zip(chunk, samples_many(source, chunk)):
                    cache[key] = samples
                    buffer.extend([*key, k, len(p["input_ids"])] for k, p in enumerate(samples))
            for c in base:
                state[c] = getattr(source, c, 0) - base[c]
            short = exhausted and self.drop_last and not self.dyn_bsz and len(buffer) < self.micro_batch_size
            if not buffer or short:
                # what drop_last leaves out: a short micro-batch, and the micro-batches of an incomplete step
                # (the DataLoader drops those): counted in the state, reported by `data_report`
                state["dropped"] = (len(buffer) + state["group"]) if self.drop_last else 0
                state["samples"] -= state["group"] if self.drop_last else 0  # never handed out
                buffer.clear()
                state["group"] = 0
                if state["dropped"]:
                    logger.warning(f"drop_last: {state['dropped']} samples of the epoch's last batch left out")
                return
            step = self.first_step + (state["produced"] // self.dataloader_batch_size) * num_workers + worker_id
            chosen = self._choose(buffer, self._token_budget(step))
            picked = [buffer[i] for i in chosen]
            for i in reversed(chosen):
                del buffer[i]
            samples = [pieces(tuple(e[:-2]))[e[-2]] for e in picked]
            live = {tuple(e[:-2]) for e in buffer}
            for key in [k for k in cache if k not in live]:
                del cache[key]
            state["produced"] += 1
            state["samples"] += len(samples)
            full_step = state["produced"] % self.dataloader_batch_size == 0
            state["group"] = 0 if full_step else state["group"] + len(samples)
            yield collate_fn(samples)

    def _choose(self, buffer: List[List[int]], budget: int) -> List[int]:
        if not self.dyn_bsz:
            return list(range(min(self.micro_batch_size, len(buffer))))
        return first_fit((entry[-1] for entry in buffer), budget)  # entries end with the sample's length


def _as_list(item) -> List[Dict[str, Any]]:
    return item if isinstance(item, list) else [item]


def _list_of_micro_batches(micro_batches):
    return list(micro_batches)


def reshard_loader_state(states: List[Dict[str, Any]], dp_rank: int, dp_size: int, produced: int) -> Dict[str, Any]:
    """Loader states saved by the ranks of another data-parallel size -> the state for `dp_rank` of `dp_size`.

    Exact for map-style data without workers: records are dealt out strided, so what all old ranks consumed is
    a prefix of the epoch's order, which the new ranks continue from (buffered, unconsumed records are re-read).
    """
    if _has_global_position(states[0]):  # a global position is the same on every rank: valid for any world size
        return copy.deepcopy(states[0])
    if _has_key(states[0], "slot_streams"):  # streamed slots: each sub-stream goes to its slot's new rank
        return reshard_slot_states(states, dp_rank, dp_size)
    datasets = [s.get("dataset_state") for s in states]
    if any(not d or "cursor" not in d.get("source", {}) for d in datasets):
        raise NotImplementedError("the data position can only be resharded for map-style data without workers")
    consumed = min(d["source"]["cursor"] - len({tuple(e[:-2]) for e in d["buffer"]}) for d in datasets)
    prefix = consumed * len(states)
    if prefix % dp_size:
        logger.warning(f"{prefix} consumed records do not split evenly over {dp_size} ranks: a few repeat")
    new = copy.deepcopy(states[0])
    new["dataset_state"] = {
        "epoch": datasets[0]["epoch"],
        "source": {"cursor": prefix // dp_size},
        "buffer": [],
        "produced": produced,
        "skipped": 0,
    }
    return new


def count_loader_steps(loader, limit: Optional[int] = None) -> Optional[int]:
    """Batches (optimizer steps) this rank's loader yields in the current epoch; None when it cannot tell.

    A dry run of the loader's own plan, so the count is exact whatever the packing: every record of this rank's
    share is read and transformed, micro-batches are chosen exactly as in training, nothing is collated. Only for
    sized (map-style) data; streamed data would have to be read to its end. Leaves the loader's state untouched.
    With `limit`, stops once that many steps are certain (and returns `limit`).
    """
    stream = getattr(loader, "dataset", None)
    if not isinstance(stream, MicroBatchStream):
        return None
    try:
        len(stream.source.dataset if isinstance(stream.source, _MapStyle) else stream.source)
    except TypeError:
        return None
    saved = stream._state, stream._resume
    # bad samples are counted (and warned about) once, in training: silence and rewind the dry run's counting
    counters = [vars(d) for d in (stream.source, *getattr(stream.source, "sources", ()))]
    skipped = [c.get("skipped") for c in counters]
    quiet = logging.getLogger("veomni.data.dataset")
    level = quiet.level
    workers, per_batch = max(loader.num_workers, 1), stream.dataloader_batch_size
    steps = 0
    try:
        stream._resume = None
        quiet.setLevel(logging.ERROR)
        for worker in range(workers):  # each worker batches its own micro-batches, as the DataLoader does
            n = 0
            for _ in stream._micro_batches(worker, workers, len):
                n += 1
                if limit and steps + n // per_batch >= limit:
                    return limit
            steps += n // per_batch if loader.drop_last else -(-n // per_batch)
    finally:
        quiet.setLevel(level)
        stream._state, stream._resume = saved
        for counter, value in zip(counters, skipped):
            if value is None:
                counter.pop("skipped", None)
            else:
                counter["skipped"] = value
    return steps


def _has_global_position(node) -> bool:
    return _has_key(node, "global_position")


def _has_key(node, key: str) -> bool:
    if isinstance(node, dict):
        return bool(node.get(key)) or any(_has_key(v, key) for v in node.values())
    return False


class MicroBatchLoader(IteratorSlotLoader):
    """The StatefulDataLoader over a micro-batch stream that stops its worker processes as soon as their iterator is
    abandoned: when a state is loaded, on `close()` (the trainer's, at the end of training or on a stop), and when the
    loader itself is collected (unless the iterator is still in use: `for batch in build_dataloader(...)`). A new
    iter() leaves the previous iterator working, as a DataLoader does: it may still be iterated.

    torch shuts an iterator's workers down only when the iterator is garbage collected. An iterator left mid-epoch
    (max_steps reached, a resume, the end of training) otherwise keeps its workers alive until then, and when the
    collection happens in a reference cycle, the workers' index queues are finalized before the iterator, the
    "exit" message never reaches them, and each worker costs the full join timeout (5 s) before it is killed.
    """

    def __init__(self, stream, **kwargs):
        self.epoch_ended = False  # the last streamed epoch ended at a slot that ran out (not at a stop)
        super().__init__(stream, **kwargs)  # the current iterator is in `self._live[0]`: see IteratorSlotLoader
        self.stream = stream
        # the box keeps the iterator out of the cyclic garbage, so its queues still work when the loader goes: the
        # finalizer only lets go of it, and torch stops its workers at once unless someone still iterates it (as in
        # `for batch in build_dataloader(...)`, where nothing else holds the loader)
        weakref.finalize(self, _release, self._live).atexit = False  # at exit torch's own handling applies

    def iterator_replaced(self, previous, iterator) -> None:
        # StatefulDataLoader drops its iterator in load_state_dict (whose position is then gone): its workers stop.
        # A new iter() replaces it, but the old one may still be iterated (two iterators, as a DataLoader allows):
        # it keeps its workers, and frees them when it ends or is collected.
        if iterator is None and previous is not None:
            _stop_workers([previous])

    def __iter__(self):
        closed = self._live[0]
        if iterator_shut_down(closed):  # close()d (or ended): new workers; persistent ones can't be reset
            keep_unstarted_iterator_state(self, closed)  # made by state_dict() and never iterated: its position
            self._live[0] = None
        iterator = super().__iter__()
        self.epoch_ended = False
        return _UntilEndMarker(iterator, self) if isinstance(self.stream, SlotStream) else iterator

    def close(self) -> None:
        """Stop the current iterator's worker processes now. `state_dict()` still gives the position reached; a
        later `iter()` starts the next epoch (or resumes a loaded state) with new workers."""
        _stop_workers(self._live)

    def set_epoch(self, epoch: int, first_step: int = 0) -> None:
        """Reshuffle for `epoch` (the trainer calls this before each epoch's iter())."""
        self.stream.set_epoch(epoch, first_step)

    def num_batches(self, limit: Optional[int] = None) -> Optional[int]:
        """Optimizer steps in an epoch (the same on every rank): the global plan's length for sized data, a dry run
        of the micro-batch plan otherwise (None for streamed data, whose length is unknown)."""
        return _num_batches(self, self.stream, limit)


class _UntilEndMarker:
    """Ends the epoch at the first step a streamed slot could not fill (its micro-batches are end markers), even
    when other loader workers still have steps: later steps would otherwise come out of order."""

    def __init__(self, iterator, loader):
        self.iterator, self.loader, self.ended = iterator, weakref.ref(loader), False

    def __iter__(self):
        return self

    def __next__(self):
        if self.ended:
            raise StopIteration
        step = next(self.iterator)
        if any(is_end_marker(mb) for mb in step):
            self.ended = True
            loader = self.loader()
            if loader is not None:  # the trainer then counts the records left unread
                loader.epoch_ended = True
            raise StopIteration
        return step


def _release(box: List[Any]) -> None:
    box[0] = None  # the last reference gone, torch's __del__ stops the workers; otherwise its holder still iterates


def _stop_workers(box: List[Any]) -> None:
    """Tell the workers of the iterator in `box` to exit and join them (prompt: they are idle or prefetching)."""
    shutdown_iterator_workers(box[0])


def _slots_per_rank(global_batch_size: Optional[int], micro: int, per_rank: int, dp_size: int) -> int:
    """dataloader_batch_size from global_batch_size (when given): a step is global_batch_size / micro_batch_size
    micro-batches over dp_size ranks. A global size that does not split, or that contradicts an explicit
    dataloader_batch_size, is refused rather than ignored."""
    if global_batch_size is None or global_batch_size == micro * per_rank * dp_size:
        return per_rank
    if per_rank == 1 and global_batch_size % (micro * dp_size) == 0:
        return global_batch_size // (micro * dp_size)
    from ..arguments.arguments_types import batch_split_message

    if global_batch_size % (micro * dp_size):
        raise ValueError(batch_split_message(global_batch_size, micro, dp_size))
    raise ValueError(
        f"global_batch_size={global_batch_size} but micro_batch_size * dataloader_batch_size * dp_size = {micro} * "
        f"{per_rank} * {dp_size} = {micro * per_rank * dp_size}: give one of them (dataloader_batch_size "
        f"{global_batch_size // (micro * dp_size)} matches)"
    )


def _data_parallel_place():
    from ..distributed.parallel_state import get_parallel_state

    state = get_parallel_state()  # raises, naming init_parallel_state, when it was not initialised
    return state.dp_rank, state.dp_size


def _with_sequence_parallel(collate_fn_kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """The collator's sp_size / sp_rank, when the caller gave none: the parallel state's Ulysses group."""
    if "sp_size" in collate_fn_kwargs:
        return collate_fn_kwargs
    from ..distributed.parallel_state import parallel_state_or_none

    state = parallel_state_or_none()
    if state is None:
        return collate_fn_kwargs
    return dict(collate_fn_kwargs, sp_size=state.sp_size, sp_rank=state.sp_rank)


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
) -> MicroBatchLoader:
    """A stateful loader whose `next()` is a list of `dataloader_batch_size` collated micro-batches."""
    if dataloader_type != "native":
        raise ValueError(f"unknown dataloader type {dataloader_type!r}; only 'native' exists")
    if dp_rank is None or dp_size is None:  # the seed's call gives neither: this rank's place in the parallel state
        dp_rank, dp_size = _data_parallel_place()
    dataloader_batch_size = _slots_per_rank(global_batch_size, micro_batch_size, dataloader_batch_size, dp_size)
    if collate_fn is None:
        if not build_collate_fn:
            raise ValueError("build_collate_fn=False needs an explicit collate_fn")
        collate_fn = MainCollator(max_seq_len=max_seq_len, **_with_sequence_parallel(collate_fn_kwargs or {}))
    batching = dict(  # the same plan for both streams
        micro_batch_size=micro_batch_size,
        max_seq_len=max_seq_len,
        dataloader_batch_size=dataloader_batch_size,
        dyn_bsz=dyn_bsz,
        buffer_size=dyn_bsz_buffer_size,
        dp_rank=dp_rank,
        dp_size=dp_size,
        warmup_steps=int(train_steps * bsz_warmup_ratio),
        warmup_init_tokens=bsz_warmup_init_mbtoken,
        drop_last=drop_last,
    )
    if is_sized(dataset):  # global batches independent of the world size (see global_batches.py)
        sources = cached_sources(dataset)
        if sources is not None:  # samples in an on-disk cache every rank maps (built here on first use)
            index = CachedSampleIndex(dataset, sources)
        else:  # a user's own map-style data: transformed once, here, so that loader workers inherit the samples
            index = SampleIndex(as_resumable(dataset, seed, shuffle))
        index.order(0)
        stream = GlobalBatchStream(index, collate_fn, **batching)
    elif supports_slots(dataset):  # streamed files: global batches independent of the world size too
        stream = SlotStream(dataset, collate_fn, num_workers, **batching)
    else:  # a user's plain iterable: read in turn by the ranks and workers
        stream = MicroBatchStream(dataset, collate_fn, seed=seed, shuffle=shuffle, **batching)
    extra = {"prefetch_factor": prefetch_factor} if num_workers > 0 and prefetch_factor else {}
    return MicroBatchLoader(
        stream,
        batch_size=dataloader_batch_size,
        collate_fn=_list_of_micro_batches,
        num_workers=num_workers,
        drop_last=drop_last,
        pin_memory=pin_memory and torch.cuda.is_available(),
        **extra,
    )


def is_sized(dataset) -> bool:
    """Map-style, pre-tokenised and interleaved-mapping data: records that can all be indexed up front."""
    if isinstance(dataset, IterableDataset) and not hasattr(dataset, "iter_keys"):
        return False  # a user's plain iterable dataset
    try:
        len(dataset)
    except TypeError:  # streamed sources have no length
        return False
    return hasattr(dataset, "__getitem__") or hasattr(dataset, "iter_keys")


def _num_batches(loader, stream, limit: Optional[int] = None) -> Optional[int]:
    if hasattr(stream, "num_steps"):
        steps = stream.num_steps()
        return min(steps, limit) if limit else steps
    return count_loader_steps(loader, limit)
