"""veomni: PyTorch-native training for large language and omni-modal models, from a laptop CPU to GPU clusters.

FSDP2 / DDP over torch.distributed (gloo on CPU, NCCL on CUDA), HF-format models, packed data, exact resume.

Start here:
    bash train.sh tasks/train_text.py configs/text/demo.yaml      # the bundled demo
    python tasks/train_text.py --help [GROUP]                     # every config key, its type, default and doc

Subpackages: arguments (config groups, parse_args), data (datasets, transforms, stateful loader), models
(build_foundation_model, build_tokenizer), distributed (parallel state, FSDP2/DDP wrapping, MoE), ops (loss,
experts), optim (optimizers, LR schedules), checkpoint (DCP save/resume, HF export), trainer (TextTrainer).
"""

__version__ = "0.1.0"


from .compat.torch_runtime import quiet_torchao_enum_notice  # noqa: E402  (torch-free: no torch import here)

quiet_torchao_enum_notice()
