"""Under torchrun (2 ranks): a save works when a non-zero rank created the folders, and a checkpoint folder that
is not shared between ranks (per-node disks, simulated by a different folder per rank) fails on every rank with
a message that names it, instead of leaving unpublished shards behind."""

import os
import sys

import torch
import torch.distributed as dist
from torch import nn

from veomni.checkpoint import Checkpointer, resolve_checkpoint
from veomni.distributed.parallel_state import destroy_parallel_state, init_parallel_state

init_parallel_state(mode="fsdp2")
rank, base = dist.get_rank(), sys.argv[1]


def say(line: str) -> None:
    """One write per line (print writes the text and its newline apart: two ranks' lines could run together)."""
    os.write(1, (line + "\n").encode())


def model_and_optimizer():
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    return model, torch.optim.AdamW(model.parameters())


# 1. shared folder, created by rank 1 only: the save and a resume work, every rank's state is there
shared = os.path.join(base, "shared")
if rank == 1:
    os.makedirs(os.path.join(shared, "checkpoints"))
dist.barrier()
model, opt = model_and_optimizer()
Checkpointer(shared).save(1, model, opt, {"rank": torch.tensor(rank)}, {})
loaded = Checkpointer(shared).load(resolve_checkpoint("auto", shared), *model_and_optimizer())
assert [int(e["rank"]) for e in loaded["extra_states"]] == [0, 1]
say(f"SHARED_SAVE_OK {rank}")

# 2. "per-node disks": each rank writes a folder of its own under the same name
ckpt = Checkpointer(os.path.join(base, f"node{rank}"))
ckpt.storage_patience_s = 0.5
try:
    ckpt.save(1, *model_and_optimizer(), {}, {})
    say(f"PER_NODE_SAVED {rank}")
except RuntimeError as err:
    say(f"PER_NODE_REFUSED {rank} {err}".replace("\n", " "))
destroy_parallel_state()
