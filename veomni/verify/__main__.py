"""`python -m veomni.verify CONFIG [--group.key value ...] [--layouts auto|LIST] [--steps N] [--nproc N]
[--report FILE]`

Runs CONFIG (its model, data and optimizer) in fp32 for N steps once as one process and once per parallel layout
that fits N local ranks (CPU ranks over gloo without GPUs), and prints one table: per layout the largest relative
loss and grad-norm difference, the worst parameter gradient at equal weights, and the verdict with its tolerance;
then a resume from step N-1 (bit-identical) and a reshard resume N ranks -> 1. Exit 1 on any failure, 2 on a bad
flag or config.
"""

import argparse
import os
import platform
import sys
import tempfile
import time
from typing import List, Optional

from .layouts import KINDS


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m veomni.verify", description=__doc__.split("\n\n")[1])
    parser.add_argument("config", help="the run's YAML config")
    parser.add_argument("--layouts", default="auto", help=f"auto, or a comma-separated list of {', '.join(KINDS)}")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps per run (default 3)")
    parser.add_argument("--nproc", type=int, default=2, help="local ranks of the layouts (default 2)")
    parser.add_argument("--report", help="write a markdown report here (versions, config, table, failure)")
    parser.add_argument("--workdir", help="where the runs write (default: a temporary folder, removed after)")
    return parser


def _bad_flag(options) -> Optional[str]:
    if options.steps < 1:
        return f"--steps takes a count >= 1, got {options.steps}"
    if options.nproc < 2:
        return f"--nproc takes 2 or more ranks, got {options.nproc}"
    kinds = options.layouts.split(",")
    unknown = [k for k in kinds if k not in KINDS] if kinds != ["auto"] else []
    return f"--layouts: unknown {', '.join(unknown)} (known: auto, {', '.join(KINDS)})" if unknown else None


def _split_batches(train, nproc: int) -> List[str]:
    """Every layout must split the same global batch over its data-parallel ranks (at most nproc): the largest
    micro-batch that does, for every run alike (the one process too), when the config's own does not."""
    micro, global_batch = train.micro_batch_size, train.global_batch_size
    if not global_batch or global_batch % (micro * nproc) == 0:
        return []
    fitting = [m for m in range(micro, 0, -1) if global_batch % (m * nproc) == 0]
    if not fitting:
        raise ValueError(
            f"train.global_batch_size={global_batch} does not split over {nproc} data-parallel ranks at any "
            f"micro-batch size: give --train.global_batch_size a multiple of {nproc}"
        )
    print(f"verify: train.micro_batch_size {micro} -> {fitting[0]} for every run, so that the global batch of "
          f"{global_batch} splits over {nproc} ranks")  # fmt: skip
    return ["--train.micro_batch_size", str(fitting[0])]


def main(argv: Optional[List[str]] = None) -> int:
    options, overrides = _parser().parse_known_args(argv)
    bad = _bad_flag(options)
    if bad is None:
        try:
            return _verify(options, overrides)
        except (ValueError, FileNotFoundError) as err:
            bad = str(err)
    print(f"python -m veomni.verify: {bad}", file=sys.stderr)
    return 2


def _verify(options, overrides: List[str]) -> int:
    from ..arguments import VeOmniArguments, parse_args
    from ..models.auto import build_config
    from ..models.multimodal import is_multimodal
    from ..plan.model_shape import ModelShape
    from .layouts import choose_layouts
    from .report import render_plans, write_report
    from .run import Verify

    args = parse_args(VeOmniArguments, [options.config, *overrides])
    config = build_config(args.model.config_path)
    shape = ModelShape.from_config(config)
    layouts, skipped = choose_layouts(args, shape, options.nproc, options.layouts.split(","), is_multimodal(config))
    overrides = overrides + _split_batches(args.train, options.nproc)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="veomni_verify_") as tmp:
        workdir = options.workdir or tmp
        os.makedirs(workdir, exist_ok=True)
        check = Verify(options.config, overrides, workdir, options.steps, options.nproc)
        failed = check.reference()
        if failed:
            print(f"python -m veomni.verify: {failed}", file=sys.stderr)
            return 1
        outcome = check.layouts(layouts)
        outcome.skipped = skipped
        fsdp = next((lay for lay in layouts if lay.kind == "fsdp2"), None)
        outcome.rows += check.resumes(fsdp)
    outcome.seconds = time.perf_counter() - start
    from .compare import render_table

    print(render_table(outcome.rows, outcome.skipped))
    print(render_plans(outcome.plans))
    verdict = "every layout within tolerance" if outcome.ok else "FAILED"
    print(
        f"verify: {verdict} ({len(outcome.rows)} checks, {outcome.seconds:.0f} s on {platform.node() or 'this host'})"
    )
    if options.report:
        write_report(options.report, options.config, overrides, options, outcome)
    return 0 if outcome.ok else 1


if __name__ == "__main__":
    sys.exit(main())
