"""What a run shows and leaves behind: a progress bar, metrics.jsonl, optional wandb/TensorBoard, loss.png (loss,
LR and resume points), the run's summary line; and what it decides on evaluations: the best checkpoint, early
stopping, sample answers to `train.eval_prompts`.

The sinks act on rank 0 only: the trainer builds them there (standard_callbacks), and only those asked for.
"""

import dataclasses
import json
import os
import sys
import time
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch.distributed as dist
from tqdm import tqdm

from ..utils.logging import get_logger
from .moe_metrics import moe_summary

logger = get_logger(__name__)


class Callback:
    def on_train_begin(self, trainer) -> None: ...

    def on_step_end(self, trainer, metrics: Dict[str, Any]) -> None: ...

    def on_train_end(self, trainer) -> None: ...


def seconds_since_process_start() -> Optional[float]:
    """Wall time since this process started (Linux /proc), so set-up time includes imports; None elsewhere."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return uptime - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def scalar_items(metrics: Dict[str, Any]) -> Iterator[Tuple[str, float]]:
    """(name, number) pairs for scalar sinks: a per-layer list (moe_*_layers) becomes one scalar per layer, name/i."""
    for key, value in metrics.items():
        if isinstance(value, (int, float)) and key != "step":
            yield key, value
        elif isinstance(value, list):
            yield from ((f"{key}/{i}", v) for i, v in enumerate(value) if isinstance(v, (int, float)))


def _clock(seconds: float) -> str:
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


class ProgressCallback(Callback):
    """Rank 0: a line when training starts (with the set-up time), a tqdm bar on a terminal (step/total, elapsed,
    ETA, loss, tokens/s), and every `log_steps` a plain line with the same facts, which is what a log file keeps."""

    def __init__(self, log_steps: int = 1):
        self.log_steps, self.bar = max(log_steps, 1), None
        self.start, self.first_step = 0.0, 0

    def on_train_begin(self, trainer):
        setup = seconds_since_process_start()
        first, total = trainer.global_step + 1, trainer.total_steps
        resumed = f" (resumed at step {trainer.global_step})" if trainer.global_step else ""
        logger.info(
            f"training starts{resumed}: steps {first}..{total}"
            + (f"; set-up took {setup:.1f} s (imports, data check, step count, model)" if setup else "")
        )
        self.start, self.first_step = time.perf_counter(), trainer.global_step
        quiet = not sys.stderr.isatty()  # in a log file (CI, nohup) a redrawn bar is noise: only the periodic lines
        self.bar = tqdm(
            total=total, initial=trainer.global_step, desc="train", unit="step", dynamic_ncols=True, disable=quiet
        )

    def on_step_end(self, trainer, metrics):
        self.bar.update(1)
        self.bar.set_postfix(loss=f"{metrics['loss']:.4f}", tok_s=f"{metrics['tokens_per_sec']:.0f}")
        step, total = metrics["step"], trainer.total_steps
        if step % self.log_steps == 0 or step == total or step == self.first_step + 1:
            elapsed = time.perf_counter() - self.start
            eta = elapsed / (step - self.first_step) * (total - step)  # (this run's steps so far: at least one)
            self.bar.write(
                f"step {step}/{total}: loss {metrics['loss']:.4f} grad_norm {metrics['grad_norm']:.3f} "
                f"lr {metrics['lr']:.3e}{moe_summary(metrics)} {metrics['tokens_per_sec']:.0f} tok/s | "
                f"{_clock(elapsed)} elapsed, ETA {_clock(eta)}"
            )
        if "eval_pairs" in metrics:  # a preference run's held-out pairs (veomni.trainer.dpo_trainer)
            self.bar.write(
                f"step {step}/{total}: eval loss {metrics['eval_loss']:.4f} reward accuracy "
                f"{metrics['eval_rewards/accuracies']:.3f} margin {metrics['eval_rewards/margins']:.4f} "
                f"({metrics['eval_pairs']:,} held-out pairs)"
            )
        elif "eval_loss" in metrics:  # said whenever it is measured, whatever log_steps
            self.bar.write(
                f"step {step}/{total}: eval loss {metrics['eval_loss']:.4f} ppl {metrics['eval_ppl']:.2f} "
                f"({metrics['eval_tokens']:,} held-out tokens)"
            )

    def on_train_end(self, trainer):  # (the run's closing line is SummaryCallback's)
        self.bar.close()


class MetricsFileCallback(Callback):
    """One JSON object per optimizer step, appended (a resumed run continues the same file); with `plot`, that
    path's loss.png drawn from them at the end of training: train and eval loss, the LR (right axis) and the steps
    where the run was resumed."""

    def __init__(self, path: str, plot: Optional[str] = None):
        self.path, self.plot, self.resumed_from = path, plot, None
        self.history: List[Dict[str, Any]] = []

    def on_train_begin(self, trainer):
        self.resumed_from = trainer.global_step or None  # marked on the first step after a resume (loss.png)
        if os.path.isfile(self.path):
            with open(self.path) as f:
                self.history = [json.loads(line) for line in f if line.strip()]
            # a resumed run rewrites the steps after its checkpoint
            self.history = [m for m in self.history if m["step"] <= trainer.global_step]
            with open(self.path, "w") as f:
                f.writelines(json.dumps(m) + "\n" for m in self.history)

    def on_step_end(self, trainer, metrics):
        if self.resumed_from:
            metrics["resumed_from"], self.resumed_from = self.resumed_from, None
        self.history.append(metrics)
        with open(self.path, "a") as f:
            f.write(json.dumps(metrics) + "\n")

    def on_train_end(self, trainer):
        if self.plot and self.history:
            draw_loss_plot(self.history, self.plot)
            logger.info(f"loss curve written to {self.plot}")


def draw_loss_plot(history: List[Dict[str, Any]], path: str) -> List[str]:
    """Draw `history` (metrics.jsonl records) into `path`; returns the legend's labels."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [m["step"] for m in history]
    preference = "rewards/accuracies" in history[0]  # a DPO run: its reward accuracy in a panel below
    fig, axes = plt.subplots(2 if preference else 1, 1, figsize=(8, 6 if preference else 4), squeeze=False)
    ax = axes[0][0]
    ax.plot(steps, [m["loss"] for m in history], label="train loss")
    evaluated = [m for m in history if "eval_loss" in m]
    eval_steps = [m["step"] for m in evaluated]
    if evaluated:
        ax.plot(eval_steps, [m["eval_loss"] for m in evaluated], "o-", label="eval loss")
    for m in history:
        if "resumed_from" in m:
            ax.axvline(m["resumed_from"], color="gray", linestyle=":", label=f"resumed at step {m['resumed_from']}")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    lr_ax = ax.twinx()
    lr_ax.plot(steps, [m.get("lr", float("nan")) for m in history], "--", color="tab:green", alpha=0.6, label="lr")
    lr_ax.set_ylabel("learning rate")
    handles, labels = ax.get_legend_handles_labels()
    lr_handles, lr_labels = lr_ax.get_legend_handles_labels()
    ax.legend(handles + lr_handles, labels + lr_labels, fontsize="small")
    if preference:
        below = axes[1][0]
        below.plot(steps, [m["rewards/accuracies"] for m in history], ":", label="reward accuracy")
        if evaluated:
            below.plot(
                eval_steps, [m["eval_rewards/accuracies"] for m in evaluated], "s-", label="eval reward accuracy"
            )
        below.set_xlabel("step")
        below.set_ylabel("reward accuracy")
        below.set_ylim(0, 1)
        below.grid(alpha=0.3)
        below.legend(fontsize="small")
        labels += below.get_legend_handles_labels()[1]
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return labels + lr_labels


class WandbCallback(Callback):
    def __init__(self, project: str, name: Optional[str], mode: str, config: Dict[str, Any], out: str):
        self.run, self.kwargs = None, dict(project=project, name=name, mode=mode, config=config, dir=out)

    def on_train_begin(self, trainer):
        try:
            import wandb
        except ImportError:
            raise ImportError("train.wandb.enable needs wandb: pip install wandb") from None
        self.run = wandb.init(**self.kwargs)

    def on_step_end(self, trainer, metrics):
        flat = {k: v for k, v in metrics.items() if not isinstance(v, list)}
        flat.update(scalar_items({k: v for k, v in metrics.items() if isinstance(v, list)}))  # one per layer
        if metrics.get("samples"):  # train.eval_prompts: a table of prompt / response
            import wandb

            rows = [[s["prompt"], s["response"]] for s in metrics["samples"]]
            flat["samples"] = wandb.Table(columns=["prompt", "response"], data=rows)
        self.run.log(flat, step=metrics["step"])

    def on_train_end(self, trainer):
        self.run.finish()


class TensorBoardCallback(Callback):
    def __init__(self, log_dir: str):
        self.log_dir, self.writer = log_dir, None

    def on_train_begin(self, trainer):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ImportError("train.use_tensorboard needs tensorboard: pip install tensorboard") from None
        self.writer = SummaryWriter(self.log_dir)

    def on_step_end(self, trainer, metrics):
        for key, value in scalar_items(metrics):
            name = f"eval/{key[5:]}" if key.startswith("eval_") else f"train/{key}"
            self.writer.add_scalar(name, value, metrics["step"])
        for i, sample in enumerate(metrics.get("samples") or []):  # train.eval_prompts
            self.writer.add_text(f"samples/{i}", f"**{sample['prompt']}**\n\n{sample['response']}", metrics["step"])

    def on_train_end(self, trainer):
        self.writer.close()


# ------------------------------------------------------------------------------------------ best eval
RECORD = "best_checkpoint.json"


class BestEvalCallback(Callback):
    """The lowest eval loss of a run: `train.checkpoint.keep_best` keeps its checkpoint through retention, and
    `train.early_stopping_patience` ends the run after that many evaluations in a row without a new lowest.

    Every rank decides alike (the eval loss is all-reduced). A new lowest at a step that is not saved anyway is saved
    then (keep_best), and its step is shielded from `save_total_limit`; `output_dir/best_checkpoint.json` names it (a
    resumed run reads it back). Early stopping shortens the run to the current step, so the loop ends there and the
    run finishes as at its last step: final checkpoint, HF export, summary."""

    def __init__(self, keep_best: bool, patience: int, save_steps: int, output_dir: str, is_main: bool):
        self.keep_best, self.patience, self.save_steps = keep_best, patience, save_steps
        self.record, self.is_main = os.path.join(output_dir, RECORD), is_main
        self.best_loss: Optional[float] = None
        self.best_step: Optional[int] = None
        self.stale = 0  # evaluations since the lowest

    def on_train_begin(self, trainer):
        if not (self.keep_best or self.patience) or not os.path.isfile(self.record):
            return
        with open(self.record) as f:
            saved = json.load(f)
        if saved["step"] <= trainer.global_step:  # the same on every rank: they read the same file
            self.best_loss, self.best_step, self.stale = saved["eval_loss"], saved["step"], saved.get("stale", 0)
            self._protect(trainer)
            if self.patience and self.stale >= self.patience:  # resumed after an early stop: nothing left to train
                trainer.total_steps = trainer.global_step

    def on_step_end(self, trainer, metrics):
        if "eval_loss" not in metrics or not (self.keep_best or self.patience):
            return
        step, loss = metrics["step"], metrics["eval_loss"]
        if self.best_loss is None or loss < self.best_loss:
            self.best_loss, self.best_step, self.stale = loss, step, 0
            if self.keep_best:
                self._protect(trainer)
                saved_anyway = (self.save_steps > 0 and step % self.save_steps == 0) or step >= trainer.total_steps
                if not saved_anyway:
                    trainer.save_checkpoint()
        else:
            self.stale += 1
        self._write(trainer)
        if self.patience and self.stale >= self.patience and step < trainer.total_steps:
            if trainer.is_main:
                logger.info(
                    f"early stopping at step {step}: eval loss {loss:.4f} has not improved on {self.best_loss:.4f} "
                    f"(step {self.best_step}) for {self.stale} evaluation(s) (train.early_stopping_patience="
                    f"{self.patience})"
                )
            trainer.total_steps = step  # the loop ends after this step and the run finishes as at its last

    def _protect(self, trainer) -> None:
        if self.keep_best:
            trainer.checkpointer.checkpointer.protected_steps = {self.best_step}

    def _write(self, trainer) -> None:
        if not self.is_main:
            return
        path = os.path.join(trainer.checkpointer.root, f"global_step_{self.best_step}") if self.keep_best else None
        record = {"step": self.best_step, "eval_loss": self.best_loss, "stale": self.stale, "checkpoint": path}
        tmp = self.record + ".tmp"
        with open(tmp, "w") as f:
            json.dump(record, f)
        os.replace(tmp, self.record)


# ----------------------------------------------------------------------------------- eval_prompts samples
class SampleGenerationCallback(Callback):
    """`train.eval_prompts`: the model's greedy answers to a few prompts at each eval, each checkpoint save and the last
    step, through the training chat template and transformers' `generate`, in metrics.jsonl (`samples`) and the log.

    Every rank generates (an FSDP-sharded model gathers its parameters in each forward, a collective), with
    `synced_gpus` so that all ranks run the same number of forwards whatever each one's answer length."""

    def __init__(self, prompts: List[str], max_new_tokens: int, save_steps: int):
        self.prompts, self.max_new_tokens, self.save_steps = list(prompts), max_new_tokens, save_steps

    def due(self, trainer, metrics: Dict[str, Any]) -> bool:
        step = metrics["step"]
        saved = self.save_steps > 0 and step % self.save_steps == 0
        return bool(self.prompts) and ("eval_loss" in metrics or saved or step >= trainer.total_steps)

    def on_train_begin(self, trainer):
        state = trainer.parallel_state
        if self.prompts and (state.tp_size > 1 or state.sp_size > 1):
            logger.warning("train.eval_prompts: not generated with tp_size or sp_size > 1 (each rank holds a part)")
            self.prompts = []
        if self.prompts and trainer.tokenizer is None:
            logger.warning("train.eval_prompts: this trainer has no text tokenizer (e.g. a processor): not generated")
            self.prompts = []

    def on_step_end(self, trainer, metrics):
        if not self.due(trainer, metrics):
            return
        from ..models.generate import reply  # (not at import: the planner's callbacks import this module)

        model, tokenizer, template = trainer.model, trainer.tokenizer, trainer.training_chat_template
        synced = dist.is_initialized() and dist.get_world_size() > 1
        samples = []
        model.eval()
        try:
            for prompt in self.prompts:
                chat = [{"role": "user", "content": prompt}]
                response = reply(
                    model, tokenizer, chat, self.max_new_tokens, chat_template=template, synced_gpus=synced
                )
                samples.append({"prompt": prompt, "response": response})
        finally:
            model.train()
        metrics["samples"] = samples
        if trainer.is_main:
            for sample in samples:
                logger.info(f"step {metrics['step']} sample: {sample['prompt']!r} -> {sample['response']!r}")


class SummaryCallback(Callback):
    """Rank 0, at the end: one line with the steps, tokens and time of this run, the final train loss, the final and
    best eval loss, and where the checkpoints and the HF export are."""

    def __init__(self, metrics: MetricsFileCallback, best: BestEvalCallback, progress: ProgressCallback):
        self.metrics, self.best, self.progress = metrics, best, progress  # (the progress bar times the run)

    def on_train_end(self, trainer):
        if not self.metrics.history:
            return
        last = self.metrics.history[-1]
        evals = [m for m in self.metrics.history if "eval_loss" in m]
        parts = [
            f"run summary: steps {self.progress.first_step + 1}..{trainer.global_step} of {trainer.total_steps}",
            f"{trainer.state.consumed_tokens:,} tokens in total",
            f"{_clock(time.perf_counter() - self.progress.start)}",
            f"final train loss {last['loss']:.4f}",
        ]
        if evals:
            best = min(evals, key=lambda m: m["eval_loss"])
            parts.append(
                f"eval loss {evals[-1]['eval_loss']:.4f} (best {best['eval_loss']:.4f} at step {best['step']})"
            )
        parts.append(f"checkpoints in {trainer.checkpointer.root}")
        if self.best.keep_best and self.best.best_step is not None:
            parts.append(f"best checkpoint global_step_{self.best.best_step}")
        hf = os.path.join(trainer.output_dir, "hf")
        if os.path.isdir(hf):
            parts.append(f"HF export in {hf} (talk to it: python -m veomni.chat {trainer.output_dir})")
        logger.info("; ".join(parts))


def standard_callbacks(trainer) -> List[Callback]:
    """The callbacks every run has (`BaseTrainer.build_callbacks`): eval_prompts samples and the best eval loss
    (every rank); on rank 0 metrics.jsonl, progress, those asked for of loss.png, wandb and TensorBoard, then the
    summary. Order matters: what adds to a step's metrics (samples) comes before what writes them."""
    args, out = trainer.args, trainer.output_dir
    train, ckpt = args.train, args.train.checkpoint
    best = BestEvalCallback(ckpt.keep_best, train.early_stopping_patience, ckpt.save_steps, out, trainer.is_main)
    every_rank = [SampleGenerationCallback(train.eval_prompts, train.eval_max_new_tokens, ckpt.save_steps), best]
    if not trainer.is_main:
        return every_rank
    plot = os.path.join(out, "loss.png") if train.loss_plot else None
    metrics = MetricsFileCallback(os.path.join(out, "metrics.jsonl"), plot)
    progress = ProgressCallback(train.log_steps)
    sinks = [progress, metrics]  # (the bar closes before the plot is announced)
    if train.wandb.enable:
        wandb = train.wandb
        sinks.append(WandbCallback(wandb.project, wandb.name, wandb.mode, dataclasses.asdict(args), out))
    if train.use_tensorboard:
        sinks.append(TensorBoardCallback(os.path.join(out, "tensorboard")))
    return every_rank + sinks + [SummaryCallback(metrics, best, progress)]
