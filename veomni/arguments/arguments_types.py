"""The configuration tree: one dataclass per group, every leaf documented where it is defined.

`parse_args` (parser.py) fills these from a YAML file and `--group.sub.key value` overrides. Users extend a
group by subclassing it and naming the subclass in their own `VeOmniArguments` subclass.
"""

import math
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Literal, Optional

from .fields import documented as _doc
from .model_arguments import LoraArguments, ModelArguments, OpsImplementation  # noqa: F401  (public here too)
from .parallel_sizes import resolve_parallel_sizes


@dataclass
class DataloaderArguments:
    """How batches are loaded."""

    type: Literal["native"] = _doc("Dataloader implementation.", default="native")
    num_workers: int = _doc("Worker processes per rank.", default=0)
    drop_last: bool = _doc("Drop the last incomplete global batch.", default=True)
    pin_memory: bool = _doc("Pin host memory (only takes effect with an accelerator).", default=True)
    prefetch_factor: Optional[int] = _doc("Batches prefetched per worker (needs num_workers > 0).", default=None)


@dataclass
class DataArguments:
    """The training data and how records become token sequences."""

    train_path: Optional[str] = _doc(
        "Training data: a file, a glob, a folder, a dataset.yaml, or a hub dataset "
        "`hf://datasets/org/name[@rev][/path/in/repo]` (its files, fetched into the huggingface_hub cache), or "
        "`hf://datasets/org/name[@rev][/config][:split]` (through `datasets`: pip install 'veomni[hub]').",
        default=None,
    )
    eval_path: Optional[str] = _doc(
        "Held-out data (same format and transform as train_path): its token-weighted loss and perplexity are "
        "logged every train.eval_steps and after the last step (metrics.jsonl eval_loss / eval_ppl). Read in full, "
        "in file order, as mapping data.",
        default=None,
    )
    datasets_type: str = _doc(
        "Registered dataset builder: `mapping` (any size: transformed once into a shared on-disk cache, see "
        "data.cache_dir), `iterable` (streaming, for data read once), or your own "
        "`@DATASET_REGISTRY.register` name. A dataset.yaml train_path interleaves sources of this type.",
        default="mapping",
    )
    data_type: Literal["plaintext", "conversation"] = _doc(
        "Pretraining text or chat conversations.", default="plaintext"
    )
    text_keys: str = _doc("Key of the text (or messages) in each sample.", default="text")
    max_seq_len: int = _doc("Tokens per sequence; longer documents are split (see over_length).", default=2048)
    chat_template: str = _doc(
        "Chat template of conversation data. `auto`: the tokenizer's own (its tokenizer_config.json "
        "`chat_template`, as TRL and `apply_chat_template` use it) when it ships one, else `default`; the start log "
        "says which. `tokenizer` (insist on the tokenizer's own), `chatml`, `default` (plain `User:`/`Assistant:` "
        "text, any tokenizer), a name registered with `@CHAT_TEMPLATE_REGISTRY.register`, or a custom jinja "
        "template (a `.jinja` file, or the template text). A template other than the tokenizer's own is warned "
        "about at start: the model's exported tokenizer still carries its own.",
        default="auto",
    )
    conversation_format: Literal["auto", "messages", "alpaca"] = _doc(
        "Conversation records: `messages` (OpenAI role/content or ShareGPT from/value under text_keys, `messages` "
        "or `conversations`), `alpaca` (instruction, input, output; optional system, history: one user turn of "
        "the instruction and input, trained on the output), or `auto` (messages when a record has them, else "
        "Alpaca when it has instruction or output).",
        default="auto",
    )
    think_loss: Literal["train", "mask", "mask_empty"] = _doc(
        "Whether `<think>...</think>` blocks of assistant turns carry loss: `train` (as rendered by the template: "
        "Qwen3's writes an empty `<think>\\n\\n</think>` into a last turn without reasoning, which then teaches "
        "the model to skip thinking), `mask` (no reasoning is trained, only the answers), `mask_empty` (reasoning "
        "is trained, empty blocks are not).",
        default="train",
    )
    last_turn_only: bool = _doc(
        "Conversation data: loss on the last assistant turn only (earlier turns are context).", default=False
    )
    over_length: Optional[Literal["split", "truncate", "error"]] = _doc(
        "A sample longer than max_seq_len. null: the data type's default, `split` for plaintext (consecutive "
        "pieces, none dropped), `error` for conversations (a bad sample: skipped with skip_bad_samples). "
        "`truncate`: keep the first max_seq_len tokens (a conversation keeps its labels; an error if no assistant "
        "token is left).",
        default=None,
    )
    train_size: Optional[int] = _doc("Tokens to train on (iterable data with dyn_bsz).", default=None)
    train_sample: Optional[int] = _doc("Samples to train on (iterable data without dyn_bsz).", default=None)
    shuffle_buffer_size: int = _doc("Records in the shuffle buffer of iterable data.", default=1000)
    cache_dir: Optional[str] = _doc(
        "Where mapping data is cached after its one transform (token ids and sample lengths, memory-mapped by "
        "every rank and later run; keyed by a fingerprint of the files, the transform and the tokenizer). Must be "
        "on storage every rank sees. null: $VEOMNI_DATA_CACHE, else ~/.cache/veomni/data.",
        default=None,
    )
    skip_bad_samples: bool = _doc("Skip (and count) malformed or over-long samples instead of failing.", default=False)
    allow_changed_data: bool = _doc(
        "Resume a checkpoint whose data files, transform or tokenizer have changed since it was saved (refused "
        "otherwise, naming what changed): the data order then restarts at the start of the current epoch, on the "
        "data as it is now.",
        default=False,
    )
    mm_configs: Dict[str, Any] = _doc(
        "Multimodal transform options (tasks/train_vlm.py), passed to process_sample_*: `media_dir` (base of "
        "relative media paths), `video_fps`, `image_kwargs` / `audio_kwargs` (extra processor kwargs, e.g. "
        "`{max_pixels: 12544}`), `max_image_pixels` (an image over it is a bad sample, checked before decoding; "
        "default 64e6). max_seq_len defaults to data.max_seq_len.",
        default_factory=dict,
    )
    dataloader: DataloaderArguments = field(default_factory=DataloaderArguments)

    @property
    def dataset_name(self) -> str:
        """The builder `build_dataset` uses. A property, not a key: the seed passes it beside `**asdict(data)`."""
        return self.datasets_type


# ----------------------------------------------------------------------------------------------- training
@dataclass
class OptimizerArguments:
    """Optimizer and learning-rate schedule (the schedule spans the steps that will run)."""

    type: Literal["adamw", "anyprecision_adamw", "muon"] = _doc("Optimizer.", default="adamw")
    lr: float = _doc("Peak learning rate.", default=5e-5)
    lr_min: float = _doc("Final learning rate of the decay.", default=1e-7)
    lr_start: float = _doc("Learning rate at the start of warmup.", default=0.0)
    lr_warmup_ratio: float = _doc("Fraction of steps spent warming up.", default=0.0)
    lr_decay_style: Literal["constant", "linear", "cosine"] = _doc("Schedule after warmup.", default="constant")
    lr_decay_ratio: float = _doc("Fraction of steps over which the decay runs.", default=1.0)
    weight_decay: float = _doc("Decoupled weight decay (never on biases and norms).", default=0.0)
    betas: List[float] = _doc("Adam betas.", default_factory=lambda: [0.9, 0.999])
    eps: float = _doc("Adam epsilon.", default=1e-8)
    max_grad_norm: float = _doc("Clip the global grad norm to this; <= 0 disables clipping.", default=1.0)
    fused: Optional[bool] = _doc(
        "AdamW kernel (also Muon's AdamW group): null = torch's fused kernel where the device has one (CPU, CUDA; "
        "~5x faster than foreach on CPU), true = insist on it, false = foreach.",
        default=None,
    )
    # muon_* keys are read only when type == "muon": Muon trains 2-D hidden weights and 3-D expert stacks, and an
    # AdamW sibling (lr, weight_decay, betas, eps above) trains embeddings, lm_head, MoE routers, biases and norms.
    muon_lr: float = _doc("Muon group learning rate (follows the lr schedule from its own base).", default=2e-2)
    muon_momentum: float = _doc("Muon momentum factor.", default=0.95)
    muon_nesterov: bool = _doc("Nesterov momentum for Muon.", default=True)
    muon_weight_decay: float = _doc("Decoupled weight decay of the Muon group.", default=0.0)
    muon_ns_steps: int = _doc("Newton-Schulz iterations.", default=5)
    muon_ns_coefficients: List[float] = _doc(
        "Quintic Newton-Schulz coefficients (a, b, c).", default_factory=lambda: [3.4445, -4.7750, 2.0315]
    )
    muon_eps: float = _doc("Epsilon of the norm that scales each matrix before Newton-Schulz.", default=1e-7)
    muon_adjust_lr_fn: Literal["original", "match_rms_adamw"] = _doc(
        "Per-matrix lr: original = sqrt(max(1, rows/cols)); match_rms_adamw = 0.2 * sqrt(max(rows, cols)).",
        default="match_rms_adamw",
    )
    muon_expert_zero_comm: bool = _doc(
        "MoE with EP: FSDP shards whole experts (dim 0) over ep_fsdp so Muon needs no communication for them; "
        "needs (num_experts / ep_size) % ep_fsdp_size == 0, else a warning and the dim-1 (gather) layout.",
        default=False,
    )


@dataclass
class MixedPrecisionArguments:
    """Mixed precision (FSDP2 and DDP)."""

    enable: bool = _doc(
        "fp32 master weights and optimizer state, compute in param_dtype (FSDP2: MixedPrecisionPolicy; DDP: the "
        "forward under torch.autocast, gradients all-reduced in fp32). Off: "
        "parameters and optimizer state are kept in param_dtype itself; with a 16-bit param_dtype that is pure "
        "bf16/fp16 training, which loses small updates (a warning says so).",
        default=True,
    )
    param_dtype: Optional[Literal["bfloat16", "float16", "float32"]] = _doc(
        "Compute dtype. null: bfloat16 on CUDA (fsdp2 and ddp); float32 on CPU (see "
        "veomni.distributed.mixed_precision.resolve_precision).",
        default=None,
    )
    reduce_dtype: Literal["bfloat16", "float32"] = _doc("Gradient reduction dtype.", default="float32")


@dataclass
class FSDPConfig:
    """The data-parallel engine and its memory options."""

    fsdp_mode: Literal["fsdp2", "ddp"] = _doc("Data-parallel engine.", default="fsdp2")
    full_shard: bool = _doc("Shard parameters, grads and optimizer state (ZeRO-3).", default=True)
    reshard_after_forward: Optional[bool] = _doc(
        "Free gathered parameters after forward (backward gathers them again). null (default): yes, except on a "
        "one-rank shard group, where keeping them (a bf16 copy, 2 bytes per parameter) spares backward a second "
        "gather and cast of every layer (0.6B on one H100: 0.80 -> 0.90 of a bare loop's speed, with the CUDA grad "
        "norm). true/false: always/never.",
        default=None,
    )
    offload: bool = _doc("Keep sharded parameters on CPU (FSDP2 CPUOffloadPolicy).", default=False)
    forward_prefetch: bool = _doc("Prefetch the next FSDP unit's parameters in forward.", default=True)
    max_load_broadcast_size: int = _doc("Bytes per rank-0 weight broadcast chunk.", default=2**30)
    mixed_precision: MixedPrecisionArguments = field(default_factory=MixedPrecisionArguments)


@dataclass
class AcceleratorArguments:
    """Parallel sizes; -1 derives a size from the world size."""

    dp_size: int = _doc("Data-parallel size; -1 derives it from the world size.", default=-1)
    dp_replicate_size: int = _doc("Replicated (HSDP) data-parallel size; -1 derives it.", default=-1)
    dp_shard_size: int = _doc("Sharded data-parallel size; -1 derives it.", default=-1)
    tp_size: int = _doc(
        "Tensor parallel size: the innermost mesh dim (adjacent ranks, so TP stays inside a node). q/k/v and "
        "gate/up are split column-wise, o and down row-wise, the embedding and lm_head over the vocabulary (the "
        "loss never gathers full logits); FSDP2 then shards over dp_shard (2-D), HSDP over dp_replicate too. "
        "Ranks of one tp group get the same batches. Heads, KV heads, intermediate and vocab size must divide "
        "by it; plans exist for llama, qwen2, qwen3 (veomni.distributed.tensor_parallel.TP_PLANS). Needs "
        "fsdp_mode fsdp2; not with ulysses_size > 1 or MoE models.",
        default=1,
    )
    pp_size: int = _doc("Pipeline parallel size (not supported yet: must be 1).", default=1)
    cp_size: int = _doc("Context parallel size (not supported yet: must be 1).", default=1)
    ulysses_size: int = _doc(
        "Ulysses sequence parallel size: each rank of a group of this many holds 1/ulysses_size of every packed "
        "row (the collator pads the row to a multiple and slices it); attention exchanges sequence shards for head "
        "shards by all-to-all and runs on the full sequence for num_attention_heads/ulysses_size heads, wrapping "
        "whatever attn_implementation is set. num_attention_heads must divide by it (KV heads are repeated when "
        "fewer). Ranks = dp_size * ulysses_size; FSDP shards over dp_shard x ulysses.",
        default=1,
    )
    extra_parallel_sizes: List[int] = _doc("Sizes of extra parallel dims (e.g. expert parallel).", default_factory=list)
    extra_parallel_names: List[str] = _doc("Names of the extra parallel dims, e.g. [ep].", default_factory=list)
    extra_parallel_placement_innermost: List[bool] = _doc(
        "Per extra dim: place it innermost (adjacent ranks).", default_factory=list
    )
    enable_async: bool = _doc(
        "Async Ulysses: send each of Q, K, V by all-to-all as soon as it is projected, overlapping the exchange "
        "with the next projection (Llama, Qwen2, Qwen3, Qwen3-MoE attention; other models run sync Ulysses). Same "
        "results as sync. Only used with ulysses_size > 1.",
        default=False,
    )
    dist_timeout_minutes: float = _doc(
        "How long a collective may wait for a peer before the job fails with an error naming the rank and the "
        "operation (a dead or stalled rank, mismatched collectives). Fractions are fine (0.5 = 30 s).",
        default=10.0,
    )
    fsdp_config: FSDPConfig = field(default_factory=FSDPConfig)


@dataclass
class CheckpointArguments:
    """Outputs and checkpoints. Re-running a command resumes its run; overwrite starts over."""

    output_dir: str = _doc("Where metrics, the resolved config, plots and checkpoints go.", default="outputs")
    save_steps: int = _doc("Save every N optimizer steps; 0 saves only at the end.", default=0)
    save_total_limit: int = _doc("Keep the newest N checkpoints; 0 keeps all.", default=0)
    keep_best: bool = _doc(
        "Besides the newest save_total_limit checkpoints, keep the one of the lowest eval loss (data.eval_path): "
        "output_dir/best_checkpoint.json names it.",
        default=False,
    )
    load_path: Optional[str] = _doc(
        "Checkpoint to resume from. `auto` (default): the newest complete checkpoint in output_dir, if any, so "
        "re-running the same command resumes. A path: that checkpoint. null/`none`: never resume (refused when "
        "output_dir already holds a run; see overwrite).",
        default="auto",
    )
    overwrite: bool = _doc(
        "Start over even though output_dir holds a run: its files are first moved to "
        "`<output_dir>.old-<YYYYmmdd-HHMMSS>` (never deleted).",
        default=False,
    )
    save_hf_weights: bool = _doc("Export an HF-format model to output_dir/hf at the end of training.", default=False)
    async_save: bool = _doc("Write checkpoints in the background (published when complete).", default=False)


@dataclass
class GradientCheckpointingArguments:
    """Activation checkpointing."""

    enable: bool = _doc("Recompute activations in backward.", default=False)
    enable_reentrant: bool = _doc("Use the reentrant implementation.", default=False)


@dataclass
class WandbArguments:
    """Weights & Biases logging."""

    enable: bool = _doc(
        "Log to Weights & Biases (pip install wandb). Setting project or name, in the YAML or on the command line, "
        "turns it on (the log says so) unless enable itself is given: `enable: false` keeps it off.",
        default=False,
    )
    project: str = _doc("W&B project (setting it enables wandb).", default="veomni")
    name: Optional[str] = _doc("W&B run name (setting it enables wandb).", default=None)
    mode: Literal["online", "offline", "disabled"] = _doc(
        "W&B mode. offline (default) needs no network or login: the run is written under output_dir/wandb and "
        "uploaded later with `wandb sync <output_dir>/wandb/offline-run-*`; online streams to wandb.ai (wandb login "
        "or WANDB_API_KEY first).",
        default="offline",
    )


@dataclass
class TrainingArguments:
    """Batch sizes, steps, seed, logging; and the nested optimizer/accelerator/checkpoint groups."""

    seed: int = _doc("Random seed for init, data order and dropout.", default=42)
    micro_batch_size: int = _doc(
        "Samples per micro-batch; with dyn_bsz (the default) a token budget instead: micro-batches are packed up "
        "to micro_batch_size * max_seq_len tokens, however many samples that takes.",
        default=1,
    )
    global_batch_size: Optional[int] = _doc(
        "Micro-batch slots per optimizer step over all DP ranks, in units of micro_batch_size: without dyn_bsz "
        "that many samples; with dyn_bsz (the default) a token budget of global_batch_size * max_seq_len tokens "
        "(short samples: many more samples per step). The start line prints both per step.",
        default=None,
    )
    num_train_epochs: int = _doc("Passes over the data.", default=1)
    eval_steps: int = _doc("Evaluate data.eval_path every this many steps (0: only after the last step).", default=0)
    eval_prompts: List[str] = _doc(
        "Prompts answered by the model (greedy, through the training chat template) at each eval, each checkpoint "
        "save and the last step: metrics.jsonl `samples` [{prompt, response}] and the log. Not with tp/sp > 1.",
        default_factory=list,
    )
    eval_max_new_tokens: int = _doc("Tokens generated at most per train.eval_prompts answer.", default=64)
    early_stopping_patience: int = _doc(
        "Stop after this many evaluations in a row without a new lowest eval loss (needs data.eval_path; the run "
        "saves, exports and says so). 0: never.",
        default=0,
    )
    max_steps: Optional[int] = _doc(
        "Optimizer steps of the whole run, over all epochs (as in HF Trainer and torchtitan): training stops there, "
        "in whichever epoch it falls, and the LR schedule spans it. When num_train_epochs of the data hold fewer "
        "steps, the run ends with the data and the log says so (and which num_train_epochs would reach it).",
        default=None,
    )
    dyn_bsz: bool = _doc("Pack micro-batches up to a token budget instead of a sample count.", default=True)
    bsz_warmup_ratio: float = _doc(
        "Fraction of the first epoch's steps over which the token budget warms up (by global step: once per run).",
        default=0.0,
    )
    bsz_warmup_init_mbtoken: int = _doc("Micro-batch token budget at the start of bsz warmup.", default=200)
    dyn_bsz_buffer_size: int = _doc("Samples buffered to fill micro-batches.", default=200)
    init_device: Literal["cpu", "cuda", "meta"] = _doc("Where parameters are first built.", default="cpu")
    broadcast_model_weights_from_rank0: bool = _doc("Rank 0 reads weights, broadcasts to others.", default=True)
    enable_full_determinism: bool = _doc("Deterministic kernels (slower).", default=False)
    log_steps: int = _doc("Print a metrics line every N steps.", default=1)
    skip_nonfinite_steps: bool = _doc("Skip a step with non-finite loss/grad instead of stopping.", default=False)
    plan_check: Literal["refuse", "warn", "off"] = _doc(
        "The planner's memory check of the task's PlanCheckCallback (tasks/train_text.py): a layout predicted to "
        "exceed plan_check_memory_gib is refused before the first step (one line naming the largest term and the "
        "layouts that fit), or only warned about; off: no check.",
        default="refuse",
    )
    plan_check_memory_gib: Optional[float] = _doc(
        "Device memory the plan check holds the predicted peak to; null: 95% of the GPU's memory (no check on CPU).",
        default=None,
    )
    use_tensorboard: bool = _doc("Write TensorBoard scalars under output_dir/tensorboard.", default=False)
    loss_plot: bool = _doc(
        "Draw output_dir/loss.png at the end of training (matplotlib on rank 0: about a second per run). The "
        "environment variable VEOMNI_LOSS_PLOT=0 turns the default off (a sweep, a test suite).",
        default=os.environ.get("VEOMNI_LOSS_PLOT", "1") != "0",
    )
    tf32: bool = _doc(
        "On CUDA, fp32 matmuls and convolutions use TensorFloat-32 tensor cores (10-bit mantissa inputs, fp32 "
        "accumulation). Off: exact fp32. No effect on CPU.",
        default=True,
    )
    fp8: Literal["off", "tensorwise", "rowwise"] = _doc(
        "torchao float8 training of the linear layers large enough to gain (veomni.distributed.fp8: torchao's "
        "H100-measured size rule; never the output head nor layers whose dims are not multiples of 16); "
        "`tensorwise`: one scale per tensor (fastest; FSDP2 then gathers the weights in float8), `rowwise`: one "
        "scale per row (more accurate). Needs torchao (pip install veomni[fp8]) and an H100-class GPU to gain; runs "
        "emulated elsewhere. Not with tp_size > 1.",
        default="off",
    )
    optimizer: OptimizerArguments = field(default_factory=OptimizerArguments)
    accelerator: AcceleratorArguments = field(default_factory=AcceleratorArguments)
    checkpoint: CheckpointArguments = field(default_factory=CheckpointArguments)
    gradient_checkpointing: GradientCheckpointingArguments = field(default_factory=GradientCheckpointingArguments)
    wandb: WandbArguments = field(default_factory=WandbArguments)

    # Derived by `resolve()`; not user keys.
    dataloader_batch_size: int = field(default=0, init=False, metadata={"derived": True})
    train_steps: int = field(default=0, init=False, metadata={"derived": True})

    def compute_train_steps(
        self, dataset_length: Optional[float] = None, data: Optional["DataArguments"] = None
    ) -> int:
        """Optimizer steps per epoch, stored in `train_steps` (the seed's `args.train.compute_train_steps`).

        `dataset_length` is the number of samples one data-parallel rank sees (for mapping data, divide the
        dataset length by dp_size first, as the seed shows). The first that is set counts: dyn_bsz's token budget
        (`data.train_size`), `dataset_length`, `data.train_sample`, `max_steps`; `max_steps` also caps the result.
        `data` defaults to the data group of the `VeOmniArguments` this group belongs to.
        """
        data = data if data is not None else getattr(self, "_data", None)
        if data is None:
            raise ValueError("compute_train_steps needs the data group: call it on VeOmniArguments or pass data=")
        if self.dyn_bsz and data.train_size:
            steps = math.ceil(data.train_size / (self.global_batch_size * data.max_seq_len))
        elif dataset_length is not None:
            steps = math.floor(dataset_length / (self.micro_batch_size * self.dataloader_batch_size))
        elif data.train_sample:
            steps = math.floor(data.train_sample / self.global_batch_size)
        elif self.max_steps:
            steps = self.max_steps
        else:
            raise ValueError(
                "cannot compute train steps: give a dataset length, data.train_size, data.train_sample "
                "or train.max_steps"
            )
        if self.max_steps:
            steps = min(steps, self.max_steps)
        if steps <= 0:  # an rc-0 run that trains nothing and saves an untrained checkpoint helps nobody
            raise ValueError(
                f"this run would train 0 steps: the data ({dataset_length or data.train_size or data.train_sample}) "
                f"does not fill one global batch of {self.global_batch_size}; use more data or smaller batches"
            )
        self.train_steps = steps
        return steps

    def resolve(self, world_size: Optional[int]) -> None:
        """Fill the derived sizes; called by `parse_args` with torchrun's world size (None outside torchrun: the
        smallest world the configured sizes fit, see `resolve_parallel_sizes`)."""
        acc = self.accelerator
        sizes = resolve_parallel_sizes(acc, world_size)
        acc.dp_replicate_size, acc.dp_shard_size = sizes.dp_replicate, sizes.dp_shard
        acc.dp_size = sizes.dp_replicate * sizes.dp_shard
        per_step = self.micro_batch_size * acc.dp_size
        if self.global_batch_size is None:
            self.global_batch_size = per_step
        if self.global_batch_size % per_step:
            raise ValueError(batch_split_message(self.global_batch_size, self.micro_batch_size, acc.dp_size))
        self.dataloader_batch_size = self.global_batch_size // per_step


def batch_split_message(global_batch: int, micro_batch: int, dp_size: int) -> str:
    """Why a global batch does not split over the ranks, and the nearest settings that would."""
    per_step = micro_batch * dp_size
    lower, upper = global_batch // per_step * per_step, (global_batch // per_step + 1) * per_step
    options = [f"train.global_batch_size {' or '.join(str(g) for g in (lower, upper) if g > 0)}"]
    micros = [m for m in range(1, global_batch + 1) if global_batch % (m * dp_size) == 0]
    if micros:
        near = sorted(micros, key=lambda m: (abs(m - micro_batch), m))[:2]
        options.append(f"train.micro_batch_size {' or '.join(str(m) for m in sorted(near))}")
    ranks = [d for d in range(1, 2 * dp_size + 1) if global_batch % (micro_batch * d) == 0]
    if ranks:
        near = sorted(ranks, key=lambda d: (abs(d - dp_size), d))[:2]
        options.append(f"{' or '.join(str(d) for d in sorted(near))} data-parallel ranks (NPROC_PER_NODE)")
    return (
        f"train.global_batch_size={global_batch} does not split over {dp_size} data-parallel ranks: each step "
        f"takes a multiple of train.micro_batch_size * dp_size = {micro_batch} * {dp_size} = {per_step} samples. "
        f"Nearest valid: {'; '.join(options)}; or leave train.global_batch_size unset (a step is then "
        f"micro_batch_size samples per rank, on any number of ranks)"
    )


@dataclass
class VeOmniArguments:
    """The whole configuration: model, data and train groups."""

    model: ModelArguments = field(default_factory=ModelArguments)
    data: DataArguments = field(default_factory=DataArguments)
    train: TrainingArguments = field(default_factory=TrainingArguments)

    @property
    def train_steps(self) -> int:
        return self.train.train_steps

    def __post_init__(self):
        # the train group computes steps from the data group (`args.train.compute_train_steps(n)`, as the seed
        # names it): a plain attribute, not a field, so it is neither a config key nor saved
        self.train._data = self.data

    def compute_train_steps(self, dataset_length: Optional[float] = None) -> int:
        """Optimizer steps per epoch (see `TrainingArguments.compute_train_steps`)."""
        return self.train.compute_train_steps(dataset_length, self.data)
