"""veomni's merged expert tensors (fused gate_up_proj or stacked gate_proj/up_proj) -> HF per-expert keys.

python scripts/moe_split.py --merge_hf_path IN --split_hf_path OUT
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from veomni.checkpoint.moe_conversion import peak_rss_mb, split_moe_checkpoint  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--merge_hf_path", required=True, help="checkpoint folder with merged expert tensors")
    parser.add_argument("--split_hf_path", required=True, help="output folder")
    a = parser.parse_args()
    tic = time.time()
    report = split_moe_checkpoint(a.merge_hf_path, a.split_hf_path)
    print(
        f"split {report['layers']} MoE layers over {report['shards']} shards into {a.split_hf_path} "
        f"in {time.time() - tic:.1f}s; peak RSS {peak_rss_mb():.0f} MB"
    )


if __name__ == "__main__":
    main()
