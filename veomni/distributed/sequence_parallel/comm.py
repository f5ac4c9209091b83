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
    """An all-to-all in flight: `.wait()` -> [B, N / sp, sp * M, D] (for q/k/v: the rank's heads over the full
    sequence)."""

    def __init__(self, received: torch.Tensor, batch: int, n: int, m: int, dim: int, sp: int):
        self.received, self.shape = received, (batch, n, m, dim, sp)

    def wait(self) -> torch.Tensor:
        batch, n, m, dim, sp = self.shape
        # received: [source rank, B, N/sp, M, D] -> the source ranks' blocks side by side on dim 2, in rank order
        return self.received.view(sp, batch, n, m, dim).permute(1, 2, 0, 3, 4).reshape(batch, n, sp * m, dim)


def _launch(x: torch.Tensor, group: dist.ProcessGroup) -> PendingHeads:
    """The one Ulysses exchange, both directions: [B, N, M, D] -> (pending) [B, N / sp, sp * M, D], where block r of
    dim 1 goes to rank r."""
    sp = dist.get_world_size(group)
    batch, n, m, dim = x.shape
    send = x.reshape(batch, sp, n // sp, m, dim).transpose(0, 1).contiguous()  # one contiguous chunk per rank
    return PendingHeads(all_to_all_single_autograd(send, None, None, group), batch, n // sp, m, dim, sp)


def launch_seq_to_heads(x: torch.Tensor, group: dist.ProcessGroup) -> PendingHeads:
    """[B, H, S, D] sequence shard -> (pending) [B, H / sp, sp * S, D]; H must divide by the group size."""
    sp, heads = dist.get_world_size(group), x.shape[1]
    if heads % sp:
        raise ValueError(f"{heads} heads do not split over ulysses_size={sp}")
    return _launch(x, group)


def heads_to_seq(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """[B, sp * S, H / sp, D] (attention output for this rank's heads) -> [B, S, H, D] for this rank's shard."""
    return _launch(x, group).wait()


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
