"""Under torchrun: a MultiOptimizer (two AdamW over disjoint parameters, and Muon + AdamW from build_optimizer) on
an FSDP2 model survives a DCP save/load and an offload/onload round trip exactly. argv: model_dir, output dir."""

import sys

import torch

from veomni.checkpoint import Checkpointer
from veomni.distributed import destroy_parallel_state, init_parallel_state
from veomni.distributed.offload import load_veomni_optimizer, offload_veomni_optimizer
from veomni.distributed.torch_parallelize import build_parallelize_model
from veomni.models import build_foundation_model
from veomni.optim import MultiOptimizer, build_optimizer


def build(model_dir, kind):
    torch.manual_seed(0)
    model = build_foundation_model(model_dir, torch_dtype="float32")
    model = build_parallelize_model(model, basic_modules=["Qwen2DecoderLayer"])
    if kind == "muon":
        return model, build_optimizer(model, lr=3e-3, weight_decay=0.1, optimizer_type="muon", muon_weight_decay=0.01)
    matrices = [p for p in model.parameters() if p.ndim == 2]
    vectors = [p for p in model.parameters() if p.ndim < 2]
    opt = MultiOptimizer(
        {
            "matrices": torch.optim.AdamW(matrices, lr=1e-2, weight_decay=0.1),
            "vectors": torch.optim.AdamW(vectors, lr=3e-3),
        }
    )
    return model, opt


def step(model, opt, seed):
    ids = torch.randint(3, 500, (2, 32), generator=torch.Generator().manual_seed(seed))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def check(model_dir, out, kind):
    model, opt = build(model_dir, kind)
    for s in range(3):
        step(model, opt, s)
    ckpt = Checkpointer(out)
    ckpt.save(3, model, opt, extra_state={}, meta={"dp_size": 2})
    offload_veomni_optimizer(opt)
    load_veomni_optimizer(opt)
    expected = [step(model, opt, s) for s in range(3, 6)]

    model2, opt2 = build(model_dir, kind)
    ckpt.load(f"{out}/checkpoints/global_step_3", model2, opt2)
    got = [step(model2, opt2, s) for s in range(3, 6)]
    assert got == expected, (got, expected)
    assert all(len(inner.state) > 0 for inner in opt2.optimizers_dict.values())
    return expected


def main(model_dir, out):
    init_parallel_state()
    results = {kind: check(model_dir, f"{out}/{kind}", kind) for kind in ("adamw", "muon")}
    print(f"MULTI_OPTIMIZER_OK {results}", flush=True)  # one line per rank
    destroy_parallel_state()


if __name__ == "__main__":
    main(*sys.argv[1:])
