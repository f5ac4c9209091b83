from .base import BaseTrainer, NonFiniteError
from .text_trainer import TextTrainer

__all__ = ["BaseTrainer", "NonFiniteError", "TextTrainer"]
