"""Loading a real-size HF checkpoint: wall time and peak RSS per rank, against transformers' `from_pretrained`.

    python benchmarks/load_checkpoint.py [--config configs/model/qwen3_1_7b] [--ckpt /tmp/veomni_bench_ckpt]
                                         [--shard 1GB] [--repeats 2]

A random model of `--config` is written once by transformers' `save_pretrained` (bf16, sharded at `--shard`, the
hub layout). Each run is a fresh process (peak RSS is per process): transformers' `from_pretrained` into fp32 (the
baseline, one process), then ours: `build_foundation_model` on meta + `build_parallelize_model` (FSDP2, fp32
masters) on 1 and 2 ranks, reading on rank 0 and broadcasting, or each rank reading its own slices. Every loaded
model is checked against the checkpoint (a few tensors compared exactly) before its time counts.
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
PROBES = ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight", "model.norm.weight")


def _peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def write_checkpoint(config_dir: str, out: str, shard: str) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if os.path.isfile(os.path.join(out, "model.safetensors.index.json")):
        return
    print(f"writing a random {config_dir} checkpoint to {out} ...", flush=True)
    config = AutoConfig.from_pretrained(config_dir)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out, max_shard_size=shard)


def _probe(ckpt: str):
    from veomni.models.loader import CheckpointFiles

    with CheckpointFiles(ckpt) as files:
        return {k: files.read(k).float() for k in PROBES}


def baseline_worker(ckpt: str) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    seconds, rss = time.perf_counter() - start, _peak_rss_gb()  # before the check below allocates
    state = model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in _probe(ckpt).items())
    return [{"seconds": seconds, "peak_rss_gb": rss}]


def veomni_worker(ckpt: str, read: str) -> dict:
    import torch
    import torch.distributed as dist

    sys.path.insert(0, REPO)
    from veomni.distributed import destroy_parallel_state, init_parallel_state
    from veomni.distributed.torch_parallelize import build_parallelize_model
    from veomni.models import build_foundation_model

    init_parallel_state()
    dist.barrier()
    start = time.perf_counter()
    model = build_foundation_model(ckpt, ckpt, init_device="meta", torch_dtype="float32")
    model = build_parallelize_model(
        model,
        init_device="meta",
        weights_path=ckpt,
        basic_modules=["Qwen3DecoderLayer"],
        broadcast_model_weights_from_rank0=read == "broadcast",
    )
    dist.barrier()
    seconds, rss = time.perf_counter() - start, _peak_rss_gb()  # before the check below allocates
    state = model.state_dict()
    for key, want in _probe(ckpt).items():
        got = state[key].full_tensor() if hasattr(state[key], "full_tensor") else state[key]
        assert torch.equal(got, want), key
    results = [None] * dist.get_world_size()
    dist.all_gather_object(results, {"rank": dist.get_rank(), "seconds": seconds, "peak_rss_gb": rss})
    destroy_parallel_state()
    return results


def _launch(argv, nproc: int) -> list:
    env = dict(os.environ, OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE")
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--master_port=0"]
        cmd += ["--rdzv_backend=c10d", "--rdzv_endpoint=127.0.0.1:0", *argv]
    else:
        cmd = [sys.executable, *argv]
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
    (line,) = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    return json.loads(line[len("RESULT ") :])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=os.path.join(REPO, "configs", "model", "qwen3_1_7b"))
    parser.add_argument("--ckpt", default="/tmp/veomni_bench_ckpt")
    parser.add_argument("--shard", default="1GB")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--worker", choices=["baseline", "broadcast", "local"])
    args = parser.parse_args()
    if args.worker:
        fn = baseline_worker if args.worker == "baseline" else veomni_worker
        result = fn(args.ckpt) if args.worker == "baseline" else fn(args.ckpt, args.worker)
        if int(os.environ.get("RANK", "0")) == 0:
            print("RESULT " + json.dumps(result), flush=True)
        return
    write_checkpoint(args.config, args.ckpt, args.shard)
    size = sum(os.path.getsize(os.path.join(args.ckpt, f)) for f in os.listdir(args.ckpt)) / 2**30
    print(f"checkpoint: {args.ckpt} ({size:.2f} GiB on disk); loading into fp32", flush=True)
    me = os.path.abspath(__file__)
    rows = [("transformers from_pretrained", 1, "baseline")]
    rows += [(f"veomni {read}", n, read) for n in (1, 2) for read in ("broadcast", "local")]
    print(f"{'loader':<30}{'ranks':>6}{'seconds (runs)':>28}{'peak RSS GiB per rank':>26}")
    baseline = None
    for label, nproc, worker in rows:
        runs = [_launch([me, "--ckpt", args.ckpt, "--worker", worker], nproc) for _ in range(args.repeats)]
        seconds = [max(r["seconds"] for r in run) for run in runs]
        rss = max(r["peak_rss_gb"] for run in runs for r in run)
        baseline = baseline or statistics.median(seconds)
        ratio = statistics.median(seconds) / baseline
        spread = ", ".join(f"{s:.1f}" for s in seconds)
        print(f"{label:<30}{nproc:>6}{spread:>20} ({ratio:.2f}x){rss:>20.2f}", flush=True)


if __name__ == "__main__":
    main()
