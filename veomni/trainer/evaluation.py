"""Validation: the token-weighted loss and perplexity of held-out data (`data.eval_path`), every `train.eval_steps`
steps and at the end of training.

The held-out data is a mapping dataset read in its file order (no shuffle, no sample dropped), cut into micro-batches
as one process would cut it, the micro-batches dealt round-robin to the data-parallel ranks, so every sample is
evaluated exactly once and the micro-batches are the same whatever the number of ranks. Ranks
step through it in lockstep: while any rank still has a micro-batch, every rank runs a forward (a rank that has run
out forwards a masked copy of the first sample, which adds nothing), so FSDP's all-gathers, Ulysses' all-to-alls and
EP's dispatch see the same collectives on every rank. The loss is summed per token over all data- and
sequence-parallel ranks (each holds its own tokens: expert-parallel ranks are data ranks, a Ulysses rank holds a
slice of its group's sequence) and divided by the total loss tokens; tensor-parallel ranks hold the same tokens, so
they are not summed. The same number on 1, 2 or 4 ranks and under SP, TP and EP, up to float rounding
(tests/test_evaluation.py: within 1e-6). MoE auxiliary losses are left out: this is the language-modelling loss alone.
"""

import math
from typing import Any, Dict, Optional

import torch
import torch.distributed as dist

from ..data import build_dataloader, build_dataset
from ..data.data_collator import MainCollator
from ..data.data_transform import IGNORE_INDEX
from ..distributed.sequence_parallel import count_loss_tokens_shifted
from ..ops import count_loss_tokens
from ..utils import lifecycle
from ..utils.logging import get_logger

logger = get_logger(__name__)


class EvaluationMixin:
    """build_eval_dataloader / evaluate for BaseTrainer (uses self.model, self.args, self.parallel_state, ...)."""

    evaluating = False  # forward_loss_sum leaves auxiliary losses out while True

    def build_eval_dataloader(self):
        """The held-out data's loader, or None without data.eval_path. Call after the training loader (a VLM
        trainer's collate infos are set up there)."""
        args = self.args
        if not args.data.eval_path:
            return None
        skip = ("dataloader", "mm_configs", "train_path", "datasets_type")
        data = {k: v for k, v in vars(args.data).items() if k not in skip}
        self.eval_dataset = build_dataset(
            dataset_name="mapping", train_path=args.data.eval_path, transform=self.build_data_transform(),
            seed=args.train.seed, **data,
        )  # fmt: skip
        self._eval_collate = MainCollator(max_seq_len=args.data.max_seq_len, **self.collate_fn_kwargs())
        return build_dataloader(
            dataset=self.eval_dataset,
            micro_batch_size=args.train.micro_batch_size,
            dataloader_batch_size=1,
            max_seq_len=args.data.max_seq_len,
            dyn_bsz=args.train.dyn_bsz,
            drop_last=False,
            shuffle=False,
            seed=args.train.seed,
            collate_fn_kwargs=self.collate_fn_kwargs(),
            dp_rank=0,
            dp_size=1,
        )  # fmt: skip  (one process's plan, every micro-batch of it: dealt round-robin to the ranks in evaluate)

    def should_evaluate(self) -> bool:
        if getattr(self, "eval_dataloader", None) is None:
            return False
        every = self.args.train.eval_steps
        return self.global_step >= self.total_steps or (every > 0 and self.global_step % every == 0)

    def evaluate(self) -> Dict[str, Any]:
        """{"eval_loss", "eval_ppl", "eval_tokens"} over the whole held-out set. Collective: every rank alike."""
        state = self.parallel_state
        count = count_loss_tokens_shifted if state.sp_enabled else count_loss_tokens
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        tokens = torch.zeros((), dtype=torch.float64, device=self.device)
        self.eval_dataloader.set_epoch(0)
        # micro-batch i of the one-process plan goes to data-parallel rank i mod dp_size (a rank collates and drops
        # the others': held-out sets are small), so every sample is evaluated once on any number of ranks
        batches = (s for i, s in enumerate(self.eval_dataloader) if i % state.dp_size == state.dp_rank)
        was_training, self.evaluating = self.model.training, True
        self.model.eval()
        try:
            with torch.no_grad():
                while True:
                    lifecycle.set_progress(self.global_step, "evaluation")
                    step = next(batches, None)
                    have = torch.tensor([float(bool(step))], device=self.device)
                    dist.all_reduce(have, op=dist.ReduceOp.MAX, group=state.dp_sp_group)
                    if not have.item():
                        break
                    micro_batch = self._to_device(step[0] if step else self._masked_eval_batch())
                    loss = self.forward_loss_sum(micro_batch)
                    if step:  # (a masked batch adds nothing, and its labels count no token)
                        loss_sum += loss.double()
                        tokens += count(micro_batch["labels"])
        finally:
            self.evaluating = False
            self.model.train(was_training)
            self.eval_dataloader.close()
        totals = torch.stack([loss_sum, tokens])
        dist.all_reduce(totals, group=state.dp_sp_group)
        loss = (totals[0] / totals[1].clamp(min=1)).item()
        return {"eval_loss": loss, "eval_ppl": math.exp(min(loss, 700.0)), "eval_tokens": int(totals[1].item())}

    def _masked_eval_batch(self) -> Dict[str, Any]:
        """The first held-out sample with no loss token: a rank out of data joins the others' collectives with it."""
        first = self.eval_dataset[0]
        sample = dict(first[0] if isinstance(first, list) else first)
        sample["labels"] = [IGNORE_INDEX] * len(sample["input_ids"])
        return self._eval_collate([sample])


def eval_summary(metrics: Dict[str, Any]) -> Optional[str]:
    if "eval_loss" not in metrics:
        return None
    return f"eval loss {metrics['eval_loss']:.4f} ppl {metrics['eval_ppl']:.2f} ({metrics['eval_tokens']:,} tokens)"
