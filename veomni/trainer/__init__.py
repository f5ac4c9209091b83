"""Trainers: BaseTrainer (the loop, checkpoints, resume) and TextTrainer; callbacks for progress and metrics."""

from .base import BaseTrainer, NonFiniteError
from .text_trainer import TextTrainer

__all__ = ["BaseTrainer", "NonFiniteError", "TextTrainer"]
