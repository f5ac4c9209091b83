"""Async Ulysses: each projection's all-to-all is in flight while the next projection is computed.

The attention interface sees q, k and v only once all three exist, so overlapping their exchanges with the
projections needs the attention module's own forward. Llama, Qwen2, Qwen3 and Qwen3-MoE share one structure
(q/k/v/o projections, optional per-head q/k RMSNorm, rotary embedding from `position_embeddings`), so one adapter
serves them all; it keeps the modules' weights and submodules and calls them, and takes `rotate_half` from the
module's own modeling file:

    q = rope(norm(q_proj(h)))  -> send q   (in flight while ...)
    k = rope(norm(k_proj(h)))  -> send k   (... k, then v, are projected)
    v = v_proj(h)              -> send v
    wait; attention over the full sequence for this rank's heads; send back; o_proj

It computes exactly what the synchronous path computes (same ops, same order); tests compare them to 1e-6.
A module of another shape keeps its own forward and runs synchronous Ulysses through the attention interface.
"""

import types
from typing import Set, Tuple

import torch

from ...compat.transformers import bind_instance_method, config_attn_implementation, modeling_global
from .comm import kv_replication, launch_seq_to_heads, repeat_kv_heads
from .ulysses import PREFIX, attend_heads, sp_group

SUPPORTED = ("LlamaAttention", "Qwen2Attention", "Qwen3Attention", "Qwen3MoeAttention")


def async_ulysses_forward(self, hidden_states, position_embeddings, attention_mask, past_key_values=None, **kwargs):
    if past_key_values is not None:
        raise ValueError("Ulysses sequence parallelism is for training: no KV cache")
    group = sp_group()
    rotate_half = modeling_global(self, "rotate_half")
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)
    cos, sin = (t.unsqueeze(1) for t in position_embeddings)

    def project(proj, norm, rope: bool) -> torch.Tensor:
        x = proj(hidden_states).view(hidden_shape)
        x = (norm(x) if norm is not None else x).transpose(1, 2)
        return (x * cos) + (rotate_half(x) * sin) if rope else x

    query = launch_seq_to_heads(project(self.q_proj, getattr(self, "q_norm", None), True), group)
    key = project(self.k_proj, getattr(self, "k_norm", None), True)
    repeat = kv_replication(key.shape[1], self.config.num_attention_heads, group.size())
    key = launch_seq_to_heads(repeat_kv_heads(key, repeat), group)
    value = launch_seq_to_heads(repeat_kv_heads(project(self.v_proj, None, False), repeat), group)
    out = attend_heads(
        self,
        query,
        key,
        value,
        attention_mask,
        config_attn_implementation(self.config)[len(PREFIX) :],
        group,
        dropout=0.0 if not self.training else self.attention_dropout,
        scaling=self.scaling,
        sliding_window=getattr(self, "sliding_window", None),
        **kwargs,
    )
    return self.o_proj(out.reshape(*input_shape, -1).contiguous()), None


def patch_async_attention(model: torch.nn.Module) -> Tuple[int, Set[str]]:
    """Give every supported attention module the overlapped forward; returns (how many, names of the others)."""
    patched, skipped = 0, set()
    for module in model.modules():
        name = type(module).__name__
        if name in SUPPORTED:
            bind_instance_method(module, "forward", types.MethodType(async_ulysses_forward, module))
            patched += 1
        elif name.endswith("Attention") and hasattr(module, "q_proj"):
            skipped.add(name)
    return patched, skipped
