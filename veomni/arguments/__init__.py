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
from .config_names import (  # VeOmni's names of the same groups (config_names.py)
    AcceleratorConfig,
    CheckpointConfig,
    DataloaderConfig,
    GradientCheckpointingConfig,
    MixedPrecisionConfig,
    OpsImplementationConfig,
    OptimizerConfig,
    WandbConfig,
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
    # VeOmni's names of the same groups
    "AcceleratorConfig",
    "CheckpointConfig",
    "DataloaderConfig",
    "GradientCheckpointingConfig",
    "MixedPrecisionConfig",
    "OpsImplementationConfig",
    "OptimizerConfig",
    "WandbConfig",
    "parse_args",
    "save_args",
]
