"""DPOTrainer: preference tuning (DPO / IPO) on the text trainer's loop, data cache, packing and checkpoints.

A pair is one sample of the data pipeline (veomni.data.preference), so packing, the data cache, the batch plan and
its resume are the SFT ones; a micro-batch holds whole pairs, its chosen and rejected sequences as separate documents.
The step's normalisation unit is the pair instead of the token: the collator reports each micro-batch's pairs as its
`loss_units`, so the loop's global count (all-reduced over every rank, once per step) is the step's pairs and every
pair weighs the same whatever the packing, the micro-batches or the layout:

    loss(step) = sum over the step's pairs of preference_loss(pair) / pairs(step)

Each rank returns its micro-batch's summed pair losses divided by its sequence-parallel size (the per-sequence sums
are all-reduced over the Ulysses group, forward and backward: veomni.ops.preference_loss), so the loop's token-sum
machinery (scale dp*sp / N, FSDP's average over dp*sp) gives the exact mean-over-pairs gradient. The reference
log-probs come from veomni.trainer.dpo_reference (`dpo.reference`). The TRL metrics (rewards/chosen,
rewards/rejected, rewards/accuracies, rewards/margins, logps/chosen, logps/rejected) are pair means of the step,
logged beside loss and grad_norm (metrics.jsonl, the plot, wandb, TensorBoard), and the same over `data.eval_path`
with an `eval_` prefix.
"""

from functools import partial
from typing import Any, Dict, List

import torch
import torch.distributed as dist

from ..data.preference import PreferenceCollator, process_preference_example
from ..models import build_tokenizer
from ..ops.preference_loss import SequenceLogps, preference_loss, split_pairs
from .dpo_reference import build_reference, sequence_logps
from .evaluation import Evaluator
from .text_trainer import TextTrainer, conversation_keys

STAT_NAMES = (
    "loss",
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
)


def pair_stats(losses, chosen, rejected, ref_chosen, ref_rejected, beta: float) -> torch.Tensor:
    """Sums over the pairs of STAT_NAMES (float64, detached); rewards are beta * (policy - reference) log-probs."""
    chosen_rewards = beta * (chosen - ref_chosen).detach()
    rejected_rewards = beta * (rejected - ref_rejected).detach()
    values = (
        losses.detach(),
        chosen_rewards,
        rejected_rewards,
        (chosen_rewards > rejected_rewards).float(),
        chosen_rewards - rejected_rewards,
        chosen.detach(),
        rejected.detach(),
    )
    return torch.stack([v.double().sum() for v in values])


class DPOTrainer(TextTrainer):
    """`args` is a DPOVeOmniArguments (its `dpo` group: beta, loss_type, label_smoothing, reference)."""

    non_model_keys = TextTrainer.non_model_keys + (
        "sequence_index", "num_pairs", "loss_units", "pair_keys", "num_targets",
    )  # fmt: skip

    def build_data_transform(self):
        data = self.args.data
        self.tokenizer = build_tokenizer(self.args.model.tokenizer_path, self.args.model.trust_remote_code)
        return partial(
            process_preference_example,
            tokenizer=self.tokenizer,
            chat_template=self.conversation_template(last_turn_only=True),  # the response: only it carries log-probs
            max_seq_len=data.max_seq_len,
            text_keys=conversation_keys(data),
        )

    def build_collator(self):
        return PreferenceCollator(super().build_collator())

    def build_evaluator(self, dataset, loader, collate):
        """The pair statistics' means over the held-out pairs (eval_loss, eval_rewards/accuracies, ..., eval_pairs)."""

        def stats(micro_batch):  # [STAT_NAMES sums (once per sequence-parallel group), pairs]
            with torch.no_grad():
                sums = self.dpo_forward(self._to_device(micro_batch))[1]
            return torch.cat([sums, sums.new_tensor([micro_batch["loss_units"]])])

        state, steps = self.parallel_state, self.args.train.eval_steps
        return Evaluator(dataset, loader, collate, stats, STAT_NAMES, "pairs", self.model, state, self.device, steps)

    def build_model(self) -> None:
        super().build_model()
        state = self.parallel_state
        chunk = self.args.model.ops_implementation.loss_chunk_size
        self.sp_group = state.sp_group if state.sp_enabled else None
        self.sequence_logps = SequenceLogps(self.model, chunk, self.sp_group)
        self.reference = build_reference(self, chunk)  # before the checkpoint's resume: the initial policy
        self.dpo_stats = torch.zeros(len(STAT_NAMES), dtype=torch.float64, device=self.device)

    # -------------------------------------------------------------------------------------------- step
    def dpo_forward(self, micro_batch: Dict[str, Any]):
        """(summed pair losses of the micro-batch, its pair statistics [len(STAT_NAMES)] counted once per
        sequence-parallel group) on the device."""
        dpo = self.args.dpo
        inputs = {k: v for k, v in micro_batch.items() if k not in self.non_model_keys}
        logps, tokens, _ = sequence_logps(self.sequence_logps, micro_batch, inputs)
        with torch.no_grad():
            ref_logps = self.reference(micro_batch, inputs)
        chosen, rejected = split_pairs(logps)
        ref_chosen, ref_rejected = split_pairs(ref_logps.to(logps.dtype))
        chosen_tokens, rejected_tokens = split_pairs(tokens)
        losses = preference_loss(
            chosen, rejected, ref_chosen, ref_rejected, dpo.beta, dpo.loss_type, dpo.label_smoothing,
            chosen_tokens, rejected_tokens,
        )  # fmt: skip
        counted = float(self.parallel_state.sp_rank == 0)  # each pair once over its sequence-parallel group
        stats = pair_stats(losses, chosen, rejected, ref_chosen, ref_rejected, dpo.beta) * counted
        return losses.sum() / self.parallel_state.sp_size, stats

    def forward_loss_sum(self, micro_batch: Dict[str, Any]) -> torch.Tensor:
        loss_sum, stats = self.dpo_forward(micro_batch)
        self.dpo_stats += stats
        return loss_sum

    def train_step(self, micro_batches: List[Dict[str, Any]], totals: Dict[str, Any]) -> Dict[str, Any]:
        self.dpo_stats.zero_()
        metrics = super().train_step(micro_batches, totals)
        stats = self.dpo_stats.clone()
        dist.all_reduce(stats, group=self.parallel_state.dp_sp_group)
        means = stats / max(totals["loss_tokens"], 1)  # the step's pairs (the collator's loss units)
        metrics.update({name: means[i] for i, name in enumerate(STAT_NAMES) if name != "loss"})
        return metrics

    def _finish_metrics(self, metrics: Dict[str, Any], totals: Dict[str, Any]) -> None:
        super()._finish_metrics(metrics, totals)
        metrics["pairs"] = totals["loss_tokens"]  # (the loop's "loss_tokens" counts the collator's units: pairs)
