"""`ParallelDims`: the one place that turns the configured parallel sizes into degrees, validates them, and builds
the device meshes.

Every mesh is derived from the dense mesh, the root, through its flattened 1-D world view:

    dense (dp_replicate, dp_shard, ulysses, tp)  row-major: tp ranks are adjacent
    world (W) = dense flattened -> <name> (<name>_fsdp, <name>) per extra dim (ep), or (<name>, <name>_fsdp)

and the data-parallel views are flattened from the dense mesh: `dp` (dp_replicate x dp_shard), `dp_shard_sp`
(dp_shard x ulysses: what FSDP shards over, since sequence-parallel ranks hold the same parameters), `dp_sp`
(every rank holding its own tokens) and `sp` (ulysses, under VeOmni's name). Since the dense mesh is the root, each
view is also reachable by name on it (`dense["dp_sp"]`, `dense.get_group("sp")`), as VeOmni's clients expect. The
degrees come from the config by one formula (veomni.arguments.parallel_sizes), which `TrainingArguments.resolve`
reads too.
"""

from dataclasses import dataclass, field
from typing import Dict, Optional

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ..arguments.arguments_types import AcceleratorArguments
from ..arguments.parallel_sizes import ExtraDim, ParallelSizes, resolve_parallel_sizes
from ..compat.torch import flatten_mesh, unflatten_mesh

__all__ = ["DENSE_DIMS", "ExtraDim", "ParallelDims", "ParallelMeshes"]

DENSE_DIMS = ("dp_replicate", "dp_shard", "ulysses", "tp")


@dataclass(frozen=True)
class ParallelDims(ParallelSizes):
    """The degrees of a layout (veomni.arguments.parallel_sizes), and the meshes they make."""

    @classmethod
    def from_config(cls, acc, world_size: Optional[int]) -> "ParallelDims":
        """The degrees `train.accelerator` (an AcceleratorArguments) means on `world_size` ranks."""
        return cls(**vars(resolve_parallel_sizes(acc, world_size)))

    @classmethod
    def resolve(cls, world_size: Optional[int], **sizes) -> "ParallelDims":
        """`from_config` with the accelerator's size keys as keywords (`dp_size=`, `tp_size=`, `ulysses_size=`, ...,
        `extra_parallel_names=`), every other one at its default."""
        return cls.from_config(AcceleratorArguments(**sizes), world_size)

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

    @property
    def ep(self) -> int:
        return next((extra.size for extra in self.extras if extra.name == "ep"), 1)

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
            layout = [(f"{dim.name}_fsdp", self.world_size // dim.size), (dim.name, dim.size)]  # innermost: ep last
            names, sizes = zip(*(layout if dim.innermost else layout[::-1]))
            extra[dim.name] = unflatten_mesh(world, 0, sizes, names)
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
