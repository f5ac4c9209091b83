"""Under torchrun (2 ranks): a hub checkpoint (transformers' `save_pretrained`) loads into a sharded model equal to
`from_pretrained`, and both the live export and the DCP checkpoint's export write back exactly the hub folder's keys
and tensors. argv: OUT, then cases FAMILY:LAYOUT:READ, checked one after another in this launch:
LAYOUT fsdp2 | ep2 (expert parallel 2) | tp2 (tensor parallel 2); READ broadcast (rank 0 reads) | local (each rank
reads its own slices)."""

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: hf_families

from hf_families import transformers_load, write_checkpoint  # noqa: E402

from veomni.checkpoint import Checkpointer, dcp_to_hf, save_hf_model  # noqa: E402
from veomni.checkpoint.hf_export import architecture_of, export_config  # noqa: E402
from veomni.distributed import destroy_parallel_state, init_parallel_state  # noqa: E402
from veomni.distributed.torch_parallelize import build_parallelize_model, no_split_module_names  # noqa: E402
from veomni.models import build_foundation_model  # noqa: E402
from veomni.models.loader import CheckpointFiles  # noqa: E402
from veomni.optim import build_optimizer  # noqa: E402

LAYOUTS = {
    "fsdp2": {},
    "ep2": dict(extra_parallel_sizes=[2], extra_parallel_names=["ep"]),
    "tp2": dict(tp_size=2, dp_shard_size=1),
}


def full_state(model):
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu() for k, v in model.state_dict().items()}


def folder_tensors(folder: str):
    with CheckpointFiles(folder) as files:
        return {key: files.read(key) for key in files.keys()}


def assert_same(got: dict, want: dict, what: str) -> None:
    assert sorted(got) == sorted(want), f"{what}: keys differ: {sorted(set(got) ^ set(want))[:6]}"
    unequal = [k for k in want if got[k].dtype != want[k].dtype or not torch.equal(got[k], want[k])]
    assert not unequal, f"{what}: tensors differ: {unequal[:4]}"


def check(out: str, family: str, layout: str, read: str) -> None:
    init_parallel_state(**LAYOUTS[layout])
    rank = dist.get_rank()
    hub = os.path.join(out, f"hub_{family}")
    if rank == 0 and not os.path.isdir(hub):
        write_checkpoint(family, hub, max_shard_size="300KB")
    dist.barrier()
    moe = "fused" if layout == "ep2" else None
    model = build_foundation_model(hub, hub, init_device="meta", torch_dtype="float32", moe_implementation=moe)
    model = build_parallelize_model(
        model,
        init_device="meta",
        weights_path=hub,
        basic_modules=no_split_module_names(model),
        broadcast_model_weights_from_rank0=read == "broadcast",
        max_load_broadcast_size=100_000,  # many chunks
    )
    case = f"{family}:{layout}:{read}"
    assert_same(full_state(model), transformers_load(family, hub).state_dict(), f"{case} loaded")

    live = os.path.join(out, f"live_{family}_{layout}_{read}")
    save_hf_model(model, live, max_shard_bytes=400_000)
    run = os.path.join(out, f"run_{family}_{layout}_{read}")
    optimizer = build_optimizer(model, lr=1e-3)

    def attach(folder):  # as the trainer attaches it: what an HF export needs
        export_config(model.config, os.path.join(folder, "hf_config"), architecture_of(model))

    path = Checkpointer(run).save(1, model, optimizer, {}, {}, attach=attach)
    if rank == 0:
        hub_tensors = folder_tensors(hub)
        assert_same(folder_tensors(live), hub_tensors, f"{case} live export")
        merged = dcp_to_hf(path, os.path.join(out, f"dcp_{family}_{layout}_{read}"), max_shard_bytes=400_000)
        assert_same(folder_tensors(merged), hub_tensors, f"{case} DCP export")
    dist.barrier()
    print(f"HF_ROUND_TRIP_OK {case}", flush=True)


def main(out: str, *cases: str) -> None:
    try:
        for case in cases:
            check(out, *case.split(":"))
    finally:
        destroy_parallel_state()


if __name__ == "__main__":
    main(*sys.argv[1:])
