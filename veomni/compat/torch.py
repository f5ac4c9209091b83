"""Private torch symbols: meshes, replicate, collectives, a TP output hook, kernels, nn/optim internals, DCP metadata.

Each adapter says why veomni needs the private symbol and what breaks if torch moves it. Where a symbol can be
missing at run time and a slower path exists (`torch._grouped_mm`, the fused-AdamW device list), the fallback is
logged once; everything else is imported at module load, so a moved symbol fails on `import veomni.compat.torch`
with torch's ImportError / AttributeError naming it (and tests/test_compat.py names it first).
"""

import contextlib
import functools
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch import nn
from torch.distributed._composable.replicate import replicate
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel
from torch.utils._python_dispatch import TorchDispatchMode

from ..utils.logging import get_logger

logger = get_logger(__name__)

__all__ = [
    "replicate",
    "flatten_mesh",
    "unflatten_mesh",
    "all_to_all_single_autograd",
    "is_strided_shard",
    "local_tensor",
    "ColwiseParallelPassingPlainOutputs",
    "fused_kernel_devices",
    "foreach_norm",
    "foreach_mul_",
    "grouped_mm_available",
    "grouped_mm",
    "parameter_slots",
    "reset_optimizer_step_hooks",
    "unhooked_step",
    "DCP_PRIVATE_PICKLED",
    "open_dcp_metadata",
    "finish_dcp_metadata",
    "init_fake_process_group",
    "clear_dtensor_sharding_caches",
    "TorchDispatchMode",
    "op_schema",
    "resolve_process_group",
    "fsdp_param_group",
    "DTENSOR_REDISTRIBUTE_LOGGER",
    "in_backward",
]

# (module, attribute path, why): what tests/test_compat.py resolves one by one, to fail naming the moved one
PRIVATE_SYMBOLS: List[Tuple[str, str, str]] = [
    ("torch.distributed._composable.replicate", "replicate", "DDP (HSDP's replicate dim) in torch_parallelize"),
    ("torch.distributed.device_mesh", "DeviceMesh._flatten", "flat dp / dp_shard_sp / dp_sp meshes"),
    ("torch.distributed.device_mesh", "DeviceMesh._unflatten", "unflatten_mesh (parallel dims)"),
    ("torch.distributed._functional_collectives", "all_to_all_single_autograd", "Ulysses and EP all-to-alls"),
    ("torch.distributed.tensor.placement_types", "_StridedShard", "grad-norm path for FSDP over EP experts"),
    ("torch.distributed.tensor", "DTensor._local_tensor", "Muon / offload read the local shard graph-free"),
    ("torch.distributed.tensor.parallel", "ColwiseParallel._prepare_output_fn", "the vocab-parallel head"),
    ("torch.utils._foreach_utils", "_get_fused_kernels_supported_devices", "fused AdamW where torch has it"),
    ("torch", "_foreach_norm", "grad norm on CUDA (one kernel)"),
    ("torch", "_foreach_mul_", "grad clipping (one kernel)"),
    ("torch", "_grouped_mm", "fused MoE experts on CUDA bf16 (fallback: per-expert matmuls, logged)"),
    ("torch.distributed.checkpoint.filesystem", "FileSystemReader._get_metadata_path", "safe DCP metadata read"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo", "pickled into DCP .metadata"),
    ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING", "pickled into DCP .metadata"),
    ("torch.serialization", "_get_layout", "pickled into DCP .metadata"),
    ("torch.testing._internal.distributed.fake_pg", "FakeStore", "veomni.plan's fake world"),
    ("torch.utils._python_dispatch", "TorchDispatchMode", "veomni.plan counts collectives"),
    ("torch.distributed.distributed_c10d", "_resolve_process_group", "veomni.plan: functional collectives' groups"),
    ("torch.distributed.tensor", "DTensor._op_dispatcher", "veomni.plan clears sharding caches between worlds"),
    ("torch.distributed.fsdp", "FSDPModule._get_fsdp_state", "veomni.plan reads FSDP2's padded shards"),
    ("torch._C", "_current_graph_task_id", "MoE metrics skip checkpoint recomputes"),
]


@functools.lru_cache(maxsize=None)
def _log_once(message: str) -> None:
    logger.info(message)


# ------------------------------------------------------------------------------------------- meshes
def flatten_mesh(mesh: DeviceMesh, name: str) -> DeviceMesh:
    """`mesh._flatten(name)`: one 1-D mesh over several named dims (FSDP's dp_shard x ulysses, the dp group).
    torch has no public way to merge mesh dims; if `_flatten` moves, every multi-dim layout fails to build."""
    return mesh._flatten(name)


def unflatten_mesh(mesh: DeviceMesh, dim, sizes: Sequence[int], names: Sequence[str]) -> DeviceMesh:
    """`mesh._unflatten(dim, sizes, names)`: split one mesh dim into several named ones (the world into the dense
    layout plus the ep / ep_fsdp view). Present since torch 2.10 (pytorch#161224); torch has no public equivalent."""
    method = getattr(mesh, "_unflatten", None)
    if method is None:
        raise RuntimeError(
            f"torch {torch.__version__} has no DeviceMesh._unflatten (added in torch 2.10; veomni needs torch >= "
            "2.11): upgrade torch"
        )
    return method(dim, tuple(sizes), tuple(names))


# ------------------------------------------------------------------------------------------- DTensor
def is_strided_shard(placement) -> bool:
    """Whether a placement is torch's private `_StridedShard` (two shardings of one dim: FSDP over EP experts),
    for which summing local norms per mesh dim is wrong. Compared by class name, as before: a rename would send
    those gradients down the per-dim path silently, so the canary imports the class."""
    return type(placement).__name__ == "_StridedShard"


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard without an autograd node (`_local_tensor`; `to_local()` records one under grad
    mode), the same storage, so in-place updates (Muon, CPU offload) reach the parameter. Plain tensors pass."""
    return t._local_tensor if isinstance(t, DTensor) else t


class ColwiseParallelPassingPlainOutputs(ColwiseParallel):
    """ColwiseParallel whose output hook lets a plain (non-DTensor) output through untouched.

    torch's output hook is the private static `_prepare_output_fn`, the only place to intercept the output; the
    chunked loss replaces the head's output by a plain, already-reduced loss. If torch renames the hook, this
    override is ignored and that loss would be wrapped as a DTensor (the canary catches it)."""

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        if not isinstance(outputs, DTensor):
            return outputs
        return ColwiseParallel._prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh)


# ------------------------------------------------------------------------------------------- kernels
def fused_kernel_devices() -> List[str]:
    """Device types with torch's fused optimizer kernels (`torch.utils._foreach_utils`, private). If it moves,
    AdamW runs `foreach` (slower, same numerics) and this is logged once."""
    try:
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices
    except ImportError:
        _log_once(f"torch {torch.__version__}: no fused-kernel device list; AdamW runs foreach (slower)")
        return []
    return list(_get_fused_kernels_supported_devices())


def foreach_norm(tensors: List[torch.Tensor], norm_type: float, dtype: torch.dtype) -> List[torch.Tensor]:
    """`torch._foreach_norm`: one kernel for every gradient's norm on CUDA (the CPU path needs none of it)."""
    return torch._foreach_norm(tensors, norm_type, dtype=dtype)


def foreach_mul_(tensors: List[torch.Tensor], scalar) -> None:
    """`torch._foreach_mul_`: scale every gradient in one kernel (clipping); `scalar` a float or a 0-dim tensor."""
    torch._foreach_mul_(tensors, scalar)


_GROUPED_MM: Optional[Callable] = getattr(torch, "_grouped_mm", None)


def grouped_mm_available(x: torch.Tensor) -> bool:
    """Whether the MoE experts can use `torch._grouped_mm` for `x` (CUDA bf16, where torch has the kernel). The
    first CUDA bf16 call logs which path the experts take: without the kernel they run per-expert matmuls
    (same numerics, slower)."""
    if not (x.is_cuda and x.dtype == torch.bfloat16):
        return False
    if _GROUPED_MM is None:
        _log_once(f"torch {torch.__version__} has no torch._grouped_mm: MoE experts run per-expert matmuls")
    else:
        _log_once("MoE experts: torch._grouped_mm (CUDA bf16)")
    return _GROUPED_MM is not None


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """`torch._grouped_mm(a, b, offs=offs)`: rows of `a` grouped by expert (`offs` = cumulative counts)."""
    return _GROUPED_MM(a, b, offs=offs)


# ------------------------------------------------------------------------------------------- nn / optim internals
def parameter_slots(module: nn.Module) -> Dict[str, Optional[nn.Parameter]]:
    """`module._parameters`: the module's own parameter dict, written in place (meta-device init, re-tying shared
    parameters). `named_parameters()` cannot replace a parameter object; `register_parameter` re-runs checks."""
    return module._parameters


def reset_optimizer_step_hooks(optimizer: torch.optim.Optimizer) -> None:
    """An Optimizer subclass that does not call `Optimizer.__init__` (MultiOptimizer) must still own the two hook
    dicts torch's `step` wrapper reads (`_optimizer_step_pre_hooks` / `_post_hooks`), or every step fails."""
    optimizer._optimizer_step_pre_hooks, optimizer._optimizer_step_post_hooks = {}, {}


def skips_on_found_inf(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer.step()` skips its whole update (parameters, moments, step count) on the device when its
    `found_inf` tensor is 1, as GradScaler uses it: torch's fused Adam/AdamW/SGD (`_step_supports_amp_scaling`)."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


def set_found_inf(optimizer: torch.optim.Optimizer, found_inf: Optional[torch.Tensor]) -> None:
    """The 0-dim float32 flag the fused kernels read on the device (`Adam.step` passes `self.found_inf` to them)."""
    optimizer.found_inf = found_inf


def unhooked_step(optimizer_class: type) -> Callable:
    """`optimizer_class.step` without torch's hook wrapper (`Optimizer.profile_hook_step`, marked `hooked` and put on
    the class by the first instance's `__init__`): a subclass's `step` that calls its parent's would otherwise run
    every step pre/post hook twice. The wrapper keeps the wrapped function as `__wrapped__` (functools.wraps)."""
    step = optimizer_class.step
    while getattr(step, "hooked", False):
        step = step.__wrapped__
    return step


# ------------------------------------------------------------------------------------------- DCP metadata
# Private names torch's FileSystemWriter pickles into `.metadata` (torch 2.11-2.14), allowed by the safe reader
DCP_PRIVATE_PICKLED = frozenset(
    {
        ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),  # an Enum of plain ints
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch.serialization", "_get_layout"),  # looks a torch.layout up by its name, nothing else
    }
)


@contextlib.contextmanager
def open_dcp_metadata(reader, rank: Optional[int]) -> Iterator[Tuple[object, str]]:
    """(binary stream, path) of a FileSystemReader's `.metadata`, located as its own `read_metadata` does (the
    private `_get_metadata_path`), for the allow-list unpickler that replaces torch's `pickle.load`."""
    path = reader._get_metadata_path(rank)
    with reader.fs.create_stream(path, "rb") as stream:
        yield stream, str(path)


def finish_dcp_metadata(reader, metadata) -> None:
    """What torch's `FileSystemReader.read_metadata` does after unpickling (torch 2.11-2.14): a `StorageMeta` with
    this load's id. Without it DCP's load planner misses `storage_meta.load_id`."""
    from torch.distributed.checkpoint.metadata import StorageMeta

    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = StorageMeta()
    metadata.storage_meta.load_id = reader.load_id


# ------------------------------------------------------------------------- planning on a fake world (veomni.plan)
def init_fake_process_group(rank: int, world_size: int) -> None:
    """A process group of `world_size` ranks that exist only on paper: torch's "fake" backend (collectives return
    at once and move nothing), so the meshes and plans of a 512-rank layout build in one process. `FakeStore` and
    the backend's registration live in torch.testing._internal."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)


def clear_dtensor_sharding_caches() -> None:
    """DTensor caches each op's output sharding keyed by meshes that compare equal across fake worlds (same shape
    and ranks), holding the mesh object: the next world's DTensors would carry a destroyed world's meshes."""
    propagator = DTensor._op_dispatcher.sharding_propagator
    propagator.propagate_op_sharding.cache_clear()
    propagator._propagate_tensor_meta_cached.cache_clear()
    clear_native = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)  # the C++ fast path's copy
    if clear_native is not None:
        clear_native()


def op_schema(func):
    """An aten/c10d overload's schema (argument names and the op's qualified name), for counting collectives."""
    return func._schema


def resolve_process_group(group_name: str):
    """The ProcessGroup a functional collective names by string."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group_name)


def fsdp_param_group(module: nn.Module):
    """FSDP2's parameter group of a `fully_shard`ed module (its padded flat shards), or None."""
    return module._get_fsdp_state()._fsdp_param_group


# DTensor's redistribute logger (warns once per redistribution of meta tensors while planning)
DTENSOR_REDISTRIBUTE_LOGGER = "torch.distributed.tensor._redistribute"


def in_backward() -> bool:
    """True while autograd runs a backward pass (where activation checkpointing recomputes a layer's forward)."""
    task_id = getattr(torch._C, "_current_graph_task_id", None)
    return task_id is not None and task_id() != -1
