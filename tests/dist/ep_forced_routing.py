"""Under torchrun (1, 2 or 4 ranks): the real TextTrainer (FSDP2, expert parallel when asked, real all-to-alls)
on the tiny MoE, with the router pushed through the hard cases of expert parallelism, one case per step in turn:

    one_expert         every token's first choice is expert 0; expert 7 gets no token anywhere
    receives_nothing   no token picks experts 4..7: the ranks holding them receive no rows at all
    sends_nothing      tokens of "high" documents (ids >= vocab/2) pick only experts 4..7, the others never
                       expert 3: the ep rank holding 4..7 keeps all its rows and sends none away
    natural            the router as trained (the load-balancing loss matters here)

The push is a bias of +-30 on the router logits, a function of the token ids only, so one process and any
parallel layout route every token alike. The dispatch's split sizes are recorded (the all-to-all stays the real
one) and each rank prints, per case, the rows it sent to other ranks and the rows it received.

argv: config.yaml [--overrides ...] [:: config.yaml [--overrides ...]]: trainings run in turn in one launch;
each prints one `ROUTING {json}` line per rank (with the MoE metrics' routing counts of every step).
"""

import json
import sys
import types

import torch
import torch.nn.functional as F

import veomni.ops.moe as moe
from veomni.arguments import VeOmniArguments, parse_args
from veomni.distributed import destroy_parallel_state
from veomni.trainer import TextTrainer

CASES = ("one_expert", "receives_nothing", "sends_nothing", "natural")
PUSH = 30.0


def routing_bias(input_ids: torch.Tensor, case: str, num_experts: int, vocab: int) -> torch.Tensor:
    ids = input_ids.reshape(-1)
    bias = torch.zeros(ids.shape[0], num_experts)
    half = num_experts // 2
    if case == "one_expert":
        bias[:, 0], bias[:, -1] = PUSH, -PUSH
    elif case == "receives_nothing":
        bias[:, half:] = -PUSH
    elif case == "sends_nothing":
        high = ids >= vocab // 2
        bias[high, :half] = -PUSH
        bias[~high, 3] = -PUSH
    return bias


def biased_router_forward(self, hidden_states):
    """transformers' Qwen3MoeTopKRouter.forward with the test's bias added to the logits."""
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    router_logits = F.linear(hidden_states, self.weight) + self._test_bias().to(hidden_states)
    router_probs = torch.softmax(router_logits, dtype=torch.float, dim=-1)
    top_value, top_index = torch.topk(router_probs, self.top_k, dim=-1)
    if self.norm_topk_prob:
        top_value /= top_value.sum(dim=-1, keepdim=True)
    return router_logits, top_value.to(router_logits.dtype), top_index


class ForcedRoutingTrainer(TextTrainer):
    def build_model(self):
        super().build_model()
        config = self.model.config
        self.routing = {case: {"sent_away": 0, "received": 0, "calls": 0} for case in CASES}
        self._ids = None
        self.step_counts = []  # the MoE metrics' routing counts of every step

        def bias():
            return routing_bias(self._ids, self.case, config.num_experts, config.vocab_size)

        for module in self.model.modules():
            if type(module).__name__ == "Qwen3MoeTopKRouter":
                module._test_bias = bias
                module.forward = types.MethodType(biased_router_forward, module)
        self._record_splits()

    @property
    def case(self) -> str:
        return CASES[self.global_step % len(CASES)]

    def _record_splits(self):
        """Count what the dispatch all-to-all (the first of each pair) sends away and receives."""
        real, trainer, calls = moe.all_to_all_single_autograd, self, [0]

        def recorded(tensor, output_split_sizes, input_split_sizes, group):
            calls[0] += 1
            if calls[0] % 2 == 1:  # dispatch; the even calls bring results back
                stats = trainer.routing[trainer.case]
                rank = torch.distributed.get_rank(group)
                stats["sent_away"] += sum(n for r, n in enumerate(input_split_sizes) if r != rank)
                stats["received"] += sum(output_split_sizes)
                stats["calls"] += 1
            return real(tensor, output_split_sizes, input_split_sizes, group)

        moe.all_to_all_single_autograd = recorded

    def forward_loss_sum(self, micro_batch):
        self._ids = micro_batch["input_ids"]
        return super().forward_loss_sum(micro_batch)

    def train_step(self, micro_batches, totals):
        metrics = super().train_step(micro_batches, totals)
        self.step_counts.append(self.moe_metrics.last_counts())  # [layer][expert], summed over the ranks
        return metrics


def main():
    """One training per `::`-separated group of arguments, one after the other in this process."""
    argv, runs = sys.argv[1:], []
    while "::" in argv:
        cut = argv.index("::")
        runs.append(argv[:cut])
        argv = argv[cut + 1 :]
    runs.append(argv)
    try:
        for run in runs:
            trainer = ForcedRoutingTrainer(parse_args(VeOmniArguments, run))
            trainer.fit()
            state = trainer.parallel_state
            ep_rank = state.ep_rank if state.ep_enabled else 0
            line = {"rank": torch.distributed.get_rank(), "ep_rank": ep_rank, "routing": trainer.routing}
            line["counts"] = trainer.step_counts
            sys.stdout.write(f"ROUTING {json.dumps(line)}\n")
            sys.stdout.flush()
    finally:
        destroy_parallel_state()


if __name__ == "__main__":
    main()
