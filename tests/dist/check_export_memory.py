"""Under torchrun (2 ranks): a model whose largest tensor is under 1/8 of the whole, loaded into FSDP2 shards from a
hub folder (each rank reading its own slices), exported three ways: the HF export (save_hf_model), and with LoRA on
every linear of the decoder layers the merged and the adapter export. Around each export every rank measures its
peak-RSS growth: the kernel's high-water mark (VmHWM), reset to the current size just before (/proc/self/clear_refs),
less that size. It prints `EXPORT_MEMORY {json}` per rank and export, with its budget: its shard plus the largest
tensor. Then rank 0 checks each folder holds exactly what the rank-0 export wrote: the same keys, dtypes and values
(the hub folder's tensors; the LoRA merge W + scaling * B @ A in fp32 of the gathered tensors; PEFT's adapter state
dict), in files byte for byte as `safetensors.torch.save` writes those tensors. argv: HUB OUT."""

import json
import os
import re
import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save
from torch.distributed.tensor import DTensor

from veomni.checkpoint import save_hf_model
from veomni.distributed import destroy_parallel_state, init_parallel_state
from veomni.distributed.torch_parallelize import build_parallelize_model
from veomni.models import build_foundation_model
from veomni.models.lora import attach_lora, base_checkpoint_names, place_adapters

try:
    from veomni.checkpoint import save_lora_model
except ImportError:  # the code before the LoRA export moved to veomni/checkpoint (to measure it the same way)
    from veomni.models.lora import save_lora_model

LORA = SimpleNamespace(enable=True, r=8, alpha=16.0, dropout=0.0, target_modules=["all-linear"])


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"{key}:\s+(\d+) kB", f.read()).group(1)) * 1024


def measured(what: str, model, export) -> None:
    """Run `export()`, print this rank's peak-RSS growth during it and its budget."""
    params = list(model.parameters())
    shard = sum(p.to_local().numel() * p.element_size() if isinstance(p, DTensor) else 0 for p in params)
    largest = max(p.numel() * p.element_size() for p in params)
    dist.barrier()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the high-water mark starts again from the current size
    before = _status("VmRSS")
    export()
    growth = _status("VmHWM") - before
    result = dict(what=what, rank=dist.get_rank(), growth=growth, shard=shard, largest=largest)
    os.write(1, ("EXPORT_MEMORY " + json.dumps(result) + "\n").encode())  # one write: the ranks share stdout
    dist.barrier()


def build(hub: str, lora: bool):
    model = build_foundation_model(hub, hub, init_device="meta", torch_dtype="float32")
    adapters = attach_lora(model, LORA, seed=0) if lora else {}
    generator = torch.Generator().manual_seed(1)
    for name in adapters:  # B starts at zero: a trained-looking B, so the merge changes every adapted weight
        if ".lora_B." in name:
            adapters[name] = torch.randn(adapters[name].shape, generator=generator) * 0.02
    with base_checkpoint_names(model, adapters):
        model = build_parallelize_model(
            model,
            init_device="meta",
            weights_path=hub,
            basic_modules=["Qwen3DecoderLayer"],
            broadcast_model_weights_from_rank0=False,
        )
    place_adapters(model, adapters)
    return model


def gathered(model):
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu() for k, v in model.state_dict().items()}


def folder(path: str) -> dict:
    """{file: {key: tensor}} of a folder's safetensors files."""
    out = {}
    for name in sorted(f for f in os.listdir(path) if f.endswith(".safetensors")):
        with safe_open(os.path.join(path, name), "pt") as f:
            out[name] = {key: f.get_tensor(key) for key in f.keys()}
    return out


def check(path: str, want: dict, what: str) -> None:
    files = folder(path)
    got = {key: t for tensors in files.values() for key, t in tensors.items()}
    assert sorted(got) == sorted(want), f"{what}: keys differ: {sorted(set(got) ^ set(want))[:6]}"
    unequal = [k for k in want if got[k].dtype != want[k].dtype or not torch.equal(got[k], want[k])]
    assert not unequal, f"{what}: tensors differ: {unequal[:4]}"
    for name, tensors in files.items():
        with open(os.path.join(path, name), "rb") as f:
            assert f.read() == save(tensors, metadata={"format": "pt"}), f"{what}: {name} is not what save_file writes"


def merged_reference(model, full: dict) -> dict:
    """The rank-0 export's merge (veomni/models/lora.py before the move), on the gathered tensors."""
    from veomni.models import lora

    out = {}
    layers = getattr(lora, "lora_layers", None) or lora._lora_layers
    for name, layer in layers(model):
        weight, a, b = (full[f"{name}.{part}.weight"] for part in ("base_layer", "lora_A.default", "lora_B.default"))
        out[f"{name}.weight"] = (weight.float() + (b.float() @ a.float()) * layer.scaling["default"]).to(weight.dtype)
    for key, tensor in full.items():
        base = key.replace(".base_layer.", ".")
        if ".lora_" not in key and base not in out:
            out[base] = tensor
    return out


def main(hub: str, out: str) -> None:
    init_parallel_state()
    rank = dist.get_rank()
    model = build(hub, lora=False)
    measured("hf", model, lambda: save_hf_model(model, os.path.join(out, "hf"), max_shard_bytes=20_000_000))
    if rank == 0:
        check(os.path.join(out, "hf"), {k: t for f in folder(hub).values() for k, t in f.items()}, "hf export")
    del model
    model = build(hub, lora=True)
    merged, adapter = os.path.join(out, "merged"), os.path.join(out, "adapter")
    measured("lora_merged", model, lambda: save_lora_model(model, merged, None, "merged", 20_000_000))
    measured("lora_adapter", model, lambda: save_lora_model(model, adapter, None, "adapter"))
    full = gathered(model)
    if rank == 0:
        from peft import get_peft_model_state_dict

        check(merged, merged_reference(model, full), "LoRA merged export")
        peft = get_peft_model_state_dict(model, state_dict=full, adapter_name="default", save_embedding_layers=False)
        check(adapter, {f"base_model.model.{k}": v for k, v in peft.items()}, "LoRA adapter export")
        print("EXPORT_CHECKS_OK", flush=True)
    dist.barrier()


if __name__ == "__main__":
    try:
        main(*sys.argv[1:])
    finally:
        destroy_parallel_state()
