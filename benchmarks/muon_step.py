"""Optimizer step time: AdamW vs Muon (+ AdamW), and Muon's two ways to spread Newton-Schulz over ranks.

    torchrun --nproc_per_node=2 benchmarks/muon_step.py [--config configs/model/demo_qwen2] [--repeats 10]

An FSDP2-wrapped model from `--config` gets fixed random gradients; each optimizer's `step()` is timed (median of
`--repeats`, after one warm-up step that also allocates state). Printed on rank 0, per optimizer: median step time
and its ratio to AdamW's, measured in the same run. Muon cases: `owner` (each matrix orthogonalised by one rank,
two all-to-alls) and `all_gather` (every rank gathers and orthogonalises every matrix).
"""

import argparse
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor

sys.path.insert(0, ".")
from veomni.distributed import destroy_parallel_state, init_parallel_state  # noqa: E402
from veomni.distributed.torch_parallelize import build_parallelize_model  # noqa: E402
from veomni.models import build_foundation_model  # noqa: E402
from veomni.optim import build_optimizer  # noqa: E402


def time_steps(model, opt, repeats):
    for p in model.parameters():  # the same gradients for every optimizer
        g = torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel()))
        p.grad = distribute_tensor(g, p.device_mesh, p.placements) if isinstance(p, DTensor) else g
    opt.step()  # warm-up: state allocation
    times = []
    for _ in range(repeats):
        dist.barrier()
        tic = time.perf_counter()
        opt.step()
        dist.barrier()
        times.append(time.perf_counter() - tic)
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default="configs/model/demo_qwen2")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--layer", default="Qwen2DecoderLayer")
    args = parser.parse_args()
    init_parallel_state()
    torch.manual_seed(0)
    model = build_parallelize_model(
        build_foundation_model(args.config, torch_dtype="float32"), basic_modules=[args.layer]
    )
    cases = {
        "adamw": dict(optimizer_type="adamw"),
        "muon owner": dict(optimizer_type="muon", strategy="owner"),
        "muon all_gather": dict(optimizer_type="muon", strategy="all_gather"),
    }
    results = {
        name: time_steps(model, build_optimizer(model, lr=1e-4, **kw), args.repeats) for name, kw in cases.items()
    }
    if dist.get_rank() == 0:
        params = sum(p.numel() for p in model.parameters()) / 1e6
        print(f"{args.config}: {params:.2f}M params, {dist.get_world_size()} ranks, median of {args.repeats} steps")
        for name, seconds in results.items():
            print(f"  {name:16s} {seconds * 1e3:8.1f} ms   x{seconds / results['adamw']:.2f} of adamw")
    destroy_parallel_state()


if __name__ == "__main__":
    main()
