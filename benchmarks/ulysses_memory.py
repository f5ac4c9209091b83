"""Ulysses sequence parallel on CPU/gloo: activation memory per rank vs sequence length, and sync vs async time.

    python benchmarks/ulysses_memory.py memory [--sp 1 2 4] [--lengths 2048 4096 8192] [--budget-mb 512]
    python benchmarks/ulysses_memory.py speed  [--sp 2] [--length 4096] [--steps 4] [--repeats 3]

Model: configs/model/demo_qwen2 (the demo's 4.0M-parameter Qwen2, 4 heads / 2 KV heads), fp32, FSDP2 over the sp
ranks, the trainer's chunked loss. A training row is one packed sequence of the given length made of real
Shakespeare documents (cut at the row's end), sliced by MainCollator exactly as in training.

memory: one process group per sp size; for each (increasing) length, one forward + backward; a rank's activation
memory is its peak RSS (ru_maxrss, a high-water mark) minus its RSS just before the first step (so it also holds
the gradients, the gathered FSDP parameters and the loss chunk: a per-rank constant). glibc is told to serve
blocks over 64 KiB by mmap, so freed activations leave RSS instead of lingering in the heap. The longest length under --budget-mb per rank is reported per sp.
speed: sync and async Ulysses alternate step by step in one process group (the same model, the forward swapped),
so both see the same machine load; the median step time of each over --repeats rounds is reported.
Timings on a shared machine are noisy: read the ratio, and repeat.
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _documents(length: int):
    """Real text as packed samples: Shakespeare documents tokenised with the demo tokenizer until `length`."""
    from veomni.models import build_tokenizer
    from veomni.utils.demo_assets import ensure_demo_assets

    assets = os.path.join(REPO, ".assets")
    ensure_demo_assets(assets, quiet=True)
    tokenizer = build_tokenizer(os.path.join(assets, "tokenizer"))
    samples, total = [], 0
    with open(os.path.join(assets, "shakespeare", "train.jsonl")) as f:
        for line in f:
            ids = tokenizer(json.loads(line)["text"])["input_ids"][: length - total]
            samples.append({"input_ids": ids, "labels": list(ids)})
            total += len(ids)
            if total >= length:
                break
    return samples


def _build(sp: int, async_enabled: bool):
    import torch

    from veomni.distributed import init_parallel_state
    from veomni.distributed.torch_parallelize import build_parallelize_model
    from veomni.models import build_foundation_model

    state = init_parallel_state(ulysses_size=sp, async_enabled=async_enabled)
    torch.manual_seed(0)
    model = build_foundation_model(
        config_path=os.path.join(REPO, "configs", "model", "demo_qwen2"), torch_dtype="float32"
    )
    model = build_parallelize_model(model, basic_modules=["Qwen2DecoderLayer"])
    return state, model


def _step(model, batch, sp: bool):
    from veomni.ops import CausalLMLoss

    labels = batch["labels"]  # shifted by the collator, with or without sequence parallel
    inputs = {k: v for k, v in batch.items() if k not in ("labels", "shift_labels")}
    loss = CausalLMLoss(model, 1024)(labels, **inputs, use_cache=False).loss_sum
    loss.backward()
    model.zero_grad(set_to_none=True)


def worker_memory(args):
    import torch.distributed as dist

    from veomni.data import MainCollator

    sp = int(os.environ["WORLD_SIZE"])
    state, model = _build(sp, False)
    baseline = _rss_mb()
    results = []
    for length in sorted(args.lengths):
        batch = MainCollator()(_documents(length))
        tic = time.perf_counter()
        _step(model, batch, sp > 1)
        elapsed = time.perf_counter() - tic
        per_rank = [None] * sp
        dist.all_gather_object(per_rank, _peak_mb() - baseline)
        results.append({"sp": sp, "length": length, "activation_mb": max(per_rank), "step_s": round(elapsed, 2)})
        if state.is_main_process:
            print(json.dumps(results[-1]), flush=True)
        if max(per_rank) > args.budget_mb:
            break


def worker_speed(args):
    import torch.distributed as dist

    from veomni.data import MainCollator
    from veomni.distributed.sequence_parallel.async_attention import async_ulysses_forward

    sp = int(os.environ["WORLD_SIZE"])
    state, model = _build(sp, False)
    batch = MainCollator()(_documents(args.length))
    attentions = [m for m in model.modules() if type(m).__name__ == "Qwen2Attention"]
    times = {"sync": [], "async": []}
    _step(model, batch, True)  # warm-up
    for _ in range(args.repeats):
        for mode in ("sync", "async"):
            for m in attentions:  # swap the forward: the same weights, the same data
                if mode == "async":
                    m.forward = async_ulysses_forward.__get__(m)
                else:
                    m.__dict__.pop("forward", None)
            dist.barrier()
            tic = time.perf_counter()
            for _ in range(args.steps):
                _step(model, batch, True)
            dist.barrier()
            times[mode].append((time.perf_counter() - tic) / args.steps)
    if state.is_main_process:
        sync, asyn = statistics.median(times["sync"]), statistics.median(times["async"])
        print(json.dumps({"sp": sp, "length": args.length, "sync_s": sync, "async_s": asyn, "all": times}))


def launch(nproc: int, argv):
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), PYTHONPATH=REPO)
    # large blocks straight from mmap and back on free: RSS then follows live tensors, not heap fragmentation
    env.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--master_port=0"]
    cmd += ["--rdzv_backend=c10d", "--rdzv_endpoint=127.0.0.1:0", __file__, *argv]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if out.returncode:
        sys.stderr.write(out.stderr[-4000:])
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["memory", "speed"])
    parser.add_argument("--sp", type=int, nargs="+", default=None)
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    parser.add_argument("--budget-mb", type=float, default=512)
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if "RANK" in os.environ:
        return (worker_memory if args.mode == "memory" else worker_speed)(args)
    argv = sys.argv[1:]
    if args.mode == "speed":
        for row in launch((args.sp or [2])[0], argv):
            print(json.dumps(row))
        return
    table = {}
    for sp in args.sp or [1, 2, 4]:
        for row in launch(sp, argv):
            print(json.dumps(row), flush=True)
            table.setdefault(row["length"], {})[sp] = row
    sizes = args.sp or [1, 2, 4]
    print(f"\nactivation MB per rank (peak RSS - RSS before the first step); budget {args.budget_mb:.0f} MB")
    print("length  " + "  ".join(f"SP {s:>2}" for s in sizes))
    for length in sorted(table):
        row = table[length]
        print(f"{length:>6}  " + "  ".join(f"{row[s]['activation_mb']:5.0f}" if s in row else "    -" for s in sizes))
    for s in sizes:
        fits = [n for n in table if s in table[n] and table[n][s]["activation_mb"] <= args.budget_mb]
        print(f"SP {s}: longest measured sequence within {args.budget_mb:.0f} MB/rank: {max(fits) if fits else 'none'}")


if __name__ == "__main__":
    main()
