"""Framework overhead: the TextTrainer vs a bare torch loop, same model, same batches, same process.

    OMP_NUM_THREADS=2 OMP_WAIT_POLICY=PASSIVE python benchmarks/trainer_overhead.py [--steps 30] [config overrides]

Both loops see exactly the micro-batches the trainer's dataloader produces for the bundled demo config; the bare
loop is plain HF model + torch AdamW + clip_grad_norm_ (no FSDP, no DP bookkeeping). Prints steps/s, tokens/s
and the ratio (trainer / bare). The first `--warmup` steps of each are not timed.
"""

import argparse
import statistics
import sys
import time

import torch

sys.path.insert(0, ".")
from veomni.arguments import VeOmniArguments, parse_args  # noqa: E402
from veomni.distributed import destroy_parallel_state  # noqa: E402
from veomni.models import build_foundation_model  # noqa: E402
from veomni.ops import CausalLMLoss, count_loss_tokens  # noqa: E402
from veomni.trainer import TextTrainer  # noqa: E402
from veomni.utils.demo_assets import ensure_demo_assets  # noqa: E402


def bare_loop(args, batches, warmup):
    torch.manual_seed(args.train.seed)
    ops = args.model.ops_implementation  # the trainer's own kernels and loss, so only the loop differs
    model = build_foundation_model(
        args.model.config_path,
        torch_dtype="float32",
        attn_implementation=ops.attn_implementation,
        moe_implementation=ops.moe_implementation,
    )
    opt = torch.optim.AdamW(model.parameters(), lr=args.train.optimizer.lr, foreach=True)
    loss_module = CausalLMLoss(model, ops.loss_chunk_size)
    times, tokens = [], []
    for i, micro_batches in enumerate(batches):
        tic = time.perf_counter()
        n = sum(count_loss_tokens(mb["labels"]) for mb in micro_batches)
        for mb in micro_batches:
            inputs = {k: v for k, v in mb.items() if k not in ("labels", "shift_labels")}
            loss = loss_module(mb["labels"], **inputs, use_cache=False).loss_sum
            (loss / n).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        if i >= warmup:
            times.append(time.perf_counter() - tic)
            tokens.append(sum(mb["input_ids"].numel() for mb in micro_batches))
    return times, tokens


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--config", default="configs/text/demo.yaml")
    known, rest = parser.parse_known_args()
    ensure_demo_assets(".assets")
    args = parse_args(
        VeOmniArguments,
        [
            known.config,
            "--train.max_steps",
            str(known.steps),
            "--train.checkpoint.output_dir",
            "outputs/bench_overhead",
            *rest,
        ],
    )
    trainer = TextTrainer(args)
    trainer.train_dataloader.set_epoch(0)
    it = iter(trainer.train_dataloader)
    batches = [next(it) for _ in range(known.steps)]

    trainer.callbacks = [c for c in trainer.callbacks if type(c).__name__ == "MetricsFileCallback"]
    records = []
    trainer.callbacks.append(
        type(
            "Grab",
            (),
            {
                "on_train_begin": lambda *a: None,
                "on_train_end": lambda *a: None,
                "on_step_end": lambda self, t, m: records.append(m),
            },
        )()
    )
    trainer.fit()
    t_times = [m["step_time"] for m in records[known.warmup :]]
    t_tokens = [m["tokens"] for m in records[known.warmup :]]
    b_times, b_tokens = bare_loop(args, batches, known.warmup)
    destroy_parallel_state()

    def report(name, times, tokens):
        sps, tps = len(times) / sum(times), sum(tokens) / sum(times)
        print(
            f"{name:8s} steps/s {sps:7.3f}   tokens/s {tps:9.0f}   median step {statistics.median(times) * 1e3:7.1f} ms"
        )
        return tps

    print(f"threads={torch.get_num_threads()} steps timed={len(t_times)} model={trainer.num_params / 1e6:.2f}M params")
    tt = report("trainer", t_times, t_tokens)
    bt = report("bare", b_times, b_tokens)
    print(f"trainer / bare tokens/s ratio: {tt / bt:.3f}")


if __name__ == "__main__":
    main()
