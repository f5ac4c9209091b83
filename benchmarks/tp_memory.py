"""Tensor parallel: per-rank parameter + optimizer memory and step time, tp 2 (2 ranks) vs tp 1 (1 process).

    python benchmarks/tp_memory.py [--config configs/model/demo_qwen2] [--steps 8] [--repeats 3] [--row 512]

The driver launches itself twice (1 process with tp 1, then 2 ranks with tp 2 and dp 1), each training the same
model on the same global batch (2 packed rows of `--row` tokens; AdamW, fp32, chunked loss). It reports the bytes
of the parameters and the AdamW state this rank holds (local shards of DTensors) after the first step, and the
step time of `--repeats` blocks of `--steps` timed steps (after 2 warm-up steps): the median of each block, wall
clock and CPU seconds of all ranks together (steadier on a shared machine).
On CPU, tp 2 runs on 2 cores and tp 1 on one; the ratio is the price of TP's collectives and DTensor dispatch at
this size, not a speed-up forecast for GPUs.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _local_bytes(t) -> int:
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    sys.path.insert(0, REPO)
    from veomni.distributed import clip_grad_norm
    from veomni.distributed.parallel_state import destroy_parallel_state, init_parallel_state
    from veomni.distributed.torch_parallelize import build_parallelize_model
    from veomni.models import build_foundation_model
    from veomni.ops import CausalLMLoss, shift_labels
    from veomni.optim import build_optimizer

    tp = int(os.environ.get("WORLD_SIZE", 1))
    init_parallel_state(tp_size=tp, dp_shard_size=1)
    torch.manual_seed(0)
    model = build_foundation_model(config_path=args.config, torch_dtype="float32")
    model = build_parallelize_model(model, basic_modules=list(model._no_split_modules))
    optimizer = build_optimizer(model, lr=1e-3, weight_decay=0.01)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(1)
    docs = [args.row // 4, args.row // 2, args.row // 4]  # three packed documents per row
    rows = []
    for _ in range(2):
        ids = torch.randint(3, vocab, (1, args.row), generator=g)
        pos = torch.cat([torch.arange(n) for n in docs]).unsqueeze(0)
        rows.append({"input_ids": ids, "position_ids": pos, "labels": shift_labels(ids)})
    tokens = sum(int(r["labels"].numel()) for r in rows)

    def step():
        for mb in rows:
            inputs = {"input_ids": mb["input_ids"], "position_ids": mb["position_ids"], "use_cache": False}
            loss = CausalLMLoss(model, 1024)(mb["labels"], **inputs).loss_sum
            (loss / tokens).backward()
        clip_grad_norm(model, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()
    param_bytes = sum(_local_bytes(p) for p in model.parameters())
    optim_bytes = sum(_local_bytes(v) for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v))
    step()
    blocks, cpu_blocks = [], []
    for _ in range(args.repeats):
        times, cpu = [], []
        for _ in range(args.steps):
            dist.barrier()
            tic, cpu_tic = time.perf_counter(), time.process_time()
            step()
            times.append(time.perf_counter() - tic)
            cpu.append(time.process_time() - cpu_tic)
        blocks.append(statistics.median(times))
        # CPU seconds of all ranks together per step: steadier than wall time on a shared box
        total = torch.tensor(statistics.median(cpu), dtype=torch.float64)
        dist.all_reduce(total)
        cpu_blocks.append(total.item())
    if dist.get_rank() == 0:
        result = {
            "tp": tp,
            "param_bytes": param_bytes,
            "optim_bytes": optim_bytes,
            "step_s": blocks,
            "cpu_s": cpu_blocks,
        }
        with open(args.out, "w") as f:
            json.dump(result, f)
    destroy_parallel_state()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=os.path.join(REPO, "configs", "model", "demo_qwen2"))
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--row", type=int, default=512)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)  # set by the driver for its workers
    args = parser.parse_args()
    if args.out:
        return worker(args)
    env = dict(os.environ, OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE", PYTHONPATH=REPO)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for nproc in (1, 2):
            out = os.path.join(tmp, f"tp{nproc}.json")
            launcher = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}"]
            launcher += ["--master_port=0", "--rdzv_backend=c10d", "--rdzv_endpoint=127.0.0.1:0"]
            flags = ["--config", args.config, "--steps", str(args.steps), "--repeats", str(args.repeats)]
            subprocess.run([*launcher, __file__, *flags, "--row", str(args.row), "--out", out], env=env, check=True)
            with open(out) as f:
                results[nproc] = json.load(f)
    one, two = results[1], results[2]
    for key in ("param_bytes", "optim_bytes"):
        print(
            f"{key:12s} per rank: tp1 {one[key] / 2**20:8.2f} MiB  tp2 {two[key] / 2**20:8.2f} MiB  "
            f"ratio {two[key] / one[key]:.3f}"
        )
    fmt = ", ".join
    print(f"step time tp1 (1 process): median per block {fmt(f'{s * 1e3:.0f} ms' for s in one['step_s'])}")
    print(f"step time tp2 (2 ranks):   median per block {fmt(f'{s * 1e3:.0f} ms' for s in two['step_s'])}")
    print(
        f"CPU-s per step, all ranks: tp1 {fmt(f'{s:.2f}' for s in one['cpu_s'])}; tp2 {fmt(f'{s:.2f}' for s in two['cpu_s'])}"
    )
    ratios = [b / a for a, b in zip(one["step_s"], two["step_s"])]
    print(
        f"tp2 / tp1 step time per block: {fmt(f'{r:.2f}' for r in ratios)} (min {min(ratios):.2f}, "
        f"max {max(ratios):.2f}); same global batch, {2 * args.row} tokens per step"
    )


if __name__ == "__main__":
    main()
