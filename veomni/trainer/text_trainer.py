"""TextTrainer: pretraining on plain text (and, with data_type=conversation, SFT on chats)."""

from functools import partial

from ..data import build_dataloader, build_dataset
from ..data.data_transform import process_pretrain_example
from ..models import build_tokenizer
from .base import BaseTrainer


class TextTrainer(BaseTrainer):
    def build_transform(self):
        data = self.args.data
        self.tokenizer = build_tokenizer(self.args.model.tokenizer_path)
        if data.data_type == "plaintext":
            return partial(
                process_pretrain_example,
                tokenizer=self.tokenizer,
                max_seq_len=data.max_seq_len,
                text_keys=data.text_keys,
            )
        raise NotImplementedError(f"data.data_type={data.data_type!r} is not supported yet")

    def build_dataset(self):
        args = self.args
        data_kwargs = {k: v for k, v in vars(args.data).items() if k != "dataloader"}
        return build_dataset(transform=self.build_transform(), seed=args.train.seed, **data_kwargs)

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
            collate_fn_kwargs={"pad_token_id": self.tokenizer.pad_token_id or 0},
        )
