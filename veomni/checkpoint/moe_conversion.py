"""scripts/moe_merge.py and moe_split.py: an MoE checkpoint between the hub's per-expert keys and the model's own
merged expert tensors, by transformers' own conversion rules (models/hf_conversion.py), the way `from_pretrained`
reads a checkpoint and `save_pretrained` writes one.

    per-expert (HF):   <p>.experts.{e}.gate_proj.weight [I, H], .up_proj.weight [I, H], .down_proj.weight [H, I]
    fused (default):   <p>.experts.gate_up_proj [E, 2I, H], <p>.experts.down_proj [E, H, I]
    stacked:           <p>.experts.gate_proj [E, I, H], <p>.experts.up_proj [E, I, H], <p>.experts.down_proj [E, H, I]

The merged checkpoint is the model's own layout (what veomni and `from_pretrained` load directly); the split one is
what `save_pretrained` writes. Every key is checked before a tensor is read (loader.py), then tensors are read,
converted and written one group at a time (one layer's experts at most) into the shard they came from.
"""

import os
import re
import shutil
from typing import Dict, List, Tuple

import torch

from ..models.loader import INDEX_FILE, ModelWeights
from .hf_export import Item, hub_items, produce
from .safetensors_layout import Layout, Spec

_PER_EXPERT = re.compile(r"\.experts\.\d+\.")
_MERGED = re.compile(r"\.experts\.(gate_up_proj|gate_proj|up_proj|down_proj)$")


def _weights(src: str) -> ModelWeights:
    """The checkpoint read as the model its config.json describes (built on meta: names, shapes and rules only)."""
    from transformers import AutoConfig

    from ..models.multimodal import model_class_for

    config = AutoConfig.from_pretrained(src)
    with torch.device("meta"):
        model = model_class_for(config).from_config(config)
    return ModelWeights(src, model)


def _sources(weights: ModelWeights) -> Dict[str, Tuple[str, torch.dtype]]:
    """Each model tensor the checkpoint gives: (the file its last source key is in, its dtype there)."""
    out = {}
    for group in weights.groups:
        last = group.keys[-1]
        for target in group.targets():
            out[target] = (os.path.basename(weights.files.file_of[last]), weights.files.dtype[last])
    return out


def _layers(names: List[str]) -> int:
    return len({name.split(".experts.")[0] for name in names if ".experts." in name})


def _write(src: str, dst: str, weights: ModelWeights, files: Dict[str, List[Spec]], items: List[Item]) -> None:
    """Side files copied; `items` written from the model tensors `weights` streams, each as soon as it is whole."""
    os.makedirs(dst, exist_ok=True)
    for name in os.listdir(src):
        path = os.path.join(src, name)
        if os.path.isfile(path) and not name.endswith(".safetensors") and name != INDEX_FILE:
            shutil.copy2(path, os.path.join(dst, name))
    layout = Layout({file: specs for file, specs in files.items() if specs})
    layout.create(dst)
    waiting = {key: item for item in items for key in item.keys}
    held: Dict[str, torch.Tensor] = {}
    for name, tensor, _ in weights.tensors():
        held[name] = tensor
        item = waiting.pop(name)
        if all(key in held for key in item.keys):
            for out, value in produce(item, {key: held.pop(key) for key in item.keys}).items():
                layout.write(dst, out, value)
    layout.close()


def merge_moe_checkpoint(src: str, dst: str, layout: str = "fused") -> Dict[str, int]:
    """HF per-expert keys -> the model's merged expert tensors (`stacked`: gate and up kept apart)."""
    if layout not in ("fused", "stacked"):
        raise ValueError(f"layout must be fused or stacked, got {layout!r}")
    weights = _weights(src)
    if not any(_PER_EXPERT.search(key) for key in weights.files.keys()):
        raise ValueError(
            f"{src}: no per-expert keys (*.experts.N.gate_proj.weight): not an HF per-expert MoE "
            "checkpoint (already merged?)"
        )
    sources, shapes = _sources(weights), {n: tuple(t.shape) for n, t in weights.model.state_dict().items()}
    files: Dict[str, List[Spec]] = {os.path.basename(f): [] for f in weights.files.files}
    items = []
    for name, (file, dtype) in sources.items():
        outputs = [(name, shapes[name], dtype)]
        convert = None
        if layout == "stacked" and name.endswith("experts.gate_up_proj"):
            half = (shapes[name][0], shapes[name][1] // 2, *shapes[name][2:])
            outputs = [(name.replace("gate_up_proj", part), half, dtype) for part in ("gate_proj", "up_proj")]
            convert = _unstack(name, outputs)
        items.append(Item([name], outputs, convert))
        files[file] += outputs
    _write(src, dst, weights, files, items)
    converted = [g.target for g in weights.groups if not g.is_rename]
    return {"layers": _layers(converted), "shards": len(weights.files.files)}


def _unstack(name: str, outputs: List[Spec]):
    return lambda tensors: dict(zip([o[0] for o in outputs], tensors[name].chunk(2, dim=1)))


def split_moe_checkpoint(src: str, dst: str) -> Dict[str, int]:
    """Merged expert tensors (fused or stacked) -> HF per-expert keys, as `save_pretrained` writes them."""
    weights = _weights(src)
    if not any(_MERGED.search(key) for key in weights.files.keys()):
        raise ValueError(f"{src}: no merged expert tensors (*.experts.gate_up_proj / gate_proj): nothing to split")
    sources = _sources(weights)
    shapes = {n: (tuple(t.shape), sources[n][1]) for n, t in weights.model.state_dict().items() if n in sources}
    items = hub_items(weights.model, shapes)
    files: Dict[str, List[Spec]] = {os.path.basename(f): [] for f in weights.files.files}
    for item in items:
        files[sources[item.keys[0]][0]] += item.outputs
    _write(src, dst, weights, files, items)
    return {"layers": _layers([i.keys[0] for i in items if i.convert is not None]), "shards": len(files)}


def peak_rss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
