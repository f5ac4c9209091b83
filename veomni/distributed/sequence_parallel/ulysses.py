"""Ulysses sequence parallelism as a transformers attention implementation that wraps another one.

`apply_ulysses(model)` renames the model's attention implementation `X` to `veomni_ulysses:X` (registered with
transformers' AttentionInterface on first use). Every attention call then:

    q, k, v [B, H, S/sp, D]  --all-to-all-->  [B, H/sp, S, D]      (sequence shards -> head shards)
    X(q, k, v) on the FULL packed sequence for this rank's heads (global cu_seq_lens / position_ids)
    out [B, S, H/sp, D]      --all-to-all-->  [B, S/sp, H, D]      (back to this rank's sequence shard)

so any model that calls the attention interface (dense, MoE, a VL model's text tower) is sequence-parallel with
no code of its own. Document boundaries come from the collator's global `cu_seq_lens_q/k` (or, failing that, from
the position ids gathered over the sp group); the sp padding is a document of its own, so it never attends into
real tokens, and its labels are ignored. Kernels that read document boundaries themselves (veomni_varlen,
flash_attention_2/3) get them as kwargs; the others (sdpa, eager) get a block-diagonal causal mask built here.
GQA with fewer KV heads than ulysses_size repeats each KV head just enough to split them over the ranks.
"""

from typing import Dict, Optional, Tuple

import torch
import torch.distributed as dist
from torch.utils.weak import WeakTensorKeyDictionary
from transformers import AttentionInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ...compat.transformers import config_attn_implementation, modeling_global, set_config_attn_implementation
from ...ops.attention import VARLEN, _cu_seqlens_from_position_ids
from ...utils.collectives import gather_seq
from .comm import PendingHeads, heads_to_seq, kv_replication, launch_seq_to_heads, repeat_kv_heads

PREFIX = "veomni_ulysses:"
# kernels that take packed-document boundaries from cu_seq_lens / position_ids kwargs (no mask needed)
_READS_BOUNDARIES = {VARLEN, "flash_attention_2", "flash_attention_3"}


def sp_group() -> dist.ProcessGroup:
    from ..parallel_state import get_parallel_state

    return get_parallel_state().sp_group


class _LocalHeads:
    """The attention module as the inner kernel must see it when KV heads were repeated: eager/sdpa repeat KV by
    `num_key_value_groups`, which is now (local query heads) / (local KV heads)."""

    def __init__(self, module: torch.nn.Module, groups: int):
        self._module, self.num_key_value_groups = module, groups

    def __getattr__(self, name):
        return getattr(self._module, name)


def _inner_function(module: torch.nn.Module, inner: str):
    if inner == "eager":  # each modeling file has its own eager attention; use the module's
        return modeling_global(module, "eager_attention_forward")
    return ALL_ATTENTION_FUNCTIONS.get_interface(inner, None)


_GATHERED_POSITIONS = WeakTensorKeyDictionary()  # a forward's local position ids -> the whole sequence's


def _global_position_ids(position_ids: torch.Tensor, group) -> torch.Tensor:
    """Position ids of the whole sequence, gathered once per forward: every layer receives the same tensor, and the
    gathered copy lives as long as it does."""
    cached = _GATHERED_POSITIONS.get(position_ids)
    if cached is None:
        cached = _GATHERED_POSITIONS[position_ids] = gather_seq(position_ids, group, dim=-1)
    return cached


def _document_mask(cu: torch.Tensor, total: int, window: Optional[int], device) -> torch.Tensor:
    """[1, 1, T, T] boolean block-diagonal causal mask (for kernels that do not read cu_seq_lens)."""
    doc = torch.bucketize(torch.arange(total, device=device), cu[1:].to(device), right=True)
    i = torch.arange(total, device=device)
    mask = (doc[:, None] == doc[None, :]) & (i[:, None] >= i[None, :])
    if window:
        mask = mask & (i[:, None] - i[None, :] < window)
    return mask[None, None]


def _global_kwargs(kwargs: Dict, group, total: int) -> Dict:
    """The attention kwargs for the full sequence: position ids gathered; cu_seq_lens must already be global."""
    out = dict(kwargs)
    if torch.is_tensor(out.get("position_ids")) and out["position_ids"].shape[-1] * dist.get_world_size(group) == total:
        out["position_ids"] = _global_position_ids(out["position_ids"], group)
    cu = out.get("cu_seq_lens_q")
    if cu is not None and int(cu[-1]) != total:
        raise ValueError(
            f"cu_seq_lens_q covers {int(cu[-1])} tokens but the gathered sequence has {total}: under sequence "
            "parallelism the collator must emit the boundaries of the whole (unsharded) packed row"
        )
    return out


def launch_qkv(query, key, value, group) -> Tuple[PendingHeads, PendingHeads, PendingHeads]:
    """Start the three exchanges (sync path: all three in flight together), KV heads repeated as sp needs."""
    repeat = kv_replication(key.shape[1], query.shape[1], dist.get_world_size(group))
    key, value = repeat_kv_heads(key, repeat), repeat_kv_heads(value, repeat)
    return tuple(launch_seq_to_heads(x, group) for x in (query, key, value))


def attend_heads(
    module: torch.nn.Module,
    query: PendingHeads,
    key: PendingHeads,
    value: PendingHeads,
    attention_mask: Optional[torch.Tensor],
    inner: str,
    group,
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    sliding_window: Optional[int] = None,
    **kwargs,
) -> torch.Tensor:
    """Wait for the head shards, run `inner` attention on the full sequence, return [B, S_local, H, D]."""
    q, k, v = query.wait(), key.wait(), value.wait()
    batch, heads, total, _ = q.shape
    if attention_mask is not None:
        raise ValueError(
            "sequence parallelism attends by document boundaries (cu_seq_lens / position_ids), not by an "
            "attention_mask: pack the batch with MainCollator"
        )
    kwargs = _global_kwargs(kwargs, group, total)
    if inner not in _READS_BOUNDARIES:
        cu = kwargs.get("cu_seq_lens_q")
        if cu is None and torch.is_tensor(kwargs.get("position_ids")):
            cu = _cu_seqlens_from_position_ids(kwargs["position_ids"][:1])
        if batch != 1 and cu is not None:
            raise ValueError(f"attn_implementation={inner} under sequence parallelism needs one packed row")
        if cu is not None:
            attention_mask = _document_mask(cu, total, sliding_window, q.device)
            if inner == "eager":  # eager attention adds its mask to the scores
                blocked = torch.finfo(q.dtype).min
                attention_mask = q.new_zeros(attention_mask.shape).masked_fill(~attention_mask, blocked)
    proxy = module if heads == k.shape[1] * module.num_key_value_groups else _LocalHeads(module, heads // k.shape[1])
    out, _ = _inner_function(module, inner)(
        proxy, q, k, v, attention_mask, dropout=dropout, scaling=scaling, sliding_window=sliding_window, **kwargs
    )
    return heads_to_seq(out, group)


# eager under compiled decoder layers, as the attention it wraps
@torch.compiler.disable
def ulysses_attention_forward(module, query, key, value, attention_mask, **kwargs):
    """The registered `veomni_ulysses:<inner>` attention: [B, H, S/sp, D] in, ([B, S/sp, H, D], None) out."""
    inner = config_attn_implementation(module.config)[len(PREFIX) :]
    group = sp_group()
    q, k, v = launch_qkv(query, key, value, group)
    return attend_heads(module, q, k, v, attention_mask, inner, group, **kwargs), None


def ulysses_name(inner: Optional[str]) -> str:
    """Register (once) and return the Ulysses wrapper of attention implementation `inner`."""
    inner = inner or "sdpa"
    if inner.startswith(PREFIX):
        return inner
    if inner not in ("eager", "sdpa") and inner not in ALL_ATTENTION_FUNCTIONS:
        raise ValueError(f"attn_implementation {inner!r} is not registered with transformers' AttentionInterface")
    name = PREFIX + inner
    if name not in ALL_ATTENTION_FUNCTIONS:
        AttentionInterface.register(name, ulysses_attention_forward)
    return name


def apply_ulysses(model: torch.nn.Module) -> str:
    """Make `model`'s language-model attention Ulysses sequence-parallel over the parallel state's sp group.

    Wraps whatever attention implementation the (text) config names; returns the new name. No mask function is
    registered for it: transformers then builds no mask, and the wrapper attends by the global document boundaries
    instead. (The overlapped attention of `enable_async` is apply_sp's next step: async_attention.py.)
    """
    config = model.config.get_text_config()
    name = ulysses_name(config_attn_implementation(config))
    set_config_attn_implementation(config, name)
    return name
