"""Trainers: BaseTrainer (the loop and its components), TextTrainer, VLMTrainer; callbacks for progress and metrics;
`run_task` (task.py), the launch body of every task script.

Names are imported lazily, so that a task script importing `run_task` answers `--help` and config mistakes before
torch loads.
"""

import importlib

_LAZY = {
    "BaseTrainer": "base",
    "NonFiniteError": "base",
    "TextTrainer": "text_trainer",
    "VLMTrainer": "vlm_trainer",
    "run_task": "task",
}

__all__ = sorted(_LAZY)


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
