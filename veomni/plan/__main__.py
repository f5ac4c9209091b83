"""`python -m veomni.plan CONFIG.yaml --nnodes N --nproc-per-node G [--gpu h100|h200|a100] [--key value ...]`

Plans a training run before it is booked: the configured layout under the real parallel plan on a fake world of
N*G ranks (no GPU, no network), its memory per rank and collectives per step, and the layouts that fit, ranked
by predicted step time. Options other than the planner's own are config overrides, as for a training task.
"""

import argparse
import logging
import sys
import time
from typing import List, Optional

from .cost import GPUS


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m veomni.plan", description=__doc__.split("\n\n")[1])
    parser.add_argument("config", help="the run's YAML config")
    parser.add_argument("--nnodes", type=int, default=1)
    parser.add_argument("--nproc-per-node", type=int, default=8, help="GPUs per node")
    parser.add_argument("--gpu", choices=sorted(GPUS), default="h100")
    parser.add_argument(
        "--mfu",
        type=float,
        help="model FLOPs utilisation assumed (default: the newest benchmarks/results record for this GPU and the "
        "nearest benchmarked model size)",
    )
    parser.add_argument("--intra-node-gbps", type=float, help="GB/s (bytes) per GPU per direction within a node")
    parser.add_argument("--inter-node-gbps", type=float, help="GB/s (bytes) per GPU per direction between nodes")
    parser.add_argument("--tokens", type=int, help="tokens per micro-batch (default micro_batch_size * max_seq_len)")
    parser.add_argument("--top", type=int, default=5, help="how many fitting layouts to list")
    return parser


def _bad_flag(options: argparse.Namespace) -> Optional[str]:
    """What is wrong with the planner's own flags, naming the flag (None when nothing is)."""
    counts = {"--nnodes": options.nnodes, "--nproc-per-node": options.nproc_per_node, "--top": options.top}
    for flag, value in counts.items():
        if value < 1:
            return f"{flag} takes a count >= 1, got {value}"
    if options.mfu is not None and not 0 < options.mfu <= 1:
        return f"--mfu takes a fraction in (0, 1], got {options.mfu}"
    positive = (("--intra-node-gbps", options.intra_node_gbps), ("--inter-node-gbps", options.inter_node_gbps),
                ("--tokens", options.tokens))  # fmt: skip
    for flag, value in positive:
        if value is not None and value <= 0:
            return f"{flag} takes a value > 0, got {value}"
    return None


def main(argv: Optional[List[str]] = None) -> int:
    """Plan and print; a bad flag, config or file is said in one line on stderr (exit 2), not a traceback."""
    options, overrides = _parser().parse_known_args(argv)
    from ..trainer.task import user_error_types

    bad = _bad_flag(options)
    if bad is None:
        try:
            return _plan_and_print(options, overrides)
        except (*user_error_types(), FileNotFoundError) as err:
            bad = str(err)
    print(f"python -m veomni.plan: {bad}", file=sys.stderr)
    return 2


def _plan_and_print(options: argparse.Namespace, overrides: List[str]) -> int:
    from .planner import plan
    from .report import render
    from .shards import logger_levels

    start = time.perf_counter()
    # the plan's own model builds log as a training run's do (FSDP2 over mesh ...): noise here
    veomni_loggers = [name for name in list(logging.root.manager.loggerDict) if name.startswith("veomni")]
    with logger_levels(veomni_loggers, logging.WARNING):
        result = plan([options.config, *overrides], options)
    print(render(result))
    print(f"(planned in {time.perf_counter() - start:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
