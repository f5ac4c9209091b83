"""Our trainer vs the Hugging Face Trainer: same model config, tokenizer, documents and tokens.

    pip install accelerate   # the HF Trainer needs it (extra `bench` in pyproject.toml)
    python benchmarks/train_vs_hf.py [--docs 200] [--repeats 2] [--bf16] [--nproc 2] [config overrides]

`--nproc 1` (default): everything in one process on one thread. `--nproc N`: the cores as each framework uses them
by default, ours on N ranks of one thread (torchrun, as train.sh runs it), HF in one process on N threads; the
global batch (tokens per optimizer step) is the same. `--bf16`: bf16 compute with fp32 master weights in all three
(ours: FSDP2 mixed precision; HF: `bf16=True`, autocast).

Documents: the first `--docs` records of the demo's Shakespeare text (variable length, 1 to max_seq_len tokens
after our transform splits long ones), tokenised once by our transform; every framework trains one epoch over
exactly these samples from the same initial weights:
  * ours:    TextTrainer with the demo config (packed micro-batches of micro_batch_size * max_seq_len tokens,
             veomni_varlen attention, fused linear + cross-entropy loss, fused AdamW);
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
import subprocess
import sys
import tempfile
import time
from functools import partial


def _cores_asked() -> str:
    """--nproc, read before torch is imported: OpenMP sizes its thread pool from OMP_NUM_THREADS at import."""
    for i, arg in enumerate(sys.argv):
        if arg == "--nproc" and i + 1 < len(sys.argv):
            return sys.argv[i + 1]
        if arg.startswith("--nproc="):
            return arg.split("=", 1)[1]
    return "1"


os.environ.setdefault("OMP_NUM_THREADS", _cores_asked())  # HF's threads (ours' ranks get 1 each)

import torch  # noqa: E402

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


def build_ours(config, docs_path, out, rest, world_size=1):
    args = parse_args(
        VeOmniArguments,
        [
            config,
            "--data.train_path", docs_path,
            "--train.checkpoint.output_dir", out,
            # 4 * max_seq_len tokens per step, one packed micro-batch per rank
            "--train.global_batch_size", "4",
            "--train.micro_batch_size", str(4 // world_size),
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


def padding_share(samples, batch_size, shuffles=100):
    """The share of the tokens a padded batch holds that are padding, for random batches of `batch_size`: the
    upper bound of ours / hf_pad were both to run their FLOPs equally fast (packing computes no padding)."""
    import random

    lengths, rng, pad, total = [len(s["input_ids"]) for s in samples], random.Random(0), 0, 0
    for _ in range(shuffles):
        order = rng.sample(lengths, len(lengths))
        for i in range(0, len(order), batch_size):
            batch = order[i : i + batch_size]
            pad += len(batch) * max(batch) - sum(batch)
            total += len(batch) * max(batch)
    return pad / total


def check_first_batch(trainer, state, samples, batch_size, tokenizer):
    """The same first batch through ours (packed), HF padded and HF flattened: the mean losses agree."""
    first = [{"input_ids": s["input_ids"], "labels": list(s["labels"])} for s in samples[:batch_size]]
    with torch.no_grad():
        packed = MainCollator()(first)
        tokens = int((packed["labels"] != -100).sum())  # shifted by the collator
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


def ours_on_ranks(nproc, config, docs_path, out, rest):
    """Our trainer as `train.sh` runs it on a CPU box: `nproc` ranks of one thread each (torchrun). Returns useful
    tokens, wall seconds (the slowest rank's fit) and CPU seconds (summed over ranks), as run_ours."""
    results = os.path.join(out, "ranks")
    os.makedirs(results, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", __file__,
        "--worker", results, "--config", config, "--docs-path", docs_path, *rest,
    ]  # fmt: skip
    subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL)
    ranks = [json.load(open(os.path.join(results, f"{r}.json"))) for r in range(nproc)]
    return ranks[0]["useful"], max(r["wall"] for r in ranks), sum(r["cpu"] for r in ranks)


def worker(results, config, docs_path, rest):
    """One rank of ours_on_ranks."""
    trainer = build_ours(config, docs_path, os.path.join(results, "out"), rest, int(os.environ["WORLD_SIZE"]))
    torch.distributed.barrier()
    useful, wall, cpu = run_ours(trainer)
    with open(os.path.join(results, f"{os.environ['RANK']}.json"), "w") as f:
        json.dump({"useful": useful, "wall": wall, "cpu": cpu}, f)
    destroy_parallel_state()


def run_hf(config_path, state, samples, batch_size, collator, lr, seed, out, bf16=False):
    model = hf_model(config_path, state)
    args = TrainingArguments(
        output_dir=out, per_device_train_batch_size=batch_size, num_train_epochs=1, learning_rate=lr,
        lr_scheduler_type="constant", save_strategy="no", report_to=[], logging_steps=10_000, seed=seed,
        use_cpu=not torch.cuda.is_available(), dataloader_num_workers=0, disable_tqdm=True, max_grad_norm=1.0,
        bf16=bf16,  # torch.autocast to bf16 around forward: fp32 master weights, as ours with param_dtype bfloat16
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
    parser.add_argument(
        "--nproc", type=int, default=1,
        help="cores to use: ours runs on this many ranks of 1 thread (as train.sh does), HF on this many threads",
    )  # fmt: skip
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # internal: one rank of ours, results to this folder
    parser.add_argument("--docs-path", help=argparse.SUPPRESS)
    parser.add_argument(
        "--bf16", action="store_true", help="bf16 compute with fp32 master weights in all three (HF: bf16=True)"
    )
    known, rest = parser.parse_known_args()
    if known.bf16:
        rest = [*rest, "--train.accelerator.fsdp_config.mixed_precision.param_dtype", "bfloat16"]
    if known.worker:
        return worker(known.worker, known.config, known.docs_path, rest)
    torch.set_num_threads(known.nproc)
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
            print(f"  hf_pad computes on padding: {padding_share(samples, batch_size):.0%} of its tokens "
                  f"(random batches of {batch_size}, mean over 100 shuffles)")  # fmt: skip
        lr, seed, config_path = trainer.args.train.optimizer.lr, trainer.args.train.seed, trainer.args.model.config_path
        hf = partial(run_hf, config_path, state, samples, batch_size, lr=lr, seed=seed, out=work, bf16=known.bf16)
        pad = DataCollatorForSeq2Seq(trainer.tokenizer, label_pad_token_id=-100)
        ours = partial(ours_on_ranks, known.nproc, known.config, docs_path, os.path.join(work, "ours"), rest)
        runs = {
            "ours": partial(run_ours, trainer) if known.nproc == 1 else ours,
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
