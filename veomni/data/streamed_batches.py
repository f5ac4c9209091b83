"""Global batches of streamed data that do not depend on the world size.

A global step is `P = global_batch_size / micro_batch_size` micro-batch *slots* (dp_size x dataloader_batch_size,
whatever the split). Each slot j is an independent stream of micro-batches, read by loader worker w of the rank that
owns it as `W` sub-streams (W = loader workers per rank, at least 1): sub-stream v = j * W + w reads the units (jsonl
byte ranges, parquet row groups) that the epoch's seeded permutation deals to v out of P * W, through its own seeded
shuffle buffer, and packs its own micro-batches (dyn_bsz from its own buffer). Global step s takes, for every slot j,
the next micro-batch of sub-stream (j, s mod W).

So the samples of step s depend on the data, the seed, P and W, not on how many ranks share the slots: rank r owns
slots [r * a, (r + 1) * a) (a = dataloader_batch_size) and reads only their sub-streams, and a 2-rank state resumes
on 4 ranks (each sub-stream's state moves to the rank that owns its slot now). The epoch ends at the first step a
sub-stream cannot fill: that step yields end markers, the loader stops there, and the trainer's all-reduce makes every
rank stop at the same step.
"""

import copy
import itertools
from typing import Any, Callable, Dict, Iterator, List, Optional

from torch.utils.data import get_worker_info

from ..compat.torchdata import worker_snapshots
from .global_batches import Batching, BatchingStream, take

END_OF_EPOCH = "veomni_end_of_epoch"
_UNITS_PER_SUB_STREAM = 16
_READ_AHEAD = 64  # records per samples_many call: many records per (batched) transform
_COUNTERS = ("produced", "samples", "skipped", "empty", "dropped")


def is_end_marker(item: Any) -> bool:
    return isinstance(item, dict) and item.get(END_OF_EPOCH, False)


class PlainIterable:
    """A user's iterable dataset without keys or state, seen through the streamed protocol: each shard keeps the
    items at its stride. A resume re-iterates the dataset from its start and skips what was consumed (so it must be
    re-iterable and yield the same items in order)."""

    def __init__(self, dataset):
        self.dataset, self._items, self._expected = dataset, {}, set()

    def expect(self, keys) -> None:
        """Keys of a resumed buffer: keep their items while skipping ahead."""
        self._expected |= set(keys)

    def iter_keys(self, epoch, shard, num_shards, state):
        resume_at, i = state.setdefault("count", 0), -1
        for i, item in enumerate(self.dataset):
            if i % num_shards != shard:
                continue
            if i < resume_at:
                if (i,) in self._expected:
                    self._items[(i,)] = item
                continue
            state["count"] = i + 1
            self._items[(i,)] = item
            yield (i,)
        if i + 1 < resume_at:
            raise RuntimeError(
                f"cannot resume {type(self.dataset).__name__}: it yielded {i + 1} items, fewer than the {resume_at} "
                "already consumed. A plain IterableDataset is resumed by iterating it again from the start and "
                "skipping; make it re-iterable in the same order, or give it iter_keys/samples_many (streaming.py)"
            )

    def samples_many(self, keys):
        items = [self._items.pop(tuple(key)) for key in keys]
        return [item if isinstance(item, list) else [item] for item in items]


class _SubStream:
    """One sub-stream's reading and packing; `state` (a plain dict) is its resumable position."""

    def __init__(self, owner: "SlotStream", shard: int, num_shards: int, state: Dict[str, Any]):
        self.owner, self.state = owner, state
        if state["buffer"] and hasattr(owner.dataset, "expect"):  # a resumed buffer: its records are read again
            owner.dataset.expect({tuple(e[:-2]) for e in state["buffer"]})
        self.keys = owner.dataset.iter_keys(owner.epoch, shard, num_shards, state["source"])
        self.cache: Dict[tuple, List[Dict[str, Any]]] = {}
        self.exhausted = False

    def _read(self) -> None:
        owner, buffer, source = self.owner, self.state["buffer"], self.owner.dataset
        while len(buffer) < owner.buffer_size and not self.exhausted:
            chunk = list(itertools.islice(self.keys, _READ_AHEAD))
            self.exhausted = len(chunk) < _READ_AHEAD
            before = {c: getattr(source, c, 0) for c in ("skipped", "empty")}
            for key, samples in zip(chunk, source.samples_many(chunk) if chunk else []):
                self.cache[key] = samples
                buffer.extend([*key, k, len(p["input_ids"])] for k, p in enumerate(samples))
            for c, value in before.items():  # sub-streams run one at a time: the change is this one's
                self.state[c] += getattr(source, c, 0) - value

    def next_micro_batch(self, budget: int) -> Optional[List[Dict[str, Any]]]:
        """The next micro-batch's samples, or None when this sub-stream has no more for this epoch."""
        buffer, b = self.state["buffer"], self.owner.batching
        self._read()
        short = self.exhausted and b.drop_last and not b.dyn_bsz and len(buffer) < b.micro_batch_size
        if not buffer or short:
            return None
        picked = take(buffer, (entry[-1] for entry in buffer), budget, b)
        samples = [self._pieces(tuple(e[:-2]))[e[-2]] for e in picked]
        live = {tuple(e[:-2]) for e in buffer}
        self.cache = {key: samples for key, samples in self.cache.items() if key in live}
        self.state["produced"] += 1
        self.state["samples"] += len(samples)
        return samples

    def _pieces(self, key: tuple) -> List[Dict[str, Any]]:
        if key not in self.cache:  # a buffer restored by a resume: its records are read again by key
            self.cache[key] = self.owner.dataset.samples_many([key])[0]
        return self.cache[key]


def _fresh() -> Dict[str, Any]:
    return {"source": {}, "buffer": [], **{c: 0 for c in _COUNTERS}}


def _sum_counters(state: Dict[str, Any]) -> None:
    """The worker's totals (what data_report reads) over its sub-streams."""
    for c in _COUNTERS:
        state[c] = sum(s[c] for s in state["streams"].values())
    state["blank"] = sum(s["source"].get("blank", 0) for s in state["streams"].values())


class SlotStream(BatchingStream):
    """Yields this rank's collated micro-batches of each global step (see the module doc)."""

    def __init__(self, source, collate_fn: Callable, batching: Batching, dp_rank: int, dp_size: int, num_workers: int):
        dataset = source if hasattr(source, "iter_keys") else PlainIterable(source)
        super().__init__(dataset, collate_fn, batching, dp_rank, dp_size)
        self.workers = max(num_workers, 1)
        if hasattr(source, "cut_units"):  # >= 16 units per sub-stream: one running out early ends the epoch
            source.cut_units(_UNITS_PER_SUB_STREAM * self.slots * self.workers)

    def sub_stream_ids(self, worker: int) -> List[int]:
        accum = self.batching.dataloader_batch_size
        return [j * self.workers + worker for j in range(self.dp_rank * accum, (self.dp_rank + 1) * accum)]

    def __iter__(self) -> Iterator[Dict[str, Any]]:
        info = get_worker_info()
        worker = info.id if info else 0
        state = self._start_state({"slot_streams": True, "epoch": self.epoch, "streams": {}})
        num_shards = self.slots * self.workers
        subs = [
            _SubStream(self, v, num_shards, state["streams"].setdefault(str(v), _fresh()))
            for v in self.sub_stream_ids(worker)
        ]
        while True:
            handed = []  # this step's micro-batches so far: not trained if a later slot cannot fill the step
            for i, sub in enumerate(subs):
                step = sub.state["produced"] * self.workers + worker  # the epoch's global step of this micro-batch
                samples = sub.next_micro_batch(self._token_budget(self.first_step + step))
                if samples is None:  # the step cannot be filled: the epoch ends here on every rank
                    for earlier, n in handed:
                        earlier.state["samples"] -= n
                        earlier.state["dropped"] += n
                    _sum_counters(state)
                    for _ in subs[i:]:
                        yield {END_OF_EPOCH: True}
                    return
                handed.append((sub, len(samples)))
                _sum_counters(state)
                yield self.collate_fn(samples)

    def unread(self, states: Dict[int, Dict[str, Any]]) -> int:
        """Records of this rank's sub-streams not reached when the epoch stopped (their buffers included)."""
        left, num_shards = 0, self.slots * self.workers
        for worker in range(self.workers):
            streams = states.get(worker, {}).get("streams", {})
            for v in self.sub_stream_ids(worker):
                sub = streams.get(str(v), _fresh())
                if hasattr(self.dataset, "unread"):
                    left += self.dataset.unread(self.epoch, v, num_shards, sub["source"])
                left += len({tuple(e[:-2]) for e in sub["buffer"]})
        return left


def worker_states(loader_state: Dict[str, Any]) -> Dict[int, Dict[str, Any]]:
    """worker id -> its dataset state in a StatefulDataLoader state (without workers: the main process's, as 0)."""
    if "dataset_state" in loader_state:
        return {0: loader_state["dataset_state"] or {}}
    snapshots = worker_snapshots(loader_state)
    return {s["worker_id"]: s["dataset_state"] for s in snapshots.values() if s.get("dataset_state") is not None}


def reshard_slot_states(states: List[Dict[str, Any]], dp_rank: int, dp_size: int) -> Dict[str, Any]:
    """Loader states of every rank of an earlier run -> this rank's: each sub-stream's state goes to the rank that
    owns its slot now (the slots per step and the loader workers must be the same)."""
    new = copy.deepcopy(states[0])
    everything: Dict[int, Dict[str, Any]] = {}
    for old in states:
        for worker, dataset_state in worker_states(old).items():
            everything.setdefault(worker, {}).update(dataset_state.get("streams", {}))  # ({} if never iterated)
    for worker, dataset_state in worker_states(new).items():
        streams = everything.get(worker, {})  # this worker's sub-streams of every slot, from all the old ranks
        if len(streams) % dp_size:
            raise NotImplementedError(f"{len(streams)} streamed slots per step do not split over {dp_size} ranks")
        per_rank = len(streams) // dp_size
        ids = sorted(int(v) for v in streams)[dp_rank * per_rank : (dp_rank + 1) * per_rank]
        dataset_state["streams"] = {str(v): copy.deepcopy(streams[str(v)]) for v in ids}
        _sum_counters(dataset_state)
    return new
