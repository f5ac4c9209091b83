"""Collectives as the planner counts them: one name per kind, the bytes of its full-size buffer, and its group.

`CollectiveCounter` measures them: a TorchDispatchMode sees every collective op, whoever issues it -- FSDP2's
all-gathers and reduce-scatters (c10d ops), DTensor's and the Ulysses / expert-parallel all-to-alls (functional
collectives), the trainer's own all-reduces -- in forward, in backward and in recomputation alike, which
wrapping the Python functions of torch.distributed would not (DTensor and FSDP2 call the ops directly).

Bytes of one call (the buffer a ring algorithm moves (n-1)/n of, or 2(n-1)/n for an all-reduce):
    all_gather      the gathered output         reduce_scatter  the unreduced input
    all_reduce      the tensor                  all_to_all      the input this rank sends (its own share too)
    broadcast       the tensor
"""

from typing import Dict, List, Tuple

import torch
import torch.distributed as dist

from ..compat.torch import TorchDispatchMode, op_schema, resolve_process_group

# op name -> (kind, which argument holds the counted buffer); a list argument counts all its tensors
_C10D = {
    "allreduce_": ("all_reduce", 0),
    "_allgather_base_": ("all_gather", 0),
    "allgather_": ("all_gather", 0),
    "allgather_into_tensor_coalesced_": ("all_gather", 0),
    "_reduce_scatter_base_": ("reduce_scatter", 1),
    "reduce_scatter_": ("reduce_scatter", 1),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1),
    "alltoall_base_": ("all_to_all", 1),
    "alltoall_": ("all_to_all", 1),
    "broadcast_": ("broadcast", 0),
}
_FUNCTIONAL = {
    "all_reduce": ("all_reduce", 0),
    "all_reduce_": ("all_reduce", 0),
    "all_gather_into_tensor": ("all_gather", 0),  # times the group size: its argument is the input
    "reduce_scatter_tensor": ("reduce_scatter", 0),
    "all_to_all_single": ("all_to_all", 0),
    "broadcast": ("broadcast", 0),
}


def _nbytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


def _group_ranks(func, args, kwargs) -> Tuple[int, ...]:
    """Functional collectives name their group (`group_name`); c10d ops carry the ProcessGroup (`process_group`)."""
    for i, schema_arg in enumerate(op_schema(func).arguments):
        if schema_arg.name not in ("group_name", "process_group"):
            continue
        value = args[i] if i < len(args) else kwargs[schema_arg.name]
        if isinstance(value, str):
            group = resolve_process_group(value)
        else:
            group = dist.ProcessGroup.unbox(value)
        return tuple(dist.get_process_group_ranks(group))
    raise ValueError(f"{func}: no process group argument")


def group_key(kind: str, ranks) -> str:
    """`kind@r0,r1,...`: collectives over the same ranks add up whatever mesh dim named the group."""
    return f"{kind}@{','.join(str(r) for r in ranks)}"


class CollectiveCounter(TorchDispatchMode):
    """Within the block, every collective of this rank: `calls` (kind, bytes, ranks) in issue order."""

    def __init__(self):
        super().__init__()
        self.calls: List[Tuple[str, int, Tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        namespace, name = func.namespace, op_schema(func).name.split("::")[-1]
        table = _C10D if namespace == "c10d" else _FUNCTIONAL if namespace.startswith("_c10d_functional") else {}
        if name in table:
            kind, index = table[name]
            ranks = _group_ranks(func, args, kwargs)
            nbytes = _nbytes(args[index])
            if namespace != "c10d" and name == "all_gather_into_tensor":
                nbytes *= len(ranks)
            self.calls.append((kind, nbytes, ranks))
        return func(*args, **kwargs)

    def by_group(self) -> Dict[str, int]:
        totals: Dict[str, int] = {}
        for kind, nbytes, ranks in self.calls:
            key = group_key(kind, ranks)
            totals[key] = totals.get(key, 0) + nbytes
        return totals
