"""HF per-expert MoE checkpoint -> veomni's merged expert tensors (transformers' own rules), one layer at a time.

python scripts/moe_merge.py --raw_hf_path IN --merge_hf_path OUT [--layout fused|stacked]
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from veomni.checkpoint.moe_conversion import merge_moe_checkpoint, peak_rss_mb  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--raw_hf_path", required=True, help="HF checkpoint folder with per-expert keys")
    parser.add_argument("--merge_hf_path", required=True, help="output folder")
    parser.add_argument(
        "--layout",
        choices=["fused", "stacked"],
        default="fused",
        help="fused: experts.gate_up_proj [E, 2I, H] (transformers 5 / veomni); stacked: gate_proj, up_proj [E, I, H]",
    )
    a = parser.parse_args()
    tic = time.time()
    report = merge_moe_checkpoint(a.raw_hf_path, a.merge_hf_path, a.layout)
    print(
        f"merged {report['layers']} MoE layers over {report['shards']} shards into {a.merge_hf_path} "
        f"in {time.time() - tic:.1f}s; peak RSS {peak_rss_mb():.0f} MB"
    )


if __name__ == "__main__":
    main()
