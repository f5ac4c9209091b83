"""Data: dataset registry (mapping, streaming, interleaved), sample transforms, the stateful packing loader."""

from .data_collator import DataCollateInfo, MainCollator
from .data_loader import build_dataloader
from .data_transform import DataFormatError, process_pretrain_example
from .dataset import DATASET_REGISTRY, build_dataset

__all__ = [
    "DATASET_REGISTRY",
    "DataCollateInfo",
    "DataFormatError",
    "MainCollator",
    "build_dataloader",
    "build_dataset",
    "process_pretrain_example",
]
