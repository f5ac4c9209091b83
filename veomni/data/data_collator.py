"""MainCollator: packs a micro-batch of samples into one row (no padding) with the metadata attention needs.

Labels come out shifted (`labels[t]` is the target of position t, veomni.ops.loss): each document's first label is
masked, then the packed row shifts by one, so the last token of a document, whose next token opens another
document, predicts nothing, and a Ulysses shard sliced afterwards holds its own targets. The same tensor is also
given as `shift_labels`, transformers' name for pre-shifted labels, so `model(**micro_batch).loss` computes the same
loss without shifting a second time. `position_ids` restart at every document, which is what block-diagonal
(varlen) attention keys on; `cu_seq_lens_*` / `max_length_*` serve flash-attention varlen kernels.
"""

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

import torch

from ..ops.loss import shift_labels
from .data_transform import IGNORE_INDEX


@dataclass
class DataCollateInfo:
    pack_dim: int = 0  # -1: concatenate along the last dim and add a batch dim of 1
    sp_slice: bool = False  # slice this field along the sequence for sequence-parallel ranks
    sp_pad_value: Optional[int] = None  # pad value to make the sequence divisible by sp_size; None: no padding
    sp_pad_scale: int = 1  # sp padding makes the field a multiple of sp_size * sp_pad_scale along pack_dim
    # (merge_size**2 for vision patches: each rank then holds whole merged tokens)


@dataclass
class MainCollator:
    collate_infos: Optional[Dict[str, DataCollateInfo]] = None  # added to (or overriding) the text fields' own
    seq_classification: bool = False
    pad_to_length: bool = False
    max_seq_len: Optional[int] = None
    pad_token_id: int = 0
    sp_size: Optional[int] = None  # Ulysses group size and this rank's place in it: given by whoever builds the
    sp_rank: Optional[int] = None  # collator (build_dataloader, the trainers); None: no sequence parallel

    def __post_init__(self):
        self.collate_infos = {
            "input_ids": DataCollateInfo(pack_dim=-1, sp_slice=True, sp_pad_value=0),
            "labels": DataCollateInfo(pack_dim=-1, sp_slice=True, sp_pad_value=IGNORE_INDEX),
            "position_ids": DataCollateInfo(pack_dim=-1, sp_slice=True, sp_pad_value=0),
            "attention_mask": DataCollateInfo(pack_dim=-1, sp_slice=False, sp_pad_value=0),
            **(self.collate_infos or {}),
        }
        if self.sp_size is None:  # left to guess, it would pack whole rows on every rank of a Ulysses group: refuse
            from ..distributed.parallel_state import parallel_state_or_none

            state = parallel_state_or_none()
            if state is not None and state.sp_enabled:
                raise ValueError(
                    f"MainCollator under Ulysses sequence parallel (ulysses_size={state.sp_size}) needs sp_size and "
                    "sp_rank (this rank's slice of each row): pass sp_size=state.sp_size, sp_rank=state.sp_rank, or "
                    "build it through build_dataloader"
                )
            self.sp_size = 1
        self.sp_rank = self.sp_rank or 0

    def __call__(self, samples: Sequence[Dict[str, Any]]) -> Dict[str, torch.Tensor]:
        if not samples:
            raise ValueError("MainCollator got an empty micro-batch")
        lengths = [len(s["input_ids"]) for s in samples]
        batch: Dict[str, Any] = {}
        # the union of keys: text-only samples may sit beside multimodal ones in one micro-batch
        for key in dict.fromkeys(k for s in samples for k in s):
            if key == "attention_mask":  # packed rows attend block-diagonally by position_ids, not by a mask
                continue
            info = self.collate_infos.get(key, DataCollateInfo())
            if info.pack_dim == -1:  # per-token fields: concatenate along the sequence, batch dim just before it
                values = [_per_token(s, key, n, samples, info) for s, n in zip(samples, lengths)]
                batch[key] = torch.cat(values, dim=-1).unsqueeze(-2)
            else:  # per-item fields (vision patches, grids, audio features): stacked in sample order
                batch[key] = torch.cat([torch.as_tensor(s[key]) for s in samples if key in s], dim=info.pack_dim)
        if "position_ids" not in batch:
            batch["position_ids"] = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
        if "labels" in batch and not self.seq_classification:
            starts = torch.tensor([0] + lengths[:-1]).cumsum(0)
            batch["labels"][..., 0, starts[1:]] = IGNORE_INDEX  # no position predicts across a document border
            batch["labels"] = shift_labels(batch["labels"])
        if self.pad_to_length and self.max_seq_len is not None:
            self._pad(batch, lengths)
        if self.sp_size > 1:  # padded, then this rank's slice of each sequence-parallel field
            self._pad_for_sp(batch, lengths)
            for key, info in self.collate_infos.items():
                if key in batch and info.sp_slice:
                    batch[key] = batch[key].chunk(self.sp_size, dim=info.pack_dim)[self.sp_rank].contiguous()
        cu = torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        batch["cu_seq_lens_q"] = batch["cu_seq_lens_k"] = cu
        batch["max_length_q"] = batch["max_length_k"] = max(lengths)
        if "labels" in batch and not self.seq_classification:
            batch["shift_labels"] = batch["labels"]
        return batch

    def _pad_for_sp(self, batch: Dict[str, torch.Tensor], lengths: List[int]) -> None:
        """Pad to a multiple of sp_size (the labels are shifted already: each rank's slice holds its own targets)."""
        pad = -sum(lengths) % self.sp_size
        for key, info in self.collate_infos.items():
            if key not in batch or info.sp_pad_value is None:
                continue
            value = batch[key]
            width = -value.shape[info.pack_dim] % (self.sp_size * info.sp_pad_scale)  # its own length, padded
            if width:
                batch[key] = _padded(key, value, width, info.pack_dim, info.sp_pad_value)
        if pad:
            lengths.append(pad)

    def _pad(self, batch: Dict[str, torch.Tensor], lengths: List[int]) -> None:
        """Pad the packed row to `max_seq_len` as one extra document that carries no loss."""
        pad = self.max_seq_len - sum(lengths)
        if pad <= 0:
            return
        fill = {"labels": IGNORE_INDEX, "input_ids": self.pad_token_id}
        for key, value in batch.items():
            per_token = value.dim() >= 2 and value.shape[-2:-1] == (1,) and value.shape[-1] == sum(lengths)
            if key == "position_ids" or per_token:
                batch[key] = _padded(key, value, pad, -1, fill.get(key, 0))
        lengths.append(pad)


def _padded(key: str, value: torch.Tensor, width: int, dim: int, fill: int) -> torch.Tensor:
    """`value` with `width` more entries along `dim`: `fill`, or for position ids one more document's positions."""
    if key == "position_ids":
        filler = torch.arange(width).expand(*value.shape[:-1], width)
    else:
        shape = list(value.shape)
        shape[dim] = width
        filler = torch.full(shape, fill, dtype=value.dtype)
    return torch.cat([value, filler], dim=dim)


def _per_token(sample, key: str, length: int, samples, info: DataCollateInfo) -> torch.Tensor:
    """`sample[key]`, or where this sample lacks the field (a text-only sample among multimodal ones) its neutral
    value: plain positions (as many rows as the others' M-RoPE ids), else the field's pad value."""
    if key in sample:
        return torch.as_tensor(sample[key])
    like = next(torch.as_tensor(s[key]) for s in samples if key in s)
    return _padded(key, like[..., :0], length, -1, info.sp_pad_value or 0)
