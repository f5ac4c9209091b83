"""Private torchdata / torch.utils.data symbols: StatefulDataLoader's iterator slot, its workers' shutdown and the
layout of its state dict.

IteratorSlotLoader stops loader workers as soon as their iterator is abandoned, and veomni reshards saved loader
states between layouts: both need internals torchdata does not expose (tests/test_compat.py checks them).
"""

import os
import weakref
from typing import Any, Dict, List, Tuple

from torchdata.stateful_dataloader import StatefulDataLoader

__all__ = [
    "IteratorSlotLoader",
    "iterator_shut_down",
    "shutdown_iterator_workers",
    "keep_unstarted_iterator_state",
    "worker_snapshots",
]

# class-level symbols; the loader's instance attributes (`_iterator`, `_initial_iter_for_state_dict`) and the
# iterator's `_shutdown` are checked by running a loader (tests/test_compat.py)
PRIVATE_SYMBOLS: List[Tuple[str, str, str]] = [
    ("torch.utils.data.dataloader", "_MultiProcessingDataLoaderIter._shutdown_workers", "stop a loader's workers"),
    ("torchdata.stateful_dataloader.stateful_dataloader", "_StatefulMultiProcessingDataLoaderIter._SNAPSHOT", "-"),
    (
        "torchdata.stateful_dataloader.stateful_dataloader",
        "_StatefulMultiProcessingDataLoaderIter._WORKER_SNAPSHOTS",
        "-",
    ),
]
_SNAPSHOT, _WORKER_SNAPSHOTS = "_snapshot", "_worker_snapshots"  # (those two constants' values)


class IteratorSlotLoader(StatefulDataLoader):
    """A StatefulDataLoader that stops its worker processes as soon as their iterator is abandoned: when a state is
    loaded, on `close()` (the trainer's, at the end of training or on a stop), and when the loader itself is collected
    (unless the iterator is still in use: `for batch in build_dataloader(...)`). A new iter() leaves the previous
    iterator working, as a DataLoader does: it may still be iterated.

    torch shuts an iterator's workers down only when the iterator is garbage collected. An iterator left mid-epoch
    (max_steps reached, a resume, the end of training) otherwise keeps its workers alive until then, and when the
    collection happens in a reference cycle, the workers' index queues are finalized before the iterator, the
    "exit" message never reaches them, and each worker costs the full join timeout (5 s) before it is killed.

    The current iterator (torch's private `self._iterator`, assigned by `__iter__`, `state_dict` and
    `load_state_dict`) lives in `self._live[0]`, a box a finalizer can reach without holding the loader; each
    replacement goes through `iterator_replaced(previous, new)`. If torchdata renames `_iterator`, the box stays
    empty while torch keeps its own attribute: workers would again stop only at garbage collection
    (tests/test_data_loader.py's worker-shutdown tests catch it)."""

    def __init__(self, *args, **kwargs):
        self._live: List[Any] = [None]
        super().__init__(*args, **kwargs)
        # the box keeps the iterator out of the cyclic garbage, so its queues still work when the loader goes: the
        # finalizer only lets go of it, and torch stops its workers at once unless someone still iterates it (as in
        # `for batch in build_dataloader(...)`, where nothing else holds the loader)
        weakref.finalize(self, _release, self._live, os.getpid()).atexit = False  # at exit torch's own handling

    @property
    def _iterator(self):
        return self._live[0]

    @_iterator.setter
    def _iterator(self, iterator) -> None:
        previous, self._live[0] = self._live[0], iterator
        self.iterator_replaced(previous, iterator)

    def iterator_replaced(self, previous, new) -> None:
        """Called on each assignment of the current iterator. load_state_dict drops it (None: its position is then
        gone), so its workers stop. A new iter() replaces it, but the old one may still be iterated (two iterators,
        as a DataLoader allows): it keeps its workers, and frees them when it ends or is collected."""
        if new is None and previous is not None:
            shutdown_iterator_workers(previous)

    def __iter__(self):
        closed = self._live[0]
        if iterator_shut_down(closed):  # close()d (or ended): new workers; persistent ones can't be reset
            keep_unstarted_iterator_state(self, closed)  # made by state_dict() and never iterated: its position
            self._live[0] = None
        return super().__iter__()

    def close(self) -> None:
        """Stop the current iterator's worker processes now. `state_dict()` still gives the position reached; a
        later `iter()` starts the next epoch (or resumes a loaded state) with new workers."""
        shutdown_iterator_workers(self._live[0])  # (they are idle or prefetching: they exit promptly)


def _release(box: List[Any], owner_pid: int) -> None:
    if os.getpid() == owner_pid:
        box[0] = None  # the last reference gone, torch's __del__ stops the workers; otherwise its holder still iterates
    else:  # a copy in a process forked while the loader lived: its iterator's shutdown there would tell the owner's
        _FOREIGN.append(box)  # workers to exit (the owner's next batch then never comes), so it is never freed


_FOREIGN: List[List[Any]] = []  # iterator boxes copied into a forked process: kept, never shut down there


def iterator_shut_down(iterator) -> bool:
    """Whether a loader iterator was closed or ran to its end (`_shutdown`; a single-process one never is)."""
    return bool(getattr(iterator, "_shutdown", False))


def shutdown_iterator_workers(iterator) -> None:
    """Tell an iterator's worker processes to exit and join them (`_shutdown_workers`; a single-process iterator
    has no workers and no such method)."""
    shutdown = getattr(iterator, "_shutdown_workers", None)
    if shutdown is not None:
        shutdown()


def keep_unstarted_iterator_state(loader: StatefulDataLoader, iterator) -> None:
    """An iterator made by `state_dict()` and never iterated (`_initial_iter_for_state_dict`) is where the next
    `iter()` must start: keep its position as the loader's `next_iter_state` before the iterator is dropped."""
    if loader._initial_iter_for_state_dict:
        loader.next_iter_state = iterator.state_dict()
        loader._initial_iter_for_state_dict = False


def worker_snapshots(loader_state: Dict[str, Any]) -> Dict[Any, Dict[str, Any]]:
    """The per-worker snapshots in a multi-worker StatefulDataLoader state (`state["_snapshot"]
    ["_worker_snapshots"]`, torchdata's private layout), {} when there are none."""
    return loader_state.get(_SNAPSHOT, {}).get(_WORKER_SNAPSHOTS, {})
