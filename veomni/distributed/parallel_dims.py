"""`ParallelDims`: the one place that turns the configured parallel sizes into degrees, validates them, and builds
the device meshes.

Every mesh is derived from the dense mesh, the root, through its flattened 1-D world view:

    dense (dp_replicate, dp_shard, ulysses, tp)  row-major: tp ranks are adjacent
    world (W) = dense flattened -> <name> (<name>_fsdp, <name>) per extra dim (ep), or (<name>, <name>_fsdp)

and the data-parallel views are flattened from the dense mesh: `dp` (dp_replicate x dp_shard), `dp_shard_sp`
(dp_shard x ulysses: what FSDP shards over, since sequence-parallel ranks hold the same parameters), `dp_sp`
(every rank holding its own tokens) and `sp` (ulysses, under VeOmni's name). Since the dense mesh is the root, each
view is also reachable by name on it (`dense["dp_sp"]`, `dense.get_group("sp")`), as VeOmni's clients expect. The arguments (`TrainingArguments.resolve`) and `init_parallel_state` both
call `ParallelDims.resolve`, so the degrees a config means are computed by one formula.
"""

import math
from dataclasses import dataclass, field
from typing import Dict, Optional, Sequence, Tuple

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ..compat.torch import flatten_mesh, unflatten_mesh

DENSE_DIMS = ("dp_replicate", "dp_shard", "ulysses", "tp")


@dataclass(frozen=True)
class ExtraDim:
    """A parallel dimension over all ranks beside the dense ones (expert parallel: `ep`)."""

    name: str
    size: int
    innermost: bool = True  # adjacent ranks form one group: all-to-all stays within a node


@dataclass(frozen=True)
class ParallelDims:
    world_size: int
    dp_replicate: int = 1
    dp_shard: int = 1
    ulysses: int = 1
    tp: int = 1
    extras: Tuple[ExtraDim, ...] = ()

    @classmethod
    def resolve(
        cls,
        world_size: Optional[int],
        dp_size: int = -1,
        dp_replicate_size: int = -1,
        dp_shard_size: int = -1,
        tp_size: int = 1,
        pp_size: int = 1,
        cp_size: int = 1,
        ulysses_size: int = 1,
        extra_parallel_names: Sequence[str] = (),
        extra_parallel_sizes: Sequence[int] = (),
        extra_parallel_placement_innermost: Sequence[bool] = (),
    ) -> "ParallelDims":
        """Fill every -1 from the world size and check that the degrees multiply to it (errors name the keys).

        `world_size=None` (a config read outside torchrun, e.g. by `--preview` or a test): the smallest world the
        given sizes fit, every -1 taken as 1.
        """
        if world_size is None:
            world_size = _smallest_world(dp_size, dp_replicate_size, dp_shard_size, tp_size * ulysses_size)
            world_size = math.lcm(world_size, *extra_parallel_sizes)
        for name, size in (("pp_size", pp_size), ("cp_size", cp_size)):
            if size != 1:
                raise NotImplementedError(f"{name}={size} is not supported yet: set it to 1")
        for name, size in (("tp_size", tp_size), ("ulysses_size", ulysses_size)):
            if size < 1:
                raise ValueError(f"{name} must be at least 1, got {size}")
        if dp_size == -1:
            dp_size = world_size // (ulysses_size * tp_size)
        dp_replicate, dp_shard = _split_dp(dp_size, dp_replicate_size, dp_shard_size)
        product = dp_size * ulysses_size * tp_size
        if product != world_size:
            raise ValueError(
                "parallel sizes do not multiply to the world size: dp_size * ulysses_size * tp_size * pp_size * "
                f"cp_size = {dp_size} * {ulysses_size} * {tp_size} * 1 * 1 = {product}, but world_size = {world_size}"
            )
        extras = _extra_dims(world_size, extra_parallel_names, extra_parallel_sizes, extra_parallel_placement_innermost)
        return cls(world_size, dp_replicate, dp_shard, ulysses_size, tp_size, extras)

    # ------------------------------------------------------------------ degrees
    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp(self) -> int:
        """Ranks FSDP shards over (dp_shard x ulysses); HSDP replicates that over dp_replicate."""
        return self.dp_shard * self.ulysses

    @property
    def dp_sp(self) -> int:
        """Ranks that hold their own tokens: loss-token counts are summed over them."""
        return self.dp * self.ulysses

    def extra_size(self, name: str) -> int:
        return next((extra.size for extra in self.extras if extra.name == name), 1)

    @property
    def ep(self) -> int:
        return self.extra_size("ep")

    # ------------------------------------------------------------------- meshes
    def build_meshes(self, device_type: str) -> "ParallelMeshes":
        """Every mesh of this layout, derived from one world mesh (collective on every rank, same order)."""
        sizes = (self.dp_replicate, self.dp_shard, self.ulysses, self.tp)
        # the dense mesh is the root, so every flattened view is also reachable by name on it (`dense["sp"]`,
        # `dense.get_local_rank("dp")`), as VeOmni's `device_mesh` is and verl's VeOmni engine reads it
        dense = init_device_mesh(device_type, sizes, mesh_dim_names=DENSE_DIMS)
        world = flatten_mesh(dense, "world")
        flat = {
            "dp": flatten_mesh(dense["dp_replicate", "dp_shard"], "dp"),
            "dp_shard_sp": flatten_mesh(dense["dp_shard", "ulysses"], "dp_shard_sp"),
            "dp_sp": flatten_mesh(dense["dp_replicate", "dp_shard", "ulysses"], "dp_sp"),
            "sp": flatten_mesh(dense["ulysses"], "sp"),  # VeOmni's name of the sequence-parallel group
        }
        extra = {}
        fsdp = self._fsdp_mesh(dense, flat)
        for dim in self.extras:
            outer = (f"{dim.name}_fsdp", self.world_size // dim.size)
            inner = (dim.name, dim.size)
            first, second = (outer, inner) if dim.innermost else (inner, outer)
            extra[dim.name] = unflatten_mesh(world, 0, (first[1], second[1]), (first[0], second[0]))
        return ParallelMeshes(world=world, dense=dense, flat=flat, extra=extra, fsdp=fsdp)

    def _fsdp_mesh(self, dense: DeviceMesh, flat: Dict[str, DeviceMesh]) -> DeviceMesh:
        """What FSDP2 shards over: 1-D (dp_shard x ulysses), or 2-D with dp_replicate first for HSDP."""
        if self.ulysses == 1:
            return dense["dp_replicate", "dp_shard"] if self.dp_replicate > 1 else dense["dp_shard"]
        if self.dp_replicate == 1:
            return flat["dp_shard_sp"]
        # HSDP over sequence-parallel ranks: dp_sp's ranks are ordered (dp_replicate, dp_shard, ulysses)
        return unflatten_mesh(flat["dp_sp"], 0, (self.dp_replicate, self.fsdp), ("dp_replicate", "dp_shard_sp"))


@dataclass
class ParallelMeshes:
    world: DeviceMesh
    dense: DeviceMesh
    flat: Dict[str, DeviceMesh] = field(default_factory=dict)
    extra: Dict[str, DeviceMesh] = field(default_factory=dict)
    fsdp: Optional[DeviceMesh] = None


def _smallest_world(dp_size: int, dp_replicate_size: int, dp_shard_size: int, model_parallel: int) -> int:
    if dp_size == -1:
        dp_size = max(dp_replicate_size, 1) * max(dp_shard_size, 1)
    return dp_size * model_parallel


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


def _extra_dims(
    world_size: int, names: Sequence[str], sizes: Sequence[int], innermost: Sequence[bool]
) -> Tuple[ExtraDim, ...]:
    names, sizes, innermost = list(names or []), list(sizes or []), list(innermost or [])
    if len(names) != len(sizes):
        raise ValueError(f"extra_parallel_names {names} and extra_parallel_sizes {sizes} differ in length")
    extras = []
    for i, (name, size) in enumerate(zip(names, sizes)):
        if size < 1 or world_size % size:
            raise ValueError(f"extra parallel '{name}' size {size} does not divide world_size {world_size}")
        extras.append(ExtraDim(name, size, innermost[i] if i < len(innermost) else True))
    return tuple(extras)
