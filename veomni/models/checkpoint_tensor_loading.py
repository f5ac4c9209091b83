"""`get_checkpoint_tensor_converter(model)`: the object that converts a model's tensors between checkpoint and
training layout, when the model registers one (VeOmni's protocol, read by verl's VeOmni engine when it exports
weights to its rollout).

Our models need none: checkpoint keys and layouts (per-expert MoE keys, hub names of VL models) are converted by
transformers' own rules, both ways (models/hf_conversion.py), so a model's `state_dict()` names are what
`from_pretrained` accepts. A custom model may still register a converter: a `_create_checkpoint_tensor_converter`
attribute, called with the model, returning an object with `can_handle(name)` and `convert(name, tensor)` (and
optionally `export_weights(model)`, which verl then uses instead of `state_dict()`).
"""

from typing import Any, Optional

from torch import nn

from ..utils.logging import get_logger

logger = get_logger(__name__)


def get_checkpoint_tensor_converter(model: nn.Module) -> Optional[Any]:
    """The converter `model` registers (see the module docstring), or None (every model built here)."""
    factory = getattr(model, "_create_checkpoint_tensor_converter", None)
    if factory is None:
        return None
    if not callable(factory):
        logger.warning(f"{type(model).__name__}._create_checkpoint_tensor_converter is not callable: ignored")
        return None
    converter = factory(model)
    if converter is not None and not (hasattr(converter, "can_handle") and hasattr(converter, "convert")):
        logger.warning(f"{type(converter).__name__} has no can_handle/convert: not a checkpoint tensor converter")
        return None
    return converter
