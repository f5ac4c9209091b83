"""Data: dataset registry (mapping, streaming, interleaved), sample transforms, the stateful packing loader."""

from .chat_template import CHAT_TEMPLATE_REGISTRY, ChatTemplate, build_chat_template
from .data_collator import DataCollateInfo, MainCollator
from .data_loader import build_dataloader, build_loader
from .data_report import data_report
from .data_transform import DataFormatError, process_pretrain_example, process_sft_example
from .dataset import (
    DATASET_REGISTRY,
    InterleaveDataset,
    InterleavedIterableDataset,
    InterleavedMappingDataset,
    IterativeDataset,
    MappingDataset,
    build_dataset,
)
from .global_batches import Batching
from .multimodal import build_multimodal_chat_template

__all__ = [
    "Batching",
    "CHAT_TEMPLATE_REGISTRY",
    "ChatTemplate",
    "DATASET_REGISTRY",
    "DataCollateInfo",
    "DataFormatError",
    "InterleaveDataset",
    "InterleavedIterableDataset",
    "InterleavedMappingDataset",
    "IterativeDataset",
    "MainCollator",
    "MappingDataset",
    "build_chat_template",
    "build_dataloader",
    "build_dataset",
    "build_loader",
    "build_multimodal_chat_template",
    "data_report",
    "process_pretrain_example",
    "process_sft_example",
]
