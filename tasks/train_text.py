"""Train a causal LM on text: `bash train.sh tasks/train_text.py CONFIG.yaml [--group.key value ...]`.

`python tasks/train_text.py --help [GROUP]` lists every config key with its type, default and doc.

Exit codes: 0 done; 1 an error (said once, by the first rank that failed); 130/143 stopped by SIGINT/SIGTERM
after saving a checkpoint, 129 the same after the launcher died (see veomni.trainer.lifecycle).
A new task copies this file and builds its own trainer (veomni.trainer.task runs the rest).
"""

from veomni.trainer.task import run_task


def build_trainer(args):
    from veomni.plan.runlog import PlanCheckCallback  # imported after the config is parsed: --help answers at once
    from veomni.trainer import TextTrainer

    return TextTrainer(args, callbacks=[PlanCheckCallback()])  # the planner's memory prediction, checked


if __name__ == "__main__":
    run_task(build_trainer)
