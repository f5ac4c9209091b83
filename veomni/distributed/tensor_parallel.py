"""Tensor parallel plans as data: a module-name pattern -> a `torch.distributed.tensor.parallel` style.

Megatron layout over the `tp` mesh dim, built with `parallelize_module` (no home-made layers):
    q/k/v, gate/up   ColwiseParallel   weight (and bias) Shard(0): each rank computes its own heads / columns
    o, down          RowwiseParallel   weight Shard(1): partial outputs, all-reduced to a replicated output
    embed_tokens     RowwiseParallel   weight Shard(0) over the vocabulary (vocab-parallel embedding)
    lm_head          VocabParallelHead weight Shard(0) over the vocabulary; its logits stay a DTensor sharded on
                     the vocabulary, and the loss (veomni/ops/vocab_parallel_loss.py) never gathers them
transformers' attention reshapes projections with `-1` heads, so each rank runs attention on its local heads
(num_heads / tp and num_kv_heads / tp) with any attention implementation, veomni_varlen included.

Sequence parallel on the norms is left out: transformers' decoder layers pass hidden states by keyword and take
full-length rotary embeddings and masks, and packed rows have arbitrary lengths (uneven sequence shards), so it
would need per-model input preparation for every attention and MLP call; norm activations are small next to
the attention and MLP ones that TP already splits.

A model family with other module names adds an entry to TP_PLANS (keyed by config.model_type). Model types without an entry are tried with the dense decoder plan, and refused with
the list of patterns that matched nothing.
"""

import fnmatch
from typing import Dict

import torch.distributed
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from ..compat.torch import ColwiseParallelPassingPlainOutputs
from ..compat.torch_runtime import explain_redistribute_notice
from ..models.placement import tie_again, tied_sources
from ..utils.logging import get_logger

logger = get_logger(__name__)


class VocabParallelHead(ColwiseParallelPassingPlainOutputs):
    """ColwiseParallel for the output head: logits come out as a DTensor sharded on the vocabulary.

    The chunked loss (veomni/ops/loss.py) takes over the head's forward and returns the summed loss, a plain
    tensor already reduced over the tp group: that output passes through untouched.
    """

    def __init__(self):
        super().__init__(output_layouts=Shard(-1), use_local_output=False)


def dense_decoder_plan() -> Dict[str, ParallelStyle]:
    """Llama / Qwen2 / Qwen2.5 / Qwen3 (and any model with the same module names)."""
    return {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "model.layers.*.self_attn.q_proj": ColwiseParallel(),
        "model.layers.*.self_attn.k_proj": ColwiseParallel(),
        "model.layers.*.self_attn.v_proj": ColwiseParallel(),
        "model.layers.*.self_attn.o_proj": RowwiseParallel(),
        "model.layers.*.mlp.gate_proj": ColwiseParallel(),
        "model.layers.*.mlp.up_proj": ColwiseParallel(),
        "model.layers.*.mlp.down_proj": RowwiseParallel(),
        "lm_head": VocabParallelHead(),
    }


def qk_norm_decoder_plan() -> Dict[str, ParallelStyle]:
    """Qwen3: RMSNorm per head on q and k ([batch, seq, heads, head_dim]). Each rank holds only its heads, so the
    norm weight's gradient is a partial sum over heads: as a replicated DTensor over an input sharded on the head
    dim (torch's SequenceParallel on dim 2), autograd sums it over the tp group."""
    plan = dense_decoder_plan()
    plan["model.layers.*.self_attn.q_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
    plan["model.layers.*.self_attn.k_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
    return plan


TP_PLANS = {"llama": dense_decoder_plan, "qwen2": dense_decoder_plan, "qwen3": qk_norm_decoder_plan}

# (config attribute, what it is): each must divide by tp_size so every rank holds an equal share
_DIVISIBLE = (
    ("num_attention_heads", "attention heads"),
    ("num_key_value_heads", "key/value heads"),
    ("intermediate_size", "MLP intermediate size"),
    ("vocab_size", "vocabulary size"),
)


def get_tp_plan(model: nn.Module) -> Dict[str, ParallelStyle]:
    return TP_PLANS.get(getattr(model.config, "model_type", ""), dense_decoder_plan)()


def check_tp_divisibility(config, tp_size: int) -> None:
    config = getattr(config, "get_text_config", lambda: config)()
    bad = []
    for attr, what in _DIVISIBLE:
        value = getattr(config, attr, None)
        if value is not None and value % tp_size:
            bad.append(f"{what} ({attr}={value})")
    if bad:
        raise ValueError(
            f"tensor parallel: {', '.join(bad)} must divide by train.accelerator.tp_size={tp_size}; "
            "choose a tp_size that divides them"
        )


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh) -> nn.Module:
    """Shard `model` in place over `tp_mesh` by its plan; returns it. Tied parameters stay tied."""
    tp_size = tp_mesh.size()
    names = [name for name, _ in model.named_modules() if name]
    if getattr(model.config, "num_experts", None) or any("experts" in n for n in names):
        raise NotImplementedError(
            f"tensor parallel for MoE models ({type(model).__name__}) is not supported: use expert parallel "
            "(train.accelerator.extra_parallel_sizes / extra_parallel_names: [ep]) with tp_size=1"
        )
    check_tp_divisibility(model.config, tp_size)
    plan = get_tp_plan(model)
    missing = [pattern for pattern in plan if not any(fnmatch.fnmatchcase(n, pattern) for n in names)]
    if missing:
        raise ValueError(
            f"no tensor-parallel plan fits {type(model).__name__} (model_type "
            f"{getattr(model.config, 'model_type', None)!r}): these patterns of the plan match no module: "
            f"{missing}. Plans exist for {sorted(TP_PLANS)}; add one to veomni.distributed.tensor_parallel.TP_PLANS"
        )
    tied = tied_sources(model)
    explain_redistribute_notice(torch.distributed.get_rank())  # torch's per-rank notice: once, with its meaning
    parallelize_module(model, tp_mesh, plan)
    for name, source in tied.items():  # each style made its own DTensor of a tied weight: one for both again
        mine, first = model.get_parameter(name), model.get_parameter(source)
        if getattr(mine, "placements", None) != getattr(first, "placements", None):  # (None: not a DTensor)
            raise ValueError(
                f"tied parameter {name} gets placement {getattr(mine, 'placements', 'replicated')} but its twin "
                f"{source} {getattr(first, 'placements', 'replicated')}"
            )
    tie_again(model, tied)
    logger.info(f"tensor parallel over tp={tp_size}: {len(plan)} plan entries, {len(tied)} tied parameter(s)")
    return model
