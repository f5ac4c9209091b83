"""Under torchrun (2 ranks), two checks in one launch:

1. FSDP2 over the tiny Qwen2.5-VL (vision blocks and decoder layers as their own units) trains 10 AdamW steps
   with the same losses and final weights (1e-5) as one process on the whole global batch. Some steps give rank 1
   text-only samples: it must still run the vision tower (same collectives on every rank).
2. The same, 3 steps, on the tiny Qwen2.5-Omni thinker: nested units (the audio and vision encoders around their
   own blocks), the audio tower run on a dummy clip by every rank.
3. Expert parallel 2 (FSDP2 + EP) on the tiny Qwen3-VL-MoE with the fused experts: same losses and weights as
   one process without EP, 4 steps.
4. Ulysses sequence parallel 2 on the tiny Qwen2.5-VL: both ranks train the same packed row of mixed image/text
   samples, each holding half of it (images straddle the shard border; some steps put every image in rank 0's half);
   10 AdamW steps give the same losses, grad norms and final weights (1e-5) as one process on the whole row.

Every rank builds the single-process reference itself (plain module, no collectives). Prints VLM_PARALLEL_OK.
argv: vl_config_dir moe_config_dir omni_config_dir
"""

import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from vlm_inputs import make_sample, pack  # noqa: E402

from veomni.data.data_collator import MainCollator  # noqa: E402
from veomni.distributed import destroy_parallel_state, init_parallel_state, parallel_state  # noqa: E402
from veomni.distributed.torch_parallelize import build_parallelize_model, no_split_module_names  # noqa: E402
from veomni.models import build_foundation_model  # noqa: E402
from veomni.ops import lm_loss_sum  # noqa: E402
from veomni.trainer.vlm_trainer import build_data_collate_info  # noqa: E402


def global_batches(model, steps, seed):
    """Per step 4 samples; rank r trains samples 2r, 2r+1. On odd steps rank 1's samples have no image."""
    g = torch.Generator().manual_seed(seed)
    batches = []
    for step in range(steps):
        text_only_rank1 = step % 2 == 1
        shapes = [[(4, 4)], [], [] if text_only_rank1 else [(4, 8)], [] if text_only_rank1 else [(4, 4), (4, 4)]]
        batches.append([make_sample(model, 3 + (i + step) % 5, s, g) for i, s in enumerate(shapes)])
    return batches


def loss_tokens(samples):
    batch = pack(samples)
    return int((batch["labels"] != -100).sum())


def step_loss(model, samples, scale):
    batch = pack(samples)
    labels = batch.pop("labels")
    loss_sum, _ = lm_loss_sum(model(**batch, use_cache=False).logits, labels)
    (loss_sum * scale).backward()
    return loss_sum.detach()


def full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def train_both(config_dir, moe, steps, seed, state):
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = build_foundation_model(config_dir, torch_dtype="float32", moe_implementation=moe)
    reference = build_foundation_model(config_dir, torch_dtype="float32", moe_implementation=moe)
    reference.load_state_dict(model.state_dict())
    batches = global_batches(reference, steps, seed)
    build_parallelize_model(model, basic_modules=no_split_module_names(model))
    units = [type(m).__name__ for m in model.modules() if isinstance(m, FSDPModule) and m is not model]
    assert any("Vision" in u for u in units) and any("Decoder" in u for u in units), units
    if getattr(model.model, "audio_tower", None) is not None:
        assert "FSDPQwen2_5OmniAudioEncoderLayer" in units and "FSDPQwen2_5OmniAudioEncoder" in units, units
    model.train(), reference.train()
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=2e-3, weight_decay=0.01)
    for step, samples in enumerate(batches):
        n = sum(loss_tokens(samples[2 * r : 2 * r + 2]) for r in range(world))
        ref_total = sum(step_loss(reference, samples[2 * r : 2 * r + 2], 1.0 / n) for r in range(world)) / n
        ref_opt.step()
        ref_opt.zero_grad()
        mine = step_loss(model, samples[2 * rank : 2 * rank + 2], world / n)  # FSDP averages over ranks
        dist.all_reduce(mine)
        opt.step()
        opt.zero_grad()
        assert abs(mine.item() / n - ref_total.item()) < 1e-5, (step, mine.item() / n, ref_total.item())
    ours = {k: full(v) for k, v in model.state_dict().items()}
    for key, ref in reference.state_dict().items():
        torch.testing.assert_close(ours[key], ref, atol=1e-5, rtol=1e-5, msg=key)
    return ref_total.item()


def sp_batches(model, steps, seed):
    """Per step one packed row of 4 samples. Even steps: images early, middle and late (some straddle the shard
    border); steps 1, 5, 9: one image in the first sample only (rank 1's half holds no visual token); steps 3, 7:
    one image in the last sample only (rank 0's half holds none)."""
    g = torch.Generator().manual_seed(seed)
    batches = []
    for step in range(steps):
        shapes = [[(4, 4)], [(4, 8)], [(4, 4), (4, 4)], [(4, 4)]]
        if step % 4 == 1:
            shapes = [[(4, 4)], [], [], []]
        elif step % 4 == 3:
            shapes = [[], [], [], [(4, 4)]]
        batches.append([make_sample(model, 3 + (i + step) % 5, s, g) for i, s in enumerate(shapes)])
    return batches


def grad_norm(model):
    return float(full(torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))))


def train_sequence_parallel(config_dir, steps, seed):
    """Ulysses 2 vs one process on the same rows (phase 4 of the module docstring); returns the last loss."""
    state = init_parallel_state(ulysses_size=2)
    torch.manual_seed(0)
    model = build_foundation_model(config_dir, torch_dtype="float32")
    reference = build_foundation_model(config_dir, torch_dtype="float32")
    reference.load_state_dict(model.state_dict())
    batches = sp_batches(reference, steps, seed)
    build_parallelize_model(model, basic_modules=no_split_module_names(model))
    assert model.config.text_config._attn_implementation.startswith("veomni_ulysses:")
    collate = MainCollator(collate_infos=build_data_collate_info(), sp_size=2, sp_rank=state.sp_rank)
    whole = MainCollator(collate_infos=build_data_collate_info(), sp_size=1, sp_rank=0)  # the reference's row
    model.train(), reference.train()
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=2e-3, weight_decay=0.01)
    for step, samples in enumerate(batches):
        ref_batch = whole(samples)
        ref_labels = ref_batch.pop("labels")
        ref_sum, n = lm_loss_sum(reference(**ref_batch, use_cache=False).logits, ref_labels)
        n = int(n)
        (ref_sum / n).backward()
        ref_loss = ref_sum.detach() / n
        ref_norm = grad_norm(reference)
        ref_opt.step()
        ref_opt.zero_grad()
        batch = collate(samples)
        labels = batch.pop("labels")
        loss_sum, _ = lm_loss_sum(model(**batch, use_cache=False).logits, labels)
        (loss_sum * state.sp_size / n).backward()  # FSDP averages over the dp x sp ranks
        mine = loss_sum.detach()
        dist.all_reduce(mine, group=state.sp_group)
        norm = grad_norm(model)
        opt.step()
        opt.zero_grad()
        assert abs(mine.item() / n - ref_loss.item()) < 1e-5, (step, mine.item() / n, ref_loss.item())
        assert abs(norm - ref_norm) < 1e-5 * max(1.0, ref_norm), (step, norm, ref_norm)
    ours = {k: full(v) for k, v in model.state_dict().items()}
    for key, ref in reference.state_dict().items():
        torch.testing.assert_close(ours[key], ref, atol=1e-5, rtol=1e-5, msg=lambda m, key=key: f"{key}: {m}")
    return ref_loss.item()


def main(vl_dir, moe_dir, omni_dir):
    state = init_parallel_state()
    last = train_both(vl_dir, "eager", 10, 7, state)
    print(f"FSDP_VL_OK rank={dist.get_rank()} last_loss={last:.6f}", flush=True)
    last = train_both(omni_dir, "eager", 3, 9, state)
    print(f"FSDP_OMNI_OK rank={dist.get_rank()} last_loss={last:.6f}", flush=True)
    # new meshes on the same default process group: destroying and re-creating the group in one process can hang
    # in gloo's rendezvous (the new group reads the old group's addresses from the store)
    parallel_state._PARALLEL_STATE = None
    state = init_parallel_state(extra_parallel_sizes=[2], extra_parallel_names=["ep"])
    last = train_both(moe_dir, "fused", 4, 8, state)
    print(f"EP_VL_MOE_OK rank={dist.get_rank()} last_loss={last:.6f}", flush=True)
    parallel_state._PARALLEL_STATE = None
    last = train_sequence_parallel(vl_dir, 10, 11)
    print(f"SP_VL_OK rank={dist.get_rank()} last_loss={last:.6f}", flush=True)
    destroy_parallel_state()
    print("VLM_PARALLEL_OK", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3])
