"""The pair statistics DPO logs (TRL's names), and their mean over a held-out pair set.

PreferenceEvaluator walks the held-out set as Evaluator does (one process's micro-batches dealt round-robin to the
data-parallel ranks, every rank forwarding in lockstep, a rank out of data forwarding a masked copy that counts
nothing) and reports each statistic's mean over all held-out pairs with an `eval_` prefix.
"""

from typing import Any, Dict

import torch
import torch.distributed as dist

from . import lifecycle
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

    def evaluate(self, global_step: int) -> Dict[str, Any]:
        state = self.parallel_state
        sums = torch.zeros(len(STAT_NAMES) + 1, dtype=torch.float64, device=self.device)  # + the pairs
        self.loader.set_epoch(0)
        batches = (s for i, s in enumerate(self.loader) if i % state.dp_size == state.dp_rank)
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                while True:
                    lifecycle.set_progress(global_step, "evaluation")
                    step = next(batches, None)
                    have = torch.tensor([float(bool(step))], device=self.device)
                    dist.all_reduce(have, op=dist.ReduceOp.MAX, group=state.dp_sp_group)
                    if not have.item():
                        break
                    micro_batch = step[0] if step else self._masked_batch()
                    stats = self.loss_sum(micro_batch)
                    if step:  # a masked batch counts nothing
                        sums[:-1] += stats.to(sums.device)
                        sums[-1] += micro_batch["loss_units"]
        finally:
            self.model.train(was_training)
            self.loader.close()
        dist.all_reduce(sums, group=state.dp_sp_group)
        pairs = max(sums[-1].item(), 1.0)
        out = {f"eval_{name}": value / pairs for name, value in zip(STAT_NAMES, sums[:-1].tolist())}
        out["eval_pairs"] = int(sums[-1].item())
        return out
