"""Packed-sequence boundaries from position ids, in the form flash attention's varlen kernels take
(VeOmni's `veomni.utils.seqlen_pos_transform_utils`; verl's VeOmni engine calls it on every packed micro-batch).
"""

from typing import Tuple

import torch


def prepare_fa_kwargs_from_position_ids(
    position_ids: torch.Tensor,
) -> Tuple[Tuple[torch.Tensor, torch.Tensor], Tuple[int, int]]:
    """`((cu_seq_lens_q, cu_seq_lens_k), (max_length_q, max_length_k))` of a packed row: a document starts wherever
    the position id is 0 (and the first token always starts one). `position_ids` is (1, total) or (total,);
    cu_seq_lens are int32 on its device, the max lengths Python ints (flash attention takes them as ints).

    These are the kwargs names transformers passes to attention (`cu_seq_lens_q`, ...): `veomni_varlen` and the
    Ulysses wrapper read them, so under sequence parallelism they must describe the whole (unsharded) row.
    """
    flat = position_ids.reshape(-1)
    if flat.numel() == 0:
        raise ValueError("prepare_fa_kwargs_from_position_ids: empty position_ids")
    starts = flat == 0
    starts[0] = True
    index = starts.nonzero().reshape(-1).to(torch.int32)
    cu = torch.cat([index, index.new_tensor([flat.numel()])])
    max_length = int((cu[1:] - cu[:-1]).max())
    return (cu, cu), (max_length, max_length)
