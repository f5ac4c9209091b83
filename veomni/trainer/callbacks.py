"""What a run shows and leaves behind: a progress bar, metrics.jsonl, optional wandb/TensorBoard, loss.png.

Every callback is a no-op on ranks other than 0, so the trainer calls them unconditionally.
"""

import json
import os
from typing import Any, Dict, List, Optional

from ..utils.logging import get_logger

logger = get_logger(__name__)


class Callback:
    def on_train_begin(self, trainer) -> None: ...

    def on_step_end(self, trainer, metrics: Dict[str, Any]) -> None: ...

    def on_train_end(self, trainer) -> None: ...


class ProgressCallback(Callback):
    """tqdm bar over optimizer steps, with loss and lr, on rank 0."""

    def __init__(self, enabled: bool, log_steps: int = 1):
        self.enabled, self.log_steps, self.bar = enabled, max(log_steps, 1), None

    def on_train_begin(self, trainer):
        if self.enabled:
            import sys

            from tqdm import tqdm

            # in a log file (CI, nohup) a redrawn bar is noise: keep only the periodic metric lines
            self.bar = tqdm(
                total=trainer.total_steps,
                initial=trainer.global_step,
                desc="train",
                dynamic_ncols=True,
                disable=not sys.stderr.isatty(),
            )

    def on_step_end(self, trainer, metrics):
        if self.bar is None:
            return
        self.bar.update(1)
        self.bar.set_postfix(
            loss=f"{metrics['loss']:.4f}", lr=f"{metrics['lr']:.2e}", tok_s=f"{metrics['tokens_per_sec']:.0f}"
        )
        if metrics["step"] % self.log_steps == 0 or metrics["step"] == trainer.total_steps:
            self.bar.write(
                f"step {metrics['step']}: loss {metrics['loss']:.4f} grad_norm {metrics['grad_norm']:.3f} "
                f"lr {metrics['lr']:.3e} {metrics['tokens_per_sec']:.0f} tok/s"
            )

    def on_train_end(self, trainer):
        if self.bar is not None:
            self.bar.close()


class MetricsFileCallback(Callback):
    """One JSON object per optimizer step, appended (a resumed run continues the same file)."""

    def __init__(self, enabled: bool, path: str):
        self.enabled, self.path = enabled, path
        self.history: List[Dict[str, Any]] = []

    def on_train_begin(self, trainer):
        if self.enabled and os.path.isfile(self.path):
            with open(self.path) as f:
                self.history = [json.loads(line) for line in f if line.strip()]
            # a resumed run rewrites the steps after its checkpoint
            self.history = [m for m in self.history if m["step"] <= trainer.global_step]
            with open(self.path, "w") as f:
                f.writelines(json.dumps(m) + "\n" for m in self.history)

    def on_step_end(self, trainer, metrics):
        if not self.enabled:
            return
        self.history.append(metrics)
        with open(self.path, "a") as f:
            f.write(json.dumps(metrics) + "\n")


class LossPlotCallback(Callback):
    """loss.png beside metrics.jsonl at the end of training."""

    def __init__(self, enabled: bool, metrics: MetricsFileCallback, path: str):
        self.enabled, self.metrics, self.path = enabled, metrics, path

    def on_train_end(self, trainer):
        if not self.enabled or not self.metrics.history:
            return
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        steps = [m["step"] for m in self.metrics.history]
        fig, ax = plt.subplots(figsize=(7, 4))
        ax.plot(steps, [m["loss"] for m in self.metrics.history], label="train loss")
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(self.path, dpi=100)
        plt.close(fig)
        logger.info(f"loss curve written to {self.path}")


class WandbCallback(Callback):
    def __init__(self, enabled: bool, project: str, name: Optional[str], mode: str, config: Dict[str, Any], out: str):
        self.enabled, self.run = enabled, None
        self.kwargs = dict(project=project, name=name, mode=mode, config=config, dir=out)

    def on_train_begin(self, trainer):
        if not self.enabled:
            return
        try:
            import wandb
        except ImportError:
            raise ImportError("train.wandb.enable needs wandb: pip install wandb") from None
        self.run = wandb.init(**self.kwargs)

    def on_step_end(self, trainer, metrics):
        if self.run is not None:
            self.run.log(metrics, step=metrics["step"])

    def on_train_end(self, trainer):
        if self.run is not None:
            self.run.finish()


class TensorBoardCallback(Callback):
    def __init__(self, enabled: bool, log_dir: str):
        self.enabled, self.log_dir, self.writer = enabled, log_dir, None

    def on_train_begin(self, trainer):
        if self.enabled:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise ImportError("train.use_tensorboard needs tensorboard: pip install tensorboard") from None
            self.writer = SummaryWriter(self.log_dir)

    def on_step_end(self, trainer, metrics):
        if self.writer is not None:
            for key, value in metrics.items():
                if isinstance(value, (int, float)) and key != "step":
                    self.writer.add_scalar(f"train/{key}", value, metrics["step"])

    def on_train_end(self, trainer):
        if self.writer is not None:
            self.writer.close()
