"""liger-kernel's RMSNorm, RoPE and SwiGLU bound to one model instance.

liger's `apply_liger_kernel_to_<model>(model=m)` also assigns the modeling file's classes and RoPE function, so
every model of that family built or run later in the process runs liger too. Here nothing global changes:

    RMSNorm  each norm module of the model is replaced (in its parent) by a `LigerRMSNorm` holding the same
             Parameter, so state-dict names, FSDP units and checkpoints are unchanged;
    SwiGLU   each gated MLP instance gets a forward whose silu(gate) * up is one kernel (its own Linear layers,
             LoRA and all, still run; bound through veomni.compat's `bind_instance_method`, the parity test of
             tests/test_kernels.py is its canary: the transformers MLP must still be down(act(gate(x)) * up(x)));
    RoPE     each attention instance gets its class's forward with the modeling-file function
             `apply_rotary_pos_emb` (`_vision` in vision towers) meaning liger's
             (veomni.compat.transformers.bind_forward_with_global).

The kernels run as torch custom ops (liger_ops.py), so torch.compile keeps a compiled layer in one graph.
Which modules: those of the families below whose modeling files were checked to match liger's semantics (llama-
style RMSNorm: fp32 normalisation, cast back, then times the weight; SwiGLU with silu). M-RoPE (Qwen2.5-VL,
Qwen3-VL): transformers 5 merges the three position sections into cos/sin once per forward in the rotary embedding,
and the attention calls the plain `apply_rotary_pos_emb`, so liger's plain RoPE kernel is the one that applies
(`liger_multimodal_rotary_pos_emb` targets `apply_multimodal_rotary_pos_emb`, which those files no longer call).
"""

from typing import Dict

import torch
from torch import nn

from ...compat.transformers import bind_forward_with_global, bind_instance_method, forward_calls_global

# modeling files whose RMSNorm / gated MLP / RoPE match liger's kernels (parity-tested in tests/test_kernels.py)
FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe", "qwen2_5_vl", "qwen3_vl")
_MODELING_FILES = {f"transformers.models.{name}.modeling_{name}" for name in FAMILIES}


def _in_family(module: nn.Module) -> bool:
    return type(module).__module__ in _MODELING_FILES


def is_rms_norm(module: nn.Module) -> bool:
    return (
        _in_family(module)
        and type(module).__name__.endswith("RMSNorm")
        and isinstance(getattr(module, "weight", None), torch.Tensor)
        and hasattr(module, "variance_epsilon")
    )


def is_swiglu_mlp(module: nn.Module) -> bool:
    """A gated MLP down(silu(gate(x)) * up(x)) (the experts of an MoE are fused 3-D weights, not these)."""
    act = getattr(module, "act_fn", None)
    return (
        _in_family(module)
        and all(isinstance(getattr(module, n, None), nn.Module) for n in ("gate_proj", "up_proj", "down_proj"))
        and (isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation")  # ACT2FN["silu"] / ["swish"]
    )


def _liger_rms_norm(norm: nn.Module) -> nn.Module:
    from .liger_ops import LigerRMSNorm

    fused = LigerRMSNorm(norm.weight, norm.variance_epsilon)  # the same Parameter: names, sharding, optimizer state
    fused.train(norm.training)
    return fused


def bind_liger(model: nn.Module) -> Dict[str, int]:
    """Bind liger's kernels onto `model`'s own modules; returns {"rms_norm": n, "swiglu": n, "rope": n}."""
    from .liger_ops import rotary_pos_emb, rotary_pos_emb_vision, swiglu_mlp_forward

    counts = {"rms_norm": 0, "swiglu": 0, "rope": 0}
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if is_rms_norm(child):
                setattr(parent, name, _liger_rms_norm(child))
                counts["rms_norm"] += 1
    ropes = {"apply_rotary_pos_emb": rotary_pos_emb, "apply_rotary_pos_emb_vision": rotary_pos_emb_vision}
    for module in model.modules():
        if is_swiglu_mlp(module):
            bind_instance_method(module, "forward", swiglu_mlp_forward.__get__(module))
            counts["swiglu"] += 1
        elif _in_family(module) and type(module).__name__.endswith("Attention"):
            for global_name, kernel in ropes.items():
                if forward_calls_global(type(module), global_name):
                    bind_forward_with_global(module, global_name, kernel)
                    counts["rope"] += 1
    return counts
