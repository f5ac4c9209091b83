"""HF export of a sharded model: per-rank peak-RSS growth and wall time, this tree against a baseline tree (by
default the code this branch started from: the rank-0 export, which gathered the whole model on rank 0).

    python benchmarks/hf_export.py [--config configs/model/qwen3_1_7b] [--ckpt /tmp/veomni_bench_ckpt]
                                   [--ranks 2 4] [--baseline-ref REF] [--repeats 1]

A random model of `--config` is written once by transformers (bf16, the hub layout, 1 GB shards). Each run is a
fresh torchrun launch: the model is built on meta, sharded by FSDP2 (bf16) and filled with each rank reading its
own slices; then `save_hf_model` exports it (5 GB shards, the default) and each rank reports its peak-RSS growth
during the export (the kernel's high-water mark, reset just before: /proc/self/clear_refs) and the export's wall
time (barrier to barrier). The baseline tree is `git archive REF` of this repository, run by the same worker file;
both exports are then compared byte for byte.
"""

import argparse
import filecmp
import json
import os
import re
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"{key}:\s+(\d+) kB", f.read()).group(1)) * 1024


def worker(code: str, ckpt: str, out: str) -> None:
    sys.path.insert(0, code)
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from veomni.checkpoint import save_hf_model
    from veomni.distributed import destroy_parallel_state, init_parallel_state
    from veomni.distributed.torch_parallelize import build_parallelize_model
    from veomni.models import build_foundation_model

    init_parallel_state()
    model = build_foundation_model(ckpt, ckpt, init_device="meta", torch_dtype="bfloat16")
    model = build_parallelize_model(
        model,
        init_device="meta",
        weights_path=ckpt,
        basic_modules=["Qwen3DecoderLayer"],
        broadcast_model_weights_from_rank0=False,
    )
    shard = sum(p.to_local().numel() * p.element_size() for p in model.parameters() if isinstance(p, DTensor))
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    dist.barrier()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _status("VmRSS")
    start = time.perf_counter()
    save_hf_model(model, out)
    dist.barrier()
    seconds = time.perf_counter() - start
    mine = {"rank": dist.get_rank(), "growth": _status("VmHWM") - before, "rss_before": before, "shard": shard}
    results = [None] * dist.get_world_size()
    dist.all_gather_object(results, dict(mine, seconds=seconds, largest=largest))
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(results), flush=True)
    destroy_parallel_state()


def write_checkpoint(config_dir: str, out: str) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if os.path.isfile(os.path.join(out, "model.safetensors.index.json")):
        return
    print(f"writing a random {config_dir} checkpoint to {out} ...", flush=True)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config_dir), dtype=torch.bfloat16)
    model.save_pretrained(out, max_shard_size="1GB")


def _launch(code: str, ckpt: str, out: str, nproc: int) -> list:
    env = dict(os.environ, OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE")
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--master_port=0"]
    cmd += ["--rdzv_backend=c10d", "--rdzv_endpoint=127.0.0.1:0", os.path.abspath(__file__)]
    cmd += ["--worker", code, "--ckpt", ckpt, "--out", out]
    proc = subprocess.run(cmd, cwd=code, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    (line,) = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    return json.loads(line[len("RESULT ") :])


def _baseline_tree(ref: str, folder: str) -> str:
    archive = subprocess.run(["git", "archive", ref], cwd=REPO, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", folder], input=archive, check=True)
    return folder


def _same(a: str, b: str) -> bool:
    files = sorted(f for f in os.listdir(a) if "safetensors" in f)
    return files == sorted(f for f in os.listdir(b) if "safetensors" in f) and all(
        filecmp.cmp(os.path.join(a, f), os.path.join(b, f), shallow=False) for f in files
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=os.path.join(REPO, "configs", "model", "qwen3_1_7b"))
    parser.add_argument("--ckpt", default="/tmp/veomni_bench_ckpt")
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--baseline-ref", default=None, help="default: the merge base of HEAD and main")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--worker")
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker, args.ckpt, args.out)
    write_checkpoint(args.config, args.ckpt)
    ref = (
        args.baseline_ref
        or subprocess.run(
            ["git", "merge-base", "HEAD", "main"], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout.strip()
    )
    with tempfile.TemporaryDirectory() as tmp:
        os.makedirs(os.path.join(tmp, "base"))
        trees = {f"baseline {ref[:10]}": _baseline_tree(ref, os.path.join(tmp, "base")), "this tree": REPO}
        print(f"{'code':<22}{'ranks':>6}{'seconds':>10}{'growth GiB per rank':>34}{'shard GiB':>11}{'largest':>9}")
        for nproc in args.ranks:
            outs = []
            for label, code in trees.items():
                for _ in range(args.repeats):
                    out = os.path.join(tmp, f"{label.split()[0]}_{nproc}")
                    runs = _launch(code, args.ckpt, out, nproc)
                    growth = " ".join(f"{r['growth'] / 2**30:.2f}" for r in runs)
                    seconds = max(r["seconds"] for r in runs)
                    shard = max(r["shard"] for r in runs) / 2**30
                    print(f"{label:<22}{nproc:>6}{seconds:>10.1f}{growth:>34}{shard:>11.2f}"
                          f"{runs[0]['largest'] / 2**30:>9.2f}", flush=True)  # fmt: skip
                outs.append(out)
            print(f"  exports of {nproc} ranks byte-identical: {_same(*outs)}", flush=True)


if __name__ == "__main__":
    main()
