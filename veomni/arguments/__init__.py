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

# The groups under the names VeOmni spells them: the same classes, not copies (`MixedPrecisionConfig is
# MixedPrecisionArguments`), so code written against VeOmni's names (verl's VeOmni engine builds
# `MixedPrecisionConfig(enable=...)` and `OpsImplementationConfig(**selectors)`) and code written against ours
# build, parse and validate the same objects. Fields VeOmni has and we do not are refused by the constructor, by name.
AcceleratorConfig = AcceleratorArguments
CheckpointConfig = CheckpointArguments
DataloaderConfig = DataloaderArguments
GradientCheckpointingConfig = GradientCheckpointingArguments
MixedPrecisionConfig = MixedPrecisionArguments
OpsImplementationConfig = OpsImplementation
OptimizerConfig = OptimizerArguments
WandbConfig = WandbArguments

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
