"""The `dpo` group: preference tuning (tasks/train_dpo.py, veomni.trainer.dpo_trainer)."""

from dataclasses import dataclass, field
from typing import Literal

from .arguments_types import VeOmniArguments
from .fields import documented as _doc
from .validation import ConfigError


@dataclass
class DPOArguments:
    """Direct preference optimisation on {prompt, chosen, rejected} pairs (README "Preference tuning (DPO)")."""

    beta: float = _doc("Strength of the KL penalty towards the reference: rewards are beta * log-ratios.", default=0.1)
    loss_type: Literal["sigmoid", "ipo"] = _doc(
        "sigmoid: the DPO loss; ipo: the IPO squared loss on per-token averaged log-ratios (TRL's).", default="sigmoid"
    )
    label_smoothing: float = _doc(
        "Conservative DPO (sigmoid only): the chance a label is flipped, in [0, 0.5).", default=0.0
    )
    reference: Literal["model", "adapters_off", "precomputed"] = _doc(
        "The reference log-probs: model (a frozen copy of the initial policy, sharded like it, no grads, no "
        "optimizer), adapters_off (the LoRA policy with its adapters disabled: no second copy), precomputed (one "
        "pass of the frozen initial model before training, stored beside the data cache).",
        default="model",
    )


@dataclass
class DPOVeOmniArguments(VeOmniArguments):
    """The whole configuration of a DPO run: model, data, train and dpo."""

    dpo: DPOArguments = field(default_factory=DPOArguments)

    def __post_init__(self):
        super().__post_init__()
        if not 0.0 <= self.dpo.label_smoothing < 0.5:
            raise ConfigError(f"dpo.label_smoothing={self.dpo.label_smoothing}: expected a value in [0, 0.5)")
        if self.dpo.beta <= 0:
            raise ConfigError(f"dpo.beta={self.dpo.beta}: expected a positive number")
        if self.dpo.reference == "adapters_off" and not self.model.lora.enable:
            raise ConfigError("dpo.reference=adapters_off needs a LoRA policy (model.lora.enable: true)")
