"""Under torchrun (2 or 4 ranks): Muon (+ AdamW) on FSDP2 / FSDP2 + EP trains exactly like one process.

argv: dense_model_dir moe_model_dir uneven_moe_model_dir case [case ...]; a case is NAME or NAME:STRATEGY
(STRATEGY: owner, the default, or all_gather). Cases:
    fsdp_dense   dense model, FSDP2 over all ranks        -> hidden matrices take fsdp_gather_2d
    fsdp_moe     MoE model, FSDP2 only (no EP)            -> experts Shard(0) over dp: moe_local_3d
    ep           MoE, EP 2 (x ep_fsdp = world / 2)        -> experts moe_local_3d (ep_fsdp 1) / moe_gather_3d
    ep_zero      as ep with muon_expert_zero_comm         -> experts moe_local_3d
    ep_uneven    6 experts, EP 2 x ep_fsdp 2, zero_comm   -> warning, falls back to moe_gather_3d (no training)
Rank 0 trains each model alone (plain tensors, the `local` path) on the whole batch as the reference; every case
must match it: loss and grad norm of 10 steps within 1e-5, every parameter after 10 steps within 1e-5.
"""

import logging
import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from veomni.distributed import clip_grad_norm, destroy_parallel_state, init_parallel_state
from veomni.distributed.torch_parallelize import build_parallelize_model
from veomni.models import build_foundation_model
from veomni.ops import lm_loss_sum, shift_labels
from veomni.optim import build_optimizer

STEPS, ROWS, SEQ = 10, 4, 32
OPT = dict(lr=1e-3, weight_decay=0.1, optimizer_type="muon", muon_lr=0.02, muon_weight_decay=0.01)
LAYERS = {"dense": "Qwen2DecoderLayer", "moe": "Qwen3MoeDecoderLayer"}


def batch(step):
    return torch.randint(3, 96, (ROWS, SEQ), generator=torch.Generator().manual_seed(1000 + step))


def build(model_dir, kind):
    torch.manual_seed(0)
    impl = {"moe_implementation": "fused"} if kind == "moe" else {}
    return build_foundation_model(model_dir, torch_dtype="float32", **impl)


def train(model, opt, dp_rank, dp_size):
    """The trainer's step: sum CE * dp / global tokens, backward, clip to 1.0, step."""
    losses, norms = [], []
    for step in range(STEPS):
        ids = batch(step).chunk(dp_size)[dp_rank]
        loss_sum, _ = lm_loss_sum(model(input_ids=ids, use_cache=False).logits, shift_labels(ids))
        total = ROWS * (SEQ - 1)  # every label counts: the global token count is known
        (loss_sum * dp_size / total).backward()
        norms.append(clip_grad_norm(model, 1.0))
        loss_sum = loss_sum.detach().clone()
        if dp_size > 1:
            dist.all_reduce(loss_sum)
        losses.append(loss_sum.item() / total)
        opt.step()
        opt.zero_grad()
    return losses, norms


def reference(model_dir, kind):
    model = build(model_dir, kind)
    losses, norms = train(model, build_optimizer(model, **OPT), 0, 1)
    return losses, norms, {n: p.detach().clone() for n, p in model.named_parameters()}


def expected_path(case, world, name, param):
    if param.ndim == 2:
        return "fsdp_gather_2d"
    if case == "ep" and world == 4 or case == "ep_uneven":
        return "moe_gather_3d"
    return "moe_local_3d"


def close(a, b, what):
    assert abs(a - b) <= 1e-5 * max(abs(a), abs(b)), f"{what}: {a!r} vs {b!r}"


def run_case(case, strategy, dirs, refs, warnings):
    world, rank = dist.get_world_size(), dist.get_rank()
    kind = "dense" if case == "fsdp_dense" else "moe"
    model_dir = dirs["uneven"] if case == "ep_uneven" else dirs[kind]
    ep = case.startswith("ep")
    state = init_parallel_state(**(dict(extra_parallel_sizes=[2], extra_parallel_names=["ep"]) if ep else {}))
    model = build_parallelize_model(
        build(model_dir, kind), basic_modules=[LAYERS[kind]], expert_zero_comm=case in ("ep_zero", "ep_uneven")
    )
    muon_kw = dict(muon_expert_zero_comm=case in ("ep_zero", "ep_uneven"), strategy=strategy)
    opt = build_optimizer(model, **OPT, **muon_kw)
    muon = opt.optimizers_dict["muon"]
    in_muon = {id(p) for p in muon.param_groups[0]["params"]}
    paths = {}
    for name, p in model.named_parameters():
        if id(p) in in_muon:
            paths[name] = muon.path_of(p)
            want = expected_path(case, world, name, p)
            assert paths[name] == want, f"{case}: {name} took {paths[name]}, expected {want}"
    if case == "ep_uneven":
        assert any("do not split evenly" in w for w in warnings), warnings
        assert any("muon_expert_zero_comm is on but 4 expert stacks" in w for w in warnings), warnings
        print(f"MUON_CASE_OK {case} world={world} falls back with a warning", flush=True)
        return
    losses, norms = train(model, opt, state.dp_rank, state.dp_size)
    full = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach() for n, p in model.named_parameters()}
    if rank == 0:
        ref_losses, ref_norms, ref_params = refs[kind]
        for s in range(STEPS):
            close(losses[s], ref_losses[s], f"{case} loss step {s + 1}")
            close(norms[s], ref_norms[s], f"{case} grad norm step {s + 1}")
        for n, want in ref_params.items():
            torch.testing.assert_close(full[n], want, rtol=0, atol=1e-5, msg=lambda m, n=n: f"{case} {n}: {m}")
        moved = max((full[n] - p).abs().max().item() for n, p in build(model_dir, kind).named_parameters())
        assert moved > 1e-3, f"{case}: parameters barely moved ({moved})"
    counts = {path: list(paths.values()).count(path) for path in sorted(set(paths.values()))}
    dist.barrier()  # no rank reports success before rank 0 has compared with the reference
    print(f"MUON_CASE_OK {case}:{strategy} world={world} paths={counts} loss={losses[-1]:.6f}", flush=True)


class _Capture(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def main(dense_dir, moe_dir, uneven_dir, *cases):
    dist.init_process_group("gloo")
    capture = _Capture()
    for name in ("veomni.distributed.fsdp", "veomni.optim.optimizer"):  # they do not propagate
        logging.getLogger(name).addHandler(capture)
    dirs = {"dense": dense_dir, "moe": moe_dir, "uneven": uneven_dir}
    refs = {}
    if dist.get_rank() == 0:  # the single-process runs, plain tensors only: no collective
        kinds = {"dense" if c.startswith("fsdp_dense") else "moe" for c in cases if not c.startswith("ep_uneven")}
        refs = {kind: reference(dirs[kind], kind) for kind in sorted(kinds)}
    for case in cases:
        name, _, strategy = case.partition(":")
        run_case(name, strategy or "owner", dirs, refs, capture.messages)
    destroy_parallel_state()


if __name__ == "__main__":
    main(*sys.argv[1:])
