"""Parallel state: meshes on 2 gloo ranks, and clear failures for sizes that cannot work."""

import os

import pytest

from helpers import REPO, torchrun
from veomni.distributed.parallel_state import _check_sizes


def test_meshes_and_groups_on_two_ranks():
    proc = torchrun(os.path.join(REPO, "tests", "dist", "check_parallel_state.py"), [], 2)
    assert proc.stdout.count("PARALLEL_STATE_OK") == 2


def test_inconsistent_sizes_show_the_arithmetic():
    with pytest.raises(
        ValueError,
        match=r"dp_size \* ulysses_size \* tp_size \* pp_size \* cp_size = 2 \* 2 \* 1 \* 1 \* 1 = 4, "
        r"but world_size = 2",
    ):
        _check_sizes(2, 2, -1, -1, 1, 1, 1, 2)
    with pytest.raises(ValueError, match=r"dp_replicate_size \* dp_shard_size = 2 \* 2 = 4, but dp_size = 2"):
        _check_sizes(2, 2, 2, 2, 1, 1, 1, 1)
    assert _check_sizes(4, -1, 2, -1, 1, 1, 1, 1) == (4, 2, 2)
    assert _check_sizes(4, -1, -1, -1, 1, 1, 1, 2) == (2, 1, 2)
    assert _check_sizes(4, -1, -1, -1, 2, 1, 1, 1) == (2, 1, 2)  # tp takes its share of the world first


@pytest.mark.parametrize("name,index", [("pp_size", 5), ("cp_size", 6)])
def test_unimplemented_parallelism_fails_loudly(name, index):
    sizes = [2, -1, -1, -1, 1, 1, 1, 1]
    sizes[index] = 2
    with pytest.raises(NotImplementedError, match=f"{name}=2 is not supported yet"):
        _check_sizes(*sizes)
