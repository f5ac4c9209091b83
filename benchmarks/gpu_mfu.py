"""Training throughput and MFU on one GPU: Qwen3-0.6B / 1.7B / 4B and a small Qwen3-MoE, from config only.

    python benchmarks/gpu_mfu.py [--models qwen3_0_6b,qwen3_1_7b] [--tokens 8192,32768] [--steps 8]

Architectures come from configs/model/*/config.json (the public configs; random init, no weights). The MoE is
Qwen3-30B-A3B's layer shape (128 experts, top-8) cut to `--moe-layers` layers so that it fits one GPU. Each
micro-batch packs real-length documents (256-4096 tokens, seeded) up to the token budget, bf16 parameters, AdamW.

For each model and budget, in the same process:
  * trainer: our BaseTrainer step (FSDP2 over 1 rank, veomni_varlen attention, chunked loss, fused MoE experts,
    loss-token all-reduce, grad clipping, scheduler, metrics);
  * bare:    the same model and kernels in a plain loop (forward, chunked loss, backward, clip, AdamW step).
Prints tokens/s, MFU, peak memory and trainer/bare. If a budget runs out of memory it is retried with
activation checkpointing (and says so).

MFU = achieved FLOP/s / the GPU's dense bf16 peak (H100/H200 SXM 989 TFLOP/s; --peak-tflops to override), with
training FLOPs per micro-batch = 6 * N_active * T  +  6 * L * H * d * sum_docs(len^2)
  N_active: parameters in matmuls per token (attention + MLP, for MoE the top-k experts and the router, plus
  the output head; embeddings excluded); T: tokens; second term: causal attention (QK^T and PV, 2 FLOPs per
  multiply-add, half the square, x3 for forward + backward) over L layers of H heads of width d. Recomputation
  under activation checkpointing is not counted (it is overhead, not useful work).

On a machine without a CUDA GPU it says so and exits with status 1 without measuring anything.
"""

import argparse
import json
import os
import sys
import time

REFUSAL = "benchmarks/gpu_mfu.py measures GPU training throughput, and this machine has no CUDA GPU: nothing measured."
PEAK_TFLOPS = {"H100": 989.4, "H200": 989.4, "H800": 989.4, "A100": 312.0, "A800": 312.0, "L40S": 362.0}


def gpu_or_refuse():
    import torch

    if not torch.cuda.is_available():
        print(REFUSAL)
        sys.exit(1)
    return torch


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


def build_trainer(config_dir, steps, batch, checkpointing):
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

        def build_callbacks(self):
            return []

        def save_checkpoint(self):
            pass

    argv = [
        "--model.config_path", config_dir, "--train.init_device", "cuda", "--train.max_steps", str(steps),
        "--train.gradient_checkpointing.enable", str(checkpointing).lower(), "--train.micro_batch_size", "1",
        "--train.global_batch_size", "1", "--model.ops_implementation.moe_implementation", "fused",
        "--train.checkpoint.output_dir", "/tmp/gpu_mfu", "--train.optimizer.lr", "1e-5",
    ]  # fmt: skip
    return SyntheticTrainer(parse_args(VeOmniArguments, argv))


def time_trainer(trainer, steps, warmup):
    import torch

    times = []
    trainer.callbacks = [
        type("T", (), {"on_step_end": lambda s, t, m: times.append(m["step_time"]), "on_train_begin": lambda *a: None,
                       "on_train_end": lambda *a: None})()
    ]  # fmt: skip
    torch.cuda.reset_peak_memory_stats()
    trainer.fit()
    return sum(times[warmup:]) / max(len(times) - warmup, 1), torch.cuda.max_memory_allocated()


def time_bare(model, batch, steps, warmup):
    """forward + chunked loss + backward + clip + AdamW, nothing else."""
    import torch

    from veomni.ops import chunked_lm_head_loss

    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    inputs = {k: (v.cuda(non_blocking=True) if torch.is_tensor(v) else v) for k, v in batch.items() if k != "labels"}
    labels = batch["labels"].cuda()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for i in range(steps):
        torch.cuda.synchronize()
        tic = time.perf_counter()
        with chunked_lm_head_loss(model, labels, 1024) as head:
            out = model(**inputs, use_cache=False)
        (out.logits / head["tokens"]).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - tic)
    return sum(times) / len(times), torch.cuda.max_memory_allocated()


def run_one(torch, name, budget, args, peak):
    import tempfile

    from veomni.distributed import destroy_parallel_state
    from veomni.models import build_foundation_model

    config = model_config(name, args.moe_layers)
    folder = tempfile.mkdtemp(prefix=f"gpu_mfu_{name}_")
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    lengths = documents(budget, seed=budget)
    batch = micro_batch(lengths, config["vocab_size"], seed=0)
    flops = step_flops(config, lengths)
    for checkpointing in (False, True):
        try:
            trainer = build_trainer(folder, args.steps, batch, checkpointing)
            t_step, t_mem = time_trainer(trainer, args.steps, args.warmup)
            del trainer
            destroy_parallel_state()
            torch.cuda.empty_cache()
            model = build_foundation_model(
                folder, init_device="cuda", torch_dtype="bfloat16", moe_implementation="fused"
            )
            if checkpointing:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            model.train()
            b_step, b_mem = time_bare(model, batch, args.steps, args.warmup)
            del model
            torch.cuda.empty_cache()
        except torch.OutOfMemoryError:
            destroy_parallel_state()
            torch.cuda.empty_cache()
            if checkpointing:
                print(f"{name:14s} {budget:6d} tok  out of memory even with activation checkpointing")
                return
            continue
        print(
            f"{name:14s} {budget:6d} tok  ckpt={'on ' if checkpointing else 'off'}  trainer {budget / t_step:8.0f} tok/s "
            f"MFU {flops / t_step / peak:5.1%} peak {t_mem / 2**30:5.1f} GiB | bare {budget / b_step:8.0f} tok/s "
            f"MFU {flops / b_step / peak:5.1%} peak {b_mem / 2**30:5.1f} GiB | trainer/bare {b_step / t_step:.3f}",
            flush=True,
        )
        return


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="qwen3_0_6b,qwen3_1_7b,qwen3_4b,qwen3_30b_a3b")
    parser.add_argument("--tokens", default="8192,32768")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--moe-layers", type=int, default=4)
    parser.add_argument("--peak-tflops", type=float, default=None)
    args = parser.parse_args()
    torch = gpu_or_refuse()
    sys.path.insert(0, ".")
    device = torch.cuda.get_device_name()
    peak = args.peak_tflops or next((v for k, v in PEAK_TFLOPS.items() if k in device), None)
    if peak is None:
        sys.exit(f"unknown peak bf16 TFLOP/s for {device!r}: pass --peak-tflops")
    print(f"{device}, torch {torch.__version__}, peak {peak} TFLOP/s bf16 dense")
    for name in args.models.split(","):
        for budget in (int(t) for t in args.tokens.split(",")):
            run_one(torch, name, budget, args, peak * 1e12)


if __name__ == "__main__":
    main()
