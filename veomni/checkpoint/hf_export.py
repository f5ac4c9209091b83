"""Consolidated HF-format folders (config.json, safetensors shards + index, tokenizer / processor files), from a
live (sharded) model or from a DCP checkpoint, loadable by plain `transformers.AutoModelForCausalLM.from_pretrained`
(`AutoModelForImageTextToText` and `AutoProcessor` for vision/audio-language models)."""

import copy
import json
import math
import os
import shutil
from typing import Callable, Dict, List, Optional, Tuple

import torch
from safetensors.torch import save_file
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from ..models.hf_conversion import TensorGroup, convert_group, plan_save
from ..models.loader import tied_parameter_names
from ..utils.collectives import on_rank0
from ..utils.logging import get_logger

logger = get_logger(__name__)

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "generation_config.json",
    # a multimodal processor saved beside the model: AutoProcessor.from_pretrained(out_dir) rebuilds it
    "preprocessor_config.json",
    "video_preprocessor_config.json",
    "processor_config.json",
    "chat_template.json",
)


def export_config(config, out_dir: str, architecture: Optional[str] = None) -> None:
    """The model config for inference: the cache back on, the real class name (not FSDP's wrapper)."""
    config = copy.deepcopy(config)
    config.use_cache = True
    if getattr(config, "text_config", None) is not None:
        config.text_config.use_cache = True
    if architecture:
        config.architectures = [architecture]
    config.save_pretrained(out_dir)


def copy_tokenizer(tokenizer_dir: Optional[str], out_dir: str) -> None:
    if not tokenizer_dir or not os.path.isdir(tokenizer_dir):
        return
    for name in TOKENIZER_FILES:
        src = os.path.join(tokenizer_dir, name)
        if os.path.isfile(src):
            shutil.copy2(src, os.path.join(out_dir, name))


def save_readable(tensors: Dict[str, torch.Tensor], path: str) -> None:
    """`save_file`, then the permissions any other file gets here: safetensors writes through a private temporary
    file (mode 0600), which would make an exported model unreadable to everyone else."""
    save_file(tensors, path, metadata={"format": "pt"})
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def _nbytes(shape, dtype: torch.dtype) -> int:
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


def _buckets(sizes: List[Tuple[object, int]], max_shard_bytes: int) -> List[List[object]]:
    """Consecutive items in shards of at most `max_shard_bytes` (an item larger than that gets a shard of its own)."""
    shards, current, size = [], [], 0
    for item, nbytes in sizes:
        if current and size + nbytes > max_shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(item)
        size += nbytes
    return shards + [current]


def write_hf_shards(
    out_dir: str, shards: List[List[object]], produce: Callable[[List[object]], Dict[str, torch.Tensor]]
) -> None:
    """One `model.safetensors`, or `model-0000i-of-0000N.safetensors` + `model.safetensors.index.json` (written
    last, so a reader never sees an index pointing at missing shards). `produce(shard)` gives one shard's tensors,
    so only one shard is in memory at a time."""
    os.makedirs(out_dir, exist_ok=True)
    weight_map, total = {}, 0
    for i, shard in enumerate(shards, 1):
        tensors = {name: t.detach().contiguous().cpu() for name, t in produce(shard).items()}
        file = "model.safetensors" if len(shards) == 1 else f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_readable(tensors, os.path.join(out_dir, file))
        for name, t in tensors.items():
            weight_map[name] = file
            total += t.numel() * t.element_size()
        del tensors
    if len(shards) > 1:
        with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=1)


def write_safetensors(state_dict: Dict[str, torch.Tensor], out_dir: str, max_shard_bytes: int = 5 * 2**30) -> None:
    """Tensors exactly as given (no renaming), in shards of at most `max_shard_bytes`."""
    names = sorted(state_dict)
    sizes = [(n, state_dict[n].numel() * state_dict[n].element_size()) for n in names]
    write_hf_shards(out_dir, _buckets(sizes, max_shard_bytes), lambda shard: {n: state_dict[n] for n in shard})


def write_hub_layout(
    model: nn.Module,
    shapes: Dict[str, Tuple[Tuple[int, ...], torch.dtype]],
    read: Callable[[List[str]], Dict[str, torch.Tensor]],
    out_dir: str,
    max_shard_bytes: int,
) -> None:
    """Write the model tensors named in `shapes` under the key layout `save_pretrained` writes for `model`'s class
    (per-expert MoE keys, the hub names of VL/Omni models): transformers' own rules, reversed. `read(names)` gives
    the model tensors of one shard, which are converted and written before the next shard is read."""
    groups = plan_save(model, shapes)
    sizes = [(group, sum(_nbytes(*shapes[key]) for key in group.keys)) for group in groups]

    def produce(shard: List[TensorGroup]) -> Dict[str, torch.Tensor]:
        tensors = read([key for group in shard for key in group.keys])
        out = {}
        for group in shard:
            converted = convert_group(group, {key: tensors.pop(key) for key in group.keys}, model)
            # a converter's outputs may be views of one tensor: safetensors refuses shared storage
            out.update({name: t if group.is_rename else t.clone() for name, t in converted.items()})
        return out

    write_hf_shards(out_dir, _buckets(sizes, max_shard_bytes), produce)


def architecture_of(model) -> str:
    names = getattr(model.config, "architectures", None)
    if names:
        return names[0]
    name = type(model).__name__
    return name[4:] if name.startswith("FSDP") else name


def save_hf_model(model, out_dir: str, tokenizer_dir: Optional[str] = None, max_shard_bytes: int = 5 * 2**30) -> None:
    """Gather the full weights of a (sharded) model to rank 0 and write an HF folder there (call on all ranks)."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_model_state_dict(model, options=options)
    # rank 0 writes; a failure there (a full disk) ends every rank at once
    on_rank0(lambda: write_hf_folder(model, state, out_dir, tokenizer_dir, max_shard_bytes))


def write_hf_folder(
    model, state: Dict[str, torch.Tensor], out_dir: str, tokenizer_dir: Optional[str], max_shard_bytes: int
) -> None:
    """`state` (full tensors under `model`'s names; consumed) as an HF folder, replacing `out_dir` at once."""
    tied = set(tied_parameter_names(model))
    kept = {k: v for k, v in state.items() if k not in tied}  # HF re-ties on load
    shapes = {k: (tuple(v.shape), v.dtype) for k, v in kept.items()}
    tmp = out_dir.rstrip("/") + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    write_hub_layout(model, shapes, lambda names: {n: kept.pop(n) for n in names}, tmp, max_shard_bytes)
    export_config(model.config, tmp, architecture_of(model))
    copy_tokenizer(tokenizer_dir, tmp)
    shutil.rmtree(out_dir, ignore_errors=True)
    os.replace(tmp, out_dir)
    logger.info(f"exported HF model to {out_dir}")


def dcp_to_hf(
    checkpoint_dir: str, out_dir: str, max_shard_bytes: int = 5 * 2**30, trust_remote_code: bool = False
) -> str:
    """Consolidate the model of a DCP checkpoint (any world size) into an HF folder, in one process. The metadata
    is read with the allow-list reader; a config naming custom code is refused unless `trust_remote_code`."""
    import torch.distributed.checkpoint as dcp
    from transformers import AutoConfig

    from ..models.multimodal import model_class_for
    from .safe_reader import SafeFileSystemReader

    config_dir = os.path.join(checkpoint_dir, "hf_config")
    if not os.path.isfile(os.path.join(config_dir, "config.json")):
        raise FileNotFoundError(f"{checkpoint_dir}: no hf_config/config.json; is this a veomni checkpoint?")
    config = AutoConfig.from_pretrained(config_dir, trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        skeleton = model_class_for(config).from_config(config, trust_remote_code=trust_remote_code)
    tied = set(tied_parameter_names(skeleton))
    folder = os.path.join(checkpoint_dir, "model_optimizer")
    saved = SafeFileSystemReader(folder).read_metadata().state_dict_metadata  # shapes and dtypes exactly as trained
    shapes = {}
    for key, meta in saved.items():
        name = key[len("model.") :]
        if key.startswith("model.") and name not in tied:
            shapes[name] = (tuple(meta.size), meta.properties.dtype)
    if any(".lora_" in name for name in shapes):  # adapters under PEFT's names: no hub key fits them
        raise ValueError(
            f"{checkpoint_dir} holds LoRA adapters (model.lora): its merged or adapter export is written at the end "
            "of training (train.checkpoint.save_hf_weights, model.lora.export); converting a LoRA DCP checkpoint "
            "is not supported"
        )

    def read(names: List[str]) -> Dict[str, torch.Tensor]:  # one output shard's tensors from the DCP files
        state = {"model": {name: torch.empty(shapes[name][0], dtype=shapes[name][1]) for name in names}}
        dcp.load(state, storage_reader=SafeFileSystemReader(folder), no_dist=True)
        return state["model"]

    tmp = out_dir.rstrip("/") + ".tmp"  # as save_hf_model: no stale shards or index of an earlier export remain
    shutil.rmtree(tmp, ignore_errors=True)
    write_hub_layout(skeleton, shapes, read, tmp, max_shard_bytes)
    export_config(config, tmp, architecture_of(skeleton))
    copy_tokenizer(config_dir, tmp)
    shutil.rmtree(out_dir, ignore_errors=True)
    os.replace(tmp, out_dir)
    return out_dir
