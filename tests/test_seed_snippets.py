"""The seed's snippets run unchanged against the package: pretraining and SFT, 1 and 2 ranks."""

import json
import os
import re

import pytest
import yaml

from helpers import REPO, tiny_run_config, torchrun


def _sft_data(path, n=40):
    with open(path, "w") as f:
        for i in range(n):
            conv = [
                {"role": "user", "content": "the quick brown fox " * (1 + i % 3)},
                {"role": "assistant", "content": "jumps over the lazy dog " * (1 + i % 4)},
            ]
            f.write(json.dumps({"messages": conv}) + "\n")
    return path


@pytest.mark.parametrize("nproc,kind", [(2, "pretrain"), (1, "sft")])
def test_seed_walkthrough(tmp_path, nproc, kind):
    config = tiny_run_config(str(tmp_path), max_steps=3)
    extra = ["--train.max_steps", "3"]
    if kind == "sft":
        cfg = yaml.safe_load(open(config))
        cfg["data"].update(
            train_path=_sft_data(str(tmp_path / "chat.jsonl")), data_type="conversation", chat_template="chatml"
        )
        yaml.safe_dump(cfg, open(config, "w"))
    proc = torchrun(os.path.join(REPO, "tests", "dist", "seed_walkthrough.py"), [config, *extra], nproc)
    assert proc.stdout.count("SEED_WALKTHROUGH_OK") == nproc  # ranks' lines may interleave: count, then parse one
    losses = [float(x) for x in re.search(r"SEED_WALKTHROUGH_OK \d+ \d+ \[([^\]]*)\]", proc.stdout)[1].split(",")]
    assert len(losses) == 3 and all(loss > 0 for loss in losses)
