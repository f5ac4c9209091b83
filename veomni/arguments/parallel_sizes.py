"""The parallel degrees a config means: `train.accelerator`'s sizes, every -1 filled from the world size and checked
to multiply to it (errors name the keys). One formula, read by `TrainingArguments.resolve` (batch arithmetic at
parse time) and by `veomni.distributed.ParallelDims.from_config` (the meshes).
"""

import math
from dataclasses import dataclass
from typing import Optional, Tuple


@dataclass(frozen=True)
class ExtraDim:
    """A parallel dimension over all ranks beside the dense ones (expert parallel: `ep`)."""

    name: str
    size: int
    innermost: bool = True  # adjacent ranks form one group: all-to-all stays within a node


@dataclass(frozen=True)
class ParallelSizes:
    world_size: int
    dp_replicate: int = 1
    dp_shard: int = 1
    ulysses: int = 1
    tp: int = 1
    extras: Tuple[ExtraDim, ...] = ()


def resolve_parallel_sizes(acc, world_size: Optional[int]) -> ParallelSizes:
    """The degrees of `acc` (an AcceleratorArguments) on `world_size` ranks.

    `world_size=None` (a config read outside torchrun, e.g. by `--preview` or a test): the smallest world the
    given sizes fit, every -1 taken as 1.
    """
    tp, ulysses = acc.tp_size, acc.ulysses_size
    if world_size is None:
        dp = acc.dp_size if acc.dp_size != -1 else max(acc.dp_replicate_size, 1) * max(acc.dp_shard_size, 1)
        world_size = math.lcm(dp * tp * ulysses, *acc.extra_parallel_sizes)
    for name, size in (("pp_size", acc.pp_size), ("cp_size", acc.cp_size)):
        if size != 1:
            raise NotImplementedError(f"{name}={size} is not supported yet: set it to 1")
    for name, size in (("tp_size", tp), ("ulysses_size", ulysses)):
        if size < 1:
            raise ValueError(f"{name} must be at least 1, got {size}")
    dp_size = world_size // (ulysses * tp) if acc.dp_size == -1 else acc.dp_size
    dp_replicate, dp_shard = _split_dp(dp_size, acc.dp_replicate_size, acc.dp_shard_size)
    product = dp_size * ulysses * tp
    if product != world_size:
        raise ValueError(
            "parallel sizes do not multiply to the world size: dp_size * ulysses_size * tp_size * pp_size * "
            f"cp_size = {dp_size} * {ulysses} * {tp} * 1 * 1 = {product}, but world_size = {world_size}"
        )
    names, sizes = list(acc.extra_parallel_names), list(acc.extra_parallel_sizes)
    if len(names) != len(sizes):
        raise ValueError(f"extra_parallel_names {names} and extra_parallel_sizes {sizes} differ in length")
    for name, size in zip(names, sizes):
        if size < 1 or world_size % size:
            raise ValueError(f"extra parallel '{name}' size {size} does not divide world_size {world_size}")
    innermost = list(acc.extra_parallel_placement_innermost) + [True] * len(names)  # unset: innermost
    extras = tuple(ExtraDim(*dim) for dim in zip(names, sizes, innermost))
    return ParallelSizes(world_size, dp_replicate, dp_shard, ulysses, tp, extras)


def _split_dp(dp_size: int, dp_replicate_size: int, dp_shard_size: int) -> Tuple[int, int]:
    if dp_replicate_size == -1 and dp_shard_size == -1:
        return 1, dp_size
    if dp_shard_size == -1:
        dp_shard_size = dp_size // max(dp_replicate_size, 1)
    elif dp_replicate_size == -1:
        dp_replicate_size = dp_size // max(dp_shard_size, 1)
    if dp_replicate_size < 1 or dp_shard_size < 1 or dp_replicate_size * dp_shard_size != dp_size:
        raise ValueError(
            f"dp_replicate_size * dp_shard_size = {dp_replicate_size} * {dp_shard_size} = "
            f"{dp_replicate_size * dp_shard_size}, but dp_size = {dp_size}"
        )
    return dp_replicate_size, dp_shard_size
