"""The launch body every task script shares: parse the config, build the task's trainer, fit, leave the group.

A task script (tasks/train_text.py, tasks/train_vlm.py) says only which trainer it builds:

    def build_trainer(args):
        from veomni.trainer import TextTrainer  # imported after parsing: --help answers before torch loads
        return TextTrainer(args)

    if __name__ == "__main__":
        run_task(build_trainer)
"""

from typing import Any, Callable


def run_task(build_trainer: Callable[[Any], Any]) -> None:
    """Run `build_trainer(args).fit()` on this rank under `run_worker` (stop signals, errors said once, exit codes).

    The arguments are parsed before anything heavy is imported, so `--help` and config mistakes answer at once;
    `build_trainer` should import its trainer class inside itself for the same reason.
    """
    from .lifecycle import run_worker

    def main():
        from ..arguments import VeOmniArguments, parse_args

        args = parse_args(VeOmniArguments)  # --help and config mistakes answer before the model is built
        from ..distributed import destroy_parallel_state

        build_trainer(args).fit()
        destroy_parallel_state()

    run_worker(main)
