"""The seed's plain training script: every building block called by hand, no trainer class.

bash train.sh tasks/deprecated_task/train_torch.py configs/text/demo.yaml

It saves no checkpoints, so SIGINT/SIGTERM end it at once (exit 130/143); errors end every rank promptly with
the message said once (exit 1). See veomni.trainer.lifecycle.
"""

import json
import os
import time
from dataclasses import asdict
from functools import partial

import torch
import torch.distributed as dist

from veomni.arguments import VeOmniArguments, parse_args, save_args
from veomni.compat.transformers import no_split_modules
from veomni.data import build_dataloader, build_dataset
from veomni.data.data_transform import process_pretrain_example
from veomni.distributed import clip_grad_norm
from veomni.distributed.parallel_state import destroy_parallel_state, init_parallel_state_from_config
from veomni.distributed.torch_parallelize import build_parallelize_model
from veomni.models import build_foundation_model, build_tokenizer
from veomni.ops import count_loss_tokens, lm_loss_sum
from veomni.optim import build_lr_scheduler, build_optimizer
from veomni.trainer import lifecycle
from veomni.trainer.task import user_error_types
from veomni.utils import get_device, get_device_type, get_logger

logger = get_logger("train_torch")


def main():
    args = parse_args(VeOmniArguments)
    torch.manual_seed(args.train.seed)
    parallel_state = init_parallel_state_from_config(args.train.accelerator)
    out = args.train.checkpoint.output_dir
    if parallel_state.is_main_process:
        save_args(args, out)

    tokenizer = build_tokenizer(args.model.tokenizer_path)
    transform = partial(
        process_pretrain_example, tokenizer=tokenizer, max_seq_len=args.data.max_seq_len, text_keys=args.data.text_keys
    )
    data_args = {k: v for k, v in asdict(args.data).items() if k != "dataloader"}
    train_dataset = build_dataset(transform=transform, seed=args.train.seed, **data_args)
    dataset_length = None if not hasattr(train_dataset, "__len__") else len(train_dataset)
    if args.data.datasets_type == "mapping":
        dataset_length = dataset_length / args.train.accelerator.dp_size
    args.compute_train_steps(dataset_length)
    train_steps = args.train_steps

    train_dataloader = build_dataloader(
        dataloader_type=args.data.dataloader.type,
        dataset=train_dataset,
        micro_batch_size=args.train.micro_batch_size,
        global_batch_size=args.train.global_batch_size,
        dataloader_batch_size=args.train.dataloader_batch_size,
        max_seq_len=args.data.max_seq_len,
        train_steps=train_steps,
        dyn_bsz=args.train.dyn_bsz,
        bsz_warmup_ratio=args.train.bsz_warmup_ratio,
        bsz_warmup_init_mbtoken=args.train.bsz_warmup_init_mbtoken,
        dyn_bsz_buffer_size=args.train.dyn_bsz_buffer_size,
        num_workers=args.data.dataloader.num_workers,
        drop_last=args.data.dataloader.drop_last,
        pin_memory=args.data.dataloader.pin_memory,
        prefetch_factor=args.data.dataloader.prefetch_factor,
        seed=args.train.seed,
    )

    mixed = args.train.accelerator.fsdp_config.mixed_precision
    model = build_foundation_model(
        config_path=args.model.config_path,
        weights_path=args.model.model_path,
        init_device=args.train.init_device,
        torch_dtype="float32" if mixed.enable or get_device_type() == "cpu" else "bfloat16",
        attn_implementation=args.model.ops_implementation.attn_implementation,
        moe_implementation=args.model.ops_implementation.moe_implementation,
    )
    fsdp = args.train.accelerator.fsdp_config
    model = build_parallelize_model(
        model,
        init_device=args.train.init_device,
        weights_path=args.model.model_path,
        enable_full_shard=fsdp.full_shard,
        enable_reshard_after_forward=fsdp.reshard_after_forward,
        mixed_precision=fsdp.mixed_precision,
        enable_gradient_checkpointing=args.train.gradient_checkpointing.enable,
        enable_fsdp_offload=fsdp.offload,
        basic_modules=list(set(no_split_modules(model)) | set(args.model.basic_modules)),
        enable_reentrant=args.train.gradient_checkpointing.enable_reentrant,
        enable_forward_prefetch=fsdp.forward_prefetch,
        broadcast_model_weights_from_rank0=args.train.broadcast_model_weights_from_rank0,
        max_load_broadcast_size=fsdp.max_load_broadcast_size,
    )
    opt = args.train.optimizer
    optimizer = build_optimizer(
        model, lr=opt.lr, weight_decay=opt.weight_decay, betas=opt.betas, eps=opt.eps, optimizer_type=opt.type
    )
    lr_scheduler = build_lr_scheduler(
        optimizer,
        train_steps=train_steps * args.train.num_train_epochs,
        lr=opt.lr,
        lr_min=opt.lr_min,
        lr_decay_style=opt.lr_decay_style,
        lr_warmup_ratio=opt.lr_warmup_ratio,
    )

    device, dp_group = get_device(), parallel_state.dp_group
    metrics_file = open(os.path.join(out, "metrics.jsonl"), "a") if parallel_state.is_main_process else None
    step = 0
    model.train()
    for epoch in range(args.train.num_train_epochs):
        train_dataloader.set_epoch(epoch, first_step=step)  # the bsz warmup follows the global step
        data_iterator = iter(train_dataloader)
        for _ in range(train_steps):
            lifecycle.set_progress(step + 1, "training step")  # named if a collective fails or a peer stalls
            tic = time.perf_counter()
            micro_batches = next(data_iterator)
            # normalise by the loss tokens of the whole global batch, so every token counts once
            tokens = torch.tensor(float(sum(count_loss_tokens(mb["labels"]) for mb in micro_batches)), device=device)
            dist.all_reduce(tokens, group=dp_group)
            total = torch.zeros((), device=device)
            for micro_batch in micro_batches:
                micro_batch = {k: v.to(device) if torch.is_tensor(v) else v for k, v in micro_batch.items()}
                labels = micro_batch.pop("labels")  # shifted by the collator (shift_labels holds the same)
                micro_batch.pop("shift_labels", None)
                logits = model(**micro_batch, use_cache=False).logits
                loss_sum, _ = lm_loss_sum(logits, labels)
                (loss_sum * parallel_state.dp_size / tokens).backward()
                total += loss_sum.detach()
            grad_norm = clip_grad_norm(model, opt.max_grad_norm)
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad()
            dist.all_reduce(total, group=dp_group)
            step += 1
            record = {
                "step": step,
                "loss": (total / tokens).item(),
                "grad_norm": grad_norm,
                "lr": lr_scheduler.get_last_lr()[0],
                "step_time": time.perf_counter() - tic,
            }
            if metrics_file:
                metrics_file.write(json.dumps(record) + "\n")
                metrics_file.flush()
                logger.info(f"epoch {epoch} step {step}: loss {record['loss']:.4f} grad_norm {grad_norm:.3f}")
    destroy_parallel_state()


if __name__ == "__main__":
    lifecycle.run_worker(main, user_error_types)
