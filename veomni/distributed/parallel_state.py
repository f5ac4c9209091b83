"""The process group and the parallel state: `init_parallel_state(...)` once, `get_parallel_state()` anywhere.

The degrees and meshes come from `ParallelDims` (parallel_dims.py). The dense mesh has named dims (dp_replicate,
dp_shard, ulysses, tp); FSDP shards over dp_shard and ulysses together (sequence-parallel ranks hold the same
parameters, so their gradients must be summed too). Each extra dimension (expert parallel, `ep`) has a 2-D mesh
(`<name>_fsdp`, `<name>`) over all ranks.
"""

import os
import socket
import sys
from dataclasses import dataclass, fields
from datetime import timedelta
from typing import Literal, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ..arguments.arguments_types import AcceleratorArguments, FSDPConfig
from ..utils.device import get_device, get_device_type, get_dist_backend
from .parallel_dims import DENSE_DIMS, ParallelDims, ParallelMeshes

_PARALLEL_STATE: Optional["ParallelState"] = None


def init_distributed(timeout_minutes: float = 10) -> None:
    """Start the default process group from torchrun's environment, or a 1-process group without it.

    `timeout_minutes` bounds every collective: a dead or stalled peer ends the job with an error instead of a
    hang (gloo honours it directly; on NCCL, async error handling aborts the communicator when it expires).
    """
    if dist.is_initialized():
        return
    if "RANK" not in os.environ:  # plain `python`: a world of one, so the same code path runs everywhere
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        if "MASTER_PORT" not in os.environ:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    kwargs = {"backend": get_dist_backend(), "timeout": timedelta(minutes=timeout_minutes)}
    if get_device_type() == "cuda":
        # a failed or timed-out collective ends the process (3: without waiting on the communicator's teardown)
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
        torch.cuda.set_device(get_device())
        kwargs["device_id"] = get_device()
    dist.init_process_group(**kwargs)


def _views(name: str):
    """The (mesh, group, this rank's index) properties of the mesh `get_mesh(name)`."""
    return (
        property(lambda self: self.get_mesh(name)),
        property(lambda self: self.get_mesh(name).get_group()),
        property(lambda self: self.get_mesh(name).get_local_rank()),
    )


@dataclass
class ParallelState:
    """A public view of the degrees (`dims`, a ParallelDims) and the meshes built from them: `get_mesh(name)`, and
    the seed's properties (sizes, meshes, groups and ranks by feature), each one line over those two."""

    dims: ParallelDims
    meshes: ParallelMeshes
    mode: Literal["fsdp2", "ddp"] = "fsdp2"
    async_enabled: bool = False

    @classmethod
    def from_dims(cls, dims: ParallelDims, mode: str = "fsdp2", async_enabled: bool = False) -> "ParallelState":
        return cls(dims, dims.build_meshes(get_device_type()), mode, async_enabled)

    def get_mesh(self, names: Union[str, Tuple[str, ...]]) -> DeviceMesh:
        """The mesh of `names`: a dense dim (dp_replicate, dp_shard, ulysses, tp) or a tuple of them, a flattened view
        (dp, dp_shard_sp, dp_sp), `fsdp` (what FSDP2 shards over), `world`, or a dim of an extra mesh (ep, ep_fsdp)."""
        meshes = self.meshes
        if not isinstance(names, str):
            return meshes.dense[tuple(names)]
        if names in DENSE_DIMS:
            return meshes.dense[names]
        views = {**meshes.flat, "fsdp": meshes.fsdp, "world": meshes.world}
        if names in views:
            return views[names]
        for extra in meshes.extra.values():
            if names in extra.mesh_dim_names:
                return extra[names]
        raise KeyError(
            f"no mesh named {names!r}; dims: {DENSE_DIMS}, views: {sorted(meshes.flat)}, extra: "
            f"{self.extra_parallel_names or 'none'}"
        )

    # sizes
    world_size = property(lambda self: self.dims.world_size)
    dp_size = property(lambda self: self.dims.dp)
    dp_replicate_size = property(lambda self: self.dims.dp_replicate)
    dp_shard_size = property(lambda self: self.dims.dp_shard)
    fsdp_size = property(lambda self: self.dims.fsdp, doc="dp_shard x ulysses (HSDP replicates it over dp_replicate)")
    ulysses_size = sp_size = property(lambda self: self.dims.ulysses)
    tp_size = property(lambda self: self.dims.tp)
    ep_size = property(lambda self: self.dims.ep)
    dp_sp_size = property(lambda self: self.dims.dp_sp, doc="Ranks that hold their own tokens (data x sequence).")
    dp_enabled = property(lambda self: self.dims.dp > 1)
    sp_enabled = property(lambda self: self.dims.ulysses > 1)
    tp_enabled = property(lambda self: self.dims.tp > 1)
    ep_enabled = property(lambda self: self.dims.ep > 1)
    extra_parallel_names = property(lambda self: [extra.name for extra in self.dims.extras])
    # meshes, groups and this rank's place in them
    device_mesh = property(lambda self: self.meshes.dense, doc="The dense mesh (dp_replicate, dp_shard, ulysses, tp).")
    flat_meshes = property(lambda self: self.meshes.flat)
    extra_meshes = property(lambda self: self.meshes.extra)
    dp_mode = property(lambda self: self.mode, doc="VeOmni's name of `mode` ('fsdp2' or 'ddp').")
    fsdp_mesh = property(
        lambda self: self.meshes.fsdp, doc="1-D (dp_shard x ulysses), or 2-D with dp_replicate (HSDP)."
    )
    dp_mesh, dp_group, dp_rank = _views("dp")
    sp_mesh, sp_group, sp_rank = _views("ulysses")
    tp_mesh, tp_group, tp_rank = _views("tp")
    _, ep_group, ep_rank = _views("ep")
    dp_sp_group = property(lambda self: self.get_mesh("dp_sp").get_group(), doc="Loss-token counts sum over it.")
    ep_mesh = property(lambda self: self.extra_mesh("ep"))
    global_rank = property(lambda self: dist.get_rank())
    is_main_process = property(lambda self: dist.get_rank() == 0)

    def extra_mesh(self, name: str) -> DeviceMesh:
        """2-D mesh (`<name>_fsdp`, `<name>`) of an extra parallel dimension, e.g. `extra_mesh("ep")`."""
        if name not in self.extra_meshes:
            raise KeyError(f"no extra parallel dim '{name}'; configured: {self.extra_parallel_names or 'none'}")
        return self.extra_meshes[name]


def init_parallel_state_from_config(acc) -> ParallelState:
    """Initialise the process group (if needed) and the device meshes of `train.accelerator` (an
    AcceleratorArguments); `get_parallel_state()` returns them. The trainer's entry."""
    global _PARALLEL_STATE
    mode = acc.fsdp_config.fsdp_mode
    if mode not in ("fsdp2", "ddp"):
        raise ValueError(f"mode must be 'fsdp2' or 'ddp', got {mode!r}")
    init_distributed(acc.dist_timeout_minutes)
    dims = ParallelDims.from_config(acc, dist.get_world_size())
    _PARALLEL_STATE = ParallelState.from_dims(dims, mode, acc.enable_async)
    return _PARALLEL_STATE


def init_parallel_state(
    dp_size: int = -1,
    dp_replicate_size: int = -1,
    dp_shard_size: int = -1,
    tp_size: int = 1,
    pp_size: int = 1,
    cp_size: int = 1,
    ulysses_size: int = 1,
    extra_parallel_sizes: Optional[Sequence[int]] = None,
    extra_parallel_placement_innermost: Optional[Sequence[bool]] = None,
    extra_parallel_names: Optional[Sequence[str]] = None,
    mode: Literal["fsdp2", "ddp"] = "fsdp2",
    async_enabled: bool = False,
    dist_timeout_minutes: float = 10,
    dp_mode: Optional[Literal["fsdp2", "ddp"]] = None,
    ep_size: Optional[int] = None,
) -> ParallelState:
    """The seed's entry: `init_parallel_state_from_config` of the `train.accelerator` these keywords spell (each is
    the key of the same name; `mode` is `fsdp_config.fsdp_mode`, `async_enabled` is `enable_async`).

    `dist_timeout_minutes`: how long any collective may wait for a peer before the job fails.
    VeOmni's spellings are accepted as well (see `veomni_keywords`): `dp_mode` for `mode`, `ep_size` for an extra
    dim named `ep`, and `extra_parallel_sizes` without names meaning `("ep",)`.
    """
    mode, extra_parallel_sizes, extra_parallel_names = veomni_keywords(
        mode, dp_mode, ep_size, extra_parallel_sizes, extra_parallel_names
    )
    extra_parallel_placement_innermost = list(extra_parallel_placement_innermost or [])
    given = locals()
    keys = {f.name for f in fields(AcceleratorArguments)} & set(given)  # every keyword named as its key
    acc = AcceleratorArguments(
        **{key: given[key] for key in keys}, enable_async=async_enabled, fsdp_config=FSDPConfig(fsdp_mode=mode)
    )
    return init_parallel_state_from_config(acc)


# ------------------------------------------------------------------------------- VeOmni's keywords
def veomni_keywords(
    mode: str,
    dp_mode: Optional[str],
    ep_size: Optional[int],
    extra_parallel_sizes: Optional[Sequence[int]],
    extra_parallel_names: Optional[Sequence[str]],
):
    """(mode, extra sizes, extra names) from VeOmni's spellings of `init_parallel_state`'s arguments, as its clients
    (verl's VeOmni engine, the seed's pull request) write them:

    - `dp_mode="fsdp2"` is `mode="fsdp2"` (both given and different: an error);
    - `ep_size=N` is an extra parallel dim `ep` of size N (with `extra_parallel_sizes` too: an error);
    - `extra_parallel_sizes=(N,)` without names names it `ep`: VeOmni's default, `extra_parallel_names=("ep",)`.
    """
    if dp_mode is not None:
        if mode != "fsdp2" and mode != dp_mode:
            raise ValueError(f"init_parallel_state: mode={mode!r} and dp_mode={dp_mode!r} disagree; pass one")
        mode = dp_mode
    sizes = list(extra_parallel_sizes or [])
    names = list(extra_parallel_names or [])
    if ep_size is not None:
        if sizes:
            raise ValueError("init_parallel_state: pass ep_size or extra_parallel_sizes, not both")
        sizes, names = [ep_size], ["ep"]
    if sizes and not names:
        if len(sizes) != 1:
            raise ValueError(f"init_parallel_state: extra_parallel_sizes={sizes} needs extra_parallel_names")
        names = ["ep"]
    return mode, sizes, names


def get_parallel_state() -> ParallelState:
    if _PARALLEL_STATE is None:
        raise RuntimeError("parallel state is not initialised: call init_parallel_state(...) first")
    return _PARALLEL_STATE


def parallel_state_or_none() -> Optional[ParallelState]:
    """The parallel state if `init_parallel_state` ran, else None (for checks that must not initialise it)."""
    return _PARALLEL_STATE


def destroy_parallel_state() -> None:
    """Forget the meshes and tear the process group down cleanly (avoids exit-time aborts on gloo).

    The barrier runs only on the way out of a normal run. Called from a `finally:` while an exception
    propagates, it would wait for peers that are themselves stuck in a collective (a hang, not an error), so
    then it returns at once and lets the process exit with the exception.
    """
    global _PARALLEL_STATE
    _PARALLEL_STATE = None
    if dist.is_initialized() and sys.exc_info()[0] is None:
        dist.barrier()
        dist.destroy_process_group()
