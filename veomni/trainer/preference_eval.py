"""The pair statistics DPO logs (TRL's names), and their mean over a held-out pair set.

PreferenceEvaluator walks the held-out set as Evaluator does (one process's micro-batches dealt round-robin to the
data-parallel ranks, every rank forwarding in lockstep, a rank out of data forwarding a masked copy that counts
nothing) and reports each statistic's mean over all held-out pairs with an `eval_` prefix.
"""

from typing import Any, Dict

import torch

from .evaluation import Evaluator

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
    """Sums over the pairs of [loss, rewards/chosen, rewards/rejected, rewards/accuracies, rewards/margins,
    logps/chosen, logps/rejected] (float64, detached); rewards are beta * (policy - reference) log-probs."""
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


class PreferenceEvaluator(Evaluator):
    """`loss_sum(micro_batch)` here returns the micro-batch's pair statistics (pair_stats, counted once per
    sequence-parallel group)."""

    stat_width = len(STAT_NAMES) + 1  # + the pairs

    def evaluate(self, global_step: int) -> Dict[str, Any]:
        sums = self._held_out_sums(global_step)
        pairs = max(sums[-1].item(), 1.0)
        out = {f"eval_{name}": value / pairs for name, value in zip(STAT_NAMES, sums[:-1].tolist())}
        out["eval_pairs"] = int(sums[-1].item())
        return out

    def _micro_batch_stats(self, micro_batch: Dict[str, Any]) -> torch.Tensor:
        stats = self.loss_sum(micro_batch).double()
        return torch.cat([stats, stats.new_tensor([micro_batch["loss_units"]])])
