"""Converting MoE checkpoints between HF's per-expert keys and veomni's merged expert tensors, shard by shard.

    per-expert (HF):   <p>.experts.{e}.gate_proj.weight [I, H], .up_proj.weight [I, H], .down_proj.weight [H, I]
    fused (default):   <p>.experts.gate_up_proj [E, 2I, H], <p>.experts.down_proj [E, H, I]
    stacked:           <p>.experts.gate_proj [E, I, H], <p>.experts.up_proj [E, I, H], <p>.experts.down_proj [E, H, I]

`<p>` is any prefix (`model.layers.3.mlp`, `thinker.model.layers.0.mlp`, ...); dense layers (DeepSeek's
first_k_dense_replace) and shared experts pass through untouched. Which experts a layer has comes from the
checkpoint's own key list, so a layer is written as soon as its last expert has been read: memory stays about one
shard plus the layers that straddle shards, never the whole model.
"""

import json
import os
import re
import shutil
from collections import defaultdict
from typing import Dict, List, Optional, Set, Tuple

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .loader import INDEX_FILE, SINGLE_FILE, num_experts_of

PER_EXPERT = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")
MERGED = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<proj>gate_up_proj|gate_proj|up_proj|down_proj)$")


def _shard_keys(folder: str) -> List[Tuple[str, List[str]]]:
    """(shard file, its keys) in checkpoint order, from the index or the single file's header."""
    index = os.path.join(folder, INDEX_FILE)
    if os.path.isfile(index):
        with open(index) as f:
            weight_map: Dict[str, str] = json.load(f)["weight_map"]
        by_file: Dict[str, List[str]] = defaultdict(list)
        for key, file in weight_map.items():
            by_file[file].append(key)
        return sorted(by_file.items())
    single = os.path.join(folder, SINGLE_FILE)
    if not os.path.isfile(single):
        raise FileNotFoundError(f"{folder}: no {INDEX_FILE} or {SINGLE_FILE}; is this an HF checkpoint folder?")
    with safe_open(single, "pt") as f:
        return [(SINGLE_FILE, list(f.keys()))]


def _copy_side_files(src: str, dst: str) -> None:
    os.makedirs(dst, exist_ok=True)
    for name in os.listdir(src):
        path = os.path.join(src, name)
        if os.path.isfile(path) and not name.endswith(".safetensors") and name != INDEX_FILE:
            shutil.copy2(path, os.path.join(dst, name))


def _save_shard(dst: str, file: str, tensors: Dict[str, torch.Tensor]) -> Dict[str, int]:
    """Write one output shard; keep only its key sizes (for the index), never the tensors."""
    save_file(tensors, os.path.join(dst, file), metadata={"format": "pt"})
    return {key: t.numel() * t.element_size() for key, t in tensors.items()}


def _write_index(dst: str, shards: List[Tuple[str, Dict[str, int]]], single: bool) -> None:
    weight_map = {key: file for file, sizes in shards for key in sizes}
    total = sum(n for _, sizes in shards for n in sizes.values())
    if not single:
        with open(os.path.join(dst, INDEX_FILE), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2, sort_keys=True)


def _config(folder: str) -> dict:
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{folder}: no config.json")
    with open(path) as f:
        return json.load(f)


class _Cfg:
    def __init__(self, d):
        self.__dict__.update({k: (_Cfg(v) if isinstance(v, dict) else v) for k, v in d.items()})


def merge_moe_checkpoint(src: str, dst: str, layout: str = "fused") -> Dict[str, int]:
    """HF per-expert keys -> merged expert tensors. Returns counts for the report."""
    if layout not in ("fused", "stacked"):
        raise ValueError(f"layout must be fused or stacked, got {layout!r}")
    shards = _shard_keys(src)
    expected: Dict[str, Set[int]] = defaultdict(set)
    for _, keys in shards:
        for key in keys:
            m = PER_EXPERT.match(key)
            if m:
                expected[m["prefix"]].add(int(m["expert"]))
    if not expected:
        raise ValueError(
            f"{src}: no per-expert keys (*.experts.N.gate_proj.weight): not an HF per-expert MoE "
            "checkpoint (already merged?)"
        )
    for prefix, experts in expected.items():
        if experts != set(range(len(experts))):
            raise ValueError(f"{src}: {prefix} has experts {sorted(experts)[:8]}..., not 0..N-1")
    configured = num_experts_of(_Cfg(_config(src)))
    counts = {len(e) for e in expected.values()}
    if configured is not None and configured not in counts:  # omni models may mix counts (thinker / talker)
        raise ValueError(f"{src}: layers have {sorted(counts)} experts but config.json says {configured}")
    _copy_side_files(src, dst)
    pending: Dict[str, _MergedLayer] = {}
    written, layers = [], 0
    for file, keys in shards:
        out: Dict[str, torch.Tensor] = {}
        with safe_open(os.path.join(src, file), "pt") as f:
            for key in keys:
                m = PER_EXPERT.match(key)
                if not m:
                    out[key] = f.get_tensor(key)
                    continue
                prefix = m["prefix"]
                layer = pending.get(prefix) or pending.setdefault(prefix, _MergedLayer(len(expected[prefix]), layout))
                if layer.add(int(m["expert"]), m["proj"], f.get_tensor(key)):
                    out.update(layer.tensors(prefix))
                    del pending[prefix]
                    layers += 1
        written.append((file, _save_shard(dst, file, out)))
        del out
    if pending:
        raise ValueError(f"{src}: incomplete experts for {sorted(pending)[:4]}")
    _write_index(dst, written, single=len(shards) == 1)
    return {"layers": layers, "shards": len(shards)}


class _MergedLayer:
    """One layer's merged expert tensors, filled in place as each expert's weight arrives (then freed), so a
    layer never exists twice in memory."""

    def __init__(self, num_experts: int, layout: str):
        self.n, self.layout, self.seen = num_experts, layout, 0
        self.buffers: Dict[str, torch.Tensor] = {}

    def add(self, expert: int, proj: str, tensor: torch.Tensor) -> bool:
        if self.layout == "fused" and proj in ("gate_proj", "up_proj"):
            rows = tensor.shape[0]
            buffer = self._buffer("gate_up_proj", (self.n, 2 * rows, tensor.shape[1]), tensor.dtype)
            buffer[expert, (0 if proj == "gate_proj" else rows) : (rows if proj == "gate_proj" else 2 * rows)] = tensor
        else:
            self._buffer(proj, (self.n, *tensor.shape), tensor.dtype)[expert] = tensor
        self.seen += 1
        return self.seen == 3 * self.n

    def _buffer(self, name, shape, dtype) -> torch.Tensor:
        if name not in self.buffers:
            self.buffers[name] = torch.empty(shape, dtype=dtype)
        return self.buffers[name]

    def tensors(self, prefix: str) -> Dict[str, torch.Tensor]:
        return {f"{prefix}.{name}": t for name, t in self.buffers.items()}


def split_moe_checkpoint(src: str, dst: str) -> Dict[str, int]:
    """Merged expert tensors (fused or stacked) -> HF per-expert keys."""
    shards = _shard_keys(src)
    if not any(MERGED.match(k) for _, keys in shards for k in keys):
        raise ValueError(f"{src}: no merged expert tensors (*.experts.gate_up_proj / gate_proj): nothing to split")
    _copy_side_files(src, dst)
    written, layers = [], 0
    for file, keys in shards:
        out: Dict[str, torch.Tensor] = {}
        with safe_open(os.path.join(src, file), "pt") as f:
            for key in keys:
                tensor = f.get_tensor(key)
                m = MERGED.match(key)
                if not m:
                    out[key] = tensor
                    continue
                prefix, proj = m["prefix"], m["proj"]
                if proj == "gate_up_proj":
                    half = tensor.shape[1] // 2
                    for e in range(tensor.shape[0]):
                        out[f"{prefix}.{e}.gate_proj.weight"] = tensor[e, :half].clone()
                        out[f"{prefix}.{e}.up_proj.weight"] = tensor[e, half:].clone()
                    layers += 1
                else:
                    for e in range(tensor.shape[0]):
                        out[f"{prefix}.{e}.{proj}.weight"] = tensor[e].clone()
        written.append((file, _save_shard(dst, file, out)))
        del out
    _write_index(dst, written, single=len(shards) == 1)
    return {"layers": layers, "shards": len(shards)}


def peak_rss_mb() -> Optional[float]:
    try:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    except ImportError:
        return None
