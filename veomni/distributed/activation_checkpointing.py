"""`apply_ac`: activation checkpointing, the step of `parallelize` that trades recompute for memory."""

from torch import nn


def apply_ac(model: nn.Module, reentrant: bool = False) -> None:
    """Turn on transformers' checkpointing of every decoder layer (and encoder block) of `model`."""
    kwargs = {"use_reentrant": reentrant}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x; the old name warns, gone in v6
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    elif hasattr(model, "gradient_checkpointing_enable"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    else:
        raise TypeError(f"{type(model).__name__} does not support gradient checkpointing")
    if reentrant and hasattr(model, "enable_input_require_grads"):
        model.enable_input_require_grads()  # reentrant checkpoints need an input that requires grad
