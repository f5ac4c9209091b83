"""What to do with an output_dir that already holds a run: resume it by default, never overwrite it by accident.

| output_dir holds          | load_path `auto` (default)     | load_path null / `none`  | overwrite: true          |
| ------------------------- | ------------------------------ | ------------------------ | ------------------------ |
| nothing                   | fresh start                    | fresh start              | fresh start              |
| a complete checkpoint     | resume from the newest         | error naming both fixes  | old run moved aside      |
| only metrics / debris     | old files moved aside, fresh   | error naming both fixes  | old run moved aside      |

An explicit checkpoint path inside output_dir resumes this run; one elsewhere initialises a new run, which needs an
empty output_dir (or `overwrite: true`). "Moved aside" renames the run's files into a sibling folder
`<output_dir>.old-<YYYYmmdd-HHMMSS>`; nothing is ever deleted. The plan is computed without side effects
(`plan_run`), so rank 0 can decide, move, and tell the other ranks.
"""

import os
import socket
import time
from dataclasses import dataclass
from typing import IO, List, Optional

from .checkpointer import list_checkpoints, resolve_checkpoint

# The files a run writes into output_dir; only these move aside (anything else the user keeps there stays).
RUN_ARTIFACTS = ("checkpoints", "metrics.jsonl", "veomni_config.yaml", "loss.png", "hf", "tensorboard", "wandb")


LOCK_FILE = ".veomni.lock"  # held by the run that uses output_dir (never moved aside, never a run artifact)


class RunDirError(ValueError):
    """output_dir holds a run that the requested start would overwrite, or another run is using it now."""


def lock_run_dir(output_dir: str) -> IO:
    """Hold output_dir for this run: an exclusive lock on `<output_dir>/.veomni.lock`, kept while the returned file
    stays open and released by the kernel when the process ends, however it ends (no stale lock after a SIGKILL).
    A second run on the same folder is refused, naming the one that holds it."""
    import fcntl

    os.makedirs(output_dir, exist_ok=True)
    handle = open(os.path.join(output_dir, LOCK_FILE), "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.seek(0)
        holder = handle.read().strip() or "another process"
        handle.close()
        raise RunDirError(
            f"train.checkpoint.output_dir={output_dir} is in use by another run ({holder}): wait for it to end or "
            "stop it, or give this run another output_dir"
        ) from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"pid {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    handle.flush()
    return handle


@dataclass
class RunPlan:
    load_path: Optional[str]  # the checkpoint to load, None for a fresh start
    move_aside: bool  # rename the previous run's files out of the way first
    message: str  # one line for the log saying what happens and why


def previous_run(output_dir: str) -> List[str]:
    """The run artifacts present in output_dir (empty files and an empty checkpoints folder do not count)."""

    def present(path: str) -> bool:
        return bool(os.listdir(path)) if os.path.isdir(path) else os.path.isfile(path) and os.path.getsize(path) > 0

    # veomni_config.yaml is written before anything runs: alone it is no run worth keeping
    return [n for n in RUN_ARTIFACTS if n != "veomni_config.yaml" and present(os.path.join(output_dir, n))]


def is_inside(path: str, folder: str) -> bool:
    path, folder = os.path.realpath(path), os.path.realpath(folder)
    return os.path.commonpath([path, folder]) == folder


def plan_run(output_dir: str, load_path: Optional[str], overwrite: bool = False) -> RunPlan:
    """Decide how this run starts; raises RunDirError when that would silently overwrite a previous run."""
    explicit = load_path not in (None, "", "auto", "none")
    if explicit:
        resolve_checkpoint(load_path, output_dir)  # a wrong path fails first, naming the path
    found = previous_run(output_dir)
    steps = list_checkpoints(os.path.join(output_dir, "checkpoints"))
    what = f"checkpoints up to step {steps[-1]}" if steps else ", ".join(found)
    aside = "the old run is moved to <output_dir>.old-<time>, nothing is deleted"
    if overwrite:
        message = (
            f"starting over; the previous run in {output_dir} ({what}) is moved aside" if found else "nothing to move"
        )
        return RunPlan(load_path if explicit else None, bool(found), f"train.checkpoint.overwrite: {message}")
    if explicit:
        if found and not is_inside(load_path, output_dir):
            raise RunDirError(
                f"train.checkpoint.output_dir={output_dir} already holds another run ({', '.join(found)}); "
                f"to start a run from {load_path}, use a new output_dir or add --train.checkpoint.overwrite true "
                f"({aside})"
            )
        return RunPlan(load_path, False, f"resuming from {load_path}")
    if load_path == "auto":
        newest = resolve_checkpoint("auto", output_dir)
        if newest is not None:
            return RunPlan(
                newest,
                False,
                f"{output_dir} holds a run: resuming from {newest} (start over with --train.checkpoint.overwrite true)",
            )
        if found:  # a run that died before its first checkpoint: nothing to resume, but keep its files
            return RunPlan(
                None,
                True,
                f"{output_dir} holds a run with no complete checkpoint ({', '.join(found)}): its files are moved "
                "aside and training starts fresh",
            )
        return RunPlan(None, False, f"no checkpoint in {output_dir}: starting fresh")
    if found:  # load_path null: the user asked for no resume, but did not ask to replace the run
        raise RunDirError(
            f"train.checkpoint.output_dir={output_dir} already holds a run ({what}) and "
            f"train.checkpoint.load_path is null; resume it with --train.checkpoint.load_path auto (the default), "
            f"or start over with --train.checkpoint.overwrite true ({aside})"
        )
    return RunPlan(None, False, f"starting fresh in {output_dir}")


def move_run_aside(output_dir: str) -> str:
    """Rename the run's files into `<output_dir>.old-<timestamp>` (a sibling, so the rename is atomic per file)."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    base = f"{os.path.normpath(os.path.abspath(output_dir))}.old-{stamp}"
    target, n = base, 1
    while os.path.exists(target):  # two restarts within a second
        target, n = f"{base}-{n}", n + 1
    os.makedirs(target)
    for name in RUN_ARTIFACTS:
        src = os.path.join(output_dir, name)
        if os.path.lexists(src):
            os.replace(src, os.path.join(target, name))
    return target


def remap_into(path: Optional[str], output_dir: str, moved_to: str) -> Optional[str]:
    """A checkpoint path that pointed into the run just moved aside, pointed at its new place."""
    if path is None or not is_inside(path, output_dir):
        return path
    rel = os.path.relpath(os.path.realpath(path), os.path.realpath(output_dir))
    return os.path.join(moved_to, rel)
