"""Host-side coordination of ranks: rank-0 work every rank waits for, work every rank does, on CPU objects.

A plain `if rank == 0: work(); dist.barrier()` leaves the other ranks in the barrier until the collective timeout
when rank 0's work fails (a full disk, a permission). `on_rank0` broadcasts rank 0's result or its error instead:
every rank returns the same value or raises the same error at once. `on_every_rank` does the same for work that
every rank does (a share of a data cache): one rank's failure is raised on all, naming the rank.

`gather_seq` concatenates the sequence shards of a tensor (Ulysses, the MoE balance loss). `HostGroup` (and `host_group` for a `with` block) is a gloo group over every rank, for CPU tensors and objects (NCCL carries only GPU tensors) and
with its own timeout: data preparation may keep a rank busy for longer than a training collective should wait.
"""

import contextlib
import os
import pickle
from datetime import timedelta
from typing import Any, Callable, Iterator, Optional, Tuple

import torch
import torch.distributed as dist


def rank_and_world() -> Tuple[int, int]:
    """(this rank, the world size); (0, 1) outside torch.distributed."""
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def on_rank0(fn: Callable[[], Any], group: Optional[dist.ProcessGroup] = None) -> Any:
    """`fn()` on rank 0; its result (or its exception) on every rank. Collective (on `group`, default the world):
    call on every rank alike."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return fn()
    box = [None]
    if dist.get_rank() == 0:
        try:
            box = [("ok", fn())]
        except Exception as err:
            box = [("error", err)]
            try:
                pickle.dumps(err)
            except Exception:  # an exception that cannot travel: its type and message do
                box = [("error", RuntimeError(f"{type(err).__name__}: {err}"))]
            dist.broadcast_object_list(box, src=0, group=group)
            raise
    dist.broadcast_object_list(box, src=0, group=group)
    kind, value = box[0]
    if kind == "error":
        raise value
    return value


class HostGroup:
    """A gloo group over every rank, made on first `get()` (collective: every rank alike) and kept until `close()`.
    With `reuse_gloo_world`, the world group itself where it is gloo already (nothing made, nothing to close)."""

    def __init__(self, timeout_minutes: Optional[float] = None, reuse_gloo_world: bool = False):
        if timeout_minutes is None:
            timeout_minutes = float(os.environ.get("VEOMNI_HOST_TIMEOUT_MINUTES", 12 * 60))
        self.timeout, self.reuse_gloo_world = timedelta(minutes=timeout_minutes), reuse_gloo_world
        self.group: Optional[dist.ProcessGroup] = None

    def get(self) -> dist.ProcessGroup:
        if self.group is None:
            reuse = self.reuse_gloo_world and dist.get_backend() == "gloo"
            self.group = dist.group.WORLD if reuse else dist.new_group(backend="gloo", timeout=self.timeout)
        return self.group

    def close(self) -> None:
        """Frees the group this made (a trainer per run in one process would otherwise pile them up)."""
        if self.group is not None and self.group is not dist.group.WORLD and dist.is_initialized():
            dist.destroy_process_group(self.group)
        self.group = None


@contextlib.contextmanager
def host_group() -> Iterator[Optional[dist.ProcessGroup]]:
    """A gloo group of every rank for the `with` block (None in a world of one). Collective to create: enter it on
    every rank alike. The timeout (`VEOMNI_HOST_TIMEOUT_MINUTES`, default 12 hours) bounds each wait in it."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        yield None
        return
    group = HostGroup()
    try:
        yield group.get()
    finally:
        group.close()


def gather_seq(x: torch.Tensor, group: Optional[dist.ProcessGroup], dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's sequence shard of a tensor that needs no gradient (position ids, masks) along
    `dim`; `x` itself without a group."""
    if group is None:
        return x
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def on_every_rank(
    fn: Callable[[], Any], what: str, group: Optional[dist.ProcessGroup] = None, error_type: type = RuntimeError
) -> Any:
    """`fn()` on this rank; if it fails on any rank, every rank raises (the failing rank its own error, the others
    an `error_type` naming that rank, what it was doing and its message). Collective on `group`."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return fn()
    error: Optional[BaseException] = None
    try:
        result = fn()
    except Exception as err:
        error = err
    outcomes = [None] * dist.get_world_size(group)
    dist.all_gather_object(outcomes, None if error is None else f"{type(error).__name__}: {error}", group=group)
    if error is not None:
        raise error
    for rank, outcome in enumerate(outcomes):
        if outcome is not None:
            raise error_type(f"rank {rank} failed {what}: {outcome}")
    return result
