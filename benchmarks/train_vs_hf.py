"""Our trainer vs the Hugging Face Trainer: same model config, tokenizer, documents and tokens, one process.

    pip install accelerate   # the HF Trainer needs it (extra `bench` in pyproject.toml)
    OMP_NUM_THREADS=1 python benchmarks/train_vs_hf.py [--docs 200] [--repeats 2] [config overrides]

Documents: the first `--docs` records of the demo's Shakespeare text (variable length, 1 to max_seq_len tokens
after our transform splits long ones), tokenised once by our transform; every framework trains one epoch over
exactly these samples from the same initial weights:
  * ours:    TextTrainer with the demo config (packed micro-batches of micro_batch_size * max_seq_len tokens,
             veomni_varlen attention, chunked loss);
  * hf_pad:  transformers.Trainer, its padded default (DataCollatorForSeq2Seq, sdpa), batches of B samples
             where B * mean sample length ~ our token budget per micro-batch;
  * hf_flat: transformers.Trainer with DataCollatorWithFlattening (padding-free, position_ids), same B.
Prints useful tokens (tokens that carry a loss, pads excluded) per wall second and per CPU second of the process
(steadier than wall time on a shared machine), and the ratios to ours, per repeat. Before
timing it checks that the three agree on the loss of one identical first batch (same weights, same samples).
Timings exclude model building; they include data loading. On a shared machine repeat and read the spread.
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from functools import partial

import torch

sys.path.insert(0, ".")
from transformers import (  # noqa: E402
    AutoConfig,
    AutoModelForCausalLM,
    DataCollatorForSeq2Seq,
    DataCollatorWithFlattening,
    Trainer,
    TrainingArguments,
)

from veomni.arguments import VeOmniArguments, parse_args  # noqa: E402
from veomni.data import MainCollator  # noqa: E402
from veomni.distributed import destroy_parallel_state  # noqa: E402
from veomni.trainer import TextTrainer  # noqa: E402
from veomni.utils.demo_assets import ensure_demo_assets  # noqa: E402


def build_ours(config, docs_path, out, rest):
    args = parse_args(
        VeOmniArguments,
        [
            config,
            "--data.train_path", docs_path,
            "--train.checkpoint.output_dir", out,
            "--train.global_batch_size", "4",  # one packed micro-batch (4 * max_seq_len tokens) per step
            "--train.micro_batch_size", "4",
            "--train.max_steps", "100000",
            "--train.checkpoint.save_steps", "0",
            *rest,
        ],
    )  # fmt: skip
    return TextTrainer(args)


def samples_of(trainer):
    """The samples our transform made of the documents, in dataset order (long documents split in pieces)."""
    return [s for i in range(len(trainer.train_dataset)) for s in trainer.train_dataset[i]]


def full_state_dict(model):
    return {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for k, v in model.state_dict().items()
    }


def hf_model(config_path, state):
    config = AutoConfig.from_pretrained(config_path)
    config.use_cache = False
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    model.load_state_dict(state)
    return model


def check_first_batch(trainer, state, samples, batch_size, tokenizer):
    """The same first batch through ours (packed), HF padded and HF flattened: the mean losses agree."""
    first = [{"input_ids": s["input_ids"], "labels": list(s["labels"])} for s in samples[:batch_size]]
    with torch.no_grad():
        packed = MainCollator()(first)
        tokens = int((packed["labels"][..., 1:] != -100).sum())
        ours = trainer.forward_loss_sum(packed).item() / tokens
        model = hf_model(trainer.args.model.config_path, state)
        pad = model(**DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=-100, return_tensors="pt")(first)).loss
        flat = model(**DataCollatorWithFlattening()(first)).loss
    print(
        f"first-batch loss ({batch_size} samples): ours {ours:.6f}  hf_pad {pad.item():.6f}  hf_flat {flat.item():.6f}"
    )
    worst = max(abs(ours - pad.item()), abs(ours - flat.item())) / abs(ours)
    print(f"  largest relative difference {worst:.1e} ({'agree' if worst < 1e-4 else 'DISAGREE'})")
    return worst


def run_ours(trainer):
    records = []
    grab = type(
        "Grab",
        (),
        {"on_train_begin": lambda *a: None, "on_train_end": lambda *a: None, "on_step_end": lambda s, t, m: records.append(m)},
    )()  # fmt: skip
    trainer.callbacks = [grab]
    trainer.save_checkpoint = lambda: None  # the benchmark times training, not checkpoints
    wall, cpu = time.perf_counter(), time.process_time()
    trainer.fit()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return sum(m["loss_tokens"] for m in records), wall, cpu


def run_hf(config_path, state, samples, batch_size, collator, lr, seed, out):
    model = hf_model(config_path, state)
    args = TrainingArguments(
        output_dir=out, per_device_train_batch_size=batch_size, num_train_epochs=1, learning_rate=lr,
        lr_scheduler_type="constant", save_strategy="no", report_to=[], logging_steps=10_000, seed=seed,
        use_cpu=not torch.cuda.is_available(), dataloader_num_workers=0, disable_tqdm=True, max_grad_norm=1.0,
    )  # fmt: skip
    data = [{"input_ids": s["input_ids"], "labels": list(s["labels"])} for s in samples]
    trainer = Trainer(model=model, args=args, train_dataset=data, data_collator=collator)
    wall, cpu = time.perf_counter(), time.process_time()
    trainer.train()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return sum(len(s["input_ids"]) - 1 for s in samples), wall, cpu


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default="configs/text/demo.yaml")
    parser.add_argument("--docs", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=2)
    known, rest = parser.parse_known_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    root = ensure_demo_assets(".assets", quiet=True)
    work = tempfile.mkdtemp(prefix="train_vs_hf_")
    docs_path = os.path.join(work, "docs.jsonl")
    with open(f"{root}/shakespeare/train.jsonl") as src, open(docs_path, "w") as dst:
        for _, line in zip(range(known.docs), src):
            dst.write(line)

    results = {"ours": [], "hf_pad": [], "hf_flat": []}
    for repeat in range(known.repeats):
        trainer = build_ours(known.config, docs_path, os.path.join(work, "ours"), rest)
        samples = samples_of(trainer)
        budget = trainer.args.train.micro_batch_size * trainer.args.data.max_seq_len
        mean_len = statistics.mean(len(s["input_ids"]) for s in samples)
        batch_size = max(1, round(budget / mean_len))
        state = full_state_dict(trainer.model)
        if repeat == 0:
            print(f"{len(samples)} samples, {sum(len(s['input_ids']) for s in samples)} tokens, mean length "
                  f"{mean_len:.0f}; ours packs {budget} tokens per micro-batch, HF takes {batch_size} samples")  # fmt: skip
            check_first_batch(trainer, state, samples, batch_size, trainer.tokenizer)
        lr, seed, config_path = trainer.args.train.optimizer.lr, trainer.args.train.seed, trainer.args.model.config_path
        hf = partial(run_hf, config_path, state, samples, batch_size, lr=lr, seed=seed, out=work)
        pad = DataCollatorForSeq2Seq(trainer.tokenizer, label_pad_token_id=-100)
        runs = {
            "ours": partial(run_ours, trainer),
            "hf_pad": partial(hf, collator=pad),
            "hf_flat": partial(hf, collator=DataCollatorWithFlattening()),
        }
        line = []
        order = list(runs) if repeat % 2 == 0 else list(runs)[::-1]  # alternate the order: load drifts
        for name in order:
            run = runs[name]
            useful, wall, cpu = run()
            results[name].append((useful / wall, useful / cpu))
            line.append(f"{name} {useful / wall:6.0f} tok/s, {useful / cpu:6.0f} tok/CPU-s ({useful} tokens)")
        destroy_parallel_state()
        print(f"repeat {repeat}: " + " | ".join(line), flush=True)
    for i, unit in enumerate(("useful tokens per wall second", "useful tokens per CPU second")):
        print(f"{unit} (min / median / max over {known.repeats} repeats):")
        for name, values in results.items():
            v = [x[i] for x in values]
            print(f"  {name:8s} {min(v):7.0f} / {statistics.median(v):7.0f} / {max(v):7.0f}")
        for name in ("hf_pad", "hf_flat"):
            ratios = [a[i] / b[i] for a, b in zip(results["ours"], results[name])]
            print(f"  ours / {name}: " + ", ".join(f"{r:.2f}" for r in ratios))
    print(json.dumps(results))


if __name__ == "__main__":
    main()
