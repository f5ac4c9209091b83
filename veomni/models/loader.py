"""Reading HF checkpoints (safetensors, or PyTorch `.bin` with `weights_only=True`; one file or a sharded index),
one tensor at a time."""

import contextlib
import json
import os
import re
from typing import Dict, Iterable, Iterator, List, Optional, Tuple

import torch
from safetensors import safe_open
from torch import nn

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# PyTorch pickle weights (older HF folders): read only with `torch.load(weights_only=True)`, which refuses any
# callable a crafted file could name; safetensors (no code at all) are preferred whenever both are present.
BIN_SINGLE_FILE = "pytorch_model.bin"
BIN_INDEX_FILE = "pytorch_model.bin.index.json"
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth")


def _indexed_files(folder: str, index: str) -> List[str]:
    with open(index) as f:
        weight_map: Dict[str, str] = json.load(f)["weight_map"]
    return [os.path.join(folder, name) for name in sorted(set(weight_map.values()))]


def safetensors_files(weights_path: str) -> List[str]:
    """The weight files of a checkpoint folder (or the single file given), in a stable order: safetensors, or
    else PyTorch `.bin` files (loaded with `weights_only=True`)."""
    if os.path.isfile(weights_path):
        return [weights_path]
    # unindexed shards: any *.safetensors, but only pytorch_model*.bin (not e.g. a Trainer's training_args.bin)
    formats = (
        (INDEX_FILE, SINGLE_FILE, "", ".safetensors"),
        (BIN_INDEX_FILE, BIN_SINGLE_FILE, "pytorch_model", ".bin"),
    )
    names = sorted(os.listdir(weights_path)) if os.path.isdir(weights_path) else []
    for index, single, prefix, suffix in formats:
        if os.path.isfile(os.path.join(weights_path, index)):
            return _indexed_files(weights_path, os.path.join(weights_path, index))
        if os.path.isfile(os.path.join(weights_path, single)):
            return [os.path.join(weights_path, single)]
        found = [f for f in names if f.startswith(prefix) and f.endswith(suffix)]
        if found:
            return [os.path.join(weights_path, f) for f in found]
    raise FileNotFoundError(
        f"no weights in {weights_path} (looked for {INDEX_FILE}, {SINGLE_FILE}, {BIN_INDEX_FILE}, {BIN_SINGLE_FILE})"
    )


def load_pickled_weights(path: str) -> Dict[str, torch.Tensor]:
    """A PyTorch `.bin`/`.pt` state dict, unpickled with `weights_only=True`: tensors and plain containers only,
    so a crafted file cannot run code. The error names the file."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:
        raise ValueError(
            f"{path}: refused or unreadable PyTorch weights (loaded with weights_only=True, which allows tensors "
            f"only; convert the checkpoint to safetensors if it is yours): {type(err).__name__}: {err}"
        ) from err
    if not isinstance(state, dict) or not all(torch.is_tensor(v) for v in state.values()):
        raise ValueError(f"{path}: not a state dict of tensors")
    return state


def iter_safetensors(weights_path: str) -> Iterator[Tuple[str, torch.Tensor]]:
    """Yield `(name, tensor)` file by file, so memory is bounded by one tensor (one `.bin` shard), not the model."""
    for path in safetensors_files(weights_path):
        if path.endswith(_PICKLE_SUFFIXES):
            yield from load_pickled_weights(path).items()
            continue
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


@contextlib.contextmanager
def init_empty_weights():
    """Build parameters on the meta device but keep buffers real (RoPE `inv_freq` stays correct)."""
    original = nn.Module.register_parameter

    def register_parameter(module, name, param):
        original(module, name, param)
        if param is not None and not param.is_meta:  # a meta param re-registered (weight tying) stays the same object
            kwargs = {"requires_grad": param.requires_grad}
            module._parameters[name] = nn.Parameter(module._parameters[name].to("meta"), **kwargs)

    nn.Module.register_parameter = register_parameter
    try:
        yield
    finally:
        nn.Module.register_parameter = original


def tied_parameter_names(model: nn.Module) -> List[str]:
    """Names that share storage with an earlier parameter (e.g. a tied lm_head): not loaded separately."""
    seen, tied = {}, []
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in seen:
            tied.append(name)
        else:
            seen[id(param)] = name
    return tied


@torch.no_grad()
def load_weights(model: nn.Module, weights_path: str, strict: bool = True) -> None:
    """Copy a safetensors checkpoint into a materialised (non-meta, non-sharded) model."""
    state = model.state_dict()
    tied = set(tied_parameter_names(model))
    loaded = set()
    for name, tensor in iter_model_weights(weights_path, getattr(model, "config", None)):
        if name not in state:
            if strict and name not in tied:
                raise KeyError(
                    f"{weights_path}: checkpoint key '{name}' matches no parameter of {type(model).__name__}"
                )
            continue
        target = state[name]
        if target.shape != tensor.shape:
            raise ValueError(
                f"{weights_path}: '{name}' has shape {tuple(tensor.shape)}, model expects {tuple(target.shape)}"
            )
        target.copy_(tensor.to(target.dtype))
        loaded.add(name)
    missing = [n for n in state if n not in loaded and n not in tied and n not in _non_persistent(model)]
    if strict and missing:
        raise KeyError(f"{weights_path}: missing weights for {missing[:8]}{' ...' if len(missing) > 8 else ''}")


def _non_persistent(model: nn.Module) -> set:
    names = set()
    for prefix, module in model.named_modules():
        for b in module._non_persistent_buffers_set:
            names.add(f"{prefix}.{b}" if prefix else b)
    return names


_PER_EXPERT = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")
_STACKED = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<proj>gate_proj|up_proj)$")


def num_experts_of(config) -> Optional[int]:
    for source in (config, getattr(config, "text_config", None), getattr(config, "thinker_config", None)):
        for name in ("num_experts", "n_routed_experts", "num_local_experts"):
            value = getattr(source, name, None) if source is not None else None
            if isinstance(value, int) and value > 0:
                return value
    return None


def fuse_experts(tensors: Iterable[Tuple[str, torch.Tensor]], num_experts: Optional[int]):
    """Per-expert HF keys (`experts.{e}.gate_proj.weight` ...) and stacked `experts.gate_proj`/`up_proj` become the
    fused `experts.gate_up_proj` [E, 2I, H] and `experts.down_proj` [E, H, I]; everything else passes through.
    A layer's experts are held only until its last one arrives, so memory stays about one layer."""
    pending: Dict[str, Dict[Tuple[int, str], torch.Tensor]] = {}
    stacked: Dict[str, Dict[str, torch.Tensor]] = {}
    for name, tensor in tensors:
        match = _PER_EXPERT.match(name)
        if match and num_experts:
            layer = pending.setdefault(match["prefix"], {})
            layer[(int(match["expert"]), match["proj"])] = tensor
            if len(layer) == 3 * num_experts:
                del pending[match["prefix"]]
                gate_up = [torch.cat([layer[(e, "gate_proj")], layer[(e, "up_proj")]]) for e in range(num_experts)]
                yield f"{match['prefix']}.gate_up_proj", torch.stack(gate_up)
                yield f"{match['prefix']}.down_proj", torch.stack([layer[(e, "down_proj")] for e in range(num_experts)])
            continue
        match = _STACKED.match(name)
        if match:
            pair = stacked.setdefault(match["prefix"], {})
            pair[match["proj"]] = tensor
            if len(pair) == 2:
                del stacked[match["prefix"]]
                yield f"{match['prefix']}.gate_up_proj", torch.cat([pair["gate_proj"], pair["up_proj"]], dim=1)
            continue
        yield name, tensor
    incomplete = sorted(pending) + sorted(stacked)
    if incomplete:
        raise KeyError(f"checkpoint has incomplete experts for {incomplete[:4]} (expected {num_experts} per layer)")


def iter_model_weights(weights_path: str, config=None) -> Iterator[Tuple[str, torch.Tensor]]:
    """A checkpoint's tensors under the model's own names (experts fused on the fly)."""
    tensors = iter_safetensors(weights_path)
    return fuse_experts(tensors, num_experts_of(config)) if config is not None else tensors
