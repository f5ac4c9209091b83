"""Parallel state: meshes on 2 gloo ranks, and clear failures for sizes that cannot work."""

import os

import pytest

from helpers import REPO, torchrun
from veomni.distributed.parallel_dims import ParallelDims


def test_meshes_and_groups_on_two_ranks():
    proc = torchrun(os.path.join(REPO, "tests", "dist", "check_parallel_state.py"), [], 2)
    assert proc.stdout.count("PARALLEL_STATE_OK") == 2


def test_inconsistent_sizes_show_the_arithmetic():
    with pytest.raises(
        ValueError,
        match=r"dp_size \* ulysses_size \* tp_size \* pp_size \* cp_size = 2 \* 2 \* 1 \* 1 \* 1 = 4, "
        r"but world_size = 2",
    ):
        ParallelDims.resolve(2, dp_size=2, ulysses_size=2)
    with pytest.raises(ValueError, match=r"dp_replicate_size \* dp_shard_size = 2 \* 2 = 4, but dp_size = 2"):
        ParallelDims.resolve(2, dp_size=2, dp_replicate_size=2, dp_shard_size=2)
    dims = ParallelDims.resolve(4, dp_replicate_size=2)
    assert (dims.dp, dims.dp_replicate, dims.dp_shard) == (4, 2, 2)
    dims = ParallelDims.resolve(4, ulysses_size=2)
    assert (dims.dp, dims.dp_replicate, dims.dp_shard, dims.fsdp) == (2, 1, 2, 4)
    dims = ParallelDims.resolve(4, tp_size=2)  # tp takes its share of the world first
    assert (dims.dp, dims.dp_replicate, dims.dp_shard) == (2, 1, 2)


@pytest.mark.parametrize("name", ["pp_size", "cp_size"])
def test_unimplemented_parallelism_fails_loudly(name):
    with pytest.raises(NotImplementedError, match=f"{name}=2 is not supported yet"):
        ParallelDims.resolve(2, **{name: 2})
