"""Private torchdata / torch.utils.data symbols: StatefulDataLoader's iterator slot, its workers' shutdown and the
layout of its state dict.

veomni's MicroBatchLoader stops loader workers as soon as their iterator is abandoned (torch waits for garbage
collection, which in a reference cycle costs 5 s per worker), and reshards saved loader states between layouts.
Both need internals torchdata does not expose; tests/test_data_loader.py and tests/test_compat.py exercise them.
"""

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
    """A StatefulDataLoader whose current iterator (torch's private `self._iterator`, assigned by `__iter__`,
    `state_dict` and `load_state_dict`) lives in `self._live[0]`, a box a finalizer can reach without holding the
    loader, and whose subclass hears of every replacement through `iterator_replaced(previous, new)`.

    If torchdata renames `_iterator`, the box stays empty while torch keeps its own attribute: workers would again
    stop only at garbage collection (tests/test_data_loader.py's worker-shutdown tests catch it)."""

    def __init__(self, *args, **kwargs):
        self._live: List[Any] = [None]
        super().__init__(*args, **kwargs)

    @property
    def _iterator(self):
        return self._live[0]

    @_iterator.setter
    def _iterator(self, iterator) -> None:
        previous, self._live[0] = self._live[0], iterator
        self.iterator_replaced(previous, iterator)

    def iterator_replaced(self, previous, new) -> None:
        """Called on each assignment of the current iterator (None when a state is loaded)."""


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
