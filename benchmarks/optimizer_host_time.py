"""Host time of one AdamW step over FSDP2's DTensor parameters: torch's AdamW through DTensor vs veomni's
LocalShardAdamW (the same kernel on the local shards) vs torch's AdamW over plain tensors (the bare loop's).

    OMP_NUM_THREADS=1 python benchmarks/optimizer_host_time.py [--layers 28] [--hidden 32] [--steps 20]

A Qwen3 with Qwen3-1.7B's parameter count per layer (11 tensors; 28 layers: 311 tensors, as on the GPU) but tiny
widths, so the time is the per-tensor host work (what the GPU does not hide behind a host sync), not arithmetic.
FSDP2 over one gloo rank (or a GPU when there is one), each decoder layer a unit, fused AdamW, two parameter groups
as veomni builds them. Prints the median ms per step of each, measured in the same run.
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402

from veomni.models import build_foundation_model  # noqa: E402
from veomni.optim.local_shards import LocalShardAdamW  # noqa: E402
from veomni.optim.optimizer import param_groups  # noqa: E402


def build(layers, hidden, device, shard):
    config = {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 128, "hidden_size": hidden,
        "intermediate_size": 2 * hidden, "num_hidden_layers": layers, "num_attention_heads": 2,
        "num_key_value_heads": 1, "head_dim": 16, "max_position_embeddings": 64, "tie_word_embeddings": False,
        "use_cache": False,
    }  # fmt: skip
    folder = tempfile.mkdtemp(prefix="opt_host_")
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    torch.manual_seed(0)
    model = build_foundation_model(folder, init_device=device, torch_dtype="float32")
    if shard:
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
    for p in model.parameters():
        p.grad = torch.ones_like(p) * 1e-3
    return model


def median_step_ms(optimizer, steps, device, wait=False):
    optimizer.step()  # the state is made in the first step
    times = []
    for _ in range(steps):
        if device == "cuda":
            torch.cuda.synchronize()
        tic = time.perf_counter()
        optimizer.step()
        if wait and device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - tic)  # host time (the kernels queued, not waited for) unless --wait
    return statistics.median(times) * 1e3


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--wait", action="store_true", help="time until the GPU is done too (host + kernels)")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", store=dist.HashStore(), rank=0, world_size=1)
    rows = {}
    for label, cls, shard in (
        ("AdamW over DTensors (torch)", torch.optim.AdamW, True),
        ("LocalShardAdamW over DTensors", LocalShardAdamW, True),
        ("AdamW over plain tensors (bare loop)", torch.optim.AdamW, False),
    ):
        model = build(args.layers, args.hidden, device, shard)
        optimizer = cls(param_groups(model, 0.01), lr=1e-4, fused=True)
        tensors = sum(1 for _ in model.parameters())
        rows[label] = median_step_ms(optimizer, args.steps, device, args.wait)
        print(
            f"{label:40s} {tensors} tensors  {rows[label]:7.2f} ms {'wall' if args.wait else 'host'} time per step ({device})",
            flush=True,
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
