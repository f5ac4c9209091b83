"""Under torchrun: a meta-built model, sharded then filled from rank 0 in small broadcast chunks, holds exactly
the weights of a plain load, and gives identical logits. argv: model_dir (config + weights), then one or more
cases MODE:BROADCAST (fsdp2:broadcast, fsdp2:local, ddp:broadcast), checked one after another in this launch."""

import sys

import torch

from veomni.distributed import destroy_parallel_state, init_parallel_state
from veomni.distributed.torch_parallelize import build_parallelize_model
from veomni.models import build_foundation_model


def full_state(model):
    return {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for k, v in model.state_dict().items()
    }


def check(model_dir: str, mode: str, broadcast: str):
    init_parallel_state(mode=mode)
    plain = build_foundation_model(model_dir, model_dir, init_device="cpu", torch_dtype="float32")
    meta = build_foundation_model(model_dir, model_dir, init_device="meta", torch_dtype="float32")
    assert all(p.is_meta for p in meta.parameters())
    meta = build_parallelize_model(
        meta,
        init_device="meta",
        weights_path=model_dir,
        basic_modules=["Qwen2DecoderLayer"],
        broadcast_model_weights_from_rank0=broadcast == "broadcast",
        max_load_broadcast_size=20_000,  # many chunks
    )
    want, got = full_state(plain), full_state(meta)
    assert want.keys() == got.keys(), set(want) ^ set(got)
    for k in want:
        assert torch.equal(want[k], got[k]), f"{k} differs"
    ids = torch.arange(3, 40).unsqueeze(0)
    with torch.no_grad():
        assert torch.equal(plain(input_ids=ids).logits, meta(input_ids=ids).logits), "logits differ"
    print(f"META_BROADCAST_OK {mode}:{broadcast} {len(want)}", flush=True)


def main(model_dir: str, *cases: str):
    try:
        for case in cases:
            check(model_dir, *case.split(":"))
    finally:
        destroy_parallel_state()


if __name__ == "__main__":
    main(*sys.argv[1:])
