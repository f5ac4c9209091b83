"""examples/slurm/train.sbatch maps Slurm's variables onto train.sh's (NNODES, NODE_RANK, MASTER_ADDR,
MASTER_PORT) and passes the task, config and overrides through. Run with stand-ins for srun, scontrol and python
that print what they are given: no Slurm, no torch, well under a second."""

import os
import stat
import subprocess

from helpers import REPO

FAKES = {
    # scontrol show hostnames NODELIST: one name per line, node 0 first
    "scontrol": 'printf "gpu-a\\ngpu-b\\n"\n',
    # srun OPTIONS... CMD: run CMD as node 1 would
    "srun": 'while [ "${1#--}" != "$1" ]; do shift; done\nexport SLURM_NODEID=1\nexec "$@"\n',
    # train.sh asks python for the GPU count (-c), then runs the launcher (-m veomni.launch ...)
    "python": 'if [ "$1" = "-c" ]; then echo 8; else echo "LAUNCH $* TIMEOUT=$TORCH_ELASTIC_SHUTDOWN_TIMEOUT"; fi\n',
}


def test_sbatch_launches_train_sh_on_each_node_with_its_rank(tmp_path):
    for name, body in FAKES.items():
        path = tmp_path / name
        path.write_text("#!/bin/bash\n" + body)
        path.chmod(path.stat().st_mode | stat.S_IEXEC)
    env = {
        "PATH": f"{tmp_path}:{os.environ['PATH']}",
        "PYTHON": str(tmp_path / "python"),
        "SLURM_SUBMIT_DIR": REPO,
        "SLURM_NNODES": "2",
        "SLURM_JOB_NODELIST": "gpu-[a-b]",
    }
    cmd = ["bash", "examples/slurm/train.sbatch", "tasks/train_text.py", "configs/text/qwen3_8b_sft.yaml"]
    proc = subprocess.run(
        cmd + ["--train.optimizer.lr", "2e-5"], cwd=REPO, env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == (
        "LAUNCH -m veomni.launch --nnodes=2 --node_rank=1 --nproc_per_node=8 --master_addr=gpu-a "
        "--master_port=29500 tasks/train_text.py configs/text/qwen3_8b_sft.yaml --train.optimizer.lr 2e-5 "
        "TIMEOUT=600"
    ), proc.stdout
