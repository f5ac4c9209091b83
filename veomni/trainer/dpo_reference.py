"""The reference log-probs of DPO (`dpo.reference`), per sequence of a packed micro-batch, without gradients.

model         a second copy of the initial policy, built and sharded like it (the same parallelize: FSDP2/HSDP, TP,
              Ulysses, EP), its weights copied from the policy's shards before training (and before a resume loads
              the trained ones), frozen: no gradients, no optimizer state, not in the checkpoint (it is rebuilt the
              same way on resume). With a LoRA policy it is the base model (the adapters' names left out).
adapters_off  the LoRA policy itself with its adapters disabled (PEFT's `enable_adapters(False)` on every LoRA
              layer): no second copy of the weights is held.
precomputed   one pass of the frozen initial policy over every training pair before the first step, stored as
              `dpo_reference-<key>.pt` in the data cache's folder (key: the model's config, weights and seed, the
              layout-free pair content), read back by later runs and resumes; each micro-batch then looks its pairs
              up by content (`pair_keys`).
"""

import contextlib
import hashlib
import json
import os
from typing import Any, Dict, List

import torch
import torch.distributed as dist

from ..arguments import ConfigError
from ..data.preference import PreferenceCollator
from ..distributed.torch_parallelize import parallelize
from ..models.lora import lora_layers
from ..ops.loss import IGNORE_INDEX
from ..ops.preference_loss import SequenceLogps
from ..utils.device import get_device_type
from ..utils.logging import get_logger
from .base import build_model_from_args

logger = get_logger(__name__)


def build_reference(trainer, chunk_size: int):
    kind = trainer.args.dpo.reference
    if kind == "adapters_off":
        logger.info("dpo.reference=adapters_off: the policy with its LoRA adapters disabled, no second copy")
        return LogpsReference(trainer.sequence_logps, adapters_off=trainer.model)
    if kind == "precomputed" and not hasattr(trainer.train_dataset, "prepare"):
        raise ConfigError("dpo.reference=precomputed needs map-style data (data.datasets_type: mapping)")
    model = frozen_copy(trainer)
    held = sum(_local(p).numel() * p.element_size() for p in model.parameters())
    logger.info(f"dpo.reference={kind}: a frozen copy of the initial policy, {held / 2**20:.1f} MiB on this rank")
    logps = SequenceLogps(model, chunk_size, trainer.sp_group)
    if kind == "model":
        return LogpsReference(logps)
    return PrecomputedReference(trainer, logps)


def frozen_copy(trainer):
    """The initial policy again (no adapters), parallelised like it, its weights copied shard by shard, frozen."""
    args = trainer.args
    model = build_model_from_args(args, get_device_type(), args.train.init_device)
    model = trainer.prepare_model(model)
    model = parallelize(model, trainer.parallel_state, args)
    policy = {name.replace(".base_layer", ""): p for name, p in trainer.model.named_parameters()}
    with torch.no_grad():
        for name, param in model.named_parameters():
            _local(param).copy_(_local(policy[name]))
    return model.requires_grad_(False).eval()


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor parameter, or the tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def sequence_logps(logps: SequenceLogps, micro_batch: Dict[str, Any], inputs: Dict[str, Any]):
    """`logps`' (log-probs, tokens, ...) of every sequence of a packed pair micro-batch."""
    labels, index = micro_batch["labels"], micro_batch["sequence_index"]
    targets = micro_batch.get("num_targets")
    return logps(labels, index, 2 * micro_batch["num_pairs"], targets, **inputs, use_cache=False)


@contextlib.contextmanager
def adapters_disabled(model):
    """PEFT's switch on every LoRA layer: the base model's forward while inside."""
    layers = [module for _, module in lora_layers(model)]
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer in layers:
            layer.enable_adapters(True)


class LogpsReference:
    """The reference's log-probs computed on the fly: a frozen model's, or (`adapters_off`) the LoRA policy's own
    with its adapters disabled."""

    def __init__(self, logps: SequenceLogps, adapters_off=None):
        self.logps, self.adapters_off = logps, adapters_off

    def __call__(self, micro_batch, inputs) -> torch.Tensor:
        off = adapters_disabled(self.adapters_off) if self.adapters_off is not None else contextlib.nullcontext()
        with off:
            return sequence_logps(self.logps, micro_batch, inputs)[0]


class PrecomputedReference:
    """Per-pair (chosen, rejected) reference log-probs by pair content, computed once before training."""

    def __init__(self, trainer, logps: SequenceLogps):
        self.table: Dict[str, List[float]] = {}
        eval_data = trainer.eval_data  # the held-out pairs too, with the same initial model
        for dataset in [trainer.train_dataset] + ([eval_data[0]] if eval_data else []):
            path = _store_path(trainer, dataset)
            self.table.update(torch.load(path) if os.path.isfile(path) else _precompute(trainer, logps, dataset, path))
        del logps.model  # the frozen copy is no longer needed: its memory goes back
        self.device = trainer.device

    def __call__(self, micro_batch, inputs) -> torch.Tensor:
        missing = [k for k in micro_batch["pair_keys"] if k not in self.table]
        if missing and bool((micro_batch["labels"] != IGNORE_INDEX).any()):  # (a masked evaluation batch scores 0)
            raise RuntimeError(f"dpo.reference=precomputed: {len(missing)} pairs of this batch were not precomputed")
        values = [v for k in micro_batch["pair_keys"] for v in self.table.get(k, (0.0, 0.0))]
        return torch.tensor(values, dtype=torch.float64, device=self.device)


def _store_path(trainer, dataset) -> str:
    """`dpo_reference-<key>.pt` beside `dataset`'s data cache (the run's output folder for data without one)."""
    args = trainer.args
    cache = dataset.prepare() if hasattr(dataset, "prepare") else None
    folder = getattr(cache, "folder", None) or trainer.output_dir
    weights = args.model.model_path
    stamp = [(f, os.path.getsize(os.path.join(weights, f)), os.path.getmtime(os.path.join(weights, f)))
             for f in sorted(os.listdir(weights))] if weights and os.path.isdir(weights) else weights  # fmt: skip
    config = os.path.join(args.model.config_path or "", "config.json")
    described = {
        "config": open(config).read() if os.path.isfile(config) else args.model.config_path,
        "weights": stamp,
        "seed": args.train.seed,
        "lora": args.model.lora.enable,
    }
    key = hashlib.sha256(json.dumps(described, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return os.path.join(folder, f"dpo_reference-{key}.pt")


def _precompute(trainer, logps: SequenceLogps, dataset, path: str) -> Dict[str, List[float]]:
    """Every training pair through the frozen initial model, the data-parallel ranks sharing the pairs (all in
    lockstep: a rank with fewer forwards a masked pair), the tables merged over the ranks; rank 0 writes the file."""
    state = trainer.parallel_state
    cache = dataset.prepare()
    collate: PreferenceCollator = trainer.build_collator()
    samples = list(range(cache.num_samples))
    mine = samples[state.dp_rank :: state.dp_size]
    rounds = -(-len(samples) // state.dp_size)
    table: Dict[str, List[float]] = {}
    logger.info(f"dpo.reference=precomputed: {len(samples)} pairs through the reference model -> {path}")
    for r in range(rounds):
        sample = dict(cache.sample(mine[r] if r < len(mine) else samples[0]))
        batch = collate([sample])
        on_device = trainer._to_device(batch)
        inputs = {k: v for k, v in on_device.items() if k not in trainer.non_model_keys}
        with torch.no_grad():
            values = sequence_logps(logps, on_device, inputs)[0].double().tolist()
        if r < len(mine):
            table[batch["pair_keys"][0]] = values
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, table, group=trainer.host_group.get())
    for part in gathered:
        table.update(part)
    if trainer.is_main:
        tmp = f"{path}.tmp-{os.getpid()}"
        torch.save(table, tmp)
        os.replace(tmp, path)
    dist.barrier(group=trainer.host_group.get())
    return table
