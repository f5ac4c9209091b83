"""Checkpoint folders on 2 real ranks: saving never relies on another rank's mkdir, and a folder that is not
shared between ranks (per-node disks) fails at the save with a clear message on every rank."""

import os

from helpers import REPO, torchrun


def test_save_with_folders_from_rank1_and_refusal_on_per_node_disks(tmp_path):
    proc = torchrun(os.path.join(REPO, "tests", "dist", "check_checkpoint_storage.py"), [str(tmp_path)], 2)
    assert proc.stdout.count("SHARED_SAVE_OK") == 2
    assert "PER_NODE_SAVED" not in proc.stdout
    refused = [line for line in proc.stdout.splitlines() if line.startswith("PER_NODE_REFUSED")]
    assert len(refused) == 2, proc.stdout
    for line in refused:
        assert "is not shared: rank 1" in line and "train.checkpoint.output_dir" in line
    assert not os.path.exists(tmp_path / "node1" / "checkpoints" / "global_step_1")  # nothing half-published
