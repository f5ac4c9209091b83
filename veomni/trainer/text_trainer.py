"""TextTrainer: pretraining on plain text, or SFT on conversations (`data.data_type: conversation`)."""

from functools import partial

from ..data import build_dataloader, build_dataset
from ..data.chat_template import build_chat_template
from ..data.data_loader import data_report
from ..data.data_transform import process_pretrain_example, process_sft_example
from ..models import build_tokenizer
from ..utils.logging import get_logger
from .base import BaseTrainer

logger = get_logger(__name__)


class TextTrainer(BaseTrainer):
    def build_transform(self):
        data = self.args.data
        self.tokenizer = build_tokenizer(self.args.model.tokenizer_path, self.args.model.trust_remote_code)
        if data.data_type == "plaintext":
            return partial(
                process_pretrain_example,
                tokenizer=self.tokenizer,
                max_seq_len=data.max_seq_len,
                text_keys=data.text_keys,
            )
        chat_template = build_chat_template(data.chat_template, self.tokenizer)
        text_keys = "messages" if data.text_keys == "text" else data.text_keys
        return partial(
            process_sft_example, chat_template=chat_template, max_seq_len=data.max_seq_len, text_keys=text_keys
        )

    def build_dataset(self):
        args = self.args
        data_kwargs = {k: v for k, v in vars(args.data).items() if k != "dataloader"}
        return build_dataset(
            dataset_name=args.data.dataset_name, transform=self.build_transform(), seed=args.train.seed, **data_kwargs
        )

    def build_dataloader(self):
        args = self.args
        loader = args.data.dataloader
        return build_dataloader(
            dataloader_type=loader.type,
            dataset=self.train_dataset,
            micro_batch_size=args.train.micro_batch_size,
            global_batch_size=args.train.global_batch_size,
            dataloader_batch_size=args.train.dataloader_batch_size,
            max_seq_len=args.data.max_seq_len,
            train_steps=args.train.train_steps,
            dyn_bsz=args.train.dyn_bsz,
            bsz_warmup_ratio=args.train.bsz_warmup_ratio,
            bsz_warmup_init_mbtoken=args.train.bsz_warmup_init_mbtoken,
            dyn_bsz_buffer_size=args.train.dyn_bsz_buffer_size,
            num_workers=loader.num_workers,
            drop_last=loader.drop_last,
            pin_memory=loader.pin_memory,
            prefetch_factor=loader.prefetch_factor,
            seed=args.train.seed,
            collate_fn_kwargs=self.collate_fn_kwargs(),
        )

    def collate_fn_kwargs(self):
        """MainCollator's keyword arguments (VLMTrainer adds its per-key collate infos)."""
        return {"pad_token_id": self.tokenizer.pad_token_id or 0}

    def on_train_end(self) -> None:
        # a streamed epoch ends at the first step a slot cannot fill: what the other slots had left is said here
        ended = getattr(self.train_dataloader, "epoch_ended", False)
        report = data_report(self.train_dataloader, count_unread=ended)
        if report.get("unread"):
            logger.warning(
                f"{report['unread']} streamed records of this rank's share were not reached when the epoch ended "
                "(a slot ran out first; more or finer units, or fewer slots per step, leave less)"
            )
        if report["skipped"]:
            logger.warning(f"skipped {report['skipped']} bad samples on this rank (data.skip_bad_samples)")
        if report["empty"] or report["blank"] or report["dropped"]:
            logger.warning(
                f"data of the last epoch on this rank left out: {report['empty']} empty records, {report['blank']} "
                f"blank lines, {report['dropped']} samples of a tail too small for a step "
                f"({report['samples']} samples handed out)"
            )
