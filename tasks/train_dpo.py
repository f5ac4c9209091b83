"""Preference-tune a causal LM (DPO / IPO): `bash train.sh tasks/train_dpo.py CONFIG.yaml [--group.key value ...]`.

The text trainer with the `dpo` group (beta, loss_type, label_smoothing, reference); data are preference pairs
(README "Preference tuning (DPO)"). `python tasks/train_dpo.py --help dpo` lists its keys.
"""

from veomni.trainer.task import run_task


def build_trainer(args):
    from veomni.trainer.dpo_trainer import DPOTrainer  # imported after the config is parsed: --help answers at once

    return DPOTrainer(args)


def arguments_class():
    from veomni.arguments.dpo_arguments import DPOVeOmniArguments

    return DPOVeOmniArguments


if __name__ == "__main__":
    run_task(build_trainer, arguments_class())
