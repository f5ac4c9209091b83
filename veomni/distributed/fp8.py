"""`train.fp8`: torchao float8 training of the linear layers large enough to gain (a step of `parallelize`).

Each chosen `nn.Linear` becomes torchao's `Float8Linear`: its three matmuls (output, input gradient, weight
gradient) run in float8 with dynamic scales, the weights stay in their dtype (fp32 masters under FSDP2's bf16
policy). `tensorwise` (one scale per tensor) is the fastest, and FSDP2 then all-gathers the weights already cast
to float8; `rowwise` (one scale per row) keeps more accuracy.

Which layers (`wants_fp8`): not the output head (the logits' precision), only dims that are multiples of 16 (the
float8 matmul's requirement), and only shapes where float8 beat bf16 in torchao's H100 measurements (weight N x K,
N = out_features, K = in_features):
    tensorwise  K > 4096 or N > 1024
    rowwise     N > 2048 and K > 1024 and (N > 4096 or K > 2048)
so a small layer (a KV projection of a 1.7B model, anything of a tiny test model) stays in bf16, where the cast
and scale would cost more than the faster matmul saves. Runs before compile and sharding (torchao's order).
"""

from typing import Dict, List

from torch import nn

from ..utils.logging import get_logger

logger = get_logger(__name__)

RECIPES = ("tensorwise", "rowwise")
KEY = "train.fp8"


def gains_from_fp8(out_features: int, in_features: int, recipe: str) -> bool:
    """torchao's H100 size rule for `recipe` (see the module docstring)."""
    n, k = out_features, in_features
    if n % 16 or k % 16:
        return False
    if recipe == "tensorwise":
        return k > 4096 or n > 1024
    return n > 2048 and k > 1024 and (n > 4096 or k > 2048)


def fp8_layer_names(model: nn.Module, recipe: str) -> List[str]:
    """Names of the linear layers `apply_fp8` converts for `recipe`."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return [
        name
        for name, module in model.named_modules()
        if type(module) is nn.Linear
        and module is not head
        and gains_from_fp8(module.out_features, module.in_features, recipe)
    ]


def apply_fp8(model: nn.Module, recipe: str, tp_size: int = 1) -> Dict[str, int]:
    """Convert the chosen linear layers of `model` to float8 training; returns {"converted": n, "linear": n}."""
    if recipe == "off":
        return {}
    if recipe not in RECIPES:
        raise ValueError(f"{KEY}={recipe!r}: choose one of off, {', '.join(RECIPES)}")
    if tp_size > 1:
        raise ValueError(f"{KEY}={recipe} with tensor parallel (tp_size={tp_size}): not supported; set {KEY} off")
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError:
        raise ValueError(f"{KEY}={recipe} needs torchao: pip install veomni[fp8]") from None
    chosen = set(fp8_layer_names(model, recipe))
    config = Float8LinearConfig.from_recipe_name(recipe)
    if recipe == "tensorwise":  # FSDP2 gathers the float8 weights: half the all-gather bytes of bf16
        config = Float8LinearConfig(enable_fsdp_float8_all_gather=True)
    convert_to_float8_training(model, config=config, module_filter_fn=lambda module, fqn: fqn in chosen)
    linear = sum(1 for m in model.modules() if isinstance(m, nn.Linear))
    logger.info(f"{KEY}={recipe}: {len(chosen)} of {linear} linear layers train in float8 (the others are too small)")
    return {"converted": len(chosen), "linear": linear}
