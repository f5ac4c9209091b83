"""Under torchrun (2 ranks): the expert-parallel experts forward/backward equals the single-device computation,
with uneven per-rank counts and an expert that receives no tokens at all. argv: model_dir."""

import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from veomni.distributed import destroy_parallel_state, init_parallel_state
from veomni.distributed.parallel_plan import apply_ep
from veomni.models import build_foundation_model
from veomni.ops.moe import fused_experts_forward


def routing(rank, tokens, experts, top_k, seed):
    """Random top-k routing that never picks expert 3; rank 1 sends nothing to experts 4..7's owner but one."""
    g = torch.Generator().manual_seed(seed)
    allowed = [e for e in range(experts) if e != 3]
    if rank == 1:
        allowed = [0, 1, 2, 5]
    idx = torch.stack([torch.tensor(allowed)[torch.randperm(len(allowed), generator=g)[:top_k]] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=g)
    return idx, weights


def main(model_dir):
    state = init_parallel_state(extra_parallel_sizes=[2], extra_parallel_names=["ep"])
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = build_foundation_model(model_dir, torch_dtype="float32", moe_implementation="fused")
    reference = model.model.layers[0].mlp.experts
    full_gate_up, full_down = reference.gate_up_proj.detach().clone(), reference.down_proj.detach().clone()
    hidden = reference.gate_up_proj.shape[-1]
    experts_total = reference.num_experts

    # every rank's tokens, so each rank can compute the whole single-device reference
    inputs = []
    for r in range(world):
        g = torch.Generator().manual_seed(100 + r)
        tokens = 7 + 5 * r  # uneven
        idx, w = routing(r, tokens, experts_total, 2, 200 + r)
        inputs.append((torch.randn(tokens, hidden, generator=g), idx, w))

    ref_out, ref_grads = [], []
    for x, idx, w in inputs:
        x = x.clone().requires_grad_(True)
        out = fused_experts_forward(reference, x, idx, w)
        ref_out.append(out.detach())
    total = sum(fused_experts_forward(reference, x, idx, w).pow(2).sum() for x, idx, w in inputs)
    total.backward()
    ref_grads = [reference.gate_up_proj.grad.clone(), reference.down_proj.grad.clone()]

    owners = apply_ep(model, state)
    experts = owners[0]
    assert isinstance(experts.gate_up_proj, DTensor) and experts.gate_up_proj.to_local().shape[0] == experts_total // 2
    x, idx, w = inputs[rank]
    x = x.clone().requires_grad_(True)
    out = fused_experts_forward(experts, x, idx, w)
    torch.testing.assert_close(out, ref_out[rank], rtol=1e-6, atol=1e-6)
    out.pow(2).sum().backward()
    local = slice(rank * experts_total // 2, (rank + 1) * experts_total // 2)
    for got, ref in zip((experts.gate_up_proj.grad, experts.down_proj.grad), ref_grads):
        got = got.to_local() * 2  # the 1/ep scale, undone: FSDP over ep_fsdp would average the rest
        torch.testing.assert_close(got, ref[local], rtol=1e-5, atol=1e-6)
    assert ref_grads[0][3].abs().sum() == 0  # expert 3 got no tokens anywhere
    print(f"EXPERT_PARALLEL_OK {rank}", flush=True)
    destroy_parallel_state()


if __name__ == "__main__":
    main(sys.argv[1])
