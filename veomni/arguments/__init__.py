"""Configuration: dataclass groups (model, data, train) filled by `parse_args` from YAML and `--group.key value`."""

from .arguments_types import (
    AcceleratorArguments,
    CheckpointArguments,
    DataArguments,
    DataloaderArguments,
    FSDPConfig,
    GradientCheckpointingArguments,
    LoraArguments,
    MixedPrecisionArguments,
    ModelArguments,
    OpsImplementation,
    OptimizerArguments,
    TrainingArguments,
    VeOmniArguments,
    WandbArguments,
)
from .parser import ConfigError, parse_args, save_args

__all__ = [
    "AcceleratorArguments",
    "CheckpointArguments",
    "ConfigError",
    "DataArguments",
    "DataloaderArguments",
    "FSDPConfig",
    "GradientCheckpointingArguments",
    "LoraArguments",
    "MixedPrecisionArguments",
    "ModelArguments",
    "OpsImplementation",
    "OptimizerArguments",
    "TrainingArguments",
    "VeOmniArguments",
    "WandbArguments",
    "parse_args",
    "save_args",
]
