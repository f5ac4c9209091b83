"""Global batches for sized (mapping, pre-tokenised, interleaved-mapping) datasets: the samples of global step N
are a function of the data, the seed and the batch shape only -- not of the world size or the number of workers.

Design, and why:
1. Split records into samples first, once: every record is transformed into the dataset's sample cache (mapping.py),
   and a long document becomes its consecutive pieces. The epoch's seeded record order (one global order, as one
   process sees it) with each record's pieces in place is the *global sample order*; it does not depend on who
   reads it. (Sharding records before the transform, as streaming does, makes a rank's share depend on how many
   pieces its records split into: 1 and 2 processes then train on different global batches.)
2. Cut the global order into micro-batches with a rule every rank computes identically: `micro_batch_size`
   samples each, or with dyn_bsz first-fit into a token budget of `micro_batch_size * max_seq_len` (from a buffer
   of `dyn_bsz_buffer_size` samples; lengths are known from step 1, so this is cheap). Samples reach the collate
   function as the cache holds them (int64 numpy arrays for token fields).
3. A global step is the next `global_batch_size / micro_batch_size` micro-batches (= dp_size * dataloader_batch_size);
   rank r takes micro-batches [r * a, (r+1) * a) of it, a = dataloader_batch_size. Loader worker w produces the
   global steps w, w + W, ...; the DataLoader's round robin over workers returns them in order.
So a global step holds the same samples on 1, 2 or 4 ranks and with any number of workers; with dyn_bsz it holds
the same micro-batches when `micro_batch_size` (the token budget) and `global_batch_size` are kept. The loader
state is a global position (epoch, step, micro-batch), valid for any world size: a resume on another number of
ranks continues the same sample sequence.

The tail of an epoch: the micro-batches left after the last full step are kept when they can be split (never
merged, so the token budget holds) into one micro-batch per rank and accumulation slot; otherwise, or with
drop_last, they are dropped and counted (`dropped` in `data_report(loader)`).
"""

import copy
import dataclasses
import hashlib
import itertools
import os
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Tuple

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info


@dataclass
class Batching:
    """How micro-batches are cut, the same for both streams. A global step is `dp_size * dataloader_batch_size`
    micro-batches of `micro_batch_size` samples, or with `dyn_bsz` of up to `micro_batch_size * max_seq_len` tokens
    (first-fit from a buffer of `buffer_size` samples; over the first `warmup_steps` steps the budget rises from
    `warmup_init_tokens`)."""

    micro_batch_size: int
    max_seq_len: int
    dataloader_batch_size: int = 1
    dyn_bsz: bool = True
    buffer_size: int = 200
    warmup_steps: int = 0
    warmup_init_tokens: int = 0
    drop_last: bool = False


def take(buffer: List[Any], lengths: Iterable[int], budget: int, b: Batching) -> List[Any]:
    """Remove and return the next micro-batch from `buffer` (entries in arrival order, `lengths` their token counts):
    the first `micro_batch_size`, or with dyn_bsz first-fit into the token budget (the first entry always: a sample
    longer than the budget goes alone; stops as soon as the budget is full). Both streams pack through it, so they
    pack identically."""
    if not b.dyn_bsz:
        chosen = list(range(min(b.micro_batch_size, len(buffer))))
    else:
        chosen, used = [], 0
        for i, n in enumerate(lengths):
            if used + n <= budget or not chosen:
                chosen.append(i)
                used += n
                if used >= budget:
                    break
    picked = [buffer[i] for i in chosen]
    for i in reversed(chosen):
        del buffer[i]
    return picked


class Plan:
    """An epoch's global steps, as two arrays: micro-batch m holds the sample positions
    `positions[bounds[m]:bounds[m + 1]]` (positions in the epoch's global sample order); step s is micro-batches
    `[s * per_step, (s + 1) * per_step)`. `dropped`: samples of the tail that fit no step."""

    def __init__(self, positions: np.ndarray, bounds: np.ndarray, per_step: int, dropped: int):
        self.positions, self.bounds, self.per_step, self.dropped = positions, bounds, per_step, dropped

    def __len__(self) -> int:
        return (len(self.bounds) - 1) // self.per_step

    def micro_batch(self, m: int) -> np.ndarray:
        return self.positions[self.bounds[m] : self.bounds[m + 1]]


def plan_micro_batches(
    lengths: List[int], per_step: int, b: Batching, budget: Callable[[int], int], buffer_size: int
) -> Plan:
    """Global steps of `per_step` micro-batches: `b.micro_batch_size` consecutive samples each, or with `b.dyn_bsz`
    first-fit into the token budget of their step from a buffer of `buffer_size` samples in arrival order."""
    n = len(lengths)
    if not b.dyn_bsz:  # consecutive runs: no loop over the samples
        positions = np.arange(n, dtype=np.int64)
        bounds = np.append(np.arange(0, n, b.micro_batch_size, dtype=np.int64), n)
        complete = n // b.micro_batch_size  # a short last micro-batch is tail
    else:
        micro: List[int] = []
        bound_list, buffer, arrivals = [0], [], iter(range(n))
        while buffer or len(micro) < n:
            buffer += itertools.islice(arrivals, buffer_size - len(buffer))
            micro += take(buffer, (lengths[pos] for pos in buffer), budget((len(bound_list) - 1) // per_step), b)
            bound_list.append(len(micro))
        positions, bounds = np.asarray(micro, dtype=np.int64), np.asarray(bound_list, dtype=np.int64)
        complete = len(bounds) - 1
    keep = complete // per_step * per_step  # micro-batches of the full steps
    tail = np.diff(bounds[keep:]).tolist()  # the sizes of the micro-batches after them, in order
    if tail and not b.drop_last:
        while len(tail) < per_step:  # split (never merge) the fullest micro-batch: budgets still hold
            big = tail.index(max(tail))
            if tail[big] < 2:
                break
            tail[big : big + 1] = [tail[big] // 2, tail[big] - tail[big] // 2]
        if len(tail) == per_step:  # the same samples in the same order, cut again
            return Plan(positions, np.concatenate([bounds[: keep + 1], bounds[keep] + np.cumsum(tail)]), per_step, 0)
    return Plan(positions[: bounds[keep]], bounds[: keep + 1], per_step, sum(tail))


class BatchingStream(IterableDataset):
    """What both micro-batch streams share: the batching, the epoch, the warmup token budget and the resumable
    position (GlobalBatchStream for sized data, streamed_batches.SlotStream for streamed data)."""

    def __init__(self, dataset, collate_fn: Callable, batching: Batching, dp_rank: int, dp_size: int):
        self.dataset, self.collate_fn, self.dp_rank, self.dp_size = dataset, collate_fn, dp_rank, dp_size
        self.batching = dataclasses.replace(batching)  # its own: the warmup length is set per loader
        self.slots = dp_size * batching.dataloader_batch_size  # P: micro-batches in a global step
        self.buffer_size = max(batching.buffer_size, batching.micro_batch_size)
        self.epoch, self.first_step = 0, 0
        self._resume: Optional[Dict[str, Any]] = None
        self._state: Dict[str, Any] = {}

    def set_epoch(self, epoch: int, first_step: int = 0) -> None:
        """`first_step`: optimizer steps of the run before this epoch; the token-budget warmup follows the run's
        global step, so it does not start again with each epoch."""
        self.epoch, self.first_step = epoch, first_step

    def _token_budget(self, step: int) -> int:
        """The micro-batch token budget of global step `step` (counted over the whole run): it rises linearly from
        `warmup_init_tokens` to the full budget over the first `warmup_steps` steps (both streams pack with it)."""
        b = self.batching
        full = b.micro_batch_size * b.max_seq_len
        if b.warmup_steps == 0 or step >= b.warmup_steps:
            return full
        start = min(b.warmup_init_tokens, full)
        return int(start + (full - start) * step / b.warmup_steps)

    def _start_state(self, fresh: Dict[str, Any]) -> Dict[str, Any]:
        """The position an iteration starts from: a loaded state of this epoch over `fresh`, else `fresh`."""
        resume, self._resume = self._resume, None
        self._state = {**fresh, **resume} if resume is not None and resume.get("epoch") == self.epoch else fresh
        return self._state

    def state_dict(self) -> Dict[str, Any]:
        # a loaded position not yet reached by iteration (state taken right after a resume) is still the position
        return copy.deepcopy(self._resume if self._resume is not None else self._state)

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self._resume = copy.deepcopy(state) if state else None


class GlobalBatchStream(BatchingStream):
    """Yields this rank's collated micro-batches of each global step (see the module doc)."""

    def __init__(self, dataset, collate_fn: Callable, batching: Batching, dp_rank: int, dp_size: int):
        super().__init__(dataset, collate_fn, batching, dp_rank, dp_size)  # the sized protocol (mapping.py)
        self._plans: Dict[Tuple[int, int, int], Plan] = {}
        self._order: Dict[int, Any] = {}

    def order(self, epoch: int) -> Tuple[np.ndarray, np.ndarray]:
        """The sample ids of the epoch in global order and their lengths (one epoch kept)."""
        if epoch not in self._order:
            self._order = {epoch: self.dataset.epoch_order(epoch)}
        return self._order[epoch]

    def plan(self, epoch: int) -> Plan:
        """The epoch's global steps (each: dp_size * dataloader_batch_size micro-batches), computed once and kept
        beside the sample cache, so a later run with the same data and batching reads it (`_stored_plan`)."""
        first = min(self.first_step, self.batching.warmup_steps)  # past the warmup, where it starts changes nothing
        key = (epoch, first, self.batching.warmup_steps)
        if key not in self._plans:
            path = self._plan_path(epoch, first)
            plan = _load_plan(path, self.slots) if path else None
            if plan is None:
                lengths, budget = self.order(epoch)[1].tolist(), lambda s: self._token_budget(first + s)
                plan = plan_micro_batches(lengths, self.slots, self.batching, budget, self.buffer_size)
                if path:
                    _save_plan(path, plan)
            self._plans = {key: plan}
        return self._plans[key]

    def _plan_path(self, epoch: int, first: int) -> Optional[str]:
        """Where this epoch's plan is kept: in the dataset's cache (None for a cache of one run's own)."""
        where = self.dataset.plan_store() if hasattr(self.dataset, "plan_store") else None
        if where is None:
            return None
        folder, identity = where
        b = self.batching
        spec = (_PLAN_FORMAT, identity, epoch, first, self.slots, b.micro_batch_size, b.max_seq_len, b.dyn_bsz,
                self.buffer_size, b.warmup_steps, b.warmup_init_tokens, b.drop_last)  # fmt: skip
        return os.path.join(folder, "plans", hashlib.sha256(repr(spec).encode()).hexdigest()[:20] + ".npz")

    def __iter__(self) -> Iterator[Dict[str, torch.Tensor]]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        plan, accum = self.plan(self.epoch), self.batching.dataloader_batch_size
        ids = self.order(self.epoch)[0]
        # a global position, the same on every rank: any rank's state resumes any world size
        state = self._start_state(
            {"global_position": True, "epoch": self.epoch, "step": worker, "micro": 0, "produced": 0, "samples": 0}
        )
        state.update(self.dataset.counts(), dropped=plan.dropped)
        while state["step"] < len(plan):
            batch = plan.micro_batch(state["step"] * plan.per_step + self.dp_rank * accum + state["micro"])
            if state["micro"] + 1 < accum:  # the state names what comes after this yield
                state["micro"] += 1
            else:
                state["step"], state["micro"] = state["step"] + workers, 0
            state["produced"] += 1
            state["samples"] += len(batch)
            yield self.collate_fn([self.dataset.sample(ids[p]) for p in batch])


_PLAN_FORMAT = 1


def _load_plan(path: str, per_step: int) -> Optional[Plan]:
    try:
        with np.load(path) as stored:
            return Plan(stored["positions"], stored["bounds"], per_step, int(stored["dropped"]))
    except (OSError, ValueError, KeyError):  # none yet, or unreadable: computed again (and written again)
        return None


def _save_plan(path: str, plan: Plan) -> None:
    """Kept for later runs (atomically: ranks write the same plan); a cache on read-only storage keeps none."""
    tmp = f"{path}.{uuid.uuid4().hex[:8]}.tmp.npz"
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        np.savez(tmp, positions=plan.positions, bounds=plan.bounds, dropped=plan.dropped)
        os.replace(tmp, path)
    except OSError:
        if os.path.exists(tmp):
            os.remove(tmp)
