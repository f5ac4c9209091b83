"""Consolidated HF-format folders (config.json, safetensors shards + index, tokenizer / processor files), from a
live (sharded) model or from a DCP checkpoint, loadable by plain `transformers.AutoModelForCausalLM.from_pretrained`
(`AutoModelForImageTextToText` and `AutoProcessor` for vision/audio-language models)."""

import copy
import json
import os
import shutil
from typing import Dict, Optional

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from ..models.loader import tied_parameter_names
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


def _save_readable(tensors: Dict[str, torch.Tensor], path: str) -> None:
    """`save_file`, then the permissions any other file gets here: safetensors writes through a private temporary
    file (mode 0600), which would make an exported model unreadable to everyone else."""
    save_file(tensors, path, metadata={"format": "pt"})
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def write_safetensors(state_dict: Dict[str, torch.Tensor], out_dir: str, max_shard_bytes: int = 5 * 2**30) -> None:
    """One file, or shards with a `model.safetensors.index.json`, written beside each other atomically enough
    (index last) that a reader never sees an index pointing at missing shards."""
    os.makedirs(out_dir, exist_ok=True)
    shards, current, size = [], {}, 0
    for name in sorted(state_dict):
        tensor = state_dict[name].detach().contiguous().cpu()
        nbytes = tensor.numel() * tensor.element_size()
        if current and size + nbytes > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = tensor
        size += nbytes
    shards.append(current)
    if len(shards) == 1:
        _save_readable(shards[0], os.path.join(out_dir, "model.safetensors"))
        return
    weight_map, total = {}, 0
    for i, shard in enumerate(shards, 1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        _save_readable(shard, os.path.join(out_dir, file))
        for name, t in shard.items():
            weight_map[name] = file
            total += t.numel() * t.element_size()
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)


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
    if dist.get_rank() == 0:
        tied = set(tied_parameter_names(model))
        state = {k: v for k, v in state.items() if k not in tied}  # HF re-ties on load
        tmp = out_dir.rstrip("/") + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        write_safetensors(state, tmp, max_shard_bytes)
        export_config(model.config, tmp, architecture_of(model))
        copy_tokenizer(tokenizer_dir, tmp)
        shutil.rmtree(out_dir, ignore_errors=True)
        os.replace(tmp, out_dir)
        logger.info(f"exported HF model to {out_dir}")
    dist.barrier()


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
    reader = SafeFileSystemReader(os.path.join(checkpoint_dir, "model_optimizer"))
    saved = reader.read_metadata().state_dict_metadata  # shapes and dtypes exactly as trained
    state = {"model": {}}
    for key, meta in saved.items():
        name = key[len("model.") :]
        if key.startswith("model.") and name not in tied:
            state["model"][name] = torch.empty(meta.size, dtype=meta.properties.dtype)
    dcp.load(state, storage_reader=SafeFileSystemReader(os.path.join(checkpoint_dir, "model_optimizer")), no_dist=True)
    write_safetensors(state["model"], out_dir, max_shard_bytes)
    export_config(config, out_dir, architecture_of(skeleton))
    copy_tokenizer(config_dir, out_dir)
    return out_dir
