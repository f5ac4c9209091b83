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
from typing import Any, Callable, Dict

import torch
import torch.distributed as dist

from ..data import Batching, build_dataset, build_loader
from ..data.data_transform import IGNORE_INDEX
from . import lifecycle


def build_eval_loader(args, transform, collate_fn: Callable):
    """(dataset, loader, collator) of `data.eval_path`: one process's plan, every micro-batch of it (dealt
    round-robin to the ranks by the Evaluator), collated by the training collator `collate_fn`."""
    skip = ("dataloader", "mm_configs", "train_path", "datasets_type")
    data = {k: v for k, v in vars(args.data).items() if k not in skip}
    dataset = build_dataset(
        dataset_name="mapping", train_path=args.data.eval_path, transform=transform, seed=args.train.seed, **data
    )
    train = args.train
    batching = Batching(train.micro_batch_size, args.data.max_seq_len, dyn_bsz=train.dyn_bsz, drop_last=False)
    loader = build_loader(dataset, collate_fn, batching, dp_rank=0, dp_size=1, seed=train.seed, shuffle=False)
    return dataset, loader, collate_fn


class Evaluator:
    """Runs the held-out set through `stats(micro_batch)`: a float64 vector on the device, sums over the micro-batch
    of the statistics `names`, then the count they are averaged over (`unit`: loss tokens, or pairs for a preference
    loss). `evaluate` reports each as `eval_<name>` (its mean over the held-out set) and the count as `eval_<unit>`."""

    def __init__(self, dataset, loader, collate, stats: Callable, names, unit, model, parallel_state, device, steps):
        self.dataset, self.loader, self.collate = dataset, loader, collate
        self.stats, self.names, self.unit = stats, names, unit
        self.model, self.parallel_state, self.device, self.eval_steps = model, parallel_state, device, steps

    def due(self, global_step: int, total_steps: int) -> bool:
        """Every eval_steps and after the last step, on every rank alike."""
        every = self.eval_steps
        return global_step >= total_steps or (every > 0 and global_step % every == 0)

    def evaluate(self, global_step: int) -> Dict[str, Any]:
        """The means over the whole held-out set (with the token-weighted LM loss, its perplexity). Collective."""
        *sums, count = self._held_out_sums(global_step).tolist()
        out = {f"eval_{name}": value / max(count, 1) for name, value in zip(self.names, sums)}
        out[f"eval_{self.unit}"] = int(count)
        if self.unit == "tokens":
            out["eval_ppl"] = math.exp(min(out["eval_loss"], 700.0))
        return out

    def _held_out_sums(self, global_step: int) -> torch.Tensor:
        """`stats` summed over the held-out set and all data- and sequence-parallel ranks. Collective:
        every rank runs one forward per round while any rank has a micro-batch, then one all-reduce."""
        state = self.parallel_state
        sums = torch.zeros(len(self.names) + 1, dtype=torch.float64, device=self.device)
        self.loader.set_epoch(0)
        # micro-batch i of the one-process plan goes to data-parallel rank i mod dp_size (a rank collates and drops
        # the others': held-out sets are small), so every sample is evaluated once on any number of ranks
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
                    stats = self.stats(step[0] if step else self._masked_batch())
                    if step:  # (a masked batch adds nothing, and its labels count no token)
                        sums += stats.to(sums.device)
        finally:
            self.model.train(was_training)
            self.loader.close()
        dist.all_reduce(sums, group=state.dp_sp_group)
        return sums

    def _masked_batch(self) -> Dict[str, Any]:
        """The first held-out sample with no loss token: a rank out of data joins the others' collectives with it."""
        first = self.dataset[0]
        sample = dict(first[0] if isinstance(first, list) else first)
        sample["labels"] = [IGNORE_INDEX] * len(sample["input_ids"])
        return self.collate([sample])
