"""Under torchrun (or plain python for one process): the runs of one world size, one after another in this launch
(the process group stays; each trainer builds its own meshes). argv: plan.json, written by veomni.verify.

plan = {"ref_dir": DIR, "runs": [{"name": ..., "argv": [...], "record": bool, "resume": bool, "save": bool,
                                 "stall_at": STEP}, ...]}
Each run trains its config with `ProbedTrainer`; rank 0 writes <output_dir>/verify.json: the per-step,
per-parameter gradient differences at the one-process weights (none for `record`, the one-process run itself, and
for `resume`, a run that continues a checkpoint), and the planner's predicted vs measured bytes of this rank.
A run with `stall_at` k waits in step k + 1, once step k's checkpoint is published, for the parent to SIGKILL the
launch (so it is the launch's last run). The trainer is tasks/train_vlm.py's for a multimodal model, else
tasks/train_text.py's.
"""

import json
import os
import sys
import traceback

import torch.distributed as dist

from ..arguments import VeOmniArguments, parse_args
from ..distributed import destroy_parallel_state
from .breaks import apply_break
from .harness import GradProbe, probed_trainer_class
from .measure import PlanMeasure, peak_reader


def _write(out_dir: str, result: dict) -> None:
    if dist.get_rank() == 0:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "verify.json"), "w") as f:
            json.dump(result, f)


def one_run(run: dict, ref_dir: str) -> None:
    args = parse_args(VeOmniArguments, run["argv"])
    args.train.loss_plot = False  # matplotlib costs a second a run, and the plot is not under test
    try:
        trainer = probed_trainer_class(args)(args)
    except ValueError as err:  # a layout the config cannot take (the same verdict on every rank): its row says why
        traceback.print_exc()
        _write(args.train.checkpoint.output_dir, {"name": run["name"], "error": str(err), "plan": {}, "grad_diffs": {}})
        return
    trainer.keep_checkpoints = run.get("save", True)
    trainer.stall_at = run.get("stall_at")
    if not run.get("resume"):
        trainer.probe = GradProbe(ref_dir, record=run.get("record", False))
    apply_break(trainer)
    measure = PlanMeasure(peak_reader(trainer.device))
    trainer.callbacks.append(measure)
    trainer.step_watch = measure.watch
    error = None
    try:
        trainer.fit()
    except Exception as err:  # a layout that fails to train is a row of the table, not the end of the check
        error = f"{type(err).__name__}: {err}"
        traceback.print_exc()
    diffs = {str(k): v for k, v in (trainer.probe.diffs if trainer.probe else {}).items()}
    _write(trainer.output_dir, {"name": run["name"], "error": error, "plan": measure.result(), "grad_diffs": diffs})
    if error is not None:
        raise SystemExit(1)  # collectives may be out of step now: the launch ends here, the parent reports it
    trainer.checkpointer.wait()


def main() -> None:
    with open(sys.argv[1]) as f:
        plan = json.load(f)
    try:
        for run in plan["runs"]:
            one_run(run, plan["ref_dir"])
    finally:
        destroy_parallel_state()


if __name__ == "__main__":
    main()
