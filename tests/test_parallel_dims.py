"""ParallelDims: every layout the other tests run (and a 512-rank one) built through it on a fake process group,
each sub-mesh checked against the rank grid computed here by hand."""

import os
import subprocess
import sys

import numpy as np
import pytest

from veomni.distributed.parallel_dims import ParallelDims

# (world size, sizes as the config gives them): the layouts of the parity tests, plus larger ones
LAYOUTS = [
    (1, {}),
    (2, {}),  # FSDP2 / DDP over 2
    (4, {"dp_replicate_size": 2}),  # HSDP 2 x 2
    (2, {"ulysses_size": 2}),
    (4, {"ulysses_size": 2}),  # dp 2 x sp 2
    (8, {"dp_replicate_size": 2, "ulysses_size": 2}),
    (2, {"tp_size": 2}),
    (4, {"tp_size": 2}),  # dp 2 x tp 2
    (8, {"dp_replicate_size": 2, "tp_size": 2}),
    (2, {"extra_parallel_names": ["ep"], "extra_parallel_sizes": [2]}),
    (4, {"extra_parallel_names": ["ep"], "extra_parallel_sizes": [2]}),  # ep 2 x ep_fsdp 2
    (4, {"extra_parallel_names": ["ep"], "extra_parallel_sizes": [2], "extra_parallel_placement_innermost": [False]}),
    (2, {"ulysses_size": 2, "extra_parallel_names": ["ep"], "extra_parallel_sizes": [2]}),
    (512, {"dp_replicate_size": 4, "ulysses_size": 2, "extra_parallel_names": ["ep"], "extra_parallel_sizes": [8]}),
]


def _expected_groups(dims: ParallelDims, rank: int) -> dict:
    grid = np.arange(dims.world_size).reshape(dims.dp_replicate, dims.dp_shard, dims.ulysses, dims.tp)
    r, s, u, t = (int(i) for i in np.argwhere(grid == rank)[0])
    groups = {
        "dp_replicate": grid[:, s, u, t],
        "dp_shard": grid[r, :, u, t],
        "ulysses": grid[r, s, :, t],
        "tp": grid[r, s, u, :],
        "dp": grid[:, :, u, t].ravel(),
        "dp_shard_sp": grid[r, :, :, t].ravel(),
        "dp_sp": grid[:, :, :, t].ravel(),
        "sp": grid[r, s, :, t],  # VeOmni's name of the ulysses group
    }
    fsdp = grid[:, :, :, t].reshape(dims.dp_replicate, dims.fsdp)  # HSDP: replicate x (shard x ulysses)
    groups["fsdp"] = fsdp if dims.dp_replicate > 1 else fsdp.ravel()
    for extra in dims.extras:
        world = np.arange(dims.world_size)
        if extra.innermost:  # consecutive ranks
            groups[extra.name] = world.reshape(-1, extra.size)[rank // extra.size]
        else:
            outer = dims.world_size // extra.size
            groups[extra.name] = world.reshape(extra.size, outer)[:, rank % outer]
    return {name: ranks.tolist() for name, ranks in groups.items()}


def _built_groups(state) -> dict:
    dense = state.device_mesh
    groups = {name: dense[name].mesh.tolist() for name in ("dp_replicate", "dp_shard", "ulysses", "tp")}
    groups.update({name: mesh.mesh.tolist() for name, mesh in state.flat_meshes.items()})
    # every flattened view is reachable by name on the dense (root) mesh too, as VeOmni's clients read it
    assert all(dense[name].mesh.tolist() == groups[name] for name in state.flat_meshes)
    groups.update({name: mesh[name].mesh.tolist() for name, mesh in state.extra_meshes.items()})
    groups["fsdp"] = state.fsdp_mesh.mesh.tolist()
    return groups


def check_all_layouts() -> None:
    """Run in a process of its own: the fake process group stands in for each world size in turn."""
    import torch.distributed as dist

    from veomni.compat import init_fake_process_group
    from veomni.distributed.parallel_state import ParallelState

    for world, sizes in LAYOUTS:
        for rank in sorted({0, world // 2, world - 1}):
            init_fake_process_group(rank, world)
            dims = ParallelDims.resolve(world, **sizes)
            state = ParallelState.from_dims(dims)
            assert _built_groups(state) == _expected_groups(dims, rank), (world, sizes, rank)
            assert state.fsdp_size == dims.fsdp and state.fsdp_mesh.size() == dims.fsdp * dims.dp_replicate
            assert state.dp_sp_size == dims.dp_sp == world // dims.tp
            # get_mesh: the same meshes by name (a dense dim, a tuple of them, a flattened view, an extra dim)
            assert state.get_mesh("dp_sp").size() == dims.dp_sp and state.get_mesh("tp").size() == dims.tp
            assert state.get_mesh(("dp_shard", "ulysses")).size() == dims.fsdp
            assert state.get_mesh("ep").size() == dims.ep if dims.ep > 1 else "ep" not in state.extra_meshes
            assert state.get_mesh("fsdp") is state.fsdp_mesh and state.get_mesh("world").size() == world
            dist.destroy_process_group()
    print(f"LAYOUTS_OK {len(LAYOUTS)}")
    check_collator_needs_sequence_parallel_sizes()


def check_collator_needs_sequence_parallel_sizes() -> None:
    """Under Ulysses a collator must be told its rank's slice; one left to guess refuses (it used to pack whole
    rows silently when it could not see the parallel state)."""
    import torch.distributed as dist

    from veomni.compat import init_fake_process_group
    from veomni.data.data_collator import MainCollator
    from veomni.data.data_loader import _with_sequence_parallel
    from veomni.distributed.parallel_state import destroy_parallel_state, init_parallel_state

    init_fake_process_group(1, 2)
    init_parallel_state(ulysses_size=2)
    try:
        MainCollator()
    except ValueError as error:
        assert "ulysses_size=2" in str(error) and "sp_rank" in str(error), error
    else:
        raise AssertionError("MainCollator without sp_size under sequence parallel did not refuse")
    assert MainCollator(**_with_sequence_parallel({})).sp_rank == 1  # build_dataloader's default: the state's
    destroy_parallel_state()
    if dist.is_initialized():
        dist.destroy_process_group()
    assert MainCollator().sp_size == 1  # no parallel state: no sequence parallel
    print("COLLATOR_OK")


def test_every_layout_builds_the_sub_meshes_of_its_rank_grid_and_the_collator_is_told_its_slice():
    proc = subprocess.run([sys.executable, os.path.abspath(__file__)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"LAYOUTS_OK {len(LAYOUTS)}" in proc.stdout and "COLLATOR_OK" in proc.stdout


@pytest.mark.parametrize(
    "world,sizes,expected",
    [
        (8, {"tp_size": 2, "dp_replicate_size": 2}, (2, 2, 1, 2)),
        (8, {"ulysses_size": 4}, (1, 2, 4, 1)),
        (8, {"dp_shard_size": 2, "ulysses_size": 2}, (2, 2, 2, 1)),
        (6, {"dp_size": 3, "tp_size": 2}, (1, 3, 1, 2)),
    ],
)
def test_degrees(world, sizes, expected):
    dims = ParallelDims.resolve(world, **sizes)
    assert (dims.dp_replicate, dims.dp_shard, dims.ulysses, dims.tp) == expected


def test_outside_torchrun_the_smallest_world_the_sizes_fit():
    assert ParallelDims.resolve(None).world_size == 1
    assert ParallelDims.resolve(None, tp_size=2, dp_replicate_size=2).world_size == 4
    dims = ParallelDims.resolve(None, extra_parallel_names=["ep"], extra_parallel_sizes=[2])
    assert (dims.world_size, dims.dp, dims.ep) == (2, 2, 2)


@pytest.mark.parametrize(
    "world,sizes,message",
    [
        (4, {"ulysses_size": 3}, "do not multiply to the world size"),
        (4, {"dp_replicate_size": 3}, r"dp_replicate_size \* dp_shard_size"),
        (4, {"extra_parallel_names": ["ep"], "extra_parallel_sizes": [3]}, "'ep' size 3 does not divide"),
        (4, {"extra_parallel_names": ["ep", "x"], "extra_parallel_sizes": [2]}, "differ in length"),
        (4, {"tp_size": 0}, "tp_size must be at least 1"),
    ],
)
def test_bad_sizes_name_the_keys(world, sizes, message):
    with pytest.raises(ValueError, match=message):
        ParallelDims.resolve(world, **sizes)


if __name__ == "__main__":
    check_all_layouts()
