"""Private torch / transformers symbols the project needs, in one place (placeholder until the compat module lands)."""

from torch.distributed._composable.replicate import replicate  # noqa: F401
from torch.distributed.device_mesh import DeviceMesh


def flatten_mesh(mesh: DeviceMesh, name: str) -> DeviceMesh:
    return mesh._flatten(name)


def unflatten_mesh(mesh: DeviceMesh, dim, sizes, names) -> DeviceMesh:
    return mesh._unflatten(dim, tuple(sizes), tuple(names))


def init_fake_process_group(rank: int, world_size: int) -> None:
    """A process group of `world_size` ranks that exist only on paper (torch's fake backend: collectives return at
    once without moving data), for building the meshes and plans of a large layout in one process."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
