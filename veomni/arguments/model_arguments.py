"""The model group of the configuration tree: which model, its kernels, and LoRA adapters."""

from dataclasses import dataclass, field
from typing import List, Literal, Optional

from .fields import documented as _doc


@dataclass
class OpsImplementation:
    """Which kernels the model runs."""

    attn_implementation: Literal[
        "veomni_varlen",
        "flash_attention_2",
        "flash_attention_3",
        "sdpa",
        "eager",
        "flex_attention",
        "veomni_flash_attention_2_with_sp",
        "veomni_flash_attention_3_with_sp",
        "veomni_flash_attention_4_with_sp",
    ] = _doc(
        "Attention kernel. `veomni_varlen` (default): packed documents attend only within themselves using "
        "cu_seq_lens, never an (S x S) mask -- flash-attn varlen on CUDA when installed, else torch varlen; on CPU "
        "one causal SDPA per document. `flash_attention_2/3` without their package fall back to "
        "`veomni_varlen` (one log line). `sdpa`/`eager` are transformers' own (packed rows get a block-diagonal mask). "
        "`veomni_flash_attention_{2,3,4}_with_sp` (VeOmni's names, which verl sends) run `veomni_varlen`: it reads "
        "cu_seq_lens, and Ulysses wraps it whenever ulysses_size > 1.",
        default="veomni_varlen",
    )
    moe_implementation: Literal["eager", "fused"] = _doc(
        "Mixture-of-experts kernel: `fused` (tokens sorted by expert, batched/grouped matmuls; as fast as eager on "
        "CPU, much faster on CUDA) or `eager` (transformers' per-expert loop, the reference).",
        default="fused",
    )
    loss_chunk_size: int = _doc(
        "Tokens per chunk of the training loss: the output head and cross-entropy run on this many tokens at a "
        "time (each chunk's gradients are computed in forward), so the full (tokens x vocab) fp32 logits never "
        "exist. 0: plain loss on full logits.",
        default=1024,
    )
    loss_implementation: Literal["auto", "chunked", "liger"] = _doc(
        "The output head and cross-entropy of the training loss (with loss_chunk_size > 0): `chunked` (ours: a fused "
        "linear + cross-entropy in torch, chunk by chunk) or `liger` (liger-kernel's fused linear cross-entropy "
        "Triton kernel, CUDA only, no tensor parallel). `auto`: liger on CUDA where it is installed and tp_size is "
        "1, chunked otherwise (measured on an H200 by benchmarks/gpu_speed.py: 2.4x faster, 45% less memory).",
        default="auto",
    )
    kernels: Literal["auto", "liger", "eager"] = _doc(
        "Fused Triton kernels (liger-kernel: RMSNorm, RoPE incl. Qwen-VL M-RoPE, SwiGLU) bound to this model instance "
        "only (transformers' classes and functions stay as they are, so another model in the process runs eager). "
        "`auto`: liger on CUDA when liger-kernel is installed (`pip install veomni[kernels]`) and `compile` is off "
        "(inductor fuses compiled layers better), eager otherwise (the log says which, once); `liger`: refused where it cannot run (no CUDA, not installed, tp_size > 1); "
        "`eager`: transformers' modules. Families: llama, qwen2, qwen3, qwen3_moe, qwen2_5_vl, qwen3_vl.",
        default="auto",
    )
    compile: bool = _doc(
        "torch.compile each decoder layer's forward (attention and MoE dispatch stay eager): fuses the norms, "
        "rotary embeddings, SwiGLU and residual adds that eager runs as many small kernels. Costs a cold compile "
        "at start (tens of seconds on a GPU machine, minutes on a small CPU box).",
        default=False,
    )


@dataclass
class LoraArguments:
    """LoRA through HF PEFT: low-rank adapters on the named linear layers are trained, the base weights stay frozen."""

    enable: bool = _doc(
        "Train LoRA adapters instead of the whole model (optimizer state for adapters only).", default=False
    )
    r: int = _doc("Rank of each adapter (A: r x in, B: out x r).", default=8)
    alpha: float = _doc("Scale numerator: the update is (alpha / r) * B @ A.", default=16.0)
    dropout: float = _doc("Dropout on the adapters' input (0: none).", default=0.0)
    target_modules: List[str] = _doc(
        "Modules that get adapters: names matched against the end of each module path (e.g. [q_proj, k_proj, "
        "v_proj, o_proj]), or [all-linear] (every linear layer but the output head), or one regular expression over "
        'the full module path written as ["re:.*layers\\.[0-3]\\..*(q|v)_proj"].',
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"],
    )
    export: Literal["merged", "adapter"] = _doc(
        "What train.checkpoint.save_hf_weights writes to output_dir/hf: `merged` (base + adapters merged, the base "
        "checkpoint's keys, loads with plain from_pretrained) or `adapter` (a PEFT folder: adapter_config.json, "
        "adapter_model.safetensors; load with peft.PeftModel.from_pretrained(base, folder)).",
        default="merged",
    )


@dataclass
class ModelArguments:
    """The model: its HF config, weights (none: from scratch) and tokenizer."""

    config_path: Optional[str] = _doc(
        "HF config.json or folder holding it, or a hub name (org/name[@rev]); defaults to model_path.", default=None
    )
    model_path: Optional[str] = _doc(
        "Folder of HF weights (safetensors), or a hub name `org/name[@revision]` fetched into the huggingface_hub "
        "cache (HF_HOME, HF_HUB_OFFLINE honoured; local rank 0 of each node downloads). None trains from scratch.",
        default=None,
    )
    tokenizer_path: Optional[str] = _doc(
        "Tokenizer folder or hub name (org/name[@rev]); defaults to model_path, then config_path.", default=None
    )
    basic_modules: List[str] = _doc("Extra module class names to wrap as FSDP units.", default_factory=list)
    trust_remote_code: bool = _doc(
        "Let a model or tokenizer folder whose config names custom Python (`auto_map`) run that code. Off: such "
        "folders are refused; turn on only for folders you trust.",
        default=False,
    )
    freeze_vit: bool = _doc(
        "Vision-language models: keep the vision tower's weights fixed (requires_grad off). The tower still runs, "
        "under no_grad, and takes part in FSDP's collectives.",
        default=False,
    )
    freeze_audio_tower: bool = _doc(
        "Omni models: keep the audio encoder's weights fixed, as freeze_vit.", default=False
    )
    ops_implementation: OpsImplementation = field(default_factory=OpsImplementation)
    lora: LoraArguments = field(default_factory=LoraArguments)

    def __post_init__(self):
        self.config_path = self.config_path or self.model_path
        self.tokenizer_path = self.tokenizer_path or self.model_path or self.config_path
