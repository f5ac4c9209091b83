"""The launch body every task script shares: parse the config, build the task's trainer, fit, leave the group.

A task script (tasks/train_text.py, tasks/train_vlm.py) says only which trainer it builds:

    def build_trainer(args):
        from veomni.trainer import TextTrainer  # imported after parsing: --help answers before torch loads
        return TextTrainer(args)

    if __name__ == "__main__":
        run_task(build_trainer)
"""

from typing import Any, Callable, List, Optional


def run_task(build_trainer: Callable[[Any], Any], arguments_class: Optional[type] = None) -> None:
    """Run `build_trainer(args).fit()` on this rank under `run_worker` (stop signals, errors said once, exit codes).

    The arguments are parsed before anything heavy is imported, so `--help` and config mistakes answer at once;
    `build_trainer` should import its trainer class inside itself for the same reason. `--preview N` (taken out of
    argv before parsing) shows N samples as trained, the packing and the step counts, then exits without a model
    (veomni.trainer.preview). `arguments_class`: the task's configuration tree (default VeOmniArguments; DPO adds
    its `dpo` group with DPOVeOmniArguments).
    """
    from .lifecycle import run_worker

    def main():
        import sys

        from ..arguments import VeOmniArguments, parse_args

        preview = take_preview_flag(sys.argv)  # `--preview N`: show the data as trained, build no model, exit 0
        # --help and config mistakes answer before the model is built
        args = parse_args(arguments_class or VeOmniArguments)
        if preview is not None:
            from ..trainer.preview import run_preview

            run_preview(args, preview, build_trainer)
            return
        from ..distributed import destroy_parallel_state
        from ..trainer.preview import log_first_sample

        trainer = build_trainer(args)
        log_first_sample(trainer)  # rank 0, once: the first sample decoded, its loss-bearing tokens marked
        trainer.fit()
        destroy_parallel_state()

    run_worker(main, user_error_types)


def take_preview_flag(argv: List[str]) -> Optional[int]:
    """Remove `--preview N` (or `--preview=N`) from `argv` in place; return N, or None when absent."""
    for i, token in enumerate(argv):
        if token == "--preview" or token.startswith("--preview="):
            value = token.split("=", 1)[1] if "=" in token else (argv[i + 1] if i + 1 < len(argv) else "")
            del argv[i : i + (1 if "=" in token else 2)]
            if not value.isdigit() or int(value) < 1:
                from ..arguments import ConfigError

                raise ConfigError(f"command line: --preview takes a number of samples >= 1, got {value!r}")
            return int(value)
    return None


def user_error_types():
    """The errors that mean a mistake in the config, the data or the files it names: said in one line."""
    from ..arguments.parser import ConfigError
    from ..checkpoint.checkpointer import CheckpointError
    from ..checkpoint.run_dir import RunDirError
    from ..data.chat_template import ChatTemplateError
    from ..data.data_transform import DataFormatError
    from ..models.auto import CustomCodeError
    from ..models.loader import WeightsMismatchError
    from ..utils.hub import HubNameError

    return (
        ConfigError, DataFormatError, ChatTemplateError, WeightsMismatchError, CustomCodeError, CheckpointError,
        RunDirError, HubNameError,
    )  # fmt: skip
