"""Training throughput and MFU on one GPU: Qwen3-0.6B / 1.7B / 4B and a small Qwen3-MoE, from config only.

    python benchmarks/gpu_mfu.py [--models qwen3_0_6b,qwen3_1_7b] [--tokens 8192,32768] [--steps 8]

Architectures come from configs/model/*/config.json (the public configs; random init, no weights). The MoE is
Qwen3-30B-A3B's layer shape (128 experts, top-8) cut to `--moe-layers` layers so that it fits one GPU. Each
micro-batch packs real-length documents (256-4096 tokens, seeded) up to the token budget; fp32 parameters, bf16 compute, AdamW.

For each model and budget, in the same process:
  * trainer: our BaseTrainer step (FSDP2 over 1 rank, veomni_varlen attention, chunked loss, fused MoE experts,
    loss-token all-reduce, grad clipping, scheduler, metrics);
  * bare:    the same model and kernels in a plain loop (forward, chunked loss, backward, clip, AdamW step), fp32
             parameters under bf16 autocast (the trainer: fp32 parameters, bf16 compute through FSDP2's policy).
Prints tokens/s, MFU, peak memory and trainer/bare. If a budget runs out of memory it is retried with
activation checkpointing (and says so); `--checkpointing both` measures each, for the longest trainable context.

MFU = achieved FLOP/s / the GPU's dense bf16 peak (H100/H200 SXM 989 TFLOP/s; --peak-tflops to override), with
training FLOPs per micro-batch = 6 * N_active * T  +  6 * L * H * d * sum_docs(len^2)
  N_active: parameters in matmuls per token (attention + MLP, for MoE the top-k experts and the router, plus
  the output head; embeddings excluded); T: tokens; second term: causal attention (QK^T and PV, 2 FLOPs per
  multiply-add, half the square, x3 for forward + backward) over L layers of H heads of width d. Recomputation
  under activation checkpointing is not counted (it is overhead, not useful work).

On a machine without a CUDA GPU it says so and exits with status 1 without measuring anything. `--smoke` runs the
whole code path on CPU with the bundled demo model for a few steps (the figures mean nothing there: peak memory is
the process's peak RSS, MFU is against a nominal 1 TFLOP/s); CI runs it so that the first GPU run finds no bug.
"""

import argparse
import json
import os
import resource
import sys
import tempfile
import time

REFUSAL = "benchmarks/gpu_mfu.py measures GPU training throughput, and this machine has no CUDA GPU: nothing measured."
PEAK_TFLOPS = {"H100": 989.4, "H200": 989.4, "H800": 989.4, "A100": 312.0, "A800": 312.0, "L40S": 362.0}


DEVICE = "cuda"  # "cpu" under --smoke


def gpu_or_refuse(smoke=False):
    import torch

    global DEVICE
    if smoke:
        DEVICE = "cpu"
    elif not torch.cuda.is_available():
        print(REFUSAL)
        sys.exit(1)
    return torch


def synchronize():
    import torch

    if DEVICE == "cuda":
        torch.cuda.synchronize()


def reset_peak_memory():
    import gc

    import torch

    gc.collect()  # the previous run's model and optimizer may sit in reference cycles
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def peak_memory():
    """Peak bytes allocated on the GPU since the last reset; on CPU the process's peak RSS (never reset)."""
    import torch

    if DEVICE == "cuda":
        return torch.cuda.max_memory_allocated()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def model_config(name, moe_layers):
    with open(os.path.join("configs", "model", name, "config.json")) as f:
        config = json.load(f)
    if config.get("num_experts"):
        config["num_hidden_layers"] = moe_layers
    config["use_cache"] = False
    return config


def active_params(c):
    heads, kv, d, h = c["num_attention_heads"], c["num_key_value_heads"], c.get("head_dim"), c["hidden_size"]
    d = d or h // heads
    attn = h * heads * d * 2 + h * kv * d * 2
    if c.get("num_experts"):
        mlp = c["num_experts_per_tok"] * 3 * h * c["moe_intermediate_size"] + h * c["num_experts"]
    else:
        mlp = 3 * h * c["intermediate_size"]
    return c["num_hidden_layers"] * (attn + mlp) + h * c["vocab_size"]


def step_flops(c, lengths):
    d = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    attention = 6 * c["num_hidden_layers"] * c["num_attention_heads"] * d * sum(n * n for n in lengths)
    return 6 * active_params(c) * sum(lengths) + attention


def documents(budget, seed):
    import random

    rng, lengths = random.Random(seed), []
    while sum(lengths) < budget:
        lengths.append(min(rng.randint(256, 4096), budget - sum(lengths)))
    return lengths


def micro_batch(lengths, vocab, seed):
    import torch

    from veomni.data import MainCollator

    g = torch.Generator().manual_seed(seed)
    docs = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]
    return MainCollator(sp_size=1)([{"input_ids": d, "labels": list(d)} for d in docs])


def build_trainer(config_dir, steps, batch, checkpointing, compile_layers=False, extra_argv=()):
    """Our BaseTrainer on a fixed synthetic micro-batch: the real step, none of the data pipeline."""
    from veomni.arguments import VeOmniArguments, parse_args
    from veomni.trainer.base import BaseTrainer

    class Loader:
        def set_epoch(self, epoch):
            pass

        def __iter__(self):
            return iter([[batch]] * steps)

        def state_dict(self):
            return {}

    class SyntheticTrainer(BaseTrainer):
        def build_dataset(self):
            return None

        def build_dataloader(self):
            return Loader()

        def compute_train_steps(self):
            self.args.train.train_steps = self.total_steps = steps
            self.epoch_steps = [steps]

        def build_callbacks(self):
            return []

        def save_checkpoint(self):
            pass

    argv = [
        "--model.config_path", config_dir, "--train.init_device", DEVICE, "--train.max_steps", str(steps),
        "--train.gradient_checkpointing.enable", str(checkpointing).lower(), "--train.micro_batch_size", "1",
        "--train.global_batch_size", "1", "--model.ops_implementation.moe_implementation", "fused",
        "--train.checkpoint.output_dir", tempfile.mkdtemp(prefix="out-", dir=config_dir), "--train.optimizer.lr", "1e-5",
        "--data.train_path", config_dir,  # must exist; never read (the synthetic loader replaces the data)
        "--model.ops_implementation.compile", str(compile_layers).lower(), *extra_argv,
    ]  # fmt: skip
    return SyntheticTrainer(parse_args(VeOmniArguments, argv))


PROFILE = {"steps": 0}  # --profile: the last `steps` steps of each loop run under torch.profiler


class profiled:
    """Profiles the steps after `warmup` (a step ends at each `step()`); prints where the GPU time went."""

    def __init__(self, label, warmup):
        import torch

        self.label, self.active = label, PROFILE["steps"]
        self.prof = None
        if self.active:
            schedule = torch.profiler.schedule(wait=max(warmup - 1, 0), warmup=1, active=self.active, repeat=1)
            activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            self.prof = torch.profiler.profile(activities=activities, schedule=schedule, on_trace_ready=self.report)

    def __enter__(self):
        if self.prof:
            self.prof.__enter__()
        self.tic = time.perf_counter()
        return self

    def step(self):
        if self.prof:
            self.prof.step()

    def __exit__(self, *exc):
        if self.prof:
            self.prof.__exit__(*exc)

    def report(self, prof):
        events = prof.key_averages()
        kernels = sum(e.self_device_time_total for e in events) / 1e3 / self.active  # ms per step on the GPU
        print(f"--- profile: {self.label}, GPU busy {kernels:.1f} ms per step (kernel time, {self.active} steps)")
        print(events.table(sort_by="self_device_time_total", row_limit=15, max_name_column_width=60))
        print(f"--- profile: {self.label}, by host (CPU) time")
        print(events.table(sort_by="cpu_time_total", row_limit=30, max_name_column_width=60))


def time_trainer(trainer, steps, warmup, label=""):
    times = []
    with profiled(f"trainer {label}", warmup) as prof:

        def on_step_end(_callback, _trainer, metrics):
            times.append(metrics["step_time"])
            prof.step()

        hooks = {"on_step_end": on_step_end, "on_train_begin": lambda *a: None, "on_train_end": lambda *a: None}
        trainer.callbacks = [type("T", (), hooks)()]
        reset_peak_memory()
        trainer.fit()
    return sum(times[warmup:]) / max(len(times) - warmup, 1), peak_memory()


def time_bare(model, batch, steps, warmup, label=""):
    """forward + chunked loss + backward + clip + AdamW, nothing else. Same precision as the trainer's default: fp32
    parameters and AdamW state, bf16 compute on CUDA (autocast; the trainer casts through FSDP2's policy)."""
    import torch

    from veomni.ops import CausalLMLoss

    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    inputs = {k: (v.to(DEVICE, non_blocking=True) if torch.is_tensor(v) else v) for k, v in batch.items()}
    labels = inputs.pop("labels")
    inputs.pop("shift_labels", None)
    loss_module = CausalLMLoss(model, 1024)
    autocast = torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=DEVICE == "cuda")
    reset_peak_memory()
    times = []
    with profiled(f"bare {label}", warmup) as prof:
        for i in range(steps):
            synchronize()
            tic = time.perf_counter()
            with autocast:
                out = loss_module(labels, **inputs, use_cache=False)
            (out.loss_sum / out.tokens).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            synchronize()
            if i >= warmup:
                times.append(time.perf_counter() - tic)
            prof.step()
    return sum(times) / len(times), peak_memory()


def moe_block(torch, name, tokens, args, steps=10):
    """One MoE layer's experts alone, fwd + bwd in bf16 on `tokens` tokens with router-like top-k picks: eager
    (transformers' loop over experts), transformers' grouped_mm, and ours (veomni_fused). Median ms of `steps`."""
    import statistics

    from transformers import AutoConfig
    from transformers.integrations.moe import ExpertsInterface
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    from veomni.ops.moe import FUSED

    config = AutoConfig.for_model(**model_config(name, 1))

    g = torch.Generator(device=DEVICE).manual_seed(0)
    with torch.device(DEVICE):
        layer_experts = Qwen3MoeExperts(config).to(torch.bfloat16)
        for p in layer_experts.parameters():
            p.data.normal_(0, 0.02, generator=g)
        x = torch.randn(tokens, config.hidden_size, generator=g, dtype=torch.bfloat16, requires_grad=True)
        scores = torch.rand(tokens, config.num_experts, generator=g)
        weights, index = scores.topk(config.num_experts_per_tok, dim=-1)
        weights = (weights / weights.sum(-1, keepdim=True)).to(torch.bfloat16)
    times = {}
    for impl in ("eager", "grouped_mm", FUSED):
        if impl not in ("eager", *ExpertsInterface._global_mapping.keys()):
            continue
        layer_experts.config._experts_implementation = impl
        runs = []
        for i in range(steps + 2):
            synchronize()
            tic = time.perf_counter()
            layer_experts(x, index, weights).float().square().mean().backward()
            synchronize()
            if i >= 2:
                runs.append(time.perf_counter() - tic)
        times[impl] = statistics.median(runs)
    row = "  ".join(f"{impl} {t * 1e3:7.2f} ms" for impl, t in times.items())
    print(f"{name:14s} MoE experts, one layer, {tokens} tokens fwd+bwd bf16: {row}", flush=True)
    record(args, {"kind": "moe_block", "model": name, "tokens": tokens, **{k: v * 1e3 for k, v in times.items()}})


def record(args, row):
    """Append one result row to --json (one JSON object per line)."""
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps(row) + "\n")


def run_one(torch, name, budget, args, peak):

    from veomni.distributed import destroy_parallel_state

    config = model_config(name, args.moe_layers)
    folder = tempfile.mkdtemp(prefix=f"gpu_mfu_{name}_")
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    lengths = documents(budget, seed=budget)
    batch = micro_batch(lengths, config["vocab_size"], seed=0)
    flops = step_flops(config, lengths)
    modes = {"auto": (False, True), "off": (False,), "on": (True,), "both": (False, True)}[args.checkpointing]
    ckpt_name = {False: "ckpt=off", True: "ckpt=on "}
    for checkpointing in modes:
        trainer_run = out_of_memory_as_none(torch, time_trainer_model, folder, checkpointing, batch, args)
        destroy_parallel_state()
        reset_peak_memory()
        bare_run = None
        if trainer_run is not None and not args.trainer_only:
            bare_run = out_of_memory_as_none(torch, time_bare_model, folder, checkpointing, batch, args)
            reset_peak_memory()
        row = {"kind": "step", "model": name, "tokens": budget, "ckpt": checkpointing, "flops": flops}
        row["compile"] = args.compile
        if trainer_run is None:
            print(f"{name:14s} {budget:6d} tok  {ckpt_name[checkpointing]}  out of memory", flush=True)
            record(args, {**row, "oom": True})
            continue
        t_step, t_mem = trainer_run
        line = (
            f"{name:14s} {budget:6d} tok  {ckpt_name[checkpointing]}{' compiled' if args.compile else ''}  trainer {budget / t_step:8.0f} tok/s "
            f"MFU {flops / t_step / peak:5.1%} peak {t_mem / 2**30:5.1f} GiB"
        )
        row.update(trainer_s=t_step, trainer_peak=t_mem)
        if bare_run is not None:
            b_step, b_mem = bare_run
            line += (
                f" | bare {budget / b_step:8.0f} tok/s MFU {flops / b_step / peak:5.1%} peak {b_mem / 2**30:5.1f} GiB"
                f" | trainer/bare {b_step / t_step:.3f}"
            )
            row.update(bare_s=b_step, bare_peak=b_mem)
        elif not args.trainer_only:
            line += " | bare: out of memory"
        print(line, flush=True)
        record(args, row)
        if args.checkpointing == "auto":
            return  # auto: checkpointing only where the budget does not fit without it


def out_of_memory_as_none(torch, measure, *args):
    """measure(*args), or None if it ran out of GPU memory (its frames, and so its tensors, are gone on return)."""
    try:
        return measure(*args)
    except torch.OutOfMemoryError:
        return None


def time_trainer_model(folder, checkpointing, batch, args):
    trainer = build_trainer(folder, args.steps, batch, checkpointing, args.compile)
    return time_trainer(trainer, args.steps, args.warmup, os.path.basename(folder))


def time_bare_model(folder, checkpointing, batch, args):
    from veomni.distributed.activation_checkpointing import apply_ac
    from veomni.distributed.compile import compile_basic_modules
    from veomni.distributed.fsdp import basic_module_instances, no_split_module_names
    from veomni.models import build_foundation_model

    model = build_foundation_model(folder, init_device=DEVICE, torch_dtype="float32", moe_implementation="fused")
    if checkpointing:
        apply_ac(model, reentrant=False)  # as the trainer does
    if args.compile:
        compile_basic_modules(basic_module_instances(model, no_split_module_names(model)))
    model.train()
    return time_bare(model, batch, args.steps, args.warmup, os.path.basename(folder))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="qwen3_0_6b,qwen3_1_7b,qwen3_4b,qwen3_30b_a3b")
    parser.add_argument("--tokens", default="8192,32768")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--moe-layers", type=int, default=4)
    parser.add_argument("--peak-tflops", type=float, default=None)
    parser.add_argument(
        "--checkpointing", choices=("auto", "off", "on", "both"), default="auto",
        help="activation checkpointing: auto = off, then on for a budget that runs out of memory; both = measure "
        "each (with --tokens 8192,16384,32768,65536,...: the longest context that trains, with and without)",
    )  # fmt: skip
    parser.add_argument("--trainer-only", action="store_true", help="skip the bare loop (context-length search)")
    parser.add_argument("--compile", action="store_true", help="torch.compile the decoder layers (both loops)")
    parser.add_argument("--profile", type=int, default=0, help="profile this many steps of each loop (after warmup)")
    parser.add_argument("--json", default=None, help="also append each result as a JSON line to this file")
    parser.add_argument(
        "--moe-block", type=int, default=0,
        help="first time one MoE layer's experts (eager / transformers grouped_mm / ours) on this many tokens",
    )  # fmt: skip
    parser.add_argument("--smoke", action="store_true", help="run the code path on CPU (demo model; no real figure)")
    args = parser.parse_args()
    torch = gpu_or_refuse(args.smoke)
    PROFILE["steps"] = args.profile
    sys.path.insert(0, ".")
    if args.smoke:
        args.models, args.tokens, args.steps, args.warmup = "demo_qwen2,demo_qwen3_moe", "1024", 2, 1
        args.moe_block = args.moe_block or 256
        args.checkpointing = "both"
        args.peak_tflops = args.peak_tflops or 1.0
    device = torch.cuda.get_device_name() if DEVICE == "cuda" else "CPU (smoke run)"
    peak = args.peak_tflops or next((v for k, v in PEAK_TFLOPS.items() if k in device), None)
    if peak is None:
        sys.exit(f"unknown peak bf16 TFLOP/s for {device!r}: pass --peak-tflops")
    print(f"{device}, torch {torch.__version__}, peak {peak} TFLOP/s bf16 dense")
    for name in args.models.split(","):
        if args.moe_block and model_config(name, 1).get("num_experts"):
            moe_block(torch, name, args.moe_block, args)
        for budget in (int(t) for t in args.tokens.split(",")):
            run_one(torch, name, budget, args, peak * 1e12)


if __name__ == "__main__":
    main()
