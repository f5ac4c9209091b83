"""`build_dataloader`: sharded, shuffled, packed micro-batches; `next()` returns one optimizer step's worth.

The pipeline per data-parallel rank (and per worker):
    record order (seeded per epoch) -> rank/worker shard -> transform -> micro-batcher -> MainCollator
The micro-batcher fills each micro-batch either with `micro_batch_size` samples or, with dyn_bsz, with as many
samples as fit in a token budget of `micro_batch_size * max_seq_len` (chosen first-fit from a buffer, so
micro-batches come out nearly full). Its state is a handful of integers plus the buffered sample ids, so a
resumed run reproduces exactly the batches the uninterrupted run would have seen.
"""

from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
from torch.utils.data import IterableDataset, get_worker_info
from torchdata.stateful_dataloader import StatefulDataLoader

from .data_collator import MainCollator

SampleId = Tuple[int, int]  # (record index, piece index within the record's transformed samples)


class MicroBatchStream(IterableDataset):
    """Yields collated micro-batches for one data-parallel rank of a map-style dataset."""

    def __init__(
        self,
        dataset,
        collate_fn: Callable,
        micro_batch_size: int,
        max_seq_len: int,
        dataloader_batch_size: int,
        dyn_bsz: bool,
        buffer_size: int,
        dp_rank: int,
        dp_size: int,
        seed: int,
        shuffle: bool = True,
        warmup_steps: int = 0,
        warmup_init_tokens: int = 0,
    ):
        self.dataset, self.collate_fn = dataset, collate_fn
        self.micro_batch_size, self.max_seq_len = micro_batch_size, max_seq_len
        self.dataloader_batch_size = dataloader_batch_size
        self.dyn_bsz, self.buffer_size = dyn_bsz, max(buffer_size, micro_batch_size)
        self.dp_rank, self.dp_size, self.seed, self.shuffle = dp_rank, dp_size, seed, shuffle
        self.warmup_steps, self.warmup_init_tokens = warmup_steps, warmup_init_tokens
        self.epoch = 0
        self._resume: Optional[Dict[str, Any]] = None
        self._state: Dict[str, Any] = {}

    # ----------------------------------------------------------------------------------------- ordering
    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _record_order(self, worker_id: int, num_workers: int) -> List[int]:
        n = len(self.dataset)
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(n, generator=g).tolist()
        else:
            order = list(range(n))
        # strided, so the first k records of every rank together are the first k * dp_size of the order: a
        # global batch holds the same samples whatever the data-parallel size (parity with one process)
        usable = (n // self.dp_size) * self.dp_size
        mine = order[:usable][self.dp_rank :: self.dp_size]
        return mine[worker_id::num_workers]

    # ------------------------------------------------------------------------------------------ budget
    def _token_budget(self, step: int) -> int:
        full = self.micro_batch_size * self.max_seq_len
        if step >= self.warmup_steps or self.warmup_steps == 0:
            return full
        start = min(self.warmup_init_tokens, full)
        return int(start + (full - start) * step / self.warmup_steps)

    # -------------------------------------------------------------------------------------------- state
    def state_dict(self) -> Dict[str, Any]:
        return dict(self._state)

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self._resume = dict(state)

    # ---------------------------------------------------------------------------------------- iteration
    def __iter__(self) -> Iterator[Dict[str, torch.Tensor]]:
        info = get_worker_info()
        worker_id, num_workers = (info.id, info.num_workers) if info else (0, 1)
        order = self._record_order(worker_id, num_workers)
        state = {"epoch": self.epoch, "cursor": 0, "buffer": [], "produced": 0}
        if self._resume is not None and self._resume.get("epoch") == self.epoch:
            state.update(self._resume)
        self._resume = None
        self._state = state
        cache: Dict[int, List[Dict[str, Any]]] = {}

        def sample(sid: SampleId) -> Dict[str, Any]:
            if sid[0] not in cache:
                cache[sid[0]] = _as_list(self.dataset[sid[0]])
            return cache[sid[0]][sid[1]]

        def refill():
            while len(state["buffer"]) < self.buffer_size and state["cursor"] < len(order):
                index = order[state["cursor"]]
                state["cursor"] += 1
                pieces = _as_list(self.dataset[index])
                cache[index] = pieces
                state["buffer"].extend([index, k] for k in range(len(pieces)))

        while True:
            refill()
            if not state["buffer"]:
                return
            step = (state["produced"] // self.dataloader_batch_size) * num_workers + worker_id
            chosen = self._choose(state["buffer"], sample, self._token_budget(step))
            picked = [state["buffer"][i] for i in chosen]
            for i in reversed(chosen):
                del state["buffer"][i]
            state["produced"] += 1
            batch = self.collate_fn([sample(tuple(sid)) for sid in picked])
            live = {sid[0] for sid in state["buffer"]}
            for key in [k for k in cache if k not in live]:
                del cache[key]
            yield batch

    def _choose(self, buffer: List[List[int]], sample: Callable, budget: int) -> List[int]:
        if not self.dyn_bsz:
            return list(range(min(self.micro_batch_size, len(buffer))))
        chosen, used = [], 0
        for i, sid in enumerate(buffer):
            n = len(sample(tuple(sid))["input_ids"])
            if used + n <= budget or not chosen:
                chosen.append(i)
                used += n
                if used >= budget:
                    break
        return chosen


def _as_list(item) -> List[Dict[str, Any]]:
    return item if isinstance(item, list) else [item]


def _list_of_micro_batches(micro_batches):
    return list(micro_batches)


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
) -> StatefulDataLoader:
    """A stateful loader whose `next()` is a list of `dataloader_batch_size` collated micro-batches."""
    if dataloader_type != "native":
        raise ValueError(f"unknown dataloader type {dataloader_type!r}; only 'native' exists")
    if dp_rank is None or dp_size is None:
        from ..distributed.parallel_state import get_parallel_state

        state = get_parallel_state()
        dp_rank, dp_size = state.dp_rank, state.dp_size
    if collate_fn is None:
        if not build_collate_fn:
            raise ValueError("build_collate_fn=False needs an explicit collate_fn")
        collate_fn = MainCollator(max_seq_len=max_seq_len, **(collate_fn_kwargs or {}))
    stream = MicroBatchStream(
        dataset,
        collate_fn,
        micro_batch_size=micro_batch_size,
        max_seq_len=max_seq_len,
        dataloader_batch_size=dataloader_batch_size,
        dyn_bsz=dyn_bsz,
        buffer_size=dyn_bsz_buffer_size,
        dp_rank=dp_rank,
        dp_size=dp_size,
        seed=seed,
        shuffle=shuffle,
        warmup_steps=int(train_steps * bsz_warmup_ratio),
        warmup_init_tokens=bsz_warmup_init_mbtoken,
    )
    extra = {"prefetch_factor": prefetch_factor} if num_workers > 0 and prefetch_factor else {}
    loader = StatefulDataLoader(
        stream,
        batch_size=dataloader_batch_size,
        collate_fn=_list_of_micro_batches,
        num_workers=num_workers,
        drop_last=drop_last,
        pin_memory=pin_memory and torch.cuda.is_available(),
        **extra,
    )
    loader.set_epoch = stream.set_epoch  # the trainer reshuffles per epoch through the loader
    return loader
