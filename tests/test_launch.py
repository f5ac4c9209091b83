"""train.sh's rendezvous settings (with a stand-in python that prints the torchrun command instead of running
it) and the install metadata."""

import os
import re
import subprocess
import tomllib

import pytest

from helpers import REPO

FAKE_PYTHON = """#!/usr/bin/env bash
if [ "$1" = "-c" ]; then echo 0; exit 0; fi   # the GPU count query: a CPU-only machine
echo "$@"
"""


def _launch(tmp_path, **env):
    fake = tmp_path / "python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    config = tmp_path / "config.yaml"
    config.write_text("train: {}\n")
    full = {k: v for k, v in os.environ.items() if k not in ("NNODES", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK")}
    full.update(PYTHON=str(fake), **env)
    return subprocess.run(
        ["bash", os.path.join(REPO, "train.sh"), "tasks/train_text.py", str(config)],
        cwd=REPO,
        env=full,
        capture_output=True,
        text=True,
        timeout=60,
    )


def _port(proc) -> int:
    assert proc.returncode == 0, proc.stderr
    return int(re.search(r"--master_port=(\d+)", proc.stdout)[1])


def test_multi_node_uses_one_fixed_port(tmp_path):
    ports = {_port(_launch(tmp_path, NNODES="2", NODE_RANK=str(r), MASTER_ADDR="10.0.0.1")) for r in (0, 1)}
    assert ports == {29500}, "every node must dial the same port"


def test_single_node_port_is_random_and_override_wins(tmp_path):
    ports = {_port(_launch(tmp_path)) for _ in range(4)}
    assert all(20000 <= p < 40000 for p in ports) and len(ports) > 1
    assert _port(_launch(tmp_path, NNODES="2", NODE_RANK="0", MASTER_ADDR="10.0.0.1", MASTER_PORT="31234")) == 31234


def test_multi_node_without_master_addr_or_node_rank_says_so(tmp_path):
    proc = _launch(tmp_path, NNODES="2", NODE_RANK="1")
    assert proc.returncode == 2 and "MASTER_ADDR" in proc.stderr
    proc = _launch(tmp_path, NNODES="2", MASTER_ADDR="10.0.0.1")  # every node would claim node rank 0
    assert proc.returncode == 2 and "NODE_RANK" in proc.stderr


def test_torch_is_a_range_not_a_pin():
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        deps = tomllib.load(f)["project"]["dependencies"]
    torch_dep = next(d for d in deps if re.match(r"torch\b", d) and not d.startswith("torchdata"))
    assert "==" not in torch_dep and ">=2.11" in torch_dep


@pytest.mark.parametrize("nnodes", ["1", "2"])
def test_node_count_reaches_torchrun(tmp_path, nnodes):
    proc = _launch(tmp_path, NNODES=nnodes, NODE_RANK="0", MASTER_ADDR="10.0.0.1")
    assert f"--nnodes={nnodes}" in proc.stdout
