"""Deliberate breaks, for the tests that prove `verify` catches them (never set in a real run).

VEOMNI_VERIFY_BREAK names one or several (comma-separated); the worker applies each to each trainer whose layout has that parallelism, by
patching the running process only (the library's code is untouched):
  sp_gather  Ulysses: the key projection's exchange carries no gradient back (its all-to-all backward dropped)
  tp_norm    tensor parallel: layer 0's q_norm weight gradient (a TP-replicated norm) scaled by 1.001
  ep_scale   expert parallel: the experts' 1/ep gradient scaling skipped
"""

import dataclasses
import os

ENV = "VEOMNI_VERIFY_BREAK"


def _drop_key_gradient_exchange() -> None:
    from ..distributed.sequence_parallel import ulysses

    real = ulysses.launch_qkv

    def launch_qkv(query, key, value, group):
        return real(query, key.detach(), value, group)

    ulysses.launch_qkv = launch_qkv


def _scale_q_norm_gradient(model) -> None:
    def register(module, args):
        weight = module.weight
        if not weight.requires_grad:
            return
        handle = None

        def scale(grad):
            handle.remove()  # once per forward: the unsharded parameter object lives on
            return grad * 1.001

        handle = weight.register_hook(scale)

    for name, module in model.named_modules():
        if name.endswith("layers.0.self_attn.q_norm"):
            module.register_forward_pre_hook(register)


def _skip_expert_gradient_scale(model) -> None:
    from ..ops.moe import expert_parallel_of, set_expert_parallel

    for module in model.modules():
        ep = expert_parallel_of(module)
        if ep is not None:
            set_expert_parallel(module, dataclasses.replace(ep, grad_scale=1.0))


def apply_break(trainer) -> None:
    """The break VEOMNI_VERIFY_BREAK names, when this trainer's layout has the parallelism it breaks."""
    kinds, state = os.environ.get(ENV, "").split(","), trainer.parallel_state
    if "sp_gather" in kinds and state.sp_size > 1:
        _drop_key_gradient_exchange()
    if "tp_norm" in kinds and state.tp_size > 1:
        _scale_q_norm_gradient(trainer.model)
    if "ep_scale" in kinds and state.ep_size > 1:
        _skip_expert_gradient_scale(trainer.model)
