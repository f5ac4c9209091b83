"""CUDA only when every local rank has a GPU of its own; otherwise CPU/gloo (a 2-rank test on a 1-GPU machine
used to die with `invalid device ordinal`). Device counts are faked, so this runs on any machine."""

import socket

import pytest
import torch

from veomni.utils import device


@pytest.fixture
def gpus(monkeypatch):
    """Pretend this machine has `n` GPUs (on CPU-only torch, any real CUDA call would still fail loudly)."""

    def set_count(n: int):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)

    return set_count


@pytest.mark.parametrize(
    "local_world_size,cuda_count,expected",
    [(1, 0, "cpu"), (2, 0, "cpu"), (1, 1, "cuda"), (2, 1, "cpu"), (2, 2, "cuda"), (4, 8, "cuda"), (8, 4, "cpu")],
)
def test_select_device_type(local_world_size, cuda_count, expected):
    assert device.select_device_type(local_world_size, cuda_count) == expected


@pytest.mark.parametrize("local_world_size,count,backend", [("2", 1, "gloo"), ("2", 2, "nccl"), ("1", 1, "nccl")])
def test_backend_and_device_follow_the_decision(monkeypatch, gpus, local_world_size, count, backend):
    gpus(count)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", local_world_size)
    monkeypatch.setenv("LOCAL_RANK", "1" if local_world_size == "2" else "0")
    assert device.get_dist_backend() == backend
    expected = torch.device("cpu") if backend == "gloo" else torch.device("cuda", int(local_world_size) - 1)
    assert device.get_device() == expected


def test_force_cpu(monkeypatch, gpus):
    gpus(8)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert device.get_device_type() == "cuda"
    monkeypatch.setenv(device.FORCE_ENV, "cpu")
    assert device.get_device_type() == "cpu" and device.get_dist_backend() == "gloo"


def test_parallel_state_on_two_local_ranks_and_one_gpu_uses_gloo(monkeypatch, gpus):
    """init_parallel_state as rank 0 of 2 local ranks on a 1-GPU machine: gloo, CPU meshes, no CUDA call."""
    import torch.distributed as dist

    from veomni.distributed.parallel_state import destroy_parallel_state, init_parallel_state

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    gpus(1)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1")
    for key, value in dict(env, MASTER_PORT=str(port)).items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(torch.cuda, "set_device", lambda *_: pytest.fail("set_device called: not a fallback"))
    state = init_parallel_state()
    try:
        assert dist.get_backend() == "gloo"
        assert state.device_mesh.device_type == "cpu"
    finally:
        destroy_parallel_state()
