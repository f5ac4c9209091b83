"""Consolidate a veomni DCP checkpoint (saved by any number of ranks) into an HF-format model folder.

python scripts/merge_dcp_to_hf.py --checkpoint outputs/demo/checkpoints/global_step_150 --output outputs/demo/hf

Under torchrun (`torchrun --nproc_per_node N scripts/merge_dcp_to_hf.py ...`) the N processes share the work.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from veomni.checkpoint import dcp_to_hf  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True, help="a global_step_N folder")
    parser.add_argument("--output", required=True, help="folder to write (replaced if it exists)")
    parser.add_argument("--max-shard-gb", type=float, default=5.0)
    a = parser.parse_args()
    launched = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if launched:
        import torch.distributed as dist

        dist.init_process_group("gloo")
    try:
        out = dcp_to_hf(a.checkpoint, a.output, int(a.max_shard_gb * 2**30), all_ranks=launched)
    finally:
        if launched:
            dist.destroy_process_group()
    if not launched or int(os.environ["RANK"]) == 0:
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
