"""The argument groups under the names VeOmni spells them (`MixedPrecisionConfig`, `OpsImplementationConfig`, ...).

Each is the same class as ours, not a copy: `MixedPrecisionConfig is MixedPrecisionArguments`, so code written
against VeOmni's names (verl's VeOmni engine builds `MixedPrecisionConfig(enable=...)` and
`OpsImplementationConfig(**selectors)`) and code written against ours build, parse and validate the same objects.
Fields that VeOmni has and we do not are refused by the dataclass constructor, by name.
"""

from .arguments_types import (
    AcceleratorArguments,
    CheckpointArguments,
    DataloaderArguments,
    GradientCheckpointingArguments,
    MixedPrecisionArguments,
    OptimizerArguments,
    WandbArguments,
)
from .model_arguments import OpsImplementation

AcceleratorConfig = AcceleratorArguments
CheckpointConfig = CheckpointArguments
DataloaderConfig = DataloaderArguments
GradientCheckpointingConfig = GradientCheckpointingArguments
MixedPrecisionConfig = MixedPrecisionArguments
OpsImplementationConfig = OpsImplementation
OptimizerConfig = OptimizerArguments
WandbConfig = WandbArguments

__all__ = [
    "AcceleratorConfig",
    "CheckpointConfig",
    "DataloaderConfig",
    "GradientCheckpointingConfig",
    "MixedPrecisionConfig",
    "OpsImplementationConfig",
    "OptimizerConfig",
    "WandbConfig",
]
