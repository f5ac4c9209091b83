"""The real parallel plan of a config on a fake world: the model built on `meta` exactly as the trainer builds it,
then sharded by `build_parallelize_model` (Ulysses, TP, EP, FSDP2/HSDP) for rank r of W, and read back.

The fake world is torch's "fake" process group, whose collectives return at once and move nothing, so meshes,
FSDP2, TP and EP plans can be built for rank r of W without W processes or a network. The fake backend and
DTensor's caches are private torch APIs, reached through veomni.compat.torch.
"""

import copy
import os
from contextlib import contextmanager
from typing import Dict, Iterator, List, Optional

import torch.distributed as dist

from ..arguments import VeOmniArguments, parse_args
from ..compat.torch import clear_dtensor_sharding_caches, init_fake_process_group
from ..distributed.mixed_precision import resolve_precision
from ..distributed.parallel_state import destroy_parallel_state, init_parallel_state_from_config
from ..distributed.torch_parallelize import parallelize
from ..models.auto import build_config
from ..trainer.base import build_model_from_args
from ..utils.device import FORCE_ENV
from .analytic import Layout
from .comm import StepShape
from .model_shape import ModelShape
from .shards import RankPlan, read_rank_plan


def _set_environ(values: Dict[str, Optional[str]]) -> None:
    for key, value in values.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@contextmanager
def _environ(values: Dict[str, Optional[str]]) -> Iterator[None]:
    """Within the block the environment holds `values` (None: unset); what it held before is restored after."""
    saved = {key: os.environ.get(key) for key in values}
    _set_environ(values)
    try:
        yield
    finally:
        _set_environ(saved)


@contextmanager
def fake_world(world_size: int, rank: int = 0) -> Iterator[None]:
    """Within the block this process is rank `rank` of a fake world of `world_size`; meshes are built on CPU
    (the planner decides GPU dtypes itself), so no device is touched. Refused inside a real process group."""
    if dist.is_initialized():
        raise RuntimeError("fake_world inside an initialised process group: plan in a process of its own")
    with _environ({FORCE_ENV: "cpu", "RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": "0"}):
        init_fake_process_group(rank, world_size)
        try:
            yield
        finally:
            clear_dtensor_sharding_caches()
            destroy_parallel_state()  # forgets the meshes and destroys the fake group
            if dist.is_initialized():
                dist.destroy_process_group()


def load_args(argv: List[str], world_size: Optional[int]) -> VeOmniArguments:
    """`CONFIG.yaml --key value ...` parsed as a run on `world_size` ranks would parse it (None: as outside
    torchrun, for the smallest world its sizes fit)."""
    with _environ({"WORLD_SIZE": None if world_size is None else str(world_size)}):  # parse_args resolves dp sizes
        return parse_args(VeOmniArguments, list(argv))


def reshard_after_forward(args, fsdp_size: int) -> bool:
    """What build_parallelize_model decides: resharded unless full_shard is off, or unset over a single rank."""
    fsdp = args.train.accelerator.fsdp_config
    reshard = fsdp.reshard_after_forward if fsdp.reshard_after_forward is not None else fsdp_size > 1
    return bool(reshard and fsdp.full_shard)


def plan_rank(args, world_size: int, rank: int = 0, device_type: str = "cuda") -> RankPlan:
    """Rank `rank`'s share under the real plan of `args` on a fake world of `world_size`: the meta model, built as
    the trainer builds it (in its parameters' dtype on `device_type`), then sharded."""
    if args.train.accelerator.fsdp_config.fsdp_mode != "fsdp2":
        raise ValueError("the planner plans fsdp_mode=fsdp2 runs (DDP keeps a full replica: param bytes x world)")
    planned = copy.deepcopy(args)  # the shards' shapes are all it reads: no compile, no offload, nothing allocated
    planned.train.init_device, planned.model.ops_implementation.compile = "meta", False
    planned.train.accelerator.fsdp_config.offload = False
    with fake_world(world_size, rank):
        state = init_parallel_state_from_config(args.train.accelerator)
        model = parallelize(build_model_from_args(args, device_type, "meta"), state, planned, materialize=False)
        return read_rank_plan(model, state, args.train.optimizer.type, reshard_after_forward(args, state.fsdp_size))


def model_shape(args) -> ModelShape:
    return ModelShape.from_config(build_config(args.model.config_path, args.model.trust_remote_code))


def dtype_bytes(args, device_type: str):
    """(compute, gradient-reduce, parameter) bytes per element under the run's precision on `device_type`."""
    fsdp = args.train.accelerator.fsdp_config
    precision = resolve_precision(fsdp.mixed_precision, device_type, fsdp.fsdp_mode)
    param = precision.param_dtype.itemsize
    if precision.policy is None:
        return param, param, param
    compute = precision.policy.param_dtype.itemsize if precision.policy.param_dtype is not None else param
    reduce = precision.policy.reduce_dtype.itemsize if precision.policy.reduce_dtype is not None else compute
    return compute, reduce, param


def step_shape(args, micro_batches, device_type: str):
    """The StepShape of `args` for micro-batches given as (local tokens, loss tokens)."""
    acc = args.train.accelerator
    compute, reduce, _ = dtype_bytes(args, device_type)
    ep = dict(zip(acc.extra_parallel_names, acc.extra_parallel_sizes)).get("ep", 1)
    return StepShape(
        micro_batches=tuple((int(t), int(n)) for t, n in micro_batches),
        compute_bytes=compute,
        reduce_bytes=reduce,
        checkpointing=args.train.gradient_checkpointing.enable,
        loss_chunk=args.model.ops_implementation.loss_chunk_size,
        tp=acc.tp_size,
        sp=acc.ulysses_size,
        ep=ep,
        moe_metric_values=model_shape(args).moe_metric_values,
    )


def args_for_layout(args, layout):
    """A copy of `args` set to `layout`'s parallel sizes and checkpointing (batch sizes left as they are)."""
    args = copy.deepcopy(args)
    acc = args.train.accelerator
    acc.dp_size, acc.dp_replicate_size, acc.dp_shard_size = layout.dims.dp, layout.dp_replicate, layout.dp_shard
    acc.tp_size, acc.ulysses_size = layout.tp, layout.ulysses
    names = [n for n in acc.extra_parallel_names if n != "ep"]
    sizes = [s for n, s in zip(acc.extra_parallel_names, acc.extra_parallel_sizes) if n != "ep"]
    if layout.ep > 1:
        names, sizes = names + ["ep"], sizes + [layout.ep]
    acc.extra_parallel_names, acc.extra_parallel_sizes = names, sizes
    args.train.gradient_checkpointing.enable = layout.checkpointing
    return args


def layout_of(args, world_size: int):
    """The Layout `args` describes on `world_size` ranks (parse_args resolved its -1 sizes)."""
    acc, data, train = args.train.accelerator, args.data, args.train
    ep = dict(zip(acc.extra_parallel_names, acc.extra_parallel_sizes)).get("ep", 1)
    tokens = train.micro_batch_size * data.max_seq_len  # dyn_bsz: the token budget; else samples of up to max_seq_len
    return Layout(
        world=world_size,
        dp_replicate=acc.dp_replicate_size,
        dp_shard=acc.dp_shard_size,
        ulysses=acc.ulysses_size,
        tp=acc.tp_size,
        ep=ep,
        checkpointing=train.gradient_checkpointing.enable,
        mb_tokens=tokens,
    )
