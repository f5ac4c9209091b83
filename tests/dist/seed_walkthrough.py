"""The seed's snippets, as written, in the order the seed gives them (run under torchrun).

argv: config.yaml [--overrides]. Prints SEED_WALKTHROUGH_OK with the losses.
"""

from dataclasses import asdict, dataclass, field
from functools import partial

from veomni.arguments import DataArguments, ModelArguments, TrainingArguments, VeOmniArguments, parse_args
from veomni.data import build_dataloader, build_dataset
from veomni.data.chat_template import build_chat_template
from veomni.data.data_transform import process_pretrain_example, process_sft_example
from veomni.distributed.parallel_state import get_parallel_state, init_parallel_state
from veomni.distributed.torch_parallelize import build_parallelize_model
from veomni.models import build_foundation_model, build_tokenizer
from veomni.optim import build_lr_scheduler, build_optimizer


@dataclass
class Arguments(VeOmniArguments):
    model: "ModelArguments" = field(default_factory=ModelArguments)
    data: "DataArguments" = field(default_factory=DataArguments)
    train: "TrainingArguments" = field(default_factory=TrainingArguments)


if __name__ == "__main__":
    args = parse_args(Arguments)
    print(args.train.optimizer.lr)  # Access default arguments

    init_parallel_state(
        dp_size=args.train.accelerator.dp_size,  # data parallel size
        dp_replicate_size=args.train.accelerator.dp_replicate_size,  # data parallel replicate size
        dp_shard_size=args.train.accelerator.dp_shard_size,  # data parallel shard degree
        tp_size=args.train.accelerator.tp_size,  # tensor parallel size
        pp_size=args.train.accelerator.pp_size,  # pipeline parallel size, not support now
        cp_size=args.train.accelerator.cp_size,  # context parallel size, not support now
        ulysses_size=args.train.accelerator.ulysses_size,  # ulysses parallel size
        extra_parallel_sizes=args.train.accelerator.extra_parallel_sizes,  # including expert parallel size
        extra_parallel_placement_innermost=args.train.accelerator.extra_parallel_placement_innermost,
        extra_parallel_names=args.train.accelerator.extra_parallel_names,
        mode=args.train.accelerator.fsdp_config.fsdp_mode,  # data parallel mode, can be "ddp" or "fsdp2"
        async_enabled=args.train.accelerator.enable_async,  # async ulysses
    )

    parallel_state = get_parallel_state()

    # Access dp state
    dp_mesh = parallel_state.dp_mesh
    dp_group = parallel_state.dp_group

    # Access sp state
    sp_group = parallel_state.sp_group
    sp_rank = parallel_state.sp_rank

    # Access tp state
    tp_group = parallel_state.tp_group
    tp_mesh = parallel_state.tp_mesh

    tokenizer = build_tokenizer(args.model.tokenizer_path)
    if args.data.data_type == "conversation":
        chat_template = build_chat_template(args.data.chat_template, tokenizer)
        transform = partial(
            process_sft_example,
            chat_template=chat_template,
            max_seq_len=args.data.max_seq_len,
            text_keys=args.data.text_keys,
        )
    else:
        transform = partial(
            process_pretrain_example,
            tokenizer=tokenizer,
            max_seq_len=args.data.max_seq_len,
            text_keys=args.data.text_keys,
        )

    train_dataset = build_dataset(
        dataset_name=args.data.dataset_name,
        transform=transform,
        seed=args.train.seed,
        **asdict(args.data)
    )

    dataset_length = None if not hasattr(train_dataset, "__len__") else len(train_dataset)
    if args.data.datasets_type == "mapping":
        dataset_length = dataset_length / args.train.accelerator.dp_size
    args.compute_train_steps(dataset_length)
    train_steps = args.train_steps

    collate_fn_kwargs = {}
    train_dataloader = build_dataloader(
        dataloader_type=args.data.dataloader.type,
        dataset=train_dataset,
        micro_batch_size=args.train.micro_batch_size,  # micro batch size
        global_batch_size=args.train.global_batch_size,  # global batch size
        dataloader_batch_size=args.train.dataloader_batch_size,  # dataloader batch size
        max_seq_len=args.data.max_seq_len,  # max sequence length
        train_steps=args.train.train_steps,  # train steps, calculate by args.train.compute_train_steps
        dyn_bsz=args.train.dyn_bsz,  # enable dynamic batching
        bsz_warmup_ratio=args.train.bsz_warmup_ratio,  # bsz warmup ratio
        bsz_warmup_init_mbtoken=args.train.bsz_warmup_init_mbtoken,  # bsz warmup init micro batch token
        dyn_bsz_buffer_size=args.train.dyn_bsz_buffer_size,  # dynamic batching buffer size
        num_workers=args.data.dataloader.num_workers,  # dataloader num workers
        drop_last=args.data.dataloader.drop_last,  # dataloader drop last
        pin_memory=args.data.dataloader.pin_memory,  # dataloader pin memory
        prefetch_factor=args.data.dataloader.prefetch_factor,  # dataloader prefetch factor
        seed=args.train.seed,  # random seed
        build_collate_fn=True,
        collate_fn_kwargs=collate_fn_kwargs,  # kwargs for collate_fn
    )

    config_kwargs = {}
    model = build_foundation_model(
        config_path=args.model.config_path,  # model config path, can be None if weights_path is not None
        weights_path=args.model.model_path,  # model weights path, can be None if config_path is not None
        init_device=args.train.init_device,  # model init device
        torch_dtype="float32" if args.train.accelerator.fsdp_config.mixed_precision.enable else "bfloat16",
        attn_implementation=args.model.ops_implementation.attn_implementation,
        moe_implementation=args.model.ops_implementation.moe_implementation,
        config_kwargs=config_kwargs,
    )

    model = build_parallelize_model(
        model,
        init_device=args.train.init_device,  # model init device
        weights_path=args.model.model_path,
        enable_full_shard=args.train.accelerator.fsdp_config.full_shard,  # enable full shard, same to Zero3
        enable_reshard_after_forward=args.train.accelerator.fsdp_config.reshard_after_forward,
        mixed_precision=args.train.accelerator.fsdp_config.mixed_precision,  # enable mixed precision
        enable_gradient_checkpointing=args.train.gradient_checkpointing.enable,  # enable gradient checkpointing
        enable_fsdp_offload=args.train.accelerator.fsdp_config.offload,  # enable fsdp offload
        basic_modules=list(set(getattr(model, "_no_split_modules", None) or []) | set(args.model.basic_modules)),
        enable_reentrant=args.train.gradient_checkpointing.enable_reentrant,
        enable_forward_prefetch=args.train.accelerator.fsdp_config.forward_prefetch,
        broadcast_model_weights_from_rank0=args.train.broadcast_model_weights_from_rank0,  # load model weights
        max_load_broadcast_size=args.train.accelerator.fsdp_config.max_load_broadcast_size,
    )

    optimizer = build_optimizer(
        model,
        lr=args.train.optimizer.lr,
        weight_decay=args.train.optimizer.weight_decay,
    )

    lr_scheduler = build_lr_scheduler(
        optimizer,
        train_steps=args.train.train_steps * args.train.num_train_epochs,
    )

    losses = []
    for epoch in range(args.train.num_train_epochs):
        data_iterator = iter(train_dataloader)
        for _ in range(args.train.train_steps):
            micro_batches = next(data_iterator)
            for micro_batch in micro_batches:
                loss = model(**micro_batch).loss / len(micro_batches)
                loss.backward()

            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad()
            losses.append(round(loss.item() * len(micro_batches), 4))

    # one write per line (unbuffered print writes each argument separately, and ranks share stdout)
    print(f"SEED_WALKTHROUGH_OK {parallel_state.dp_size} {train_steps} {losses}", flush=True)
