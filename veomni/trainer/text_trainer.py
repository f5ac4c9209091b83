"""TextTrainer: pretraining on plain text, or SFT on conversations (`data.data_type: conversation`)."""

from functools import partial
from typing import Dict, Optional

import torch
import torch.distributed as dist

from ..arguments import ConfigError
from ..data import Batching, build_dataset, build_loader
from ..data.chat_template import build_chat_template, training_template_note
from ..data.data_report import data_report
from ..data.data_transform import process_pretrain_example, process_sft_example
from ..models import build_tokenizer
from ..utils.logging import get_logger
from .base import BaseTrainer

logger = get_logger(__name__)


class TextTrainer(BaseTrainer):
    def build_data_transform(self):
        """The record -> sample transform of `data` (VLMTrainer and DPOTrainer override it)."""
        data = self.args.data
        self.tokenizer = build_tokenizer(self.args.model.tokenizer_path, self.args.model.trust_remote_code)
        allowed = ("split", "truncate") if data.data_type == "plaintext" else ("error", "truncate")
        if data.over_length is not None and data.over_length not in allowed:
            raise ConfigError(
                f"data.over_length={data.over_length} does not apply to data.data_type {data.data_type}: use one "
                f"of {list(allowed)} (or null)"
            )
        if data.data_type == "plaintext":
            return partial(
                process_pretrain_example,
                tokenizer=self.tokenizer,
                max_seq_len=data.max_seq_len,
                text_keys=data.text_keys,
                split_long=data.over_length != "truncate",
            )
        return partial(
            process_sft_example,
            chat_template=self.conversation_template(data.last_turn_only),
            max_seq_len=data.max_seq_len,
            text_keys=conversation_keys(data),
            truncate=data.over_length == "truncate",
            conversation_format=data.conversation_format,
        )

    def conversation_template(self, last_turn_only: bool):
        """The chat template conversations train on (its jinja kept for the HF export); says (rank 0, once) which
        one trains, and warns when it is not the tokenizer's own (the one the exported model carries)."""
        data, own = self.args.data, getattr(self.tokenizer, "chat_template", None)
        chat_template = build_chat_template(
            data.chat_template, self.tokenizer, last_turn_only=last_turn_only, think_loss=data.think_loss
        )
        self.training_chat_template = chat_template.get_jinja_template() or None
        info, warning = training_template_note(chat_template, data.chat_template, own)
        if self.is_main:
            logger.info(info)
            if warning:
                logger.warning(warning)
        return chat_template

    def build_dataset(self):
        args = self.args
        data_kwargs = {k: v for k, v in vars(args.data).items() if k not in ("dataloader", "mm_configs")}
        transform = self.build_data_transform()
        return build_dataset(
            dataset_name=args.data.dataset_name, transform=transform, seed=args.train.seed, **data_kwargs
        )

    def build_dataloader(self):
        """This rank's loader of `train_dataset`; the warmup's length is set by the step plan (step_count.py)."""
        args, train, state = self.args, self.args.train, self.parallel_state
        batching = Batching(
            micro_batch_size=train.micro_batch_size,
            max_seq_len=args.data.max_seq_len,
            dataloader_batch_size=train.dataloader_batch_size,
            dyn_bsz=train.dyn_bsz,
            buffer_size=train.dyn_bsz_buffer_size,
            warmup_init_tokens=train.bsz_warmup_init_mbtoken,
            drop_last=args.data.dataloader.drop_last,
        )
        loader = args.data.dataloader
        return build_loader(
            self.train_dataset,
            self.build_collator(),
            batching,
            state.dp_rank,
            state.dp_size,
            num_workers=loader.num_workers,
            pin_memory=loader.pin_memory,
            prefetch_factor=loader.prefetch_factor,
            seed=train.seed,
            allow_changed_data=args.data.allow_changed_data,
        )

    def collate_fn_kwargs(self):
        """MainCollator's keyword arguments (VLMTrainer adds its per-key collate infos)."""
        return dict(super().collate_fn_kwargs(), pad_token_id=self.tokenizer.pad_token_id or 0)

    def on_train_end(self) -> None:
        """One account of the data over all ranks, on rank 0: bad records skipped always; what the last epoch left
        out (empty records, blank lines, a tail too small for a step, streamed records not reached) only when the
        epoch ran to the end of its data, not when train.max_steps stopped it. Collective (every rank alike)."""
        ended = self.data_ran_out or self.whole_epochs
        report = data_report(self.train_dataloader, count_unread=ended)
        names = ("skipped", "empty", "blank", "dropped", "unread", "samples")
        # a whole-dataset count is the same on every rank: averaged, not summed (samples are always this rank's)
        share = dist.get_world_size(self.parallel_state.dp_group) if report["whole_dataset"] else 1
        counts = torch.tensor(
            [report.get(n, 0) * (1 if n == "samples" else 1 / share) for n in names], dtype=torch.float64
        ).to(self.device)
        dist.all_reduce(counts, group=self.parallel_state.dp_group)
        total = {n: round(c) for n, c in zip(names, counts.tolist())}
        if not self.is_main:
            return
        if total["skipped"]:
            logger.warning(f"skipped {total['skipped']} bad samples (data.skip_bad_samples)")
        if ended and left_out_message(total):
            logger.warning(left_out_message(total))


def conversation_keys(data) -> str:
    """The record key of a conversation: `data.text_keys`, read as `messages` when left at its default `text`."""
    return "messages" if data.text_keys == "text" else data.text_keys


_LEFT_OUT = {"empty": "empty records", "blank": "blank lines", "dropped": "samples of a tail too small for a step",
             "unread": "streamed records not reached when a slot ran out"}  # fmt: skip


def left_out_message(total: Dict[str, int]) -> Optional[str]:
    """What an epoch left out, naming only the kinds it left some of; None when it left out nothing."""
    parts = [f"{total[k]:,} {what}" for k, what in _LEFT_OUT.items() if total.get(k)]
    return f"the last epoch left out {', '.join(parts)} ({total['samples']:,} samples handed out)" if parts else None
