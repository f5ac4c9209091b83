"""The Ulysses exchanges: all-to-alls that trade a sequence shard of every head for every token of some heads.

Both directions carry autograd (the backward of one is the other) through torch's functional collectives, whose
result is waited for lazily: `launch_seq_to_heads` returns at once, and only `.wait()` (or the first use of the
tensor) blocks. The async attention uses that to send Q while K and V are still being projected.

Layouts follow transformers' attention interface: q/k/v come in as [B, H, S_local, D]; the attention output comes
back as [B, S_global, H_local, D].
"""

import math

import torch
import torch.distributed as dist

from ...compat.torch import all_to_all_single_autograd


class PendingHeads:
    """An all-to-all in flight: `.wait()` -> [B, H / sp, S * sp, D] (the rank's heads over the full sequence)."""

    def __init__(self, received: torch.Tensor, batch: int, heads: int, seq: int, dim: int, sp: int):
        self.received, self.shape = received, (batch, heads, seq, dim, sp)

    def wait(self) -> torch.Tensor:
        batch, heads, seq, dim, sp = self.shape
        # received: [source rank (= its sequence shard), B, H/sp, S, D] -> [B, H/sp, sp * S, D]
        return (
            self.received.view(sp, batch, heads, seq, dim).permute(1, 2, 0, 3, 4).reshape(batch, heads, sp * seq, dim)
        )


def launch_seq_to_heads(x: torch.Tensor, group: dist.ProcessGroup) -> PendingHeads:
    """[B, H, S, D] sequence shard -> (pending) [B, H / sp, sp * S, D]; H must divide by the group size."""
    sp = dist.get_world_size(group)
    batch, heads, seq, dim = x.shape
    if heads % sp:
        raise ValueError(f"{heads} heads do not split over ulysses_size={sp}")
    # rank r receives head block r: put the head blocks first, one contiguous chunk per destination
    send = x.reshape(batch, sp, heads // sp, seq, dim).transpose(0, 1).contiguous()
    received = all_to_all_single_autograd(send, None, None, group)
    return PendingHeads(received, batch, heads // sp, seq, dim, sp)


def heads_to_seq(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """[B, sp * S, H / sp, D] (attention output for this rank's heads) -> [B, S, H, D] for this rank's shard."""
    sp = dist.get_world_size(group)
    batch, total, heads, dim = x.shape
    seq = total // sp
    send = x.reshape(batch, sp, seq, heads, dim).transpose(0, 1).contiguous()  # one sequence shard per destination
    received = all_to_all_single_autograd(send, None, None, group)  # [source rank (= its heads), B, S, H/sp, D]
    return received.view(sp, batch, seq, heads, dim).permute(1, 2, 0, 3, 4).reshape(batch, seq, sp * heads, dim)


def kv_replication(kv_heads: int, q_heads: int, sp: int) -> int:
    """How many copies of each KV head make the KV heads split over `sp` ranks in step with the query heads.

    With kv_heads % sp == 0 nothing is copied. Otherwise each KV head is repeated r = sp / gcd(kv_heads, sp)
    times, so that rank i's query heads [i*H/sp, (i+1)*H/sp) find exactly their KV heads among its share.
    """
    if q_heads % sp:
        raise ValueError(f"num_attention_heads={q_heads} is not divisible by ulysses_size={sp}")
    repeat = sp // math.gcd(kv_heads, sp)
    if q_heads % (kv_heads * repeat):
        raise ValueError(f"{kv_heads} KV heads cannot be spread over ulysses_size={sp} with {q_heads} query heads")
    return repeat


def repeat_kv_heads(x: torch.Tensor, repeat: int) -> torch.Tensor:
    """[B, Hkv, S, D] -> [B, Hkv * repeat, S, D], each head's copies adjacent (head h serves query group h)."""
    return x.repeat_interleave(repeat, dim=1) if repeat > 1 else x
