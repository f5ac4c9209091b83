"""`train.eval_prompts`: the model's greedy answers to a few prompts at each eval, each checkpoint save and the last
step, through the training chat template and transformers' `generate`, in metrics.jsonl (`samples`) and the log.

Every rank generates (an FSDP-sharded model gathers its parameters in each forward, a collective), with
`synced_gpus` so that all ranks run the same number of forwards whatever each one's answer length."""

from typing import Any, Dict, List

import torch.distributed as dist

from ..models.generate import reply
from ..utils.logging import get_logger
from .callbacks import Callback

logger = get_logger(__name__)


class SampleGenerationCallback(Callback):
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
        if self.prompts and getattr(trainer, "tokenizer", None) is None:
            logger.warning("train.eval_prompts: this trainer has no text tokenizer (e.g. a processor): not generated")
            self.prompts = []

    def on_step_end(self, trainer, metrics):
        if not self.due(trainer, metrics):
            return
        model = trainer.model
        model.eval()
        try:
            samples = [
                {
                    "prompt": prompt,
                    "response": reply(
                        model,
                        trainer.tokenizer,
                        [{"role": "user", "content": prompt}],
                        self.max_new_tokens,
                        chat_template=trainer.training_chat_template,
                        synced_gpus=dist.is_initialized() and dist.get_world_size() > 1,
                    ),
                }
                for prompt in self.prompts
            ]
        finally:
            model.train()
        metrics["samples"] = samples
        if trainer.is_main:
            for sample in samples:
                logger.info(f"step {metrics['step']} sample: {sample['prompt']!r} -> {sample['response']!r}")
