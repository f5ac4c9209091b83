"""Under torchrun (2 ranks): rank 0's file work before a collective fails alone (the checkpoint root is a file it
cannot create folders in); every rank must raise at once, not wait in a barrier. argv: MODE OUT."""

import os
import sys

import torch
from torch import nn

from veomni.checkpoint import Checkpointer
from veomni.distributed import destroy_parallel_state, init_parallel_state


def main(mode: str, out: str) -> None:
    state = init_parallel_state(dist_timeout_minutes=10)  # a hang would outlast the test's own timeout
    assert mode == "rank0_fails"
    root = os.path.join(out, "run")
    if state.dp_rank == 0:
        os.makedirs(root, exist_ok=True)
        open(os.path.join(root, "checkpoints"), "w").write("a file where the folder would go\n")
    model = nn.Linear(4, 4)
    try:
        Checkpointer(root).save(1, model, torch.optim.AdamW(model.parameters()), {}, {})
    except Exception as err:  # noqa: BLE001 - any error will do, as long as every rank gets it at once
        print(f"RANK_SAW_THE_ERROR {state.dp_rank} {type(err).__name__}: {str(err)[:200]}", flush=True)
        raise
    finally:
        destroy_parallel_state()


if __name__ == "__main__":
    main(*sys.argv[1:])
